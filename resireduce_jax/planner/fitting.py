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

import concurrent.futures
import dataclasses
import math
import os
import re
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from resireduce_jax import hlo

__all__ = [
    "EXCHANGES",
    "OPTIMIZERS",
    "PREDICTION_MARGIN",
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
      peak_phase: for a run with several programs (the phases of a density schedule,
        one compiled step each), the phase whose compiled peak ``peak_bytes`` is; empty
        for a run of one program.
      phase_peaks: ``(phase, compiled peak)`` of every phase compiled for these figures,
        in the schedule's order: the last phase alone (the steady state, whose figures
        these are) until the other phases are compiled (:meth:`Compiler.over_phases`),
        then every phase, ``peak_bytes`` their maximum.
    """

    peak_bytes: int
    flops: float = 0.0
    bytes_accessed: float = 0.0
    residual_bytes: int = 0
    flops_overhead: float | None = 0.0
    compile_seconds: float = 0.0
    compilations: int = 1
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    peak_phase: str = ""
    phase_peaks: tuple[tuple[str, int], ...] = ()

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
            "peak_phase": self.peak_phase,
            "phase_peaks": [list(p) for p in self.phase_peaks],
        }

    def with_phases(
        self, peaks: Sequence[tuple[str, int]], compiled: Sequence[Compiled]
    ) -> Compiled:
        """These figures (the last phase's) with the compiled peaks of every phase, in the
        schedule's order: ``peak_bytes`` their maximum (a tie goes to the later phase),
        ``peak_phase`` its phase, and the compile time and count of ``compiled`` (the
        other phases' programs) added."""
        if len(peaks) <= 1:
            return self
        index = max(range(len(peaks)), key=lambda i: (peaks[i][1], i))
        return dataclasses.replace(
            self,
            peak_bytes=int(peaks[index][1]),
            peak_phase=peaks[index][0],
            phase_peaks=tuple((str(name), int(peak)) for name, peak in peaks),
            compile_seconds=self.compile_seconds + sum(c.compile_seconds for c in compiled),
            compilations=self.compilations + sum(c.compilations for c in compiled),
        )

    @property
    def all_phases(self) -> bool:
        """Whether ``peak_bytes`` is over every phase (or the run has one program)."""
        return not self.peak_phase or len(self.phase_peaks) > 1


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


@runtime_checkable
class Compiler(Protocol):
    """Compiles candidates; what :func:`fit` and :func:`largest_batch` need.

    ``leanest(candidate, batch)``: the figures of the candidate's leanest configuration at
    that per-worker batch (for a candidate that is not adaptive, its only one).
    ``fastest_fitting(candidate, batch, budget_bytes)``: its fastest configuration whose
    compiled peak fits the budget, or the leanest when none fits.

    Two optional methods let the searches skip compilations (a compiler without them is
    searched exhaustively):

    * ``peak_bound(candidate, batch)``: a :class:`PeakBound`, or ``None``: a candidate
      whose bound exceeds the budget is ruled out without compiling;
    * ``predicted_peak(candidate, batch)``: a :class:`Prediction` of the leanest
      configuration's peak from programs compiled so far (e.g. another candidate's at
      this batch, shifted by the difference of the two), or ``None``; a compilation
      predicted over the budget (:meth:`Prediction.over`) is skipped.

    A run whose step is several programs (one per phase of a density schedule: a dense
    warm-up, then top-k) fits when every phase's compiled peak does. Its compiler returns
    the figures of the last phase (the steady state) from ``leanest``, and has

    * ``over_phases(candidate, batch, compiled)``: ``compiled`` (figures from ``leanest``
      or ``fastest_fitting``) with the other phases of the same configuration compiled:
      :meth:`Compiled.with_phases`. The searches ask for it only when the last phase fits
      (a configuration whose last phase does not fit needs nothing more); a compiler
      without it compiles one program per configuration.

    Its ``fastest_fitting`` judges every configuration it tries by the peak over phases,
    or, called with ``every_phase=False``, by the last phase's alone (compiling nothing
    else); its bounds and predictions are of the last phase, lower bounds of that maximum.
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


class OnceMap:
    """Values computed once per key, also when several threads ask for a key at once.

    ``get(key, compute)`` returns the stored value, waits for a thread already computing
    it, or computes it (outside the lock: compilations run in parallel).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._values: dict[Hashable, Any] = {}
        self._running: dict[Hashable, concurrent.futures.Future] = {}

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._values:
                return self._values[key]
            future = self._running.get(key)
            owner = future is None
            if owner:
                future = self._running[key] = concurrent.futures.Future()
        if not owner:
            return future.result()
        try:
            value = compute()
        except BaseException as error:
            with self._lock:
                del self._running[key]
            future.set_exception(error)
            raise
        with self._lock:
            self._values[key] = value
            del self._running[key]
        future.set_result(value)
        return value

    def peek(self, key: Hashable, default: Any = None) -> Any:
        """The value if it is computed, else ``default`` (never waits)."""
        with self._lock:
            return self._values.get(key, default)

    def items(self) -> list[tuple[Hashable, Any]]:
        """The computed ``(key, value)`` pairs, in the order they were computed."""
        with self._lock:
            return list(self._values.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)


class CachedCompiler:
    """A :class:`Compiler` that compiles each (candidate, batch) once.

    Wraps a ``compile_fn(candidate, batch)`` for candidates that do not adapt to the
    budget, or a :class:`Compiler`. Results are cached by ``(candidate, batch)`` (and the
    budget, for :meth:`fastest_fitting` of adaptive candidates), so several :func:`fit`
    and :func:`largest_batch` calls on one ``CachedCompiler`` share their compilations;
    threads asking for the same configuration share one compilation. ``peak_bound`` and
    ``predicted_peak`` are the wrapped compiler's, where it has them.

    For a run of several programs (the wrapped compiler's ``over_phases``, see
    :class:`Compiler`): :meth:`leanest` is the last phase's figures, :meth:`over_phases`
    the leanest configuration over every phase (cached too), and :meth:`fastest_fitting`
    compiles the other phases of a configuration whose last phase fits, so that its
    ``peak_bytes`` is the maximum over the phases wherever it fits.
    """

    def __init__(self, compile_fn: CompileFn | Compiler):
        self._inner = compile_fn if isinstance(compile_fn, Compiler) else None
        self._fn = None if self._inner is not None else compile_fn
        self._leanest = OnceMap()
        self._fitting = OnceMap()
        self._phases = OnceMap()  # (candidate, batch) -> the leanest over every phase

    def leanest(self, candidate: Candidate, batch: int) -> Compiled:
        def compute() -> Compiled:
            if self._inner is not None:
                return _as_compiled(self._inner.leanest(candidate, int(batch)))
            self._check_function(candidate)
            return _as_compiled(self._fn(candidate, int(batch)))

        return self._leanest.get((candidate, int(batch)), compute)

    def over_phases(self, candidate: Candidate, batch: int) -> Compiled:
        """The leanest configuration's figures with ``peak_bytes`` over every phase of the
        run (compiling the phases other than the last; :meth:`leanest` itself for a run of
        one program)."""

        def compute() -> Compiled:
            compiled = self.leanest(candidate, batch)
            method = getattr(self._inner, "over_phases", None)
            if method is None or compiled.settings.get("ruled_out"):
                return compiled
            return _as_compiled(method(candidate, int(batch), compiled))

        return self._phases.get((candidate, int(batch)), compute)

    def fastest_fitting(
        self, candidate: Candidate, batch: int, budget_bytes: int, *, every_phase: bool = True
    ) -> Compiled:
        """The fastest configuration of ``candidate`` that fits ``budget_bytes`` in every
        phase of the run, else its leanest; ``every_phase=False``: the fastest whose last
        phase fits (the other phases not compiled, unless they were already)."""
        if not candidate.adaptive:
            compiled = self.leanest(candidate, batch)
            if compiled.peak_bytes > budget_bytes:  # the last phase alone does not fit
                return compiled
            if not every_phase:
                return self._phases.peek((candidate, int(batch)), compiled)
            return self.over_phases(candidate, batch)
        self._check_function(candidate)
        method = getattr(self._inner, "over_phases", None)
        if not every_phase and method is not None:
            return self._fitting.get(
                (candidate, int(batch), int(budget_bytes), "last phase"),
                lambda: _as_compiled(
                    self._inner.fastest_fitting(
                        candidate, int(batch), int(budget_bytes), every_phase=False
                    )
                ),
            )

        def compute() -> Compiled:
            compiled = _as_compiled(
                self._inner.fastest_fitting(candidate, int(batch), int(budget_bytes))
            )
            if (
                method is None
                or compiled.all_phases
                or compiled.peak_bytes > budget_bytes
                or compiled.settings.get("ruled_out")
            ):
                return compiled
            return _as_compiled(method(candidate, int(batch), compiled))

        return self._fitting.get((candidate, int(batch), int(budget_bytes)), compute)

    def peak_bound(self, candidate: Candidate, batch: int) -> PeakBound | None:
        method = getattr(self._inner, "peak_bound", None)
        return None if method is None else method(candidate, int(batch))

    def predicted_peak(self, candidate: Candidate, batch: int) -> Prediction | None:
        compiled = self._leanest.peek((candidate, int(batch)))
        if compiled is not None:
            peak = compiled.peak_bytes
            return Prediction(peak, peak, peak, "its compiled program")
        method = getattr(self._inner, "predicted_peak", None)
        return None if method is None else method(candidate, int(batch))

    def _check_function(self, candidate: Candidate) -> None:
        if self._inner is None and candidate.adaptive:
            raise ValueError(
                f"candidate {candidate.label} adapts to the budget: pass a Compiler "
                "(leanest / fastest_fitting), not a compile function."
            )

    def known_peaks(self, candidate: Candidate) -> dict[int, int]:
        """Compiled leanest peaks of ``candidate`` by batch, so far: over every phase
        where :meth:`over_phases` compiled them, else the last phase's."""
        peaks = {b: c.peak_bytes for (k, b), c in self._leanest.items() if k == candidate}
        peaks.update({b: c.peak_bytes for (k, b), c in self._phases.items() if k == candidate})
        return peaks

    @property
    def compilations(self) -> int:
        """Distinct configurations looked up so far (cached results counted once), and
        the other phases compiled for :meth:`over_phases`."""
        phases = sum(max(0, len(c.phase_peaks) - 1) for _, c in self._phases.items())
        searches = {key[:3] for key, _ in self._fitting.items()}  # either judgement: one
        return len(self._leanest) + len(searches) + phases


def _cached(compile_fn: CompileFn | Compiler | CachedCompiler) -> CachedCompiler:
    return compile_fn if isinstance(compile_fn, CachedCompiler) else CachedCompiler(compile_fn)


CORES_PER_COMPILE = 2
"""Cores one XLA:CPU compilation keeps busy: its code generation is itself parallel (a
byte-GPT step: 8.0 s of CPU in 5.8 s; docs/design.md, "Memory planning")."""


def compile_threads(requested: int = 0) -> int:
    """Threads to compile with: ``requested``, or for 0 one per :data:`CORES_PER_COMPILE`
    cores that no other process uses, at least one.

    XLA compiles release the GIL, so candidates compile in parallel on idle cores; on a
    machine already busy, more threads only share the same cores. One thread compiles in
    the search's order, each compilation pricing the next (:func:`fit`): more threads
    than the cores can feed compile more candidates, each slower.
    """
    if requested > 0:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    idle = min(int(cores or 1), (cores or 1) - busy)
    return max(1, int(idle // CORES_PER_COMPILE))


def _run_all(
    fn: Callable[[Any], Row],
    items: Sequence[Any],
    threads: int,
    bar: Any,
) -> dict[Any, Any]:
    """``{item: fn(item)}``, on ``threads`` threads, updating the progress ``bar``."""
    results: dict[Any, Any] = {}
    ruled_out = 0

    def done(item: Any, result: Any) -> None:
        nonlocal ruled_out
        results[item] = result
        row = result.row if isinstance(result, BatchSearch) else result
        ruled_out += bool(row.ruled_out)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"ruled out {ruled_out}" if ruled_out else "")

    if threads <= 1 or len(items) <= 1:
        for item in items:
            done(item, fn(item))
        return results
    with concurrent.futures.ThreadPoolExecutor(min(threads, len(items))) as pool:
        futures = {pool.submit(fn, item): item for item in items}
        for future in concurrent.futures.as_completed(futures):
            done(futures[future], future.result())
    return results


def _bar(progress: Callable[..., Any] | None, total: int, initial: int, desc: str) -> Any:
    """A ``tqdm``-like bar over ``total`` candidates, ``initial`` of them decided already."""
    if progress is None:
        return None
    bar = progress(total=total, initial=initial, desc=desc, unit="candidate")
    if initial:
        bar.set_postfix_str(f"ruled out {initial}")
    return bar


# ------------------------------------------------------------------ fit


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


def _fastest(rows: Iterable[Row]) -> Row | None:
    """The fitting row with the smallest step estimate (then peak, then table order)."""
    fitting = [(r.step_seconds, r.compiled.peak_bytes, i, r) for i, r in enumerate(rows) if r.fits]
    return min(fitting, key=lambda t: t[:3])[3] if fitting else None


def _search_order(compiler: CachedCompiler, batch: int) -> Callable[[Candidate], tuple]:
    """Candidates that compile one program first, then the adaptive ones (a search over
    plans, whose monolithic step the first ones predict); each leanest bound first, so
    that every compilation prices the next ones (:meth:`Compiler.predicted_peak`)."""

    def key(candidate: Candidate) -> tuple:
        bound = compiler.peak_bound(candidate, batch)
        return (candidate.adaptive, 0 if bound is None else bound.bytes)

    return key


def fit(
    candidates: Sequence[Candidate],
    compile_fn: CompileFn | Compiler,
    budget: int | float | str,
    *,
    batch_per_worker: int,
    device: DeviceModel | None = None,
    progress: Callable[..., Any] | None = None,
    threads: int = 1,
) -> FitResult:
    """The fastest candidate whose compiled peak fits ``budget``, with the full table.

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
        # Judged by their last phase so far: the other phases of the fastest candidate are
        # compiled (and its search redone over every phase where one does not fit) until
        # the fastest one fits in every phase. No slower candidate can beat it: a
        # configuration that fits in every phase fits in its last.
        while (chosen := _fastest(rows[c] for c in candidates)) is not None:
            unchecked = [
                r
                for r in rows.values()
                if r.fits and not r.compiled.all_phases and r.step_seconds <= chosen.step_seconds
            ]
            if not unchecked:
                break
            for r in unchecked:  # the fastest, and any tied with it
                compiled = compiler.fastest_fitting(r.candidate, batch, budget_bytes)
                rows[r.candidate] = _row(r.candidate, batch, compiled, budget_bytes, device)
    finally:
        if bar is not None:
            bar.close()
    table = [rows[c] for c in candidates]
    if chosen is None:
        raise BudgetError(budget_bytes, table)
    return FitResult(budget_bytes, batch, chosen, table, device)


# ------------------------------------------------------------------ largest batch


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
      did not halve. The result is the same; usually 3-5 compilations instead of 2 log2.

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
