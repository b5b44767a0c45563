"""The fastest candidate whose compiled peak fits a memory budget (:func:`fit`).

Every candidate not ruled out is compiled at one batch; the result is the choice and the
whole table. See docs/design.md, "Memory planning" ("Choosing", "Density phases").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from resireduce_jax.planner.bounds import _search_order, _skip_reason
from resireduce_jax.planner.budget import format_bytes, parse_budget
from resireduce_jax.planner.candidates import Candidate
from resireduce_jax.planner.compile_cache import CompileFn, Compiler, _bar, _cached, _run_all
from resireduce_jax.planner.compiled import DeviceModel
from resireduce_jax.planner.tables import Row, _row, _ruled_out, _table


class BudgetError(ValueError):
    """No candidate fits the budget. ``smallest`` is the row with the smallest peak
    (compiled where any was; else the smallest lower bound)."""

    def __init__(self, budget_bytes: int, rows: Sequence[Row]):
        self.budget_bytes = budget_bytes
        self.rows = list(rows)
        compiled = [r for r in self.rows if not r.ruled_out]
        self.smallest = min(compiled or self.rows, key=lambda r: r.compiled.peak_bytes)
        peak = self.smallest.compiled.peak_bytes
        head = (
            f"no configuration fits the memory budget of {budget_bytes} bytes "
            f"({format_bytes(budget_bytes)}) at {self.smallest.batch_per_worker} per worker: "
        )
        if compiled:
            phase = self.smallest.compiled.peak_phase
            found = (
                f"the smallest compiled peak found is {peak} bytes ({format_bytes(peak)}, "
                f"{self.smallest.candidate.label}"
                + (f", density phase {phase}" if phase else "")
                + f") among {len(self.rows)} candidates"
            )
            if len(compiled) < len(self.rows):
                found += f" ({len(self.rows) - len(compiled)} ruled out without compiling)"
        else:
            found = (
                f"every one of the {len(self.rows)} candidates needs more for its arguments "
                f"and one activation: the least, {self.smallest.candidate.label}, "
                f"{self.smallest.ruled_out} ({peak} bytes; bounded from shapes, nothing "
                "compiled)"
            )
        super().__init__(
            head + found + "; raise the budget to at least that or lower the batch per worker."
        )


@dataclasses.dataclass
class FitResult:
    """What :func:`fit` found: the chosen row and the full candidate table."""

    budget_bytes: int
    batch_per_worker: int
    chosen: Row
    rows: list[Row]
    device: DeviceModel

    def as_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "batch_per_worker": self.batch_per_worker,
            "device_model": self.device.as_dict(),
            "chosen": self.chosen.as_dict(),
            "candidates": [r.as_dict() for r in self.rows],
        }

    def table(self) -> str:
        """The candidate table as text, the chosen row marked with ``*``."""
        return _table(
            self.rows,
            f"Memory plan: budget {format_bytes(self.budget_bytes)} per worker, "
            f"{self.batch_per_worker} per worker; step time estimated for {self.device.name}",
            chosen=self.chosen,
        )

    def __str__(self) -> str:
        return self.table()


#: How :func:`fit` chooses among the fitting candidates: ``"accuracy"``, the fastest of the
#: first exchange (in the candidates' order: the most accurate first) with any; ``"speed"``,
#: the fastest of all.
PREFERENCES = ("accuracy", "speed")


def _ranking(candidates: Sequence[Candidate], prefer: str) -> Callable[[Row], tuple]:
    """A row's sort key: its exchange's place among ``candidates`` (``prefer="accuracy"``;
    0 for ``"speed"``), step estimate, peak, table order."""
    tiers: dict[str, int] = {}
    for c in candidates:
        tiers.setdefault(c.exchange, len(tiers))
    order = {c: i for i, c in enumerate(candidates)}

    def rank(row: Row) -> tuple:
        tier = tiers[row.candidate.exchange] if prefer == "accuracy" else 0
        return (tier, row.step_seconds, row.compiled.peak_bytes, order[row.candidate])

    return rank


def _best(rows: Iterable[Row], rank: Callable[[Row], tuple]) -> Row | None:
    """The fitting row that ranks first, or ``None``."""
    return min((r for r in rows if r.fits), key=rank, default=None)


def fit(
    candidates: Sequence[Candidate],
    compile_fn: CompileFn | Compiler,
    budget: int | float | str,
    *,
    batch_per_worker: int,
    device: DeviceModel | None = None,
    progress: Callable[..., Any] | None = None,
    threads: int = 1,
    prefer: str = "accuracy",
) -> FitResult:
    """The fastest candidate whose compiled peak fits ``budget``, with the full table.

    With ``prefer="accuracy"`` (the default) the exchanges rank first, in the order they
    first appear in ``candidates``: the fastest fitting candidate of the first exchange that
    has one. Memory-reduced optimizers and activation checkpointing change no update, a
    narrower residual format or a shared store does, so list the exchanges most accurate
    first (:data:`EXCHANGES` is): a lossy exchange is chosen only where no more accurate one
    fits. ``prefer="speed"`` takes the fastest of all.

    Every candidate is compiled once (abstract shapes: nothing is allocated or run); an
    adaptive candidate (activation checkpointing) is compiled with its fastest
    configuration that fits, or its leanest when none does. For a run of several programs
    (the phases of a density schedule; see :class:`Compiler`) a candidate fits when every
    phase does. Every candidate is first judged by its last phase (the steady state); the
    other phases are compiled only for the fastest candidate whose last phase fits (and
    its search redone over every phase if one does not), until the fastest fits in every
    phase: rows slower than the chosen one may be judged by their last phase alone
    (:attr:`Compiled.all_phases` false). A row's peak is the maximum over the phases
    compiled and ``peak_phase`` names the phase that set it. The step-time estimate is
    :class:`DeviceModel`'s, of the last phase; ties go to the smaller peak, then to the
    earlier candidate.

    A compiler with ``peak_bound`` / ``predicted_peak`` (see :class:`Compiler`) rules
    candidates out before compiling them: one whose lower bound exceeds the budget (when
    all do, the answer comes without any compilation), and one predicted to exceed it by
    more than :data:`PREDICTION_MARGIN`. The others compile leanest bound first.

    Args:
      candidates: the configurations to consider (e.g. :func:`candidate_grid`).
      compile_fn: ``compile_fn(candidate, batch)`` (see :data:`CompileFn`), or a
        :class:`Compiler` (needed for adaptive candidates); a :class:`CachedCompiler`
        keeps its compilations across calls.
      budget: per-worker bytes or a size string (:func:`parse_budget`).
      batch_per_worker: the per-worker batch to compile for.
      device: the step-time model (default :class:`DeviceModel`).
      progress: a ``tqdm.tqdm``-like bar factory, called with ``total=``, ``initial=``
        (candidates ruled out by their bounds), ``desc=`` and ``unit=``.
      threads: candidates compiled at once (see :func:`compile_threads`).
      prefer: ``"accuracy"`` or ``"speed"`` (above).

    Returns:
      A :class:`FitResult`; ``chosen.compiled.peak_bytes <= budget_bytes`` over every
      phase.

    Raises:
      BudgetError: when no candidate fits; the message names the smallest peak found, or
        the smallest bound when every candidate was ruled out by its bound.
      ValueError: for an unreadable budget or no candidates.
    """
    budget_bytes = parse_budget(budget)
    if not candidates:
        raise ValueError("fit() needs at least one candidate.")
    if prefer not in PREFERENCES:
        raise ValueError(f"fit(prefer={prefer!r}); choose one of {list(PREFERENCES)}.")
    rank = _ranking(candidates, prefer)
    device = device or DeviceModel()
    compiler = _cached(compile_fn)
    batch = batch_per_worker
    rows: dict[Candidate, Row] = {}
    for candidate in candidates:
        bound = compiler.peak_bound(candidate, batch)
        if bound is not None and bound.bytes > budget_bytes:
            reason = f"needs at least {bound.describe()}"
            rows[candidate] = _ruled_out(candidate, batch, bound.bytes, reason)
    if len(rows) == len(candidates):
        raise BudgetError(budget_bytes, [rows[c] for c in candidates])
    pending = sorted((c for c in candidates if c not in rows), key=_search_order(compiler, batch))

    def plan(candidate: Candidate) -> Row:
        skip = _skip_reason(compiler, candidate, batch, budget_bytes)
        if skip is not None:
            return _ruled_out(candidate, batch, *skip)
        compiled = compiler.fastest_fitting(candidate, batch, budget_bytes, every_phase=False)
        return _row(candidate, batch, compiled, budget_bytes, device)

    bar = _bar(progress, len(candidates), len(rows), "planning")
    try:
        rows.update(_run_all(plan, pending, threads, bar))
        # Judged by their last phase so far: the other phases of the best candidate are
        # compiled (and its search redone over every phase where one does not fit) until
        # the best one fits in every phase. No candidate ranked below it can beat it: a
        # configuration that fits in every phase fits in its last.
        while (chosen := _best((rows[c] for c in candidates), rank)) is not None:
            unchecked = [
                r
                for r in rows.values()
                if r.fits and not r.compiled.all_phases and rank(r)[:2] <= rank(chosen)[:2]
            ]
            if not unchecked:
                break
            for r in unchecked:  # the best, and any tied with it
                compiled = compiler.fastest_fitting(r.candidate, batch, budget_bytes)
                rows[r.candidate] = _row(r.candidate, batch, compiled, budget_bytes, device)
    finally:
        if bar is not None:
            bar.close()
    table = [rows[c] for c in candidates]
    if chosen is None:
        raise BudgetError(budget_bytes, table)
    return FitResult(budget_bytes, batch, chosen, table, device)
