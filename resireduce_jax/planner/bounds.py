"""Ruling a configuration out before compiling it: lower bounds and predicted peaks.

A :class:`PeakBound` comes from shapes alone, a :class:`Prediction` from the programs
compiled so far. Both let :func:`~resireduce_jax.planner.fit` and
:func:`~resireduce_jax.planner.largest_batch` skip compilations. See docs/design.md,
"Memory planning" ("Ruling out before compiling").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from resireduce_jax.planner.budget import format_bytes
from resireduce_jax.planner.candidates import Candidate

if TYPE_CHECKING:
    from resireduce_jax.planner.compile_cache import CachedCompiler


@dataclasses.dataclass(frozen=True)
class PeakBound:
    """A lower bound on a candidate's compiled peak that needs no compilation.

    The compiled peak is ``argument + output - alias + temp`` (``hlo.peak_memory``): every
    argument counts in full, and the forward pass writes each activation between two
    stages of a chain into ``temp``. So the bytes of the step's arguments (parameters,
    optimizer state, residuals, model state, batch) plus the smallest such activation
    bound the peak from below, from shapes alone.

    Attributes:
      parts: bytes per device by what they hold, in the order they are reported.
    """

    parts: Mapping[str, int]

    @property
    def bytes(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        """``"2.61 MiB = params 700.00 KiB + optimizer state 1.31 MiB + ..."``."""
        parts = " + ".join(f"{name} {format_bytes(n)}" for name, n in self.parts.items() if n)
        return f"{format_bytes(self.bytes)} = {parts}"


PREDICTION_MARGIN = 0.05
"""A compilation is skipped when a prediction from compiled programs puts its peak more
than this fraction over the budget, even at the low end of the prediction (see
:class:`Prediction`); a batch search takes a batch as fitting when the high end is this
fraction under it."""


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A compiled peak expected from programs compiled so far, without compiling.

    Attributes:
      value: the expected peak (bytes).
      low: the peak is at least this (e.g. the same program at a smaller batch).
      high: and at most this (``math.inf``: no upper end known).
      source: what it was predicted from, for the table.
    """

    value: float
    low: float
    high: float
    source: str = "the programs compiled"

    def over(self, budget: int) -> bool:
        """Over the budget by more than :data:`PREDICTION_MARGIN`, even at its low end."""
        return self.low > budget * (1 + PREDICTION_MARGIN)

    def under(self, budget: int) -> bool:
        """Under the budget by :data:`PREDICTION_MARGIN`, even at its high end."""
        return self.high * (1 + PREDICTION_MARGIN) <= budget

    def describe(self) -> str:
        return f"predicted {format_bytes(self.value)} from {self.source}"


def _skip_reason(compiler: CachedCompiler, candidate: Candidate, batch: int, budget: int):
    """``(peak, reason)`` when ``candidate``'s leanest form at ``batch`` need not be
    compiled to know that it does not fit, else ``None``."""
    bound = compiler.peak_bound(candidate, batch)
    if bound is not None and bound.bytes > budget:
        return bound.bytes, f"needs at least {bound.describe()}"
    predicted = compiler.predicted_peak(candidate, batch)
    if predicted is not None and predicted.over(budget):
        return predicted.value, predicted.describe()
    return None


def _search_order(compiler: CachedCompiler, batch: int) -> Callable[[Candidate], tuple]:
    """Candidates that compile one program first, then the adaptive ones (a search over
    plans, whose monolithic step the first ones predict); each leanest bound first, so
    that every compilation prices the next ones (:meth:`Compiler.predicted_peak`)."""

    def key(candidate: Candidate) -> tuple:
        bound = compiler.peak_bound(candidate, batch)
        return (candidate.adaptive, 0 if bound is None else bound.bytes)

    return key
