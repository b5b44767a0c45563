"""The figures read off one compiled configuration, and the step-time estimate from them.

:class:`Compiled` holds a program's peak, FLOPs and bytes accessed (per phase of a run
with several programs); :class:`DeviceModel` turns them into an estimated step time that
ranks candidates. See docs/design.md, "Memory planning" ("Choosing", "Density phases").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from resireduce_jax import hlo


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
