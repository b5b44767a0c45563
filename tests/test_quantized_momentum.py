"""Compressed momentum (1-bit Adam's error-compensated momentum exchange, Tang et al. 2021,
§3) with its momentum error in a residual format: per worker, what the momentum did not
send stays in the residual up to the format's rounding (checked in the decoded layout
with a NumPy decoder), the optimizers train in every format, and the bytes are exact."""

from __future__ import annotations

import inspect
import math

import jax
import numpy as np
import optax
import pytest

import resireduce_jax as rr
from resireduce_jax import residual_formats
from tests.test_quantized_dgc import _np_decode, _Stepper

WORKERS = 4
BETA = 0.9
SHAPES = {"a": (30, 50), "b": (60, 60), "bias": (40,)}  # a, b compressed (min_size 1000)
FORMATS = ["int8", "float8", "int4", "int4/64/stochastic", "bfloat16"]
# Two buffers, so that the residual is the momentum error alone (where the optimizers take
# one_buffer=, a leaf's own store would otherwise hold b1 m + e_i).
TWO_BUFFERS = (
    {"one_buffer": False}
    if "one_buffer" in inspect.signature(rr.compressed_momentum_sgd).parameters
    else {}
)


def _params():
    return {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}


def _grads(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        {k: rng.normal(size=(WORKERS, *s)).astype(np.float32) for k, s in SHAPES.items()}
        for _ in range(steps)
    ]


def _exchange(name, compressor=None):
    return rr.error_feedback(
        compressor or rr.compressors.topk(0.05), min_size=1000, residual_format=name
    )


def _decoded(stored, name: str, shape) -> np.ndarray:
    """One worker's residual in the leaf's layout, decoded by NumPy."""
    fmt = residual_formats.parse_format(name)
    if isinstance(fmt, residual_formats.FloatFormat):
        return np.asarray(stored, np.float32)
    return _np_decode(stored, fmt.codes, shape)


def _bound(e: np.ndarray, stored, name: str) -> np.ndarray:
    """The largest rounding error of each kept value: from the stored scales, half a code
    step (nearest int8 / int4), one step (stochastic), 3 mantissa bits (float8, bfloat16:
    8)."""
    fmt = residual_formats.parse_format(name)
    if isinstance(fmt, residual_formats.FloatFormat):
        return np.abs(e) * 2.0**-8 * (1 + 2.0**-7)
    size = e.size
    scale = np.repeat(np.asarray(stored.scales, np.float64), fmt.block_size)[:size]
    scale = scale.reshape(e.shape)
    if fmt.codes == "float8":
        return np.maximum(np.abs(e) * 2.0**-3, scale * 2.0**-9)
    return scale if fmt.stochastic else scale / 2


@pytest.mark.parametrize("name", FORMATS)
def test_sgd_momentum_error_is_conserved_within_the_rounding(name):
    """Per worker: ``m_i = g_i + b m``, ``c_i = m_i + e_i`` is sent compressed, the new
    momentum is the mean of what was sent, and ``e_i'`` keeps ``c_i - sent_i`` rounded. So
    ``mean_i (g_i + b m + e_i - e_i') - m'`` is the mean rounding error of ``e'``."""
    tx = rr.compressed_momentum_sgd(0.1, _exchange(name), momentum=BETA, **TWO_BUFFERS)
    stepper = _Stepper(tx, _params(), WORKERS)
    state = jax.device_get(stepper.init(stepper.params))
    worst = 0.0
    for t, grads in enumerate(_grads(4, seed=1)):
        _, new = stepper(state, grads)
        for k in ("a", "b"):
            shape = SHAPES[k]
            m_old = np.asarray(state.mu[k], np.float64)
            m_new = np.asarray(new.mu[k], np.float64)

            def worker(s, w, k=k, shape=shape):
                stored = jax.tree.map(lambda x, w=w: x[w], s.exchange.residuals[k])
                return stored, _decoded(stored, name, shape).astype(np.float64)

            kept, bounds = [], []
            for w in range(WORKERS):
                _, e_old = worker(state, w)
                stored, e_new = worker(new, w)
                kept.append(grads[k][w] + BETA * m_old + e_old - e_new)
                bounds.append(_bound(e_new, stored, name))
            error = np.abs(np.mean(kept, 0) - m_new)
            slack = 1e-6 * (np.abs(m_new).max() + max(np.abs(v).max() for v in kept))
            assert (error <= np.mean(bounds, 0) * (1 + 1e-5) + slack).all(), (t, k)
            worst = max(worst, float(error.max()))
            assert (m_new != 0).mean() < 0.5  # the momentum is the sparse mean sent
        state = new
    assert worst > 1e-7  # the residual is rounded


@pytest.mark.parametrize("name", FORMATS)
def test_compressed_momentum_adam_trains_in_every_format(name):
    """Adam with a dense warm-up of 2 steps, then Top-k 5 % of the update's direction:
    finite updates, residuals kept in the format, and the update after the warm-up within
    a few percent of float32 error feedback's."""
    compressor = rr.compressors.topk(rr.compressors.dense_warmup(2, 0.05))
    grads = _grads(5, seed=2)

    def run(fmt):
        tx = rr.compressed_momentum_adam(1e-2, _exchange(fmt, compressor), **TWO_BUFFERS)
        stepper = _Stepper(tx, _params(), WORKERS)
        state, outs = stepper.init(stepper.params), []
        for g in grads:
            out, state = stepper(state, g)
            outs.append(out)
        return outs, state

    outs, state = run(name)
    ref, _ = run(None)
    stored = state.exchange.residuals["b"]
    if name == "bfloat16":
        assert stored.dtype == np.dtype("bfloat16")
    else:
        assert isinstance(stored, residual_formats.Quantized)
    for out in outs:
        for k in SHAPES:
            assert np.isfinite(out[k]).all()
    for k in ("a", "b"):  # the first compressed step starts from R = 0: the same update
        np.testing.assert_array_equal(outs[2][k], ref[2][k])
        total = np.abs(ref[4][k]).sum()
        assert np.abs(outs[4][k] - ref[4][k]).sum() <= 0.25 * total, k


@pytest.mark.parametrize("name", ["int4", "int8", "bfloat16"])
def test_model_state_bytes_of_compressed_momentum(name):
    """The residuals are the exchange's codes and scales: a: 1500 values, b: 3600 values.
    int4 blocks of 128: 12 and 29 blocks of 64 + 4 bytes; int8 blocks of 256: 6 and 15
    blocks of 256 + 4; bfloat16: 2 bytes a value. The momentum (replicated) is float32."""
    blocks = {
        "int4": (12 + 29) * (64 + 4),
        "int8": (6 + 15) * (256 + 4),
        "bfloat16": (1500 + 3600) * 2,
    }
    assert math.ceil(1500 / 128) == 12 and math.ceil(3600 / 128) == 29
    assert math.ceil(1500 / 256) == 6 and math.ceil(3600 / 256) == 15
    exchange = _exchange(name)
    tx = rr.compressed_momentum_sgd(0.1, exchange, momentum=BETA, **TWO_BUFFERS)
    m = rr.memory.model_state_bytes(_params(), tx)
    assert m.residuals == blocks[name] == exchange.plan(_params()).residual_bytes()
    assert m.optimizer >= (1500 + 3600 + 40) * 4  # m per leaf, replicated, in float32
    state = jax.eval_shape(tx.init, _params())
    assert rr.memory.tree_bytes(state.exchange.residuals) == blocks[name]
    assert isinstance(tx, optax.GradientTransformation)
