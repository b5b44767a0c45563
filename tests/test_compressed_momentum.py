"""compressed_momentum_adam against a numpy paraphrase of 1-bit Adam (Tang et al. 2021,
Algorithm 1) with Top-k, against optax's AdamW during the warm-up, and its invariants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jex_core
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from tests import transform_harness as th

W = 8
SHAPES = {"w1": (40, 60), "w2": (60, 30), "b": (60,)}
MIN_SIZE = 1000
COMPRESSED = ("w1", "w2")
HYPER = {"b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.01}


def _params():
    rng = np.random.default_rng(1)
    return {k: rng.normal(0, 0.1, s).astype(np.float32) for k, s in SHAPES.items()}


def floored(v):
    return np.maximum(v, np.float32(0.01) * v.mean(dtype=np.float32))


def _clip(tree, c):
    norm = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in tree.values()))
    return {k: (x * np.float32(min(1.0, c / norm))).astype(np.float32) for k, x in tree.items()}


def np_compressed_momentum_adam(
    grads_per_step, params, *, lr, warmup, density, clip, compressed="momentum"
):
    """Tang et al., Algorithm 1, with Top-k as the compressor and per-worker errors:
    warm-up: Adam on the mean gradient; then m = mean_w Q(b1 m + (1-b1) g_w + e_w),
    e_w = what Q left, v frozen; u = -lr (m_hat / (sqrt(v_hat) + eps) + wd p), where after
    the warm-up v is floored per leaf at 1 % of its mean (the library's ``nu_floor``)."""
    b1, b2, eps, wd = HYPER["b1"], HYPER["b2"], HYPER["eps"], HYPER["weight_decay"]
    m = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    v = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    e = {k: np.zeros((W, *SHAPES[k]), np.float32) for k in COMPRESSED}
    updates = []
    for t, g in enumerate(grads_per_step):
        step = t + 1
        if t < warmup:
            gbar = {k: x.mean(0, dtype=np.float64).astype(np.float32) for k, x in g.items()}
            if clip is not None:
                gbar = _clip(gbar, clip)
            m = {k: (1 - b1) * gbar[k] + b1 * m[k] for k in SHAPES}
            v = {k: (1 - b2) * gbar[k] * gbar[k] + b2 * v[k] for k in SHAPES}
        else:
            local = [{k: x[w] for k, x in g.items()} for w in range(W)]
            if clip is not None:  # each worker's own norm, at the mean's threshold sqrt(W) c
                local = [_clip(x, clip * np.sqrt(W)) for x in local]
            new_m = {}
            for k in SHAPES:
                # "update": the momentum in units of the frozen sqrt(v_hat) + eps.
                denom = np.sqrt(floored(v[k]) / (1 - b2**warmup)) + eps
                scale = denom if compressed == "update" else np.float32(1)
                x = np.stack([((1 - b1) * local[w][k] + b1 * m[k]) / scale for w in range(W)])
                if k in COMPRESSED:
                    comp = x + e[k]
                    sent = np.stack([th.np_topk_sparsify(comp[w], density) for w in range(W)])
                    e[k] = comp - sent
                    x = sent
                new_m[k] = x.mean(0, dtype=np.float64).astype(np.float32) * scale
            m = new_m
        bias1 = 1 - b1**step
        bias2 = 1 - b2 ** min(step, warmup)
        used = v if t < warmup else {k: floored(x) for k, x in v.items()}
        updates.append(
            {
                k: -lr * ((m[k] / bias1) / (np.sqrt(used[k] / bias2) + eps) + wd * params[k])
                for k in SHAPES
            }
        )
    return updates, m, v, e


@pytest.mark.parametrize(
    "clip, compressed, one_buffer",
    [
        (None, "momentum", False),
        (0.5, "momentum", False),
        (0.5, "update", False),
        (0.5, "update", True),  # the default: w_i = b1 m + e_i in the store
    ],
)
def test_matches_numpy_one_bit_adam_paraphrase_through_both_phases(clip, compressed, one_buffer):
    warmup, density, lr = 2, 0.05, 1e-2
    grads = th.random_grads(np.random.default_rng(0), SHAPES, W, steps=6)
    params = _params()
    exchange = rr.error_feedback(
        rr.compressors.topk(rr.compressors.dense_warmup(warmup, density)), min_size=MIN_SIZE
    )
    tx = rr.compressed_momentum_adam(
        lr, exchange, max_grad_norm=clip, compressed=compressed, one_buffer=one_buffer, **HYPER
    )
    outputs, state = th.run_shard_map(tx, params, grads)
    ref, m, v, e = np_compressed_momentum_adam(
        grads, params, lr=lr, warmup=warmup, density=density, clip=clip, compressed=compressed
    )
    for t, (out, r) in enumerate(zip(outputs, ref, strict=True)):
        for k in SHAPES:
            for w in range(W):  # every worker applies the same update
                np.testing.assert_allclose(out[k][w], r[k], rtol=2e-5, atol=1e-7, err_msg=(t, k))
    if one_buffer:  # tests/test_one_buffer.py reads w_i = b1 m + e_i
        return
    for k in SHAPES:
        np.testing.assert_allclose(state.mu[k][0], m[k], rtol=2e-5, atol=1e-8)
        np.testing.assert_allclose(state.nu[k][0], v[k], rtol=1e-5, atol=1e-12)
    for k in COMPRESSED:  # each worker's momentum error is its own
        np.testing.assert_allclose(state.exchange.residuals[k], e[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state.count, np.full(W, len(grads)))


def test_warmup_is_optax_adamw_on_the_mean_gradient():
    grads = th.random_grads(np.random.default_rng(2), SHAPES, W, steps=4)
    params = _params()
    exchange = rr.resireduce(
        rr.compressors.topk(rr.compressors.dense_warmup(10, 0.01)),
        min_size=MIN_SIZE,
        grouping=rr.grouping.auto(),
        inter="weighted",
        intra="2d",
        intra_layers="w1",
    )
    tx = rr.compressed_momentum_adam(3e-3, exchange, max_grad_norm=1.0, **HYPER)
    outputs, _ = th.run_shard_map(tx, params, grads)
    reference = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(3e-3, b1=HYPER["b1"], b2=HYPER["b2"], eps=HYPER["eps"], weight_decay=0.01),
    )
    state = reference.init(params)
    for t, g in enumerate(grads):
        mean = {k: jnp.asarray(x).mean(0) for k, x in g.items()}
        expected, state = reference.update(mean, state, params)
        for k in SHAPES:
            np.testing.assert_allclose(outputs[t][k][0], expected[k], rtol=2e-5, atol=1e-8)


def test_error_feedback_conserves_the_momentum_sent_and_kept():
    """After the warm-up, per worker: D(P_w) + e_new = m_w + e_old with m_w = b1 m +
    (1 - b1) g_w; the new momentum is the mean of what was sent."""
    b1 = HYPER["b1"]
    grads = th.random_grads(np.random.default_rng(4), SHAPES, W, steps=4)
    params = _params()
    exchange = rr.error_feedback(
        rr.compressors.topk(rr.compressors.dense_warmup(2, 0.02)), min_size=MIN_SIZE
    )
    tx = rr.compressed_momentum_adam(
        1e-2, exchange, compressed="momentum", one_buffer=False, **HYPER
    )
    _, before = th.run_shard_map(tx, params, grads[:3])
    _, after = th.run_shard_map(tx, params, grads)
    for k in COMPRESSED:
        local = b1 * before.mu[k][0] + (1 - b1) * grads[3][k]
        sent = local + before.exchange.residuals[k] - after.exchange.residuals[k]
        for w in range(W):
            assert np.count_nonzero(after.exchange.residuals[k][w] == 0) >= int(0.02 * sent[w].size)
        np.testing.assert_allclose(after.mu[k][0], sent.mean(0), rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(after.nu[k], before.nu[k])  # frozen


def test_skipped_step_keeps_every_moment_and_the_count():
    grads = th.random_grads(np.random.default_rng(6), SHAPES, W, steps=4)
    grads[3]["w2"][5, 0, 0] = np.nan  # one worker's gradient element
    params = _params()
    exchange = rr.error_feedback(
        rr.compressors.topk(rr.compressors.dense_warmup(2, 0.02)), min_size=MIN_SIZE
    )
    tx = rr.skip_nonfinite(rr.compressed_momentum_adam(1e-2, exchange, **HYPER), mode="strict")
    _, three = th.run_shard_map(tx, params, grads[:3])
    outputs, four = th.run_shard_map(tx, params, grads)
    assert int(four.skipped[0]) == 1
    for k in SHAPES:
        np.testing.assert_array_equal(outputs[3][k], 0.0)
        np.testing.assert_array_equal(four.inner.mu[k], three.inner.mu[k])
        np.testing.assert_array_equal(four.inner.nu[k], three.inner.nu[k])
    np.testing.assert_array_equal(four.inner.count, three.inner.count)


def test_plan_and_bytes_are_the_exchanges():
    params = _params()
    exchange = rr.error_feedback(
        rr.compressors.topk(rr.compressors.dense_warmup(3, 0.05)), min_size=MIN_SIZE
    )
    tx = rr.compressed_momentum_adam(1e-3, exchange)
    assert tx.plan(params) == exchange.plan(params)
    assert tx.bytes_sent(params, 10) == exchange.bytes_sent(params, 10)
    state = jax.eval_shape(tx.init, params)
    assert isinstance(state, rr.CompressedMomentumState)
    assert rr.exchange.exchange_states(state)[0].residuals.keys() == set(COMPRESSED)


def test_a_coordinate_without_warmup_gradient_takes_a_bounded_step():
    """A feature that is zero in every warm-up batch has v = 0; when its gradient appears,
    the floored v keeps its step within 1 / sqrt(nu_floor) of its leaf's typical step."""
    grads = th.random_grads(np.random.default_rng(8), SHAPES, W, steps=5)
    for t in range(2):  # no gradient for w1[0, 0] during the warm-up
        grads[t]["w1"][:, 0, 0] = 0.0
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    exchange = rr.error_feedback(
        rr.compressors.topk(rr.compressors.dense_warmup(2, 0.5)), min_size=MIN_SIZE
    )
    with_floor = rr.compressed_momentum_adam(1e-3, exchange, b2=0.95)
    outputs, state = th.run_shard_map(with_floor, params, grads)
    assert state.nu["w1"][0][0, 0] == 0.0  # the state keeps v; the floor is where it divides
    typical = np.median(np.abs(outputs[4]["w1"][0]))
    assert np.abs(outputs[4]["w1"][0][0, 0]) <= typical / np.sqrt(0.01) * 2
    frozen = rr.compressed_momentum_adam(1e-3, exchange, b2=0.95, nu_floor=0.0)
    outputs, _ = th.run_shard_map(frozen, params, grads)
    assert np.abs(outputs[4]["w1"][0][0, 0]) > 100 * typical  # divided by eps


def test_an_exchange_that_starts_compressed_is_refused():
    with pytest.raises(ValueError, match="dense warm-up"):
        rr.compressed_momentum_adam(1e-3, rr.error_feedback(rr.compressors.topk(0.01)))
    with pytest.raises(ValueError, match="exchange transform"):
        rr.compressed_momentum_adam(1e-3, optax.sgd(0.1))
    with pytest.raises(ValueError, match="b2"):
        rr.compressed_momentum_adam(
            1e-3,
            rr.error_feedback(rr.compressors.topk(rr.compressors.dense_warmup(1, 0.01))),
            b2=1.0,
        )


def test_sgd_variant_matches_numpy_momentum_correction_after_optax_sgd_warmup():
    """Dense phase: optax.sgd(momentum) on the clipped mean gradient (with L2 decay);
    then m = mean_w Q(b m + g_w + e_w), the update -lr m."""
    beta, lr, wd, warmup, density = 0.9, 0.05, 0.01, 2, 0.05
    grads = th.random_grads(np.random.default_rng(11), SHAPES, W, steps=5)
    params = _params()
    exchange = rr.error_feedback(
        rr.compressors.topk(rr.compressors.dense_warmup(warmup, density)), min_size=MIN_SIZE
    )
    tx = rr.compressed_momentum_sgd(lr, exchange, momentum=beta, weight_decay=wd, max_grad_norm=1.0)
    outputs, state = th.run_shard_map(tx, params, grads)
    reference = optax.chain(
        optax.add_decayed_weights(wd), optax.clip_by_global_norm(1.0), optax.sgd(lr, beta)
    )
    ref_state = reference.init(params)
    for t in range(warmup):
        mean = {k: jnp.asarray(x).mean(0) for k, x in grads[t].items()}
        expected, ref_state = reference.update(mean, ref_state, params)
        for k in SHAPES:
            np.testing.assert_allclose(outputs[t][k][0], expected[k], rtol=2e-5, atol=1e-8)
    m = {k: np.asarray(v) for k, v in ref_state[2][0].trace.items()}
    e = {k: np.zeros((W, *SHAPES[k]), np.float32) for k in COMPRESSED}
    for t in range(warmup, len(grads)):
        local = [  # each worker's own norm, at the mean's threshold sqrt(W) c
            _clip({k: grads[t][k][w] + wd * params[k] for k in SHAPES}, np.sqrt(W))
            for w in range(W)
        ]
        new_m = {}
        for k in SHAPES:
            x = np.stack([local[w][k] + beta * m[k] for w in range(W)])
            if k in COMPRESSED:
                comp = x + e[k]
                sent = np.stack([th.np_topk_sparsify(comp[w], density) for w in range(W)])
                e[k], x = comp - sent, sent
            new_m[k] = x.mean(0, dtype=np.float64).astype(np.float32)
        m = new_m
        for k in SHAPES:
            np.testing.assert_allclose(outputs[t][k][0], -lr * m[k], rtol=2e-5, atol=1e-8)
    assert state.nu == () or all(x.size == 0 for x in jax.tree.leaves(state.nu))


def test_compressed_phase_holds_no_denominator_beside_the_exchange():
    """Compiled compressed-phase step (update units, float8 error feedback) of a model
    with a large embedding: the frozen √v̂ + ε divides the message before the exchange
    and multiplies the momentum after it; the step recomputes it there instead of keeping
    it alive across the exchange, so its temp stays within that of error feedback on
    AdamW plus a quarter of the embedding (it held one more embedding: +4.3 MB of 5.8)."""
    workers, vocab, width = 4, 4096, 256
    shapes = {"emb": (vocab, width), **{f"w{i}": (width, width) for i in range(6)}}
    params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    batch = {"ids": np.zeros((workers, 64), np.int32)}
    mesh = rr.parallel.make_mesh(workers)

    def loss_fn(p, b):  # a tied embedding between a chain of dense layers
        x = p["emb"][b["ids"][0]]
        for i in range(6):
            x = jnp.tanh(x @ p[f"w{i}"])
        return jnp.sum(x @ p["emb"].T)

    def temp(tx, **phase):
        sharded = rr.parallel.shard_batch(batch, mesh)
        return th.step_memory(loss_fn, tx, params, sharded, mesh, **phase).temp

    topk = rr.compressors.topk(rr.compressors.dense_warmup(1, 0.01))
    exchange = rr.error_feedback(topk, residual_dtype=jnp.float8_e4m3fn)
    cm = temp(
        rr.compressed_momentum_adam(1e-3, exchange, one_buffer=False, **HYPER), density_phase=1
    )
    adamw = optax.adamw(1e-3, b1=HYPER["b1"], b2=HYPER["b2"], eps=HYPER["eps"])
    ef = temp(optax.chain(rr.error_feedback(rr.compressors.topk(0.01)), adamw))
    assert cm <= ef + vocab * width * 4 // 4, (cm, ef)


def _count(jaxpr, primitive: str) -> int:
    """Equations of ``primitive`` in ``jaxpr`` and every jaxpr nested in it."""
    return sum(
        (eqn.primitive.name == primitive)
        + sum(_count(sub, primitive) for sub in jex_core.jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
    )


def test_a_program_of_one_phase_computes_that_phase_alone():
    """With ``density_phase`` (the training program's one program per phase) the warm-up
    flag is known when tracing, so only the phase's own arithmetic is traced: per leaf the
    warm-up takes one sqrt(v_hat) (Adam's step), the compressed phase two (the message is
    divided before the exchange, the momentum multiplied after it), the switching program
    both phases' three."""
    params = _params()
    exchange = rr.error_feedback(
        rr.compressors.topk(rr.compressors.dense_warmup(2, 0.05)), min_size=MIN_SIZE
    )
    tx = rr.compressed_momentum_adam(1e-2, exchange, one_buffer=False, **HYPER)
    mesh = th.mesh(W)
    specs, state = rr.parallel.abstract_state(tx, params, mesh, th.AXIS)

    def roots(density_phase):
        def update(grads, state, params):
            state = jax.tree.map(lambda x, spec: x if spec == P() else x[0], state, specs)
            grads = jax.tree.map(lambda g: jax.lax.pcast(g, th.AXIS, to="varying"), grads)
            return tx.update(grads, state, params, density_phase=density_phase)[0]

        fn = jax.shard_map(update, mesh=mesh, in_specs=(P(), specs, P()), out_specs=P())
        return _count(jax.make_jaxpr(fn)(params, state, params).jaxpr, "sqrt")

    assert [roots(phase) for phase in (0, 1, None)] == [len(SHAPES) * n for n in (1, 2, 3)]


def test_a_16_bit_warmup_is_adamw_on_the_16_bit_mean_and_then_compresses():
    """A warm-up sent in bfloat16 (``with_dense_dtype``) is still the warm-up: AdamW on the
    mean that a bfloat16 all-reduce gives (``compressed_mean`` of the same cast, a separate
    code path), then the compressed phase."""
    grads = th.random_grads(np.random.default_rng(4), SHAPES, W, steps=3)
    params = _params()
    schedule = rr.compressors.schedule
    compressor = schedule.with_dense_dtype(
        rr.compressors.topk(rr.compressors.dense_warmup(2, 0.05)), "bfloat16"
    )
    exchange = rr.error_feedback(compressor, min_size=MIN_SIZE)
    assert rr.compressed_momentum.warmup_steps(exchange) == 2
    tx = rr.compressed_momentum_adam(3e-3, exchange, max_grad_norm=1.0, **HYPER)
    outputs, state = th.run_shard_map(tx, params, grads)
    reference = optax.chain(
        rr.compressed_mean(rr.compressors.Cast("bfloat16", feedback=False), min_size=MIN_SIZE),
        optax.clip_by_global_norm(1.0),
        optax.adamw(3e-3, b1=HYPER["b1"], b2=HYPER["b2"], eps=HYPER["eps"], weight_decay=0.01),
    )
    expected, _ = th.run_shard_map(reference, params, grads[:2])
    for t in range(2):
        for k in COMPRESSED:
            np.testing.assert_allclose(
                outputs[t][k][0], expected[t][k][0], rtol=2e-5, atol=1e-8, err_msg=(t, k)
            )
    for k in COMPRESSED:  # compressing from step 2: each worker now holds a momentum error
        assert np.all(np.any(state.exchange.residuals[k] != 0, axis=(1, 2))), k
