"""The hierarchical exchange: dense inside a node, compressed across nodes, sharded residuals.

8 simulated devices as 2 nodes × 4 (``make_mesh(local_devices=4)``). References are numpy
paraphrases of the algorithm in docs/design.md ("Hierarchical exchange"): node means, the
leaf's 2-D view split along axis 0 into padded shards, error feedback per shard, the mean
over nodes, and the shards put back together.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest

import resireduce_jax as rr
from resireduce_jax.compressors.sparse import num_selected
from tests import transform_harness as th

W, L = 8, 4
NODES = W // L
MIN_SIZE = 1000
# A conv-like kernel (2-D view 30 x 50: 30 rows split 8/8/8/6+pad), two same-shape
# kernels (a shared group), an embedding whose 101 vocabulary rows do not divide by 4,
# and a bias that travels dense.
PARAMS = {
    "conv": {"kernel": np.zeros((3, 10, 50), np.float32)},
    "block_0": {"kernel": np.zeros((40, 50), np.float32)},
    "block_1": {"kernel": np.zeros((40, 50), np.float32)},
    "embed": {"embedding": np.zeros((101, 40), np.float32)},
    "head": {"bias": np.zeros((40,), np.float32)},
}
DENSITY = 0.1


def _grads(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        jax.tree.map(lambda p: rng.standard_normal((W, *p.shape)).astype(np.float32), PARAMS)
        for _ in range(steps)
    ]


def _view(path, shape):
    if path.endswith("embedding"):
        return shape[0], math.prod(shape[1:])
    return math.prod(shape[:-1]), shape[-1]


def _shards(x2d):
    """numpy: the L padded shards of a 2-D view, split along axis 0."""
    rows = -(-x2d.shape[0] // L)
    padded = np.zeros((rows * L, x2d.shape[1]), x2d.dtype)
    padded[: x2d.shape[0]] = x2d
    return [padded[j * rows : (j + 1) * rows] for j in range(L)]


def _topk_sent(x):
    """numpy Top-k: x where |x| is among the k largest, 0 elsewhere."""
    flat = x.ravel()
    keep = np.argsort(-np.abs(flat), kind="stable")[: num_selected(flat.size, DENSITY)]
    sent = np.zeros_like(flat)
    sent[keep] = flat[keep]
    return sent.reshape(x.shape)


def _hierarchical_ef_reference(grads_per_step):
    """numpy: per leaf and step, the hierarchical error-feedback output and residual shards."""
    paths = rr.tree_paths.leaf_paths(PARAMS)
    residuals = {}
    outputs = []
    for grads in grads_per_step:
        out = {}
        for path, g in zip(paths, jax.tree.leaves(grads), strict=True):
            shape = g.shape[1:]
            if g[0].size < MIN_SIZE or g[0].ndim <= 1:
                out[path] = g.mean(0)
                continue
            a, b = _view(path, shape)
            node_means = [g[n * L : (n + 1) * L].reshape(L, a, b).mean(0) for n in range(NODES)]
            mean_shards = []
            for j in range(L):
                sent_sum = 0
                for n in range(NODES):
                    shard = _shards(node_means[n])[j]
                    key = (path, n, j)
                    compensated = shard + residuals.get(key, 0)
                    sent = _topk_sent(compensated)
                    residuals[key] = compensated - sent
                    sent_sum = sent_sum + sent
                mean_shards.append(sent_sum / NODES)
            out[path] = np.concatenate(mean_shards)[:a].reshape(shape)
        outputs.append(out)
    return outputs, residuals


def test_make_mesh_with_local_devices_is_nodes_by_devices():
    mesh = rr.parallel.make_mesh(W, local_devices=L)
    assert dict(mesh.shape) == {"data": NODES, "local": L}
    assert [d.id for d in mesh.devices[1]] == [4, 5, 6, 7]
    assert dict(rr.parallel.make_mesh(W, local_devices=1).shape) == {"data": W, "local": 1}
    with pytest.raises(ValueError, match="not a multiple of local_devices=3"):
        rr.parallel.make_mesh(W, local_devices=3)
    with pytest.raises(ValueError, match="positive int"):
        rr.parallel.make_mesh(W, local_devices=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda c, **kw: rr.compressed_mean(c, min_size=MIN_SIZE, **kw),
        lambda c, **kw: rr.error_feedback(c, min_size=MIN_SIZE, **kw),
        lambda c, **kw: rr.resireduce(c, intra_layers="embed", min_size=MIN_SIZE, **kw),
    ],
    ids=["compressed_mean", "error_feedback", "resireduce"],
)
@pytest.mark.parametrize(
    "compressor",
    [rr.compressors.topk(DENSITY), rr.compressors.qsgd(16), rr.compressors.randomk(DENSITY)],
    ids=["topk", "qsgd", "randomk"],
)
def test_a_local_axis_of_size_one_is_the_flat_transform_bit_for_bit(make, compressor):
    grads = _grads(3)
    flat_out, flat_state = th.run_shard_map(make(compressor), PARAMS, grads)
    hier_out, hier_state = th.run_shard_map(
        make(compressor, local_axis="local"),
        PARAMS,
        grads,
        on_mesh=rr.parallel.make_mesh(W, local_devices=1),
    )
    for a, b in zip([*flat_out, flat_state], [*hier_out, hier_state], strict=True):
        jax.tree.map(np.testing.assert_array_equal, a, b)


def test_hierarchical_error_feedback_matches_the_numpy_reference():
    grads = _grads(4)
    tx = rr.error_feedback(rr.compressors.topk(DENSITY), local_axis="local", min_size=MIN_SIZE)
    mesh = rr.parallel.make_mesh(W, local_devices=L)
    outputs, state = th.run_shard_map(tx, PARAMS, grads, on_mesh=mesh)
    want_out, want_res = _hierarchical_ef_reference(grads)
    paths = rr.tree_paths.leaf_paths(PARAMS)
    for got, want in zip(outputs, want_out, strict=True):
        for path, leaf in zip(paths, jax.tree.leaves(got), strict=True):
            for w in range(W):  # identical on every device, equal to the reference
                np.testing.assert_allclose(leaf[w], want[path], rtol=1e-5, atol=1e-6)
    for (path, n, j), residual in want_res.items():
        np.testing.assert_allclose(
            state.residuals[path][n * L + j], residual, rtol=1e-5, atol=1e-6, err_msg=path
        )


def test_hierarchical_error_feedback_conserves_mass_per_node():
    """sent + new residual = node mean + old residual, so the output is the node-mean of
    ``G_node + R_old - R_new`` over nodes (a randomized compressor: no reference needed)."""
    grads = _grads(2, seed=3)
    tx = rr.error_feedback(rr.compressors.qsgd(4), local_axis="local", min_size=MIN_SIZE)
    mesh = rr.parallel.make_mesh(W, local_devices=L)
    (_, second), state = th.run_shard_map(tx, PARAMS, grads, on_mesh=mesh)
    _, before = th.run_shard_map(tx, PARAMS, grads[:1], on_mesh=mesh)
    g = grads[1]["block_0"]["kernel"]
    old, new = before.residuals["block_0/kernel"], state.residuals["block_0/kernel"]
    mean_shards = []
    for j in range(L):
        sent = 0
        for n in range(NODES):
            node_shard = _shards(g[n * L : (n + 1) * L].mean(0))[j]
            sent = sent + node_shard + old[n * L + j] - new[n * L + j]
        mean_shards.append(sent / NODES)
    np.testing.assert_allclose(
        second["block_0"]["kernel"][0], np.concatenate(mean_shards)[:40], rtol=1e-5, atol=1e-5
    )


def test_residual_bytes_per_device_are_the_flat_transforms_divided_by_L():
    for make in (
        lambda **kw: rr.error_feedback(rr.compressors.topk(DENSITY), min_size=MIN_SIZE, **kw),
        lambda **kw: rr.resireduce(
            rr.compressors.topk(DENSITY), intra_layers="embed", min_size=MIN_SIZE, **kw
        ),
    ):
        flat = make().plan(PARAMS).residual_bytes()
        hier_tx = make(local_axis="local")
        hier = hier_tx.plan(PARAMS, local_size=L).residual_bytes()
        # Padding rows (30 -> 32, 101 -> 104) and indices are the only overhead.
        assert flat / L <= hier <= flat / L * 1.05, (flat, hier)
        _, state = th.run_shard_map(
            hier_tx, PARAMS, _grads(1), on_mesh=rr.parallel.make_mesh(W, local_devices=L)
        )
        per_device = sum(x.nbytes for x in jax.tree.leaves(state.residuals)) // W
        assert per_device == hier
    with pytest.raises(ValueError, match="local_size"):
        rr.error_feedback(rr.compressors.topk(DENSITY), local_axis="local").plan(PARAMS)


def test_sharded_stores_take_norms_and_weights_over_the_whole_layer():
    tx = rr.resireduce(rr.compressors.topk(DENSITY), intra_layers="embed|conv", min_size=MIN_SIZE)
    hier = rr.resireduce(
        rr.compressors.topk(DENSITY),
        intra_layers="embed|conv",
        min_size=MIN_SIZE,
        local_axis="local",
    )
    mesh = rr.parallel.make_mesh(W, local_devices=L)
    _, state = th.run_shard_map(hier, PARAMS, _grads(2), on_mesh=mesh)
    plan = hier.plan(PARAMS, local_size=L)
    conv, embed = plan.store_of("conv/kernel"), plan.store_of("embed/embedding")
    flat_conv = tx.plan(PARAMS).store_of("conv/kernel")
    # conv kernel: rows (output units) are global, columns (split axis) per shard.
    assert conv.keep_rows == flat_conv.keep_rows
    assert conv.keep_cols == -(-flat_conv.keep_cols // L)
    block = state.residuals["conv/kernel"]
    for n in range(NODES):
        node_rows = block.rows[n * L : (n + 1) * L]
        assert (node_rows == node_rows[0]).all()  # one global selection per node
    # embedding: vocabulary rows split (per shard), columns global.
    assert embed.keep_rows == -(
        -rr.resireduce(rr.compressors.topk(DENSITY), intra_layers="embed|conv", min_size=MIN_SIZE)
        .plan(PARAMS)
        .store_of("embed/embedding")
        .keep_rows
        // L
    )
    cols = state.residuals["embed/embedding"].cols
    for n in range(NODES):
        assert (cols[n * L : (n + 1) * L] == cols[n * L]).all()


def test_identity_compression_gives_the_exact_global_mean():
    grads = _grads(2, seed=5)
    for tx in (
        rr.error_feedback(rr.compressors.none(), local_axis="local", min_size=MIN_SIZE),
        rr.resireduce(rr.compressors.none(), local_axis="local", min_size=MIN_SIZE),
    ):
        outputs, _ = th.run_shard_map(
            tx, PARAMS, grads, on_mesh=rr.parallel.make_mesh(W, local_devices=L)
        )
        for got, g in zip(outputs, grads, strict=True):
            jax.tree.map(
                lambda o, x: np.testing.assert_allclose(o[3], x.mean(0), rtol=1e-5, atol=1e-6),
                got,
                g,
            )


def _collective_bytes(tx, mesh, axes):
    """Bytes each device puts into collectives per step, by where their groups reach."""
    params = {k: v for k, v in PARAMS.items()}
    step = rr.parallel.data_parallel_step(
        lambda p, batch: sum(jax.numpy.vdot(x, x) for x in jax.tree.leaves(p)) * batch.sum(),
        optax.chain(tx, optax.sgd(0.1)),
        mesh,
    )
    params, state = step.init(params)
    batch = rr.parallel.shard_batch(np.ones((W, 1), np.float32), mesh)
    compiled = step.lower(params, state, batch).compile()
    nodes = [{int(d.id) for d in row} for row in np.atleast_2d(mesh.devices)]
    by = {"local": 0, "data": 0}
    dense_over_data = []
    for c in rr.hlo.collectives(compiled):
        groups = c.replica_groups or ()
        within = all(any(set(g) <= node for node in nodes) for g in groups)
        by["local" if within and len(nodes) > 1 else "data"] += c.bytes_per_worker
        if not within and c.op in ("all-reduce", "reduce-scatter"):
            dense_over_data.append(c)
    return by, dense_over_data


def test_only_compressed_payloads_cross_the_data_axis():
    topk = rr.compressors.topk(DENSITY)
    hier_mesh = rr.parallel.make_mesh(W, local_devices=L)
    hier, dense_over_data = _collective_bytes(
        rr.error_feedback(topk, local_axis="local", min_size=MIN_SIZE), hier_mesh, None
    )
    flat, _ = _collective_bytes(
        rr.error_feedback(topk, min_size=MIN_SIZE), rr.parallel.make_mesh(W), None
    )
    # The only dense collective over nodes is the small (bias) leaves' all-reduce, and the
    # loss metric; no compressed leaf is all-reduced or reduce-scattered across nodes.
    assert all(max(c.element_counts) < MIN_SIZE for c in dense_over_data), dense_over_data
    # Each device sends 1/L of flat EF's payload across nodes (one shard's Top-k each).
    assert hier["data"] < flat["data"] / L * 1.3, (hier, flat)
    assert hier["local"] > 0


def _owed(state, path, local, shape):
    """numpy: mean over nodes of each node's residual, its shards put back together."""
    a = _view(path, shape)[0]
    residual = np.asarray(state.residuals[path])
    nodes = [
        np.concatenate(list(residual[n * local : (n + 1) * local]))[:a].reshape(shape)
        for n in range(len(residual) // local)
    ]
    return sum(nodes) / len(nodes)


@pytest.mark.parametrize("new_local", [1, 2, 8])
def test_resize_workers_covers_a_change_of_devices_per_node(new_local):
    tx = rr.error_feedback(rr.compressors.topk(DENSITY), local_axis="local", min_size=MIN_SIZE)
    mesh = rr.parallel.make_mesh(W, local_devices=L)
    _, state = th.run_shard_map(tx, PARAMS, _grads(2), on_mesh=mesh)
    specs = rr.parallel.state_partition_specs(tx, PARAMS, mesh, ("data", "local"))
    resized = rr.exchange.resize_workers(
        state,
        specs,
        tx.plan(PARAMS, local_size=L),
        W,
        new_plan=tx.plan(PARAMS, local_size=new_local),
    )
    for path in ("conv/kernel", "embed/embedding"):
        shape = PARAMS[path.split("/")[0]][path.split("/")[1]].shape
        owed = _owed(state, path, L, shape)
        new = np.asarray(resized.residuals[path])
        if new_local == 1:
            for d in range(W):
                np.testing.assert_allclose(new[d], owed, rtol=1e-6, atol=1e-7)
        else:
            shards = []
            for j in range(new_local):  # numpy shards of the owed residual for the new L
                rows = -(-_view(path, shape)[0] // new_local)
                padded = np.zeros((rows * new_local, _view(path, shape)[1]), np.float32)
                padded[: _view(path, shape)[0]] = owed.reshape(_view(path, shape))
                shards.append(padded[j * rows : (j + 1) * rows])
            for d in range(W):
                np.testing.assert_allclose(new[d], shards[d % new_local], rtol=1e-6, atol=1e-7)
        # What the new layout owes equals what the old one did.
        np.testing.assert_allclose(_owed(resized, path, new_local, shape), owed, rtol=1e-6)


def test_resize_workers_reselects_sharded_intra_layer_stores():
    tx = rr.resireduce(
        rr.compressors.topk(DENSITY), intra_layers="embed", min_size=MIN_SIZE, local_axis="local"
    )
    mesh = rr.parallel.make_mesh(W, local_devices=L)
    _, state = th.run_shard_map(tx, PARAMS, _grads(2), on_mesh=mesh)
    specs = rr.parallel.state_partition_specs(tx, PARAMS, mesh, ("data", "local"))
    old_plan, new_plan = tx.plan(PARAMS, local_size=L), tx.plan(PARAMS, local_size=2)
    resized = rr.exchange.resize_workers(state, specs, old_plan, W, new_plan=new_plan)
    store = new_plan.store_of("embed/embedding")
    block = resized.residuals["embed/embedding"]
    owed = (
        sum(  # numpy: densify every old device's block, then nodes' means
            np.concatenate(
                [
                    _dense_block(state.residuals["embed/embedding"], n * L + j, old_plan)
                    for j in range(L)
                ]
            )[:101]
            for n in range(NODES)
        )
        / NODES
    )
    for d in range(W):
        j, rows = d % 2, -(-101 // 2)
        padded = np.zeros((rows * 2, 40), np.float32)
        padded[:101] = owed
        part = padded[j * rows : (j + 1) * rows]
        # vocabulary rows: the shard's own top rows; columns: the whole layer's top columns
        want_rows = np.sort(np.argsort(-np.abs(part).sum(1), kind="stable")[: store.keep_rows])
        want_cols = np.sort(np.argsort(-np.abs(padded).sum(0), kind="stable")[: store.keep_cols])
        np.testing.assert_array_equal(block.rows[d], want_rows)
        np.testing.assert_array_equal(block.cols[d], want_cols)
        np.testing.assert_allclose(block.values[d], part[np.ix_(want_rows, want_cols)], rtol=1e-6)


def _dense_block(stored, d, plan):
    store = plan.store_of("embed/embedding")
    dense = np.zeros(store.group.shape, np.float32)
    dense[np.ix_(stored.rows[d], stored.cols[d])] = stored.values[d]
    return dense


def test_a_nan_on_one_device_skips_the_step_on_every_node_and_device():
    """``skip_nonfinite`` with the default axis decides over both axes of the mesh."""
    mesh = rr.parallel.make_mesh(W, local_devices=L)
    tx = rr.skip_nonfinite(
        optax.chain(
            rr.resireduce(
                rr.compressors.topk(DENSITY),
                intra_layers="embed",
                min_size=MIN_SIZE,
                local_axis="local",
            ),
            rr.optimizers.sgd(0.1, momentum=0.9),
        )
    )

    def loss(p, batch):
        return sum(jax.numpy.sum(x * batch["scale"][0]) for x in jax.tree.leaves(p))

    step = rr.parallel.data_parallel_step(loss, tx, mesh)
    params, state = step.init(jax.tree.map(np.ones_like, PARAMS))
    scale = np.arange(1, W + 1, dtype=np.float32)[:, None]
    params, state, _ = step(params, state, rr.parallel.shard_batch({"scale": scale}, mesh))
    before = jax.device_get((params, state))
    scale[6, 0] = np.nan  # one device of the second node
    params, state, _ = step(params, state, rr.parallel.shard_batch({"scale": scale}, mesh))
    after = jax.device_get((params, state))
    assert int(after[1].skipped) == 1
    jax.tree.map(np.testing.assert_array_equal, before[0], after[0])
    (exchange,) = rr.exchange.exchange_states(after[1])
    (exchange_before,) = rr.exchange.exchange_states(before[1])
    jax.tree.map(np.testing.assert_array_equal, exchange_before.residuals, exchange.residuals)


def test_collectives_tell_their_replica_groups_and_what_a_device_contributes():
    text = "\n".join(
        [
            "%rs = f32[8,500]{1,0} reduce-scatter(%p), channel_id=1, "
            "replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}",
            "%ag = s32[2,400]{1,0} all-gather(%q), replica_groups={{0,4},{1,5},{2,6},{3,7}}",
        ]
    )
    rs, ag = rr.hlo.collectives(text)
    assert rs.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert rs.bytes_per_worker == 4 * 8 * 500 * 4  # the whole operand goes into the sum
    assert ag.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert ag.bytes_per_worker == 400 * 4  # its own part
