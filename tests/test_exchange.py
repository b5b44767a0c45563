"""The exchange core's public surface: plans, one state type, per-worker state surgery."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from tests import transform_harness as th

W = 8
MIN_SIZE = 1000
PARAMS = {
    "block_0": {"kernel": np.zeros((30, 50), np.float32)},
    "block_1": {"kernel": np.zeros((30, 50), np.float32)},
    "big": {"kernel": np.zeros((60, 60), np.float32)},
    "head": {"bias": np.zeros((40,), np.float32)},
}
TOPK = rr.compressors.topk(0.05)


def _grads(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        jax.tree.map(lambda p: rng.standard_normal((W, *p.shape)).astype(np.float32), PARAMS)
        for _ in range(steps)
    ]


def test_plans_cover_every_compressed_leaf_once_and_match_the_state():
    paths = rr.tree_paths.leaf_paths(PARAMS)
    for tx, kinds in [
        (rr.compressed_mean(TOPK, min_size=MIN_SIZE), {"none"}),
        (rr.error_feedback(TOPK, min_size=MIN_SIZE), {"leaf"}),
        (rr.resireduce(TOPK, intra_layers="big", min_size=MIN_SIZE), {"weighted", "2d"}),
    ]:
        plan = tx.plan(PARAMS)
        assert {s.kind for s in plan.stores} == kinds
        members = sorted(i for s in plan.stores for i in s.group.members)
        assert members == [
            paths.index(p) for p in ("big/kernel", "block_0/kernel", "block_1/kernel")
        ]
        assert [paths[i] for i in plan.dense] == ["head/bias"]
        state = jax.eval_shape(tx.init, PARAMS)
        assert isinstance(state, rr.ExchangeState)
        assert set(state.residuals) == {s.group.label for s in plan.kept}
        # Plan bytes (computed from the store shapes) equal the state's bytes.
        assert plan.residual_bytes() == rr.memory.tree_bytes(state.residuals)
    ef_plan = rr.error_feedback(TOPK, min_size=MIN_SIZE).plan(PARAMS)
    assert ef_plan.store_of("big/kernel").group.label == "big/kernel"
    assert ef_plan.store_of("head/bias") is None


def test_exchange_states_are_found_inside_wrappers_and_chains():
    ef = rr.error_feedback(TOPK, min_size=MIN_SIZE)
    tx = rr.skip_nonfinite(optax.chain(ef, rr.optimizers.sgd(0.1, momentum=0.9)))
    state = jax.eval_shape(tx.init, PARAMS)
    (found,) = rr.exchange.exchange_states(state)
    assert set(found.residuals) == {"big/kernel", "block_0/kernel", "block_1/kernel"}


def test_leaf_residuals_views_and_densified_intra_layer_store():
    tx = rr.resireduce(TOPK, inter="none", intra="2d", intra_layers="big", min_size=MIN_SIZE)
    _, state = th.run_shard_map(tx, PARAMS, _grads(2))
    plan = tx.plan(PARAMS)
    own = rr.exchange.leaf_residuals(state, plan)
    assert set(own) == {"block_0/kernel", "block_1/kernel"}
    np.testing.assert_array_equal(own["block_0/kernel"], state.residuals["block_0/kernel"])
    dense = rr.exchange.leaf_residuals(state, plan, dense_only=False)["big/kernel"]
    block = state.residuals["big/kernel"]
    for w in range(W):  # kernel [in, out]: rows are output units (axis 1)
        expected = np.zeros((60, 60), np.float32)
        expected[np.ix_(block.cols[w], block.rows[w])] = block.values[w]
        np.testing.assert_array_equal(dense[w], expected)


def test_resize_workers_gives_every_new_worker_the_old_mean():
    tx = rr.error_feedback(TOPK, min_size=MIN_SIZE)
    _, state = th.run_shard_map(tx, PARAMS, _grads(2))
    state = jax.device_get(state)
    specs = rr.parallel.state_partition_specs(tx, PARAMS, th.mesh(W))
    assert specs.residuals["big/kernel"] == P("data")
    resized = rr.exchange.resize_workers(state, specs, tx.plan(PARAMS), 3)
    for label, old in state.residuals.items():
        new = resized.residuals[label]
        assert new.shape == (3, *old.shape[1:])
        for w in range(3):
            np.testing.assert_allclose(new[w], old.mean(0), rtol=1e-6, atol=1e-7)


def test_store_plans_are_instances_of_their_kinds_classes():
    stores = rr.residual_stores
    params = {"a": np.zeros((64, 64), np.float32), "b": np.zeros((64, 64), np.float32)}
    group = rr.grouping.resolve(params, rr.grouping.each_leaf(), 1)[0]
    expected = {
        "none": (stores.NoStore, False, False, False),
        "leaf": (stores.LeafStore, True, True, False),
        "average": (stores.SharedStore, True, False, True),
        "weighted": (stores.SharedStore, True, False, True),
        "rows": (stores.RowsStore, True, False, False),
        "2d": (stores.BlockStore, True, False, False),
    }
    for kind, (cls, keeps, own, shared) in expected.items():
        plan = stores.StorePlan(group, kind, np.float32)
        assert type(plan) is cls and plan.kind == kind
        assert (plan.keeps_residual, plan.own_residual, plan.shared) == (keeps, own, shared)
        assert type(dataclasses.replace(plan, phi=0.25)) is cls


def test_the_exchange_compares_no_store_kinds():
    """The passes call the stores' methods: no ``.kind`` is read in exchange.py."""
    source = pathlib.Path(rr.exchange.__file__).read_text()
    reads = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr == "kind"
    ]
    assert reads == []
