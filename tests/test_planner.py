"""The memory planner: budgets, fit() and largest_batch() on real compiles, --plan_only.

The library tests compile small jitted programs whose memory depends on the candidate
(a per-leaf residual as in error feedback, a half-size or bfloat16 one, optimizer state
that is or is not donated, checkpointed layers) and on the batch, and check the planner's
answers against the compiled peaks read independently (``hlo.peak_memory``) and a brute
force scan over batch sizes.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import pytest

from resireduce_jax import hlo, planner
from resireduce_jax.planner import Candidate, Compiled
from tests.test_cli import run_cli

GiB, MiB = 2**30, 2**20

# ------------------------------------------------------------------ budgets


@pytest.mark.parametrize(
    "budget, expected",
    [
        ("12GiB", 12 * GiB),
        ("8 GB", 8 * 10**9),
        ("1.5gib", int(1.5 * GiB)),
        ("512 MiB", 512 * MiB),
        (" 640kb ", 640_000),
        ("12884901888", 12884901888),
        ("100B", 100),
        ("2e3", 2000),
        (12884901888, 12884901888),
        (2048.0, 2048),
    ],
)
def test_budgets_are_read_as_bytes(budget, expected):
    assert planner.parse_budget(budget) == expected


@pytest.mark.parametrize(
    "budget, words",
    [
        ("12XB", "cannot read"),
        ("60%", "percentages"),
        ("12 G", "ambiguous"),
        ("", "cannot read"),
        ("lots", "cannot read"),
        ("0", "at least 1 byte"),
        ("-1GiB", "cannot read"),
        (0, "at least 1 byte"),
        (-5, "at least 1 byte"),
        (1.5, "whole number"),
        (True, "bool"),
        (None, "int or a string"),
    ],
)
def test_bad_budgets_say_what_is_accepted(budget, words):
    with pytest.raises(ValueError, match=words) as error:
        planner.parse_budget(budget)
    assert "12GiB" in str(error.value)  # the accepted forms are listed


# ------------------------------------------------------------------ a small model


WIDTH, LAYERS = 128, 4


def _params():
    return {f"w{i}": jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32) for i in range(LAYERS)}


def _forward(params, x, remat=False):
    for i in range(LAYERS):
        layer = lambda h, w: jnp.tanh(h @ w)
        x = (jax.checkpoint(layer) if remat else layer)(x, params[f"w{i}"])
    return jnp.mean(x**2)


def _program(candidate: Candidate, batch: int, remat: bool = False):
    """A training step shaped by the candidate, compiled from abstract shapes.

    Residual ("ef": one float32 residual per leaf; "w+2d": half of them; "+bf16": in
    bfloat16), momentum ("original": returned as a new buffer, "r": updated in place in
    a donated one) and checkpointed layers (remat) all change the compiled peak.
    """
    params = _params()
    residual_dtype = jnp.bfloat16 if candidate.exchange.endswith("+bf16") else jnp.float32
    kept = LAYERS if candidate.exchange == "ef" else LAYERS // 2
    residuals = {f"w{i}": jax.ShapeDtypeStruct((WIDTH, WIDTH), residual_dtype) for i in range(kept)}
    x = jax.ShapeDtypeStruct((batch, WIDTH), jnp.float32)

    def step(params, momentum, residuals, x):
        grads = jax.grad(lambda p: _forward(p, x, remat))(params)
        new_res = {
            k: (grads[k] + r.astype(jnp.float32)).astype(r.dtype) for k, r in residuals.items()
        }
        momentum = jax.tree.map(lambda m, g: 0.9 * m + g, momentum, grads)
        params = jax.tree.map(lambda p, m: p - 0.1 * m, params, momentum)
        return params, momentum, new_res

    donate = (0, 1, 2) if candidate.optimizer == "r" else (0, 2)
    return jax.jit(step, donate_argnums=donate).lower(params, params, residuals, x).compile()


@functools.cache
def compile_fn(candidate: Candidate, batch: int) -> Compiled:
    """What the planner is given (cached across tests: each program compiles once)."""
    return Compiled.from_program(_program(candidate, batch))


@functools.cache
def remat_compile_fn(candidate: Candidate, batch: int) -> Compiled:
    """Every layer checkpointed."""
    return Compiled.from_program(_program(candidate, batch, remat=True))


class RematCompiler:
    """Adaptive candidates: no checkpoints when that fits, else every layer checkpointed."""

    def __init__(self):
        self.budgets = []

    def leanest(self, candidate, batch):
        return (remat_compile_fn if candidate.adaptive else compile_fn)(candidate, batch)

    def fastest_fitting(self, candidate, batch, budget_bytes):
        self.budgets.append(budget_bytes)
        plain = compile_fn(candidate, batch)
        return plain if plain.peak_bytes <= budget_bytes else self.leanest(candidate, batch)


GRID = planner.candidate_grid(remats=("none",))


@pytest.fixture(scope="module")
def peaks():
    """Compiled peaks of every candidate at batch 64, read directly off the programs."""
    return {c: hlo.peak_memory(_program(c, 64)).peak for c in GRID}


def test_the_small_model_spans_a_range_of_peaks(peaks):
    assert len(set(peaks.values())) >= 3, peaks  # the candidates differ in memory


def test_fit_chooses_the_fastest_candidate_that_fits(peaks):
    ordered = sorted(set(peaks.values()))
    budget = ordered[len(ordered) // 2]  # some fit, some do not
    result = planner.fit(GRID, compile_fn, budget, batch_per_worker=64)
    assert result.budget_bytes == budget
    assert [r.candidate for r in result.rows] == GRID
    for row in result.rows:
        assert row.compiled.peak_bytes == peaks[row.candidate]
        assert row.fits == (peaks[row.candidate] <= budget)
    chosen = result.chosen
    assert chosen.fits and chosen.compiled.peak_bytes <= budget
    # Brute force over the table: the smallest step estimate among those that fit.
    device = planner.DeviceModel()
    fitting = [c for c in GRID if peaks[c] <= budget]
    best = min(device.step_seconds(Compiled.from_program(_program(c, 64))) for c in fitting)
    assert chosen.step_seconds == pytest.approx(best)
    data = result.as_dict()
    assert data["chosen"]["peak_bytes"] == chosen.compiled.peak_bytes
    assert all({"peak_bytes", "fits"} <= set(row) for row in data["candidates"])
    assert "*" in result.table()


def test_a_candidate_that_does_not_fit_is_never_chosen(peaks):
    # Make the fastest candidate by estimate too big: the planner must pass over it.
    device = planner.DeviceModel()
    by_speed = sorted(GRID, key=lambda c: device.step_seconds(compile_fn(c, 64)))
    fastest = by_speed[0]
    budget = (
        max(peaks[c] for c in GRID if peaks[c] < peaks[fastest])
        if any(peaks[c] < peaks[fastest] for c in GRID)
        else None
    )
    if budget is None:
        pytest.skip("the fastest candidate is also the leanest")
    result = planner.fit(GRID, compile_fn, budget, batch_per_worker=64)
    assert result.chosen.candidate != fastest
    assert result.chosen.compiled.peak_bytes <= budget


def test_an_impossible_budget_names_the_smallest_peak(peaks):
    smallest = min(peaks.values())
    with pytest.raises(planner.BudgetError) as error:
        planner.fit(GRID, compile_fn, smallest - 1, batch_per_worker=64)
    assert str(smallest) in str(error.value)
    assert error.value.smallest.compiled.peak_bytes == smallest
    assert isinstance(error.value, ValueError)


def test_adaptive_candidates_use_the_compiler_and_fit():
    candidates = [Candidate("ef", "original", "none"), Candidate("ef", "original", "rotor")]
    plain = hlo.peak_memory(_program(candidates[0], 256)).peak
    lean = hlo.peak_memory(_program(candidates[1], 256, remat=True)).peak
    assert lean < plain
    compiler = RematCompiler()
    budget = (lean + plain) // 2
    result = planner.fit(candidates, compiler, budget, batch_per_worker=256)
    assert compiler.budgets == [budget]  # the adaptive candidate was planned for it
    assert result.chosen.candidate.remat == "rotor"
    assert result.chosen.compiled.peak_bytes == lean
    assert not result.rows[0].fits
    with pytest.raises(ValueError, match="Compiler"):
        planner.fit(candidates, compile_fn, plain, batch_per_worker=256)


# ------------------------------------------------------------------ largest batch


def brute_force(candidate: Candidate, budget: int, max_batch: int, remat: bool = False) -> int:
    """The largest batch that fits, compiling every batch from 1 to ``max_batch``."""
    largest = 0
    for batch in range(1, max_batch + 1):
        peak = (remat_compile_fn if remat else compile_fn)(candidate, batch).peak_bytes
        if peak <= budget:
            largest = batch
    return largest


@pytest.mark.parametrize("search", ["interpolate", "bisect"])
def test_largest_batch_agrees_with_a_brute_force_scan(search):
    max_batch = 24
    candidates = [Candidate("ef", "original"), Candidate("w+2d+bf16", "r")]
    low = compile_fn(candidates[1], 1).peak_bytes
    high = compile_fn(candidates[0], max_batch).peak_bytes
    budgets = [low - 1, (2 * low + high) // 3, (low + 2 * high) // 3, 10 * high]
    cache = planner.CachedCompiler(compile_fn)  # shared by the budgets
    # compile_fn is cached, so the brute force compiles each (candidate, batch) once.
    for i, budget in enumerate(budgets):
        cold = planner.CachedCompiler(compile_fn) if i == 1 else cache  # a search from `start`
        result = planner.largest_batch(
            candidates, cold, budget, max_batch=max_batch, search=search, start=8
        )
        for found in result.searches:
            expected = brute_force(found.candidate, budget, max_batch)
            assert found.batch == expected, (search, budget, found.candidate, found.probes)
            if expected:
                assert found.row.compiled.peak_bytes <= budget
            assert found.capped == (expected == max_batch)
    assert cache.compilations < len(candidates) * max_batch  # fewer than the brute force


def test_largest_batch_of_an_adaptive_candidate_uses_its_leanest_form():
    max_batch = 16
    candidate = Candidate("ef", "original", "rotor")
    budget = remat_compile_fn(candidate, 10).peak_bytes
    result = planner.largest_batch([candidate], RematCompiler(), budget, max_batch=max_batch)
    assert result.best.batch == brute_force(candidate, budget, max_batch, remat=True)
    assert result.best.row.compiled.peak_bytes <= budget


# ------------------------------------------------------------------ the training program


def test_plan_only_writes_the_table_and_exits(tmp_path):
    workdir = tmp_path / "plan"
    result = run_cli(
        "--config=configs/default.py",
        f"--workdir={workdir}",
        "--config.memory.budget=3.4MiB",
        "--config.num_workers=2",
        "--plan_only",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    plan = json.loads((workdir / "memory_plan.json").read_text())
    budget = plan["budget_bytes"]
    assert budget == int(3.4 * MiB)
    rows = plan["candidates"]
    assert len(rows) == 6  # ef / w+2d / w+2d+bf16 x optax sgd / skip-aware sgd (no chain)
    for row in rows:
        assert row["fits"] == (row["peak_bytes"] <= budget)
    chosen = plan["chosen"]
    assert chosen["fits"] and chosen["peak_bytes"] <= budget
    fastest = min(r["step_time_estimate_s"] for r in rows if r["fits"])
    assert chosen["step_time_estimate_s"] == fastest
    assert plan["planned"]["optimizer.name"] in ("sgd", "optax.sgd")
    assert not (workdir / "checkpoints").exists()  # nothing trained
    assert "Memory plan" in result.stdout and os.path.basename(str(workdir)) in result.stdout


def test_a_checkpointed_stage_with_unread_per_worker_outputs_differentiates_in_shard_map():
    """Rotor candidates of models with batch statistics (ResNet-50) in the data-parallel step.

    The statistics vary over the workers and the loss does not read them: their symbolic
    zero cotangent must be instantiated varying too (``remat.executor``).
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from resireduce_jax.remat.executor import sequenced_stage

    def stage(p, carry):
        h, stats = carry
        y = jnp.tanh(h @ p)
        return y, stats + jnp.mean(y, axis=0)

    run = sequenced_stage(stage)
    mesh = jax.make_mesh((8,), ("data",))

    def body(p, h):
        def loss(p):
            y, stats = run(p, (h, jnp.zeros((4,))))
            return jnp.sum(y), stats

        p = jax.lax.pcast(p, ("data",), to="varying")
        return jax.lax.psum(jax.grad(lambda p: loss(p)[0])(p), "data")

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    w = jax.device_put(jnp.eye(4), NamedSharding(mesh, P()))
    h = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("data")))
    expected = jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.ones((16, 4)) @ w)))(jnp.eye(4))
    assert jnp.allclose(step(w, h), expected, atol=1e-5)


def test_interpolation_grows_the_batch_at_most_fourfold_before_a_batch_fails():
    """Flat peaks (a plan that absorbs the batch) must not send the search to max_batch."""
    flat = {2: 10_000_000, 6: 10_000_001}  # one byte more for four more samples
    probe = planner._next_probe(flat, 6, None, 12_000_000, 512, bisect=False)
    assert 6 < probe <= 4 * 6
    steep = {2: 1_000, 4: 2_000}  # affine: the line's prediction is kept when it is near
    assert planner._next_probe(steep, 4, None, 7_000, 512, bisect=False) == 14
