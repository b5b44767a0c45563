"""Density schedules: hand-derived phases, numpy error feedback phase by phase, HLO bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from resireduce_jax import hlo
from resireduce_jax.compressors import schedule
from tests import transform_harness as th

W = 8
SHAPES = {"w1": (40, 60), "w2": (60, 30), "b": (60,)}
MIN_SIZE = 1000
COMPRESSED = ("w1", "w2")


def test_dgc_warmup_divides_the_density_by_four_per_stage_down_to_the_target():
    # DGC §3.4: sparsity 75 % -> 93.75 % -> 98.4375 % -> ..., i.e. density 1/4, 1/16, 1/64.
    s = rr.compressors.dgc_warmup(0.01, 10)
    assert s.starts == (0, 10, 20, 30)
    assert s.densities == (0.25, 0.0625, 0.015625, 0.01)
    s = rr.compressors.dgc_warmup(0.001, 5, dense_steps=7)
    assert s.starts == (0, 7, 12, 17, 22, 27)
    assert s.densities == (1.0, 0.25, 0.0625, 0.015625, 0.00390625, 0.001)


def test_dense_warmup_and_piecewise_and_lookup():
    s = rr.compressors.dense_warmup(100, 0.01)
    assert (s.starts, s.densities) == ((0, 100), (1.0, 0.01))
    assert [s.at(t) for t in (0, 99, 100, 10_000)] == [1.0, 1.0, 0.01, 0.01]
    assert s.steps_per_phase(250) == (100, 150)
    assert s.steps_per_phase(40) == (40, 0)
    assert rr.compressors.piecewise({300: 0.01, 0: 0.1}).starts == (0, 300)
    assert rr.compressors.dense_warmup(0, 0.01) == schedule.constant(0.01)


@pytest.mark.parametrize(
    "starts, densities, match",
    [
        ((5, 10), (1.0, 0.1), "begin at step 0"),
        ((0, 10, 10), (1.0, 0.1, 0.01), "increase strictly"),
        ((0, 10), (1.0,), "one density per phase"),
        ((0, 10), (1.0, 0.0), r"in \(0, 1\]"),
        ((0, 10), (1.5, 0.1), r"in \(0, 1\]"),
        ((0, 2.5), (1.0, 0.1), "must be ints"),
    ],
)
def test_bad_schedules_are_refused(starts, densities, match):
    with pytest.raises(ValueError, match=match):
        rr.compressors.DensitySchedule(starts, densities)


def test_dgc_factor_must_shrink_the_density():
    with pytest.raises(ValueError, match="factor must be > 1"):
        rr.compressors.dgc_warmup(0.01, 10, factor=1.0)


def test_every_sparsifier_takes_a_schedule_and_refuses_to_compress_with_it():
    sched = rr.compressors.dense_warmup(3, 0.05)
    for c in (
        rr.compressors.topk(sched),
        rr.compressors.fast_topk(sched),
        rr.compressors.randomk(sched),
        rr.compressors.threshold(0.1, sched),
        rr.compressors.dgc(sched),
    ):
        found = schedule.phases(c)
        assert [p.start for p in found] == [0, 3]
        assert isinstance(found[0].compressor, rr.compressors.NoCompression)
        assert getattr(found[1].compressor, c.density_field) == 0.05
        with pytest.raises(ValueError, match="is a schedule"):
            c.k(100)


def test_bytes_sent_counts_every_phase_at_its_own_size():
    c = rr.compressors.topk(rr.compressors.dense_warmup(3, 0.05))
    # 3 dense steps of 2400 float32, then 7 steps of k = 120 values + int32 indices.
    assert schedule.bytes_sent(c, (40, 60), np.float32, 10) == 3 * 2400 * 4 + 7 * 120 * 8
    assert schedule.bytes_sent(c, (40, 60), np.float32, 2) == 2 * 2400 * 4


def test_exchange_bytes_sent_adds_dense_leaves_and_hierarchical_shards():
    c = rr.compressors.topk(rr.compressors.dense_warmup(3, 0.05))
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    tx = rr.error_feedback(c, min_size=MIN_SIZE)
    per_step_dense = 60 * 4  # "b" travels dense
    expected = sum(schedule.bytes_sent(c, SHAPES[k], np.float32, 10) for k in COMPRESSED)
    assert tx.bytes_sent(params, 10) == expected + 10 * per_step_dense
    assert rr.exchange.dense_bytes(params) == 4 * (2400 + 1800 + 60)
    # Hierarchical, 4 devices per node: each device sends its shard's payload across nodes.
    hier = rr.error_feedback(c, min_size=MIN_SIZE, local_axis="local")
    shard_bytes = sum(
        schedule.bytes_sent(c, (s[0] // 4, s[1]), np.float32, 10)
        for k, s in SHAPES.items()
        if k in COMPRESSED
    )
    assert hier.bytes_sent(params, 10, local_size=4) == shard_bytes + 10 * per_step_dense


def np_scheduled_error_feedback(grads_per_step, density_at):
    """Numpy EF with a per-step density; density 1 sends everything (a dense all-reduce)."""
    residual = {k: np.zeros((W, *SHAPES[k]), np.float32) for k in COMPRESSED}
    outputs = []
    for t, grads in enumerate(grads_per_step):
        out = {}
        for name, g in grads.items():
            if name not in COMPRESSED:
                out[name] = g.astype(np.float64).mean(0)
                continue
            comp = g + residual[name]
            if density_at(t) == 1.0:
                sent = comp
            else:
                sent = np.stack([th.np_topk_sparsify(comp[w], density_at(t)) for w in range(W)])
            residual[name] = comp - sent
            out[name] = sent.astype(np.float64).mean(0)
        outputs.append(out)
    return outputs, residual


@pytest.mark.parametrize("variant", ["ef", "w+2d"])
def test_scheduled_error_feedback_matches_numpy_phase_by_phase(variant):
    sched = rr.compressors.piecewise({0: 1.0, 2: 0.25, 4: 0.02})
    grads = th.random_grads(np.random.default_rng(3), SHAPES, W, steps=6)
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    if variant == "ef":
        tx = rr.error_feedback(rr.compressors.topk(sched), min_size=MIN_SIZE)
        outputs, state = th.run_shard_map(tx, params, grads)
        ref_outputs, ref_residual = np_scheduled_error_feedback(grads, sched.at)
        for out, ref in zip(outputs, ref_outputs, strict=True):
            for name in SHAPES:
                np.testing.assert_allclose(out[name][0], ref[name], rtol=1e-6, atol=1e-6)
        for name in COMPRESSED:
            np.testing.assert_array_equal(state.residuals[name], ref_residual[name])
        return
    # ResiReduce: the scheduled transform equals, step by step, the constant-density
    # transform of each phase started from the scheduled one's state (the dense phase
    # leaves every store at zero).
    options = dict(min_size=MIN_SIZE, grouping=rr.grouping.auto(), inter="weighted", intra="2d",
                   intra_layers="w1")  # fmt: skip
    tx = rr.resireduce(rr.compressors.topk(sched), **options)
    outputs, state = th.run_shard_map(tx, params, grads)
    zeros = jax.tree.map(np.zeros_like, state.residuals)
    for t in (0, 1):  # dense: exact means, nothing kept
        for name in SHAPES:
            np.testing.assert_allclose(
                outputs[t][name][0], grads[t][name].mean(0), rtol=1e-6, atol=1e-6
            )
    _, dense_state = th.run_shard_map(tx, params, grads[:2])
    for a, b in zip(jax.tree.leaves(dense_state.residuals), jax.tree.leaves(zeros), strict=True):
        if np.issubdtype(a.dtype, np.floating):
            np.testing.assert_array_equal(a, b)
    const = rr.resireduce(rr.compressors.topk(0.25), **options)
    ref_outputs, ref_state = th.run_shard_map(const, params, grads[2:4])
    for t in (2, 3):
        for name in SHAPES:
            np.testing.assert_array_equal(outputs[t][name], ref_outputs[t - 2][name])
    _, four = th.run_shard_map(tx, params, grads[:4])
    for a, b in zip(
        jax.tree.leaves(four.residuals), jax.tree.leaves(ref_state.residuals), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def _compiled_exchange(tx, params):
    mesh = th.mesh(W)
    specs = rr.parallel.state_partition_specs(tx, params, mesh, th.AXIS)

    def step(p, s, g):
        s = rr.parallel.unstack_per_worker(s, specs)
        out, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return out, rr.parallel.stack_per_worker(s, specs)

    init = jax.shard_map(
        lambda p: rr.parallel.stack_per_worker(tx.init(p), specs),
        mesh=mesh,
        in_specs=P(),
        out_specs=specs,
    )
    state = jax.eval_shape(init, params)
    grads = {
        k: jax.ShapeDtypeStruct((W, *s), np.float32, sharding=NamedSharding(mesh, P(th.AXIS)))
        for k, s in SHAPES.items()
    }
    fn = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(th.AXIS)), out_specs=(P(), specs))
    )
    return fn.lower(params, state, grads).compile()


def test_each_phase_moves_exactly_its_payload_bytes_in_the_compiled_program():
    sched = rr.compressors.dgc_warmup(0.01, 5, dense_steps=3)  # dense, 1/4, 1/16, 1/64, 1 %
    compressor = rr.compressors.topk(sched)
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    compiled = _compiled_exchange(rr.error_feedback(compressor, min_size=MIN_SIZE), params)
    conditionals = hlo.branch_collectives(compiled)
    assert len(conditionals) == len(COMPRESSED)  # one switch per compressed leaf
    phases = schedule.phases(compressor)
    for j, phase in enumerate(phases):
        expected = sum(phase.compressor.payload_bytes(SHAPES[k], np.float32) for k in COMPRESSED)
        moved = sum(c.bytes_per_worker for cond in conditionals for c in cond[j])
        assert moved == expected, (j, phase)
    # The dense phase all-reduces; the others all-gather values and indices.
    assert {c.op for cond in conditionals for c in cond[0]} == {"all-reduce"}
    assert {c.op for cond in conditionals for c in cond[-1]} == {"all-gather"}


def test_a_constant_density_compiles_no_conditional():
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    compiled = _compiled_exchange(
        rr.error_feedback(rr.compressors.topk(0.01), min_size=MIN_SIZE), params
    )
    assert hlo.branch_collectives(compiled) == []


def test_dgc_memory_runs_a_sparse_schedule_and_refuses_a_dense_phase():
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    grads = th.random_grads(np.random.default_rng(5), SHAPES, W, steps=3)
    sched = rr.compressors.piecewise({0: 0.25, 2: 0.02})
    tx = rr.dgc_memory(rr.compressors.topk(sched), 0.9, min_size=MIN_SIZE)
    outputs, _ = th.run_shard_map(tx, params, grads)
    # Step 0: u = v = g, a quarter of each worker's entries sent.
    for name in COMPRESSED:
        n = int(np.prod(SHAPES[name]))
        sent = np.stack([th.np_topk_sparsify(grads[0][name][w], 0.25) for w in range(W)])
        np.testing.assert_allclose(outputs[0][name][0], sent.mean(0), rtol=1e-6, atol=1e-7)
        assert np.count_nonzero(sent[0]) == n // 4
    with pytest.raises(ValueError, match="density 1"):
        rr.dgc_memory(rr.compressors.topk(rr.compressors.dense_warmup(5, 0.01)))


def test_phased_compressors_run_a_dense_start_before_any_compressor():
    c = schedule.with_dense_start(2, rr.compressors.onebit())
    assert [p.start for p in schedule.phases(c)] == [0, 2]
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    grads = th.random_grads(np.random.default_rng(7), SHAPES, W, steps=3)
    outputs, _ = th.run_shard_map(rr.error_feedback(c, min_size=MIN_SIZE), params, grads)
    ref, _ = th.run_shard_map(
        rr.error_feedback(rr.compressors.onebit(), min_size=MIN_SIZE), params, grads[2:]
    )
    for name in SHAPES:  # dense steps: exact means; then 1-bit from a zero residual
        np.testing.assert_allclose(outputs[1][name][0], grads[1][name].mean(0), rtol=1e-6)
        np.testing.assert_array_equal(outputs[2][name], ref[0][name])
    with pytest.raises(ValueError, match="compressor"):
        schedule.Phased(((0, "topk"),))


@pytest.mark.parametrize("variant", ["ef", "w"])
def test_a_dense_start_keeps_powersgd_state_apart_until_powersgd_runs(variant):
    """PowerSGD keeps ``Q`` and a dense phase keeps nothing: each phase holds its own
    state in one program (``PhaseStates``), and the compressed phase equals PowerSGD run
    alone from its first step (fresh ``Q``, zero residual), step for step."""
    rank = 2
    options = {"min_size": MIN_SIZE}
    if variant == "w":  # w1 and w2 differ in shape: each is its own store; a shared one too
        shapes = {"w1": (40, 60), "w2": (40, 60), "b": (60,)}
        options |= {"grouping": rr.grouping.auto(), "inter": "weighted"}
        build = rr.resireduce
    else:
        shapes = SHAPES
        build = rr.error_feedback
    params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    grads = th.random_grads(np.random.default_rng(8), shapes, W, steps=4)
    phased = build(schedule.with_dense_start(2, rr.compressors.powersgd(rank)), **options)
    alone = build(rr.compressors.powersgd(rank), **options)
    outputs, state = th.run_shard_map(phased, params, grads)
    ref, ref_state = th.run_shard_map(alone, params, grads[2:])
    for name in shapes:
        for t in (0, 1):  # dense: exact means
            np.testing.assert_allclose(
                outputs[t][name][0], grads[t][name].mean(0), rtol=1e-6, atol=1e-6
            )
        for t in (2, 3):
            np.testing.assert_array_equal(outputs[t][name], ref[t - 2][name])
    for name in ("w1", "w2"):
        kept = state.compressor_state[name]
        assert isinstance(kept, rr.exchange.PhaseStates), kept
        assert kept.phases[0] == ()  # the dense phase's
        np.testing.assert_array_equal(kept.phases[1], ref_state.compressor_state[name])
    for a, b in zip(
        jax.tree.leaves(state.residuals), jax.tree.leaves(ref_state.residuals), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    # A schedule of one compressor keeps one state: the sparsifiers' ().
    sparse = build(rr.compressors.topk(rr.compressors.dense_warmup(2, 0.1)), **options)
    kept = jax.eval_shape(sparse.init, params).compressor_state["w1"]
    assert type(kept) is tuple and kept == ()


@pytest.mark.parametrize("dense_dtype", [None, "bfloat16"])
def test_resuming_mid_schedule_is_bit_identical(dense_dtype):
    """The phase comes from the exchange's step count, which the state carries: running
    3 steps and then 3 more from the saved state equals 6 steps at once. ``bfloat16``: the
    dense phase is a 16-bit all-reduce and the run resumes inside it (step 3 of 4)."""
    if dense_dtype is None:
        compressor = rr.compressors.topk(rr.compressors.piecewise({0: 1.0, 2: 0.25, 4: 0.02}))
    else:
        compressor = schedule.with_dense_dtype(
            rr.compressors.topk(rr.compressors.piecewise({0: 1.0, 4: 0.02})), dense_dtype
        )
    tx = optax.chain(rr.error_feedback(compressor, min_size=MIN_SIZE), optax.sgd(0.1))
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    grads = th.random_grads(np.random.default_rng(9), SHAPES, W, steps=6)
    whole, state = th.run_shard_map(tx, params, grads)
    exchange_state = state[0]
    np.testing.assert_array_equal(exchange_state.count, np.full(W, 6))
    # A state saved after step 3 and restored: feed steps 3..5 to a fresh run continued
    # from it (run_shard_map restarts from init, so rebuild the run from the saved state).
    _, mid = th.run_shard_map(tx, params, grads[:3])
    mesh = th.mesh(W)
    specs = rr.parallel.state_partition_specs(tx, params, mesh, th.AXIS)

    def step(p, s, g):
        s = rr.parallel.unstack_per_worker(s, specs)
        out, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return jax.tree.map(lambda x: x[None], out), rr.parallel.stack_per_worker(s, specs)

    fn = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), specs, P(th.AXIS)), out_specs=(P(th.AXIS), specs)
        )
    )
    restored = jax.tree.map(
        lambda x, spec: x if spec != P() else x[0], mid, specs
    )  # replicated leaves back to one copy
    restored = jax.device_put(restored, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs))
    for t in range(3, 6):
        g = jax.device_put(grads[t], NamedSharding(mesh, P(th.AXIS)))
        out, restored = fn(rr.parallel.replicated(params, mesh), restored, g)
        for name in SHAPES:
            np.testing.assert_array_equal(np.asarray(out[name]), whole[t][name])


@pytest.mark.parametrize("scope", ["leaf", "global"])
def test_one_program_per_phase_trains_exactly_as_the_switching_program(scope):
    """DataParallelStep(density_phase=j) compiles phase j alone; stepping each phase's
    program in its steps gives the switching program's parameters (to float32 rounding:
    XLA fuses a branch of a conditional apart from the code around it). ``global``: plain
    EF with whole-model Top-k."""
    sched = rr.compressors.piecewise({0: 1.0, 2: 0.25, 4: 0.02})
    rng = np.random.default_rng(12)
    params = {
        "w1": rng.normal(0, 0.1, (40, 60)).astype(np.float32),
        "w2": rng.normal(0, 0.1, (60, 30)).astype(np.float32),
    }
    batches = [
        {"x": rng.normal(size=(W * 4, 40)).astype(np.float32),
         "y": rng.normal(size=(W * 4, 30)).astype(np.float32)}
        for _ in range(6)
    ]  # fmt: skip

    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    found = schedule.phases(rr.compressors.topk(sched))

    def train(static):
        if scope == "global":
            exchange = rr.error_feedback(
                rr.compressors.topk(sched), min_size=MIN_SIZE, selection_scope="global"
            )
        else:
            exchange = rr.resireduce(
                rr.compressors.topk(sched),
                min_size=MIN_SIZE,
                grouping=rr.grouping.auto(),
                inter="weighted",
            )
        tx = rr.skip_nonfinite(rr.compressed_momentum_adam(1e-2, exchange))
        mesh = th.mesh(W)
        step = rr.parallel.data_parallel_step(loss, tx, mesh)
        p, s = step.init(jax.tree.map(np.copy, params))
        for t, b in enumerate(batches):
            phase = schedule.phase_at(found, t) if static else None
            p, s, _ = step(p, s, rr.parallel.shard_batch(b, mesh), density_phase=phase)
        return jax.device_get(p), len(step._steps)

    switched, programs = train(static=False)
    per_phase, static_programs = train(static=True)
    assert (programs, static_programs) == (1, 3)
    for k in params:
        np.testing.assert_allclose(per_phase[k], switched[k], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="density_phase=3"):
        schedule.static_phase(found, 3)


def _mlp_task(width: int, rng: np.random.Generator, steps: int):
    """An input layer and three same-shape hidden layers (a shared group of three), with
    ``steps`` batches; the input layer is ResiReduce-2d's singleton."""
    params = {"in": rng.normal(0, 0.1, (32, width)).astype(np.float32)}
    params |= {f"h{i}": rng.normal(0, 0.1, (width, width)).astype(np.float32) for i in range(3)}
    batches = [
        {"x": rng.normal(size=(W * 4, 32)).astype(np.float32),
         "y": rng.normal(size=(W * 4, width)).astype(np.float32)}
        for _ in range(steps)
    ]  # fmt: skip

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["in"])
        for i in range(3):
            h = jnp.tanh(h @ p[f"h{i}"])
        return jnp.mean((h - b["y"]) ** 2)

    return params, batches, loss


def _w2d(compressor, selection_scope="leaf"):
    return rr.resireduce(
        compressor,
        min_size=MIN_SIZE,
        grouping=rr.grouping.regex({r"h\d": "hidden"}),
        inter="weighted",
        intra="2d",
        intra_layers="^in$",
        selection_scope=selection_scope,
    )


@pytest.mark.parametrize("scope", ["leaf", "global"])
def test_a_leading_dense_phase_keeps_shared_and_2d_stores_at_zero_exactly(scope):
    """Through a dense warm-up the w+2d stores hold zeros, so the phase's own program sends
    the gradients uncompensated; it trains as the switching program does (to float32
    rounding), a skipped (NaN) step in the warm-up included, and leaves the stores zero.
    ``global``: the same under whole-model Top-k."""
    sched = rr.compressors.dense_warmup(3, 0.05)
    params, batches, loss = _mlp_task(48, np.random.default_rng(3), steps=6)
    batches[1]["x"][0, 0] = np.nan  # a skipped step inside the dense phase
    found = schedule.phases(rr.compressors.topk(sched))

    def train(static):
        exchange = _w2d(rr.compressors.topk(sched), scope)
        tx = rr.skip_nonfinite(optax.chain(exchange, optax.adam(1e-2)))
        mesh = th.mesh(W)
        step = rr.parallel.data_parallel_step(loss, tx, mesh)
        p, s = step.init(jax.tree.map(np.copy, params))
        residuals = []
        for t, b in enumerate(batches):
            # The schedule runs on the exchange's count: a skipped step does not advance it.
            phase = schedule.phase_at(found, t - int(s.skipped)) if static else None
            p, s, _ = step(p, s, rr.parallel.shard_batch(b, mesh), density_phase=phase)
            residuals.append(jax.device_get(s.inner[0].residuals))
        return jax.device_get(p), residuals, int(s.skipped)

    switched, switched_res, skipped = train(static=False)
    per_phase, per_phase_res, _ = train(static=True)
    assert skipped == 1
    labels = set(per_phase_res[0])
    assert {"hidden"} <= labels and len(labels) >= 2  # a shared group and the 2-D store

    def values(residual):  # a 2-D store also keeps its rows' and columns' indices
        return [x for x in jax.tree.leaves(residual) if np.issubdtype(x.dtype, np.floating)]

    for t in range(4):  # the warm-up (3 exchanges and the skip): every store zero
        for label in labels:
            assert not any(np.any(x) for x in values(per_phase_res[t][label])), (t, label)
    for label in labels:  # compressing now: every store holds a residual
        assert all(np.any(x) for x in values(per_phase_res[-1][label])), label
    for k in params:
        np.testing.assert_allclose(per_phase[k], switched[k], rtol=1e-5, atol=1e-7)
    for label in labels:
        for a, b in zip(
            jax.tree.leaves(per_phase_res[-1][label]),
            jax.tree.leaves(switched_res[-1][label]),
            strict=True,
        ):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_dense_warmup_program_costs_w2d_no_more_than_ef_at_the_compiled_peak():
    """The warm-up's program neither compensates nor rebuilds the shared and 2-D stores:
    on this MLP w+2d's dense phase then peaks no higher than error feedback's (compensating
    and rebuilding the stores' zeros would put it above). On GPT-2 medium width it stays above
    (benchmarks/results/density_schedule.md: the gradients are temporaries there, where
    EF's residual buffers take them in place)."""
    sched = rr.compressors.dense_warmup(3, 0.01)
    params, batches, loss = _mlp_task(512, np.random.default_rng(4), steps=1)
    mesh = th.mesh(W)

    def dense_phase_peak(exchange):
        tx = rr.skip_nonfinite(optax.chain(exchange, optax.adam(1e-3)))
        batch = rr.parallel.shard_batch(batches[0], mesh)
        return th.step_memory(loss, tx, jax.tree.map(np.copy, params), batch, mesh, density_phase=0)

    ef = dense_phase_peak(rr.error_feedback(rr.compressors.topk(sched), min_size=MIN_SIZE))
    w2d = dense_phase_peak(_w2d(rr.compressors.topk(sched)))
    assert w2d.argument < ef.argument  # the smaller residual state
    assert w2d.peak <= ef.peak, (w2d, ef)


def test_a_16_bit_dense_phase_sends_half_the_bytes_rounded_and_keeps_no_residual():
    """``with_dense_dtype``: the warm-up all-reduces bfloat16 (half the float32 bytes, in the
    compiled program too), its means are bfloat16 values, and it leaves every store zero
    (its rounding is dropped, as a 16-bit all-reduce does); Top-k then runs as before."""
    compressor = schedule.with_dense_dtype(
        rr.compressors.topk(rr.compressors.dense_warmup(3, 0.05)), "bfloat16"
    )
    found = schedule.phases(compressor)
    assert [p.start for p in found] == [0, 3]
    assert found[0].compressor == rr.compressors.Cast("bfloat16", feedback=False)
    assert rr.compressors.is_dense(found[0].compressor)
    assert not rr.compressors.is_dense(rr.compressors.bf16())  # feeds its rounding back
    assert schedule.bytes_sent(compressor, (40, 60), np.float32, 10) == (3 * 2400 * 2 + 7 * 120 * 8)
    # Nothing dense to cast: unchanged; dense throughout: one cast.
    assert schedule.with_dense_dtype(rr.compressors.topk(0.01), "bfloat16") == (
        rr.compressors.topk(0.01)
    )
    assert schedule.with_dense_dtype(rr.compressors.none(), "float16") == (
        rr.compressors.Cast("float16", feedback=False)
    )

    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    compiled = _compiled_exchange(rr.error_feedback(compressor, min_size=MIN_SIZE), params)
    conditionals = hlo.branch_collectives(compiled)
    moved = sum(c.bytes_per_worker for cond in conditionals for c in cond[0])
    wire = sum(2 * int(np.prod(SHAPES[k])) for k in COMPRESSED)
    if jax.default_backend() == "cpu":
        wire *= 2  # XLA:CPU runs a bfloat16 all-reduce in float32 (test_compressors)
    assert moved == wire

    grads = th.random_grads(np.random.default_rng(8), SHAPES, W, steps=4)
    tx = rr.resireduce(
        compressor,
        min_size=MIN_SIZE,
        grouping=rr.grouping.auto(),
        inter="weighted",
        intra="2d",
        intra_layers="w1",
    )
    outputs, warm = th.run_shard_map(tx, params, grads[:3])
    for t in range(3):
        for k in COMPRESSED:
            out = np.asarray(outputs[t][k][0])
            exact = grads[t][k].mean(0)
            np.testing.assert_allclose(out, exact, rtol=1e-2, atol=1e-2)  # bf16: 8 bits
            rounded = out.astype(jnp.bfloat16).astype(np.float32)
            np.testing.assert_array_equal(out, rounded)  # a bfloat16 mean
            assert np.any(out != exact)

    def stores(state):
        leaves = jax.tree.leaves(state.residuals)
        return [x for x in leaves if np.issubdtype(x.dtype, np.floating)]

    assert not any(np.any(x) for x in stores(warm))
    _, compressing = th.run_shard_map(tx, params, grads)
    assert all(np.any(x) for x in stores(compressing))

    # Whole-model Top-k takes the 16-bit warm-up as a dense phase too (a plain bf16 cast,
    # which feeds its rounding back, is refused there).
    global_tx = rr.error_feedback(compressor, min_size=MIN_SIZE, selection_scope="global")
    global_out, global_warm = th.run_shard_map(global_tx, params, grads[:1])
    for k in COMPRESSED:
        np.testing.assert_array_equal(global_out[0][k], outputs[0][k])
    assert not any(np.any(x) for x in stores(global_warm))
    with pytest.raises(ValueError, match="found cast"):
        rr.error_feedback(
            schedule.Phased(((0, rr.compressors.bf16()), (3, rr.compressors.topk(0.05)))),
            selection_scope="global",
        )
