"""Memory-reduced optimizers by gradient-space reutilization: AdamW-R, Adan-R, Lion-R.

Dong & Lin, "Reducing Memory Footprint in Deep Network Training by Gradient Space
Reutilization", PRCV 2024 (https://github.com/adonis-dym/memory_reduced_optimizer).
In JAX the idea is write order and buffer aliasing, so that XLA inserts no copy.
adamw_r is bit-identical to optax.adamw; lion_r and adan_r remove optax's copies.
sgd skips a step in place; optimizer_step is a donated optimizer-only step.
get_optimizer returns any of these, or an optax optimizer, by name.
What each saves and why: docs/design.md, "The memory-reduced optimizers
(optimizers/__init__.py)" and docs/optimizers.md.
"""

from resireduce_jax.optimizers.adamw_r import AdamWRState, adamw_r
from resireduce_jax.optimizers.adan_r import AdanRState, adan_r, official_diff_avg
from resireduce_jax.optimizers.lion_r import LionRState, lion_r
from resireduce_jax.optimizers.registry import OPTIMIZERS, get_optimizer
from resireduce_jax.optimizers.sgd import SGDState, sgd
from resireduce_jax.optimizers.step import OptimizerStep, grads_before_state, optimizer_step

__all__ = [
    "OPTIMIZERS",
    "AdamWRState",
    "AdanRState",
    "LionRState",
    "OptimizerStep",
    "SGDState",
    "adamw_r",
    "adan_r",
    "get_optimizer",
    "grads_before_state",
    "lion_r",
    "official_diff_avg",
    "optimizer_step",
    "sgd",
]
