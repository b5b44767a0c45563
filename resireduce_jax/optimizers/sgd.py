"""SGD with (Nesterov) momentum that can skip a step in place: ``optax.sgd``, bit for bit.

The paper configs for CNNs train with SGD and momentum. :func:`sgd` computes exactly what
``optax.sgd`` computes (same operations in the same order), and also takes the ``skip``
extra argument of :func:`resireduce_jax.skip_nonfinite`: on a skipped step the momentum
is kept by a select inside the pass that writes the new momentum, so the guarded step
needs no second momentum buffer (docs/design.md, "The non-finite guard").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from resireduce_jax.optimizers._common import (
    ScalarOrSchedule,
    check_beta,
    check_non_negative,
    descend,
    gated_step,
    value_at,
)

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """State of :func:`sgd`.

    Attributes:
      count: number of steps taken (int32); drives the learning-rate schedule.
      trace: momentum buffer like ``params`` (``optax.MaskedNode()`` leaves without momentum).
    """

    count: jax.Array
    trace: optax.Params


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float | None = None,
    nesterov: bool = False,
    accumulator_dtype: Any | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Stochastic gradient descent with optional (Nesterov) momentum, like ``optax.sgd``.

    .. math::
        t_k = g + μ\, t_{k-1},\qquad u = -η_k \,(t_k \text{ or, Nesterov, } g + μ\, t_k).

    Args:
      learning_rate: η, a float or an optax schedule of the step count (0-based).
      momentum: μ in [0, 1), or ``None`` for plain SGD (no state but the count).
      nesterov: Nesterov momentum.
      accumulator_dtype: storage dtype of the momentum (``None``: like the params).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is :class:`SGDState`.
      ``update`` takes an optional ``skip`` (a traced boolean): where true the update is
      zero and the state unchanged bit for bit.
    """
    check_non_negative("learning_rate", learning_rate)
    if momentum is not None:
        check_beta("momentum", momentum)
    dtype = None if accumulator_dtype is None else jnp.dtype(accumulator_dtype)

    def init_fn(params: optax.Params) -> SGDState:
        if momentum is None:
            trace = jax.tree.map(lambda _: optax.MaskedNode(), params)
        else:
            trace = optax.tree.zeros_like(params, dtype=dtype)
        return SGDState(count=jnp.zeros([], jnp.int32), trace=trace)

    def update_fn(updates, state: SGDState, params=None, *, skip=None, **extra_args):
        del params, extra_args
        lr = value_at(learning_rate, state.count)
        scheduled = callable(learning_rate)

        def leaf(g, t):
            if momentum is None:
                u = descend(g, lr, scheduled=scheduled)
                return (u if skip is None else jnp.where(skip, jnp.zeros((), u.dtype), u)), t

            def new_trace(g, t):
                return (g + momentum * t,)

            def update_from(g, t_new):
                direction = g + momentum * t_new if nesterov else t_new
                return descend(direction, lr, scheduled=scheduled)

            u, (t_new,) = gated_step(skip, g, (t,), new_trace, update_from)
            return u, t_new

        leaves, treedef = jax.tree.flatten(updates)
        traces = treedef.flatten_up_to(state.trace)
        pairs = [leaf(g, t) for g, t in zip(leaves, traces, strict=True)]
        new_updates = treedef.unflatten([u for u, _ in pairs])
        trace = treedef.unflatten([t for _, t in pairs])
        count = optax.safe_increment(state.count)
        count = count if skip is None else jnp.where(skip, state.count, count)
        return new_updates, SGDState(count=count, trace=trace)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
