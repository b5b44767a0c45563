"""Memory-reduced optimizers by gradient-space reutilization: AdamW-R, Adan-R, Lion-R.

Dong & Lin, "Reducing Memory Footprint in Deep Network Training by Gradient Space
Reutilization" (PRCV 2024). In PyTorch the saving is one parameter-sized buffer at the
optimizer-step peak: a temporary is written into a gradient-sized buffer that is dead by
then. In a jitted JAX step XLA fuses element-wise temporaries itself; the JAX version of
the idea is about **write order and buffer aliasing**: with parameters and state
donated, no state buffer's old value may be read after another fusion overwrote it in
place (else XLA inserts a full ``copy``), and Adan's previous gradient should be the
donated incoming gradient itself. Each optimizer's module explains its order.

* :func:`adamw_r` — bit-identical to ``optax.adamw``.
* :func:`lion_r` — Lion with the paper's reordering (equal to ``optax.lion`` in exact
  arithmetic); removes the momentum copy ``optax.lion`` makes.
* :func:`adan_r` — the official Adan (sail-sg), not ``optax.adan`` (which differs from
  step 2 on); no copies of the previous gradient.
* :func:`sgd` — ``optax.sgd`` bit for bit, able to skip a step in place (the CNN configs'
  optimizer under :func:`resireduce_jax.skip_nonfinite`).
* :func:`optimizer_step` — jitted, donated optimizer-only step with the argument order
  that lets XLA reuse every buffer.
* :func:`get_optimizer` — any of these, or an optax optimizer, by name.

All three accept ``max_grad_norm``: gradient clipping by global norm folded into the
same per-leaf pass.
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
