"""Compiling candidates: the compiler protocol, its cache, and the threads that compile.

:class:`Compiler` is what the searches ask; :class:`CachedCompiler` compiles each
configuration once, also across threads (:class:`OnceMap`); :func:`compile_threads` picks
how many compile at once. See docs/design.md, "Memory planning" ("Compiling without
allocating", "Threads and the compile cache").
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

from resireduce_jax.planner.bounds import PeakBound, Prediction
from resireduce_jax.planner.candidates import Candidate
from resireduce_jax.planner.compiled import Compiled


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
"""Cores one XLA:CPU compilation keeps busy: its code generation is itself parallel
(docs/design.md, "Memory planning", "Threads and the compile cache")."""


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
    fn: Callable[[Any], Any],
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
        row = getattr(result, "row", result)  # a BatchSearch's row, or a Row
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
