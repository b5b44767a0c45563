"""Lion-R: Lion with gradient-space reutilization (Dong & Lin, PRCV 2024, §3.3).

GSR: Dong & Lin, "Reducing Memory Footprint in Deep Network Training by Gradient Space
Reutilization", PRCV 2024 (https://github.com/adonis-dym/memory_reduced_optimizer).
Lion: Chen et al., "Symbolic Discovery of Optimization Algorithms", https://arxiv.org/abs/2302.06675.
Lion-R computes the new momentum first, then the interpolation from it alone.
So the old momentum has one reader, and XLA need not copy it as for optax.lion.
The result equals Lion's in exact arithmetic; the reordering needs b2 > 0.
The reordering and its rounding: docs/design.md, "Lion-R's reordering (optimizers/lion_r.py)".
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
    check_hyperparameters,
    check_max_grad_norm,
    decoupled_optimizer,
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
      Reutilization", PRCV 2024, §3.3 (Lion-R, Algorithm 3); code:
      https://github.com/adonis-dym/memory_reduced_optimizer.
      Chen et al., "Symbolic Discovery of Optimization Algorithms", NeurIPS 2023
      (https://arxiv.org/abs/2302.06675).
    """
    check_beta("b1", b1)
    check_beta(
        "b2",
        b2,
        positive=True,
        why="Lion-R rebuilds the step direction from the new momentum as "
        "g + (b1/b2)(m_new - g), which divides by b2.",
    )
    check_hyperparameters(learning_rate, weight_decay)
    clip_norm = check_max_grad_norm(max_grad_norm)
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
    ratio = b1 / b2

    def init_states(params: optax.Params) -> tuple[optax.Updates]:
        return (optax.tree.zeros_like(params, dtype=mu_dtype),)

    def new_momentum(g, mu):
        return ((1 - b2) * g + b2 * mu,)

    def direction(g, mu_new):
        return jnp.sign(g + ratio * (mu_new - g))

    def step_rules(count_inc: jax.Array):
        del count_inc  # Lion has no bias correction
        return new_momentum, direction

    return decoupled_optimizer(
        "lion_r", LionRState, init_states, step_rules, learning_rate, weight_decay, mask, clip_norm
    )
