"""The one-buffer compressed Adam's saving at the compiled peak of the donated, guarded step.

Compressed-momentum Adam's compressed phase on an MLP whose largest leaf is an
embedding-like ``[8192, 512]`` kernel, 8 simulated workers, Top-k 1 %, ``skip_nonfinite``,
compiled from abstract shapes (nothing runs): one buffer per worker (``w_i = b1 m + e_i``
in float32, int8 or int4, the frozen ``v`` in int8) against two float32 buffers. What kept
the saving from the peak: docs/design.md, "One-buffer compressed momentum"; full-size
figures: benchmarks/results/peak_memory_one_buffer/.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from resireduce_jax.compressors import base
from tests import transform_harness as th

WORKERS = 8
BATCH = 64  # per worker
SHAPES = {"table": (8192, 512), "hidden": (512, 512), "head": (512, 10)}


def _loss(params: dict, batch: dict) -> jax.Array:
    x = jax.nn.relu(batch["x"] @ params["table"])
    x = jax.nn.relu(x @ params["hidden"])
    logits = x @ params["head"]
    picked = jnp.take_along_axis(logits, batch["label"][:, None], -1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


@functools.cache
def _compiled(w_format: str | None, local_devices: int | None = None) -> tuple[int, int]:
    """``(peak, optimizer + residual bytes)`` per worker of the compressed phase's guarded
    step: one buffer with ``w_format``, or two float32 buffers (``None``); flat, or
    hierarchical over nodes of ``local_devices`` (each store sharded over a node)."""
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    compressor = rr.compressors.topk(rr.compressors.dense_warmup(10, 0.01))
    local = {"local_axis": rr.parallel.LOCAL_AXIS} if local_devices else {}
    exchange = rr.error_feedback(compressor, min_size=1000, residual_format=w_format, **local)
    one = w_format is not None
    tx = rr.skip_nonfinite(
        rr.compressed_momentum_adam(
            1e-3, exchange, one_buffer=one, frozen_nu_format="int8" if one else "float32"
        )
    )
    batch = {
        "x": jax.ShapeDtypeStruct((WORKERS * BATCH, 8192), jnp.float32),
        "label": jax.ShapeDtypeStruct((WORKERS * BATCH,), jnp.int32),
    }
    mesh = rr.parallel.make_mesh(WORKERS, local_devices=local_devices)
    peak = th.abstract_step_memory(_loss, tx, params, batch, mesh, density_phase=1)
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P())
    states = rr.memory.model_state_bytes(params, optax.GradientTransformation(init, tx.update))
    return peak.peak, states.optimizer + states.residuals


@pytest.mark.parametrize("w_format", ["float32", "int8", "int4/128/nearest"])
def test_the_one_buffer_saving_reaches_the_guarded_peak(w_format):
    """The peak drops by at least 0.9 of the optimizer and residual bytes saved: the
    exchange's mean is added into the compensated residual's own buffer and taken again
    once ``w_i`` is stored, so the largest leaf never holds two float32 temporaries that
    two buffers keep in their donated ``m`` and ``e_i``."""
    peak, state = _compiled(w_format)
    two_peak, two_state = _compiled(None)
    saving = two_state - state
    assert saving > 0
    assert two_peak - peak >= 0.9 * saving, (two_peak - peak, saving)


@pytest.mark.parametrize("w_format", ["float32", "int4/128/nearest"])
def test_the_saving_reaches_the_peak_where_w_is_sharded_over_a_node(w_format):
    """The same with 2 nodes of 4 devices, each device keeping 1/4 of its node's ``w_i``
    (and, under two buffers, of ``e_i``): the node's shard of the mean is added into the
    shard's buffer, then the whole mean gathered from the shards once it is stored."""
    peak, state = _compiled(w_format, 4)
    two_peak, two_state = _compiled(None, 4)
    saving = two_state - state
    assert saving > 0
    assert two_peak - peak >= 0.9 * saving, (two_peak - peak, saving)


def test_sparse_mean_into_adds_the_scaled_mean_into_the_accumulator():
    """``acc + factor * mean`` of 4 workers' Top-k payloads, against numpy."""
    rng = np.random.default_rng(0)
    n, k, workers = 50, 6, 4
    values = rng.normal(size=(workers, k)).astype(np.float32)
    indices = np.stack([rng.choice(n, k, replace=False) for _ in range(workers)])
    indices[1, -1] = n + 3  # padding: dropped
    acc = rng.normal(size=(5, 10)).astype(np.float32)
    mesh = rr.parallel.make_mesh(workers)

    def into(v, i):
        return base.sparse_mean_into(v[0], i[0], jnp.asarray(acc), "data", 0.9)[None]

    sharded = NamedSharding(mesh, P("data"))
    got = jax.shard_map(into, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(
        jax.device_put(values, sharded), jax.device_put(indices.astype(np.int32), sharded)
    )
    dense = np.zeros(n + 10, np.float64)
    for w in range(workers):
        np.add.at(dense, indices[w], values[w])
    expected = acc + 0.9 * (dense[:n] / workers).reshape(5, 10)
    got = np.asarray(got)
    for w in range(workers):  # the same on every worker
        np.testing.assert_allclose(got[w], expected, rtol=1e-6, atol=1e-6)
