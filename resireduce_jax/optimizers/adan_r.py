"""Adan-R: the official Adan with gradient-space reutilization (Dong & Lin, PRCV 2024, §3.2).

GSR: Dong & Lin, "Reducing Memory Footprint in Deep Network Training by Gradient Space
Reutilization", PRCV 2024 (https://github.com/adonis-dym/memory_reduced_optimizer).
Adan: Xie et al., https://arxiv.org/abs/2208.06677; the update follows the official code.
The state keeps a carry instead of Adan's v, so that no buffer has two late readers.
Pass the gradients before the state, all donated: the gradient becomes the new prev_grad.
Scalars are float64 for float64 parameters, so float64 runs match official Adan to rounding.
The update, the buffer hand-over and the precision: docs/design.md, "Adan-R's update and
buffers (optimizers/adan_r.py)".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from resireduce_jax.optimizers._common import (
    MaskOrFn,
    ScalarOrSchedule,
    check_beta,
    check_hyperparameters,
    check_max_grad_norm,
    decay_flags,
    global_norm,
    is_zero_constant,
    require_params,
    scalar_as,
    scalar_dtype,
    value_at,
)

__all__ = ["AdanRState", "adan_r", "official_diff_avg"]


class AdanRState(NamedTuple):
    """State of :func:`adan_r`. The order of the fields is part of the memory design.

    Attributes:
      count: number of steps taken (int32).
      prev_grad: the previous step's gradient as it arrived (before clipping).
      exp_avg_sq: :math:`n`, average of squared Nesterov-corrected gradients.
      exp_avg: :math:`m`, average of gradients.
      diff_carry: :math:`w = β_2 v - (1-β_2)\\tilde g_{prev}`; the official
        ``exp_avg_diff`` :math:`v` is :func:`official_diff_avg` of this state.
      prev_grad_scale: clip factor that was applied to ``prev_grad`` (a scalar of the
        params' scalar dtype: float32, or float64 for float64 params), or ``None`` when the
        optimizer does not clip.
    """

    count: jax.Array
    prev_grad: optax.Updates
    exp_avg_sq: optax.Updates
    exp_avg: optax.Updates
    diff_carry: optax.Updates
    prev_grad_scale: jax.Array | None


def official_diff_avg(state: AdanRState, b2: float = 0.92) -> optax.Updates:
    """The official Adan's ``exp_avg_diff`` (:math:`v`) recovered from an :class:`AdanRState`.

    :math:`v = (w + (1-β_2)\\, s\\, g_{prev}) / β_2`; zero before the first step. Meant for
    inspection and checkpoint conversion; exact up to rounding. Requires ``b2 > 0``.
    """
    check_beta("b2", b2, positive=True, why="Recovering v divides by b2.")
    started = state.count > 0

    def leaf(w, prev):
        if state.prev_grad_scale is not None:
            prev = prev * scalar_as(state.prev_grad_scale, prev)
        v = (w + (1 - b2) * prev) / b2
        return jnp.where(started, v, jnp.zeros_like(v))

    return jax.tree.map(leaf, state.diff_carry, state.prev_grad)


def adan_r(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.98,
    b2: float = 0.92,
    b3: float = 0.99,
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: MaskOrFn = None,
    *,
    no_prox: bool = False,
    max_grad_norm: float | None = None,
) -> optax.GradientTransformation:
    """Official Adan with gradient-space reutilization (Adan-R).

    Args:
      learning_rate: η, a float or an optax schedule of the step count (0-based).
      b1: β1, decay of the gradient average, in [0, 1). Official default 0.98.
      b2: β2, decay of the gradient-difference average, in [0, 1). Official default 0.92.
      b3: β3, decay of the squared-term average, in [0, 1). Official default 0.99.
      eps: ε added outside the (bias-corrected) square root.
      weight_decay: λ (float or schedule), >= 0. Applied as the official code does:
        proximal ``θ ← (θ − Δ)/(1 + ηλ)`` by default, ``θ ← θ(1 − ηλ) − Δ`` with
        ``no_prox``.
      mask: which leaves are decayed: ``None`` (all), a pytree of bools with the params'
        structure (or a prefix), or a callable of the params returning one.
      no_prox: use the non-proximal weight decay (official ``no_prox=True``).
      max_grad_norm: if set, scale the gradients by ``min(1, c / (‖g‖ + ε))`` first, as the
        official ``max_grad_norm`` does (``None`` here is the official ``0``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is :class:`AdanRState`;
      ``update`` takes an optional ``skip`` like :func:`~resireduce_jax.adamw_r` (a
      skipped step's gradient does not become the next step's previous gradient).

    Raises:
      ValueError: for betas outside [0, 1), negative eps, learning rate or weight decay,
        or a non-positive ``max_grad_norm``.

    References:
      Dong & Lin, "Reducing Memory Footprint in Deep Network Training by Gradient Space
      Reutilization", PRCV 2024, §3.2 (Adan-R, Algorithm 2); code:
      https://github.com/adonis-dym/memory_reduced_optimizer.
      Xie et al., "Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep
      Models", TPAMI 2024, Algorithm 1 (https://arxiv.org/abs/2208.06677); official code
      sail-sg/Adan.
    """
    check_hyperparameters(
        learning_rate, weight_decay, betas={"b1": b1, "b2": b2, "b3": b3}, non_negative={"eps": eps}
    )
    clip_norm = check_max_grad_norm(max_grad_norm)
    skip_decay = is_zero_constant(weight_decay)

    def init_fn(params: optax.Params) -> AdanRState:
        return AdanRState(
            count=jnp.zeros([], jnp.int32),
            prev_grad=optax.tree.zeros_like(params),
            exp_avg_sq=optax.tree.zeros_like(params),
            exp_avg=optax.tree.zeros_like(params),
            diff_carry=optax.tree.zeros_like(params),
            prev_grad_scale=None if clip_norm is None else jnp.ones([], scalar_dtype(params)),
        )

    def update_fn(
        updates: optax.Updates,
        state: AdanRState,
        params: optax.Params | None = None,
        *,
        skip: jax.Array | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, AdanRState]:
        del extra_args
        require_params(params, "adan_r needs the parameters for its weight decay")
        first = state.count == 0
        step = optax.safe_increment(state.count)
        # Scalars in float32, or float64 for float64 params (jax_enable_x64): see
        # _common.scalar_dtype. float32 and bfloat16 params get exactly what they always did.
        dtype = scalar_dtype(params)
        k = step.astype(dtype)
        lr = jnp.asarray(value_at(learning_rate, state.count), dtype)
        decay = jnp.asarray(value_at(weight_decay, state.count), dtype)
        # Official scalars: step_size = lr / bc1, step_size_diff = lr * b2 / bc2.
        step_m = lr / (1 - b1**k)
        step_v = lr * b2 / (1 - b2**k)
        sqrt_bias3 = jnp.sqrt(1 - b3**k)
        if clip_norm is None:
            scale = prev_scale = new_scale = None
        else:
            norm = global_norm(updates).astype(dtype)
            scale = jnp.minimum(1.0, clip_norm / (norm + eps))
            prev_scale, new_scale = state.prev_grad_scale, scale
        flags = decay_flags(mask, params)

        def leaf(grad, prev_raw, n, m, w, p, decayed):
            def clipped(x, factor):
                return x if factor is None else x * scalar_as(factor, x)

            g, prev = clipped(grad, scale), clipped(prev_raw, prev_scale)
            zero = jnp.zeros_like(g)

            def kept(new, old):
                # Under a late skip (skip_nonfinite) the kept state where(skip, old, new) is
                # formed behind a barrier, so that the next state's update and the update
                # read it instead of recomputing it (XLA duplicates cheap element-wise
                # producers into each consumer): each old buffer then has one reader, the
                # pass that overwrites it in place (see _common.gated_step).
                if skip is None:
                    return new
                return lax.optimization_barrier(jnp.where(skip, old.astype(new.dtype), new))

            diff = jnp.where(first, zero, g - prev)
            nesterov = diff * b2 + g
            n_new = kept(b3 * n + (1 - b3) * (nesterov * nesterov), n)
            # The new previous gradient is the incoming one, written after the n update (the
            # old one's other reader: + min(n_new, 0) is 0 unless n_new is NaN) and read by
            # everything after it, so that XLA forms it at once in the old one's buffer
            # (docs/design.md, "Adan-R's update and buffers"). On a skipped step the old one
            # is kept and the step goes on with it (its states are kept, its update is
            # zero): selected after the update instead, for the returned state only, that
            # select is left for the end of a train step, holding every exchanged gradient
            # until then (benchmarks/results/guard_cost.md).
            new_prev = grad + jnp.minimum(n_new, 0).astype(grad.dtype)
            if skip is not None:
                new_prev = jnp.where(skip, prev_raw, new_prev)
            g = clipped(new_prev, scale)
            # The new state takes over buffers in the order n -> m -> w (docs/design.md,
            # "Adan-R's update and buffers"): adding min(n_new, 0) makes the m update read
            # n_new, so it runs after the n update; likewise w after m.
            m_new = kept(b1 * (m + jnp.minimum(n_new, 0)) + (1 - b1) * g, m)
            w_carry = w + jnp.minimum(jnp.abs(m_new), 0)
            w_new = kept(b2 * jnp.where(first, zero, w_carry + (1 - b2) * g) - (1 - b2) * g, w)

            def update_from(g, n_new, m_new, w_new):
                # v from the *new* carry, so that w's old buffer has one reader (the w
                # update itself) and can be overwritten in place in a train step. With
                # b2 = 0, v is the plain gradient difference.
                if b2 > 0:
                    v_new = jnp.where(first, zero, (w_new + (1 - b2) * g) / b2)
                else:
                    v_new = jnp.where(first, zero, g - prev)
                denom = jnp.sqrt(n_new) / scalar_as(sqrt_bias3, g) + eps
                delta = (scalar_as(step_m, g) * m_new + scalar_as(step_v, g) * v_new) / denom
                if decayed and not skip_decay:
                    lr_decay = scalar_as(lr * decay, p)
                    u = -(delta + lr_decay * p)
                    if not no_prox:  # (θ − Δ)/(1 + ηλ) − θ
                        u = u / (1 + lr_decay)
                else:
                    u = -delta
                return u.astype(p.dtype)

            u = update_from(g, n_new, m_new, w_new)
            if skip is not None:
                u = jnp.where(skip, jnp.zeros((), u.dtype), u)
            return (
                u,
                new_prev,
                *(x.astype(o.dtype) for x, o in ((n_new, n), (m_new, m), (w_new, w))),
            )

        out = jax.tree.map(
            leaf,
            updates,
            state.prev_grad,
            state.exp_avg_sq,
            state.exp_avg,
            state.diff_carry,
            params,
            flags,
        )
        new_updates, prev_grad, n, m, w = jax.tree.transpose(
            jax.tree.structure(updates), jax.tree.structure((0, 0, 0, 0, 0)), out
        )
        count = step
        if skip is not None:
            count = jnp.where(skip, state.count, step)
            new_scale = None if new_scale is None else jnp.where(skip, prev_scale, new_scale)
        new_state = AdanRState(
            count=count,
            prev_grad=prev_grad,
            exp_avg_sq=n,
            exp_avg=m,
            diff_carry=w,
            prev_grad_scale=new_scale,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
