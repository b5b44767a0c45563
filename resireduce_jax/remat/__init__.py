"""Optimal activation checkpointing for heterogeneous chains (rotor) in JAX.

Beaumont et al., "Optimal checkpointing for heterogeneous chains: how to train deep neural
networks with limited memory", ACM TOMS 2024 (https://arxiv.org/abs/1911.13214).
measure_chain gives stage costs; solve runs the dynamic program; apply_plan executes a plan.
ChainPlanner and checkpoint_chain pick the fastest plan whose compiled peak fits a budget.
RotorSequential does the same for Flax linen layers; zoo.model_chain for the zoo models.
On CPU, configure_cpu keeps the barriers that remat needs.
The pieces in detail: docs/remat.md and docs/design.md, "The remat package
(remat/__init__.py)".
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
