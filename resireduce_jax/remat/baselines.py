"""Baseline checkpointing schedules, as :class:`~resireduce_jax.remat.solver.Plan` trees.

As plans, the baselines run through rotor's executor and are measured the same way.
no_remat is plain jax.grad; every_stage checkpoints each stage, as nn.remat on every layer.
sequential_segments is PyTorch's checkpoint_sequential, round(sqrt(L)) segments by default.
Chen et al., "Training Deep Nets with Sublinear Memory Cost" (https://arxiv.org/abs/1604.06174).
recursive_halving checkpoints half a segment and recurses into both halves.
Details: docs/design.md, "Remat baselines (remat/baselines.py)".
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
