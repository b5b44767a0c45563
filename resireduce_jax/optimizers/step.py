"""A jitted, donated optimizer-only step whose argument order lets XLA reuse every buffer.

jax.jit pairs each output with the first unpaired donated input of its shape and dtype.
So the argument order decides which buffer each output reuses, and a bad one copies.
adamw_r and lion_r take (params, opt_state, grads); adan_r takes (params, grads, opt_state).
optimizer_step builds the step with the right order.
Details: docs/design.md, "The optimizer step's argument order (optimizers/step.py)".
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from resireduce_jax.optimizers.adan_r import AdanRState

PyTree = Any

__all__ = ["OptimizerStep", "grads_before_state", "optimizer_step"]


def grads_before_state(opt_state: PyTree) -> bool:
    """Whether the donated step should take the gradients before the optimizer state.

    True when ``opt_state`` holds an :class:`~resireduce_jax.optimizers.AdanRState`
    (its first parameter-shaped field must pair with the incoming gradient).
    """
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, AdanRState))
    return any(isinstance(x, AdanRState) for x in nodes)


def _apply(tx: optax.GradientTransformation, params, opt_state, grads):
    updates, new_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_state


class OptimizerStep:
    """``step(params, opt_state, grads) -> (params, opt_state)``, jitted with all three donated.

    Internally the jitted function takes ``(params, grads, opt_state)`` when
    :func:`grads_before_state` says so (or ``grads_first`` forces it). ``lower`` takes
    the same arguments as the call and returns the ``jax.stages.Lowered`` program, for
    inspecting ``compile().memory_analysis()`` and the HLO.
    """

    def __init__(self, tx: optax.GradientTransformation, grads_first: bool | None = None):
        self.tx = tx
        self.grads_first = grads_first
        self._state_first = jax.jit(lambda p, s, g: _apply(tx, p, s, g), donate_argnums=(0, 1, 2))
        self._grads_first = jax.jit(lambda p, g, s: _apply(tx, p, s, g), donate_argnums=(0, 1, 2))

    def _wants_grads_first(self, opt_state: PyTree) -> bool:
        if self.grads_first is not None:
            return self.grads_first
        return grads_before_state(opt_state)

    def __call__(self, params: PyTree, opt_state: PyTree, grads: PyTree):
        if self._wants_grads_first(opt_state):
            return self._grads_first(params, grads, opt_state)
        return self._state_first(params, opt_state, grads)

    def lower(self, params: PyTree, opt_state: PyTree, grads: PyTree) -> jax.stages.Lowered:
        if self._wants_grads_first(opt_state):
            return self._grads_first.lower(params, grads, opt_state)
        return self._state_first.lower(params, opt_state, grads)


def optimizer_step(
    tx: optax.GradientTransformation, *, grads_first: bool | None = None
) -> OptimizerStep:
    """The optimizer-only step of ``tx`` with parameters, state and gradients donated.

    Args:
      tx: any optax transformation (this library's optimizers or optax's).
      grads_first: force the internal argument order; ``None`` picks it from the state
        type (gradients first for :func:`~resireduce_jax.optimizers.adan_r`).

    Returns:
      An :class:`OptimizerStep`. The arrays passed to it are donated: do not reuse them.
    """
    return OptimizerStep(tx, grads_first)
