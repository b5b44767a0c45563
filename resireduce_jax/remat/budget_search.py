"""The fastest rotor plan whose *compiled* gradient peak fits a budget: :class:`ChainPlanner`.

The budget is the compiled peak of the whole jitted gradient computation, parameters and
gradients included. Rotor's model only approximates what XLA allocates, so candidate
plans from the dynamic program are compiled, and the fastest one that fits is chosen.
:func:`checkpoint_chain` wraps a chain in that plan. See docs/remat.md, "What the budget
means" and "How it works" (Calibration).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from resireduce_jax.remat.costs import ChainCosts, Stage, measure_chain
from resireduce_jax.remat.executor import CompiledGradient, Loss, apply_plan, compile_gradient
from resireduce_jax.remat.solver import Plan, RotorTable, Solution, predict

__all__ = [
    "Budget",
    "ChainPlanner",
    "RematChoice",
    "checkpoint_chain",
    "parse_budget",
]

Budget = int | float | str
"""Bytes (int, or a float > 1), a fraction of the no-remat peak (float in (0, 1]), or a
string such as ``"512MiB"``, ``"1.5GB"``, ``"60%"``."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_budget(budget: Budget) -> tuple[str, float]:
    """Reads a budget as ``("bytes", n)`` or ``("fraction", f)``.

    Args:
      budget: an int (bytes), a float in (0, 1] (fraction of the compiled peak without
        checkpointing) or > 1 (bytes), or a string: ``"2GiB"``, ``"500MB"``, ``"60%"``.

    Returns:
      ``(kind, value)``.

    Raises:
      ValueError: for a non-positive or unreadable budget.
    """
    if isinstance(budget, bool):
        raise ValueError(f"A memory budget cannot be a bool, got {budget!r}.")
    if isinstance(budget, str):
        text = budget.strip().lower().replace(" ", "")
        if text.endswith("%"):
            try:
                value = float(text[:-1]) / 100.0
            except ValueError:
                value = -1.0
            if not 0 < value <= 1:
                raise ValueError(f"A percentage budget must be in (0%, 100%], got {budget!r}.")
            return "fraction", value
        match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([kmg]i?b|b)?", text)
        if match is None:
            raise ValueError(
                f"Cannot read the memory budget {budget!r}; use bytes (e.g. 2147483648), a "
                "size with a unit ('2GiB', '500MB') or a fraction of the no-remat peak "
                "(0.5 or '50%')."
            )
        value = float(match.group(1)) * _UNITS[match.group(2) or ""]
        if value <= 0:
            raise ValueError(f"A memory budget must be positive, got {budget!r}.")
        return "bytes", value
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"A memory budget must be positive, got {budget} bytes.")
        return "bytes", float(budget)
    if isinstance(budget, float):
        if not budget > 0:
            raise ValueError(f"A memory budget must be positive, got {budget}.")
        return ("fraction", budget) if budget <= 1 else ("bytes", budget)
    raise ValueError(f"A memory budget must be an int, float or str, got {type(budget).__name__}.")


@dataclasses.dataclass(frozen=True)
class RematChoice:
    """The plan chosen for a budget, with what the model predicted and what XLA compiled.

    Attributes:
      plan: the :class:`Plan`.
      budget_bytes: the budget it was chosen for (bytes of compiled peak).
      compiled: compiled figures of the gradient computation under ``plan``.
      predicted: the rotor model's :class:`Solution` (time, memory, overhead).
      no_remat: compiled figures without checkpointing.
      compilations: how many distinct plans were compiled so far by the planner.
    """

    plan: Plan
    budget_bytes: int
    compiled: CompiledGradient
    predicted: Solution
    no_remat: CompiledGradient
    compilations: int

    @property
    def flops_overhead(self) -> float:
        """Compiled FLOPs relative to the gradient without checkpointing, minus one."""
        return self.compiled.flops / self.no_remat.flops - 1.0

    def summary(self) -> str:
        mib = 2.0**20
        return (
            f"rotor plan: compiled peak {self.compiled.peak / mib:.1f} MiB (budget "
            f"{self.budget_bytes / mib:.1f} MiB, no remat {self.no_remat.peak / mib:.1f} MiB), "
            f"FLOPs +{100 * self.flops_overhead:.1f}% (model +{100 * self.predicted.overhead:.1f}"
            f"%), model peak {self.predicted.memory / mib:.1f} MiB, "
            f"{self.plan.num_checkpoints} checkpoints: {self.plan.compact()}"
        )


class ChainPlanner:
    """Measures a chain once and picks checkpointing plans for compiled-peak budgets.

    Args:
      stages: ``L`` pure functions ``(p_i, x_i) -> x_{i+1}``.
      params: ``L`` per-stage parameter pytrees (arrays or ``ShapeDtypeStruct``s); a leaf
        object several stages hold is a tied weight, compiled and counted once.
      x: an example chain input (arrays or ``ShapeDtypeStruct``s; its shapes are used).
      loss: maps the chain output to the scalar that is differentiated; defaults to the
        sum of its floating leaves. Make the last stage the loss for a training step.
      wrt_input: also differentiate w.r.t. the input.
      slots: memory slots of the dynamic program.
      time: ``"flops"`` or ``"measured"`` stage times (see :func:`measure_chain`).
      costs: precomputed :class:`ChainCosts` (skips the measurement).
      stage_names: readable names for plan rendering.
      sequence_backward: run each stage's backward as one unit (see :func:`apply_plan`).
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        params: Sequence[Any],
        x: Any,
        *,
        loss: Loss | None = None,
        wrt_input: bool = False,
        slots: int = 500,
        time: Literal["flops", "measured"] = "flops",
        costs: ChainCosts | None = None,
        stage_names: Sequence[str] | None = None,
        sequence_backward: bool = True,
    ):
        self.sequence_backward = sequence_backward
        self.stages = tuple(stages)
        self.params = tuple(params)
        self.x = x
        self.loss = loss
        self.wrt_input = wrt_input
        self.costs = (
            costs
            if costs is not None
            else measure_chain(
                self.stages,
                self.params,
                x,
                wrt_input=wrt_input,
                time=time,
                stage_names=stage_names,
            )
        )
        if self.costs.num_stages != len(self.stages):
            raise ValueError(
                f"costs describe {self.costs.num_stages} stages but {len(self.stages)} given."
            )
        self.table = RotorTable(self.costs, slots=slots)
        activations = RotorTable(_activations_only(self.costs), slots=slots)
        self.families: dict[str, list[Solution]] = {
            "rotor": self.table.candidates(),
            "activations": [self._solution(c.plan) for c in activations.candidates()],
        }
        merged = {c.plan: c for family in self.families.values() for c in family}
        self.candidates: list[Solution] = sorted(
            merged.values(), key=lambda c: (c.time, c.memory, c.plan.compact())
        )
        self._compiled: dict[Plan, CompiledGradient] = {}

    def _solution(self, plan: Plan) -> Solution:
        time, memory = predict(plan, self.costs)
        base = float(self.costs.forward_time.sum() + self.costs.backward_time.sum())
        return Solution(plan, time, memory, time / base - 1.0 if base > 0 else 0.0)

    def compile(self, plan: Plan) -> CompiledGradient:
        """Compiled figures of the gradient computation under ``plan`` (cached)."""
        if plan not in self._compiled:
            self._compiled[plan] = compile_gradient(
                self.stages,
                plan,
                self.params,
                self.x,
                loss=self.loss,
                wrt_input=self.wrt_input,
                sequence_backward=self.sequence_backward,
            )
        return self._compiled[plan]

    @property
    def compilations(self) -> int:
        return len(self._compiled)

    @property
    def no_remat(self) -> CompiledGradient:
        """Compiled figures without checkpointing."""
        return self.compile(Plan.unwrapped(self.costs.num_stages))

    def budget_bytes(self, budget: Budget) -> int:
        """A budget in bytes of compiled peak (fractions are of the no-remat peak)."""
        kind, value = parse_budget(budget)
        if kind == "fraction":
            return int(value * self.no_remat.peak)
        return int(value)

    def function(self, plan: Plan) -> Callable[[Sequence[Any], Any], Any]:
        """``fn(params, x)`` following ``plan``."""
        return apply_plan(self.stages, plan, sequence_backward=self.sequence_backward)

    def select(self, budget: Budget, search: Literal["bisect", "scan"] = "bisect") -> RematChoice:
        """The fastest candidate plan whose compiled peak fits ``budget``.

        Args:
          budget: compiled-peak budget (see :func:`parse_budget`).
          search: ``"bisect"`` (log of the number of candidates compilations) or ``"scan"``
            (candidates in order; exact over the candidate list).

        Returns:
          The :class:`RematChoice`.

        Raises:
          ValueError: if the budget is below the smallest compiled peak of any candidate
            compiled; the message states that minimum.
        """
        if search not in ("bisect", "scan"):
            raise ValueError(f"search must be 'bisect' or 'scan', got {search!r}.")
        limit = self.budget_bytes(budget)

        visited: list[Solution] = []

        def fits(solution: Solution) -> bool:
            visited.append(solution)
            return self.compile(solution.plan).peak <= limit

        if search == "scan":
            solution = next((c for c in self.candidates if fits(c)), None)
        else:
            for family in self.families.values():
                _bisect(family, fits)
            # The fastest fitting plan among those the bisections compiled (which ones
            # depends on the budget only, not on what earlier calls compiled).
            solution = min(
                (c for c in visited if self.compile(c.plan).peak <= limit),
                key=lambda c: (c.time, self.compile(c.plan).peak, c.plan.compact()),
                default=None,
            )
        if solution is None:
            self._raise_infeasible(limit)
        return RematChoice(
            plan=solution.plan,
            budget_bytes=limit,
            compiled=self.compile(solution.plan),
            predicted=solution,
            no_remat=self.no_remat,
            compilations=self.compilations,
        )

    def _raise_infeasible(self, limit: int) -> None:
        compiled = [(stats.peak, plan) for plan, stats in self._compiled.items()]
        floor, plan = min(compiled, key=lambda item: item[0])
        mib = 2.0**20
        raise ValueError(
            f"The memory budget of {limit} bytes ({limit / mib:.2f} MiB) is below the smallest "
            f"compiled peak that checkpointing this chain reaches: {floor} bytes "
            f"({floor / mib:.2f} MiB, parameters and gradients included; plan "
            f"{plan.compact()}). Without checkpointing the peak is {self.no_remat.peak} bytes "
            f"({self.no_remat.peak / mib:.2f} MiB). Raise the budget to at least {floor} bytes, "
            "or split the chain into more, smaller stages."
        )

    def frontier(
        self, max_plans: int | None = None, progress: Callable[[Any], Any] | None = None
    ) -> list[tuple[Solution, CompiledGradient]]:
        """Compiles candidates (all, or ``max_plans`` evenly spread, ends included).

        Args:
          max_plans: how many candidates to compile; ``None`` compiles all.
          progress: optional wrapper for the loop (e.g. ``tqdm.tqdm``).

        Returns:
          ``(model solution, compiled figures)`` pairs, fastest first.
        """
        indices = list(range(len(self.candidates)))
        if max_plans is not None and len(indices) > max_plans:
            step = (len(indices) - 1) / (max_plans - 1)
            indices = sorted({round(k * step) for k in range(max_plans)})
        loop = progress(indices) if progress is not None else indices
        return [(self.candidates[i], self.compile(self.candidates[i].plan)) for i in loop]

    def predict(self, plan: Plan) -> tuple[float, int]:
        """The model's ``(time, peak bytes)`` for any plan (e.g. a baseline)."""
        return predict(plan, self.costs)


def _bisect(family: list[Solution], fits: Callable[[Solution], bool]) -> Solution | None:
    """The first candidate that fits, assuming fitting is monotone along ``family``."""
    if not family or not fits(family[-1]):
        return None
    if fits(family[0]):
        return family[0]
    lo, hi = 0, len(family) - 1  # family[lo] does not fit, family[hi] fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(family[mid]):
            hi = mid
        else:
            lo = mid
    return family[hi]


def _activations_only(costs: ChainCosts) -> ChainCosts:
    """The chain with only its activations: no gradients, no temporaries."""
    zeros = np.zeros_like(costs.grad_bytes)
    return dataclasses.replace(
        costs,
        grad_bytes=zeros,
        forward_temp_bytes=np.zeros_like(costs.forward_temp_bytes),
        backward_temp_bytes=np.zeros_like(costs.backward_temp_bytes),
    )


def checkpoint_chain(
    stages: Sequence[Stage],
    params: Sequence[Any],
    x: Any,
    budget_bytes: Budget,
    *,
    loss: Loss | None = None,
    slots: int = 500,
    search: Literal["bisect", "scan"] = "bisect",
    time: Literal["flops", "measured"] = "flops",
) -> tuple[Callable[[Sequence[Any], Any], Any], Plan]:
    """Applies a chain with the fastest checkpointing whose compiled gradient fits a budget.

    Measures the stages (:func:`measure_chain`), solves the rotor dynamic program
    (:class:`RotorTable`) and calibrates it against the compiled peak of
    ``jax.jit(jax.value_and_grad(lambda p, x: loss(fn(p, x))))`` (see
    :class:`ChainPlanner`). On CPU, ``XLA_FLAGS`` must contain
    ``--xla_disable_hlo_passes=cse_barrier_expander`` (see
    :func:`resireduce_jax.runtime.configure_cpu`), or the recomputation is merged away.

    Args:
      stages: ``L`` pure functions ``(p_i, x_i) -> x_{i+1}``.
      params: ``L`` per-stage parameter pytrees.
      x: an example input (arrays or ``ShapeDtypeStruct``s).
      budget_bytes: compiled peak allowed for the whole gradient computation, parameters
        and gradients included: bytes, a fraction of the no-remat peak, or a string such
        as ``"1.5GiB"`` / ``"60%"`` (see :func:`parse_budget`).
      loss: maps the chain output to the differentiated scalar (default: sum of outputs).
      slots: memory slots of the dynamic program.
      search: ``"bisect"`` or ``"scan"`` over the candidate plans (see :class:`ChainPlanner`).
      time: ``"flops"`` or ``"measured"`` stage times.

    Returns:
      ``(fn, plan)``: ``fn(params, x)`` applies the chain and its gradient follows ``plan``.

    Raises:
      ValueError: if the budget is below the smallest compiled peak reachable; the message
        states the minimum.

    References:
      Beaumont et al., "Optimal checkpointing for heterogeneous chains: how to train deep
      neural networks with limited memory", ACM TOMS 2024 (https://arxiv.org/abs/1911.13214).
    """
    planner = ChainPlanner(stages, params, x, loss=loss, slots=slots, time=time)
    choice = planner.select(budget_bytes, search=search)
    return planner.function(choice.plan), choice.plan
