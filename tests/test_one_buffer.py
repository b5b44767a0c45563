"""The one-buffer compressed momentum (w_i = b1 m + e_i in the leaf's own store; Tang et
al. 2021, §3, Algorithm 1) against the two-buffer form: the same steps to float32
rounding, flat and hierarchical, across the freeze; its refusals, skips, resume, resize,
bytes and layer stacks."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from resireduce_jax import exchange_state, memory
from tests import transform_harness as th

W, L = 8, 4
SHAPES = {"w1": (40, 60), "w2": (60, 30), "b": (60,)}
MIN_SIZE = 1000
COMPRESSED = ("w1", "w2")
WARMUP = 20
ADAM = {"b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.01, "max_grad_norm": 2.0}


def _params(shapes=SHAPES):
    rng = np.random.default_rng(1)
    return {k: rng.normal(0, 0.1, s).astype(np.float32) for k, s in shapes.items()}


def _grads(steps, shapes=SHAPES, seed=0):
    return th.random_grads(np.random.default_rng(seed), shapes, W, steps=steps)


def _exchange(compressor=None, **kwargs):
    # Random-k's indices do not depend on the values, so the rounding-level differences
    # of the two forms cannot change what is sent (a Top-k near-tie could).
    compressor = compressor or rr.compressors.randomk(rr.compressors.dense_warmup(WARMUP, 0.05))
    return rr.error_feedback(compressor, min_size=MIN_SIZE, **kwargs)


def _tx(kind, one_buffer, nu="float32", **exchange_kwargs):
    ex = _exchange(**exchange_kwargs)
    if kind == "sgd":
        return rr.compressed_momentum_sgd(
            0.05, ex, momentum=0.9, weight_decay=1e-3, max_grad_norm=2.0, one_buffer=one_buffer
        )
    return rr.compressed_momentum_adam(
        1e-2, ex, compressed=kind, one_buffer=one_buffer, frozen_nu_format=nu, **ADAM
    )


class _Run(th.ShardMapStep):
    """``tx`` under shard_map on ``mesh``, step by step, from ``init`` or a given state."""

    def __init__(self, tx, params, mesh=None, workers=W):
        super().__init__(tx, params, workers, on_mesh=mesh)

    def run(self, grads, state=None, phased=False):
        """``phased``: one program per density phase (the warm-up's, then the compressed
        one), as the training program compiles; else one program switching on the count."""
        state = self.init(self.params) if state is None else state
        outputs = []
        for g in grads:
            phase = int(jax.device_get(state.count).flat[0] >= WARMUP) if phased else None
            out, state = self.step(self.params, state, self.shard_grads(g), phase)
            outputs.append(jax.device_get(out))
        return outputs, state


def _assert_close(a, b, rtol=1e-4):
    for t, (x, y) in enumerate(zip(a, b, strict=True)):
        for k in x:
            scale = float(np.max(np.abs(y[k]))) or 1.0
            np.testing.assert_allclose(x[k], y[k], rtol=rtol, atol=rtol * scale, err_msg=(t, k))


# (kind, hierarchical, phased): the one-buffer store takes the exchange's mean into its own
# buffer in a program of one density phase (exchange._Step.send_carried), so both forms of
# programs are checked, flat and with w_i sharded 1/L over a node.
CASES = [
    ("update", False, False),
    ("update", True, False),
    ("momentum", False, False),
    ("sgd", False, False),
    ("sgd", True, False),
    ("update", False, True),
    ("update", True, True),
    ("sgd", True, True),
]


@pytest.mark.parametrize("kind, hierarchical, phased", CASES)
def test_float32_one_buffer_is_the_two_buffer_form_over_100_steps(kind, hierarchical, phased):
    steps = 5 * WARMUP  # the warm-up, the freeze and 80 compressed steps
    grads = _grads(steps)
    params = _params()
    mesh = rr.parallel.make_mesh(W, local_devices=L) if hierarchical else None
    local = {"local_axis": "local"} if hierarchical else {}
    one = _Run(_tx(kind, True, **local), params, mesh)
    two = _Run(_tx(kind, False, **local), params, mesh)
    out1, s1 = one.run(grads, phased=phased)
    out2, s2 = two.run(grads)
    _assert_close(out1, out2)
    s1, s2 = jax.device_get((s1, s2))
    assert s1.mu["w1"] == optax.MaskedNode() and s1.mu["b"].shape == s2.mu["b"].shape
    b1 = 0.9
    for k in COMPRESSED:  # w_i = b1 m + e_i, in the units sent (m / d for "update")
        w = np.asarray(s1.exchange.residuals[k])
        e = np.asarray(s2.exchange.residuals[k])
        m = np.asarray(s2.mu[k])  # replicated: one copy
        if kind == "update":
            v = np.asarray(s2.nu[k])
            floor = np.maximum(v, np.float32(0.01) * v.mean())
            m = m / (np.sqrt(floor / (1 - ADAM["b2"] ** WARMUP)) + ADAM["eps"])
        if hierarchical:  # device j of a node holds rows j * R ... of its store: 1/L
            rows = -(-SHAPES[k][0] // L)
            assert w.shape == (W, rows, SHAPES[k][1])
            m = np.pad(m, ((0, rows * L - SHAPES[k][0]), (0, 0)))
            m = np.concatenate([m.reshape(L, rows, -1)] * (W // L))
        np.testing.assert_allclose(w, b1 * m + e, rtol=1e-4, atol=1e-4 * np.abs(w).max())


def test_the_first_compressed_step_is_bit_for_bit_and_a_quantized_w_runs():
    grads = _grads(WARMUP + 3)
    params = _params()
    out1, _ = _Run(_tx("momentum", True), params).run(grads)
    out2, _ = _Run(_tx("momentum", False), params).run(grads)
    for t in range(WARMUP + 1):  # the warm-up holds m exactly; c_i = (1-b1) g + b1 m
        for k in SHAPES:
            np.testing.assert_array_equal(out1[t][k], out2[t][k], err_msg=(t, k))
    for fmt in ("int4", "int8/64/stochastic", "bfloat16"):
        out, state = _Run(_tx("update", True, residual_format=fmt), params).run(grads)
        assert all(np.isfinite(out[-1][k]).all() for k in SHAPES), fmt
        assert jax.tree.leaves(state.exchange.residuals["w1"])[0].dtype != np.float32 or fmt[
            :4
        ] not in ("int4", "int8")


def test_shared_and_two_d_stores_are_refused_and_the_default_carries_the_rest():
    params = _params({"w1": (40, 60), "w2": (40, 60), "w3": (30, 50), "b": (60,)})
    compressor = rr.compressors.topk(rr.compressors.dense_warmup(2, 0.05))
    ex = rr.resireduce(
        compressor,
        grouping=rr.grouping.regex([(r"^(w1|w2)$", "g")]),
        inter="average",
        intra="none",
        min_size=MIN_SIZE,
    )
    with pytest.raises(ValueError, match="shared or 2-D store cannot hold"):
        rr.compressed_momentum_adam(1e-2, ex, one_buffer=True).init(params)
    default = rr.compressed_momentum_adam(1e-2, ex)
    state = jax.eval_shape(default.init, params)
    assert state.mu["w3"] == optax.MaskedNode()  # its own store: one buffer
    assert state.mu["w1"].shape == (40, 60)  # a shared group's member: two buffers
    two_d = rr.resireduce(
        compressor,
        grouping=rr.grouping.regex([]),
        intra="2d",
        intra_layers="^w3$",
        min_size=MIN_SIZE,
    )
    with pytest.raises(ValueError, match=r"2-D store.*\['w3'\]"):
        rr.compressed_momentum_adam(1e-2, two_d, one_buffer=True).init(params)
    with pytest.raises(ValueError, match="one_buffer"):
        rr.compressed_momentum_sgd(0.1, ex, one_buffer="yes")
    # A residual format would round b1 m too: one buffer there only when asked for.
    quantized = jax.eval_shape(_tx("update", None, residual_format="int4").init, params)
    assert quantized.mu["w1"].shape == (40, 60)


def test_a_skipped_step_leaves_the_state_unchanged():
    grads = _grads(WARMUP + 4)
    for t in (WARMUP - 1, WARMUP + 2):  # the last warm-up step, a compressed one
        grads[t]["w2"][5, 0, 0] = np.nan
    tx = rr.skip_nonfinite(_tx("update", True, "int8", residual_format="int8"), mode="strict")
    run = _Run(tx, _params())
    _, before = run.run(grads[: WARMUP - 1])
    outputs, after = run.run(grads[WARMUP - 1 : WARMUP], before)
    np.testing.assert_array_equal(outputs[0]["w1"], 0.0)
    for x, y in zip(jax.tree.leaves(after.inner), jax.tree.leaves(before.inner), strict=True):
        np.testing.assert_array_equal(x, y)
    _, before = run.run(grads[WARMUP : WARMUP + 2], after)
    _, after = run.run(grads[WARMUP + 2 : WARMUP + 3], before)
    assert int(jax.device_get(after.skipped)) == 2
    for x, y in zip(jax.tree.leaves(after.inner), jax.tree.leaves(before.inner), strict=True):
        np.testing.assert_array_equal(x, y)


def test_resume_from_an_orbax_checkpoint_is_bit_identical(tmp_path):
    from train import checkpointing

    grads = _grads(WARMUP + 6)
    run = _Run(_tx("update", True, "int8", residual_format="int4/64/stochastic"), _params())
    _, state = run.run(grads[: WARMUP + 2])
    ckpt = checkpointing.Checkpointer(
        str(tmp_path), keep=1, num_workers=W, on_worker_change="error"
    )
    ckpt.save(WARMUP + 2, {"opt_state": state}, run.specs, wait=True)
    restored = ckpt.restore(WARMUP + 2, {"opt_state": state}, run.specs, run.mesh)["opt_state"]
    ckpt.close()
    a, sa = run.run(grads[WARMUP + 2 :], state)
    b, sb = run.run(grads[WARMUP + 2 :], restored)
    for x, y in zip(jax.tree.leaves((a, sa)), jax.tree.leaves((b, sb)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resize_workers_gives_each_new_worker_the_mean_w():
    tx = _tx("momentum", True)
    params = _params()
    run = _Run(tx, params)
    _, state = run.run(_grads(WARMUP + 3))
    state = jax.device_get(state)
    plan = tx.plan(params)
    resized = exchange_state.resize_workers(state.exchange, run.specs.exchange, plan, 4)
    for k in COMPRESSED:  # mean_i w_i = b1 m + mean_i e_i: the momentum and the error owed
        old = np.asarray(state.exchange.residuals[k])
        new = np.asarray(resized.residuals[k])
        assert new.shape == (4, *old.shape[1:])
        np.testing.assert_allclose(new, np.broadcast_to(old.mean(0), new.shape), rtol=1e-6)


def test_bytes_per_parameter_per_worker():
    params = _params()
    n = {k: int(np.prod(s)) for k, s in SHAPES.items()}
    big = n["w1"] + n["w2"]
    # int4: blocks of 128 codes, two a byte, and a float32 scale a block: 68 bytes a block.
    int4 = sum(-(-n[k] // 128) * (64 + 4) for k in COMPRESSED)
    for fmt, residual in (("int4", int4), ("float32", 4 * big)):
        one = memory.model_state_bytes(params, _tx("update", True, residual_format=fmt))
        two = memory.model_state_bytes(params, _tx("update", False, residual_format=fmt))
        # Two buffers: m and v of every leaf; one buffer: m of the dense leaf only.
        assert two.optimizer - one.optimizer == 4 * big
        assert one.optimizer == 4 * (big + 2 * n["b"]) + 4 + 4  # v, the dense m, 2 counts
        assert one.residuals == two.residuals == residual
    # Per parameter per worker at int4: v 4 B, w (68 / 128) B, m 0 B where carried.
    assert int4 / big < 0.56


@pytest.mark.parametrize("hierarchical", [False, True])
def test_layer_stacks_are_the_unstacked_leaves(hierarchical):
    layers = 3
    stacked = {"h": {"w": (layers, 40, 60)}, "b": (60,)}
    flat = {f"h{i}": {"w": (40, 60)} for i in range(layers)} | {"b": (60,)}
    rng = np.random.default_rng(4)
    grads_s = [
        {
            "h": {"w": rng.standard_t(3, (W, layers, 40, 60)).astype(np.float32)},
            "b": rng.standard_t(3, (W, 60)).astype(np.float32),
        }
        for _ in range(WARMUP + 4)
    ]
    grads_f = [
        {f"h{i}": {"w": g["h"]["w"][:, i]} for i in range(layers)} | {"b": g["b"]} for g in grads_s
    ]
    p_s = {
        "h": {"w": rng.normal(0, 0.1, stacked["h"]["w"]).astype(np.float32)},
        "b": np.zeros(60, np.float32),
    }
    p_f = {f"h{i}": {"w": p_s["h"]["w"][i]} for i in range(layers)} | {"b": p_s["b"]}
    compressor = rr.compressors.randomk(rr.compressors.dense_warmup(WARMUP, 0.05))
    local = {"local_axis": "local"} if hierarchical else {}
    mesh = rr.parallel.make_mesh(W, local_devices=L) if hierarchical else None
    ex_s = rr.error_feedback(compressor, min_size=MIN_SIZE, layer_stacks={r"^h/w$": 0}, **local)
    tx_s = rr.compressed_momentum_adam(1e-2, ex_s, one_buffer=True, **ADAM)
    tx_f = rr.compressed_momentum_adam(
        1e-2, _exchange(compressor, **local), one_buffer=True, **ADAM
    )
    del flat
    out_s, _ = _Run(tx_s, p_s, mesh).run(grads_s)
    out_f, _ = _Run(tx_f, p_f, mesh).run(grads_f)
    for t, (a, b) in enumerate(zip(out_s, out_f, strict=True)):
        for i in range(layers):
            np.testing.assert_allclose(
                a["h"]["w"][:, i], b[f"h{i}"]["w"], rtol=1e-5, atol=1e-8, err_msg=t
            )


@pytest.mark.parametrize("hierarchical, w_format", [(False, "int4"), (True, "float32")])
def test_an_int8_frozen_v_is_float32_through_the_warm_up_and_rounded_once(hierarchical, w_format):
    """Li et al. 2023's 8-bit second moment, frozen: the warm-up keeps v and m in float32
    (each worker 1/N of them, m in the codes' bytes: an int4 w_i rounds nothing before
    the freeze) and is the float32 run to rounding; the freeze rounds sqrt(v) once to
    codes 1..255 (none decodes to zero), and the steps after it stay near float32's."""
    grads = _grads(WARMUP + 10)
    params = _params()
    mesh = rr.parallel.make_mesh(W, local_devices=L) if hierarchical else None
    local = {"local_axis": "local"} if hierarchical else {}
    ref, _ = _Run(_tx("update", False, **local), params, mesh).run(grads)
    tx = _tx("update", True, "int8", residual_format=w_format, **local)
    out, state = _Run(tx, params, mesh).run(grads)
    _assert_close(out[:WARMUP], ref[:WARMUP], rtol=1e-5)  # float32 rounding (fusion)
    if w_format == "float32":
        _assert_close(out[WARMUP:], ref[WARMUP:], rtol=3e-2)
    else:  # int4 w_i rounds b1 m + e_i each step: the first compressed step is near
        _assert_close(out[WARMUP : WARMUP + 1], ref[WARMUP : WARMUP + 1], rtol=0.2)
        assert all(np.isfinite(o[k]).all() for o in out for k in SHAPES)
    nu = jax.device_get(state.nu["w1"])
    assert isinstance(nu, rr.compressed_momentum.FrozenNu) and state.nu["b"].shape == (60,)
    assert nu.warm.shape == (W, 1)  # 8 workers: v's slice in the codes, beside m's
    assert nu.codes.dtype == np.uint8 and nu.codes.min() >= 1
    with pytest.raises(ValueError, match="frozen_nu_format"):
        _tx("update", True, "int4")


def test_momentum_units_with_an_int8_frozen_v_are_refused():
    """Tang et al.'s units divide the averaged momentum by sqrt(v) after the exchange; the
    int8 codes are per-worker (they hold the warm-up slices), so the division would give
    each worker its own update: refused when built, in one buffer and in two."""
    for one_buffer in (True, False):
        with pytest.raises(ValueError, match="compressed='update'"):
            _tx("momentum", one_buffer, "int8")
        _tx("momentum", one_buffer, "float32")  # v replicated: allowed


@pytest.mark.parametrize(
    "workers, one_buffer, in_codes",
    [(8, True, ("m", "v")), (4, True, ("m",)), (8, False, ("v",)), (2, False, ())],
)
def test_the_codes_hold_the_warm_up_slices_they_have_room_for(workers, one_buffer, in_codes):
    """While warm, an int8 frozen v's codes are unused bytes: each worker's float32 slice
    of m (the one-buffer "update" form) takes their first 4 n / N bytes where N >= 4, v's
    the next where N >= 8, else v's slice is a buffer of its own. Through the warm-up the
    run is the float32 one to rounding, wherever the slices live; the codes hold the
    bits of the slices each worker would compute alone (numpy's Adam on the mean)."""
    steps = WARMUP - 1  # the freeze overwrites the slices with codes
    grads = th.random_grads(np.random.default_rng(3), SHAPES, workers, steps=steps)
    params = _params()
    ref, _ = _Run(_tx("update", False), params, workers=workers).run(grads)
    out, state = _Run(_tx("update", one_buffer, "int8"), params, workers=workers).run(grads)
    _assert_close(out, ref, rtol=1e-5)
    nu = jax.device_get(state.nu["w1"])
    n = SHAPES["w1"][0] * SHAPES["w1"][1]
    per = -(-n // workers)
    assert nu.warm.shape == (workers, 1 if "v" in in_codes else per)
    mean = [g["w1"].mean(0).reshape(-1) for g in grads]
    clip = [
        min(1.0, ADAM["max_grad_norm"] / np.sqrt(sum((g[k].mean(0) ** 2).sum() for k in g)))
        for g in grads
    ]
    m = v = np.zeros(n, np.float32)
    for g, c in zip(mean, clip, strict=True):
        m = ADAM["b1"] * m + (1 - ADAM["b1"]) * g * c
        v = ADAM["b2"] * v + (1 - ADAM["b2"]) * (g * c) ** 2
    held = {"m": (0, m), "v": (1, v if "v" in in_codes else None)}
    for worker in range(workers):
        own = slice(worker * per, (worker + 1) * per)
        for name in in_codes:
            index, full = held[name]
            bits = nu.codes[worker].reshape(-1)[4 * per * index : 4 * per * (index + 1)]
            got = bits.view(np.float32)
            atol = 1e-5 * np.abs(full).max()  # float32 sums in another order
            np.testing.assert_allclose(got, full[own], rtol=1e-4, atol=atol, err_msg=name)
        if "v" not in in_codes:
            atol = 1e-5 * np.abs(v).max()
            np.testing.assert_allclose(nu.warm[worker], v[own], rtol=1e-4, atol=atol)


def test_bytes_per_parameter_per_worker_of_the_recipe_form():
    """int4 w_i and an int8 frozen v, per worker of 8: v's codes 1 byte and a scale a
    block of 256, its floor and an unused float32 (the warm-up slice is in the codes,
    beside m's); w_i 68 bytes a block of 128."""
    params = _params()
    tx = _tx("update", True, "int8", residual_format="int4")
    mesh = th.mesh(W)
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P())
    found = rr.compressed_momentum.buffer_bytes(jax.eval_shape(init, params))
    n = {k: int(np.prod(s)) for k, s in SHAPES.items()}
    assert found["m"] == 4 * n["b"]
    v = sum(-(-n[k] // 256) * (256 + 4) + 4 + 4 for k in COMPRESSED)  # + the unused [1]
    assert found["v"] == v + 4 * n["b"]
    assert found["residuals"] == sum(-(-n[k] // 128) * 68 for k in COMPRESSED)


def test_config_keys_reach_the_optimizer():
    """optimizer.one_buffer / optimizer.frozen_nu_format: checked before jax starts, then
    built into the byte GPT's compressed_momentum_adam (python -m train --config
    configs/byte_gpt.py --config.optimizer.one_buffer=on ...)."""
    from tests.test_train import load_config
    from train import config_schema, factory

    c = load_config("byte_gpt")  # its default: one buffer, the frozen v in int8
    assert (c.optimizer.one_buffer, c.optimizer.frozen_nu_format) == ("on", "int8")
    config_schema.validate(c)
    for key, value, match in (
        ("variant", "w+2d", "variant='ef'"),  # one_buffer='on' with shared stores
        ("one_buffer", "yes", "one_buffer must be one of"),
        ("frozen_nu_format", "int4", "frozen_nu_format must be"),
    ):
        bad = load_config("byte_gpt")
        (bad.compression if key == "variant" else bad.optimizer)[key] = value
        with pytest.raises(config_schema.ConfigError, match=match):
            config_schema.validate(bad)
    bad = load_config("byte_gpt")  # Tang et al.'s units divide after the exchange
    bad.optimizer.kwargs = {**dict(bad.optimizer.kwargs), "compressed": "momentum"}
    with pytest.raises(config_schema.ConfigError, match="per-worker buffer"):
        config_schema.validate(bad)
    bad.optimizer.frozen_nu_format = "float32"
    config_schema.validate(bad)
    c.compression.variant = "ef"
    c.compression.residual_format = "int4"
    c.optimizer.one_buffer = "on"
    c.optimizer.frozen_nu_format = "int8"
    config_schema.validate(c)
    tx = factory.build_tx(c, 100, 400)
    core = tx._core
    assert core.one_buffer is True and core.nu_format == rr.compressed_momentum.NuFormat(256)


def test_the_programs_default_is_one_buffer_where_the_store_keeps_float32():
    """optimizer.one_buffer defaults to 'auto': a float32 per-leaf store carries the
    momentum (the two buffers' arithmetic), a quantized one keeps two buffers, and an
    optimizer without compressed momentum is unaffected ('on' is refused there)."""
    import jax

    from tests.test_train import small_digits
    from train import config_schema, factory

    def carried(**changes):
        c = small_digits(**{"optimizer.name": "compressed_momentum_adam", **changes})
        c.optimizer.kwargs = {}
        c.compression.density_schedule.dense_fraction = 0.25
        config_schema.validate(c)
        f32 = np.float32
        params = {
            "b": jax.ShapeDtypeStruct((256,), f32),
            "w": jax.ShapeDtypeStruct((256, 256), f32),
        }
        return factory.build_tx(c, 100, 400)._core.carried(params)

    assert small_digits().optimizer.one_buffer == "auto"
    one = {"compression.variant": "ef", "compression.residual_format": "float32"}
    assert carried(**one) == {1}  # w; b travels dense
    assert carried(**{**one, "compression.residual_format": "int4"}) == frozenset()
    config_schema.validate(small_digits())  # SGD: 'auto' is no request
    with pytest.raises(config_schema.ConfigError, match="compressed-momentum optimizers'"):
        config_schema.validate(small_digits(**{"optimizer.one_buffer": "on"}))


def test_the_training_program_resumes_the_recipe_form_bit_identically(tmp_path):
    """The digits job with compressed-momentum Adam in the one-buffer form (int4 w_i,
    int8 frozen v), halted after step 5 (past the 3-step warm-up) and resumed."""
    import chex

    from tests.test_train import COMPRESSED_MOMENTUM, small_digits
    from train import train

    changes = {
        **COMPRESSED_MOMENTUM,
        "compression.density_schedule.dgc_fraction": 0.0,
        "compression.residual_dtype": "",
        "compression.variant": "ef",
        "compression.residual_format": "int4",
        "optimizer.one_buffer": "on",
        "optimizer.frozen_nu_format": "int8",
    }
    config = small_digits(**changes)
    full = train.train_and_evaluate(config, str(tmp_path / "full"))
    assert full.memory["bytes_per_parameter"]["m"] < 1.0  # m only where it travels dense
    assert train.train_and_evaluate(config, str(tmp_path / "split"), halt_after_step=5).preempted
    assert train.train_and_evaluate(config, str(tmp_path / "split")).step == 12
    a, b = (train.final_state(str(tmp_path / d)) for d in ("full", "split"))
    chex.assert_trees_all_equal(a, b)


def test_the_training_program_resizes_the_recipe_form_once_v_is_frozen(tmp_path):
    """8 workers halted past the 3-step warm-up, restored on 4 (``on_worker_change=
    "average"``): each new worker's ``w_i`` is the old workers' mean (decoded, re-encoded
    in int4), and the frozen ``v`` keeps its codes, scales and floor, since rounding it
    again would change every step's divisor. Halted inside the warm-up, where each worker
    holds its own slice of ``v``, the resize is refused and says how to go on."""
    from tests.test_quantized_dgc import _np_decode
    from tests.test_train import COMPRESSED_MOMENTUM, restore_checkpoint, small_digits
    from train import train

    changes = {
        **COMPRESSED_MOMENTUM,
        "compression.density_schedule.dgc_fraction": 0.0,
        "compression.residual_dtype": "",
        "compression.variant": "ef",
        "compression.residual_format": "int4/128/nearest",
        "optimizer.one_buffer": "on",
        "optimizer.frozen_nu_format": "int8",
    }
    workdir = str(tmp_path / "run")
    eight = small_digits(**changes)
    train.train_and_evaluate(eight, workdir, halt_after_step=5)
    old = restore_checkpoint(workdir, eight, 5)["opt_state"]  # as saved
    four = small_digits(num_workers=4, batch_size_per_worker=32, **changes)
    new = restore_checkpoint(workdir, four, 5)["opt_state"]

    def find(state, kind):
        leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind))
        return [x for x in leaves if isinstance(x, kind)]

    pairs = list(zip(*(find(s, rr.compressed_momentum.FrozenNu) for s in (old, new)), strict=True))
    assert pairs
    for a, b in pairs:
        assert a.codes.shape[0] == 8 and b.codes.shape[0] == 4
        np.testing.assert_array_equal(b.codes, np.broadcast_to(a.codes[0], b.codes.shape))
        np.testing.assert_array_equal(b.scales, a.scales)
        np.testing.assert_array_equal(b.floor, a.floor)
        assert b.warm.shape[0] == 4 and not np.asarray(b.warm).any()

    (old_ex,), (new_ex,) = (find(s, rr.ExchangeState) for s in (old, new))
    Quantized = rr.residual_formats.Quantized
    checked = 0
    for label, a in old_ex.residuals.items():
        if not isinstance(a, Quantized):
            continue
        b = new_ex.residuals[label]
        shape = (a.codes.shape[1] * 128,)  # whole blocks, padding included

        def decode(q, w, shape=shape):
            return _np_decode(Quantized(q.codes[w], q.scales[w]), "int4", shape)

        mean = np.mean([decode(a, w) for w in range(8)], axis=0)
        for w in range(4):  # the old workers' mean, rounded to the nearest int4 code
            step = np.repeat(np.asarray(b.scales[w]), 128)
            assert np.all(np.abs(decode(b, w) - mean) <= 0.5 * step * (1 + 1e-6)), label
        checked += 1
    assert checked

    warm = str(tmp_path / "warm")
    train.train_and_evaluate(eight, warm, halt_after_step=2)
    with pytest.raises(ValueError, match="until the warm-up ends"):
        restore_checkpoint(warm, four, 2)
