"""DGC's memory (momentum correction, local clipping, momentum factor masking) against an
independent NumPy paraphrase of Lin et al. (ICLR 2018), Algorithm 1 with §3.2 and §3.3."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from tests import transform_harness as th

MIN_SIZE = 1000
DENSITY = 0.05
SHAPES = {
    "block": {"kernel": (30, 50)},  # 1500 elements: compressed, k = 75
    "big": {"kernel": (60, 60)},  # 3600 elements: compressed, k = 180
    "head": {"bias": (40,), "small": (4, 5)},  # dense: ndim 1, and too small
}


def _params(dtype=np.float32):
    return jax.tree.map(
        lambda s: np.zeros(s, dtype), SHAPES, is_leaf=lambda x: isinstance(x, tuple)
    )


def _grads(workers: int, steps: int, seed: int = 0, dtype=np.float32):
    """Heavy-tailed gradients, each (step, worker) scaled by ``10**U(-1.3, 0.5)`` so that
    their norms (about 6 to 400) fall on both sides of the clipping thresholds used here."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        scale = 10 ** rng.uniform(-1.3, 0.5, size=workers)
        out.append(
            jax.tree.map(
                lambda p, s=scale: (
                    rng.standard_t(3, size=(workers, *p.shape)) * s.reshape(-1, *[1] * p.ndim)
                ).astype(dtype),
                _params(),
            )
        )
    return out


# --------------------------------------------------------------------------------------
# The reference: DGC on N workers, written from the paper, in float64


def dgc_reference(grads_per_step, *, momentum, clip_norm, density, min_size):
    """Lin et al., Algorithm 1 ("gradient sparsification on node k") with the §3 fixes.

    For every step and every worker ``k`` (leading axis of each gradient leaf):

    * local gradient clipping (§3.2): if the L2 norm of worker k's whole gradient exceeds
      ``clip_norm * N**-0.5``, rescale the gradient to that norm;
    * momentum correction (§3.2): ``u_k = m u_k + g_k``; ``v_k = v_k + u_k``;
    * sparsification (§3.1): the top ``max(1, floor(density n))`` entries of ``|v_k|``
      (ties: lower flat index first) are sent; the step's update is the mean over the
      workers of the sent sparse tensors (the all-reduce of ``encode(G~)``);
    * momentum factor masking (§3.3): ``v_k`` and ``u_k`` are zeroed where sent.

    Leaves with ``ndim <= 1`` or fewer than ``min_size`` entries are not sparsified: each
    worker keeps plain momentum ``u_k = m u_k + g_k`` and the update is the mean of the
    ``u_k`` (nothing stays behind, so there is no ``v`` and no mask).

    Returns ``(updates per step, u, v)``; ``u`` and ``v`` per worker (dense leaves: ``u``
    only), and ``clipped``: how many (step, worker) pairs were clipped.
    """
    flat = [jax.tree_util.tree_flatten_with_path(g)[0] for g in grads_per_step]
    names = [jax.tree_util.keystr(path) for path, _ in flat[0]]
    workers = flat[0][0][1].shape[0]
    shapes = {name: x.shape[1:] for name, (_, x) in zip(names, flat[0], strict=True)}
    sparse = {n: len(s) >= 2 and math.prod(s) >= min_size for n, s in shapes.items()}
    u = {n: np.zeros((workers, *s)) for n, s in shapes.items()}
    v = {n: np.zeros((workers, *s)) for n, s in shapes.items() if sparse[n]}
    updates, clipped = [], 0
    for step in flat:
        g = {n: np.asarray(x, np.float64).copy() for n, (_, x) in zip(names, step, strict=True)}
        if clip_norm is not None:
            local_threshold = clip_norm / math.sqrt(workers)
            for k in range(workers):
                norm = math.sqrt(sum(float(np.sum(g[n][k] ** 2)) for n in names))
                if norm > local_threshold:
                    clipped += 1
                    for n in names:
                        g[n][k] *= local_threshold / norm
        out = {}
        for n in names:
            u[n] = momentum * u[n] + g[n]
            if not sparse[n]:
                out[n] = u[n].mean(axis=0)
                continue
            v[n] = v[n] + u[n]
            size = math.prod(shapes[n])
            k_sent = max(1, math.floor(density * size))
            sent = np.zeros_like(v[n])
            for k in range(workers):
                magnitudes = np.abs(v[n][k]).reshape(-1)
                chosen = np.argsort(-magnitudes, kind="stable")[:k_sent]
                mask = np.zeros(size, bool)
                mask[chosen] = True
                mask = mask.reshape(shapes[n])
                sent[k][mask] = v[n][k][mask]
                v[n][k][mask] = 0.0
                u[n][k][mask] = 0.0
            out[n] = sent.mean(axis=0)
        updates.append(out)
    return updates, u, v, clipped


def _by_name(tree):
    return {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def _assert_close(got, expected, rtol, name):
    scale = max(float(np.abs(expected).max()), 1e-30)
    np.testing.assert_allclose(
        np.asarray(got, np.float64), expected, rtol=rtol, atol=rtol * scale, err_msg=name
    )


def _dense_names():
    return {"['head']['bias']", "['head']['small']"}


# --------------------------------------------------------------------------------------
# Trajectories against the reference


def _median_clip_norm(grads, workers):
    """A global threshold ``c`` whose local share ``c / sqrt(N)`` is the median local
    gradient norm: about half of the (step, worker) gradients are clipped."""
    norms = [
        math.sqrt(sum(float(np.sum(np.asarray(x[k], np.float64) ** 2)) for x in jax.tree.leaves(g)))
        for g in grads
        for k in range(workers)
    ]
    return float(np.median(norms)) * math.sqrt(workers)


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize(("momentum", "clip"), [(0.9, True), (0.9, False), (0.0, True)], ids=str)
def test_dgc_memory_matches_numpy_reference(workers, momentum, clip):
    steps = 6
    grads = _grads(workers, steps, seed=workers)
    clip_norm = _median_clip_norm(grads, workers) if clip else None
    tx = rr.dgc_memory(
        rr.compressors.topk(DENSITY), momentum=momentum, clip_norm=clip_norm, min_size=MIN_SIZE
    )
    outputs, state = th.run_shard_map(tx, _params(), grads, num_workers=workers)
    ref_updates, ref_u, ref_v, clipped = dgc_reference(
        grads, momentum=momentum, clip_norm=clip_norm, density=DENSITY, min_size=MIN_SIZE
    )
    if clip_norm is not None:  # the threshold c / sqrt(N) was hit on some, not all, steps
        assert 0 < clipped < steps * workers, clipped
    for t, (out, ref) in enumerate(zip(outputs, ref_updates, strict=True)):
        for name, got in _by_name(out).items():
            # Every worker applies the same update, bit for bit.
            assert (got == got[:1]).all(), (t, name)
            _assert_close(got[0], ref[name], 1e-5, f"step {t} {name}")
    u, v = _by_name(state.momentum), _by_name(state.velocity)
    dense_u = _by_name(state.dense_momentum)
    for name, expected in ref_u.items():
        if name in _dense_names():
            assert name not in u and name not in v
            # Replicated momentum of the mean == mean of per-worker momenta.
            _assert_close(dense_u[name][0], expected.mean(axis=0), 1e-5, name)
        else:
            assert name not in dense_u
            _assert_close(u[name], expected, 1e-5, name)
            _assert_close(v[name], ref_v[name], 1e-5, name)
            # Momentum factor masking: exactly the sent entries are zero in u and v.
            np.testing.assert_array_equal(u[name] == 0, expected == 0)
            np.testing.assert_array_equal(v[name] == 0, ref_v[name] == 0)
    assert int(state.count[0]) == steps


def test_dgc_memory_float64_matches_reference_to_rounding():
    """Under jax_enable_x64 with float64 gradients the whole pipeline (clip factor,
    momentum, exchange) is float64: 5 steps on 4 workers agree to 1e-12."""
    with jax.enable_x64(True):
        grads = _grads(4, 5, seed=7, dtype=np.float64)
        tx = rr.dgc_memory(rr.compressors.topk(DENSITY), 0.9, 60.0, min_size=MIN_SIZE)
        outputs, state = th.run_shard_map(tx, _params(np.float64), grads, num_workers=4)
        ref_updates, _, ref_v, clipped = dgc_reference(
            grads, momentum=0.9, clip_norm=60.0, density=DENSITY, min_size=MIN_SIZE
        )
        assert clipped > 0
        for out, ref in zip(outputs, ref_updates, strict=True):
            for name, got in _by_name(out).items():
                assert got.dtype == np.float64
                _assert_close(got[0], ref[name], 1e-12, name)
        for name, got in _by_name(state.velocity).items():
            _assert_close(got, ref_v[name], 1e-12, name)


def test_deep_gradient_compression_in_data_parallel_step_matches_reference():
    """The whole optimizer in the library's data-parallel step (shard_map, donated state):
    per-worker u and v get a leading worker axis sharded on the data axis, the dense
    momentum is replicated, and the parameters follow ``w <- w - lr * update``."""
    workers, steps, lr = 4, 5, 0.1
    grads = _grads(workers, steps, seed=3)
    tx = rr.deep_gradient_compression(
        rr.compressors.topk(DENSITY), lr, momentum=0.9, clip_norm=60.0, min_size=MIN_SIZE
    )
    mesh = rr.parallel.make_mesh(workers)

    def loss_fn(params, batch):  # linear: the local gradient is this worker's batch row
        return sum(
            jnp.vdot(p, b[0])
            for p, b in zip(jax.tree.leaves(params), jax.tree.leaves(batch), strict=True)
        )

    step = rr.parallel.data_parallel_step(loss_fn, tx, mesh)
    params, opt_state = step.init(_params())
    dgc_specs = step.state_specs[0]
    assert all(s == P("data") for s in jax.tree.leaves(dgc_specs.momentum))
    assert all(s == P("data") for s in jax.tree.leaves(dgc_specs.velocity))
    assert all(s == P() for s in jax.tree.leaves(dgc_specs.dense_momentum))
    assert dgc_specs.count == P()
    assert opt_state[0].velocity["big"]["kernel"].shape == (workers, 60, 60)
    for g in grads:
        params, opt_state, _ = step(params, opt_state, rr.parallel.shard_batch(g, mesh))
    ref_updates, _, ref_v, _ = dgc_reference(
        grads, momentum=0.9, clip_norm=60.0, density=DENSITY, min_size=MIN_SIZE
    )
    for name, got in _by_name(params).items():
        expected = -lr * sum(u[name] for u in ref_updates)
        _assert_close(got, expected, 1e-5, name)
    for name, got in _by_name(opt_state[0].velocity).items():
        _assert_close(got, ref_v[name], 1e-5, name)


def test_dgc_compressor_conserves_what_it_does_not_send():
    """With DGC's own sampled-threshold selection (random per worker): after the first
    step ``u = v = g`` masked, so ``sent_w = g_w - v_w`` and the update is their mean;
    at most k entries are sent per worker; u and v are zero at the same positions."""
    workers = 4
    grads = _grads(workers, 3, seed=11)
    tx = rr.dgc_memory(rr.compressors.dgc(DENSITY, sample_ratio=0.2), 0.9, min_size=MIN_SIZE)
    outputs, state = th.run_shard_map(tx, _params(), grads[:1], num_workers=workers)
    for name, v in _by_name(state.velocity).items():
        g = _by_name(grads[0])[name]
        sent = g - v
        n = math.prod(g.shape[1:])
        assert 0 < (sent != 0).reshape(workers, -1).sum(axis=1).max() <= max(1, int(DENSITY * n))
        _assert_close(_by_name(outputs[0])[name][0], sent.mean(axis=0), 1e-6, name)
        np.testing.assert_array_equal(_by_name(state.momentum)[name], v)
    _, state = th.run_shard_map(tx, _params(), grads, num_workers=workers)
    for name, v in _by_name(state.velocity).items():
        u = _by_name(state.momentum)[name]
        np.testing.assert_array_equal(u == 0, v == 0)
        assert (v != 0).any()


# --------------------------------------------------------------------------------------
# Compiled memory


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_dgc_step_needs_no_more_temp_than_error_feedback_with_momentum():
    """DGC keeps two leaf-sized buffers per worker (u, v), as error feedback + momentum
    SGD does (residual, momentum). In the donated data-parallel step both are updated in
    place: the compiled temp stays within a quarter leaf of EF + momentum's (measured:
    +1 % with clipping; writing zeros into v instead of subtracting the sent values
    costs one copy of v per leaf: +74 %)."""
    workers, shapes = 4, {f"w{i}": (512, 512) for i in range(3)}
    leaf_bytes = 512 * 512 * 4
    params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    batch = {k: np.zeros((workers, *s), np.float32) for k, s in shapes.items()}
    mesh = rr.parallel.make_mesh(workers)

    def loss_fn(p, b):
        return sum(jnp.vdot(p[k], b[k][0]) for k in p)

    def temp(tx):
        return th.step_memory(loss_fn, tx, params, rr.parallel.shard_batch(batch, mesh), mesh).temp

    topk = rr.compressors.topk(0.01)
    dgc = temp(rr.deep_gradient_compression(topk, 0.1, 0.9, clip_norm=1.0))
    ef = temp(optax.chain(rr.error_feedback(topk), rr.optimizers.sgd(0.1, momentum=0.9)))
    assert dgc <= ef + leaf_bytes // 4, (dgc, ef)


# --------------------------------------------------------------------------------------
# Skipped steps


def test_skipped_step_leaves_dgc_state_unchanged_bit_for_bit():
    """A NaN on one worker at step 2 (skip_nonfinite, lean mode): zero update, and the run
    ends in exactly the state of a run that never saw that step."""
    workers, lr = 4, 0.1
    grads = _grads(workers, 4, seed=5)
    bad = jax.tree.map(np.copy, grads[2])
    bad["big"]["kernel"][1, 3, 4] = np.nan
    with_bad = [*grads[:2], bad, grads[3]]
    without = [*grads[:2], grads[3]]

    def make():
        return rr.skip_nonfinite(
            rr.deep_gradient_compression(
                rr.compressors.topk(DENSITY), lr, 0.9, clip_norm=60.0, min_size=MIN_SIZE
            )
        )

    out_bad, state_bad = th.run_shard_map(make(), _params(), with_bad, num_workers=workers)
    out_ref, state_ref = th.run_shard_map(make(), _params(), without, num_workers=workers)
    assert int(state_bad.skipped[0]) == 1
    for leaf in jax.tree.leaves(out_bad[2]):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
    for a, b in zip(jax.tree.leaves(out_bad[3]), jax.tree.leaves(out_ref[2]), strict=True):
        np.testing.assert_array_equal(a, b)
    dgc_bad, dgc_ref = state_bad.inner[0], state_ref.inner[0]
    assert isinstance(dgc_bad, rr.DGCState)
    for a, b in zip(jax.tree.leaves(dgc_bad), jax.tree.leaves(dgc_ref), strict=True):
        np.testing.assert_array_equal(a, b)
    # The skipped state is also the reference's state after the good steps.
    _, _, ref_v, _ = dgc_reference(
        without, momentum=0.9, clip_norm=60.0, density=DENSITY, min_size=MIN_SIZE
    )
    for name, got in _by_name(dgc_bad.velocity).items():
        _assert_close(got, ref_v[name], 1e-5, name)


def test_dgc_state_is_registered_skip_aware():
    """skip_nonfinite leaves a DGCState alone (no old/new select, no extra buffers)."""
    from resireduce_jax import nonfinite

    state = rr.dgc_memory(rr.compressors.topk(0.1), min_size=10).init({"w": jnp.zeros((4, 4))})
    assert nonfinite._is_skip_aware(state)


# --------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(momentum=1.0), r"momentum must be in \[0, 1\), got 1.0"),
        (dict(momentum=-0.1), r"momentum must be in \[0, 1\)"),
        (dict(momentum=float("nan")), r"momentum must be in \[0, 1\)"),
        (dict(momentum="high"), r"momentum must be a number in \[0, 1\)"),
        (dict(clip_norm=0.0), r"clip_norm must be a positive finite number or None.*sqrt"),
        (dict(clip_norm=-1.0), r"clip_norm must be a positive finite number"),
        (dict(clip_norm=float("inf")), r"clip_norm must be a positive finite number"),
        (dict(clip_norm="big"), r"clip_norm must be a positive number or None"),
        (dict(min_size=-1), r"min_size must be a non-negative int"),
    ],
)
def test_bad_hyperparameters_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rr.dgc_memory(rr.compressors.topk(0.01), **kwargs)


@pytest.mark.parametrize(
    ("compressor", "message"),
    [
        (rr.compressors.qsgd(), r"needs a sparsifying compressor.*got 'qsgd'"),
        (rr.compressors.powersgd(rank=2), r"needs a sparsifying compressor.*'powersgd'"),
        (rr.compressors.randomk(0.01, scaled=True), r"randomk\(scaled=True\)"),
        ("topk", r"Expected a compressor from resireduce_jax.compressors"),
    ],
)
def test_non_sparse_compressors_are_refused(compressor, message):
    with pytest.raises(ValueError, match=message):
        rr.dgc_memory(compressor)


def test_unbound_axis_and_integer_leaves_raise_clear_errors():
    tx = rr.dgc_memory(rr.compressors.topk(0.1), min_size=10)
    params = {"w": jnp.zeros((4, 4))}
    with pytest.raises(ValueError, match="Axis name 'data' is not bound"):
        tx.update(params, tx.init(params))
    with pytest.raises(ValueError, match="dgc_memory: leaf 'step' has dtype int32"):
        tx.init({"w": jnp.zeros((4, 4)), "step": jnp.zeros((), jnp.int32)})
