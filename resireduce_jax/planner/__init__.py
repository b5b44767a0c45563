"""Fitting a training step into a memory budget, from compiled peaks.

:func:`fit` chooses the fastest candidate configuration whose compiled peak fits a budget
(of the most accurate exchange that fits, by default);
:func:`largest_batch` finds each candidate's largest batch that fits. The planner takes
candidates and a compiler, and knows nothing about training. One module per concern:
``budget``, ``candidates``, ``compiled``, ``bounds``, ``compile_cache``, ``tables``,
``fitting`` and ``batch_search``. See docs/design.md, "Memory planning".
"""

from resireduce_jax.planner.batch_search import BatchSearch, LargestBatch, largest_batch
from resireduce_jax.planner.bounds import PREDICTION_MARGIN, PeakBound, Prediction
from resireduce_jax.planner.budget import format_bytes, parse_budget
from resireduce_jax.planner.candidates import (
    EXCHANGES,
    OPTIMIZERS,
    REMATS,
    Candidate,
    candidate_grid,
)
from resireduce_jax.planner.compile_cache import (
    CachedCompiler,
    Compiler,
    OnceMap,
    compile_threads,
)
from resireduce_jax.planner.compiled import Compiled, DeviceModel
from resireduce_jax.planner.fitting import PREFERENCES, BudgetError, FitResult, fit
from resireduce_jax.planner.tables import Row

__all__ = [
    "EXCHANGES",
    "OPTIMIZERS",
    "PREDICTION_MARGIN",
    "PREFERENCES",
    "REMATS",
    "BatchSearch",
    "BudgetError",
    "CachedCompiler",
    "Candidate",
    "Compiled",
    "Compiler",
    "DeviceModel",
    "FitResult",
    "LargestBatch",
    "OnceMap",
    "PeakBound",
    "Prediction",
    "Row",
    "candidate_grid",
    "compile_threads",
    "fit",
    "format_bytes",
    "largest_batch",
    "parse_budget",
]
