"""The planner's tables: one :class:`Row` per candidate, and the rows as text.

See docs/design.md, "Memory planning" ("Choosing").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from resireduce_jax.planner.budget import format_bytes
from resireduce_jax.planner.candidates import Candidate
from resireduce_jax.planner.compiled import Compiled


@dataclasses.dataclass(frozen=True)
class Row:
    """One candidate of a table: its compiled figures at a batch, and the verdict.

    ``ruled_out``: empty for a compiled row; else why it was not compiled (its
    ``compiled.peak_bytes`` is then the bound or the prediction, ``compilations`` 0).
    ``fits``: the peak is within the budget, over every phase of the run where
    ``compiled.all_phases``, else over its last phase (a row :func:`fit` found slower than
    its choice).
    """

    candidate: Candidate
    batch_per_worker: int
    compiled: Compiled
    fits: bool
    step_seconds: float
    ruled_out: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.candidate.as_dict(),
            "label": self.candidate.label,
            "batch_per_worker": self.batch_per_worker,
            "fits": self.fits,
            "fits_judged_by": "every phase" if self.compiled.all_phases else "last phase",
            "step_time_estimate_s": self.step_seconds if not self.ruled_out else None,
            **self.compiled.as_dict(),
            "ruled_out": self.ruled_out,
        }


def _ruled_out(candidate: Candidate, batch: int, peak: float, reason: str) -> Row:
    compiled = Compiled(peak_bytes=int(peak), flops_overhead=None, compilations=0)
    return Row(candidate, batch, compiled, False, math.inf, reason)


def _table(rows: Sequence[Row], title: str, chosen: Row | None = None) -> str:
    """The rows as text; with several phases (a density schedule) a ``peak phase`` column
    names the phase whose compiled peak the row's is."""
    phased = any(r.compiled.peak_phase for r in rows)
    width = max([len("peak phase")] + [len(r.compiled.peak_phase) for r in rows])
    lines = [
        title,
        f"  {'':1s} {'exchange':<10s} {'optimizer':<9s} {'remat':<6s} {'batch':>6s} "
        f"{'peak':>11s} "
        + (f"{'peak phase':<{width}s} " if phased else "")
        + f"{'fits':>4s} {'FLOPs +':>8s} {'residuals':>11s} {'est. step':>10s} {'compile':>8s}",
    ]
    if phased:
        lines.insert(
            1,
            "  (peak: the largest over the phases of the density schedule compiled; the "
            "phases before the last are compiled for the fastest candidates whose last "
            "phase fits, until one fits in every phase; fits 'last': its last phase fits, "
            "the others were not compiled)",
        )
    for r in rows:
        c = r.compiled
        overhead = "?" if c.flops_overhead is None else f"{100 * c.flops_overhead:.1f}%"
        mark = "*" if chosen is not None and r is chosen else ""
        peak = format_bytes(c.peak_bytes)
        if r.ruled_out:  # a lower bound ("needs at least") or a prediction
            peak = (">" if r.ruled_out.startswith("needs") else "~") + peak
            lines.append(
                f"  {mark:1s} {r.candidate.exchange:<10s} {r.candidate.optimizer:<9s} "
                f"{r.candidate.remat:<6s} {r.batch_per_worker:>6d} {peak:>11s} "
                + (f"{'':<{width}s} " if phased else "")
                + f"{'no':>4s}   not compiled: {r.ruled_out.split(' = ')[0]}"
            )
            continue
        lines.append(
            f"  {mark:1s} {r.candidate.exchange:<10s} {r.candidate.optimizer:<9s} "
            f"{r.candidate.remat:<6s} {r.batch_per_worker:>6d} "
            f"{peak:>11s} "
            + (f"{c.peak_phase:<{width}s} " if phased else "")
            + f"{('yes' if c.all_phases else 'last') if r.fits else 'no':>4s} "
            f"{overhead:>8s} {format_bytes(c.residual_bytes):>11s} "
            f"{_format_seconds(r.step_seconds):>10s} {c.compile_seconds:>7.1f}s"
        )
    return "\n".join(lines)


def _format_seconds(seconds: float) -> str:
    """Three significant digits in s, ms or µs."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-6:.3g} µs"


def _row(candidate: Candidate, batch: int, compiled: Compiled, budget: int, device) -> Row:
    reason = compiled.settings.get("ruled_out")
    if reason:  # the compiler predicted it over the budget instead of compiling it
        return Row(candidate, batch, compiled, False, math.inf, reason)
    return Row(
        candidate, batch, compiled, compiled.peak_bytes <= budget, device.step_seconds(compiled)
    )
