"""Compressed gradient averaging as optax transforms: without and with error feedback.

:func:`compressed_mean` keeps no residual, :func:`error_feedback` one per compressed leaf
(Seide et al., "1-bit stochastic gradient descent", Interspeech 2014; Karimireddy et al.,
"Error Feedback Fixes SignSGD", https://arxiv.org/abs/1901.09847). Both are views of the
one algorithm in :mod:`resireduce_jax.exchange` and come first in an optax chain, inside
``shard_map`` or ``pmap``. Details: docs/design.md, "Exchange core and the non-finite
guard", and docs/exchange.md.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

from resireduce_jax import residual_formats
from resireduce_jax.compressors.base import Compressor
from resireduce_jax.compressors.schedule import Phased
from resireduce_jax.exchange import (
    DEFAULT_MIN_SIZE,
    AxisName,
    ExchangeTransformation,
    exchange,
    singleton_stores,
)
from resireduce_jax.layer_stacks import LayerStacks

__all__ = [
    "DEFAULT_MIN_SIZE",
    "check_compressor",
    "check_min_size",
    "check_residual_dtype",
    "compressed_mean",
    "error_feedback",
    "residual_storage",
]


def check_min_size(min_size: Any) -> int:
    """Validates ``min_size`` (a non-negative int)."""
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size must be a non-negative int, got {min_size!r}.")
    return min_size


def check_residual_dtype(residual_dtype: Any) -> Any:
    """Validates ``residual_dtype`` (``None`` or a floating dtype)."""
    if residual_dtype is not None and not jnp.issubdtype(residual_dtype, jnp.floating):
        raise ValueError(f"residual_dtype must be a floating dtype, got {residual_dtype!r}.")
    return residual_dtype


def residual_storage(residual_format: Any, residual_dtype: Any) -> tuple[Any, Any]:
    """``(dtype, format)`` of the stores: a float format is a storage dtype (``format``
    ``None``), a block format is kept as codes with per-block scales (``dtype`` ``None``:
    each leaf's, which decoded values take). ``residual_dtype`` is an alias of a float
    format."""
    if residual_format is not None and residual_dtype is not None:
        raise ValueError(
            "Give residual_format or residual_dtype, not both: residual_dtype=D is "
            "residual_format=D."
        )
    if residual_format is None:
        return check_residual_dtype(residual_dtype), None
    fmt = residual_formats.parse_format(residual_format)
    if isinstance(fmt, residual_formats.FloatFormat):
        return np.dtype(fmt.dtype), None
    return None, fmt


def check_compressor(compressor: Any) -> Compressor | Phased:
    """Validates that ``compressor`` is one of :mod:`resireduce_jax.compressors` (or
    :class:`~resireduce_jax.compressors.schedule.Phased` compressors)."""
    if not isinstance(compressor, Compressor | Phased):
        raise ValueError(
            f"Expected a compressor from resireduce_jax.compressors (e.g. topk(0.01)), got "
            f"{compressor!r}."
        )
    return compressor


def _singleton_exchange(
    kind: str,
    name: str,
    compressor: Compressor,
    axis_name: AxisName,
    local_axis: str | None,
    layer_stacks: LayerStacks | None,
    min_size: int,
    seed: int,
    residual_dtype: Any = None,
    selection_scope: str = "leaf",
    residual_format: Any = None,
) -> ExchangeTransformation:
    """The exchange whose every compressed leaf is a store of its own: with a residual
    (``kind="leaf"``, :func:`error_feedback`, in ``residual_format``) or without
    (``"none"``, :func:`compressed_mean`); arguments checked, named ``name``."""
    min_size = check_min_size(min_size)
    dtype, fmt = residual_storage(residual_format, residual_dtype)
    planner = functools.partial(
        singleton_stores, min_size=min_size, kind=kind, dtype=dtype, residual_format=fmt
    )
    return exchange(
        check_compressor(compressor),
        axis_name,
        planner=planner,
        min_size=min_size,
        seed=seed,
        name=name,
        local_axis=local_axis,
        layer_stacks=layer_stacks,
        selection_scope=selection_scope,
    )


def compressed_mean(
    compressor: Compressor,
    axis_name: AxisName = "data",
    *,
    local_axis: str | None = None,
    layer_stacks: LayerStacks | None = None,
    min_size: int = DEFAULT_MIN_SIZE,
    seed: int = 0,
    selection_scope: str = "leaf",
) -> ExchangeTransformation:
    """Averages gradients across workers in compressed form, **without** error feedback.

    ``update`` returns ``mean_w D(Q(g_w))`` for every compressed leaf and ``pmean(g)`` for
    the others (GRACE's "no memory" setting). With a biased compressor (Top-k, signSGD, ...)
    the information dropped by compression is lost for good; see :func:`error_feedback`.

    Args:
      compressor: a compressor from :mod:`resireduce_jax.compressors`.
      axis_name: the mapped axis of the data-parallel workers (a tuple of axes: all of
        them, e.g. a flat exchange over a ``("data", "local")`` mesh).
      local_axis: hierarchical exchange over a node's devices (dense reduce-scatter and
        all-gather over ``local_axis``, compressed exchange over ``axis_name`` only;
        :mod:`resireduce_jax.exchange`). ``None``: flat. The compressor's ratio applies
        to each device's shard, so a node sends that fraction of its mean gradient;
        multiply it by ``L`` to keep a flat run's bytes per device.
      layer_stacks: ``{regex: axis}`` declaring the leaves that stack a weight of every
        layer (a model scanned over its layers) and their layer axis; every slice is then
        a layer of its own: compressed and stored as the same transform does on the
        unstacked pytree (:mod:`resireduce_jax.layer_stacks`). ``None``: no stacks.
      min_size: leaves with fewer elements (or ``ndim <= 1``) travel dense.
      seed: seed of the per-step keys of randomized compressors.
      selection_scope: ``"leaf"`` or ``"global"`` (whole-model Top-k), as for
        :func:`error_feedback`.

    Returns:
      An :class:`~resireduce_jax.exchange.ExchangeTransformation` whose state is an
      :class:`~resireduce_jax.exchange.ExchangeState` with no residuals. ``update`` takes
      an optional ``skip`` (see :func:`resireduce_jax.skip_nonfinite`).
    """
    return _singleton_exchange(
        "none",
        "compressed_mean",
        compressor,
        axis_name,
        local_axis,
        layer_stacks,
        min_size,
        seed,
        selection_scope=selection_scope,
    )


def error_feedback(
    compressor: Compressor,
    axis_name: AxisName = "data",
    *,
    local_axis: str | None = None,
    layer_stacks: LayerStacks | None = None,
    min_size: int = DEFAULT_MIN_SIZE,
    seed: int = 0,
    residual_dtype: Any = None,
    selection_scope: str = "leaf",
    residual_format: Any = None,
) -> ExchangeTransformation:
    """Compressed averaging with error feedback: every compressed leaf keeps its own residual.

    Per worker and compressed leaf (ResiReduce paper §2.2, Fig. 1; Seide et al. 2014;
    Karimireddy et al. 2019)::

        G~ = G + R            # compensate with the residual of the previous step
        P  = Q(G~)            # compress
        R  <- G~ - D(P)       # keep what was not sent
        out = mean_w D(P_w)   # exchange; identical on every worker

    so ``D(P) + R_new == G + R_old`` holds exactly for every worker and step. This is the
    baseline that :func:`resireduce_jax.resireduce` reduces the memory of.

    Args:
      compressor: a compressor from :mod:`resireduce_jax.compressors`.
      axis_name: the mapped axis of the data-parallel workers (a tuple of axes: all of
        them, e.g. a flat exchange over a ``("data", "local")`` mesh).
      local_axis: hierarchical exchange over a node's devices: residuals are sharded over
        ``local_axis``, ``1/L`` of each per device, and error feedback acts on node means
        (:mod:`resireduce_jax.exchange`). ``None``: flat.
      layer_stacks: ``{regex: axis}`` declaring the leaves that stack a weight of every
        layer (a model scanned over its layers) and their layer axis; every slice is then
        a layer of its own: compressed and stored as the same transform does on the
        unstacked pytree (:mod:`resireduce_jax.layer_stacks`). ``None``: no stacks.
      min_size: leaves with fewer elements (or ``ndim <= 1``) travel dense, no residual.
      seed: seed of the per-step keys of randomized compressors.
      residual_dtype: an alias of ``residual_format`` for a float dtype.
      selection_scope: ``"leaf"`` (default): a sparsifier sends its density of every
        leaf; ``"global"``: a Top-k compressor sends its density of all compressed leaves
        together, ranked by magnitude across leaves (whole-model Top-k: the same bytes, and
        a layer of large gradients gets more of them; each compensated leaf stays in its
        residual's buffer, as per leaf). Flat exchanges without layer stacks, every
        phase Top-k or dense, one dtype. Beyond the paper
        (:mod:`resireduce_jax.exchange`).
      residual_format: how residuals are kept (beyond the paper;
        :func:`resireduce_jax.residual_formats.parse_format`): ``"float32"`` /
        ``"bfloat16"`` (a cast; the new residual is rounded, so mass is conserved up to
        that rounding), ``"int8"``, ``"float8"`` or ``"int4"`` (codes with one float32
        scale per block, exact about zero), or a
        :class:`~resireduce_jax.residual_formats.BlockFormat` with its block size and
        rounding (``"stochastic"``: keys from the seed, step, unit and worker, so a resumed
        run draws the same bits). ``"float8_e4m3fn"`` is an unscaled cast, which holds
        magnitudes from 2⁻⁹ to 448 only. Default: each leaf's dtype.

    Returns:
      An :class:`~resireduce_jax.exchange.ExchangeTransformation` whose state is an
      :class:`~resireduce_jax.exchange.ExchangeState`; ``residuals`` maps each compressed
      leaf's path to its residual (leaf shape, in ``residual_format`` or the leaf's dtype).
      ``update`` takes an optional ``skip``, a boolean scalar equal on all workers: zero
      output, counters unchanged, and each residual becomes ``G~`` (nothing was sent); see
      :func:`resireduce_jax.skip_nonfinite`.

    References:
      Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
      Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014; Karimireddy et
      al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML
      2019 (https://arxiv.org/abs/1901.09847).
    """
    return _singleton_exchange(
        "leaf",
        "error_feedback",
        compressor,
        axis_name,
        local_axis,
        layer_stacks,
        min_size,
        seed,
        residual_dtype,
        selection_scope,
        residual_format,
    )
