"""Deep Gradient Compression's own memory: momentum correction, local clipping, masking.

Lin et al., "Deep Gradient Compression", ICLR 2018 (https://arxiv.org/abs/1712.01887).
DGC's selection is a compressor (compressors.sparse.DGC); this module is its per-worker memory.
Each worker clips its gradient, accumulates velocity, sends it compressed and masks what it sent.
The optimizer after it must be plain SGD without momentum: deep_gradient_compression builds it.
Leaves too small to compress travel dense with one replicated heavy-ball momentum.
It offers no grouping: DGC's two buffers per leaf cannot be shared or cut to rows.
Both buffers can be kept in a residual format (residual_formats.py), beyond the paper.
The four steps, and why reduced residuals are not offered: docs/design.md, "DGC's memory
(dgc.py)".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from resireduce_jax import nonfinite, residual_formats
from resireduce_jax.compressors import schedule
from resireduce_jax.compressors.base import (
    Compressor,
    axis_size,
    check_axis_bound,
    dense_mean,
)
from resireduce_jax.compressors.sparse import DGC, FastTopK, RandomK, SparsePayload, Threshold, TopK
from resireduce_jax.exchange import DEFAULT_MIN_SIZE, _rounding_key, leaf_key
from resireduce_jax.optimizers import sgd
from resireduce_jax.optimizers._common import ScalarOrSchedule, clip_factor, global_norm
from resireduce_jax.transforms import check_compressor, check_min_size
from resireduce_jax.tree_paths import is_compressible, leaf_paths, validate_float_leaves

PyTree = Any

__all__ = ["DGCState", "deep_gradient_compression", "dgc_memory", "resize_workers"]

_SPARSE = (TopK, RandomK, FastTopK, Threshold, DGC)


class DGCState(NamedTuple):
    """State of :func:`dgc_memory`.

    Attributes:
      count: number of updates so far (int32); drives the per-step PRNG keys of randomized
        compressors. Not advanced by a skipped step.
      momentum: ``u`` per compressed leaf (DGC §3.2), params' structure with
        ``optax.MaskedNode()`` at dense leaves: in the leaf's dtype, or as the
        ``residual_format`` keeps it (a cast, or
        :class:`~resireduce_jax.residual_formats.Quantized` codes and scales). Per worker.
      velocity: ``v`` per compressed leaf, the accumulated momentum-corrected gradient not
        sent yet; same structure and format. Per worker.
      dense_momentum: heavy-ball momentum of the dense (uncompressed) leaves' mean,
        ``optax.MaskedNode()`` at compressed leaves. Replicated.
      compressor_state: per-leaf compressor state (``()`` for the sparse compressors
        here), ``optax.MaskedNode()`` at dense leaves.
    """

    count: jax.Array
    momentum: PyTree
    velocity: PyTree
    dense_momentum: PyTree
    compressor_state: PyTree


# Skipped steps keep u, v, the dense momentum, count and compressor state bit for bit.
nonfinite.register_skip_aware(DGCState)


def _check_momentum(momentum: Any) -> float:
    try:
        value = float(momentum)
    except (TypeError, ValueError):
        raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}.") from None
    if not 0.0 <= value < 1.0:  # also rejects NaN
        raise ValueError(
            f"momentum must be in [0, 1), got {momentum!r}: it is DGC's momentum factor m "
            "in u <- m*u + g (the paper uses 0.9); 0 disables momentum correction."
        )
    return value


def _check_clip_norm(clip_norm: Any) -> float | None:
    if clip_norm is None:
        return None
    try:
        value = float(clip_norm)
    except (TypeError, ValueError):
        raise ValueError(
            f"clip_norm must be a positive number or None, got {clip_norm!r}."
        ) from None
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(
            f"clip_norm must be a positive finite number or None, got {clip_norm!r}: it is "
            "the global gradient-norm threshold c; each worker clips its local gradient to "
            "c / sqrt(num_workers) (DGC §3.2). Pass None to disable clipping."
        )
    return value


def _check_sparse(compressor: Any) -> Compressor:
    compressor = check_compressor(compressor)
    phases = schedule.phases(compressor)
    if len(phases) > 1:
        if not isinstance(compressor, _SPARSE):
            raise ValueError(
                "dgc_memory takes a sparsifier with a density schedule, not Phased "
                "compressors: every phase must be sparse."
            )
        if any(not isinstance(p.compressor, _SPARSE) for p in phases):
            raise ValueError(
                f"dgc_memory's density schedule {getattr(compressor, compressor.density_field)} "
                "has a phase of density 1 (uncompressed): momentum factor masking would "
                "clear the momentum at every position every step, leaving SGD without "
                "momentum. Start the schedule below 1 (DGC's warm-up starts at 0.25: "
                "compressors.dgc_warmup)."
            )
        return compressor
    if not isinstance(compressor, _SPARSE):
        raise ValueError(
            f"dgc_memory needs a sparsifying compressor (topk, fast_topk, randomk, threshold "
            f"or dgc), got '{compressor.name}': momentum factor masking zeroes u and v at "
            "the positions that were sent, which only a sparse payload defines. Use "
            "error_feedback or resireduce for other compressors."
        )
    if isinstance(compressor, RandomK) and compressor.scaled:
        raise ValueError(
            "dgc_memory cannot use randomk(scaled=True): it sends size*v_i where the memory "
            "holds v_i, so clearing v at the sent positions would not conserve what was "
            "accumulated. Use randomk(scaled=False)."
        )
    return compressor


def _where(skip: jax.Array | None, if_skipped: PyTree, otherwise: PyTree) -> PyTree:
    if skip is None:
        return otherwise
    return jax.tree.map(lambda a, b: jnp.where(skip, a, b), if_skipped, otherwise)


def _zero_at(x: jax.Array, indices: jax.Array) -> jax.Array:
    """``x`` with the flat ``indices`` set to zero (indices ``>= x.size`` are dropped)."""
    flat = x.ravel().at[indices].set(0, mode="drop", unique_indices=True)
    return flat.reshape(x.shape)


def _check_format(residual_format: Any) -> residual_formats.ResidualFormat | None:
    if residual_format is None:
        return None
    return residual_formats.parse_format(residual_format)


def _leaf_format(
    fmt: residual_formats.ResidualFormat | None, dtype: Any
) -> residual_formats.ResidualFormat | None:
    """How a compressed leaf of ``dtype`` keeps ``u`` and ``v``: ``None`` for the leaf's
    own dtype (no format, or a cast to that dtype)."""
    if isinstance(fmt, residual_formats.FloatFormat) and np.dtype(fmt.dtype) == dtype:
        return None
    return fmt


@dataclasses.dataclass(frozen=True)
class _DGCMemory:
    compressor: Compressor
    momentum: float
    clip_norm: float | None
    axis_name: str
    min_size: int
    seed: int
    residual_format: residual_formats.ResidualFormat | None = None

    def format_of(self, dtype: Any) -> residual_formats.ResidualFormat | None:
        """How a compressed leaf of ``dtype`` keeps ``u`` and ``v`` (:func:`_leaf_format`)."""
        return _leaf_format(self.residual_format, dtype)

    def rounding_keys(
        self, count: jax.Array, leaf_index: int
    ) -> tuple[jax.Array | None, jax.Array | None]:
        """Stochastic rounding keys of ``(u, v)`` at one step: the exchange stores' stream
        (seed, count, leaf, worker), split in two."""
        fmt = self.residual_format
        if fmt is None or not fmt.stochastic:
            return None, None
        key_u, key_v = jax.random.split(_rounding_key(self.seed, count, leaf_index, self.axis_name))
        return key_u, key_v

    @functools.cached_property
    def phases(self) -> tuple[schedule.Phase, ...]:
        """The compressor's phases (one per density of its schedule), all sparse."""
        return schedule.phases(self.compressor)

    def compressed(self, tree: PyTree) -> list[bool]:
        return [is_compressible(x, self.min_size) for x in jax.tree.leaves(tree)]

    def init(self, params: PyTree) -> DGCState:
        validate_float_leaves(params, "dgc_memory")
        leaves, treedef = jax.tree.flatten(params)
        paths = leaf_paths(params)
        masked = optax.MaskedNode()
        us, vs, dense, cstates = [], [], [], []
        for path, x, sparse in zip(paths, leaves, self.compressed(params), strict=True):
            like = jax.ShapeDtypeStruct(np.shape(x), x.dtype)
            if sparse:
                for phase in self.phases:
                    phase.compressor.validate(path, like)
                fmt = self.format_of(like.dtype)
                zeros = jnp.zeros(like.shape, like.dtype) if fmt is None else fmt.init(like.shape)
                us.append(zeros)
                vs.append(zeros)
                dense.append(masked)
                cstates.append(self.phases[0].compressor.init(like))
            else:
                us.append(masked)
                vs.append(masked)
                dense.append(jnp.zeros(like.shape, like.dtype))
                cstates.append(masked)
        return DGCState(
            count=jnp.zeros([], jnp.int32),
            momentum=treedef.unflatten(us),
            velocity=treedef.unflatten(vs),
            dense_momentum=treedef.unflatten(dense),
            compressor_state=treedef.unflatten(cstates),
        )

    def update(
        self,
        updates: PyTree,
        state: DGCState,
        params: PyTree | None = None,
        *,
        skip: jax.Array | None = None,
        density_phase: int | None = None,
        **extra_args: Any,
    ) -> tuple[PyTree, DGCState]:
        """One DGC step. ``skip``: optional boolean scalar, equal on every worker.

        On a skipped step the output is zero and every state leaf (``u``, ``v``, dense
        momentum, count, compressor state) is returned unchanged bit for bit; the
        collectives still run (their shapes are static) on the unchanged ``v``.
        ``density_phase``: as in the exchange transforms (one program per phase).
        """
        del params, extra_args
        check_axis_bound(self.axis_name)
        leaves, treedef = jax.tree.flatten(updates)
        us = treedef.flatten_up_to(state.momentum)
        vs = treedef.flatten_up_to(state.velocity)
        dense_us = treedef.flatten_up_to(state.dense_momentum)
        cstates = treedef.flatten_up_to(state.compressor_state)
        m = self.momentum

        static = schedule.static_phase(self.phases, density_phase)
        phase = schedule.phase_index([p.start for p in self.phases], state.count)
        factor = None
        if self.clip_norm is not None:  # §3.2: local threshold c / sqrt(N)
            local_threshold = self.clip_norm / math.sqrt(axis_size(self.axis_name))
            factor = clip_factor(global_norm(updates), local_threshold)

        out: list[Any] = []
        new_us, new_vs, new_dense, new_cstates = list(us), list(vs), list(dense_us), list(cstates)
        for i, (g, sparse) in enumerate(zip(leaves, self.compressed(updates), strict=True)):
            if factor is not None:
                g = g * factor.astype(g.dtype)
            if not sparse:  # dense leaf: heavy-ball momentum on the exchanged mean
                u = m * dense_us[i] + dense_mean(g, self.axis_name)
                new_dense[i] = u = _where(skip, dense_us[i], u)
                out.append(_where(skip, jnp.zeros((), u.dtype), u))
                continue
            fmt = self.format_of(g.dtype)
            u_old, v_old = us[i], vs[i]
            if fmt is not None:  # decoded on read, encoded again after the update
                u_old = fmt.decode(u_old, g.shape, g.dtype)
                v_old = fmt.decode(v_old, g.shape, g.dtype)
            # Momentum correction (§3.2): accumulate velocity, not gradient.
            u = _where(skip, u_old, m * u_old + g)
            v = _where(skip, v_old, v_old + u)

            def send(compressor, u, v, cstate, i=i):
                key = leaf_key(self.seed, state.count, i, compressor, self.axis_name)
                like = jax.ShapeDtypeStruct(v.shape, v.dtype)
                payload, cstate = compressor.compress(v, cstate, key)
                if not isinstance(payload, SparsePayload):  # guarded by _check_sparse
                    raise TypeError(f"{compressor.name} did not produce a sparse payload.")
                mean = compressor.aggregate(payload, like, self.axis_name)
                # Momentum factor masking (§3.3): zero v and u where sent. For v this is
                # the compressors' residual hook, v - D(P): the payload values are v's own
                # entries, so sent entries become exactly 0; subtracting them (rather than
                # writing zeros) orders the in-place write after compression read v, as in
                # Compressor.reduce (measured: one copy of v per leaf otherwise). On a
                # skipped step the hook returns v unchanged and nothing is masked in u.
                v, payload = lax.optimization_barrier((v, payload))
                v = compressor.residual(v, payload, skip)
                sent = payload.indices
                if skip is not None:  # out-of-range indices are dropped
                    sent = jnp.where(skip, jnp.int32(v.size), sent)
                return mean, _zero_at(u, sent), v, cstate

            if static is not None:
                mean, u, v, cstate = send(static, u, v, cstates[i])
            else:  # one static-size branch per phase of the density schedule
                branches = [functools.partial(send, p.compressor) for p in self.phases]
                mean, u, v, cstate = lax.switch(phase, branches, u, v, cstates[i])
            if fmt is not None:  # masked entries are zeros, which every format keeps exactly
                key_u, key_v = self.rounding_keys(state.count, i)
                u = _where(skip, us[i], fmt.encode(u, key_u))
                v = _where(skip, vs[i], fmt.encode(v, key_v))
            new_us[i], new_vs[i] = u, v
            new_cstates[i] = _where(skip, cstates[i], cstate)
            out.append(_where(skip, jnp.zeros((), mean.dtype), mean))

        count = optax.safe_int32_increment(state.count)
        new_state = DGCState(
            count=_where(skip, state.count, count),
            momentum=treedef.unflatten(new_us),
            velocity=treedef.unflatten(new_vs),
            dense_momentum=treedef.unflatten(new_dense),
            compressor_state=treedef.unflatten(new_cstates),
        )
        return treedef.unflatten(out), new_state


def dgc_memory(
    compressor: Compressor,
    momentum: float = 0.9,
    clip_norm: float | None = None,
    axis_name: str = "data",
    *,
    min_size: int = DEFAULT_MIN_SIZE,
    seed: int = 0,
    residual_format: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """DGC's memory as the first transform of an optax chain (Lin et al., ICLR 2018, §3).

    Per worker and compressed leaf (the paper's reasoning: docs/design.md, "DGC's memory
    (dgc.py)")::

        g <- g * min(1, (clip_norm / sqrt(N)) / ||g||)   # §3.2 local clipping (all leaves)
        u <- momentum * u + g                            # §3.2 momentum correction
        v <- v + u
        P  = Q(v)                                        # §3.1 sparsify (Top-k, DGC, ...)
        out = mean_w D(P_w)                              # all-gather + scatter-add
        u[sent], v[sent] <- 0                            # §3.3 momentum factor masking

    Dense leaves (``ndim <= 1`` or fewer than ``min_size`` elements): the clipped gradient
    is averaged (``pmean``) and ``out = u <- momentum * u + mean`` (plain momentum).

    The output already carries momentum: follow it with plain SGD **without** momentum
    (``rr.optimizers.sgd(lr)`` or ``optax.sgd(lr)``), or use
    :func:`deep_gradient_compression`. Weight decay, if wanted inside the momentum as in
    PyTorch's SGD, goes before it: ``optax.chain(optax.add_decayed_weights(wd),
    dgc_memory(...), sgd(lr))``.

    Not combinable with ResiReduce's shared or intra-layer residuals: momentum correction
    needs each leaf's own ``u``, and a shared ``v`` would mix layers' velocities
    (docs/design.md, "DGC's memory (dgc.py)").

    Args:
      compressor: a sparsifying compressor (``topk``, ``fast_topk``, ``randomk`` unscaled,
        ``threshold`` or ``dgc``) from :mod:`resireduce_jax.compressors`, with a float
        density or a density schedule whose phases are all below 1 (a dense phase would
        mask the whole momentum every step).
      momentum: DGC's momentum factor ``m`` in [0, 1) (paper: 0.9); 0 is DGC without
        momentum correction (then ``u = g`` and this is error feedback with masking).
      clip_norm: the global gradient-norm threshold ``c``, or ``None`` for no clipping.
        Each worker scales its local gradient so that its L2 norm (over all leaves) is at
        most ``c / sqrt(num_workers)`` (§3.2).
      axis_name: the mapped axis of the data-parallel workers.
      min_size: leaves with fewer elements (or ``ndim <= 1``) travel dense.
      seed: seed of the per-step keys of randomized compressors (``dgc``'s sample).
      residual_format: how ``u`` and ``v`` of compressed leaves are kept (beyond the
        paper; :func:`resireduce_jax.residual_formats.parse_format`): ``None`` (the leaf's
        dtype), ``"float32"``, ``"bfloat16"``, ``"int8"``, ``"float8"``, ``"int4"`` or
        ``"int4/64/stochastic"``. Both are decoded on read and encoded after the update;
        masked entries stay exact zeros. Stochastic rounding keys come from ``seed``, the
        step, the leaf and the worker, as in the exchange's stores. Dense leaves' momentum
        stays in their dtype.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`DGCState`.
      ``update`` must run where ``axis_name`` is bound (``jax.shard_map``/``jax.pmap``;
      :func:`resireduce_jax.parallel.data_parallel_step`) and takes an optional ``skip``
      (:func:`resireduce_jax.skip_nonfinite`): zero output, every state leaf unchanged.

    Raises:
      ValueError: for a non-sparse or scaled random-k compressor, ``momentum`` outside
        [0, 1), a non-positive ``clip_norm``, a negative ``min_size``, an unknown
        ``residual_format``; at ``init``, for non-float leaves.

    References:
      Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
      Distributed Training", ICLR 2018 (https://arxiv.org/abs/1712.01887).
    """
    core = _DGCMemory(
        compressor=_check_sparse(compressor),
        momentum=_check_momentum(momentum),
        clip_norm=_check_clip_norm(clip_norm),
        axis_name=axis_name,
        min_size=check_min_size(min_size),
        seed=seed,
        residual_format=_check_format(residual_format),
    )
    return optax.GradientTransformationExtraArgs(core.init, core.update)


def deep_gradient_compression(
    compressor: Compressor,
    learning_rate: ScalarOrSchedule,
    momentum: float = 0.9,
    clip_norm: float | None = None,
    axis_name: str = "data",
    *,
    min_size: int = DEFAULT_MIN_SIZE,
    seed: int = 0,
    residual_format: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """DGC's whole optimizer: :func:`dgc_memory` followed by SGD without momentum.

    ``w <- w - learning_rate * mean_w sparse(v_w)`` (DGC §3.2). The SGD is
    :func:`resireduce_jax.optimizers.sgd` (skip-aware), so the chain can be wrapped in
    :func:`resireduce_jax.skip_nonfinite` without copying any state. Arguments as in
    :func:`dgc_memory`; ``learning_rate`` is a float or an optax schedule. Warm-up
    training (§3.4: exponentially increasing sparsity) is the compressor's density
    schedule: ``compressors.topk(compressors.dgc_warmup(0.001, steps_per_epoch))``.

    References:
      Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
      Distributed Training", ICLR 2018 (https://arxiv.org/abs/1712.01887).
    """
    return optax.chain(
        dgc_memory(
            compressor,
            momentum,
            clip_norm,
            axis_name,
            min_size=min_size,
            seed=seed,
            residual_format=residual_format,
        ),
        sgd(learning_rate),
    )


def resize_workers(
    state: DGCState, params: PyTree, num_workers: int, *, residual_format: Any = None
) -> DGCState:
    """``state`` (host arrays; ``u`` and ``v`` with a leading axis of the old workers) for
    ``num_workers`` workers: every new worker gets the old workers' mean ``u`` and ``v``,
    so the pending update ``mean_w v_w`` (DGC §3.1) is kept.

    ``params`` (or their ``ShapeDtypeStruct``s) give the leaves' shapes and dtypes, and
    ``residual_format`` is the one ``state`` was written with (:func:`dgc_memory`'s): kept
    values are decoded, averaged in float32 or wider and encoded again (stochastic rounding
    with a fixed key: every call gives the same bits). The count and the dense leaves'
    replicated momentum are returned as they are.
    """
    fmt = _check_format(residual_format)
    leaves, treedef = jax.tree.flatten(params)

    def mean(stored: Any, like: Any) -> Any:
        if isinstance(stored, optax.MaskedNode):
            return stored
        shape, dtype = tuple(np.shape(like)), np.dtype(like.dtype)
        wide = np.promote_types(dtype, np.float32)
        leaf_fmt = _leaf_format(fmt, dtype)
        workers = jax.tree.leaves(stored)[0].shape[0]
        if leaf_fmt is None:
            kept = np.asarray(stored).astype(wide).mean(0).astype(np.asarray(stored).dtype)
        else:
            values = [
                np.asarray(leaf_fmt.decode(jax.tree.map(lambda x, w=w: x[w], stored), shape, wide))
                for w in range(workers)
            ]
            key = jax.random.PRNGKey(0) if leaf_fmt.stochastic else None
            kept = jax.device_get(leaf_fmt.encode(jnp.asarray(np.mean(values, 0)), key))
        return jax.tree.map(
            lambda x: np.ascontiguousarray(np.broadcast_to(x, (num_workers, *np.shape(x)))), kept
        )

    def buffers(tree: PyTree) -> PyTree:
        stored = treedef.flatten_up_to(tree)
        return treedef.unflatten([mean(s, x) for s, x in zip(stored, leaves, strict=True)])

    return state._replace(momentum=buffers(state.momentum), velocity=buffers(state.velocity))
