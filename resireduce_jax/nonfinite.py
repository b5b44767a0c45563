"""Skipping non-finite steps on every worker at once, without holding gradients for it.

A NaN that reaches an error-feedback residual is sent again and poisons every later step.
skip_nonfinite wraps the whole optax chain: if any worker's step is non-finite, all skip it.
The decision comes from every worker's local values, one scalar pmin over the axis.
Modes: loss (default, decided before the backward pass), strict and lean.
Optimizers that are not skip-aware (optax's own) are guarded by a where over their state.
Their cost at the compiled peak: benchmarks/results/guard_cost.md.
The modes in detail: docs/design.md, "The non-finite guard" and "The guard's modes
(nonfinite.py)".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from resireduce_jax._src import in_place
from resireduce_jax.compressors.base import check_axis_bound
from resireduce_jax.exchange import ExchangeState
from resireduce_jax.optimizers import AdamWRState, AdanRState, LionRState, SGDState

PyTree = Any

__all__ = [
    "LOSS",
    "MODES",
    "NO_BAD_LEAF",
    "SkipNonFiniteState",
    "loss_decision",
    "register_skip_aware",
    "skip_nonfinite",
    "value_and_guarded_grad",
]

MODES = ("loss", "strict", "lean")

NO_BAD_LEAF = int(jnp.iinfo(jnp.int32).max)
LOSS = -1  # bad_leaf of a step skipped for its loss ("loss" mode)

_SKIP_AWARE: set[type] = {ExchangeState, AdamWRState, AdanRState, LionRState, SGDState}


def register_skip_aware(state_type: type) -> type:
    """Declares that transforms with state ``state_type`` handle the ``skip`` extra argument.

    Such a transform's ``update(updates, state, params, *, skip=None)`` must return, where
    ``skip`` is true, a state equal bit for bit to the old one (or, for exchange states,
    the documented one) while still updating it in place; :func:`skip_nonfinite` then
    leaves its state alone instead of selecting between old and new. Usable as a class
    decorator.
    """
    _SKIP_AWARE.add(state_type)
    return state_type


class SkipNonFiniteState(NamedTuple):
    """State of :func:`skip_nonfinite`.

    Attributes:
      inner: the wrapped transform's state.
      skipped: number of steps skipped so far (int32).
      last_skipped: whether the most recent update was skipped (bool).
      bad_leaf: index (``jax.tree.leaves`` order of the gradients) of the first non-finite
        leaf on any worker at the most recent skip (``"strict"`` and ``"lean"``), ``LOSS``
        if a non-finite loss decided it (``"loss"``), ``NO_BAD_LEAF`` if there was none.
    """

    inner: PyTree
    skipped: jax.Array
    last_skipped: jax.Array
    bad_leaf: jax.Array


def _is_skip_aware(x: Any) -> bool:
    return type(x) in _SKIP_AWARE


def _keep_unless(ok: jax.Array, new: PyTree, old: PyTree, updates: PyTree) -> tuple[PyTree, PyTree]:
    """``where(ok, new, old)`` leaf by leaf, except inside skip-aware states.

    Returns the kept state and ``updates``. A part of the state structured like the
    updates (optax's ``trace``, ``mu``, ``nu``) is selected leaf by leaf after that leaf's
    update, through one ``optimization_barrier`` with it: the update reads the old
    moment (XLA fuses ``g + b·m`` into both consumers), and the select writes the new one
    over it, so without the order XLA copies every moment (measured: the conv stack of
    ``benchmarks/guard_cost.py`` at test size, optax's SGD-m 17.8 -> 16.0 MiB; the
    transformer's strict step with optax's AdamW 94.8 -> 85.2 MiB).
    """
    treedef = jax.tree.structure(updates)
    update_leaves = treedef.flatten_up_to(updates)

    def like_updates(x: Any) -> bool:
        return not isinstance(x, jax.Array) and jax.tree.structure(x) == treedef

    def select(n, o):
        if _is_skip_aware(n):
            return n
        if not like_updates(n):
            return jax.tree.map(lambda a, b: jnp.where(ok, a, b), n, o)
        kept = []
        for i, (a, b) in enumerate(
            zip(treedef.flatten_up_to(n), treedef.flatten_up_to(o), strict=True)
        ):
            update_leaves[i], a = lax.optimization_barrier((update_leaves[i], a))
            kept.append(jnp.where(ok, a, b))
        return treedef.unflatten(kept)

    kept = jax.tree.map(select, new, old, is_leaf=lambda x: _is_skip_aware(x) or like_updates(x))
    return kept, treedef.unflatten(update_leaves)


def _decision_axes(axis_name: str | tuple[str, ...], leaves: list[jax.Array]):
    """``axis_name`` and every other mapped axis the gradients vary over, in that order.

    On a ``(data, local)`` mesh the gradients vary over both axes, so the decision covers
    every device even when only ``"data"`` is named; under ``pmap`` (no varying-axis
    types) it is ``axis_name``.
    """
    axes = list(axis_name) if isinstance(axis_name, tuple) else [axis_name]
    for g in leaves:
        manual = getattr(jax.typeof(g), "manual_axis_type", None)
        for a in sorted(manual.varying) if manual is not None else ():
            if a not in axes:
                axes.append(a)
    return axes[0] if len(axes) == 1 else tuple(axes)


def loss_decision(loss: jax.Array, axis_name: str | tuple[str, ...] = "data") -> jax.Array:
    """Whether every worker's loss is finite: the ``loss_ok`` of the ``"loss"`` mode.

    One scalar ``pmin`` over ``axis_name``, equal on every worker. Call it inside the
    mapped step, between the forward and the backward pass (see
    :func:`value_and_guarded_grad`).
    """
    check_axis_bound(axis_name)
    finite = jnp.all(jnp.isfinite(loss)).astype(jnp.int32)
    return lax.pmin(finite, axis_name) == 1


def value_and_guarded_grad(
    fun: Any, axis_name: str | tuple[str, ...] = "data", *, has_aux: bool = False
) -> Any:
    """Like ``jax.value_and_grad``, and also returns ``loss_ok`` for :func:`skip_nonfinite`.

    ``value_and_guarded_grad(f)(params, *args)`` returns ``((loss, aux), grads, loss_ok)``
    with ``has_aux`` (``(loss, grads, loss_ok)`` without). ``loss_ok`` is
    :func:`loss_decision` of the loss, taken after the forward pass; the backward pass is
    seeded with it (``1`` if true, ``0`` otherwise), so it depends on the decision and the
    decision is made before the first gradient exists. The gradients are exact when
    ``loss_ok`` is true; otherwise they are meant to be discarded (the guard does). Pass
    it on: ``tx.update(grads, opt_state, params, loss_ok=loss_ok)``.
    """

    def wrapped(params, *args):
        if has_aux:
            loss, pullback, aux = jax.vjp(lambda p: fun(p, *args), params, has_aux=True)
        else:
            loss, pullback = jax.vjp(lambda p: fun(p, *args), params)
        ok = loss_decision(loss, axis_name)
        (grads,) = pullback(jnp.where(ok, jnp.ones_like(loss), jnp.zeros_like(loss)))
        return ((loss, aux) if has_aux else loss), grads, ok

    return wrapped


def _replaced(g: jax.Array, keep: Any, value: float) -> jax.Array:
    """``where(keep(g), g, value)``, written over the gradient's own buffer block by block
    (:func:`resireduce_jax._src.in_place.map_blocks`): a gradient is a temporary, and a plain
    select would hold a second copy of it beside the first, which the exchange of a large
    layer kept in a 2-D store cannot absorb."""
    fill = jnp.asarray(value, g.dtype)
    return in_place.map_blocks(g, lambda block, row0: jnp.where(keep(block), block, fill))


def _is_bad(g: jax.Array) -> jax.Array:
    """Whether ``g`` holds a NaN/Inf. XLA:CPU materializes the one-byte flags of one leaf
    at a time (a quarter of a float32 leaf). Counting them in a chunk loop instead
    (:func:`resireduce_jax._src.in_place.sums`) raised ResNet-50's strict step from 148.1 to
    218.9 MiB (35 such loops, one per large leaf, where every gradient is held), and a
    ``max``/``min`` test misses NaN in XLA:CPU's large reductions."""
    return jnp.logical_not(jnp.all(jnp.isfinite(g)))


def _first_bad(axes, bad: list[jax.Array]) -> jax.Array:
    """Index of the first flagged leaf on any worker (``NO_BAD_LEAF`` if none)."""
    first_bad = jnp.asarray(NO_BAD_LEAF, jnp.int32)
    for i in reversed(range(len(bad))):
        first_bad = jnp.where(bad[i], jnp.int32(i), first_bad)
    return lax.pmin(first_bad, axes)


def skip_nonfinite(
    inner: optax.GradientTransformation,
    axis_name: str | tuple[str, ...] = "data",
    *,
    mode: str = "loss",
    guard_optimizer_state: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that a non-finite step on any worker is skipped by all.

    Args:
      inner: the transform to protect, typically the whole chain
        ``optax.chain(resireduce(...), optimizer)``.
      axis_name: the data-parallel axis (or axes) the workers are mapped over. The
        decision also spans every other mapped axis the gradients vary over (the
        ``local`` axis of a hierarchical mesh), so all devices skip together.
      mode: ``"loss"`` (default): skip when any worker's loss is non-finite, decided
        before the backward pass from the ``loss_ok`` extra argument
        (:func:`value_and_guarded_grad`), and zero (uncounted) the NaN/Inf elements of
        gradients under a finite loss; nothing waits for the decision. ``"strict"``: skip when any
        worker's gradient holds a NaN/Inf, decided after the backward pass, every state
        (residuals included) bit-identical to a run without that step; keeps all
        gradients alive until the decision. ``"lean"``: the strict decision, with the
        gradients sanitized and streamed through the exchange (docs/design.md, "The guard's modes
        (nonfinite.py)").
        Without ``loss_ok``, ``"loss"`` decides like ``"strict"``.
      guard_optimizer_state: keep the state of transforms that are not skip-aware
        (optax's optimizers) unchanged on a skipped step too, by a final select that
        costs temporary memory; skip-aware states need no select.

    Returns:
      A transform whose state is a :class:`SkipNonFiniteState` and whose ``update``
      takes the optional ``loss_ok`` extra argument. On a skipped step the updates are
      zeros, the optimizer state and counters are unchanged bit for bit, and the
      exchange state is as documented for the mode.

    Raises:
      ValueError: for an unknown ``mode``.
    """
    if mode not in MODES:
        raise ValueError(
            f"skip_nonfinite(mode={mode!r}): choose one of {', '.join(map(repr, MODES))}."
        )
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return SkipNonFiniteState(
            inner=inner.init(params),
            skipped=jnp.zeros([], jnp.int32),
            last_skipped=jnp.zeros([], bool),
            bad_leaf=jnp.asarray(NO_BAD_LEAF, jnp.int32),
        )

    def update_fn(updates, state, params=None, *, loss_ok=None, **extra_args):
        check_axis_bound(axis_name)
        leaves, treedef = jax.tree.flatten(updates)
        axes = _decision_axes(axis_name, leaves)
        if mode == "loss" and loss_ok is not None:
            # Decided before the backward pass: nothing waits for it. No per-leaf flag is
            # reduced over the workers: XLA:CPU runs such a pmin (it needs every gradient)
            # before the exchange's own collectives and so holds every gradient until the
            # last one exists (+21 % on the wide MLP of benchmarks/guard_cost.py, also
            # when it is traced after the exchange or tied to the new state).
            ok = jnp.asarray(loss_ok, bool)
            bad_leaf = jnp.where(ok, jnp.int32(NO_BAD_LEAF), jnp.int32(LOSS))
            safe = [_replaced(g, lambda b: ok & jnp.isfinite(b), -0.0) for g in leaves]
        else:
            bad_leaf = _first_bad(axes, [_is_bad(g) for g in leaves])
            ok = bad_leaf == NO_BAD_LEAF
            if mode == "lean":
                # Local and elementwise: each gradient streams into the exchange at once.
                safe = [_replaced(g, jnp.isfinite, 0.0) for g in leaves]
            else:  # one decision before anything is sent: G + R == R on a skipped step
                safe = [_replaced(g, lambda b: ok, -0.0) for g in leaves]
        skip = jnp.logical_not(ok)
        # The guard consumes loss_ok and gives the inner chain skip; other extra arguments
        # pass through.
        new_updates, new_inner = inner.update(
            treedef.unflatten(safe), state.inner, params, skip=skip, **extra_args
        )
        new_updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros((), u.dtype)), new_updates)
        if guard_optimizer_state:
            new_inner, new_updates = _keep_unless(ok, new_inner, state.inner, new_updates)
        return new_updates, SkipNonFiniteState(
            inner=new_inner,
            skipped=state.skipped + skip.astype(jnp.int32),
            last_skipped=skip,
            bad_leaf=jnp.where(ok, state.bad_leaf, bad_leaf),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
