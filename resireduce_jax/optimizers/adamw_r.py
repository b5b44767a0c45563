"""AdamW-R: AdamW with gradient-space reutilization (Dong & Lin, PRCV 2024, §3.1).

GSR: Dong & Lin, "Reducing Memory Footprint in Deep Network Training by Gradient Space
Reutilization", PRCV 2024 (https://github.com/adonis-dym/memory_reduced_optimizer).
In JAX the saving comes from write order and aliasing, not from reusing a buffer by hand.
Each old moment is read only by the fusion that overwrites it, so XLA copies nothing.
This is optax.adamw's order, so the two are bit-identical; clipping is folded in.
In an optimizer-only step pass step(params, opt_state, grads), all donated.
The order and the aliasing: docs/design.md, "AdamW-R's write order
(optimizers/adamw_r.py)".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from resireduce_jax.optimizers._common import (
    MaskOrFn,
    ScalarOrSchedule,
    check_hyperparameters,
    check_max_grad_norm,
    decoupled_optimizer,
)

__all__ = ["AdamWRState", "adamw_r"]


class AdamWRState(NamedTuple):
    """State of :func:`adamw_r`.

    Attributes:
      count: number of steps taken (int32); drives bias correction and schedules.
      mu: first moment (exponential average of gradients), like ``params``.
      nu: second moment (exponential average of squared gradients), like ``params``.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def adamw_r(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: MaskOrFn = None,
    *,
    nesterov: bool = False,
    max_grad_norm: float | None = None,
) -> optax.GradientTransformation:
    r"""AdamW with gradient-space reutilization (AdamW-R), bit-identical to ``optax.adamw``.

    Per leaf, with :math:`t` the 1-based step and :math:`g` the (optionally clipped)
    gradient:

    .. math::
        m_t = β_1 m_{t-1} + (1-β_1) g,\quad v_t = β_2 v_{t-1} + (1-β_2) g^2,\\
        u_t = -η_t \Big(\frac{m_t/(1-β_1^t)}{\sqrt{v_t/(1-β_2^t) + ε_{root}} + ε}
              + λ_t\, p\Big).

    Args:
      learning_rate: η, a float or an optax schedule of the step count (0-based).
      b1: β1, decay of the first moment, in [0, 1).
      b2: β2, decay of the second moment, in [0, 1).
      eps: ε added to the root of the second moment.
      eps_root: ε added inside the root.
      mu_dtype: storage dtype of the first moment (``None``: like the gradient).
      weight_decay: λ, decoupled weight decay (float or schedule), >= 0.
      mask: which leaves are decayed: ``None`` (all), a pytree of bools with the
        structure of the params (or a prefix of it), or a callable of the params
        returning one. As in ``optax.adamw``.
      nesterov: use Nesterov momentum (NAdamW), as ``optax.adamw(nesterov=True)``.
      max_grad_norm: if set, gradients are first clipped to this global L2 norm exactly
        as ``optax.clip_by_global_norm`` does, inside the same per-leaf pass.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is :class:`AdamWRState`.
      ``update`` takes an optional ``skip`` (a traced boolean): where true the update is
      zero and the state is unchanged bit for bit, computed in the same in-place pass
      (what :func:`resireduce_jax.skip_nonfinite` relies on).

    Raises:
      ValueError: for betas outside [0, 1), negative eps, learning rate or weight decay,
        or a non-positive ``max_grad_norm``.

    References:
      Dong & Lin, "Reducing Memory Footprint in Deep Network Training by Gradient Space
      Reutilization", PRCV 2024, §3.1 (AdamW-R, Algorithm 1); code:
      https://github.com/adonis-dym/memory_reduced_optimizer.
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
    """
    check_hyperparameters(
        learning_rate,
        weight_decay,
        betas={"b1": b1, "b2": b2},
        non_negative={"eps": eps, "eps_root": eps_root},
    )
    clip_norm = check_max_grad_norm(max_grad_norm)
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def init_states(params: optax.Params) -> tuple[optax.Updates, optax.Updates]:
        return optax.tree.zeros_like(params, dtype=mu_dtype), optax.tree.zeros_like(params)

    def step_rules(count_inc: jax.Array):
        bias1 = 1 - b1**count_inc
        bias2 = 1 - b2**count_inc
        bias1_next = 1 - b1 ** optax.safe_increment(count_inc) if nesterov else None

        def new_moments(g, mu, nu):
            return (1 - b1) * g + b1 * mu, (1 - b2) * (g * g) + b2 * nu

        def direction(g, mu_new, nu_new):
            if nesterov:
                mu_hat = b1 * (mu_new / bias1_next.astype(mu_new.dtype)) + (1 - b1) * (
                    g / bias1.astype(g.dtype)
                )
            else:
                mu_hat = mu_new / bias1.astype(mu_new.dtype)
            nu_hat = nu_new / bias2.astype(nu_new.dtype)
            return mu_hat / (jnp.sqrt(nu_hat + eps_root) + eps)

        return new_moments, direction

    return decoupled_optimizer(
        "adamw_r",
        AdamWRState,
        init_states,
        step_rules,
        learning_rate,
        weight_decay,
        mask,
        clip_norm,
    )
