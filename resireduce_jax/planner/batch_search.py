"""The largest per-worker batch whose compiled peak fits a budget (:func:`largest_batch`).

Per candidate, a bracket of compiled batches shrinks until its ends are neighbours. See
docs/design.md, "Memory planning" ("Largest batch").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from resireduce_jax.planner.bounds import _search_order, _skip_reason
from resireduce_jax.planner.budget import format_bytes, parse_budget
from resireduce_jax.planner.candidates import Candidate
from resireduce_jax.planner.compile_cache import (
    CachedCompiler,
    CompileFn,
    Compiler,
    _bar,
    _cached,
    _run_all,
)
from resireduce_jax.planner.compiled import DeviceModel
from resireduce_jax.planner.tables import Row, _row, _ruled_out, _table


@dataclasses.dataclass(frozen=True)
class BatchSearch:
    """The largest per-worker batch of one candidate under a budget.

    Attributes:
      candidate: the candidate.
      batch: the largest batch that fits (0: not even ``min_batch`` fits).
      row: the candidate at ``batch`` (its fastest fitting configuration), or at
        ``min_batch`` (its leanest) when nothing fits.
      next_peak: leanest peak at ``batch + 1``: compiled, or the bound or prediction that
        ruled it out (``skipped``); ``None`` if not looked at (``batch == max_batch``).
      capped: ``batch == max_batch`` fits: larger batches were not tried.
      probes: ``(batch, leanest peak)`` of every batch the search compiled.
      uncompiled: ``(batch, peak, reason)`` of every batch decided without compiling: a
        lower bound or a prediction over the budget (it does not fit), or a prediction
        under it by the margin (it fits; ``batch`` itself is always compiled).
    """

    candidate: Candidate
    batch: int
    row: Row
    next_peak: int | None
    capped: bool
    probes: tuple[tuple[int, int], ...]
    uncompiled: tuple[tuple[int, int, str], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.candidate.as_dict(),
            "label": self.candidate.label,
            "largest_batch": self.batch,
            "capped": self.capped,
            "next_batch_peak_bytes": self.next_peak,
            "probes": [list(p) for p in self.probes],
            "uncompiled": [list(p) for p in self.uncompiled],
            "at_largest": self.row.as_dict(),
        }


@dataclasses.dataclass
class LargestBatch:
    """What :func:`largest_batch` found, per candidate, and the best of them."""

    budget_bytes: int
    searches: list[BatchSearch]
    device: DeviceModel

    @property
    def best(self) -> BatchSearch | None:
        """The candidate with the largest batch (ties: fastest estimate); ``None`` if none fits."""
        fitting = [(s.batch, -s.row.step_seconds, -i, s) for i, s in enumerate(self.searches)]
        fitting = [f for f in fitting if f[0] > 0]
        return max(fitting, key=lambda t: t[:3])[3] if fitting else None

    def search(self, candidate: Candidate) -> BatchSearch:
        return next(s for s in self.searches if s.candidate == candidate)

    def as_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "budget_bytes": self.budget_bytes,
            "device_model": self.device.as_dict(),
            "best": None if best is None else best.candidate.as_dict(),
            "candidates": [s.as_dict() for s in self.searches],
        }

    def table(self) -> str:
        best = self.best
        rows = [s.row for s in self.searches]
        return _table(
            rows,
            f"Largest batch per worker under {format_bytes(self.budget_bytes)} (batch 0: none "
            "fits)",
            chosen=None if best is None else best.row,
        )


MAX_GROWTH = 4
"""Interpolation grows the batch at most this many times per probe before one fails."""


def _next_probe(
    peaks: Mapping[int, int], lo: int, hi: int | None, budget: int, max_batch: int, bisect: bool
) -> int:
    """The next batch to compile, strictly between ``lo`` (fits) and ``hi`` (does not).

    Interpolation: the line through the compiled peaks nearest the budget (``lo`` and
    ``hi``, or the two largest fitting batches) predicts the largest fitting batch; the
    guess is kept strictly inside the bracket (above ``lo`` and at most
    ``MAX_GROWTH * lo`` without a failing batch yet).
    ``bisect``: the midpoint, or double ``lo`` while no batch has failed.
    """
    upper = (max_batch + 1) if hi is None else hi
    if hi is None and bisect:
        return min(2 * lo, max_batch)
    if bisect:
        return (lo + upper) // 2
    fitting = sorted(b for b in peaks if b <= lo)
    if hi is not None:
        b0, b1 = lo, hi
    elif len(fitting) >= 2:
        b0, b1 = fitting[-2], fitting[-1]
    else:
        return min(2 * lo, max_batch)
    slope = (peaks[b1] - peaks[b0]) / (b1 - b0)
    if slope <= 0:
        guess = (lo + upper) // 2 if hi is not None else 2 * lo
    else:
        guess = lo + math.floor((budget - peaks[lo]) / slope)
    if hi is None:
        # No batch has failed yet: a flat stretch of peaks (a rotor plan that absorbs the
        # batch) extrapolates far past where peaks turn steep, and compiling a huge batch
        # costs minutes. Grow at most MAX_GROWTH-fold per probe.
        guess = min(guess, MAX_GROWTH * lo)
    return max(lo + 1, min(guess, upper - 1, max_batch))


def largest_batch(
    candidates: Sequence[Candidate],
    compile_fn: CompileFn | Compiler,
    budget: int | float | str,
    *,
    max_batch: int,
    min_batch: int = 1,
    start: int | None = None,
    search: Literal["interpolate", "bisect"] = "interpolate",
    device: DeviceModel | None = None,
    progress: Callable[..., Any] | None = None,
    threads: int = 1,
) -> LargestBatch:
    """The largest per-worker batch that fits ``budget``, for each candidate.

    Assumes the leanest compiled peak does not decrease as the batch grows. A batch fits
    when the candidate's leanest configuration fits (for checkpointing: the leanest plan)
    in every phase of the run: its last phase is compiled first, the other phases only
    when that fits (:meth:`CachedCompiler.over_phases`); at the largest fitting batch the
    candidate's fastest fitting configuration is compiled for the table. The bracket
    ``[largest fitting, smallest failing]`` shrinks until they are adjacent:

    * ``"bisect"``: doubling from ``min_batch`` until a batch fails, then bisection;
    * ``"interpolate"`` (default): compiled peaks are close to affine in the batch, so
      the next probe is where the line through the peaks nearest the budget crosses it,
      kept strictly inside the bracket, and every other probe bisects when the bracket
      did not halve. The result is the same, in fewer compilations (docs/design.md,
      "Largest batch").

    A probe whose lower bound (``peak_bound``) exceeds the budget, or whose peak is
    predicted (``predicted_peak``) more than :data:`PREDICTION_MARGIN` over it, fails
    without compiling; one predicted that far under it fits without compiling. The
    answer is always compiled (its fastest fitting configuration); should it not fit,
    the candidate is searched again on compiled peaks alone. Candidates are searched in
    the order of :func:`fit`, so that the later ones are predicted from the earlier
    ones' programs.

    Compilations are cached by ``(candidate, batch)``: pass one :class:`CachedCompiler` to
    several calls (e.g. one per budget) to reuse them, and as the search's starting
    bracket.

    Args:
      candidates: the configurations.
      compile_fn: a compile function or :class:`Compiler` (see :func:`fit`).
      budget: per-worker bytes or a size string.
      max_batch: the largest batch tried.
      min_batch: the smallest batch tried.
      start: the first batch tried when nothing is cached yet (e.g. the configured batch;
        default ``min_batch``): a line through nearby peaks predicts better.
      search: ``"interpolate"`` or ``"bisect"``.
      device: the step-time model.
      progress: a ``tqdm.tqdm``-like bar factory (see :func:`fit`).
      threads: candidates searched at once.

    Returns:
      A :class:`LargestBatch` (``best``: the candidate with the largest batch).
    """
    if search not in ("interpolate", "bisect"):
        raise ValueError(f"search must be 'interpolate' or 'bisect', got {search!r}.")
    if not 1 <= min_batch <= max_batch:
        raise ValueError(f"need 1 <= min_batch <= max_batch, got {min_batch}, {max_batch}.")
    if start is not None and not min_batch <= start <= max_batch:
        raise ValueError(f"start={start} is outside [min_batch, max_batch].")
    budget_bytes = parse_budget(budget)
    device = device or DeviceModel()
    compiler = _cached(compile_fn)
    order = sorted(candidates, key=_search_order(compiler, start or min_batch))

    def search_one(candidate: Candidate) -> BatchSearch:
        args = (compiler, candidate, budget_bytes, min_batch, max_batch, search, device, start)
        found = _search_batch(*args, trust_predictions=True)
        if found.batch and not found.row.fits:  # a prediction was wrong: compiled peaks only
            found = _search_batch(*args, trust_predictions=False)
        return found

    bar = _bar(progress, len(candidates), 0, "largest batch")
    try:
        found = _run_all(search_one, order, threads, bar)
    finally:
        if bar is not None:
            bar.close()
    return LargestBatch(budget_bytes, [found[c] for c in candidates], device)


def _search_batch(
    compiler: CachedCompiler,
    candidate: Candidate,
    budget: int,
    min_batch: int,
    max_batch: int,
    search: str,
    device: DeviceModel,
    start: int | None,
    *,
    trust_predictions: bool,
) -> BatchSearch:
    probes: list[tuple[int, int]] = []
    decided: dict[int, tuple[int, str, bool]] = {}  # batch -> (peak, reason, fits)

    def fits(batch: int) -> bool:
        if batch in decided:
            return decided[batch][2]
        if batch not in compiler.known_peaks(candidate):
            skip = _skip_reason(compiler, candidate, batch, budget)
            if skip is not None:
                decided[batch] = (int(skip[0]), skip[1], False)
                return False
            predicted = compiler.predicted_peak(candidate, batch) if trust_predictions else None
            if predicted is not None and predicted.under(budget):
                decided[batch] = (int(predicted.value), predicted.describe(), True)
                return True
        value = compiler.leanest(candidate, batch).peak_bytes
        if value <= budget:  # the last phase fits: so must every other one
            value = compiler.over_phases(candidate, batch).peak_bytes
        probes.append((batch, value))
        return value <= budget

    def peaks() -> dict[int, int]:
        """Compiled peaks and, where a batch was decided without, the bound or prediction."""
        return {**{b: d[0] for b, d in decided.items()}, **compiler.known_peaks(candidate)}

    # The bracket from what is already compiled (e.g. by a call with another budget).
    known = {
        b: p for b, p in compiler.known_peaks(candidate).items() if min_batch <= b <= max_batch
    }
    fit_batches = sorted(b for b, p in known.items() if p <= budget)
    # A batch whose last phase fits, its other phases not compiled yet: compile them.
    while fit_batches:
        over = compiler.over_phases(candidate, fit_batches[-1]).peak_bytes
        if over <= budget:
            break
        known[fit_batches.pop()] = over
    fails = sorted(b for b, p in known.items() if p > budget)
    lo = fit_batches[-1] if fit_batches else None
    hi = next((b for b in fails if lo is None or b > lo), None)
    if lo is None and hi is None and start is not None and start != min_batch:
        if fits(start):
            lo = start
        else:
            hi = start
    if lo is None:
        if hi == min_batch or not fits(min_batch):
            if min_batch in decided:
                peak, reason, _ = decided[min_batch]
                row = _ruled_out(candidate, min_batch, peak, reason)
            else:
                compiled = compiler.leanest(candidate, min_batch)
                row = _row(candidate, min_batch, compiled, budget, device)
            return BatchSearch(candidate, 0, row, None, False, tuple(probes), _listed(decided))
        lo = min_batch
    halvings_missed = 0
    while lo < max_batch and (hi is None or hi - lo > 1):
        width = (max_batch + 1 - lo) if hi is None else hi - lo
        bisect = search == "bisect" or halvings_missed > 0
        batch = _next_probe(peaks(), lo, hi, budget, max_batch, bisect)
        if fits(batch):
            lo = batch
        else:
            hi = batch
        new_width = (max_batch + 1 - lo) if hi is None else hi - lo
        halvings_missed = halvings_missed + 1 if 2 * new_width > width and hi is not None else 0
    compiled = compiler.fastest_fitting(candidate, lo, budget)
    row = _row(candidate, lo, compiled, budget, device)
    next_peak = peaks().get(lo + 1)
    return BatchSearch(
        candidate, lo, row, next_peak, lo == max_batch, tuple(probes), _listed(decided)
    )


def _listed(decided: Mapping[int, tuple[int, str, bool]]) -> tuple[tuple[int, int, str], ...]:
    return tuple((b, p, reason) for b, (p, reason, _) in sorted(decided.items()))
