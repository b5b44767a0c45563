"""Fit a training step into a memory budget: one planner over the memory techniques.

The library saves memory three ways — reduced residuals (ResiReduce variants, bfloat16
residuals), memory-reduced optimizers and activation checkpointing — and each costs
something (accuracy risk, extra FLOPs). This module answers two questions from *compiled*
programs, without allocating anything:

* :func:`fit`: of the given :class:`Candidate` configurations, which is the fastest whose
  compiled per-worker peak fits the budget? It returns the whole table (peak, FLOPs,
  FLOPs overhead of recomputation, residual bytes, estimated step time, compile time).
* :func:`largest_batch`: for each candidate, the largest per-worker batch whose compiled
  peak fits.

The planner does not know how to build a step. It takes a ``compile_fn(candidate, batch)``
that compiles one configuration (abstract shapes; e.g. ``jax.jit(step).lower(...)
.compile()``) and returns its figures (:class:`Compiled`, an XLA compiled program, or a
peak in bytes). Candidates whose memory depends on the budget — activation checkpointing,
where a rotor plan is picked for the budget — need a compiler object instead
(:class:`Compiler`: ``leanest(candidate, batch)`` and ``fastest_fitting(candidate, batch,
budget_bytes)``). The training program's compiler is ``train/memory_plan.py``.

Step time is an estimate read off the compiled program (:class:`DeviceModel`): XLA's
``cost_analysis()`` FLOPs at the device's FLOP rate plus its bytes accessed at the device's
memory bandwidth, the two added (no overlap). Communication is left out: every candidate
sends the same payload (same compressor and density), only what is kept differs. The
estimate ranks candidates; it does not predict wall time.

Compiled peaks are ``argument + output - alias + temp`` bytes per device
(:func:`resireduce_jax.hlo.peak_memory`); on CPU they are XLA:CPU's, whose scheduler and
fusion differ from XLA:GPU's, so compile on the target platform for a GPU budget.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from resireduce_jax import hlo

__all__ = [
    "EXCHANGES",
    "OPTIMIZERS",
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
    "Row",
    "candidate_grid",
    "fit",
    "format_bytes",
    "largest_batch",
    "parse_budget",
]

#: Residual variants the planner tries by default: plain error feedback, ResiReduce w+2d,
#: and w+2d with residuals stored in bfloat16 (the training program's vocabulary).
EXCHANGES = ("ef", "w+2d", "w+2d+bf16")
#: The optimizer as configured by its original library (optax), or the memory-reduced one.
OPTIMIZERS = ("original", "r")
#: No activation checkpointing, or the fastest rotor plan that fits (chain models only).
REMATS = ("none", "rotor")

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)")
_EXAMPLES = "e.g. '12GiB', '8 GB', '512MiB' or a number of bytes such as 12884901888"


def parse_budget(budget: int | float | str) -> int:
    """A per-worker memory budget in bytes.

    Args:
      budget: bytes (a positive int, or a float with an integral value), or a string: a
        number with an optional unit, ``B``, ``KB``/``MB``/``GB``/``TB`` (powers of 1000)
        or ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024), case-insensitive, spaces
        allowed: ``"12GiB"``, ``"8 GB"``, ``"1.5gib"``, ``"12884901888"``.

    Returns:
      The budget in bytes (rounded down).

    Raises:
      ValueError: for anything else (a fraction, a percentage, an unknown unit, zero or
        a negative size), with the accepted forms in the message.
    """
    if isinstance(budget, bool):
        raise ValueError(f"a memory budget cannot be a bool, got {budget!r}; {_EXAMPLES}.")
    if isinstance(budget, int):
        value = float(budget)
    elif isinstance(budget, float):
        if not math.isfinite(budget) or budget != int(budget):
            raise ValueError(
                f"a memory budget in bytes must be a whole number, got {budget!r}; {_EXAMPLES}."
            )
        value = budget
    elif isinstance(budget, str):
        text = budget.strip().lower()
        match = _SIZE.fullmatch(text)
        if match is None or (match.group(2) and match.group(2) not in _UNITS):
            hint = ""
            if text.endswith("%"):
                hint = " (percentages are for remat.budget; the planner needs a size)"
            elif match is not None and match.group(2) in ("k", "m", "g", "t", "kb/s"):
                hint = f" ('{match.group(2)}' is ambiguous: write GB or GiB)"
            raise ValueError(f"cannot read the memory budget {budget!r}{hint}; {_EXAMPLES}.")
        value = float(match.group(1)) * _UNITS.get(match.group(2) or "b", 1)
    else:
        raise ValueError(
            f"a memory budget is an int or a string, got {type(budget).__name__}; {_EXAMPLES}."
        )
    if not value >= 1:
        raise ValueError(f"a memory budget must be at least 1 byte, got {budget!r}; {_EXAMPLES}.")
    return int(value)


def format_bytes(n: float) -> str:
    """``n`` bytes as GiB (from 1 GiB), MiB or KiB with two decimals."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One combination of the memory techniques.

    Attributes:
      exchange: the residual variant, in the training program's vocabulary (``"ef"``,
        ``"w+2d"``, ``"w+2d+bf16"``, ...).
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


@dataclasses.dataclass(frozen=True)
class Compiled:
    """Figures of one compiled configuration (per device).

    Attributes:
      peak_bytes: compiled peak, ``argument + output - alias + temp``.
      flops: XLA ``cost_analysis()`` FLOPs of the program.
      bytes_accessed: XLA ``cost_analysis()`` bytes accessed.
      residual_bytes: error-feedback residual state per worker (0 if unknown).
      flops_overhead: FLOPs over the same configuration without recomputation, minus one
        (0 without checkpointing; ``None`` where that was not compiled).
      compile_seconds: wall time of the compilations behind these figures.
      compilations: how many programs were compiled to find this one (a rotor search
        compiles several plans).
      settings: how to run this configuration (e.g. the checkpointing plan), for the
        caller; reported as given.
    """

    peak_bytes: int
    flops: float = 0.0
    bytes_accessed: float = 0.0
    residual_bytes: int = 0
    flops_overhead: float | None = 0.0
    compile_seconds: float = 0.0
    compilations: int = 1
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_program(cls, compiled: Any, **fields: Any) -> Compiled:
        """Reads peak, FLOPs and bytes accessed off an XLA compiled program."""
        analysis = compiled.cost_analysis()
        if isinstance(analysis, list | tuple):  # older JAX: one dict per program
            analysis = analysis[0] if analysis else {}
        analysis = analysis or {}
        return cls(
            peak_bytes=hlo.peak_memory(compiled).peak,
            flops=float(analysis.get("flops", 0.0)),
            bytes_accessed=float(analysis.get("bytes accessed", 0.0)),
            **fields,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "flops": self.flops,
            "bytes_accessed": self.bytes_accessed,
            "residual_bytes": self.residual_bytes,
            "flops_overhead": self.flops_overhead,
            "compile_seconds": self.compile_seconds,
            "compilations": self.compilations,
            "settings": dict(self.settings),
        }


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """The step-time estimate: ``flops / flops_per_second + bytes / bytes_per_second``.

    A roofline-style sum without overlap of compute and memory traffic, from the compiled
    program's ``cost_analysis()``. The default is an A100 (40 GB) in float32 without
    tensor cores (19.5 TFLOP/s, 1555 GB/s HBM), the kind of GPU the paper's budgets
    bracket; only the ratio of the two rates affects the ranking.
    """

    name: str = "A100-40GB float32 (19.5 TFLOP/s, 1555 GB/s)"
    flops_per_second: float = 19.5e12
    bytes_per_second: float = 1.555e12

    def step_seconds(self, compiled: Compiled) -> float:
        return (
            compiled.flops / self.flops_per_second + compiled.bytes_accessed / self.bytes_per_second
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@runtime_checkable
class Compiler(Protocol):
    """Compiles candidates; what :func:`fit` and :func:`largest_batch` need.

    ``leanest(candidate, batch)``: the figures of the candidate's leanest configuration at
    that per-worker batch (for a candidate that is not adaptive, its only one).
    ``fastest_fitting(candidate, batch, budget_bytes)``: its fastest configuration whose
    compiled peak fits the budget, or the leanest when none fits.
    """

    def leanest(self, candidate: Candidate, batch: int) -> Compiled: ...

    def fastest_fitting(self, candidate: Candidate, batch: int, budget_bytes: int) -> Compiled: ...


CompileFn = Callable[[Candidate, int], Any]
"""``compile_fn(candidate, batch_per_worker)``: a :class:`Compiled`, an XLA compiled
program, or a peak in bytes."""


def _as_compiled(result: Any) -> Compiled:
    if isinstance(result, Compiled):
        return result
    if isinstance(result, int | float) and not isinstance(result, bool):
        return Compiled(peak_bytes=int(result))
    if hasattr(result, "memory_analysis"):
        return Compiled.from_program(result)
    raise TypeError(
        "compile_fn must return a Compiled, an XLA compiled program or a peak in bytes; got "
        f"{type(result).__name__}."
    )


class CachedCompiler:
    """A :class:`Compiler` that compiles each (candidate, batch) once.

    Wraps a ``compile_fn(candidate, batch)`` for candidates that do not adapt to the
    budget, or a :class:`Compiler`. Results are cached by ``(candidate, batch)`` (and the
    budget, for :meth:`fastest_fitting` of adaptive candidates), so several :func:`fit`
    and :func:`largest_batch` calls on one ``CachedCompiler`` share their compilations.
    """

    def __init__(self, compile_fn: CompileFn | Compiler):
        self._inner = compile_fn if isinstance(compile_fn, Compiler) else None
        self._fn = None if self._inner is not None else compile_fn
        self._leanest: dict[tuple[Candidate, int], Compiled] = {}
        self._fitting: dict[tuple[Candidate, int, int], Compiled] = {}

    def leanest(self, candidate: Candidate, batch: int) -> Compiled:
        key = (candidate, int(batch))
        if key not in self._leanest:
            if self._inner is not None:
                result = self._inner.leanest(candidate, int(batch))
            else:
                self._check_function(candidate)
                result = self._fn(candidate, int(batch))
            self._leanest[key] = _as_compiled(result)
        return self._leanest[key]

    def fastest_fitting(self, candidate: Candidate, batch: int, budget_bytes: int) -> Compiled:
        if not candidate.adaptive:
            return self.leanest(candidate, batch)
        key = (candidate, int(batch), int(budget_bytes))
        if key not in self._fitting:
            self._check_function(candidate)
            self._fitting[key] = _as_compiled(
                self._inner.fastest_fitting(candidate, int(batch), int(budget_bytes))
            )
        return self._fitting[key]

    def _check_function(self, candidate: Candidate) -> None:
        if self._inner is None and candidate.adaptive:
            raise ValueError(
                f"candidate {candidate.label} adapts to the budget: pass a Compiler "
                "(leanest / fastest_fitting), not a compile function."
            )

    def known_peaks(self, candidate: Candidate) -> dict[int, int]:
        """Compiled leanest peaks of ``candidate`` by batch, so far."""
        return {b: c.peak_bytes for (k, b), c in self._leanest.items() if k == candidate}

    @property
    def compilations(self) -> int:
        """Distinct configurations looked up so far (cached results counted once)."""
        return len(self._leanest) + len(self._fitting)


def _cached(compile_fn: CompileFn | Compiler | CachedCompiler) -> CachedCompiler:
    return compile_fn if isinstance(compile_fn, CachedCompiler) else CachedCompiler(compile_fn)


def _progress(items: Iterable[Any], progress: Callable[..., Iterable[Any]] | None, desc: str):
    return items if progress is None else progress(items, desc=desc)


# ------------------------------------------------------------------ fit


@dataclasses.dataclass(frozen=True)
class Row:
    """One candidate of a table: its compiled figures at a batch, and the verdict."""

    candidate: Candidate
    batch_per_worker: int
    compiled: Compiled
    fits: bool
    step_seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.candidate.as_dict(),
            "label": self.candidate.label,
            "batch_per_worker": self.batch_per_worker,
            "fits": self.fits,
            "step_time_estimate_s": self.step_seconds,
            **self.compiled.as_dict(),
        }


class BudgetError(ValueError):
    """No candidate fits the budget. ``smallest`` is the row with the smallest peak."""

    def __init__(self, budget_bytes: int, rows: Sequence[Row]):
        self.budget_bytes = budget_bytes
        self.rows = list(rows)
        self.smallest = min(self.rows, key=lambda r: r.compiled.peak_bytes)
        peak = self.smallest.compiled.peak_bytes
        super().__init__(
            f"no configuration fits the memory budget of {budget_bytes} bytes "
            f"({format_bytes(budget_bytes)}) at {self.smallest.batch_per_worker} per worker: "
            f"the smallest compiled peak found is {peak} bytes ({format_bytes(peak)}, "
            f"{self.smallest.candidate.label}) among {len(self.rows)} candidates; raise the "
            "budget to at least that or lower the batch per worker."
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


def _table(rows: Sequence[Row], title: str, chosen: Row | None = None) -> str:
    lines = [
        title,
        f"  {'':1s} {'exchange':<10s} {'optimizer':<9s} {'remat':<6s} {'batch':>6s} "
        f"{'peak':>11s} {'fits':>4s} {'FLOPs +':>8s} {'residuals':>11s} "
        f"{'est. step':>10s} {'compile':>8s}",
    ]
    for r in rows:
        c = r.compiled
        overhead = "?" if c.flops_overhead is None else f"{100 * c.flops_overhead:.1f}%"
        mark = "*" if chosen is not None and r is chosen else ""
        lines.append(
            f"  {mark:1s} {r.candidate.exchange:<10s} {r.candidate.optimizer:<9s} "
            f"{r.candidate.remat:<6s} {r.batch_per_worker:>6d} "
            f"{format_bytes(c.peak_bytes):>11s} {'yes' if r.fits else 'no':>4s} "
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
    return Row(
        candidate, batch, compiled, compiled.peak_bytes <= budget, device.step_seconds(compiled)
    )


def _fastest(rows: Iterable[Row]) -> Row | None:
    """The fitting row with the smallest step estimate (then peak, then table order)."""
    fitting = [(r.step_seconds, r.compiled.peak_bytes, i, r) for i, r in enumerate(rows) if r.fits]
    return min(fitting, key=lambda t: t[:3])[3] if fitting else None


def fit(
    candidates: Sequence[Candidate],
    compile_fn: CompileFn | Compiler,
    budget: int | float | str,
    *,
    batch_per_worker: int,
    device: DeviceModel | None = None,
    progress: Callable[..., Iterable[Any]] | None = None,
) -> FitResult:
    """The fastest candidate whose compiled peak fits ``budget``, with the full table.

    Every candidate is compiled once (abstract shapes: nothing is allocated or run); an
    adaptive candidate (activation checkpointing) is compiled with its fastest
    configuration that fits, or its leanest when none does. The step-time estimate is
    :class:`DeviceModel`'s; ties go to the smaller peak, then to the earlier candidate.

    Args:
      candidates: the configurations to consider (e.g. :func:`candidate_grid`).
      compile_fn: ``compile_fn(candidate, batch)`` (see :data:`CompileFn`), or a
        :class:`Compiler` (needed for adaptive candidates); a :class:`CachedCompiler`
        keeps its compilations across calls.
      budget: per-worker bytes or a size string (:func:`parse_budget`).
      batch_per_worker: the per-worker batch to compile for.
      device: the step-time model (default :class:`DeviceModel`).
      progress: wraps the loop over candidates (e.g. ``tqdm.tqdm``; called with
        ``desc=``).

    Returns:
      A :class:`FitResult`; ``chosen.compiled.peak_bytes <= budget_bytes``.

    Raises:
      BudgetError: when no candidate fits; the message names the smallest peak found.
      ValueError: for an unreadable budget or no candidates.
    """
    budget_bytes = parse_budget(budget)
    if not candidates:
        raise ValueError("fit() needs at least one candidate.")
    device = device or DeviceModel()
    compiler = _cached(compile_fn)
    rows = []
    for candidate in _progress(list(candidates), progress, "planning"):
        compiled = compiler.fastest_fitting(candidate, batch_per_worker, budget_bytes)
        rows.append(_row(candidate, batch_per_worker, compiled, budget_bytes, device))
    chosen = _fastest(rows)
    if chosen is None:
        raise BudgetError(budget_bytes, rows)
    return FitResult(budget_bytes, batch_per_worker, chosen, rows, device)


# ------------------------------------------------------------------ largest batch


@dataclasses.dataclass(frozen=True)
class BatchSearch:
    """The largest per-worker batch of one candidate under a budget.

    Attributes:
      candidate: the candidate.
      batch: the largest batch that fits (0: not even ``min_batch`` fits).
      row: the candidate at ``batch`` (its fastest fitting configuration), or at
        ``min_batch`` (its leanest) when nothing fits.
      next_peak: compiled leanest peak at ``batch + 1`` (``None`` if not compiled, e.g.
        ``batch == max_batch``).
      capped: ``batch == max_batch`` fits: larger batches were not tried.
      probes: ``(batch, leanest peak)`` of every batch the search looked at.
    """

    candidate: Candidate
    batch: int
    row: Row
    next_peak: int | None
    capped: bool
    probes: tuple[tuple[int, int], ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.candidate.as_dict(),
            "label": self.candidate.label,
            "largest_batch": self.batch,
            "capped": self.capped,
            "next_batch_peak_bytes": self.next_peak,
            "probes": [list(p) for p in self.probes],
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
    progress: Callable[..., Iterable[Any]] | None = None,
) -> LargestBatch:
    """The largest per-worker batch that fits ``budget``, for each candidate.

    Assumes the leanest compiled peak does not decrease as the batch grows. A batch fits
    when the candidate's leanest configuration fits (for checkpointing: the leanest plan);
    at the largest fitting batch the candidate's fastest fitting configuration is
    compiled for the table. The bracket ``[largest fitting, smallest failing]`` shrinks
    until they are adjacent:

    * ``"bisect"``: doubling from ``min_batch`` until a batch fails, then bisection;
    * ``"interpolate"`` (default): compiled peaks are close to affine in the batch, so
      the next probe is where the line through the peaks nearest the budget crosses it,
      kept strictly inside the bracket, and every other probe bisects when the bracket
      did not halve. The result is the same; usually 3-5 compilations instead of 2 log2.

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
      progress: wraps the loop over candidates.

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
    searches = []
    for candidate in _progress(list(candidates), progress, "largest batch"):
        searches.append(
            _search_batch(
                compiler, candidate, budget_bytes, min_batch, max_batch, search, device, start
            )
        )
    return LargestBatch(budget_bytes, searches, device)


def _search_batch(
    compiler: CachedCompiler,
    candidate: Candidate,
    budget: int,
    min_batch: int,
    max_batch: int,
    search: str,
    device: DeviceModel,
    start: int | None,
) -> BatchSearch:
    probes: list[tuple[int, int]] = []

    def peak(batch: int) -> int:
        value = compiler.leanest(candidate, batch).peak_bytes
        probes.append((batch, value))
        return value

    # The bracket from what is already compiled (e.g. by a call with another budget).
    known = {
        b: p for b, p in compiler.known_peaks(candidate).items() if min_batch <= b <= max_batch
    }
    fits = sorted(b for b, p in known.items() if p <= budget)
    fails = sorted(b for b, p in known.items() if p > budget)
    lo = fits[-1] if fits else None
    hi = next((b for b in fails if lo is None or b > lo), None)
    if lo is None and hi is None and start is not None and start != min_batch:
        if peak(start) <= budget:
            lo = start
        else:
            hi = start
    if lo is None:
        if hi == min_batch or peak(min_batch) > budget:
            compiled = compiler.leanest(candidate, min_batch)
            row = _row(candidate, min_batch, compiled, budget, device)
            return BatchSearch(candidate, 0, row, None, False, tuple(probes))
        lo = min_batch
    halvings_missed = 0
    while lo < max_batch and (hi is None or hi - lo > 1):
        width = (max_batch + 1 - lo) if hi is None else hi - lo
        bisect = search == "bisect" or halvings_missed > 0
        batch = _next_probe(compiler.known_peaks(candidate), lo, hi, budget, max_batch, bisect)
        if peak(batch) <= budget:
            lo = batch
        else:
            hi = batch
        new_width = (max_batch + 1 - lo) if hi is None else hi - lo
        halvings_missed = halvings_missed + 1 if 2 * new_width > width and hi is not None else 0
    compiled = compiler.fastest_fitting(candidate, lo, budget)
    row = _row(candidate, lo, compiled, budget, device)
    next_peak = compiler.known_peaks(candidate).get(lo + 1)
    return BatchSearch(candidate, lo, row, next_peak, lo == max_batch, tuple(probes))
