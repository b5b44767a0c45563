"""The rotor dynamic program against brute force, plans, baselines and budgets (numpy only)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from resireduce_jax.remat import baselines
from resireduce_jax.remat.costs import ChainCosts
from resireduce_jax.remat.planner import parse_budget
from resireduce_jax.remat.solver import Checkpoint, Plan, RotorTable, RunStage, predict, solve


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


def all_plans(start: int, end: int):
    """Every persistent plan of [start, end) that the dynamic program can express."""
    if end == start + 1:
        yield (RunStage(start),)
        return
    for rest in all_plans(start + 1, end):
        yield (RunStage(start), *rest)
    for j in range(start + 1, end):
        for body in all_plans(start, j):
            for rest in all_plans(j, end):
                yield (Checkpoint(start, j, body), *rest)


@pytest.mark.parametrize("seed", range(4))
def test_dynamic_program_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 5
    costs = random_costs(rng, n)
    plans = [Plan(items, n) for items in all_plans(0, n)]
    predicted = [predict(plan, costs) for plan in plans]
    top = max(m for _, m in predicted)
    low = min(m for _, m in predicted)
    # 1-byte slots from the held bytes up to the largest peak: the table is exact.
    table = RotorTable(costs, slots=top - RotorTable(costs).held, max_bytes=top)
    assert table.unit == pytest.approx(1.0)
    for budget in range(low - 3, top + 1):
        feasible = [t for t, m in predicted if m <= budget]
        plan = table.plan_for(budget)
        if not feasible:
            assert plan is None, budget
            continue
        time, memory = predict(plan, costs)
        assert memory <= budget
        np.testing.assert_allclose(time, min(feasible), rtol=1e-12)


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
    held = 6 + 7 + 4 + 2
    # Unwrapped: all(0) inside [0, 2): max(G_2 + x̄0 + of0, x̄0 + a1 + a0 + G_0 + ob0)
    #   = max(0 + 10 + 1, 10 + 8 + 4 + 13 + 2) = 37; plus x̄0 + need(stage 1) with
    #   stage_step(1) = max(G_2 + 3 + 0, 3 + 8 + G_1 + 5) = 23 -> 10 + 23 = 33.
    time, memory = predict(Plan.unwrapped(2), costs)
    assert time == 1 + 2 + 3 + 4
    assert memory == held + 37
    # [0] 1: sweep = G_2 + a1 + of0 = 9; a1 + need(rest) = 8 + 23 = 31;
    #   a1 + stage_step(0) = 8 + max(G_1 + 10 + 1, 10 + 4 + 13 + 2) = 8 + 29 = 37.
    # The recomputed stage 0 is the last of its segment: only its residuals are redone.
    time, memory = predict(Plan.from_json([[0], 1], 2), costs)
    assert time == 1 + 0.5 + 2 + 3 + 4
    assert memory == held + 37


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
