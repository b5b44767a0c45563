"""The rotor dynamic program against brute force, plans, baselines and budgets (numpy only).

Two independent references: a simulation of each plan's operation sequence with an explicit
set of live buffers (the brute force takes the best plan by simulated peak), and a
paraphrase of the paper's recurrence (Beaumont et al., arXiv:1911.13214, §4).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np
import pytest

from resireduce_jax.remat import baselines
from resireduce_jax.remat.budget_search import parse_budget
from resireduce_jax.remat.costs import ChainCosts
from resireduce_jax.remat.solver import (
    Checkpoint,
    Plan,
    RotorTable,
    RunStage,
    all_plans,
    predict,
    solve,
)


def random_costs(rng: np.random.Generator, n: int) -> ChainCosts:
    """Integer sizes, so that a table with 1-byte slots discretises nothing."""
    a = rng.integers(1, 20, n + 1)
    return ChainCosts(
        activation_bytes=a,
        saved_bytes=a[1:] + rng.integers(0, 30, n),
        forward_temp_bytes=rng.integers(0, 10, n),
        backward_temp_bytes=rng.integers(0, 10, n),
        param_bytes=rng.integers(1, 10, n),
        grad_bytes=rng.integers(0, 10, n),
        forward_time=(fw := rng.uniform(1, 10, n)),
        backward_time=rng.uniform(1, 20, n),
        residual_time=fw * rng.uniform(0, 1, n) * (rng.uniform(size=n) > 0.3),
        time_unit="flops",
        stage_names=tuple(f"s{i}" for i in range(n)),
    )


def simulated_peak(plan: Plan, costs: ChainCosts) -> int:
    """Peak bytes of ``plan``'s operations, replayed on an explicit set of live buffers.

    Operations as in the paper's model (§3): ``F_ck``/``F_n`` run a stage without keeping
    more than its output, ``F_all`` keeps ``x̄`` (output included), ``B`` reads ``δ_{s+1}``,
    ``x̄_s`` and ``x_s``, writes ``δ_s`` and the stage's gradient, and frees what it read
    (a cotangent as soon as the backward that reads it is done). The output cotangent
    ``δ_L`` is reserved from the start; parameters and ``x_0`` are held throughout.
    """
    a, xbar = costs.activation_bytes, costs.saved_bytes
    o_f, o_b, grad = costs.forward_temp_bytes, costs.backward_temp_bytes, costs.grad_bytes
    n = plan.num_stages
    live: dict[tuple[str, int], int] = {("x", 0): int(a[0]), ("delta", n): int(a[n])}
    fixed = int(costs.param_bytes.sum())
    peak = 0

    def during(transient: int) -> None:
        nonlocal peak
        peak = max(peak, fixed + sum(live.values()) + int(transient))

    def backward(s: int) -> None:
        during(a[s] + grad[s] + o_b[s])
        del live[("xbar", s)], live[("delta", s + 1)]
        if s > 0:
            live.pop(("x", s), None)  # a kept stage input dies with its last reader
        live[("delta", s)] = int(a[s])
        live[("grad", s)] = int(grad[s])

    def process(items, t: int) -> None:
        first, rest = items[0], items[1:]
        if isinstance(first, RunStage):
            s = first.index
            during(xbar[s] + o_f[s])
            live[("xbar", s)] = int(xbar[s])
            if rest:
                process(rest, t)
            backward(s)
            return
        s, j = first.start, first.end
        for k in range(s, j):
            during(a[k + 1] + o_f[k])
            if k > s:
                del live[("x", k)]
            live[("x", k + 1)] = int(a[k + 1])
        if rest:
            process(rest, t)
        else:
            del live[("x", j)]  # a last checkpoint's output is its caller's concern
        process(first.body, j)

    process(plan.items, n)
    assert set(live) == {("x", 0), ("delta", 0)} | {("grad", i) for i in range(n)}, live
    return peak


def plan_time(plan: Plan, costs: ChainCosts) -> float:
    """Forward and backward of every stage, plus each recomputation as the executor runs it.

    A recomputed segment's last item is pruned to what its backward reads: a last stage
    costs its residuals (``residual_time``), a last nested checkpoint is not swept.
    """
    fw, res = costs.forward_time, costs.residual_time

    def redo(items) -> float:
        total = 0.0
        for k, item in enumerate(items):
            last = k == len(items) - 1
            if isinstance(item, RunStage):
                total += res[item.index] if last else fw[item.index]
            else:
                total += (0.0 if last else fw[item.start : item.end].sum()) + redo(item.body)
        return total

    extra = sum(redo(item.body) for item in plan.items if isinstance(item, Checkpoint))
    return float(fw.sum() + costs.backward_time.sum() + extra)


def exact_table(costs: ChainCosts, top: int) -> RotorTable:
    """A table with 1-byte slots up to ``top`` bytes of model peak: nothing is rounded."""
    table = RotorTable(costs, slots=top - RotorTable(costs).held, max_bytes=top)
    assert table.unit == pytest.approx(1.0)
    return table


@pytest.mark.parametrize("seed", range(4))
def test_predicted_peak_is_the_simulated_peak(seed):
    costs = random_costs(np.random.default_rng(seed), 5)
    for items in all_plans(0, 5):
        plan = Plan(items, 5)
        time, memory = predict(plan, costs)
        assert memory == simulated_peak(plan, costs), plan.compact()
        np.testing.assert_allclose(time, plan_time(plan, costs), rtol=1e-12)
    for plan in (baselines.every_stage(5), baselines.recursive_halving(5)):
        assert predict(plan, costs)[1] == simulated_peak(plan, costs), plan.compact()


def assert_matches_brute_force(costs: ChainCosts) -> None:
    """At every budget, the table's plan is the fastest of all plans by simulated peak."""
    n = costs.num_stages
    plans = [Plan(items, n) for items in all_plans(0, n)]
    simulated = [(plan_time(plan, costs), simulated_peak(plan, costs)) for plan in plans]
    top = max(m for _, m in simulated)
    low = min(m for _, m in simulated)
    table = exact_table(costs, top)
    for budget in range(low - 3, top + 1):
        feasible = [t for t, m in simulated if m <= budget]
        plan = table.plan_for(budget)
        if not feasible:
            assert plan is None, budget
            continue
        assert plan is not None, budget
        assert simulated_peak(plan, costs) <= budget
        np.testing.assert_allclose(plan_time(plan, costs), min(feasible), rtol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_dynamic_program_matches_brute_force(seed):
    assert_matches_brute_force(random_costs(np.random.default_rng(seed), 5))


def test_forward_sweep_must_fit_beside_the_segment_cotangent():
    """A leaf's sweep can need more than both of its subproblems.

    Stage 1 has a large forward overhead and δ_3 is large: the first forward of stage 1
    runs beside δ_3 whatever the plan (10 + 1 + 1 + 20 bytes), while the recomputation of
    a checkpointed [0, 2) runs beside δ_2 alone (1 byte). Random chains rarely make this
    bind; without the sweep's own constraint the table would offer ``0 [1] 2`` at 23 bytes.
    """
    ones = np.ones(3)
    costs = ChainCosts(
        activation_bytes=np.array([1, 1, 1, 10]),
        saved_bytes=np.array([1, 1, 10]),
        forward_temp_bytes=np.array([0, 20, 0]),
        backward_temp_bytes=np.zeros(3, int),
        param_bytes=np.ones(3, int),
        grad_bytes=np.zeros(3, int),
        forward_time=ones,
        backward_time=ones,
        residual_time=ones,
        time_unit="flops",
        stage_names=("a", "b", "c"),
    )
    assert_matches_brute_force(costs)
    assert RotorTable(costs).min_bytes == 3 + 1 + 32  # parameters, x_0, the sweep


def rotor_paraphrase(costs: ChainCosts):
    """The paper's persistent recurrence (§4), written independently of the solver.

    ``opt(s, t, m)``: least time to run stages ``s..t-1`` forward and backward when ``x_s``
    is held outside ``m`` and ``δ_t`` is counted in ``m``. Choices at ``s``:

    * ``F_all``: keep ``x̄_s``, solve ``[s+1, t)`` in ``m - x̄_s``, then ``B_s``;
    * ``F_ck`` at ``s``, ``F_n`` up to ``j - 1``, keep ``x_j``: solve ``[j, t)`` in
      ``m - x_j``; its backward consumes ``δ_t`` and ``x_j`` and leaves ``δ_j``, so
      ``[s, j)`` is solved again in ``m``.

    ``m_∅``: every forward that keeps nothing (input ``x_k`` for ``k > s``, output
    ``x_{k+1}``, overhead ``o_f``) must fit beside ``δ_t``; ``F_all`` of ``s`` must fit
    beside ``δ_t`` (``m_all``) and ``B_s`` holds ``δ_{s+1}``, ``x̄_s`` and ``δ_s``.
    Rotor's chains have no parameter gradients and recompute a segment's last stage in
    full, so this takes no ``grad_bytes`` and no ``residual_time``.
    """
    x = [int(v) for v in costs.activation_bytes]
    delta = x  # |δ_i| = |x_i|
    xbar = [int(v) for v in costs.saved_bytes]
    o_f = [int(v) for v in costs.forward_temp_bytes]
    o_b = [int(v) for v in costs.backward_temp_bytes]
    u_f, u_b = list(costs.forward_time), list(costs.backward_time)

    def backward_fits(s, m):
        return m >= delta[s + 1] + xbar[s] + delta[s] + o_b[s]

    @functools.cache
    def opt(s: int, t: int, m: int) -> float:
        m_empty = delta[t] + max((x[k] if k > s else 0) + x[k + 1] + o_f[k] for k in range(s, t))
        m_all = delta[t] + xbar[s] + o_f[s]
        if m < m_empty:
            return math.inf
        best = math.inf
        if m >= m_all and backward_fits(s, m):
            best = u_f[s] + u_b[s] + (0.0 if t == s + 1 else opt(s + 1, t, m - xbar[s]))
        for j in range(s + 1, t):
            if m >= x[j]:
                best = min(best, sum(u_f[s:j]) + opt(j, t, m - x[j]) + opt(s, j, m))
        return best

    return opt


def rotor_accounting(costs: ChainCosts) -> ChainCosts:
    """``costs`` where the solver's accounting is rotor's: no gradients, no pruning."""
    return dataclasses.replace(
        costs,
        grad_bytes=np.zeros_like(costs.grad_bytes),
        residual_time=costs.forward_time.copy(),
    )


@pytest.mark.parametrize(("seed", "n"), [(s, n) for s in range(4) for n in (3, 5, 7)])
def test_dynamic_program_equals_rotor_recurrence(seed, n):
    costs = rotor_accounting(random_costs(np.random.default_rng(100 + seed), n))
    opt = rotor_paraphrase(costs)
    held = RotorTable(costs).held
    top = predict(Plan.unwrapped(n), costs)[1]
    table = exact_table(costs, top)
    for m in range(top - held + 1):
        expected = opt(0, n, m)
        plan = table.plan_at_slots(m)
        if math.isinf(expected):
            assert plan is None, m
            continue
        assert plan is not None, m
        time, memory = predict(plan, costs)
        assert memory <= held + m
        np.testing.assert_allclose(time, expected, rtol=1e-12)


def test_pruned_recomputation_is_never_slower_than_rotor():
    """Without gradients the memory model is rotor's; pruning only makes recomputing cheaper."""
    for seed in range(3):
        costs = random_costs(np.random.default_rng(200 + seed), 5)
        held = RotorTable(costs).held
        pruned = dataclasses.replace(costs, grad_bytes=np.zeros_like(costs.grad_bytes))
        opt = rotor_paraphrase(costs)
        top = predict(Plan.unwrapped(5), pruned)[1]
        table = exact_table(pruned, top)
        for m in range(top - held + 1):
            plan = table.plan_at_slots(m)
            assert (plan is None) == math.isinf(opt(0, 5, m))
            if plan is not None:
                assert predict(plan, pruned)[0] <= opt(0, 5, m) + 1e-9


def test_every_plan_is_distinct_and_valid():
    plans = [Plan(items, 5) for items in all_plans(0, 5)]
    assert len(set(plans)) == len(plans)
    for plan in plans:
        assert Plan.from_json(plan.as_json(), 5) == plan


def test_recomputation_time_prunes_the_last_item_of_each_segment():
    n = 6
    fw, res = np.arange(1.0, n + 1), np.full(n, 0.25)
    costs = ChainCosts(
        activation_bytes=np.ones(n + 1, int),
        saved_bytes=np.ones(n, int),
        forward_temp_bytes=np.zeros(n, int),
        backward_temp_bytes=np.zeros(n, int),
        param_bytes=np.ones(n, int),
        grad_bytes=np.ones(n, int),
        forward_time=fw,
        backward_time=np.zeros(n),
        residual_time=res,
        time_unit="flops",
        stage_names=tuple("abcdef"),
    )
    # [[0 1] 2] 3 [[4] 5]: outer [0,3) redoes [0 1] (fw 1+2) and stage 2's residuals;
    # [0 1] redoes stage 0 and stage 1's residuals; [[4] 5] redoes stage 4 and stage 5's
    # residuals, [4] stage 4's residuals.
    plan = Plan.from_json([[[0, 1], 2], 3, [[4], 5]], n)
    redone = (1 + 2 + 0.25) + (1 + 0.25) + (5 + 0.25) + 0.25
    assert predict(plan, costs)[0] == pytest.approx(fw.sum() + redone)
    # A last nested checkpoint's sweep is pruned entirely: [[0] [1]] redoes only the two
    # inner segments (stage 0 is needed by [1]'s input, so it is swept; [1] is not).
    plan = Plan.from_json([[[0], [1]], 2, 3, 4, 5], n)
    assert predict(plan, costs)[0] == pytest.approx(fw.sum() + 1 + 0.25 + 0.25)


def test_forward_counts_and_rendering():
    plan = Plan.from_json([[[0, 1], 2], 3, [4]], 5)
    np.testing.assert_array_equal(plan.forward_counts(), [3, 3, 2, 1, 2])
    assert plan.num_checkpoints == 3
    assert plan.compact() == "[[0 1] 2] 3 [4]"
    assert plan.render().splitlines() == [
        "checkpoint stages 0..2:",
        "  checkpoint stages 0..1:",
        "    stage 0",
        "    stage 1",
        "  stage 2",
        "stage 3",
        "checkpoint stages 4..4:",
        "  stage 4",
    ]


@pytest.mark.parametrize(
    "items",
    [
        (RunStage(0), RunStage(2)),
        (RunStage(1),),
        (Checkpoint(0, 2, (RunStage(0),)), RunStage(2)),
        (RunStage(0), RunStage(1)),
    ],
)
def test_invalid_plans_are_rejected(items):
    with pytest.raises(ValueError, match="cover"):
        Plan(items, 3)


def test_predict_matches_hand_derivation():
    # Two stages, everything in bytes: a = (4, 8, 2), x̄ = (10, 3), o_f = (1, 0), o_b = (2, 5),
    # params (6, 7), grads (6, 7).
    costs = ChainCosts(
        activation_bytes=np.array([4, 8, 2]),
        saved_bytes=np.array([10, 3]),
        forward_temp_bytes=np.array([1, 0]),
        backward_temp_bytes=np.array([2, 5]),
        param_bytes=np.array([6, 7]),
        grad_bytes=np.array([6, 7]),
        forward_time=np.array([1.0, 2.0]),
        backward_time=np.array([3.0, 4.0]),
        residual_time=np.array([0.5, 2.0]),
        time_unit="flops",
        stage_names=("a", "b"),
    )
    held = 6 + 7 + 4  # parameters and x_0; δ_2 (2 bytes) is counted by the segment
    # G = (13, 7, 0). F_all(s) in [s, t): a_t + G_t + x̄_s + o_f(s); B(s): x̄_s + a_{s+1} +
    # a_s + G_s + o_b(s). B(0) = 10 + 8 + 4 + 13 + 2 = 37, B(1) = 3 + 2 + 8 + 7 + 5 = 25.
    # Unwrapped: max(F_all(0) = 2 + 0 + 10 + 1, B(0), x̄_0 + max(F_all(1) = 5, B(1)))
    #   = max(13, 37, 10 + 25) = 37.
    time, memory = predict(Plan.unwrapped(2), costs)
    assert time == 1 + 2 + 3 + 4
    assert memory == held + 37
    # [0] 1: sweep a_2 + G_2 + a_1 + o_f(0) = 11; [1] holding x_1: 8 + 25 = 33; then the
    # recomputation of [0] with δ_1: max(F_all(0) in [0, 1) = 8 + 7 + 10 + 1, B(0)) = 37.
    # The recomputed stage 0 is the last of its segment: only its residuals are redone.
    time, memory = predict(Plan.from_json([[0], 1], 2), costs)
    assert time == 1 + 0.5 + 2 + 3 + 4
    assert memory == held + 37
    # Holding δ_2 through [0] 1 would have cost 2 more bytes (B(0) with δ_2 alive): XLA
    # frees it after B(1) (docs/remat.md, "Memory accounting").


def test_candidates_trade_time_for_memory():
    costs = random_costs(np.random.default_rng(7), 30)
    candidates = RotorTable(costs, slots=300).candidates()
    assert candidates[0].plan == Plan.unwrapped(30)
    assert candidates[0].overhead == 0
    times = [c.time for c in candidates]
    assert times == sorted(times)
    assert len(candidates) > 5
    assert candidates[-1].memory < candidates[0].memory
    assert len({c.plan for c in candidates}) == len(candidates)


def test_solve_respects_model_budget_and_reports_minimum():
    costs = random_costs(np.random.default_rng(3), 12)
    table = RotorTable(costs, slots=500)
    floor = table.min_bytes
    unwrapped = predict(Plan.unwrapped(12), costs)[1]
    for budget in np.linspace(floor * 1.05, unwrapped, 6):
        solution = solve(costs, budget)
        assert solution.memory <= budget
        assert solution.overhead >= 0
    assert solve(costs, unwrapped + 1).plan == Plan.unwrapped(12)
    with pytest.raises(ValueError, match="smallest the model allows") as info:
        solve(costs, floor * 0.5)
    assert str(floor) in str(info.value)


def test_table_handles_long_chains():
    costs = random_costs(np.random.default_rng(0), 100)
    table = RotorTable(costs, slots=500)
    m = (table.min_slots + table.size) // 2
    plan = table.plan_at_slots(m)
    assert plan is not None and plan.num_checkpoints > 0
    assert predict(plan, costs)[1] <= table.held + m * table.unit + 1
    assert table.plan_at_slots(table.min_slots - 1) is None


@pytest.mark.parametrize("n", [1, 2, 7, 16])
def test_baselines(n):
    np.testing.assert_array_equal(baselines.no_remat(n).forward_counts(), np.ones(n))
    np.testing.assert_array_equal(baselines.every_stage(n).forward_counts(), np.full(n, 2))
    segments = baselines.sequential_segments(n)
    k = max(1, round(np.sqrt(n)))
    size = n // k
    expected = np.ones(n)
    expected[: (k - 1) * size] = 2
    np.testing.assert_array_equal(segments.forward_counts(), expected)
    halving = baselines.recursive_halving(n)
    # The last stage is never recomputed; the first half has floor(n / 2) stages, so the
    # first stage is nested floor(log2 n) times.
    counts = halving.forward_counts()
    assert counts[-1] == 1
    assert counts[0] == 1 + int(np.floor(np.log2(n)))
    coarse = baselines.recursive_halving(n, leaf_size=4)
    assert coarse.forward_counts().sum() <= counts.sum()


def test_baseline_argument_errors():
    with pytest.raises(ValueError, match="segments"):
        baselines.sequential_segments(4, 5)
    with pytest.raises(ValueError, match="leaf_size"):
        baselines.recursive_halving(4, 0)
    with pytest.raises(ValueError, match="at least one stage"):
        baselines.every_stage(0)


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (1000, ("bytes", 1000.0)),
        (0.5, ("fraction", 0.5)),
        (1.0, ("fraction", 1.0)),
        (3e9, ("bytes", 3e9)),
        ("60%", ("fraction", 0.6)),
        ("2GiB", ("bytes", 2.0 * 2**30)),
        ("1.5 MB", ("bytes", 1.5e6)),
        ("512mib", ("bytes", 512.0 * 2**20)),
        ("123", ("bytes", 123.0)),
    ],
)
def test_parse_budget(budget, expected):
    assert parse_budget(budget) == expected


@pytest.mark.parametrize("budget", [0, -5, 0.0, "0%", "150%", "lots", "5 parsecs", True, None])
def test_parse_budget_rejects(budget):
    with pytest.raises(ValueError):
        parse_budget(budget)


def test_brute_force_counts_grow_like_the_search_space():
    # Sanity check of the enumerator used above: f(L) = f(L-1) + Σ_j f(j) f(L-j), the large
    # Schröder numbers (L=3: "0 1 2", "0 [1] 2", "[0] 1 2", "[0] [1] 2", "[0 1] 2", "[[0] 1] 2").
    counts = [sum(1 for _ in all_plans(0, n)) for n in range(1, 6)]
    assert counts == [1, 2, 6, 22, 90]
    assert list(itertools.islice(all_plans(0, 2), 2)) == [
        (RunStage(0), RunStage(1)),
        (Checkpoint(0, 1, (RunStage(0),)), RunStage(1)),
    ]
