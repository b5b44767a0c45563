r"""Lion-R: Lion with gradient-space reutilization (Dong & Lin, PRCV 2024, §3.3).

Lion (Chen et al., 2023) steps along ``sign(β1·m + (1−β1)·g)`` and then updates
``m ← β2·m + (1−β2)·g``. Both read the *old* momentum. In a donated, jitted JAX step the
new momentum is written into the old momentum's buffer, so the fusion computing the
sign would read a buffer that another fusion overwrites: XLA resolves the conflict with
a full ``copy`` of ``m`` (measured: ``optax.lion`` spends one momentum-sized temporary
per step). Lion-R reorders the computation as the paper does (there, to reuse the
gradient buffer for the interpolation): first the new momentum, then the interpolation
from the new momentum only,

.. math::
    m_t = β_2 m_{t-1} + (1-β_2) g,\qquad
    c_t = g + \frac{β_1}{β_2}\,(m_t - g) = (1-β_1) g + β_1 m_{t-1},

so the old momentum has a single reader (the fusion that overwrites it) and no copy is
needed. ``c_t`` equals Lion's interpolation in exact arithmetic; in floating point the
two differ by rounding, which flips ``sign(c)`` only where ``c`` is within a few ulps of
zero. The reordering divides by β2, so β2 must be > 0.

Aliasing in an optimizer-only step: ``jax.jit(step, donate_argnums=(0, 1, 2))`` with the
argument order ``step(params, opt_state, grads)`` (see
:func:`resireduce_jax.optimizers.optimizer_step`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from resireduce_jax.optimizers._common import (
    MaskOrFn,
    ScalarOrSchedule,
    check_beta,
    check_max_grad_norm,
    check_non_negative,
    clip_factor,
    decay_flags,
    descend,
    gated_step,
    global_norm,
    is_zero_constant,
    scalar_as,
    value_at,
)

__all__ = ["LionRState", "lion_r"]


class LionRState(NamedTuple):
    """State of :func:`lion_r`.

    Attributes:
      count: number of steps taken (int32); drives the schedules.
      mu: momentum (exponential average of gradients with decay β2), like ``params``.
    """

    count: jax.Array
    mu: optax.Updates


def lion_r(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Any | None = None,
    weight_decay: ScalarOrSchedule = 1e-3,
    mask: MaskOrFn = None,
    *,
    max_grad_norm: float | None = None,
) -> optax.GradientTransformation:
    r"""Lion with gradient-space reutilization (Lion-R); same hyper-parameters as ``optax.lion``.

    Per leaf, with :math:`g` the (optionally clipped) gradient:

    .. math::
        m_t = β_2 m_{t-1} + (1-β_2) g,\quad
        u_t = -η_t\big(\operatorname{sign}(g + \tfrac{β_1}{β_2}(m_t - g)) + λ_t p\big).

    Args:
      learning_rate: η, a float or an optax schedule of the step count (0-based).
      b1: β1, interpolation weight of the momentum in the step direction, in [0, 1).
      b2: β2, decay of the momentum, in (0, 1): the reordering divides by it.
      mu_dtype: storage dtype of the momentum (``None``: like the gradient).
      weight_decay: λ, decoupled weight decay (float or schedule), >= 0.
      mask: which leaves are decayed, as in ``optax.lion``: ``None`` (all), a pytree of
        bools (or a prefix), or a callable of the params returning one.
      max_grad_norm: if set, gradients are first clipped to this global L2 norm exactly
        as ``optax.clip_by_global_norm`` does, inside the same per-leaf pass.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is :class:`LionRState`;
      ``update`` takes an optional ``skip`` like :func:`~resireduce_jax.adamw_r`.

    Raises:
      ValueError: for β1 outside [0, 1), β2 outside (0, 1), a negative learning rate or
        weight decay, or a non-positive ``max_grad_norm``.

    References:
      Dong & Lin, "Reducing Memory Footprint in Deep Network Training by Gradient Space
      Reutilization", PRCV 2024, §3.3 (Lion-R, Algorithm 3).
      Chen et al., "Symbolic Discovery of Optimization Algorithms", NeurIPS 2023.
    """
    check_beta("b1", b1)
    check_beta(
        "b2",
        b2,
        positive=True,
        why="Lion-R rebuilds the step direction from the new momentum as "
        "g + (b1/b2)(m_new - g), which divides by b2.",
    )
    check_non_negative("learning_rate", learning_rate)
    check_non_negative("weight_decay", weight_decay)
    clip_norm = check_max_grad_norm(max_grad_norm)
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
    skip_decay = is_zero_constant(weight_decay)
    ratio = b1 / b2

    def init_fn(params: optax.Params) -> LionRState:
        return LionRState(
            count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params, dtype=mu_dtype)
        )

    def update_fn(
        updates: optax.Updates,
        state: LionRState,
        params: optax.Params | None = None,
        *,
        skip: jax.Array | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LionRState]:
        del extra_args
        if params is None:
            raise ValueError(
                "lion_r needs the parameters for weight decay: call "
                "tx.update(grads, opt_state, params)."
            )
        decay = value_at(weight_decay, state.count)
        lr = value_at(learning_rate, state.count)
        flags = decay_flags(mask, params)
        if clip_norm is not None:
            factor = clip_factor(global_norm(updates), clip_norm)

        def leaf(g, mu, p, decayed):
            if clip_norm is not None:
                g = g * scalar_as(factor, g)

            def new_momentum(g, mu):
                return ((1 - b2) * g + b2 * mu,)

            def update_from(g, mu_new):
                u = jnp.sign(g + ratio * (mu_new - g))
                if decayed and not skip_decay:
                    u = u + decay * p
                return descend(u, lr, scheduled=callable(learning_rate))

            u, (mu_new,) = gated_step(skip, g, (mu,), new_momentum, update_from)
            return u, mu_new

        out = jax.tree.map(leaf, updates, state.mu, params, flags)
        new_updates, mu = jax.tree.transpose(
            jax.tree.structure(updates), jax.tree.structure((0, 0)), out
        )
        count = optax.safe_increment(state.count)
        count = count if skip is None else jnp.where(skip, state.count, count)
        return new_updates, LionRState(count=count, mu=mu)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
