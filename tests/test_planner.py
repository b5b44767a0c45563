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
import re

import jax
import jax.numpy as jnp
import pytest

from resireduce_jax import hlo, planner
from resireduce_jax.planner import Candidate, Compiled
from resireduce_jax.planner.batch_search import _next_probe
from tests.test_cli import run_cli
from train import compiled_step, config_schema

GiB, MiB = 2**30, 2**20

# The tests share compiled programs (``compile_fn``, ``gpt_compilers``, ``_phased_gpt``):
# each is compiled once per worker, and this module's tests share a worker.
pytestmark = pytest.mark.xdist_group("planner")


def test_the_modules_tests_share_one_xdist_worker(request):
    """Under ``pytest -n``, ``--dist loadgroup`` (pyproject.toml) sends this module's tests to
    one worker, so its compiled programs are compiled once. pytest 9.2 silently stops the
    grouping (pytest-xdist#1386; pyproject.toml keeps pytest below it)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("tests are grouped only under pytest-xdist (-n)")
    assert request.node.nodeid.endswith("@planner"), request.node.nodeid


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


GRID = planner.candidate_grid(("ef", "w+2d", "w+2d+bf16"), remats=("none",))


@pytest.fixture(scope="module")
def peaks():
    """Compiled peaks of every candidate at batch 64, read directly off the programs."""
    return {c: hlo.peak_memory(_program(c, 64)).peak for c in GRID}


def test_the_small_model_spans_a_range_of_peaks(peaks):
    assert len(set(peaks.values())) >= 3, peaks  # the candidates differ in memory


def test_fit_chooses_the_fastest_candidate_that_fits(peaks):
    ordered = sorted(set(peaks.values()))
    budget = ordered[len(ordered) // 2]  # some fit, some do not
    result = planner.fit(GRID, compile_fn, budget, batch_per_worker=64, prefer="speed")
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


@pytest.mark.parametrize("budget_index", [0, 1, 2, 3, 4, 5])
def test_fit_prefers_the_first_exchange_that_fits(peaks, budget_index):
    """prefer="accuracy" (the default): by brute force over the table, the fastest fitting
    row of the first exchange, in the candidates' order, that has a fitting row."""
    ordered = sorted(set(peaks.values()))
    budget = ordered[min(budget_index, len(ordered) - 1)]
    result = planner.fit(GRID, compile_fn, budget, batch_per_worker=64)
    device = planner.DeviceModel()
    fitting = [c for c in GRID if peaks[c] <= budget]
    first = next(c.exchange for c in GRID if c in fitting)
    best = min(
        (c for c in fitting if c.exchange == first),
        key=lambda c: device.step_seconds(Compiled.from_program(_program(c, 64))),
    )
    assert result.chosen.candidate.exchange == first
    assert result.chosen.step_seconds == pytest.approx(
        device.step_seconds(Compiled.from_program(_program(best, 64)))
    )
    speed = planner.fit(GRID, compile_fn, budget, batch_per_worker=64, prefer="speed")
    assert speed.chosen.step_seconds <= result.chosen.step_seconds
    with pytest.raises(ValueError, match="prefer='fast'"):
        planner.fit(GRID, compile_fn, budget, batch_per_worker=64, prefer="fast")


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
    # planner.EXCHANGES x optax sgd / skip-aware sgd (no chain)
    assert len(rows) == 2 * len(planner.EXCHANGES)
    for row in rows:
        assert row["fits"] == (row["peak_bytes"] <= budget)
    chosen = plan["chosen"]
    assert chosen["fits"] and chosen["peak_bytes"] <= budget
    # The first exchange with a fitting row (most accurate first), its fastest row.
    first = next(r["exchange"] for r in rows if r["fits"])
    assert chosen["exchange"] == first
    fastest = min(r["step_time_estimate_s"] for r in rows if r["fits"] and r["exchange"] == first)
    assert chosen["step_time_estimate_s"] == fastest
    planned = compiled_step.with_variant(config_schema.base_config(), first).compression
    assert plan["planned"]["compression.residual_format"] == planned.residual_format
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
    probe = _next_probe(flat, 6, None, 12_000_000, 512, bisect=False)
    assert 6 < probe <= 4 * 6
    steep = {2: 1_000, 4: 2_000}  # affine: the line's prediction is kept when it is near
    assert _next_probe(steep, 4, None, 7_000, 512, bisect=False) == 14


# ------------------------------------------------------------------ pruning and threads


def test_once_map_computes_each_key_once_when_threads_ask_together():
    import threading
    import time

    calls = []
    values = planner.OnceMap()

    def compute(key):
        calls.append(key)
        time.sleep(0.05)  # long enough for every thread to ask while it runs
        return key * 10

    results = []
    threads = [
        threading.Thread(target=lambda k=k: results.append(values.get(k, lambda: compute(k))))
        for k in (1, 1, 1, 2, 2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == [1, 2]
    assert sorted(results) == [10, 10, 10, 20, 20]
    assert values.peek(3) is None and len(values) == 2


def test_fit_on_several_threads_gives_the_serial_answer(peaks):
    budget = sorted(set(peaks.values()))[len(peaks) // 2]
    serial = planner.fit(GRID, compile_fn, budget, batch_per_worker=64)
    parallel = planner.fit(GRID, compile_fn, budget, batch_per_worker=64, threads=3)
    assert parallel.chosen.candidate == serial.chosen.candidate
    assert [r.compiled for r in parallel.rows] == [r.compiled for r in serial.rows]


class BoundedCompiler:
    """``compile_fn`` with a lower bound: the parameters, momentum and residuals."""

    def __init__(self):
        self.compiled = []

    def leanest(self, candidate, batch):
        self.compiled.append((candidate, batch))
        return compile_fn(candidate, batch)

    def fastest_fitting(self, candidate, batch, budget_bytes):
        return self.leanest(candidate, batch)

    def peak_bound(self, candidate, batch):
        leaf = WIDTH * WIDTH * 4
        kept = LAYERS if candidate.exchange == "ef" else LAYERS // 2
        residual = leaf // 2 if candidate.exchange.endswith("+bf16") else leaf
        return planner.PeakBound(
            {"params": LAYERS * leaf, "momentum": LAYERS * leaf, "residuals": kept * residual}
        )


def test_a_budget_below_every_bound_is_answered_without_compiling(peaks):
    compiler = BoundedCompiler()
    bounds = {c: compiler.peak_bound(c, 64).bytes for c in GRID}
    assert all(bounds[c] < peaks[c] for c in GRID)  # a lower bound of the compiled peak
    with pytest.raises(planner.BudgetError) as error:
        planner.fit(GRID, compiler, min(bounds.values()) - 1, batch_per_worker=64)
    assert compiler.compiled == []
    message = str(error.value)
    assert "\n" not in message and str(min(bounds.values())) in message
    assert "params 256.00 KiB + momentum 256.00 KiB + residuals 64.00 KiB" in message
    # A budget between the bounds rules out only the candidates above it.
    budget = sorted(set(bounds.values()))[1]
    with pytest.raises(planner.BudgetError) as error:
        planner.fit(GRID, compiler, budget, batch_per_worker=64)
    ruled_out = {r.candidate for r in error.value.rows if r.ruled_out}
    assert ruled_out == {c for c in GRID if bounds[c] > budget} != set()
    assert {c for c, _ in compiler.compiled} == set(GRID) - ruled_out
    assert f"({len(ruled_out)} ruled out without compiling)" in str(error.value)


# ------------------------------------------------------------------ the program's planner


def tiny_gpt():
    from tests.test_train import load_config

    c = load_config("byte_gpt")
    c.model.overrides = {"num_layers": 2, "width": 32, "num_heads": 2, "max_len": 16}
    c.dataset = {"name": "pydoc_text", "context_length": 16}
    c.num_workers = 4
    c.batch_size_per_worker = 4
    c.compression.min_size = 500
    # AdamW with EF: both optimizer versions (AdamW, AdamW-R) are candidates.
    c.optimizer.name = "adamw"
    c.optimizer.one_buffer, c.optimizer.frozen_nu_format = "off", "float32"  # cm's options
    c.compression.density_schedule.dense_fraction = 0.0
    c.compression.density_schedule.dense_dtype = ""  # a warm-up set below is float32
    return c


def test_compressed_momentum_adam_is_planned_at_its_compressed_phase():
    """byte_gpt's own recipe (compressed-momentum Adam after a dense warm-up): every exchange
    is a candidate with the one optimizer there is, and ResiReduce's stores hold the
    momentum residual in less memory than EF's."""
    from train import memory_plan

    config = tiny_gpt()
    config.optimizer.name = "compressed_momentum_adam"
    config.compression.density_schedule.dense_fraction = 0.05
    compiler = memory_plan.StepCompiler(config, seq_len=16, exchanges=("ef", "w+2d"))
    candidates = compiler.candidates()
    assert {(c.exchange, c.optimizer) for c in candidates} == {
        ("ef", "original"),
        ("w+2d", "original"),
    }
    ef = compiler.leanest(Candidate("ef", "original", "none"), 4)
    reduced = compiler.leanest(Candidate("w+2d", "original", "none"), 4)
    assert reduced.residual_bytes < ef.residual_bytes
    assert ef.peak_bytes > ef.residual_bytes > 0


class _SharedPrograms(planner.OnceMap):
    """A compiler's record of the steps it asked for (its ``compilations``), each program
    compiled once for two compilers of one config: a (candidate, batch, plan, phase)
    compiles to the same program whichever search asks for it."""

    def __init__(self, programs: planner.OnceMap):
        super().__init__()
        self._programs = programs

    def get(self, key, compute):
        return super().get(key, lambda: self._programs.get(key, compute))


@pytest.fixture(scope="module")
def gpt_compilers():
    """The same candidates searched exhaustively and with pruning (caches kept per module).

    The pruned compiler counts its own compilations and takes the programs (and the
    chains rotor measures) that the exhaustive one compiled already.
    """
    from train import memory_plan

    exhaustive, pruned = (
        memory_plan.StepCompiler(tiny_gpt(), seq_len=16, exchanges=("ef", "w+2d+bf16"), prune=p)
        for p in (False, True)
    )
    pruned._steps = _SharedPrograms(exhaustive._steps)
    pruned._chains = exhaustive._chains
    return exhaustive, pruned


def _same_program(a: Compiled, b: Compiled) -> bool:
    return (a.peak_bytes, a.flops, a.bytes_accessed, a.settings.get("remat_plan")) == (
        b.peak_bytes,
        b.flops,
        b.bytes_accessed,
        b.settings.get("remat_plan"),
    )


def test_the_pruned_fit_chooses_what_the_exhaustive_fit_chooses(gpt_compilers):
    exhaustive, pruned = gpt_compilers
    candidates = exhaustive.candidates()
    assert len(candidates) == 8
    plain = exhaustive.leanest(Candidate("ef", "original", "none"), 4).peak_bytes
    lean = exhaustive.leanest(Candidate("w+2d+bf16", "r", "rotor"), 4).peak_bytes
    assert lean < plain
    # Nothing to checkpoint; checkpoints for some candidates; nothing fits.
    budgets = [plain + 1, lean + (plain - lean) // 4, lean * 9 // 10]
    ruled_out = 0
    for budget in budgets:
        try:
            want = planner.fit(candidates, exhaustive, budget, batch_per_worker=4)
        except planner.BudgetError:
            with pytest.raises(planner.BudgetError):
                planner.fit(candidates, pruned, budget, batch_per_worker=4)
            continue
        got = planner.fit(candidates, pruned, budget, batch_per_worker=4)
        assert got.chosen.candidate == want.chosen.candidate, budget
        assert _same_program(got.chosen.compiled, want.chosen.compiled), budget
        for mine, theirs in zip(got.rows, want.rows, strict=True):
            if mine.ruled_out:  # never one that the exhaustive search found to fit
                assert not theirs.fits, (budget, mine.candidate, mine.ruled_out)
            else:
                assert mine.fits == theirs.fits, (budget, mine.candidate)
                if mine.fits:
                    assert _same_program(mine.compiled, theirs.compiled), (budget, mine)
                    overhead = theirs.compiled.flops_overhead
                    assert mine.compiled.flops_overhead == pytest.approx(overhead, abs=0.02)
        ruled_out += sum(bool(r.ruled_out) for r in got.rows)
    assert ruled_out and pruned.compilations <= exhaustive.compilations


def test_whole_model_topk_is_planned_without_comparing_exchanges():
    """compression.selection_scope='global' (whole-model Top-k, the SGD-momentum recipe's):
    its candidates are planned, and no exchange's peak is predicted from another's (a
    shared or 2-D store's members all wait for the joint selection, so a smaller residual
    need not mean a lower peak), so pruning rules out nothing the exhaustive search would
    choose. The rotor search itself is the per-leaf one
    (``test_the_pruned_fit_chooses_what_the_exhaustive_fit_chooses``)."""
    from train import config_schema, memory_plan

    config = tiny_gpt()
    config.optimizer.name = "compressed_momentum_sgd"
    config.optimizer.kwargs = {"momentum": 0.9}
    config.compression.selection_scope = "global"
    config.memory.budget = "1GiB"
    config_schema.validate(config)  # a budget with the global scope is a valid config
    exhaustive, pruned = (
        memory_plan.StepCompiler(config, seq_len=16, exchanges=("ef", "w+2d"), prune=p)
        for p in (False, True)
    )
    pruned._steps = _SharedPrograms(exhaustive._steps)
    pruned._chains = exhaustive._chains
    candidates = exhaustive.candidates()
    assert {(c.exchange, c.optimizer, c.remat) for c in candidates} == {
        (e, "original", r) for e in ("ef", "w+2d") for r in ("none", "rotor")
    }
    ef, reduced = (Candidate(e, "original", "none") for e in ("ef", "w+2d"))
    plain = pruned.leanest(ef, 4).peak_bytes
    assert pruned.predicted_peak(ef, 4).value == plain
    assert pruned.predicted_peak(reduced, 4) is None  # per leaf: EF's peak less the saving
    budget = plain + 1  # both fit unchecked: the faster one is chosen
    want = planner.fit(candidates, exhaustive, budget, batch_per_worker=4)
    got = planner.fit(candidates, pruned, budget, batch_per_worker=4)
    assert got.chosen.candidate == want.chosen.candidate
    assert _same_program(got.chosen.compiled, want.chosen.compiled)
    assert [r.fits for r in got.rows] == [r.fits for r in want.rows]
    assert pruned.compilations == exhaustive.compilations == 2


def test_the_pruned_batch_search_finds_the_exhaustive_batches():
    from tests.test_train import load_config
    from train import memory_plan

    config = load_config("default")  # the digits MLP: one program per batch
    config.num_workers = 2
    exhaustive, pruned = (
        memory_plan.StepCompiler(config, exchanges=("ef", "w+2d+bf16"), prune=prune)
        for prune in (False, True)
    )
    candidates = [Candidate("ef", "original"), Candidate("ef", "r"), Candidate("w+2d+bf16", "r")]
    budget = exhaustive.leanest(candidates[0], 40).peak_bytes
    kwargs = {"max_batch": 64, "start": 16}
    want = planner.largest_batch(candidates, exhaustive, budget, **kwargs)
    got = planner.largest_batch(candidates, pruned, budget, **kwargs)
    for mine, theirs in zip(got.searches, want.searches, strict=True):
        assert mine.batch == theirs.batch, (mine.candidate, mine.probes, mine.uncompiled)
        assert _same_program(mine.row.compiled, theirs.row.compiled)
    assert want.search(candidates[0]).batch == 40


def test_the_bound_is_what_the_step_holds_before_computing_and_below_its_peak(gpt_compilers):
    from train import compiled_step

    _, compiler = gpt_compilers
    for candidate in compiler.candidates():
        bound = compiler.peak_bound(candidate, 4)
        assert bound.bytes <= compiler.leanest(candidate, 4).peak_bytes
        if candidate.adaptive:
            continue  # the same arguments as its monolithic step
        step = compiled_step.compile_step(
            compiler.config_for(candidate), batch_per_worker=4, seq_len=16, num_workers=4
        )
        memory = step.compiled.memory_analysis()
        arguments = bound.bytes - bound.parts["smallest activation"]
        # Left out: the PRNG key and the scalars (counts, the guard's flags).
        assert 0 <= memory.argument_size_in_bytes - arguments <= 64
    assert bound.parts["smallest activation"] == 4 * 16 * 32 * 4  # a block's output


def test_analysis_compiles_have_the_optimized_programs_figures():
    from train import compiled_step

    abstract = compiled_step.abstract_step(tiny_gpt(), seq_len=16)
    # XLA's default level, explicit: this session's own default is 0 (tests/conftest.py).
    optimized = abstract.compile(compiler_options={"xla_backend_optimization_level": 3})
    fast = abstract.compile()
    assert hlo.peak_memory(fast.compiled) == hlo.peak_memory(optimized.compiled)
    costs = fast.compiled.cost_analysis(), optimized.compiled.cost_analysis()
    for key in ("flops", "bytes accessed"):
        assert costs[0][key] == costs[1][key]


_SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _without_source_locations(hlo_text: str) -> str:
    """HLO text without what names the Python frames that traced it (they differ between
    a test and a script): op metadata, stack frame ids and the tables they index."""
    lines = [
        line
        for line in hlo_text.splitlines()
        if line not in _SOURCE_TABLES and not re.match(r"\d+ ", line)
    ]
    return re.sub(r", (metadata=\{[^}]*\}|stack_frame_id=\d+)", "", "\n".join(lines))


def _figures_of_the_tiny_step() -> dict:
    """The compiled figures of :func:`tiny_gpt`'s step and a digest of its optimized HLO."""
    import hashlib

    from train import compiled_step

    compiled = compiled_step.abstract_step(tiny_gpt(), seq_len=16).compile().compiled
    memory, costs = compiled.memory_analysis(), compiled.cost_analysis()
    return {
        "peak": hlo.peak_memory(compiled).peak,
        "temp": memory.temp_size_in_bytes,
        "flops": costs["flops"],
        "bytes accessed": costs["bytes accessed"],
        "hlo": hashlib.sha256(_without_source_locations(compiled.as_text()).encode()).hexdigest(),
    }


def test_the_sessions_quick_codegen_leaves_the_optimized_program_alone():
    """tests/conftest.py and ``--plan_only`` turn off XLA:CPU's loop unrolling, SLP
    vectorizer and tiled emitter (``runtime.ANALYSIS_CODEGEN``): code generation only. A
    process without them compiles the same optimized HLO, with the same figures."""
    import subprocess
    import sys

    from resireduce_jax import runtime
    from train.local_job import program_env

    env = program_env(JAX_PLATFORMS="cpu")
    flags = env["XLA_FLAGS"].split()
    assert f"--xla_backend_extra_options={','.join(runtime.ANALYSIS_CODEGEN)}" in flags
    env["XLA_FLAGS"] = " ".join(f for f in flags if "xla_backend_extra_options" not in f)
    env.pop("JAX_COMPILATION_CACHE_DIR")  # compiled there, not loaded from the session's
    script = (
        "import json; from resireduce_jax import runtime; runtime.configure_cpu(8); "
        "from tests import test_planner; "
        "print(json.dumps(test_planner._figures_of_the_tiny_step()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == _figures_of_the_tiny_step()


def test_an_impossible_budget_is_one_line_from_shapes(tmp_path):
    result = run_cli(
        "--config=configs/byte_gpt.py",
        f"--workdir={tmp_path / 'plan'}",
        "--config.memory.budget=1MiB",
        "--plan_only",
        timeout=300,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: memory.budget='1MiB'"), lines
    assert "params" in lines[0] and "optimizer state" in lines[0] and "nothing compiled" in lines[0]


# ------------------------------------------------------------------ density phases


class PhasedCompiler:
    """``compile_fn`` for a run of two programs: a warm-up that keeps every residual in
    float32 (EF's program, the same optimizer) before the candidate's own, the last."""

    def __init__(self):
        self.compiled = []

    def leanest(self, candidate, batch):
        self.compiled.append((candidate, batch, "last"))
        return compile_fn(candidate, batch)

    def fastest_fitting(self, candidate, batch, budget_bytes):
        compiled = self.leanest(candidate, batch)
        if compiled.peak_bytes > budget_bytes:
            return compiled
        return self.over_phases(candidate, batch, compiled)

    def over_phases(self, candidate, batch, compiled):
        self.compiled.append((candidate, batch, "warm-up"))
        warm_up = compile_fn(Candidate("ef", candidate.optimizer), batch)
        peaks = [("0 warm-up", warm_up.peak_bytes), ("1 last", compiled.peak_bytes)]
        return compiled.with_phases(peaks, [warm_up])


def test_largest_batch_fits_every_phase_and_compiles_warm_ups_only_where_the_last_fits():
    max_batch = 24
    candidate = Candidate("w+2d+bf16", "r")
    warm_up = Candidate("ef", "r")
    last_peak = {b: compile_fn(candidate, b).peak_bytes for b in range(1, max_batch + 1)}
    warm_peak = {b: compile_fn(warm_up, b).peak_bytes for b in range(1, max_batch + 1)}
    # A budget where the last phase alone would allow a larger batch than both phases.
    budget = (last_peak[16] + warm_peak[16]) // 2
    by_last = max(b for b, p in last_peak.items() if p <= budget)
    both = max(b for b in last_peak if max(last_peak[b], warm_peak[b]) <= budget)
    assert both < by_last
    compiler = PhasedCompiler()
    cache = planner.CachedCompiler(compiler)
    found = planner.largest_batch([candidate], cache, budget, max_batch=max_batch, start=8)
    search = found.searches[0]
    assert search.batch == both, search.probes
    assert search.row.fits and search.row.compiled.peak_bytes <= budget
    assert search.row.compiled.peak_bytes == max(last_peak[both], warm_peak[both])
    for _, b, phase in compiler.compiled:
        if phase == "warm-up":  # only where the last phase fits
            assert last_peak[b] <= budget, (b, search.probes)
    # A second budget reuses the compiled phases as its bracket.
    again = planner.largest_batch([candidate], cache, budget, max_batch=max_batch)
    assert again.searches[0].batch == both


class TwoPhaseFigures:
    """Hand-written figures of two-phase runs, per candidate: ``(last phase's peak, warm-up's
    peak, FLOPs)`` (the step-time estimate ranks by FLOPs)."""

    def __init__(self, figures):
        self.figures = figures
        self.compiled = []

    def leanest(self, candidate, batch):
        self.compiled.append((candidate, "last"))
        last, _, flops = self.figures[candidate]
        return Compiled(last, flops=flops, peak_phase="1 last", phase_peaks=(("1 last", last),))

    def fastest_fitting(self, candidate, batch, budget_bytes, every_phase=True):
        compiled = self.leanest(candidate, batch)
        if compiled.peak_bytes > budget_bytes or not every_phase:
            return compiled
        return self.over_phases(candidate, batch, compiled)

    def over_phases(self, candidate, batch, compiled):
        self.compiled.append((candidate, "warm-up"))
        warm = self.figures[candidate][1]
        return compiled.with_phases([("0 warm-up", warm), ("1 last", compiled.peak_bytes)], [])


def test_fit_compiles_the_warm_ups_of_the_fastest_candidates_only():
    """Judged by their last phase, then the fastest checked over every phase until one
    fits: the choice is the exhaustive one's, and the slower rows keep their last phase."""
    fast, mid, slow, big = (Candidate(e, "r") for e in ("ef", "w+2d", "w+2d+bf16", "dense"))
    figures = {  # budget 100: `fast` fits by its last phase only, `big` not even by that
        fast: (90, 120, 1e9),
        mid: (95, 99, 2e9),
        slow: (80, 150, 3e9),
        big: (130, 90, 0.5e9),
    }
    budget = 100
    compiler = TwoPhaseFigures(figures)
    result = planner.fit(list(figures), compiler, budget, batch_per_worker=1)
    exhaustive = min(
        (c for c, (last, warm, _) in figures.items() if max(last, warm) <= budget),
        key=lambda c: figures[c][2],
    )
    assert result.chosen.candidate == exhaustive == mid
    assert result.chosen.compiled.peak_bytes == 99 and result.chosen.fits
    assert sorted(c.exchange for c, phase in compiler.compiled if phase == "warm-up") == [
        "ef",
        "w+2d",
    ]
    rows = {r.candidate: r for r in result.rows}
    assert not rows[fast].fits and rows[fast].compiled.peak_phase == "0 warm-up"
    assert rows[slow].fits and rows[slow].as_dict()["fits_judged_by"] == "last phase"
    assert not rows[big].fits and rows[big].compiled.peak_bytes == 130
    table = result.table().splitlines()
    assert re.search(r"1 last +last ", next(line for line in table if " w+2d+bf16 " in line))
    # A budget nothing fits in every phase: the error, after checking each fast candidate.
    with pytest.raises(planner.BudgetError):
        planner.fit(list(figures), TwoPhaseFigures(figures), 98, batch_per_worker=1)


@functools.cache
def _phased_gpt():
    """A reduced GPT-2 (width 128, batch 1) whose dense warm-up program peaks above its
    top-k phase for ResiReduce (its warm-up sends every gradient densely)."""
    c = tiny_gpt()
    c.model.overrides = {"num_layers": 2, "width": 128, "num_heads": 2, "max_len": 16}
    c.batch_size_per_worker = 1
    c.compression.density_schedule.dense_fraction = 0.05
    return c


def test_a_warm_up_phase_over_the_budget_rules_its_candidate_out():
    """The planner judges a candidate by its peak over the density phases: compared with
    each phase compiled directly (``compiled_step``), one per candidate."""
    from train import compiled_step, factory, memory_plan

    config = _phased_gpt()
    compiler = memory_plan.StepCompiler(
        config, seq_len=16, exchanges=("ef", "w+2d+bf16"), prune=False
    )
    candidates = [Candidate("ef", "original"), Candidate("ef", "r"), Candidate("w+2d+bf16", "r")]
    phases = factory.density_phases(config, 1000)
    assert len(phases) == 2 == len(compiler.phase_names(candidates[0]))
    peaks, arguments = {}, {}
    for c in candidates:
        steps = [
            compiled_step.compile_step(
                compiler.config_for(c), batch_per_worker=1, seq_len=16, density_phase=i
            ).compiled
            for i in range(len(phases))
        ]
        peaks[c] = [hlo.peak_memory(s).peak for s in steps]
        arguments[c] = {s.memory_analysis().argument_size_in_bytes for s in steps}
    # Every phase takes the same arguments: the lower bound holds for each.
    assert all(len(a) == 1 for a in arguments.values())
    warm, last = peaks[candidates[2]]
    assert warm > last  # ResiReduce's dense warm-up peaks above its compressed phase
    # The budget: the smallest peak over both phases. w+2d+bf16 / r fits in its last phase
    # but not in its warm-up.
    budget = min(max(p) for p in peaks.values())
    assert last <= budget < warm
    # Alone, it fits by its last phase, and its warm-up (compiled to check) rules it out.
    cache = planner.CachedCompiler(compiler)
    with pytest.raises(planner.BudgetError, match="density phase 0 dense"):
        planner.fit(candidates[2:], cache, budget, batch_per_worker=1)
    assert compiler.compilations == 2
    result = planner.fit(candidates, cache, budget, batch_per_worker=1)
    fitting = {c for c in candidates if max(peaks[c]) <= budget}
    assert result.chosen.candidate in fitting and candidates[2] not in fitting
    assert result.chosen.compiled.all_phases
    assert result.chosen.compiled.peak_bytes == max(peaks[result.chosen.candidate])
    rows = {r.candidate: r for r in result.rows}
    for c in candidates:
        row = rows[c]
        if peaks[c][-1] > budget:  # its last phase does not fit: nothing more compiled
            expected = peaks[c][-1]
            assert not row.fits, c
        elif row.compiled.all_phases:  # compiled over every phase
            expected = max(peaks[c])
            assert row.fits == (max(peaks[c]) <= budget), c
        else:  # judged by its last phase: slower than the choice, its warm-up unchecked
            expected = peaks[c][-1]
            assert row.fits and row.step_seconds >= result.chosen.step_seconds, c
            assert row.as_dict()["fits_judged_by"] == "last phase"
        assert row.compiled.peak_bytes == expected, c
    row = rows[candidates[2]]
    assert not row.fits and row.compiled.peak_phase == "0 dense"
    assert row.compiled.phase_peaks == (("0 dense", warm), ("1 topk 1%", last))
    assert "peak phase" in result.table() and "0 dense" in result.table()
    assert result.as_dict()["candidates"][2]["peak_phase"] == "0 dense"
    # The warm-ups compiled only where the last phase fits: ef / original's does not; the
    # chosen candidate's and the one checked alone.
    assert peaks[candidates[0]][-1] > budget
    assert compiler.compilations == 2 + 1 + 2
    assert [r["density_phase"] for r in compiler.records()].count(0) == 2
    # Between its two phases alone: nothing fits, and the error names the warm-up.
    with pytest.raises(planner.BudgetError, match="density phase 0 dense"):
        planner.fit(candidates[2:], compiler, warm - 1, batch_per_worker=1)
    assert compiler.compilations == 5  # both of its phases were compiled already


def test_a_run_without_a_schedule_compiles_each_candidate_once():
    from train import memory_plan

    compiler = memory_plan.StepCompiler(tiny_gpt(), seq_len=16, exchanges=("ef",), prune=False)
    candidates = [Candidate("ef", "original"), Candidate("ef", "r")]
    assert compiler.phase_names(candidates[0]) == ("0 topk 1%",)
    result = planner.fit(candidates, compiler, 10 * GiB, batch_per_worker=4)
    assert compiler.compilations == len(candidates)
    assert all(r["density_phase"] is None for r in compiler.records())
    assert all(not r.compiled.peak_phase and not r.compiled.phase_peaks for r in result.rows)
    assert "peak phase" not in result.table()


def test_phase_names_tell_a_16_bit_warm_up_apart():
    import resireduce_jax as rr
    from train import memory_plan

    cast = rr.compressors.Cast("bfloat16", feedback=False)
    assert memory_plan.phase_name(0, rr.compressors.none()) == "0 dense"
    assert memory_plan.phase_name(0, cast) == "0 dense bfloat16"
    assert memory_plan.phase_name(1, rr.compressors.topk(0.01)) == "1 topk 1%"
    assert memory_plan.phase_name(0, rr.compressors.bf16()) == "0 cast"  # feeds back: not dense


@pytest.mark.parametrize(
    ("configured", "exchange", "planned"),
    [
        ("int4/128/nearest", "ef+int4", "int4/128/nearest"),  # the byte GPT config's
        ("int4/64/stochastic", "w+2d+int4", "int4/64/stochastic"),
        ("int4/128/nearest", "ef+int4/128/stochastic", "int4/128/stochastic"),  # named
        ("int8/256/stochastic", "ef+int4", "int4"),  # other codes: the exchange's defaults
        ("", "ef+int8", "int8"),
        ("int4/128/nearest", "ef", ""),
    ],
)
def test_an_exchange_keeps_the_configs_block_size_and_rounding_for_its_codes(
    configured, exchange, planned
):
    """The planner trains ``ef+int4`` in the rounding the config chose for its int4
    residuals (the shipped byte GPT config's nearest), not in int4's default one."""
    from train import memory_plan

    config = tiny_gpt()
    with config.unlocked():
        config.compression.variant = "ef"
        config.compression.residual_format = configured
    compiler = memory_plan.StepCompiler(config, seq_len=16, exchanges=(exchange,))
    (candidate, *_) = compiler.candidates()
    assert candidate.exchange == exchange
    assert compiler.config_for(candidate).compression.residual_format == planned
