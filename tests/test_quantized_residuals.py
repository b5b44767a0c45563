"""Residuals kept in a residual format (codes with per-block scales) by every kind of store:
the exchange sends what float32 error feedback sends, keeps its residual within the
format's rounding, counts its bytes exactly, and resumes, resizes and rounds reproducibly."""

from __future__ import annotations

import importlib.util
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import resireduce_jax as rr
from resireduce_jax import residual_formats
from train import config_schema, train

W = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMATS = ("int8", "float8", "int4", "int3")


def _params(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        f"d{i}": {
            "kernel": rng.normal(0, 0.1, (64, 64)).astype(np.float32),
            "bias": np.zeros(64, np.float32),
        }
        for i in range(4)
    }


def _loss(params, batch):
    h = batch["x"]
    for i in range(4):
        h = jnp.tanh(h @ params[f"d{i}"]["kernel"] + params[f"d{i}"]["bias"])
    return jnp.mean((h - batch["y"]) ** 2)


def _batch(seed: int):
    rng = np.random.default_rng(100 + seed)
    return {
        "x": rng.normal(size=(W * 4, 64)).astype(np.float32),
        "y": rng.normal(size=(W * 4, 64)).astype(np.float32),
    }


def _ef(fmt=None):
    return rr.error_feedback(rr.compressors.topk(0.05), min_size=1000, residual_format=fmt)


def _w2d(fmt=None):
    return rr.resireduce(
        rr.compressors.topk(0.05),
        min_size=1000,
        grouping=rr.grouping.regex([(r"d[123]/kernel", "hidden")]),
        inter="weighted",
        intra="2d",
        intra_layers=r"d0/",
        residual_format=fmt,
    )


def _run(exchange, steps: int):
    mesh = rr.parallel.make_mesh(W)
    tx = rr.skip_nonfinite(optax.chain(exchange, rr.optimizers.sgd(0.1)))
    step = rr.parallel.data_parallel_step(_loss, tx, mesh)
    params, state = step.init(_params())
    for t in range(steps):
        params, state, _ = step(params, state, rr.parallel.shard_batch(_batch(t), mesh))
    (ex,) = rr.exchange.exchange_states(state)
    return params, ex


def _block_bound(r: np.ndarray, fmt: residual_formats.BlockFormat) -> np.ndarray:
    """Per element, the largest rounding error of ``fmt``'s rounding of ``r``: half a step
    for nearest rounding, a whole step for stochastic."""
    flat = r.reshape(-1)
    size = fmt.block_size
    padded = np.zeros(-(-flat.size // size) * size, np.float32)
    padded[: flat.size] = flat
    absmax = np.abs(padded.reshape(-1, size)).max(axis=1, keepdims=True)
    if fmt.codes == "float8":  # 3 mantissa bits of the scaled value, and the subnormal floor
        bound = np.maximum(np.abs(padded.reshape(-1, size)) * 2.0**-4, absmax / 448 * 2.0**-10)
    else:
        bound = np.broadcast_to(
            absmax / {"int8": 127, "int4": 7, "int3": 3}[fmt.codes] / 2, (len(absmax), size)
        )
    bound = bound * (2 if fmt.stochastic else 1)
    return bound.reshape(-1)[: flat.size].reshape(r.shape) * (1 + 1e-5) + 1e-12


@pytest.mark.parametrize("name", FORMATS)
def test_error_feedback_sends_what_float32_sends_and_rounds_only_its_residual(name):
    fmt = residual_formats.parse_format(name)
    params, ex = _run(_ef(fmt), 1)
    ref_params, ref = _run(_ef(), 1)
    # From R = 0 both compensate alike and send the same payload: the same update.
    chex.assert_trees_all_equal(params, ref_params)
    plan = _ef().plan(_params())
    got = rr.exchange.leaf_residuals(ex, _ef(fmt).plan(_params()))
    want = rr.exchange.leaf_residuals(ref, plan)
    for path, r in want.items():
        r = np.asarray(r)
        error = np.abs(np.asarray(got[path]) - r)
        assert (error <= _block_bound(r, fmt)).all(), path
        assert error.max() > 0  # it is rounded


@pytest.mark.parametrize("make", [_ef, _w2d], ids=["ef", "w+2d"])
@pytest.mark.parametrize("name", FORMATS)
def test_residual_bytes_are_the_codes_and_scales_of_every_store(make, name):
    fmt = residual_formats.parse_format(name)
    _, ex = _run(make(fmt), 2)
    per_worker = sum(x.nbytes for x in jax.tree.leaves(ex.residuals)) // W
    assert make(fmt).plan(_params()).residual_bytes() == per_worker
    # Hand-derived: every stored value takes its code width, every block one float32.
    code_bits = {"int8": 8, "float8": 8, "int4": 4, "int3": 3}[name]
    if make is _ef:
        elements, indices = 4 * 64 * 64, 0
    else:  # one shared 64 x 64 residual, d0's 32 x 32 block and its 32 + 32 indices
        elements, indices = 64 * 64 + 32 * 32, (32 + 32) * 4
    stores = 4 if make is _ef else 2
    blocks = (
        stores * -(-64 * 64 // fmt.block_size)
        if make is _ef
        else -(-64 * 64 // fmt.block_size) + -(-32 * 32 // fmt.block_size)
    )
    assert per_worker == elements * code_bits // 8 + 4 * blocks + indices


def test_int4_keeps_at_most_a_seventh_of_float32_error_feedbacks_bytes():
    float32 = _ef().plan(_params()).residual_bytes()
    int4 = _ef("int4").plan(_params()).residual_bytes()
    assert int4 <= 0.14 * float32


def test_shared_and_2d_stores_train_in_every_format():
    losses = {}
    for name in (None, *FORMATS):
        mesh = rr.parallel.make_mesh(W)
        tx = optax.chain(_w2d(name), rr.optimizers.sgd(0.1))
        step = rr.parallel.data_parallel_step(_loss, tx, mesh)
        params, state = step.init(_params())
        for t in range(6):
            params, state, metrics = step(params, state, rr.parallel.shard_batch(_batch(t), mesh))
        losses[name] = float(metrics["loss"])
        (ex,) = rr.exchange.exchange_states(state)
        if name is not None:
            assert isinstance(ex.residuals["hidden"], residual_formats.Quantized)
            assert isinstance(ex.residuals["d0/kernel"].values, residual_formats.Quantized)
    for name in FORMATS:
        np.testing.assert_allclose(losses[name], losses[None], rtol=1e-3)


def test_stochastic_rounding_is_reproducible_and_differs_between_workers():
    fmt = residual_formats.BlockFormat("int8", rounding="stochastic")
    _, a = _run(_ef(fmt), 2)
    _, b = _run(_ef(fmt), 2)
    chex.assert_trees_all_equal(a.residuals, b.residuals)
    codes = np.asarray(a.residuals["d1/kernel"].codes)
    assert not np.array_equal(codes[0], codes[1])
    _, nearest = _run(_ef("int8"), 2)
    assert not np.array_equal(codes, np.asarray(nearest.residuals["d1/kernel"].codes))


def test_resize_workers_keeps_the_mean_residual_within_the_rounding():
    fmt = residual_formats.parse_format("int8")
    tx = _w2d(fmt)
    mesh = rr.parallel.make_mesh(W)
    chain = optax.chain(tx, rr.optimizers.sgd(0.1))
    step = rr.parallel.data_parallel_step(_loss, chain, mesh)
    params, state = step.init(_params())
    for t in range(2):
        params, state, _ = step(params, state, rr.parallel.shard_batch(_batch(t), mesh))
    (ex,) = rr.exchange.exchange_states(state)
    (specs,) = rr.exchange.exchange_states(step.state_specs)
    plan = tx.plan(_params())
    host = jax.tree.map(np.asarray, ex)
    resized = rr.exchange.resize_workers(host, specs, plan, 4)
    old = rr.exchange.store_residuals(host, plan)
    new = rr.exchange.store_residuals(resized, plan)
    store = plan.store_of("d1/kernel")

    def worker(stored, w):
        return np.asarray(store.densify(jax.tree.map(lambda x: x[w], stored)))

    mean = np.mean([worker(old["hidden"], w) for w in range(W)], 0)
    for w in range(4):
        got = worker(new["hidden"], w)
        assert (np.abs(got - mean) <= _block_bound(mean, fmt)).all()


def _digits(**changes):
    path = os.path.join(ROOT, "configs", "default.py")
    spec = importlib.util.spec_from_file_location("configs_default", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.num_steps, c.log_every, c.eval_every, c.checkpoint_every = 10, 2, 10, 4
    for key, value in changes.items():
        section, leaf = key.split(".")
        c[section][leaf] = value
    return c


def test_a_quantized_run_resumes_bit_identically(tmp_path):
    config = _digits(**{"compression.residual_format": "int4/64/stochastic"})
    full = train.train_and_evaluate(config, str(tmp_path / "full"))
    first = train.train_and_evaluate(config, str(tmp_path / "split"), halt_after_step=5)
    assert first.preempted
    second = train.train_and_evaluate(config, str(tmp_path / "split"))
    assert second.step == full.step == 10
    a = train.final_state(str(tmp_path / "full"))
    b = train.final_state(str(tmp_path / "split"))
    chex.assert_trees_all_equal(a, b)
    codes = [x for x in jax.tree.leaves(a["opt_state"]) if x.dtype == np.uint8]
    assert codes and all(c.shape[0] == W for c in codes)  # int4 codes, per worker


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"compression.residual_format": "int2"}, "compression.residual_format='int2'"),
        (
            {"compression.residual_format": "int8", "compression.residual_dtype": "bfloat16"},
            "give one",
        ),
        (
            {"compression.residual_format": "int8", "compression.variant": "none"},
            "keeps no residuals",
        ),
    ],
)
def test_bad_residual_formats_are_refused_before_anything_runs(changes, message):
    with pytest.raises(config_schema.ConfigError, match=message):
        config_schema.validate(_digits(**changes))
