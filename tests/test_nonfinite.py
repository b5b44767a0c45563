"""Non-finite gradients on one worker: every worker skips the step, nothing is stored."""

from __future__ import annotations

import chex
import jax
import numpy as np
import optax
import pytest

import resireduce_jax as rr
from tests import transform_harness as th

W = 8
MIN_SIZE = 1000
SHAPES = {
    "block_0": {"kernel": (30, 50)},
    "block_1": {"kernel": (30, 50)},
    "block_2": {"kernel": (30, 50)},
    "big": {"kernel": (60, 60)},
    "head": {"bias": (40,)},
}


def _params():
    return jax.tree.map(
        lambda s: np.zeros(s, np.float32), SHAPES, is_leaf=lambda x: isinstance(x, tuple)
    )


def _grads(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        jax.tree.map(lambda p: rng.standard_t(3, size=(W, *p.shape)).astype(np.float32), _params())
        for _ in range(steps)
    ]


EXCHANGES = {
    "ef": lambda: rr.error_feedback(rr.compressors.topk(0.05), min_size=MIN_SIZE),
    "w+2d": lambda: rr.resireduce(rr.compressors.topk(0.05), intra_layers="big", min_size=MIN_SIZE),
    "w+2d-softmax": lambda: rr.resireduce(
        rr.compressors.topk(0.05),
        intra_layers="big",
        selection="softmax_sample",
        min_size=MIN_SIZE,
    ),
    "powersgd-ef": lambda: rr.error_feedback(rr.compressors.powersgd(rank=2), min_size=MIN_SIZE),
    "randomk-none": lambda: rr.compressed_mean(rr.compressors.randomk(0.05), min_size=MIN_SIZE),
}


def _tx(exchange, **kwargs):
    chain = optax.chain(EXCHANGES[exchange](), optax.sgd(0.1, momentum=0.9))
    return rr.skip_nonfinite(chain, **kwargs)


@pytest.mark.parametrize("exchange", list(EXCHANGES))
@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
def test_poisoned_step_is_skipped_as_if_it_never_happened(exchange, bad_value):
    clean = _grads(3)
    poisoned = jax.tree.map(np.copy, clean[1])
    poisoned["block_1"]["kernel"][5, 3, 7] = bad_value  # worker 5 only
    with_bad = [clean[0], poisoned, clean[2]]
    without = [clean[0], clean[2]]

    out_bad, state_bad = th.run_shard_map(_tx(exchange), _params(), with_bad)
    out_ref, state_ref = th.run_shard_map(_tx(exchange), _params(), without)

    for leaf in jax.tree.leaves(out_bad[1]):  # the skipped step moves nothing, anywhere
        np.testing.assert_array_equal(leaf, 0.0)
    chex.assert_trees_all_equal(out_bad[2], out_ref[1])
    # Residuals, momentum and counters continue bit for bit as if step 1 never happened.
    chex.assert_trees_all_equal(state_bad.inner, state_ref.inner)
    np.testing.assert_array_equal(state_bad.skipped, 1)
    assert not np.asarray(state_bad.last_skipped).any()
    block_1 = rr.tree_paths.leaf_paths(_params()).index("block_1/kernel")
    np.testing.assert_array_equal(state_bad.bad_leaf, block_1)
    for leaf in jax.tree.leaves(state_bad):
        if np.issubdtype(np.asarray(leaf).dtype, np.floating):
            assert np.isfinite(leaf).all()


def test_without_optimizer_guard_residuals_are_still_exact():
    clean = _grads(2)
    poisoned = jax.tree.map(np.copy, clean[1])
    poisoned["big"]["kernel"][0, 0, 0] = np.nan
    _, state_bad = th.run_shard_map(
        _tx("ef", guard_optimizer_state=False), _params(), [clean[0], poisoned]
    )
    _, state_ref = th.run_shard_map(_tx("ef", guard_optimizer_state=False), _params(), clean[:1])
    ef_bad, ef_ref = state_bad.inner[0], state_ref.inner[0]
    chex.assert_trees_all_equal(ef_bad, ef_ref)
    momentum = state_bad.inner[1][0].trace["big"]["kernel"]
    np.testing.assert_allclose(momentum, 0.9 * state_ref.inner[1][0].trace["big"]["kernel"])


def test_all_finite_steps_are_unchanged_by_the_wrapper():
    grads = _grads(3)
    plain = optax.chain(EXCHANGES["w+2d"](), optax.sgd(0.1, momentum=0.9))
    out_plain, state_plain = th.run_shard_map(plain, _params(), grads)
    out_guarded, state_guarded = th.run_shard_map(_tx("w+2d"), _params(), grads)
    # The exchange is bit-identical. The optimizer's multiply-adds sit in other fusions once
    # the selection is added, and XLA:CPU may contract them differently: 1 ulp at most.
    chex.assert_trees_all_equal(state_plain[0], state_guarded.inner[0])
    chex.assert_trees_all_close(out_plain, out_guarded, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(state_plain[1], state_guarded.inner[1], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(state_guarded.skipped, 0)
