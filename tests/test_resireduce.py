"""ResiReduce against an independent numpy implementation of the paper's formulas (§4.2, §4.3)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import resireduce_jax as rr
from tests import transform_harness as th

W = 8
DENSITY = 0.05
MIN_SIZE = 1000
# Three same-shape blocks (a reusable group), an odd one, an embedding and a big "specific"
# kernel for intra-layer reduction; a bias that travels dense.
SHAPES = {
    "block_0": {"kernel": (30, 50)},
    "block_1": {"kernel": (30, 50)},
    "block_2": {"kernel": (30, 50)},
    "proj": {"kernel": (50, 40)},
    "big": {"kernel": (6, 10, 60)},  # conv-like: 2-D view [60 inputs, 60 outputs]
    "embed": {"embedding": (120, 20)},
    "head": {"bias": (40,)},
}
GROUP = ("block_0/kernel", "block_1/kernel", "block_2/kernel")


def _params():
    return th.zero_params(SHAPES)


def _grads(steps=3, seed=0):
    return th.random_grad_trees(np.random.default_rng(seed), _params(), W, steps)


def _flat(tree):
    return {
        k: v for k, v in zip(rr.tree_paths.leaf_paths(tree), jax.tree.leaves(tree), strict=True)
    }


# ------------------------------------------------------------------ numpy reference


def np_weight(x: np.ndarray, phi: float = 0.5) -> float:
    x = x.astype(np.float64)
    n = x.size
    return phi * np.abs(x).sum() / n + (1 - phi) * np.sqrt((x * x).sum()) / np.sqrt(n)


def torch_layout(path: str, x: np.ndarray) -> np.ndarray:
    """The paper's 2-D tensor in PyTorch layout: [out, in*...] for kernels, [vocab, d] tables."""
    if path.endswith("embedding"):
        return x.reshape(x.shape[0], -1)
    return x.reshape(-1, x.shape[-1]).T


def np_keep_2d(path, r, row_ratio, col_ratio, ranked_by=None):
    """ResiReduce-2d (Fig. 7c): rows and columns of largest L1 norm; keep the intersection.

    ``ranked_by``: the array whose norms rank rows and columns (default ``r`` itself; the
    reference code passes the compensated gradient)."""
    t = torch_layout(path, r)
    n = np.abs(torch_layout(path, r if ranked_by is None else ranked_by).astype(np.float64))
    kr = max(1, int(np.floor(row_ratio * t.shape[0])))
    rows = np.sort(np.argsort(-n.sum(1), kind="stable")[:kr])
    if col_ratio is None:  # ResiReduce-d (Fig. 7b): whole rows
        cols = np.arange(t.shape[1])
    else:
        kc = max(1, int(np.floor(col_ratio * t.shape[1])))
        cols = np.sort(np.argsort(-n.sum(0), kind="stable")[:kc])
    kept = np.zeros_like(t)
    kept[np.ix_(rows, cols)] = t[np.ix_(rows, cols)]
    back = kept.T.reshape(r.shape) if not path.endswith("embedding") else kept.reshape(r.shape)
    return back, rows, cols


def np_resireduce(
    grads_per_step,
    *,
    inter,
    intra,
    intra_paths,
    weight_source="residual",
    norm_source="residual",
    row_ratio=None,
    col_ratio=0.5,
    store_dtype=np.float32,
    scope="leaf",
):
    """Per worker: EF with group-shared residuals (§4.2) and intra-layer reduction (§4.3);
    ``scope="global"``: one Top-k over every compensated member at once."""
    params = _flat(_params())
    compressed = [p for p, x in params.items() if x.ndim >= 2 and x.size >= MIN_SIZE]
    groups = [list(GROUP)] if inter != "none" else []
    grouped = {p for g in groups for p in g}
    groups += [[p] for p in compressed if p not in grouped]
    if row_ratio is None:
        row_ratio = 0.25 if intra == "rows" else 0.5
    cols = None if intra == "rows" else col_ratio
    stored = {g[0]: np.zeros((W, *params[g[0]].shape), np.float32) for g in groups}
    outputs = []
    for grads in grads_per_step:
        grads = _flat(grads)
        out = {p: grads[p].astype(np.float64).mean(0) for p in params if p not in compressed}
        sent_sum = {p: np.zeros(params[p].shape) for p in compressed}
        for w in range(W):
            comps = {p: grads[p][w] + stored[g[0]][w].astype(np.float32) for g in groups for p in g}
            sent = _np_select(comps, scope)
            for g in groups:
                rs, weights = [], []
                for p in g:
                    sent_sum[p] += sent[p]
                    rs.append(comps[p] - sent[p])
                    source = comps[p] if weight_source == "compensated" else rs[-1]
                    weights.append(1.0 if inter == "average" else np_weight(source))
                if len(g) > 1:
                    total = sum(
                        wt * r.astype(np.float64) for wt, r in zip(weights, rs, strict=True)
                    )
                    new = total / sum(weights)
                elif intra != "none" and g[0] in intra_paths:
                    ranked_by = comps[g[0]] if norm_source == "compensated" else None
                    new = np_keep_2d(g[0], rs[0], row_ratio, cols, ranked_by)[0]
                else:
                    new = rs[0]
                stored[g[0]][w] = new.astype(store_dtype).astype(np.float32)
        for p in compressed:
            out[p] = sent_sum[p] / W
        outputs.append(out)
    return outputs, stored


def _np_select(comps: dict[str, np.ndarray], scope: str) -> dict[str, np.ndarray]:
    """What one worker sends of each compensated leaf: Top-k of each (``"leaf"``) or of
    their concatenation (``"global"``)."""
    if scope == "leaf":
        return {p: th.np_topk_sparsify(c, DENSITY) for p, c in comps.items()}
    flat = th.np_topk_sparsify(np.concatenate([c.ravel() for c in comps.values()]), DENSITY)
    bounds = np.cumsum([0, *(c.size for c in comps.values())])
    return {
        p: flat[a:b].reshape(c.shape)
        for (p, c), a, b in zip(comps.items(), bounds[:-1], bounds[1:], strict=True)
    }


VARIANTS = {
    "a": dict(inter="average", intra="none"),
    "w": dict(inter="weighted", intra="none"),
    "w-compensated": dict(inter="weighted", intra="none", weight_source="compensated"),
    "rows": dict(inter="none", intra="rows"),
    "2d": dict(inter="none", intra="2d"),
    "rows-compensated-norms": dict(inter="none", intra="rows", norm_source="compensated"),
    "2d-compensated-norms": dict(inter="none", intra="2d", norm_source="compensated"),
    "w+2d": dict(inter="weighted", intra="2d"),
    "w+2d-bf16": dict(inter="weighted", intra="2d", residual_dtype="bfloat16"),
}
INTRA = "big|embed"
INTRA_PATHS = ("big/kernel", "embed/embedding")


@pytest.fixture(scope="module")
def grads():
    return _grads()


def _blocks_resireduce(**options):
    """Top-k ResiReduce with the three blocks as one reusable group and the INTRA leaves."""
    return rr.resireduce(
        rr.compressors.topk(DENSITY),
        grouping=rr.grouping.regex({r"block_\d+/kernel": "blocks"}),
        intra_layers=INTRA,
        min_size=MIN_SIZE,
        **options,
    )


@pytest.mark.parametrize(
    "name, scope",
    [(name, "leaf") for name in VARIANTS]
    + [(name, "global") for name in ("a", "w-compensated", "2d-compensated-norms", "w+2d")],
)
def test_variant_matches_numpy_reference(grads, name, scope):
    """Every variant step by step against numpy; under whole-model Top-k
    (``selection_scope="global"``) the stores keep what the joint selection left."""
    opts = dict(VARIANTS[name])
    store_dtype = ml_dtypes.bfloat16 if opts.get("residual_dtype") == "bfloat16" else np.float32
    tx = _blocks_resireduce(selection_scope=scope, **opts)
    outputs, state = th.run_shard_map(tx, _params(), grads)
    intra_paths = {"big/kernel", "embed/embedding"}
    opts.pop("residual_dtype", None)
    ref_out, ref_stored = np_resireduce(
        grads, intra_paths=intra_paths, store_dtype=store_dtype, scope=scope, **opts
    )
    atol = 1e-5 if store_dtype is np.float32 else 2e-2
    for out, ref in zip(outputs, ref_out, strict=True):
        out = _flat(out)
        for path, expected in ref.items():
            for w in range(W):
                np.testing.assert_allclose(
                    out[path][w], expected, rtol=1e-5, atol=atol, err_msg=path
                )
    # Stored residuals, rebuilt dense, equal the reference on every worker.
    residuals = state.residuals
    if opts["inter"] != "none":
        np.testing.assert_allclose(
            np.asarray(residuals["blocks"], np.float32), ref_stored[GROUP[0]], rtol=1e-5, atol=atol
        )
        assert residuals["blocks"].shape == (W, 30, 50)  # one residual for three layers
    for path in intra_paths:
        dense = _dense_intra(residuals[path], path, opts["intra"])
        np.testing.assert_allclose(dense, ref_stored[path], rtol=1e-5, atol=atol, err_msg=path)


def _dense_intra(stored, path, intra):
    """Rebuilds a dense per-worker residual from stored rows/blocks (for comparison)."""
    shape = _flat(_params())[path].shape
    if intra == "none":
        return np.asarray(stored, np.float32)
    view = rr.residual_stores.matrix_view(path, shape)
    out = np.zeros((W, *view.shape2d), np.float32)
    for w in range(W):
        values = np.asarray(stored.values[w], np.float32)
        rows = np.asarray(stored.rows[w])
        if intra == "rows":
            if view.row_axis == 0:
                out[w][rows, :] = values
            else:
                out[w][:, rows] = values
        else:
            cols = np.asarray(stored.cols[w])
            i0, i1 = (rows, cols) if view.row_axis == 0 else (cols, rows)
            out[w][np.ix_(i0, i1)] = values
    return out.reshape(W, *shape)


@pytest.mark.parametrize("compressor", [rr.compressors.topk(0.03), rr.compressors.randomk(0.03)])
def test_no_reduction_equals_error_feedback_bit_for_bit(grads, compressor):
    ef = rr.error_feedback(compressor, min_size=MIN_SIZE)
    plain = rr.resireduce(compressor, inter="none", intra="none", min_size=MIN_SIZE)
    out_ef, state_ef = th.run_shard_map(ef, _params(), grads)
    out_rr, state_rr = th.run_shard_map(plain, _params(), grads)
    chex.assert_trees_all_equal(out_ef, out_rr)
    for path, residual in _flat(state_ef.residuals).items():
        np.testing.assert_array_equal(state_rr.residuals[path], residual)


def test_shard_map_and_pmap_agree(grads):
    tx = _blocks_resireduce()
    out_sm, state_sm = th.run_shard_map(tx, _params(), grads)
    out_pm, state_pm = th.run_pmap(tx, _params(), grads)
    chex.assert_trees_all_equal(out_sm, out_pm)
    chex.assert_trees_all_equal(state_sm.residuals, state_pm.residuals)


def test_softmax_sampling_draws_valid_rows_differently_per_worker(grads):
    tx = rr.resireduce(
        rr.compressors.topk(DENSITY),
        inter="none",
        intra="rows",
        intra_layers="big",
        selection="softmax_sample",
        min_size=MIN_SIZE,
    )
    _, state = th.run_shard_map(tx, _params(), grads[:1])
    rows = np.asarray(state.residuals["big/kernel"].rows)  # [W, 15] of 60 output units
    assert rows.shape == (W, 15)
    for w in range(W):
        assert np.all(np.diff(rows[w]) > 0) and rows[w].min() >= 0 and rows[w].max() < 60
    assert len({tuple(r) for r in rows}) > 1


def test_weight_guard_when_all_members_are_zero():
    params = {f"block_{i}": {"kernel": np.zeros((30, 50), np.float32)} for i in range(3)}
    zeros = [jax.tree.map(lambda p: np.zeros((W, *p.shape), np.float32), params)]
    tx = rr.resireduce(rr.compressors.topk(DENSITY), min_size=MIN_SIZE, intra="none")
    out, state = th.run_shard_map(tx, params, zeros)
    for r in jax.tree.leaves(state.residuals):
        np.testing.assert_array_equal(r, 0.0)  # no 0/0
    for o in jax.tree.leaves(out):
        np.testing.assert_array_equal(o, 0.0)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(inter="median"), "inter='median' is not valid"),
        (dict(intra="3d"), "intra='3d' is not valid"),
        (dict(selection="random"), "selection='random'"),
        (dict(weight_source="gradient"), "weight_source='gradient'"),
        (dict(norm_source="gradient"), "norm_source='gradient'"),
        (dict(row_ratio=0.0), "row_ratio must be in"),
        (dict(col_ratio=1.5), "col_ratio must be in"),
        (dict(row_ratio=float("nan")), "row_ratio must be in"),
        (dict(phi=2.0), "phi must be"),
        (dict(residual_dtype=jnp.int8), "residual_dtype must be a floating"),
    ],
)
def test_invalid_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rr.resireduce(rr.compressors.topk(0.01), **kwargs)


@pytest.mark.parametrize(
    "intra_layers, message",
    [
        ("nothing_matches", "matches no leaf"),
        ("head", "ndim >= 2"),
        ("block_0", "shares a group residual"),
    ],
)
def test_invalid_intra_layers(intra_layers, message):
    tx = rr.resireduce(
        rr.compressors.topk(0.01), intra_layers=intra_layers, min_size=MIN_SIZE, intra="2d"
    )
    with pytest.raises(ValueError, match=message):
        tx.init(_params())


def test_intra_layer_below_min_size_is_refused():
    params = {"small": {"kernel": np.zeros((10, 10), np.float32)}, **_params()}
    tx = rr.resireduce(rr.compressors.topk(0.01), intra_layers="small", min_size=MIN_SIZE)
    with pytest.raises(ValueError, match="fewer than min_size"):
        tx.init(params)


def test_intra_layers_skips_the_biases_it_matches():
    """r"dense_0/" hits a kernel and its bias: the kernel keeps a 2-D residual, the bias
    (a vector, which travels dense) is skipped rather than refused."""
    params = th.zero_params(
        {
            "dense_0": {"kernel": (40, 60), "bias": (60,)},
            "dense_1": {"kernel": (60, 50), "bias": (50,)},
        }
    )
    tx = rr.resireduce(
        rr.compressors.topk(0.01), intra_layers=r"dense_0/", intra="2d", min_size=MIN_SIZE
    )
    plan = tx.plan(params)
    assert plan.store_of("dense_0/kernel").kind == "2d"
    assert plan.store_of("dense_1/kernel").kind == "leaf"
    assert plan.store_of("dense_0/bias") is None
    state = tx.init(params)
    assert set(state.residuals) == {"dense_0/kernel", "dense_1/kernel"}
    assert state.residuals["dense_0/kernel"].rows.shape == (30,)  # half of 60 output units


def test_intra_layers_that_matches_no_leaf_names_the_rule_and_the_fix():
    tx = rr.resireduce(rr.compressors.topk(0.01), intra_layers=r"blocks_0/", min_size=MIN_SIZE)
    with pytest.raises(ValueError, match=r"intra_layers='blocks_0/' matches no leaf") as info:
        tx.init(_params())
    assert "block_0/kernel" in str(info.value) and "re.search" in str(info.value)


def test_group_with_mismatched_shapes_names_the_leaves():
    tx = rr.resireduce(
        rr.compressors.topk(0.01),
        grouping=rr.grouping.regex({r"(block_0|proj)/kernel": "mixed"}),
        min_size=MIN_SIZE,
    )
    with pytest.raises(
        ValueError,
        match=r"Group 'mixed' mixes shapes.*'(block_0|proj)/kernel'.*'(proj|block_0)/kernel'",
    ):
        tx.init(_params())


# ------------------------------------------------------------------ memory at the compiled peak


def _mlp_loss(num_layers):
    def loss(params, batch):
        h = batch["x"]
        for i in range(num_layers):
            h = jnp.tanh(h @ params[f"layer_{i}"]["kernel"])
        return jnp.mean(h**2)

    return loss


def test_compiled_peak_drops_by_the_residual_state_saving():
    """9 layers of 512x512 (1 MiB), 3 groups of 3: the state saves 6 residuals (6 MiB).

    The jitted, donated step's peak (argument + output - alias + temp) must drop by at least
    80 % of that; the running-sum ordering in resireduce keeps transient member residuals
    from piling up (measured: the whole saving)."""
    layers, width = 9, 512
    params = {f"layer_{i}": {"kernel": np.zeros((width, width), np.float32)} for i in range(layers)}
    mesh = rr.parallel.make_mesh(W)
    batch = rr.parallel.shard_batch({"x": np.ones((W * 2, width), np.float32)}, mesh)

    def peak(transform):
        tx = optax.chain(transform, optax.sgd(0.1, momentum=0.9))
        return th.step_memory(_mlp_loss(layers), tx, params, batch, mesh).peak

    topk = rr.compressors.topk(0.01)
    baseline = peak(rr.error_feedback(topk))
    state_saving = 6 * width * width * 4
    for inter in ("average", "weighted"):
        reduced = peak(rr.resireduce(topk, inter=inter, intra="none"))
        assert baseline - reduced >= 0.8 * state_saving, (inter, baseline, reduced)


# ------------------------------------------------------------------ norm_source (§4.3)


def test_norm_source_changes_the_kept_rows_and_columns(grads):
    """On this data the compensated gradient and the fresh residual rank rows and columns
    differently, so the numpy comparisons above tell the two norm sources apart."""

    def kept(norm_source):
        tx = rr.resireduce(
            rr.compressors.topk(DENSITY),
            inter="none",
            intra="2d",
            intra_layers=INTRA,
            norm_source=norm_source,
            min_size=MIN_SIZE,
        )
        _, state = th.run_shard_map(tx, _params(), grads)
        residuals = state.residuals
        return {
            p: (np.asarray(residuals[p].rows), np.asarray(residuals[p].cols)) for p in INTRA_PATHS
        }

    by_residual, by_compensated = kept("residual"), kept("compensated")
    for path in INTRA_PATHS:
        rows_r, cols_r = by_residual[path]
        rows_c, cols_c = by_compensated[path]
        assert not (np.array_equal(rows_r, rows_c) and np.array_equal(cols_r, cols_c)), path


def test_compensated_norms_keep_no_second_leaf_sized_buffer():
    """``norm_source="compensated"`` reads two norm vectors of G~ before G~ is consumed: the
    compiled peak of a step with one 4 MiB 2d layer grows by far less than the leaf."""
    width = 1024
    params = {"big": {"kernel": np.zeros((width, width), np.float32)}}
    mesh = rr.parallel.make_mesh(W)
    batch = rr.parallel.shard_batch({"x": np.ones((W * 2, width), np.float32)}, mesh)

    def peak(norm_source):
        exchange = rr.resireduce(
            rr.compressors.topk(0.01), inter="none", intra_layers="big", norm_source=norm_source
        )
        tx = optax.chain(exchange, optax.sgd(0.1))
        return th.step_memory(_mlp_loss_named("big"), tx, params, batch, mesh).peak

    leaf = width * width * 4
    by_residual, by_compensated = peak("residual"), peak("compensated")
    assert by_compensated - by_residual < leaf // 4, (by_residual, by_compensated)


def _mlp_loss_named(name):
    def loss(params, batch):
        return jnp.mean(jnp.tanh(batch["x"] @ params[name]["kernel"]) ** 2)

    return loss
