"""Pieces the three gradient-space-reutilization optimizers share.

Argument checks with errors that say how to fix the call, resolution of float-or-schedule
hyper-parameters, the weight-decay mask, the global gradient norm used by the
folded-in clipping and the optimizer with decoupled weight decay that AdamW-R and Lion-R
are made of (:func:`decoupled_optimizer`, its per-leaf pass :func:`decoupled_step`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from resireduce_jax._src import in_place

PyTree = Any
ScalarOrSchedule = float | Callable[[jax.Array], jax.typing.ArrayLike]
MaskOrFn = PyTree | Callable[[PyTree], PyTree] | None

__all__ = [
    "MaskOrFn",
    "ScalarOrSchedule",
    "accumulation_dtype",
    "check_beta",
    "check_hyperparameters",
    "check_max_grad_norm",
    "check_non_negative",
    "clip_factor",
    "decay_flags",
    "decoupled_optimizer",
    "decoupled_step",
    "descend",
    "global_norm",
    "is_zero_constant",
    "require_params",
    "scalar_as",
    "scalar_dtype",
    "value_at",
]


def _as_float(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"{name} must be a real number, got {value!r} of type {type(value).__name__}."
        ) from err


def check_beta(name: str, value: Any, *, positive: bool = False, why: str = "") -> None:
    """Raises ``ValueError`` unless ``0 <= value < 1`` (``0 < value < 1`` if ``positive``)."""
    beta = _as_float(name, value)
    low_ok = beta > 0.0 if positive else beta >= 0.0
    if not (low_ok and beta < 1.0) or math.isnan(beta):
        interval = "(0, 1)" if positive else "[0, 1)"
        reason = f" {why}" if why else ""
        raise ValueError(
            f"{name} must lie in {interval}, got {beta}.{reason} Exponential-average "
            "coefficients are decay factors: typical values are 0.9 to 0.999."
        )


def check_non_negative(name: str, value: Any) -> None:
    """Raises ``ValueError`` for a negative (or NaN) constant; schedules are not checked."""
    if callable(value):
        return
    number = _as_float(name, value)
    if not number >= 0.0:
        raise ValueError(
            f"{name} must be >= 0, got {number}. The optimizer already steps against the "
            "gradient, so pass the magnitude; use a schedule for values that change."
        )


def check_max_grad_norm(value: Any) -> float | None:
    """Validates ``max_grad_norm``: ``None`` disables clipping, otherwise it must be > 0."""
    if value is None:
        return None
    number = _as_float("max_grad_norm", value)
    if not number > 0.0:
        raise ValueError(
            f"max_grad_norm must be > 0, got {number}. Pass max_grad_norm=None to disable "
            "gradient clipping."
        )
    return number


def check_hyperparameters(
    learning_rate: ScalarOrSchedule,
    weight_decay: ScalarOrSchedule,
    *,
    betas: Mapping[str, Any] | None = None,
    non_negative: Mapping[str, Any] | None = None,
) -> None:
    """The argument checks the optimizers share, in the order they report errors.

    Each of ``betas`` (name to value) must lie in [0, 1) (:func:`check_beta`), each of
    ``non_negative`` (``eps`` and the like) be >= 0, then ``learning_rate`` and
    ``weight_decay`` be >= 0 (constants only: :func:`check_non_negative`).
    """
    for name, value in (betas or {}).items():
        check_beta(name, value)
    for name, value in (non_negative or {}).items():
        check_non_negative(name, value)
    check_non_negative("learning_rate", learning_rate)
    check_non_negative("weight_decay", weight_decay)


def require_params(params: PyTree | None, needs: str) -> None:
    """Raises ``ValueError`` when ``update`` was called without the parameters.

    ``needs`` starts the message, e.g. ``"adamw_r needs the parameters for weight decay"``;
    the fix (``tx.update(grads, opt_state, params)``) is appended.
    """
    if params is None:
        raise ValueError(f"{needs}: call tx.update(grads, opt_state, params).")


def is_zero_constant(value: ScalarOrSchedule) -> bool:
    """Whether ``value`` is the constant zero (such weight decay is skipped, as optax does)."""
    return not callable(value) and isinstance(value, (int, float)) and value == 0


def value_at(value: ScalarOrSchedule, count: jax.Array) -> jax.typing.ArrayLike:
    """``value(count)`` for a schedule, ``value`` itself for a constant."""
    return value(count) if callable(value) else value


def decay_flags(mask: MaskOrFn, params: PyTree) -> PyTree:
    """A pytree of Python bools with the structure of ``params``: True where decay applies.

    Args:
      mask: ``None`` (decay everything), a pytree of bools with the structure of
        ``params`` or a prefix of it (a bool then covers a whole subtree), or a callable
        returning such a pytree given ``params``. Leaves must be concrete booleans.
      params: the parameters.

    Returns:
      One bool per leaf of ``params``.
    """
    if mask is None:
        return jax.tree.map(lambda _: True, params)
    mask_tree = mask(params) if callable(mask) else mask

    def broadcast(flag: Any, subtree: PyTree) -> PyTree:
        try:
            flag = bool(flag)
        except (TypeError, jax.errors.ConcretizationTypeError) as err:
            raise ValueError(
                "mask leaves must be concrete Python or NumPy booleans (the mask decides the "
                f"program's structure), got {flag!r}."
            ) from err
        return jax.tree.map(lambda _: flag, subtree)

    try:
        return jax.tree.map(broadcast, mask_tree, params)
    except ValueError as err:
        if "mask leaves" in str(err):
            raise
        raise ValueError(
            "mask must have the structure of params (or a prefix of it): "
            f"{jax.tree.structure(mask_tree)} does not match {jax.tree.structure(params)}."
        ) from err


def _sum_of_squares(x: jax.Array) -> jax.Array:
    """``sum(x**2)`` of one leaf in :func:`accumulation_dtype` (float32 for float32 and
    narrower leaves, float64 for float64 leaves), without a squared copy of the leaf on CPU
    (:func:`resireduce_jax._src.in_place.sums`: a chunk loop; see
    ``benchmarks/results/gsr_memory.md`` for its cost beside ``optax.clip_by_global_norm``).
    """
    (total,) = in_place.sums(x, (jnp.square,), accumulation_dtype(x.dtype))
    return total


def accumulation_dtype(dtype: Any) -> jnp.dtype:
    """``promote_types(dtype, float32)``: float32 for float32, bfloat16 and float16, float64
    for float64 (with ``jax_enable_x64``)."""
    return jnp.promote_types(dtype, jnp.float32)


def scalar_dtype(tree: PyTree) -> jnp.dtype:
    """The dtype of an optimizer's scalars (step count as a float, bias corrections,
    learning rate, clip factor) for the leaves of ``tree``.

    float32 unless a leaf is float64 (``jax_enable_x64``), then float64: float32 and
    low-precision parameters keep the float32 scalars they always had (bit for bit), and
    float64 parameters get no float32 rounding in their update.
    """
    dtype = jnp.dtype(jnp.float32)
    for leaf in jax.tree.leaves(tree):
        leaf_dtype = getattr(leaf, "dtype", jnp.float32)  # Python scalars: weakly typed
        dtype = jnp.promote_types(dtype, accumulation_dtype(leaf_dtype))
    return dtype


def global_norm(tree: PyTree) -> jax.Array:
    """The L2 norm of all leaves of ``tree`` together, as a scalar of
    :func:`scalar_dtype` (float32, or float64 when a leaf is float64)."""
    total = jnp.zeros([], scalar_dtype(tree))
    for leaf in jax.tree.leaves(tree):
        total = total + _sum_of_squares(leaf)
    return jnp.sqrt(total)


def clip_factor(g_norm: jax.Array, max_norm: float) -> jax.Array:
    """``1`` if ``g_norm < max_norm`` else ``max_norm / g_norm``: the factor
    ``optax.clip_by_global_norm`` applies, as one scalar so that the clipped gradient is a
    cheap multiply XLA fuses into every consumer instead of materializing it."""
    return jnp.where(g_norm < max_norm, jnp.ones_like(g_norm), max_norm / g_norm)


def descend(updates: jax.Array, lr: jax.typing.ArrayLike, *, scheduled: bool) -> jax.Array:
    """``-lr * updates``, with the exact arithmetic of ``optax.scale_by_learning_rate``
    (a constant rate multiplies as a Python scalar, a scheduled one as an array of the
    update's dtype), so that results stay bit-identical to optax's."""
    if scheduled:
        return jnp.array(-1 * lr, dtype=updates.dtype) * updates
    return -1 * lr * updates


def scalar_as(value: jax.typing.ArrayLike, like: jax.Array) -> jax.Array:
    """``value`` as a 0-d array of ``like``'s dtype, so low-precision leaves stay low-precision."""
    return jnp.asarray(value).astype(like.dtype)


def gated_step(
    skip: jax.Array | None,
    g: jax.Array,
    olds: tuple[jax.Array, ...],
    new_states: Callable[..., tuple[jax.Array, ...]],
    update_from: Callable[..., jax.Array],
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """One leaf's step, ``(update, stored new states)``, that a late ``skip`` gates in place.

    ``new_states(g, *olds)`` gives the new states in compute precision and
    ``update_from(g, *news)`` the update from them; each new state is stored in its old
    state's dtype. Without ``skip`` this is exactly that computation. With ``skip`` (a
    traced boolean, decided after every gradient exists: :func:`resireduce_jax.skip_nonfinite`)
    the kept states ``where(skip, old, new)`` are formed first and the update is computed
    *from the kept states*, so that every old state has a single reader, the pass that
    overwrites it: XLA then updates the state in its donated buffer and keeps no copy of
    it (measured: one state-sized copy per leaf otherwise, because the update's fusion
    would re-read the old state after it may have been overwritten). On a step that is
    not skipped the kept states equal the new ones bit for bit, so the update is the
    same; on a skipped step the update is zero and every state is returned unchanged.
    """
    news = new_states(g, *olds)
    if skip is None:
        stored = tuple(n.astype(o.dtype) for n, o in zip(news, olds, strict=True))
        return update_from(g, *news), stored
    kept = tuple(jnp.where(skip, o.astype(n.dtype), n) for n, o in zip(news, olds, strict=True))
    kept = lax.optimization_barrier(kept)  # the update reads the kept states, not the old
    update = update_from(g, *kept)
    update = jnp.where(skip, jnp.zeros((), update.dtype), update)
    return update, tuple(k.astype(o.dtype) for k, o in zip(kept, olds, strict=True))


def decoupled_step(
    updates: PyTree,
    states: tuple[PyTree, ...],
    params: PyTree,
    *,
    count: jax.Array,
    learning_rate: ScalarOrSchedule,
    weight_decay: ScalarOrSchedule,
    mask: MaskOrFn,
    clip_norm: float | None,
    skip: jax.Array | None,
    new_states: Callable[..., tuple[jax.Array, ...]],
    direction: Callable[..., jax.Array],
) -> tuple[PyTree, tuple[PyTree, ...]]:
    """The per-leaf pass of AdamW-R and Lion-R: ``(updates, new states)``.

    Per leaf, ``g`` is the gradient (times :func:`clip_factor` of the global norm when
    ``clip_norm`` is set), ``new_states(g, *olds)`` gives the leaf's new states in compute
    precision and the update is :math:`-η_t(\text{direction}(g, *news) + λ_t p)` (decoupled
    weight decay on the leaves ``mask`` selects; a constant zero λ is skipped, as optax
    does), with η and λ read at ``count`` and descended as :func:`descend` does. The
    step is :func:`gated_step`: a late ``skip`` gives a zero update and the old states.

    Args:
      updates: the gradients.
      states: the optimizer's per-leaf state trees (each like ``params``), in the order
        ``new_states`` takes and returns them.
      params: the parameters.
      count: the step count the schedules are read at.
      learning_rate, weight_decay, mask: as the optimizers take them.
      clip_norm: ``max_grad_norm`` as :func:`check_max_grad_norm` returned it.
      skip: the ``skip`` extra argument, or ``None``.
      new_states: ``(g, *olds) -> news``.
      direction: ``(g, *news) -> d``, the step direction before weight decay.

    Returns:
      The update tree and a tuple of the new state trees, each old state's dtype.
    """
    decay = value_at(weight_decay, count)
    lr = value_at(learning_rate, count)
    skip_decay = is_zero_constant(weight_decay)
    flags = decay_flags(mask, params)
    if clip_norm is not None:
        factor = clip_factor(global_norm(updates), clip_norm)

    def leaf(g, p, decayed, *olds):
        if clip_norm is not None:
            g = g * scalar_as(factor, g)

        def update_from(g, *news):
            u = direction(g, *news)
            if decayed and not skip_decay:
                u = u + decay * p
            return descend(u, lr, scheduled=callable(learning_rate))

        u, news = gated_step(skip, g, olds, new_states, update_from)
        return (u, *news)

    out = jax.tree.map(leaf, updates, params, flags, *states)
    inner = jax.tree.structure((0,) * (len(states) + 1))
    new_updates, *news = jax.tree.transpose(jax.tree.structure(updates), inner, out)
    return new_updates, tuple(news)


def decoupled_optimizer(
    name: str,
    state_type: Callable[..., Any],
    init_states: Callable[[PyTree], tuple[PyTree, ...]],
    step_rules: Callable[[jax.Array], tuple[Callable[..., Any], Callable[..., jax.Array]]],
    learning_rate: ScalarOrSchedule,
    weight_decay: ScalarOrSchedule,
    mask: MaskOrFn,
    clip_norm: float | None,
) -> optax.GradientTransformationExtraArgs:
    """An optimizer with decoupled weight decay made of per-leaf rules (AdamW-R, Lion-R).

    Its state is ``state_type(count, *states)``: an int32 step count (advanced unless a
    step is skipped) and the per-leaf state trees, ``init_states(params)`` at first. Each
    ``update`` calls ``step_rules(count + 1)`` for the step's ``(new_states, direction)``
    and runs :func:`decoupled_step` with them, at the old count for the schedules.

    Args:
      name: the optimizer's name, for the error when ``update`` gets no parameters.
      state_type: the state's ``NamedTuple``, fields ``count`` and then the state trees.
      init_states: ``params -> (state tree, ...)``.
      step_rules: ``count_inc -> (new_states, direction)``, as :func:`decoupled_step`
        takes them (bias corrections and the like are functions of ``count_inc``).
      learning_rate, weight_decay, mask: as the optimizers take them.
      clip_norm: ``max_grad_norm`` as :func:`check_max_grad_norm` returned it.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes an optional
      ``skip`` (a traced boolean): where true the update is zero and the state unchanged
      bit for bit (what :func:`resireduce_jax.skip_nonfinite` relies on).
    """

    def init_fn(params: optax.Params) -> Any:
        return state_type(jnp.zeros([], jnp.int32), *init_states(params))

    def update_fn(
        updates: optax.Updates,
        state: Any,
        params: optax.Params | None = None,
        *,
        skip: jax.Array | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, Any]:
        del extra_args
        require_params(params, f"{name} needs the parameters for weight decay")
        count_inc = optax.safe_increment(state.count)
        new_states, direction = step_rules(count_inc)
        new_updates, news = decoupled_step(
            updates,
            tuple(state[1:]),
            params,
            count=state.count,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            mask=mask,
            clip_norm=clip_norm,
            skip=skip,
            new_states=new_states,
            direction=direction,
        )
        count = count_inc if skip is None else jnp.where(skip, state.count, count_inc)
        return new_updates, state_type(count, *news)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
