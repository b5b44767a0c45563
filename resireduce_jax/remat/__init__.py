"""Optimal activation checkpointing for heterogeneous chains (rotor) in JAX.

Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal checkpointing for heterogeneous
chains: how to train deep neural networks with limited memory" (arXiv:1911.13214, ACM TOMS
2024).

* :func:`measure_chain`: per-stage sizes, temporaries and times from abstract evaluation
  and compiled programs (:class:`ChainCosts`).
* :class:`RotorTable` / :func:`solve`: the persistent dynamic program; plans are trees of
  :class:`RunStage` / :class:`Checkpoint` items (:class:`Plan`).
* :func:`apply_plan`: the chain as nested ``jax.checkpoint`` following a plan.
* :class:`ChainPlanner` / :func:`checkpoint_chain`: the fastest plan whose *compiled*
  gradient peak fits a budget (bytes, or a fraction of the no-remat peak).
* :class:`RotorSequential`: the same for a sequence of Flax linen layers;
  :func:`zoo.model_chain` runs the chain-able models of the zoo (ResNet / GPT-2 / ViT, whose
  stages the models give) as such layers, with the models' own parameter names.
* :mod:`baselines`: no remat, every stage, √L segments, recursive halving.

On CPU, ``XLA_FLAGS`` must contain ``--xla_disable_hlo_passes=cse_barrier_expander`` (see
:func:`resireduce_jax.runtime.configure_cpu`); otherwise XLA merges the recomputation back
into the forward pass. The planner checks that the barriers survived.
"""

from resireduce_jax.remat import baselines, zoo
from resireduce_jax.remat.budget_search import (
    ChainPlanner,
    RematChoice,
    checkpoint_chain,
    parse_budget,
)
from resireduce_jax.remat.costs import ChainCosts, chain_shapes, measure_chain
from resireduce_jax.remat.executor import (
    CompiledGradient,
    apply_plan,
    compile_gradient,
    gradient_program,
    sequenced_loss,
    sequenced_stage,
    sum_of_outputs,
)
from resireduce_jax.remat.flax import RotorSequential
from resireduce_jax.remat.solver import (
    Checkpoint,
    Plan,
    RotorTable,
    RunStage,
    Solution,
    predict,
    solve,
)

__all__ = [
    "ChainCosts",
    "ChainPlanner",
    "Checkpoint",
    "CompiledGradient",
    "Plan",
    "RematChoice",
    "RotorSequential",
    "RotorTable",
    "RunStage",
    "Solution",
    "apply_plan",
    "baselines",
    "chain_shapes",
    "checkpoint_chain",
    "compile_gradient",
    "gradient_program",
    "measure_chain",
    "parse_budget",
    "predict",
    "sequenced_loss",
    "sequenced_stage",
    "solve",
    "sum_of_outputs",
    "zoo",
]
