"""Compressed gradient averaging as optax transforms: without and with error feedback.

Both transforms turn each worker's *local* gradients into the *global* mean gradient,
exchanged in compressed form over a named mapped axis. They belong first in an optax
chain, inside ``jax.shard_map`` (or ``jax.pmap``) over the data-parallel axis::

    tx = optax.chain(
        resireduce_jax.error_feedback(resireduce_jax.compressors.topk(0.01)),
        optax.sgd(0.1, momentum=0.9),
    )

Leaves with ``ndim <= 1`` or fewer than ``min_size`` elements travel dense (``pmean``)
and keep no residual, as in the reference code. The output is identical on every worker,
so parameters stay replicated; only residuals (and per-worker compressor state) differ
between workers. :func:`resireduce_jax.parallel.state_partition_specs` tells which state
leaves are per-worker.

Randomness: the transforms keep a step counter and derive one key per leaf and step from
``seed``; compressors that need independent draws per worker additionally fold in the
worker index.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from resireduce_jax.compressors.base import Compressor, check_axis_bound, dense_mean
from resireduce_jax.tree_paths import is_compressible, leaf_paths, validate_float_leaves

PyTree = Any

__all__ = [
    "CompressedMeanState",
    "ErrorFeedbackState",
    "compressed_mean",
    "error_feedback",
    "leaf_key",
]

DEFAULT_MIN_SIZE = 10_000


class CompressedMeanState(NamedTuple):
    """State of :func:`compressed_mean`.

    Attributes:
      count: number of updates so far (int32); drives the per-step PRNG keys.
      compressor_state: per-leaf compressor state with the params' structure;
        ``optax.MaskedNode()`` for leaves that travel dense.
    """

    count: jax.Array
    compressor_state: PyTree


class ErrorFeedbackState(NamedTuple):
    """State of :func:`error_feedback`.

    Attributes:
      count: number of updates so far (int32); drives the per-step PRNG keys.
      residuals: one residual per compressed leaf, with the params' structure and the
        leaf's shape and dtype; ``optax.MaskedNode()`` for leaves that travel dense.
        Per worker: under ``shard_map`` these carry a leading worker axis sharded on the
        data axis.
      compressor_state: as in :class:`CompressedMeanState`.
    """

    count: jax.Array
    residuals: PyTree
    compressor_state: PyTree


def leaf_key(
    seed: int, count: jax.Array, leaf_index: int, compressor: Compressor, axis_name: str
) -> jax.Array | None:
    """The PRNG key of one leaf at one step (``None`` for deterministic compressors).

    ``fold_in(fold_in(PRNGKey(seed), count), leaf_index)`` is the same on every worker;
    for ``randomness == "per_worker"`` the worker index is folded in as well.
    """
    if compressor.randomness == "none":
        return None
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), count), leaf_index)
    if compressor.randomness == "per_worker":
        key = jax.random.fold_in(key, lax.axis_index(axis_name))
    return key


def _reduce(compressor: Compressor, x, cstate, key, axis_name, skip):
    """``compressor.reduce``, passing ``skip`` only when a step may be skipped."""
    if skip is None:
        return compressor.reduce(x, cstate, key, axis_name)
    return compressor.reduce(x, cstate, key, axis_name, skip=skip)


def _dense_mean(g, axis_name, skip):
    mean = dense_mean(g, axis_name)
    return mean if skip is None else jnp.where(skip, jnp.zeros((), mean.dtype), mean)


def _next_count(count, skip):
    new = optax.safe_int32_increment(count)
    return new if skip is None else jnp.where(skip, count, new)


def _check_min_size(min_size: int) -> int:
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size must be a non-negative int, got {min_size!r}.")
    return min_size


def _check_compressor(compressor: Any) -> Compressor:
    if not isinstance(compressor, Compressor):
        raise ValueError(
            f"Expected a compressor from resireduce_jax.compressors (e.g. topk(0.01)), got "
            f"{compressor!r}."
        )
    return compressor


def _init_compressor_state(compressor: Compressor, params: PyTree, min_size: int) -> PyTree:
    paths = leaf_paths(params)

    def init_leaf(path, p):
        like = jax.ShapeDtypeStruct(p.shape, p.dtype)
        if not is_compressible(like, min_size):
            return optax.MaskedNode()
        compressor.validate(path, like)
        return compressor.init(like)

    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten([init_leaf(q, p) for q, p in zip(paths, leaves, strict=True)])


def _flatten_like(treedef, tree: PyTree) -> list[Any]:
    """Leaves of ``tree`` at the leaf positions of ``treedef`` (MaskedNodes included)."""
    return treedef.flatten_up_to(tree)


def compressed_mean(
    compressor: Compressor,
    axis_name: str = "data",
    *,
    min_size: int = DEFAULT_MIN_SIZE,
    seed: int = 0,
) -> optax.GradientTransformation:
    """Averages gradients across workers in compressed form, **without** error feedback.

    ``update`` returns ``mean_w D(Q(g_w))`` for every compressed leaf and ``pmean(g)`` for
    the others (GRACE's "no memory" setting). With a biased compressor (Top-k, signSGD, ...)
    the information dropped by compression is lost for good; see :func:`error_feedback`.

    Args:
      compressor: a compressor from :mod:`resireduce_jax.compressors`.
      axis_name: the mapped axis of the data-parallel workers.
      min_size: leaves with fewer elements (or ``ndim <= 1``) travel dense.
      seed: seed of the per-step keys of randomized compressors.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`CompressedMeanState`. ``update`` takes an optional ``skip`` (see
      :func:`resireduce_jax.skip_nonfinite`).
    """
    compressor = _check_compressor(compressor)
    min_size = _check_min_size(min_size)

    def init_fn(params):
        validate_float_leaves(params, "compressed_mean")
        return CompressedMeanState(
            count=jnp.zeros([], jnp.int32),
            compressor_state=_init_compressor_state(compressor, params, min_size),
        )

    def update_fn(updates, state, params=None, *, skip=None, **extra_args):
        del params, extra_args
        check_axis_bound(axis_name)
        leaves, treedef = jax.tree.flatten(updates)
        cstates = _flatten_like(treedef, state.compressor_state)
        out, new_cstates = [], []
        for i, (g, cs) in enumerate(zip(leaves, cstates, strict=True)):
            if isinstance(cs, optax.MaskedNode):
                out.append(_dense_mean(g, axis_name, skip))
                new_cstates.append(cs)
                continue
            key = leaf_key(seed, state.count, i, compressor, axis_name)
            reduced = _reduce(compressor, g, cs, key, axis_name, skip)
            out.append(reduced.mean)
            new_cstates.append(reduced.state)
        new_state = CompressedMeanState(
            count=_next_count(state.count, skip),
            compressor_state=treedef.unflatten(new_cstates),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def error_feedback(
    compressor: Compressor,
    axis_name: str = "data",
    *,
    min_size: int = DEFAULT_MIN_SIZE,
    seed: int = 0,
) -> optax.GradientTransformation:
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
      axis_name: the mapped axis of the data-parallel workers.
      min_size: leaves with fewer elements (or ``ndim <= 1``) travel dense, no residual.
      seed: seed of the per-step keys of randomized compressors.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an
      :class:`ErrorFeedbackState`. ``update`` takes an optional ``skip``: a boolean scalar,
      equal on all workers, that skips the step exactly (zero output, state unchanged); it
      expects the gradients of a skipped step to be ``-0.0`` (see
      :func:`resireduce_jax.skip_nonfinite`, which passes both).
    """
    compressor = _check_compressor(compressor)
    min_size = _check_min_size(min_size)

    def init_fn(params):
        validate_float_leaves(params, "error_feedback")
        residuals = jax.tree.map(
            lambda p: (
                jnp.zeros(p.shape, p.dtype) if is_compressible(p, min_size) else optax.MaskedNode()
            ),
            params,
        )
        return ErrorFeedbackState(
            count=jnp.zeros([], jnp.int32),
            residuals=residuals,
            compressor_state=_init_compressor_state(compressor, params, min_size),
        )

    def update_fn(updates, state, params=None, *, skip=None, **extra_args):
        del params, extra_args
        check_axis_bound(axis_name)
        leaves, treedef = jax.tree.flatten(updates)
        residuals = _flatten_like(treedef, state.residuals)
        cstates = _flatten_like(treedef, state.compressor_state)
        out, new_residuals, new_cstates = [], [], []
        for i, (g, r, cs) in enumerate(zip(leaves, residuals, cstates, strict=True)):
            if isinstance(r, optax.MaskedNode):
                out.append(_dense_mean(g, axis_name, skip))
                new_residuals.append(r)
                new_cstates.append(cs)
                continue
            key = leaf_key(seed, state.count, i, compressor, axis_name)
            reduced = _reduce(compressor, g + r.astype(g.dtype), cs, key, axis_name, skip)
            out.append(reduced.mean)
            new_residuals.append(reduced.residual.astype(r.dtype))
            new_cstates.append(reduced.state)
        new_state = ErrorFeedbackState(
            count=_next_count(state.count, skip),
            residuals=treedef.unflatten(new_residuals),
            compressor_state=treedef.unflatten(new_cstates),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
