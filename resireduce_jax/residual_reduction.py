"""ResiReduce: error feedback with reduced residual memory, as an optax transform.

Zheng et al., "Saving Memory via Residual Reduction for DNN Training with Compressed
Communication" (code: https://github.com/YuchongHu/ResiReduce): residuals shared across
groups of similar adjacent layers (§4.2, -a / -w) and compressed inside large single
layers (§4.3, -d / -2d). This module decides from shapes which store keeps each leaf's
residual (:func:`plan_stores`); the exchange runs them. Details: docs/design.md,
"Residual stores (residual_stores.py)".
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np

from resireduce_jax import grouping as grouping_lib
from resireduce_jax import residual_stores as stores
from resireduce_jax.compressors.base import Compressor
from resireduce_jax.exchange import DEFAULT_MIN_SIZE, AxisName, ExchangeTransformation, exchange
from resireduce_jax.layer_stacks import LayerStacks
from resireduce_jax.transforms import check_compressor, check_min_size, residual_storage
from resireduce_jax.tree_paths import leaf_paths, no_match_hint

PyTree = Any
IntraLayers = str | Callable[[str, tuple[int, ...]], bool]

__all__ = ["INTRA_AUTO_SHARE", "plan_stores", "resireduce"]

INTER_MODES = ("none", "average", "weighted")
INTRA_MODES = ("none", "rows", "2d")
SELECTIONS = ("top", "softmax_sample")
WEIGHT_SOURCES = ("residual", "compensated")
NORM_SOURCES = ("residual", "compensated")
INTRA_AUTO_SHARE = 0.10
"""``intra_layers="auto"`` picks singleton leaves holding at least this share of all
compressed elements (VGG-19's first classifier layer, GPT-2's and BERT's word embeddings)."""


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}.")
    return value


def _check_ratio(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}.") from None
    if not 0.0 < v <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}.")
    return v


def _intra_predicate(intra_layers: IntraLayers, total_elements: int):
    if intra_layers == "auto":
        return lambda path, shape: math.prod(shape) >= INTRA_AUTO_SHARE * total_elements
    if isinstance(intra_layers, str):
        try:
            pattern = re.compile(intra_layers)
        except re.error as e:
            raise ValueError(f"intra_layers regex {intra_layers!r} is invalid: {e}.") from None
        return lambda path, shape: pattern.search(path) is not None
    if callable(intra_layers):
        return intra_layers
    raise ValueError(
        "intra_layers must be a regex string, a predicate (path, shape) -> bool, or 'auto'; "
        f"got {intra_layers!r}."
    )


def plan_stores(
    params: PyTree,
    *,
    grouping: grouping_lib.Grouping,
    min_size: int = DEFAULT_MIN_SIZE,
    inter: str = "weighted",
    intra: str = "2d",
    intra_layers: IntraLayers = "auto",
    row_ratio: float | None = None,
    col_ratio: float = 0.5,
    selection: str = "top",
    phi: float = 0.5,
    weight_source: str = "residual",
    norm_source: str = "residual",
    residual_dtype: Any = None,
    residual_format: Any = None,
) -> list[stores.StorePlan]:
    """Decides, from shapes only, how every group's residual is stored.

    Arguments as in :func:`resireduce`. Returns one :class:`StorePlan` per group, in order
    of the groups' first leaves. Raises ValueError for invalid combinations.
    """
    if inter == "none":
        grouping = grouping_lib.each_leaf()
    groups = grouping_lib.resolve(params, grouping, min_size)
    total = sum(g.size * len(g.members) for g in groups)
    wants_intra = _intra_predicate(intra_layers, total) if intra != "none" else None

    if row_ratio is None:
        row_ratio = 0.25 if intra == "rows" else 0.5
    row_ratio = _check_ratio("row_ratio", row_ratio)
    col_ratio = _check_ratio("col_ratio", col_ratio)

    if wants_intra is not None and intra_layers != "auto":
        wants_intra = _usable_intra(wants_intra, params, groups, intra_layers, min_size)

    plans = []
    for g in groups:
        dtype = np.dtype(residual_dtype) if residual_dtype is not None else g.dtype
        common = dict(
            group=g, dtype=dtype, phi=phi, weight_source=weight_source, format=residual_format
        )
        if len(g.members) > 1:
            plans.append(stores.StorePlan(kind=inter, **common))
        elif wants_intra is not None and wants_intra(g.paths[0], g.shape):
            view = stores.matrix_view(g.paths[0], g.shape)
            keep_rows = max(1, math.floor(row_ratio * view.num_rows))
            keep_cols = max(1, math.floor(col_ratio * view.num_cols)) if intra == "2d" else 0
            plans.append(
                stores.StorePlan(
                    kind=intra,
                    view=view,
                    keep_rows=keep_rows,
                    keep_cols=keep_cols,
                    selection=selection,
                    norm_source=norm_source,
                    **common,
                )
            )
        else:
            plans.append(stores.StorePlan(kind="leaf", **common))
    return plans


def _usable_intra(wants_intra, params, groups, intra_layers, min_size):
    """``intra_layers`` narrowed to the leaves it can reduce: compressed (so ``ndim >= 2``)
    singleton leaves. Vectors and leaves under ``min_size`` it also matches travel dense
    and are skipped; a compressed leaf in a shared group raises (the grouping wins, §4.3);
    so does a rule that selects no usable leaf."""
    paths = leaf_paths(params)
    usable = set()
    for g in groups:
        matched = [p for p in g.paths if wants_intra(p, g.shape)]
        if not matched:
            continue
        if len(g.members) > 1:
            raise ValueError(
                f"intra_layers matches '{matched[0]}', which shares a group residual with "
                "other layers; intra-layer reduction applies to singleton groups (§4.3). "
                "Narrow the pattern or change the grouping."
            )
        usable.add(g.paths[0])
    if not usable:
        shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params)]
        hit = [f"'{p}' {s}" for p, s in zip(paths, shapes, strict=True) if wants_intra(p, s)]
        if not hit:
            hint = no_match_hint(intra_layers, paths) if isinstance(intra_layers, str) else ""
            raise ValueError(
                f"intra_layers={intra_layers!r} matches no leaf, so intra-layer reduction "
                f"would do nothing. {hint} Or pass intra='none'."
            )
        raise ValueError(
            f"intra_layers={intra_layers!r} matches only leaves that travel dense "
            f"({', '.join(hit[:4])}): intra-layer reduction needs a compressed leaf with "
            f"ndim >= 2 (leaves with ndim <= 1 or fewer than min_size={min_size} elements "
            "keep no residual). Widen the pattern or pass intra='none'."
        )
    return lambda path, shape: path in usable


def resireduce(
    compressor: Compressor,
    axis_name: AxisName = "data",
    *,
    local_axis: str | None = None,
    layer_stacks: LayerStacks | None = None,
    grouping: grouping_lib.Grouping | None = None,
    inter: Literal["none", "average", "weighted"] = "weighted",
    intra: Literal["none", "rows", "2d"] = "2d",
    intra_layers: IntraLayers = "auto",
    row_ratio: float | None = None,
    col_ratio: float = 0.5,
    selection: Literal["top", "softmax_sample"] = "top",
    phi: float = 0.5,
    weight_source: Literal["residual", "compensated"] = "residual",
    norm_source: Literal["residual", "compensated"] = "residual",
    residual_dtype: Any = None,
    min_size: int = DEFAULT_MIN_SIZE,
    seed: int = 0,
    selection_scope: Literal["leaf", "global"] = "leaf",
    residual_format: Any = None,
) -> ExchangeTransformation:
    """Compressed gradient averaging with error feedback and reduced residuals.

    Args:
      compressor: a compressor from :mod:`resireduce_jax.compressors` (e.g. ``topk(0.01)``).
      axis_name: the mapped axis of the data-parallel workers (shard_map or pmap), or a
        tuple of axes (a flat exchange over all of them).
      local_axis: hierarchical exchange over a node's devices (``None``: flat). Every
        store is sharded over ``local_axis`` (``1/L`` per device); member weights and
        row/column norms are taken over the whole layer, and the selection along the
        split dimension of an intra-layer store is made per shard
        (:mod:`resireduce_jax.residual_stores`, :mod:`resireduce_jax.exchange`). The
        compressor's ratio applies to each shard (multiply it by ``L`` to keep a flat
        run's bytes per device).
      layer_stacks: ``{regex: axis}`` declaring the leaves that stack a weight of every
        layer (a model scanned over its layers, e.g. ``{"h": 0}``) and their layer axis.
        Every slice is then a layer in every sense: compressed on its own, grouped
        (``grouping`` and ``intra_layers`` see slice paths such as
        ``h/3/attn/c_attn/kernel``, so adjacent layers are adjacent slices), stored (a
        group of adjacent slices keeps one residual, kept with its neighbours as a slice
        range of the stack) and counted: the transform is the same transform on the
        unstacked pytree (:mod:`resireduce_jax.layer_stacks`), to float32 rounding.
      grouping: which leaves share a residual: a labels pytree or a callable
        ``params -> labels`` (:mod:`resireduce_jax.grouping`); default
        ``grouping.auto()`` (adjacent same-role, same-shape leaves, up to 3).
      inter: ``"none"`` (every leaf keeps its own residual: exactly
        :func:`~resireduce_jax.error_feedback`), ``"average"`` (ResiReduce-a, §4.2) or
        ``"weighted"`` (ResiReduce-w, §4.2).
      intra: ``"none"``, ``"rows"`` (ResiReduce-d, §4.3) or ``"2d"`` (ResiReduce-2d, §4.3),
        applied to singleton groups selected by ``intra_layers``.
      intra_layers: a regex ``re.search``-ed in leaf paths (the library's convention,
        :mod:`resireduce_jax.tree_paths`), a predicate ``(path, shape) -> bool``, or
        ``"auto"``: singleton leaves with at least ``INTRA_AUTO_SHARE`` (10 %) of all
        compressed elements. A regex or predicate selects the compressed (``ndim >= 2``)
        leaves it matches: ``r"dense_0/"`` reduces ``dense_0/kernel`` and leaves its bias
        dense. It raises if it selects none, or a member of a shared group.
      row_ratio: fraction of rows kept (default 0.25 for ``"rows"``, 0.5 for ``"2d"``: both
        keep 25 % of the elements, as in the paper's Fig. 7). The reference code's
        ResiReduce-d (``dimcprs.py``) keeps all rows and half of the columns instead:
        ``intra="2d", row_ratio=1.0, col_ratio=0.5`` (docs/reference_code.md).
      col_ratio: fraction of columns kept by ``"2d"``.
      selection: ``"top"`` (rows/columns of largest L1 norm, the paper) or
        ``"softmax_sample"`` (sampled without replacement with probabilities
        ``softmax(L1 norms)``, the reference code).
      phi: weight of the L1 term in ResiReduce-w's member weights.
      weight_source: ``"residual"`` (weights from the members' residuals, the paper) or
        ``"compensated"`` (from the compensated gradients, the reference code).
      norm_source: what ``intra`` ranks rows and columns by: the L1 norms of the fresh
        residual ``G~ - D(P)`` (``"residual"``, the paper's §4.3 reading) or of the
        compensated gradient ``G~`` (``"compensated"``, the reference code's ``update``
        in ``dimcprs.py``, ``dimcprs2d.py``, ``resireduce*.py``). Used with both
        ``selection`` modes.
      residual_dtype: an alias of ``residual_format`` for a float dtype.
      residual_format: how every store keeps its values, shared, rows and 2-D blocks
        included, as :func:`~resireduce_jax.error_feedback` takes it (``"bfloat16"``,
        ``"int8"``, ``"float8"``, ``"int4"``, a ``BlockFormat``); default: the leaf's
        dtype. Beyond the paper.
      min_size: leaves with fewer elements (or ``ndim <= 1``) travel dense, no residual.
      seed: seed of the per-step keys (compressor randomness, softmax sampling).
      selection_scope: ``"leaf"`` (default, the paper): a sparsifier sends its density of
        every member; ``"global"``: a Top-k compressor sends its density of all compressed
        members together, ranked by magnitude across layers (whole-model Top-k, beyond the
        paper; :mod:`resireduce_jax.exchange`). The stores are the same: each keeps what its
        members did not send. Flat exchanges without layer stacks, every phase Top-k or
        dense, one dtype. The compensated gradients of every shared or 2-D member are
        alive at once (no member is finished before the joint selection), so its peak
        can be above error feedback's (benchmarks/results/peak_memory_global): use
        :func:`~resireduce_jax.error_feedback` with it where memory matters.

    Returns:
      An :class:`~resireduce_jax.exchange.ExchangeTransformation` whose state is an
      :class:`~resireduce_jax.exchange.ExchangeState` with one residual per store (group
      label); ``tx.plan(params)`` tells which store keeps each leaf. ``update`` takes an
      optional ``skip`` (see :mod:`resireduce_jax.exchange` and
      :func:`~resireduce_jax.skip_nonfinite`): shared and intra-layer stores keep their
      residual exactly on a skipped step.

    References:
      Zheng, Ming, Hu et al., "Saving Memory via Residual Reduction for DNN Training with
      Compressed Communication" (code: https://github.com/YuchongHu/ResiReduce).
    """
    compressor = check_compressor(compressor)
    min_size = check_min_size(min_size)
    _check_choice("inter", inter, INTER_MODES)
    _check_choice("intra", intra, INTRA_MODES)
    _check_choice("selection", selection, SELECTIONS)
    _check_choice("weight_source", weight_source, WEIGHT_SOURCES)
    _check_choice("norm_source", norm_source, NORM_SOURCES)
    if not (isinstance(phi, int | float) and 0.0 <= phi <= 1.0):
        raise ValueError(f"phi must be a number in [0, 1], got {phi!r}.")
    if row_ratio is not None:
        _check_ratio("row_ratio", row_ratio)
    _check_ratio("col_ratio", col_ratio)
    residual_dtype, residual_format = residual_storage(residual_format, residual_dtype)
    if grouping is None:
        grouping = grouping_lib.auto()
    options = dict(
        grouping=grouping,
        min_size=min_size,
        inter=inter,
        intra=intra,
        intra_layers=intra_layers,
        row_ratio=row_ratio,
        col_ratio=col_ratio,
        selection=selection,
        phi=phi,
        weight_source=weight_source,
        norm_source=norm_source,
        residual_dtype=residual_dtype,
        residual_format=residual_format,
    )

    return exchange(
        compressor,
        axis_name,
        planner=functools.partial(plan_stores, **options),
        min_size=min_size,
        seed=seed,
        name="resireduce",
        local_axis=local_axis,
        layer_stacks=layer_stacks,
        selection_scope=selection_scope,
    )
