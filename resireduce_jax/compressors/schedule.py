"""Density schedules: how many coordinates a sparsifier sends, step by step.

A sparsifier takes a float density or a DensitySchedule, piecewise constant over steps.
dense_warmup sends the first steps uncompressed; dgc_warmup falls as DGC's warm-up does.
DGC: Lin et al., ICLR 2018 (https://arxiv.org/abs/1712.01887), §3.4.
A schedule runs as one program, one static-size branch per phase: no recompiling.
A phase of density 1 travels dense, its residual zero.
phases lists a compressor's phases; bytes_sent counts what one worker sends.
The schedules in detail: docs/design.md, "Density schedules (compressors/schedule.py)".
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "DensitySchedule",
    "Phase",
    "Phased",
    "bytes_sent",
    "bytes_sent_by_collective",
    "constant",
    "dense_warmup",
    "dgc_stages",
    "dgc_warmup",
    "phase_at",
    "phase_index",
    "phases",
    "piecewise",
    "static_phase",
    "static_phase_index",
    "with_dense_dtype",
    "with_dense_start",
]


@dataclasses.dataclass(frozen=True)
class DensitySchedule:
    """A piecewise-constant density: ``densities[j]`` from step ``starts[j]`` on.

    Attributes:
      starts: first step of every phase; ``starts[0] == 0``, strictly increasing ints.
      densities: density of every phase, each in (0, 1]; 1 means uncompressed.
    """

    starts: tuple[int, ...]
    densities: tuple[float, ...]

    def __post_init__(self):
        starts, densities = tuple(self.starts), tuple(self.densities)
        if not starts or len(starts) != len(densities):
            raise ValueError(
                f"A density schedule needs one density per phase start; got starts={starts} "
                f"and densities={densities}."
            )
        if any(isinstance(s, bool) or not isinstance(s, int) for s in starts):
            raise ValueError(f"Phase starts must be ints (steps), got {starts}.")
        if starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)):
            raise ValueError(
                f"Phase starts must begin at step 0 and increase strictly, got {starts}."
            )
        checked = []
        for d in densities:
            try:
                value = float(d)
            except (TypeError, ValueError):
                value = math.nan
            if not 0.0 < value <= 1.0:
                raise ValueError(
                    f"Every density of a schedule must be in (0, 1], got {densities}: a density "
                    "is the fraction of elements each worker sends (1 = uncompressed)."
                )
            checked.append(value)
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "densities", tuple(checked))

    @property
    def final(self) -> float:
        """The density of the last phase (the run's steady state)."""
        return self.densities[-1]

    def at(self, step: int) -> float:
        """The density at ``step`` (a Python int)."""
        return self.densities[sum(step >= s for s in self.starts[1:])]

    def steps_per_phase(self, total_steps: int) -> tuple[int, ...]:
        """How many of the first ``total_steps`` steps each phase lasts."""
        return _phase_lengths(self.starts, total_steps)


def _phase_lengths(starts: Sequence[int], total_steps: int) -> tuple[int, ...]:
    ends = (*starts[1:], math.inf)
    return tuple(max(0, min(total_steps, e) - s) for s, e in zip(starts, ends, strict=True))


def constant(density: float) -> DensitySchedule:
    """The same density at every step."""
    return DensitySchedule((0,), (density,))


def piecewise(densities: Mapping[int, float]) -> DensitySchedule:
    """``{first step: density}``, e.g. ``{0: 1.0, 100: 0.01}``; must start at step 0."""
    items = sorted(densities.items())
    return DensitySchedule(tuple(s for s, _ in items), tuple(d for _, d in items))


def dense_warmup(steps: int, density: float) -> DensitySchedule:
    """Uncompressed for the first ``steps`` steps, then ``density``."""
    if steps == 0:
        return constant(density)
    return DensitySchedule((0, steps), (1.0, density))


def dgc_warmup(
    density: float,
    stage_steps: int,
    *,
    start: float = 0.25,
    factor: float = 4.0,
    dense_steps: int = 0,
) -> DensitySchedule:
    """DGC's warm-up (Lin et al. 2018, §3.4): density ``start``, ``start / factor``, ...
    for ``stage_steps`` steps each while above ``density``, then ``density``.

    The paper's 75 % → 93.75 % → 98.4375 % → 99.6 % sparsity is ``start=0.25, factor=4``.

    Args:
      density: the target density, reached after the warm-up stages.
      stage_steps: steps per warm-up stage (the paper: one epoch).
      start: density of the first stage.
      factor: the density is divided by this from one stage to the next (> 1).
      dense_steps: uncompressed steps before the first stage.
    """
    if isinstance(stage_steps, bool) or not isinstance(stage_steps, int) or stage_steps < 0:
        raise ValueError(f"stage_steps must be an int >= 0, got {stage_steps!r}.")
    stages = dgc_stages(density, start=start, factor=factor) if stage_steps else ()
    starts, densities = [], []
    if dense_steps:
        starts.append(0)
        densities.append(1.0)
    for j, d in enumerate(stages):
        starts.append(dense_steps + j * stage_steps)
        densities.append(d)
    starts.append(dense_steps + len(stages) * stage_steps)
    densities.append(density)
    return DensitySchedule(tuple(starts), tuple(densities))


def dgc_stages(density: float, *, start: float = 0.25, factor: float = 4.0) -> tuple[float, ...]:
    """The densities of DGC's warm-up stages above ``density``: ``start``, ``start /
    factor``, ... (:func:`dgc_warmup`)."""
    if not factor > 1.0:
        raise ValueError(f"factor must be > 1 (the density falls stage by stage), got {factor}.")
    stages, d = [], float(start)
    while d > density:
        stages.append(d)
        d /= factor
    return tuple(stages)


def check_density(density: float, name: str = "density") -> float:
    """Validates a fraction in (0, 1] and returns it as a float."""
    try:
        value = float(density)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in (0, 1], got {density!r}.") from None
    if not (0.0 < value <= 1.0):  # also rejects NaN
        raise ValueError(
            f"{name} must be in (0, 1], got {density!r}: it is the fraction of elements "
            "each worker sends (0.01 sends 1 %)."
        )
    return value


def as_density(value: Any, name: str = "density") -> float | DensitySchedule:
    """A validated float in (0, 1], or a :class:`DensitySchedule` (one phase: its float)."""
    if isinstance(value, DensitySchedule):
        return value.final if len(value.starts) == 1 else value
    return check_density(value, name)


class Phase(NamedTuple):
    """One phase of a scheduled compressor: from step ``start`` on, ``compressor`` runs."""

    start: int
    compressor: Any  # Compressor (imported lazily: base imports nothing from here)


def _compressor_base():
    from resireduce_jax.compressors.base import Compressor

    return Compressor


@dataclasses.dataclass(frozen=True)
class Phased:
    """Any compressors one after another: ``Phased(((0, none()), (100, onebit())))``.

    What a density schedule is for one sparsifier, for compressors of any kind (a dense
    warm-up before 1-bit compression, as 1-bit Adam does). Only the exchange transforms
    run it, one phase at a time; phases whose compressor states differ (none, then
    PowerSGD's ``Q``) each keep their own (:class:`~resireduce_jax.exchange.PhaseStates`).

    Attributes:
      steps: ``(first step, compressor)`` pairs; the first starts at step 0, the starts
        increase strictly.
    """

    steps: tuple[tuple[int, Any], ...]
    name = "phased"

    def __post_init__(self):
        steps = tuple((s, c) for s, c in self.steps)
        base = _compressor_base()
        if not steps or any(not isinstance(c, base) for _, c in steps):
            raise ValueError(
                "Phased takes (first step, compressor) pairs of resireduce_jax compressors, "
                f"got {self.steps!r}."
            )
        if any(isinstance(c, Phased) or len(phases(c)) > 1 for _, c in steps):
            raise ValueError("A phase of Phased must be one compressor, not a schedule.")
        DensitySchedule(tuple(s for s, _ in steps), (1.0,) * len(steps))  # checks the starts
        object.__setattr__(self, "steps", steps)

    @property
    def biased(self) -> bool:
        return any(c.biased for _, c in self.steps)


def with_dense_start(steps: int, compressor: Any) -> Phased:
    """Uncompressed for ``steps`` steps, then ``compressor``'s phases, each ``steps`` later."""
    from resireduce_jax.compressors.dense import NoCompression

    later = tuple((steps + p.start, p.compressor) for p in phases(compressor))
    return Phased(((0, NoCompression()), *later) if steps else later)


def with_dense_dtype(compressor: Any, dtype: str) -> Any:
    """``compressor`` with each of its uncompressed phases sent in a 16-bit ``dtype``.

    Every :class:`~resireduce_jax.compressors.NoCompression` phase (a dense warm-up)
    becomes a :class:`~resireduce_jax.compressors.Cast` to ``dtype`` (``"bfloat16"`` or
    ``"float16"``) that drops its rounding error, as a 16-bit all-reduce does: still a
    dense phase (:func:`~resireduce_jax.compressors.dense.is_dense`), every coordinate
    sent, no residual kept, at half a float32 phase's bytes. A longer warm-up then fits the
    same byte budget. Other phases are unchanged; a compressor without an uncompressed
    phase is returned as it is.
    """
    from resireduce_jax.compressors.dense import Cast, NoCompression

    cast = Cast(dtype, feedback=False)
    found = phases(compressor)
    if not any(isinstance(p.compressor, NoCompression) for p in found):
        return compressor
    steps = tuple(
        (p.start, cast if isinstance(p.compressor, NoCompression) else p.compressor) for p in found
    )
    return steps[0][1] if len(steps) == 1 else Phased(steps)


def phases(compressor: Any) -> tuple[Phase, ...]:
    """The phases of ``compressor``: one per density of its schedule, or just itself.

    A compressor whose density field (``density_field``, e.g. ``"density"``) holds a
    :class:`DensitySchedule` gives one copy per phase with that phase's float density; a
    phase of density 1 is :class:`~resireduce_jax.compressors.NoCompression` (a dense
    all-reduce). :class:`Phased` gives its own phases. Any other compressor is a single
    phase from step 0.
    """
    if isinstance(compressor, Phased):
        return tuple(Phase(s, c) for s, c in compressor.steps)
    field = getattr(compressor, "density_field", None)
    schedule = getattr(compressor, field, None) if field else None
    if not isinstance(schedule, DensitySchedule):
        return (Phase(0, compressor),)
    from resireduce_jax.compressors.dense import NoCompression

    return tuple(
        Phase(s, NoCompression() if d == 1.0 else dataclasses.replace(compressor, **{field: d}))
        for s, d in zip(schedule.starts, schedule.densities, strict=True)
    )


def static_phase_index(found: Sequence[Phase], density_phase: int | None) -> int | None:
    """The phase to compile statically: ``0`` for the only phase, or ``density_phase`` (a
    Python int) of several; ``None`` when the phase must be chosen at run time."""
    if len(found) == 1:
        return 0
    if density_phase is None:
        return None
    if isinstance(density_phase, bool) or not isinstance(density_phase, int):
        raise ValueError(
            f"density_phase must be a Python int (one compiled program per phase), got "
            f"{density_phase!r}; leave it out to switch between phases at run time."
        )
    if not 0 <= density_phase < len(found):
        raise ValueError(
            f"density_phase={density_phase}, but the density schedule has {len(found)} "
            f"phases (0 to {len(found) - 1})."
        )
    return density_phase


def static_phase(found: Sequence[Phase], density_phase: int | None) -> Any | None:
    """The compressor of :func:`static_phase_index`'s phase; ``None`` when the phase must
    be chosen at run time."""
    index = static_phase_index(found, density_phase)
    return None if index is None else found[index].compressor


def phase_at(found: Sequence[Phase], step: int) -> int:
    """The phase (a Python int) that step ``step`` falls in."""
    return sum(step >= p.start for p in found[1:])


def phase_index(starts: Sequence[int], count: jax.Array) -> jax.Array:
    """The phase (int32) that step ``count`` falls in, for phase ``starts``."""
    index = jnp.zeros([], jnp.int32)
    for s in starts[1:]:
        index = index + (count >= s).astype(jnp.int32)
    return index


def bytes_sent(compressor: Any, shape: tuple[int, ...], dtype: Any, total_steps: int) -> int:
    """Payload bytes one worker sends for one leaf over ``total_steps`` steps, every phase
    at its own size (exact: the compressors' ``payload_bytes``)."""
    found = phases(compressor)
    lengths = _phase_lengths([p.start for p in found], total_steps)
    return sum(
        n * p.compressor.payload_bytes(shape, dtype) for p, n in zip(found, lengths, strict=True)
    )


def bytes_sent_by_collective(
    compressor: Any, shape: tuple[int, ...], dtype: Any, total_steps: int
) -> dict[str, int]:
    """:func:`bytes_sent` split by how each phase's payload travels: ``{"all_gather": B,
    "all_reduce": B}`` (the phase compressor's ``collective``)."""
    found = phases(compressor)
    lengths = _phase_lengths([p.start for p in found], total_steps)
    sent = {"all_gather": 0, "all_reduce": 0}
    for p, n in zip(found, lengths, strict=True):
        sent[p.compressor.collective] += n * p.compressor.payload_bytes(shape, dtype)
    return sent
