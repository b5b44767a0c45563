"""compressed_mean and error_feedback against numpy references, invariants and bad input."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from tests import transform_harness as th

W = 8
SHAPES = {"w1": (40, 60), "w2": (60, 30), "b": (60,), "small": (10, 10)}
MIN_SIZE = 1000  # w1 (2400) and w2 (1800) are compressed; b (1-D) and small (100) are not.
COMPRESSED = ("w1", "w2")


def _params():
    return {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}


def np_error_feedback(grads_per_step, density, residual_dtype=np.float32):
    """Numpy EF (paper §2.2): per worker G~ = G + R; send topk(G~); R = G~ - sent, stored
    rounded to ``residual_dtype`` and read back in float32."""
    residual = {k: np.zeros((W, *SHAPES[k]), residual_dtype) for k in COMPRESSED}
    outputs = []
    for grads in grads_per_step:
        out = {}
        for name, g in grads.items():
            if name not in COMPRESSED:
                out[name] = g.astype(np.float64).mean(0)
                continue
            comp = g + residual[name].astype(np.float32)  # float32, like the transform
            sent = np.stack([th.np_topk_sparsify(comp[w], density) for w in range(W)])
            residual[name] = (comp - sent).astype(residual_dtype)
            out[name] = sent.astype(np.float64).mean(0)
        outputs.append(out)
    return outputs, residual


@pytest.fixture(scope="module")
def grads():
    return th.random_grads(np.random.default_rng(0), SHAPES, W, steps=4)


def test_error_feedback_matches_numpy_reference(grads):
    density = 0.05
    tx = rr.error_feedback(rr.compressors.topk(density), min_size=MIN_SIZE)
    outputs, state = th.run_shard_map(tx, _params(), grads)
    ref_outputs, ref_residual = np_error_feedback(grads, density)
    for out, ref in zip(outputs, ref_outputs, strict=True):
        for name in SHAPES:
            for w in range(W):  # every worker holds the same mean
                np.testing.assert_allclose(out[name][w], ref[name], rtol=1e-6, atol=1e-6)
    for name in COMPRESSED:
        # Same float32 additions and selections as numpy: residuals agree bit for bit.
        np.testing.assert_array_equal(state.residuals[name], ref_residual[name])
    assert set(state.residuals) == set(COMPRESSED)  # "b" and "small" travel dense
    np.testing.assert_array_equal(state.count, np.full(W, len(grads)))


def np_global_error_feedback(grads_per_step, density_at):
    """Numpy EF with whole-model Top-k: per worker, G~ of w1 and w2 concatenated, the
    ``density_at(t)`` share of all of it kept by magnitude (1.0: everything)."""
    residual = np.zeros((W, sum(np.prod(SHAPES[k]) for k in COMPRESSED)), np.float32)
    bounds = np.cumsum([0, *(np.prod(SHAPES[k]) for k in COMPRESSED)])
    outputs = []
    for t, grads in enumerate(grads_per_step):
        comp = np.concatenate([grads[k].reshape(W, -1) for k in COMPRESSED], 1) + residual
        sent = np.stack([th.np_topk_sparsify(comp[w], density_at(t)) for w in range(W)])
        residual = comp - sent
        out = {k: g.astype(np.float64).mean(0) for k, g in grads.items()}
        for k, start, stop in zip(COMPRESSED, bounds[:-1], bounds[1:], strict=True):
            out[k] = sent[:, start:stop].astype(np.float64).mean(0).reshape(SHAPES[k])
        outputs.append(out)
    split = {k: residual[:, a:b].reshape(W, *SHAPES[k])
             for k, a, b in zip(COMPRESSED, bounds[:-1], bounds[1:], strict=True)}  # fmt: skip
    return outputs, split


def test_whole_model_topk_matches_numpy_and_sends_the_same_bytes(grads):
    """selection_scope='global': one Top-k over every compressed leaf (after a dense step
    of a schedule), equal to numpy step by step; the bytes are one payload's."""
    density = 0.05
    compressor = rr.compressors.topk(rr.compressors.dense_warmup(1, density))
    tx = rr.error_feedback(compressor, min_size=MIN_SIZE, selection_scope="global")
    outputs, state = th.run_shard_map(tx, _params(), grads)
    ref_outputs, ref_residual = np_global_error_feedback(
        grads, lambda t: 1.0 if t == 0 else density
    )
    for out, ref in zip(outputs, ref_outputs, strict=True):
        for name in SHAPES:
            for w in range(W):
                np.testing.assert_allclose(out[name][w], ref[name], rtol=1e-6, atol=1e-6)
    for name in COMPRESSED:
        np.testing.assert_array_equal(state.residuals[name], ref_residual[name])
    n = sum(np.prod(SHAPES[k]) for k in COMPRESSED)
    dense = 4 * sum(np.prod(s) for k, s in SHAPES.items() if k not in COMPRESSED)
    k = int(np.floor(density * n))
    steps = 10
    assert tx.bytes_sent(_params(), steps) == 4 * n + 8 * k * (steps - 1) + dense * steps


def test_whole_model_topk_gives_a_leaf_of_large_gradients_more_entries():
    """A leaf whose gradients are 100x larger takes every entry of the step (per-leaf
    Top-k would send 5 % of each): the other leaf's residual is its whole gradient."""
    rng = np.random.default_rng(4)
    g = {k: rng.normal(size=(W, *s)).astype(np.float32) for k, s in SHAPES.items()}
    g["w1"] *= 100.0
    tx = rr.error_feedback(rr.compressors.topk(0.05), min_size=MIN_SIZE, selection_scope="global")
    _, state = th.run_shard_map(tx, _params(), [g])
    np.testing.assert_array_equal(state.residuals["w2"], g["w2"])
    sent_w1 = np.count_nonzero(state.residuals["w1"] == 0, axis=(1, 2))
    np.testing.assert_array_equal(sent_w1, np.full(W, int(0.05 * (2400 + 1800))))


def test_whole_model_topk_refuses_what_it_cannot_rank_together():
    params = _params()
    with pytest.raises(ValueError, match="every phase of the compressor must be topk"):
        rr.error_feedback(rr.compressors.qsgd(), selection_scope="global")
    with pytest.raises(ValueError, match="local_axis"):
        rr.error_feedback(rr.compressors.topk(0.1), local_axis="local", selection_scope="global")
    with pytest.raises(ValueError, match="'leaf' or 'global'"):
        rr.error_feedback(rr.compressors.topk(0.1), selection_scope="model")
    mixed = {**params, "w2": params["w2"].astype(jnp.bfloat16)}
    tx = rr.error_feedback(rr.compressors.topk(0.1), min_size=MIN_SIZE, selection_scope="global")
    with pytest.raises(ValueError, match="one dtype"):
        tx.plan(mixed)


def test_error_feedback_stores_residuals_in_residual_dtype(grads):
    """bfloat16 residuals: the numpy EF whose residual is rounded to bfloat16 each step."""
    density = 0.05
    tx = rr.error_feedback(
        rr.compressors.topk(density), min_size=MIN_SIZE, residual_dtype=jnp.bfloat16
    )
    outputs, state = th.run_shard_map(tx, _params(), grads)
    ref_outputs, ref_residual = np_error_feedback(grads, density, jnp.bfloat16)
    for name in COMPRESSED:
        assert state.residuals[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(state.residuals[name], ref_residual[name])
    for out, ref in zip(outputs, ref_outputs, strict=True):
        for name in SHAPES:
            np.testing.assert_allclose(out[name][0], ref[name], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="residual_dtype must be a floating dtype"):
        rr.error_feedback(rr.compressors.topk(density), residual_dtype=jnp.int8)


def test_error_feedback_conserves_mass_every_worker_every_step(grads):
    """D(P_w) + R_new = G_w + R_old for every worker and step; the output is their mean."""
    density = 0.02
    tx = rr.error_feedback(rr.compressors.topk(density), min_size=MIN_SIZE)
    residual = {k: np.zeros((W, *SHAPES[k]), np.float32) for k in COMPRESSED}
    for t in range(len(grads)):
        outs, state = th.run_shard_map(tx, _params(), grads[: t + 1])
        for name in COMPRESSED:
            r_new = state.residuals[name]
            compensated = grads[t][name] + residual[name]
            sent = compensated - r_new  # D(P_w), recovered from the invariant's other side
            n = sent[0].size
            k = max(1, int(np.floor(density * n)))
            for w in range(W):
                nz = np.flatnonzero(sent[w])
                assert nz.size == k  # exactly k entries were sent ...
                # ... carrying G~ unchanged, and nothing else was lost or invented.
                np.testing.assert_array_equal(sent[w].ravel()[nz], compensated[w].ravel()[nz])
                np.testing.assert_array_equal(r_new[w].ravel()[nz], 0.0)
            np.testing.assert_allclose(outs[-1][name][0], sent.mean(0), rtol=1e-6, atol=1e-7)
            residual[name] = r_new


@pytest.mark.parametrize("compressor", ["none", "topk_full"])
def test_lossless_compression_equals_pmean_and_keeps_zero_residuals(grads, compressor):
    comp = rr.compressors.none() if compressor == "none" else rr.compressors.topk(1.0)
    tx = rr.error_feedback(comp, min_size=MIN_SIZE)
    outputs, state = th.run_shard_map(tx, _params(), grads)
    pmean = th.run_shard_map(_pmean_transform(), _params(), grads)[0]
    for out, ref in zip(outputs, pmean, strict=True):
        chex.assert_trees_all_equal(out, ref)
    for name in COMPRESSED:
        np.testing.assert_array_equal(state.residuals[name], 0.0)


def _pmean_transform() -> optax.GradientTransformation:
    return optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.tree.map(lambda g: lax.pmean(g, th.AXIS), u), s),
    )


def test_compressed_mean_is_mean_of_sparsified_raw_gradients(grads):
    density = 0.05
    tx = rr.compressed_mean(rr.compressors.topk(density), min_size=MIN_SIZE)
    outputs, state = th.run_shard_map(tx, _params(), grads[:2])
    for out, g in zip(outputs, grads[:2], strict=True):
        for name in COMPRESSED:  # no memory: every step sparsifies the raw gradient
            ref = np.stack([th.np_topk_sparsify(g[name][w], density) for w in range(W)]).mean(0)
            np.testing.assert_allclose(out[name][0], ref, rtol=1e-6, atol=1e-7)
    assert state.residuals == {}


@pytest.mark.parametrize(
    "compressor", [rr.compressors.topk(0.05), rr.compressors.randomk(0.05, scaled=True)]
)
def test_shard_map_and_pmap_agree(grads, compressor):
    tx = rr.error_feedback(compressor, min_size=MIN_SIZE)
    out_sm, state_sm = th.run_shard_map(tx, _params(), grads)
    out_pm, state_pm = th.run_pmap(tx, _params(), grads)
    chex.assert_trees_all_equal(out_sm, out_pm)
    chex.assert_trees_all_equal(state_sm.residuals, state_pm.residuals)


def test_randomk_draws_change_every_step_and_agree_across_workers(grads):
    tx = rr.error_feedback(rr.compressors.randomk(0.02), min_size=MIN_SIZE)
    _, s1 = th.run_shard_map(tx, _params(), grads[:1])
    _, s2 = th.run_shard_map(tx, _params(), [grads[0], grads[0]])
    sent_1 = grads[0]["w1"] - s1.residuals["w1"]
    masks = (sent_1 != 0).reshape(W, -1)
    assert (masks == masks[0]).all()  # shared indices on every worker
    # Same gradient again at step 1: a fresh draw of indices (different residual pattern).
    sent_2 = grads[0]["w1"] + s1.residuals["w1"] - s2.residuals["w1"]
    assert ((sent_2[0] != 0) != (sent_1[0] != 0)).any()


def test_update_outside_mapped_axis_raises_clear_error():
    tx = rr.error_feedback(rr.compressors.topk(0.01), min_size=MIN_SIZE)
    params = _params()
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"not bound.*shard_map"):
        tx.update(params, state, params)


@pytest.mark.parametrize("make", [rr.error_feedback, rr.compressed_mean])
def test_integer_leaves_are_rejected_with_their_path(make):
    tx = make(rr.compressors.topk(0.01))
    with pytest.raises(ValueError, match=r"'layer/step' has dtype int32"):
        tx.init({"layer": {"kernel": jnp.zeros((200, 100)), "step": jnp.zeros((3,), jnp.int32)}})


@pytest.mark.parametrize("bad", [-1, 1.5, "10"])
def test_bad_min_size(bad):
    with pytest.raises(ValueError, match="min_size"):
        rr.error_feedback(rr.compressors.topk(0.01), min_size=bad)


def test_non_compressor_argument():
    with pytest.raises(ValueError, match="Expected a compressor"):
        rr.error_feedback("topk")


def test_state_specs_mark_only_residuals_per_worker():
    tx = optax.chain(
        rr.error_feedback(rr.compressors.topk(0.01), min_size=MIN_SIZE), optax.adam(1e-3)
    )
    specs = rr.parallel.state_partition_specs(tx, _params(), th.mesh(), th.AXIS)
    ef_specs, adam_specs = specs[0], specs[1]
    assert ef_specs.residuals["w1"] == P("data") and ef_specs.residuals["w2"] == P("data")
    assert ef_specs.count == P()
    assert all(s == P() for s in jax.tree.leaves(adam_specs))
