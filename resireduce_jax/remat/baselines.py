"""Baseline checkpointing schedules, as :class:`~resireduce_jax.remat.solver.Plan` trees.

Expressed as plans, the baselines run through the same executor as rotor's plans and are
measured the same way, so a comparison isolates the choice of schedule:

* :func:`no_remat`: plain ``jax.grad``, every stage keeps its full history.
* :func:`every_stage`: ``jax.checkpoint`` around each stage (what wrapping every layer in
  ``nn.remat`` does): only stage inputs are kept; every forward runs twice.
* :func:`sequential_segments`: ``k`` segments, all but the last checkpointed, the
  recomputation keeping full history; ``k = round(√L)`` by default, the schedule of
  PyTorch's ``checkpoint_sequential`` (Chen et al., 2016, "Training deep nets with
  sublinear memory cost", §4.1).
* :func:`recursive_halving`: checkpoint the first half of a segment and recurse into both
  halves until segments have at most ``leaf_size`` stages (logarithmic memory, a logarithmic
  number of recomputations; cf. Chen et al. §4.2 and Griewank's binomial checkpointing).
"""

from __future__ import annotations

import math

from resireduce_jax.remat.solver import Checkpoint, Plan, PlanItem, RunStage

__all__ = ["every_stage", "no_remat", "recursive_halving", "sequential_segments"]


def _check_length(num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"A chain needs at least one stage, got num_stages={num_stages}.")


def _unwrapped(start: int, end: int) -> tuple[PlanItem, ...]:
    return tuple(RunStage(i) for i in range(start, end))


def no_remat(num_stages: int) -> Plan:
    """No checkpointing."""
    _check_length(num_stages)
    return Plan.unwrapped(num_stages)


def every_stage(num_stages: int) -> Plan:
    """Each stage in its own ``jax.checkpoint``."""
    _check_length(num_stages)
    return Plan(tuple(Checkpoint(i, i + 1, (RunStage(i),)) for i in range(num_stages)), num_stages)


def sequential_segments(num_stages: int, segments: int | None = None) -> Plan:
    """``checkpoint_sequential``: ``segments`` equal segments, all but the last checkpointed.

    Args:
      num_stages: ``L``.
      segments: number of segments, ``1 <= segments <= L``; ``round(√L)`` by default.

    Returns:
      The plan: segment ``k`` covers ``[k·⌊L/segments⌋, (k+1)·⌊L/segments⌋)``, the last one
      runs to ``L`` unwrapped.
    """
    _check_length(num_stages)
    if segments is None:
        segments = max(1, round(math.sqrt(num_stages)))
    if not 1 <= segments <= num_stages:
        raise ValueError(f"segments must be in [1, {num_stages}], got {segments}.")
    size = num_stages // segments
    items: list[PlanItem] = []
    for k in range(segments - 1):
        start, end = k * size, (k + 1) * size
        items.append(Checkpoint(start, end, _unwrapped(start, end)))
    items.extend(_unwrapped((segments - 1) * size, num_stages))
    return Plan(tuple(items), num_stages)


def recursive_halving(num_stages: int, leaf_size: int = 1) -> Plan:
    """Recursive bisection: ``[checkpoint(first half, recursively), second half recursively]``.

    Args:
      num_stages: ``L``.
      leaf_size: segments of at most this many stages run unwrapped.

    Returns:
      The plan.
    """
    _check_length(num_stages)
    if leaf_size < 1:
        raise ValueError(f"leaf_size must be >= 1, got {leaf_size}.")

    def split(start: int, end: int) -> tuple[PlanItem, ...]:
        if end - start <= leaf_size:
            return _unwrapped(start, end)
        middle = (start + end) // 2
        return (Checkpoint(start, middle, split(start, middle)), *split(middle, end))

    return Plan(split(0, num_stages), num_stages)
