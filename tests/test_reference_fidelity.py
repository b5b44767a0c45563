"""The table of docs/reference_code.md, row by row, against numpy.

Every row maps one residual memory of the reference PyTorch code (zqming-cs/ResiReduce,
``resir_lib/memory/``) to arguments of this library. The reference's algorithm is
paraphrased here in numpy, in PyTorch's layout (``Linear`` weights ``[out, in]``, conv
weights ``[out, in, kh, kw]``, embeddings ``[vocab, d]``) and in float32, from its
description, per worker and per layer in backward order:

1. compensate: ``G~ = G + R`` (a group's shared ``R`` of the previous step; for a
   dimension-compressed layer, the stored block added at its rows x columns);
2. compress: top-k of ``|G~|`` with ``k = max(1, int(n * ratio))``, sent and averaged;
3. residual: ``r = G~ - sent``;
4. the store's reduction: kept whole (``residual.py``); summed over the group and divided
   by the member count (``*avg*.py``) or weighted with ``(||G~||_1 / n + ||G~||_2 /
   sqrt(n)) / 2`` (``*weight*.py``, ``resireduce*.py``) once the group's first layer is
   reached; for dimension-compressed layers, the block of ``r`` at the rows and columns
   ranked by the L1 norms of ``G~`` (``dimcprs.py``: all rows x half of the columns of
   the first classifier layer, everything of the others; ``dimcprs2d.py`` and
   ``resireduce*.py``: half x half).

The reference draws the rows and columns with ``torch.multinomial(softmax(norms))``; the
paraphrase takes the top norms instead (``torch.topk``), which the library's
``selection="top"`` must match exactly. That ``selection="softmax_sample"`` draws from the
reference's distribution is checked separately against exact inclusion probabilities.
Layers with one dimension or fewer than 10,000 elements travel dense, as in the
reference's ``check_not_compress``.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import resireduce_jax as rr
from resireduce_jax import residual_stores as stores
from tests import transform_harness as th

DENSITY = 0.01
STEPS = 4
# A small VGG-like model in Flax layout: two reusable conv groups (G1: 3 members, G2: 2),
# a first classifier layer (dimension-compressed by the reference), a second one, word
# embeddings and a bias (dense: 1-D).
SHAPES = {
    "features_17": {"kernel": (3, 3, 32, 48)},
    "features_20": {"kernel": (3, 3, 32, 48)},
    "features_23": {"kernel": (3, 3, 32, 48)},
    "features_30": {"kernel": (3, 3, 48, 48)},
    "features_33": {"kernel": (3, 3, 48, 48)},
    "classifier_0": {"kernel": (160, 96), "bias": (96,)},
    "classifier_3": {"kernel": (96, 128)},
    "word_embeddings": {"embedding": (400, 32)},
}
# Flax path -> the reference's parameter name, in forward (model) order.
TORCH_NAMES = {
    "features_17/kernel": "features.17.weight",
    "features_20/kernel": "features.20.weight",
    "features_23/kernel": "features.23.weight",
    "features_30/kernel": "features.30.weight",
    "features_33/kernel": "features.33.weight",
    "classifier_0/kernel": "classifier.0.weight",
    "classifier_0/bias": "classifier.0.bias",
    "classifier_3/kernel": "classifier.3.weight",
    "word_embeddings/embedding": "bert.embeddings.word_embeddings.weight",
}

# ----------------------------------------------------------- the reference, in numpy

REF_GROUPS = {
    "features.17.weight": "G1",
    "features.20.weight": "G1",
    "features.23.weight": "G1",
    "features.30.weight": "G2",
    "features.33.weight": "G2",
}
# Per dimension-compressed layer: (row ratio, column ratio) of the reference's update.
DIM_D = {  # dimcprs.py: every classifier weight and the embeddings; only classifier.0 shrinks
    "classifier.0.weight": (1.0, 0.5),
    "classifier.3.weight": (1.0, 1.0),
    "bert.embeddings.word_embeddings.weight": (1.0, 1.0),
}
DIM_2D = {  # dimcprs2d.py and resireduce*.py: classifier.0, word embeddings (wte)
    "classifier.0.weight": (0.5, 0.5),
    "bert.embeddings.word_embeddings.weight": (0.5, 0.5),
}
REFERENCE = {
    "residual.py": dict(groups={}, weighted=False, dim={}),
    "residual*avg*.py": dict(groups=REF_GROUPS, weighted=False, dim={}),
    "residual*weight*.py": dict(groups=REF_GROUPS, weighted=True, dim={}),
    "dimcprs.py": dict(groups={}, weighted=False, dim=DIM_D),
    "dimcprs2d.py": dict(groups={}, weighted=False, dim=DIM_2D),
    "resireduce*.py": dict(groups=REF_GROUPS, weighted=True, dim=DIM_2D),
}


def to_torch(path: str, x: np.ndarray) -> np.ndarray:
    """A Flax leaf in PyTorch's layout (the reference's tensors)."""
    if x.ndim == 4:  # conv [kh, kw, in, out] -> [out, in, kh, kw]
        return x.transpose(3, 2, 0, 1)
    if x.ndim == 2 and not path.endswith("embedding"):  # Dense [in, out] -> Linear [out, in]
        return x.T
    return x


def from_torch(path: str, t: np.ndarray) -> np.ndarray:
    if t.ndim == 4:
        return t.transpose(2, 3, 1, 0)
    if t.ndim == 2 and not path.endswith("embedding"):
        return t.T
    return t


def np_top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries (``torch.topk``; the set, sorted)."""
    return np.sort(np.argsort(-values, kind="stable")[:k])


def np_topk_sent(t: np.ndarray) -> np.ndarray:
    """``resir_lib/compressor/topk.py``: the k = max(1, int(n * ratio)) largest |entries|."""
    flat = t.ravel()
    k = max(1, int(flat.size * DENSITY))
    sent = np.zeros_like(flat)
    keep = np_top(np.abs(flat), k)
    sent[keep] = flat[keep]
    return sent.reshape(t.shape)


class ReferenceMemory:
    """One worker's residual memory of the reference code, float32, PyTorch layout."""

    def __init__(self, groups: dict[str, str], weighted: bool, dim: dict[str, tuple]):
        self.groups, self.weighted, self.dim = groups, weighted, dim
        self.residuals: dict[str, object] = {}
        self.partial: dict[str, tuple[np.ndarray, np.float32]] = {}

    def compensate(self, name: str, g: np.ndarray) -> np.ndarray:
        if name in self.dim:
            if name in self.residuals:
                rows, cols, values = self.residuals[name]
                g = g.copy()
                g[np.ix_(rows, cols)] += values
            return g
        key = self.groups.get(name, name)
        return self.residuals[key] + g if key in self.residuals else g

    def update(self, name: str, comp: np.ndarray, sent: np.ndarray, first_in_group: bool):
        r = comp - sent
        if name in self.groups:
            label = self.groups[name]
            if self.weighted:
                n = np.float32(comp.size)
                l1 = np.abs(comp).sum(dtype=np.float32) / n
                l2 = np.sqrt((comp * comp).sum(dtype=np.float32)) / np.sqrt(n)
                weight = np.float32((l1 + l2) / np.float32(2))
            else:
                weight = np.float32(1)
            total, weights = self.partial.get(label, (np.float32(0), np.float32(0)))
            total, weights = total + r * weight, weights + weight
            if first_in_group:  # backward order: the group's first layer comes last
                self.residuals[label] = (total / weights).astype(np.float32)
                self.partial.pop(label, None)
            else:
                self.partial[label] = (total, weights)
        elif name in self.dim:
            row_ratio, col_ratio = self.dim[name]
            m = comp.reshape(comp.shape[0], -1)
            rows = np_top(np.abs(m).sum(1, dtype=np.float32), int(m.shape[0] * row_ratio))
            cols = np_top(np.abs(m).sum(0, dtype=np.float32), int(m.shape[1] * col_ratio))
            self.residuals[name] = (rows, cols, r[np.ix_(rows, cols)])
        else:
            self.residuals[name] = r


def run_reference(reference: str, grads_per_step: list[dict], workers: int):
    """Per step: the averaged output per Flax path; and every worker's final memory."""
    config = REFERENCE[reference]
    memories = [ReferenceMemory(**config) for _ in range(workers)]
    names = list(TORCH_NAMES.values())
    first_member = {
        label: next(n for n in names if REF_GROUPS.get(n) == label) for label in {"G1", "G2"}
    }
    path_of = {name: path for path, name in TORCH_NAMES.items()}
    outputs = []
    for grads in grads_per_step:
        out = {}
        for name in reversed(names):  # backward order, as the gradient hooks fire
            path = path_of[name]
            g = np.stack([to_torch(path, x) for x in grads[path]])
            if g.ndim - 1 == 1 or g[0].size < 10_000:  # check_not_compress: dense, no residual
                out[path] = from_torch(path, g.sum(0, dtype=np.float32) / np.float32(workers))
                continue
            total = np.zeros(g.shape[1:], np.float32)
            for w, memory in enumerate(memories):
                comp = memory.compensate(name, g[w])
                sent = np_topk_sent(comp)
                label = config["groups"].get(name)
                memory.update(name, comp, sent, label is not None and first_member[label] == name)
                total += sent
            out[path] = from_torch(path, total / np.float32(workers))
        outputs.append(out)
    return outputs, memories


# ------------------------------------------------------------------- the library

GROUPING = rr.grouping.regex(
    {r"features_(17|20|23)/kernel": "G1", r"features_(30|33)/kernel": "G2"}
)
INTRA_2D = r"classifier_0/kernel|word_embeddings"
# The reference's weighted shared residual (-w) and 2-D residual (-2d); resireduce*.py (w+2d)
# is both together.
WEIGHTED = dict(grouping=GROUPING, inter="weighted", weight_source="compensated")
TWO_D = dict(
    intra="2d", intra_layers=INTRA_2D, row_ratio=0.5, col_ratio=0.5, norm_source="compensated"
)
# docs/reference_code.md's table: the arguments of ``resireduce`` that reproduce each reference file
# (``None``: ``error_feedback``, which is ``resireduce(inter="none", intra="none")``).
LIBRARY: dict[str, dict | None] = {
    "residual.py": None,
    "residual*avg*.py": dict(grouping=GROUPING, inter="average", intra="none"),
    "residual*weight*.py": dict(WEIGHTED, intra="none"),
    "dimcprs.py": dict(TWO_D, inter="none", intra_layers=r"classifier_0/kernel", row_ratio=1.0),
    "dimcprs2d.py": dict(TWO_D, inter="none"),
    "resireduce*.py": dict(WEIGHTED, **TWO_D),
}


def make(reference: str, **overrides) -> rr.exchange.ExchangeTransformation:
    compressor = rr.compressors.topk(DENSITY)
    kwargs = LIBRARY[reference]
    if kwargs is None:
        return rr.error_feedback(compressor)
    return rr.resireduce(compressor, **{**kwargs, **overrides})


def _params():
    return th.zero_params(SHAPES)


def _flat(tree) -> dict[str, np.ndarray]:
    return dict(zip(rr.tree_paths.leaf_paths(tree), jax.tree.leaves(tree), strict=True))


def _grads(workers: int, seed: int) -> list:
    """``STEPS`` gradient trees with a leading worker axis (heavy-tailed)."""
    return th.random_grad_trees(np.random.default_rng(seed), _params(), workers, STEPS)


def assert_matches(got: np.ndarray, expected: np.ndarray, exact: bool, what: str) -> None:
    """Bit for bit, or (``exact=False``) equal up to float32 rounding.

    Without shared groups every value is one float32 add or subtract of the same operands
    on both sides (and a mean over a power-of-two number of workers), so the library must
    be bit-identical. A group residual ``sum_i w_i r_i / sum_i w_i`` is reduced in other
    trees than the reference's (the weighted sum and the norms), so entries near zero
    carry a few ulps of the largest terms, not of their own value.
    """
    if exact:
        np.testing.assert_array_equal(got, expected, err_msg=what)
        return
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    atol = 8 * np.finfo(np.float32).eps * max(scale, 1.0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=atol, err_msg=what)


def _reference_dense(path: str, memory: ReferenceMemory, config: dict) -> np.ndarray:
    """A worker's reference residual of ``path``, dense, in Flax layout."""
    name = TORCH_NAMES[path]
    if name in config["dim"]:
        rows, cols, values = memory.residuals[name]
        t = np.zeros(to_torch(path, _flat(_params())[path]).shape, np.float32)
        m = t.reshape(t.shape[0], -1)
        m[np.ix_(rows, cols)] = values
        return from_torch(path, t)
    return from_torch(path, memory.residuals[config["groups"].get(name, name)])


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("reference", list(REFERENCE))
def test_library_arguments_reproduce_the_reference(reference, workers):
    grads = _grads(workers, seed=workers)
    ref_out, memories = run_reference(reference, [_flat(g) for g in grads], workers)
    tx = make(reference)
    outputs, state = th.run_shard_map(tx, _params(), grads, num_workers=workers)
    plan = tx.plan(_params())
    exact = not REFERENCE[reference]["groups"]

    # The exchanged mean, every step, on every worker.
    for step, (out, ref) in enumerate(zip(outputs, ref_out, strict=True)):
        out = _flat(out)
        assert set(out) == set(ref)
        for path, expected in ref.items():
            for w in range(workers):
                assert_matches(out[path][w], expected, exact, f"{path} step {step}")

    # The memory every worker ends with: the same kept rows and columns, the same values.
    config = REFERENCE[reference]
    dense = rr.exchange.leaf_residuals(state, plan, dense_only=False)
    for path, name in TORCH_NAMES.items():
        store = plan.store_of(path)
        if store is None:  # travels dense: no residual on either side
            assert all(name not in m.residuals for m in memories), path
            continue
        for w, memory in enumerate(memories):
            expected = _reference_dense(path, memory, config)
            if store.shared:
                assert store.group.label == config["groups"][name]
                got = state.residuals[store.group.label][w]
            else:
                got = dense[path][w]
            assert_matches(got, expected, exact, path)
            if name not in config["dim"]:
                continue
            rows, cols, values = memory.residuals[name]
            if store.kind == "2d":
                kept = state.residuals[path]
                np.testing.assert_array_equal(np.asarray(kept.rows[w]), rows, err_msg=path)
                np.testing.assert_array_equal(np.asarray(kept.cols[w]), cols, err_msg=path)
                assert kept.values[w].size == values.size
            else:  # every row and column kept by the reference: the whole residual
                assert store.kind == "leaf" and values.size == math.prod(store.group.shape)


def test_dimcprs_keeps_all_rows_and_half_of_the_columns():
    """The reference's ResiReduce-d shrinks the first classifier layer to rows x 50 % of
    the columns (fan-in) and keeps its other layers whole: that is 50 % of the layer, not
    the paper's 25 % of the rows."""
    plan = make("dimcprs.py").plan(_params())
    store = plan.store_of("classifier_0/kernel")
    assert (store.kind, store.keep_rows, store.keep_cols) == ("2d", 96, 80)  # torch [96, 160]
    for path in ("classifier_3/kernel", "word_embeddings/embedding"):
        assert plan.store_of(path).kind == "leaf"
    itemsize = 4
    full = math.prod(SHAPES["classifier_0"]["kernel"]) * itemsize
    assert stores.stored_bytes(store) == full // 2 + (96 + 80) * 4  # values + indices


@pytest.mark.parametrize("reference", ["dimcprs.py", "dimcprs2d.py"])
def test_residual_norms_would_not_reproduce_the_reference(reference):
    """The default ``norm_source="residual"`` ranks columns by ``r``, not ``G~``: on this
    data it keeps other columns than the reference does, so the argument matters."""
    workers = 2
    grads = _grads(workers, seed=7)
    _, memories = run_reference(reference, [_flat(g) for g in grads], workers)
    _, state = th.run_shard_map(
        make(reference, norm_source="residual"), _params(), grads, num_workers=workers
    )
    kept = state.residuals["classifier_0/kernel"]
    ref_cols = [m.residuals["classifier.0.weight"][1] for m in memories]
    assert any(not np.array_equal(np.asarray(kept.cols[w]), ref_cols[w]) for w in range(workers))


# ------------------------------------------------------- softmax_sample, in distribution


def inclusion_probabilities(p: np.ndarray, k: int) -> np.ndarray:
    """P(i is drawn) by ``torch.multinomial(p, k, replacement=False)``: sequential draws,
    each proportional to ``p`` among the entries not drawn yet (exact, by enumeration)."""
    out = np.zeros_like(p)
    for order in itertools.permutations(range(p.size), k):
        prob, left = 1.0, 1.0
        for i in order:
            prob *= p[i] / left
            left -= p[i]
        out[list(order)] += prob
    return out


def test_softmax_sample_draws_rows_and_columns_as_the_reference():
    """``selection="softmax_sample"`` keeps row ``i`` (column ``j``) with the probability
    that ``torch.multinomial(softmax(norms), k, replacement=False)`` draws it."""
    params = {"layer": {"kernel": np.zeros((6, 7), np.float32)}}  # 7 rows (out), 6 cols (in)
    tx = rr.resireduce(
        rr.compressors.topk(0.1),
        inter="none",
        intra="2d",
        intra_layers="layer",
        row_ratio=0.3,
        col_ratio=0.5,
        selection="softmax_sample",
        norm_source="compensated",
        min_size=1,
    )
    (store,) = tx.plan(params).kept
    assert (store.keep_rows, store.keep_cols) == (2, 3)
    row_norms = np.array([0.0, 0.4, 0.8, 1.2, 1.6, 2.0, 2.4], np.float32)
    col_norms = np.array([1.5, 0.0, 0.7, 0.2, 1.1, 0.3], np.float32)
    norms = stores.DimensionNorms(jnp.asarray(row_norms), jnp.asarray(col_norms))
    r = jnp.zeros((6, 7), jnp.float32)
    draws = 20_000
    keys = jax.random.split(jax.random.PRNGKey(0), draws)
    kept = jax.jit(jax.vmap(lambda key: stores.compress_residual(store, r, key, norms)))(keys)
    for picked, n, k in ((kept.rows, row_norms, 2), (kept.cols, col_norms, 3)):
        picked = np.asarray(picked)
        assert all(len(set(row)) == k for row in picked[:100])  # without replacement
        freq = np.bincount(picked.ravel(), minlength=n.size) / draws
        softmax = np.exp(n - n.max()) / np.exp(n - n.max()).sum()
        expected = inclusion_probabilities(softmax.astype(np.float64), k)
        np.testing.assert_allclose(expected.sum(), k)
        # 20,000 draws: standard error <= 0.0036; 5 sigma.
        np.testing.assert_allclose(freq, expected, atol=0.018)
