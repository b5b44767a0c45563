"""The rotor dynamic program for memory-persistent checkpointing of a chain, and its plans.

Beaumont et al., "Optimal checkpointing for heterogeneous chains: how to train deep neural
networks with limited memory", ACM TOMS 2024 (https://arxiv.org/abs/1911.13214), §4.
A plan is a tree of RunStage and Checkpoint items that maps onto nested jax.checkpoint.
The table gives the least time for each segment and memory, as JAX executes it and XLA
reports it: a cotangent is freed after its backward, gradients count once written.
Memory is discretised in slots, rounded up, so predictions stay upper bounds.
The recurrence, its memory terms and the accounting: docs/design.md, "Rotor's dynamic
program (remat/solver.py)".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from resireduce_jax.remat.costs import ChainCosts

__all__ = [
    "Checkpoint",
    "Plan",
    "PlanItem",
    "RotorTable",
    "RunStage",
    "Solution",
    "all_plans",
    "predict",
    "solve",
]


@dataclasses.dataclass(frozen=True)
class RunStage:
    """Run stage ``index`` unwrapped (keeps its full history for the backward pass)."""

    index: int


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Wrap stages ``[start, end)`` in one ``jax.checkpoint``; recompute them per ``body``."""

    start: int
    end: int
    body: tuple[PlanItem, ...]


PlanItem = RunStage | Checkpoint


def _item_span(item: PlanItem) -> tuple[int, int]:
    if isinstance(item, RunStage):
        return item.index, item.index + 1
    return item.start, item.end


def _check_items(items: Sequence[PlanItem], start: int, end: int) -> None:
    position = start
    for item in items:
        if not isinstance(item, (RunStage, Checkpoint)):
            raise ValueError(f"Plan items must be RunStage or Checkpoint, got {item!r}.")
        lo, hi = _item_span(item)
        if lo != position or hi <= lo:
            raise ValueError(
                f"Plan items must cover stages [{start}, {end}) in order without gaps; "
                f"expected an item starting at stage {position}, got {item!r}."
            )
        if isinstance(item, Checkpoint):
            _check_items(item.body, item.start, item.end)
        position = hi
    if position != end:
        raise ValueError(f"Plan items cover stages [{start}, {position}), expected up to {end}.")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A memory-persistent checkpointing schedule for a chain of ``num_stages`` stages.

    Attributes:
      items: the top-level sequence of :class:`RunStage` / :class:`Checkpoint` items.
      num_stages: ``L``.
    """

    items: tuple[PlanItem, ...]
    num_stages: int

    def __post_init__(self):
        _check_items(self.items, 0, self.num_stages)

    def forward_counts(self) -> np.ndarray:
        """How many times each stage's forward runs under ``jax.grad`` (1 + nesting depth)."""
        counts = np.zeros(self.num_stages, dtype=np.int64)

        def visit(items, depth):
            for item in items:
                if isinstance(item, RunStage):
                    counts[item.index] = depth + 1
                else:
                    visit(item.body, depth + 1)

        visit(self.items, 0)
        return counts

    @property
    def num_checkpoints(self) -> int:
        def count(items):
            return sum(1 + count(i.body) for i in items if isinstance(i, Checkpoint))

        return count(self.items)

    def compact(self) -> str:
        """One line: stage indices, a checkpointed segment in brackets, e.g. ``[[0 1] 2] 3``."""

        def render(items):
            parts = []
            for item in items:
                if isinstance(item, RunStage):
                    parts.append(str(item.index))
                else:
                    parts.append("[" + render(item.body) + "]")
            return " ".join(parts)

        return render(self.items)

    def render(self, stage_names: Sequence[str] | None = None) -> str:
        """A readable tree, one line per stage or checkpoint."""
        lines: list[str] = []

        def name(i):
            return f"stage {i}" + (f" ({stage_names[i]})" if stage_names else "")

        def visit(items, indent):
            for item in items:
                if isinstance(item, RunStage):
                    lines.append("  " * indent + name(item.index))
                else:
                    lines.append("  " * indent + f"checkpoint stages {item.start}..{item.end - 1}:")
                    visit(item.body, indent + 1)

        visit(self.items, 0)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()

    def as_json(self) -> Any:
        """Nested lists: an int is a stage run unwrapped, a list is a checkpointed segment."""

        def encode(items):
            return [i.index if isinstance(i, RunStage) else encode(i.body) for i in items]

        return encode(self.items)

    @classmethod
    def from_json(cls, nested: Any, num_stages: int) -> Plan:
        """Inverse of :meth:`as_json`."""

        def decode(entries):
            items = []
            for entry in entries:
                if isinstance(entry, int):
                    items.append(RunStage(entry))
                else:
                    body = decode(entry)
                    items.append(Checkpoint(_item_span(body[0])[0], _item_span(body[-1])[1], body))
            return tuple(items)

        return cls(decode(nested), num_stages)

    @classmethod
    def unwrapped(cls, num_stages: int) -> Plan:
        """The plan without any checkpoint (plain ``jax.grad``)."""
        return cls(tuple(RunStage(i) for i in range(num_stages)), num_stages)


class _Model:
    """The rotor memory/time model in some unit (bytes, or integer slots).

    Memory of a segment ``[s, t)`` is counted beyond ``x_s`` (held by the caller) and
    includes ``δ_t``, which the backward of stage ``t - 1`` frees (Beaumont et al., §4: the
    segment's output cotangent is part of the memory ``m`` of ``C_BP``).
    """

    def __init__(self, costs: ChainCosts, unit: float | None):
        def conv(values):
            values = np.asarray(values, dtype=np.float64)
            if unit is None:
                return values
            return np.ceil(values / unit).astype(np.int64)

        self.a = conv(costs.activation_bytes)
        self.xbar = conv(costs.saved_bytes)
        self.tf = conv(costs.forward_temp_bytes)
        self.tb = conv(costs.backward_temp_bytes)
        grads = conv(costs.grad_bytes)
        # G[i]: gradient bytes of stages i..L-1 (G[L] = 0).
        self.G = np.concatenate([np.cumsum(grads[::-1])[::-1], np.zeros(1, grads.dtype)])
        self.fw = np.asarray(costs.forward_time, dtype=np.float64)
        self.res = np.asarray(costs.residual_time, dtype=np.float64)
        self.bw = np.asarray(costs.backward_time, dtype=np.float64)
        n = len(self.fw)
        self.n = n
        # sweep_peak[s, j]: max over k in [s, j) of x_k [k > s] + x_{k+1} + o_f(k), the
        # peak of a forward sweep of [s, j) that keeps nothing (F_ck then F_n).
        step = self.a[:n] + self.a[1:] + self.tf
        self.sweep_peak = np.zeros((n + 1, n + 1), dtype=step.dtype)
        for s in range(n):
            first = self.a[s + 1] + self.tf[s]  # x_s is the caller's
            self.sweep_peak[s, s + 1 :] = np.maximum.accumulate(
                np.concatenate([[first], step[s + 1 :]])
            )

    def stage_forward(self, s: int, t: int) -> Any:
        """``F_all`` of stage s inside [s, t): ``δ_t`` and ``G_t`` live, writes ``x̄_s``."""
        return self.a[t] + self.G[t] + self.xbar[s] + self.tf[s]

    def stage_backward(self, s: int) -> Any:
        """``B`` of stage s: reads ``δ_{s+1}`` and ``x̄_s``, writes ``δ_s`` and its gradient."""
        return self.xbar[s] + self.a[s + 1] + self.a[s] + self.G[s] + self.tb[s]

    def sweep(self, s: int, j: int, t: int) -> Any:
        """Forward sweep of [s, j) that keeps nothing, inside [s, t) (``δ_t``, ``G_t`` live)."""
        return self.a[t] + self.G[t] + self.sweep_peak[s, j]

    def need(self, items: Sequence[PlanItem], t: int) -> Any:
        """Memory the items covering [s, t) need beyond ``x_s``, ``δ_t`` included."""
        first, rest = items[0], items[1:]
        if isinstance(first, RunStage):
            s = first.index
            here = max(self.stage_forward(s, t), self.stage_backward(s))
            if not rest:
                return here
            return max(here, self.xbar[s] + self.need(rest, t))
        s, j = first.start, first.end
        sweep = self.sweep(s, j, t)
        if not rest:  # never produced by the dynamic program; baselines end this way
            return max(sweep, self.need(first.body, j))
        # [j, t) holds x_j; its backward frees x_j and δ_t and leaves δ_j for the body.
        return max(sweep, self.a[j] + self.need(rest, t), self.need(first.body, j))


def all_plans(start: int, end: int) -> Iterator[tuple[PlanItem, ...]]:
    """Every plan of stages ``[start, end)`` that the dynamic program can express, as item
    tuples (``Plan(items, n)`` for ``all_plans(0, n)``): the search space of :func:`solve`,
    for brute-force checks. Their number grows like the large Schröder numbers (1, 2, 6,
    22, 90 for 1 to 5 stages)."""
    if end == start + 1:
        yield (RunStage(start),)
        return
    for rest in all_plans(start + 1, end):
        yield (RunStage(start), *rest)
    for j in range(start + 1, end):
        for body in all_plans(start, j):
            for rest in all_plans(j, end):
                yield (Checkpoint(start, j, body), *rest)


def _held_bytes(costs: ChainCosts) -> int:
    """Bytes held for the whole gradient computation outside the dynamic program.

    The parameters and the chain input are arguments. The output cotangent ``δ_L`` (at the
    size of ``x_L``) is counted by the dynamic program, as ``δ_t`` of the whole chain, and
    gradients as they are written (``G``).
    """
    return int(costs.param_bytes.sum() + costs.activation_bytes[0])


def predict(plan: Plan, costs: ChainCosts) -> tuple[float, int]:
    """The rotor model's time and peak memory (bytes) of a plan.

    The memory includes parameters, gradients, the chain input and the output cotangent,
    so it is comparable with the compiled peak of the whole gradient computation.

    Args:
      plan: a :class:`Plan` for ``costs.num_stages`` stages.
      costs: the chain's :class:`ChainCosts`.

    Returns:
      ``(time, peak_bytes)``; time in ``costs.time_unit``.
    """
    if plan.num_stages != costs.num_stages:
        raise ValueError(
            f"The plan has {plan.num_stages} stages but the costs describe {costs.num_stages}."
        )
    time = _plan_time(plan, costs)
    model = _Model(costs, unit=None)
    peak = _held_bytes(costs) + float(model.need(plan.items, plan.num_stages))
    return time, math.ceil(peak)


@dataclasses.dataclass(frozen=True)
class Solution:
    """A plan with the model's predictions.

    Attributes:
      plan: the :class:`Plan`.
      time: predicted time (``costs.time_unit``), recomputations included.
      memory: predicted peak bytes of the gradient computation (model, not compiled).
      overhead: ``time / (no-remat time) - 1``.
    """

    plan: Plan
    time: float
    memory: int
    overhead: float


def _recomputation_time(plan: Plan, costs: ChainCosts) -> float:
    """Time of the forward work that the checkpoints of ``plan`` redo.

    The recomputation of a checkpointed segment runs its body; what the backward pass does
    not read is pruned by JAX: the last item's output (the segment's output exists
    already), so a last stage costs only its residuals (``residual_time``) and a last
    nested checkpoint only its own recomputation.
    """
    fw, res = costs.forward_time, costs.residual_time

    def redo(items) -> float:
        total = 0.0
        for k, item in enumerate(items):
            last = k == len(items) - 1
            if isinstance(item, RunStage):
                total += res[item.index] if last else fw[item.index]
            else:
                if not last:
                    total += float(fw[item.start : item.end].sum())
                total += redo(item.body)
        return total

    def visit(items) -> float:
        return sum(redo(i.body) for i in items if isinstance(i, Checkpoint))

    return visit(plan.items)


def _plan_time(plan: Plan, costs: ChainCosts) -> float:
    base = float(costs.forward_time.sum() + costs.backward_time.sum())
    return base + _recomputation_time(plan, costs)


def _overhead(plan: Plan, costs: ChainCosts) -> float:
    """Recomputation time relative to the time without checkpointing."""
    base = float(costs.forward_time.sum() + costs.backward_time.sum())
    return _recomputation_time(plan, costs) / base if base > 0 else 0.0


def _shift_rows(rows: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """``out[r, m] = rows[r, m - shifts[r]]`` (``inf`` where ``m < shifts[r]``)."""
    index = np.arange(rows.shape[1])[None, :] - np.asarray(shifts)[:, None]
    out = np.take_along_axis(rows, np.clip(index, 0, None), axis=1)
    out[index < 0] = np.inf
    return out


class RotorTable:
    """The solved dynamic program for a chain over a memory range.

    Memory is discretised in slots of ``unit`` bytes from 0 to ``max_bytes`` (the model
    peak of the plan without checkpoints, unless given): every plan the dynamic program
    can produce for this chain, at any budget, is in :meth:`candidates`.

    Args:
      costs: the chain's :class:`ChainCosts`.
      slots: number of memory slots (``M`` in the paper; 500 by default).
      max_bytes: top of the memory range (total model peak, as :func:`predict` reports);
        defaults to the model peak without checkpoints.
    """

    def __init__(self, costs: ChainCosts, slots: int = 500, max_bytes: float | None = None):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}.")
        self.costs = costs
        self.slots = slots
        self.held = _held_bytes(costs)
        n = costs.num_stages
        unwrapped_need = float(_Model(costs, unit=None).need(Plan.unwrapped(n).items, n))
        top = unwrapped_need if max_bytes is None else float(max_bytes) - self.held
        if top <= 0:
            raise ValueError(
                f"max_bytes={max_bytes} leaves nothing for activations once parameters, "
                f"gradients' holder and input ({self.held} bytes) are counted."
            )
        self.unit = top / slots
        self._model = _Model(costs, unit=self.unit)
        # Rounding up every size can make the unwrapped plan need a few slots more than
        # `slots`; extend the table so that it is always reachable at the top.
        unwrapped_slots = int(self._model.need(Plan.unwrapped(n).items, n))
        self.size = max(slots, unwrapped_slots) if max_bytes is None else slots
        self._solve()

    def _solve(self) -> None:
        md = self._model
        n, size = md.n, self.size + 1
        a, xbar = md.a, md.xbar
        fw, bw = md.fw, md.bw
        inf = np.inf
        mem = np.arange(size)
        # Tables indexed [length, start, m] so that, for a fixed segment length and split
        # offset, the terms of every segment are contiguous slices (no gathers).
        # Only entries [length, start <= n - length] are written and read.
        cost = np.empty((n + 1, n + 1, size))
        by_start = np.empty((n + 1, n + 1, size))  # C(m - a_s, s, s + length)
        choice = np.empty((n + 1, n + 1, size), dtype=np.int32)
        fw_cum = np.concatenate([[0.0], np.cumsum(fw)])
        # The recomputation of [s, j) does not need x_j: stage j-1 redoes only its residuals.
        pruned = fw - md.res
        stage_backward = np.array([md.stage_backward(s) for s in range(n)])

        def store(d, starts, rows, picks):
            cost[d, starts] = rows
            choice[d, starts] = picks
            by_start[d, starts] = _shift_rows(rows, a[starts])

        starts = np.arange(n)
        single = np.maximum([md.stage_forward(s, s + 1) for s in starts], stage_backward)
        rows = np.where(mem[None, :] >= single[:, None], (fw + bw)[:, None], inf)
        store(1, starts, rows, np.where(np.isfinite(rows), 0, -1))

        for d in range(2, n + 1):
            ns = n - d + 1
            starts = np.arange(ns)
            ends = starts + d
            # "leaf j" for j = s + k, k = 1..d-1: C(m - a_j, j, s + d) + C(m, s, j) if the
            # sweep of [s, j) fits; a running minimum over k on contiguous (start, m) planes.
            best_cost = np.full((ns, size), inf)
            best = np.zeros((ns, size), dtype=np.int32)
            candidate = np.empty((ns, size))
            for k in range(1, d):
                np.add(by_start[d - k, k : k + ns], cost[k, :ns], out=candidate)
                candidate += (fw_cum[k : k + ns] - fw_cum[:ns] - pruned[k - 1 : k - 1 + ns])[
                    :, None
                ]
                sweep = a[ends] + md.G[ends] + md.sweep_peak[starts, starts + k]
                np.copyto(candidate, inf, where=mem[None, :] < sweep[:, None])
                better = candidate < best_cost
                np.copyto(best_cost, candidate, where=better)
                best[better] = k
            # "all": stage s unwrapped, then [s + 1, s + d) with x̄_s less memory.
            rows = _shift_rows(cost[d - 1, 1 : ns + 1], xbar[starts]) + (fw + bw)[:ns, None]
            forward = a[ends] + md.G[ends] + xbar[:ns] + md.tf[:ns]
            all_need = np.maximum(forward, stage_backward[:ns])
            rows[mem[None, :] < all_need[:, None]] = inf
            take_leaf = best_cost < rows
            picks = np.where(take_leaf, best + starts[:, None], 0)
            rows = np.where(take_leaf, best_cost, rows)
            picks[~np.isfinite(rows)] = -1
            store(d, starts, rows, picks)
        self._cost = cost
        self._choice = choice

    def _items(self, s: int, t: int, m: int) -> tuple[PlanItem, ...]:
        md = self._model
        items: list[PlanItem] = []
        while True:
            if t == s + 1:
                items.append(RunStage(s))
                return tuple(items)
            j = int(self._choice[t - s, s, m])
            if j < 0:
                raise AssertionError(f"no feasible choice at ({s}, {t}, {m})")
            if j == 0:
                items.append(RunStage(s))
                m -= int(md.xbar[s])
                s += 1
            else:
                # The body runs once [j, t) is done: x_j and δ_t are freed by then.
                items.append(Checkpoint(s, j, self._items(s, j, m)))
                m -= int(md.a[j])
                s = j

    @property
    def min_slots(self) -> int | None:
        """Fewest slots (beyond the held bytes) in which the dynamic program finds a plan."""
        feasible = np.flatnonzero(np.isfinite(self._cost[self._model.n, 0]))
        return int(feasible[0]) if len(feasible) else None

    @property
    def min_bytes(self) -> int | None:
        """Model peak of the plan that needs least memory (``None`` if none fits the table)."""
        m = self.min_slots
        if m is None:
            return None
        plan = self.plan_at_slots(m)
        assert plan is not None
        return predict(plan, self.costs)[1]

    def plan_at_slots(self, m: int) -> Plan | None:
        """The fastest plan in ``m`` slots (beyond the held bytes), or ``None``."""
        m = min(int(m), self.size)
        n = self._model.n
        if m < 0 or not np.isfinite(self._cost[n, 0, m]):
            return None
        return Plan(self._items(0, n, m), n)

    def plan_for(self, memory_bytes: float) -> Plan | None:
        """The fastest plan whose (discretised) model peak fits ``memory_bytes``."""
        return self.plan_at_slots(math.floor((memory_bytes - self.held) / self.unit))

    def candidates(self) -> list[Solution]:
        """Every distinct plan of the table, fastest (most memory) first."""
        n = self._model.n
        row = self._cost[n, 0]
        out: list[Solution] = []
        for m in range(self.size, -1, -1):
            if not np.isfinite(row[m]):
                break
            plan = Plan(self._items(0, n, m), n)
            if out and out[-1].plan == plan:
                continue
            time, memory = predict(plan, self.costs)
            out.append(Solution(plan, time, memory, _overhead(plan, self.costs)))
        return out


def solve(costs: ChainCosts, memory_bytes: float, slots: int = 500) -> Solution:
    """The fastest persistent checkpointing plan whose model peak fits ``memory_bytes``.

    This is the model-level answer (no compilation); :func:`resireduce_jax.remat.
    checkpoint_chain` calibrates it against XLA's compiled peak.

    Args:
      costs: the chain's :class:`ChainCosts` (from :func:`measure_chain`).
      memory_bytes: model budget for the whole gradient computation (parameters,
        gradients, input and activations), as :func:`predict` counts it.
      slots: memory discretisation (``M``).

    Returns:
      The :class:`Solution`.

    Raises:
      ValueError: if no plan fits; the message states the smallest budget that does.

    References:
      Beaumont et al., "Optimal checkpointing for heterogeneous chains: how to train deep
      neural networks with limited memory", ACM TOMS 2024 (https://arxiv.org/abs/1911.13214).
    """
    n = costs.num_stages
    unwrapped = Plan.unwrapped(n)
    unwrapped_time, unwrapped_memory = predict(unwrapped, costs)
    if memory_bytes >= unwrapped_memory:
        return Solution(unwrapped, unwrapped_time, unwrapped_memory, 0.0)
    table = RotorTable(costs, slots=slots, max_bytes=memory_bytes)
    plan = table.plan_at_slots(slots)
    if plan is None:
        floor = RotorTable(costs, slots=slots).min_bytes
        raise ValueError(
            f"No checkpointing plan fits a model budget of {int(memory_bytes)} bytes; the "
            f"smallest the model allows for this chain is about {floor} bytes "
            f"({floor / 2**20:.1f} MiB, parameters and gradients included)."
        )
    time, memory = predict(plan, costs)
    return Solution(plan, time, memory, _overhead(plan, costs))
