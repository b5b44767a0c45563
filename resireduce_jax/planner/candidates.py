"""The candidates the planner weighs: one combination of the memory techniques each.

A :class:`Candidate` is (exchange, optimizer, remat); :func:`candidate_grid` lists them.
See docs/design.md, "Memory planning" ("Candidates").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

#: Residual variants the planner tries by default, most accurate first (the order
#: ``fit(prefer="accuracy")`` ranks them in; the training program's vocabulary): plain
#: error feedback, its residuals in int8 and int4 codes with a scale per block, and
#: ResiReduce w+2d in int4, the smallest. The frontier they come from:
#: benchmarks/results/accuracy_formats/accuracy.md (w+2d in float32 or bfloat16 keeps more
#: bytes than EF in int4 and is less accurate, so it is not tried unless named).
EXCHANGES = ("ef", "ef+int8", "ef+int4", "w+2d+int4")
#: The optimizer as configured by its original library (optax), or the memory-reduced one.
OPTIMIZERS = ("original", "r")
#: No activation checkpointing, or the fastest rotor plan that fits (chain models only).
REMATS = ("none", "rotor")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One combination of the memory techniques.

    Attributes:
      exchange: the residual variant, in the training program's vocabulary (``"ef"``,
        ``"w+2d"``, ``"w+2d+bf16"``, ``"ef+int4"``: a store and its residual format).
      optimizer: ``"original"`` (optax's) or ``"r"`` (this library's memory-reduced one).
      remat: ``"none"``, or ``"rotor"``: the fastest rotor checkpointing plan that fits
        the budget, so the candidate's compiled program depends on the budget.
    """

    exchange: str = "ef"
    optimizer: str = "original"
    remat: str = "none"

    def __post_init__(self):
        if not isinstance(self.exchange, str) or not self.exchange:
            raise ValueError(f"Candidate.exchange must be a variant name, got {self.exchange!r}.")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"Candidate.optimizer={self.optimizer!r}; choose one of {list(OPTIMIZERS)}."
            )
        if self.remat not in REMATS:
            raise ValueError(f"Candidate.remat={self.remat!r}; choose one of {list(REMATS)}.")

    @property
    def adaptive(self) -> bool:
        """Whether what is compiled depends on the budget (a plan chosen for it)."""
        return self.remat != "none"

    @property
    def label(self) -> str:
        return f"{self.exchange} / {self.optimizer} / {self.remat}"

    def as_dict(self) -> dict[str, str]:
        return {"exchange": self.exchange, "optimizer": self.optimizer, "remat": self.remat}


def candidate_grid(
    exchanges: Sequence[str] = EXCHANGES,
    optimizers: Sequence[str] = OPTIMIZERS,
    remats: Sequence[str] = REMATS,
) -> list[Candidate]:
    """Every combination, exchange-major, in the given orders."""
    return [Candidate(e, o, r) for e in exchanges for o in optimizers for r in remats]
