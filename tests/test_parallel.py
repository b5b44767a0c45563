"""The shard_map data-parallel step: replicated params, per-worker residuals, collectives."""

from __future__ import annotations

import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import resireduce_jax as rr
from resireduce_jax import hlo

W = 8
MIN_SIZE = 1000


def _mlp_params(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        "hidden": {
            "kernel": rng.normal(0, 0.1, (32, 64)).astype(np.float32),
            "bias": np.zeros(64, np.float32),
        },
        "out": {
            "kernel": rng.normal(0, 0.1, (64, 40)).astype(np.float32),
            "bias": np.zeros(40, np.float32),
        },
    }


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["hidden"]["kernel"] + params["hidden"]["bias"])
    logits = h @ params["out"]["kernel"] + params["out"]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _batch(step: int, per_worker: int = 4):
    rng = np.random.default_rng(100 + step)
    n = W * per_worker
    return {"x": rng.normal(size=(n, 32)).astype(np.float32), "y": rng.integers(0, 40, n)}


def _shards(x: jax.Array) -> list[np.ndarray]:
    return [np.asarray(s.data) for s in sorted(x.addressable_shards, key=lambda s: s.device.id)]


def test_twenty_steps_keep_params_identical_on_every_worker_while_residuals_differ():
    mesh = rr.parallel.make_mesh(W)
    tx = optax.chain(
        rr.error_feedback(rr.compressors.topk(0.01), min_size=MIN_SIZE),
        optax.sgd(0.1, momentum=0.9),
    )
    step = rr.parallel.data_parallel_step(_loss, tx, mesh)
    params, opt_state = step.init(_mlp_params())
    losses = []
    for t in range(20):
        params, opt_state, metrics = step(
            params, opt_state, rr.parallel.shard_batch(_batch(t), mesh)
        )
        if t % 5 == 4:
            losses.append(float(metrics["loss"]))  # blocks every few steps (CPU rendezvous)
    for leaf in jax.tree.leaves(params):
        copies = _shards(leaf)
        assert len(copies) == W
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0])
    residual = opt_state[0].residuals["hidden/kernel"]
    assert residual.shape == (W, 32, 64)
    assert residual.sharding.spec[0] == "data"
    per_worker = np.asarray(residual)
    assert all(not np.array_equal(per_worker[0], per_worker[w]) for w in range(1, W))
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_lossless_step_equals_full_batch_gradient_descent():
    """Local gradients + exact mean = the gradient of the mean loss over the global batch."""
    mesh = rr.parallel.make_mesh(W)
    tx = optax.chain(rr.error_feedback(rr.compressors.none(), min_size=MIN_SIZE), optax.sgd(0.5))
    step = rr.parallel.data_parallel_step(_loss, tx, mesh)
    params, opt_state = step.init(_mlp_params())
    ref = jax.tree.map(jnp.asarray, _mlp_params())
    for t in range(3):
        batch = _batch(t)
        params, opt_state, _ = step(params, opt_state, rr.parallel.shard_batch(batch, mesh))
        grads = jax.grad(_loss)(ref, batch)  # one device, whole batch
        ref = jax.tree.map(lambda p, g: p - 0.5 * g, ref, grads)
    chex.assert_trees_all_close(jax.device_get(params), jax.device_get(ref), rtol=2e-5, atol=2e-6)


def test_clipping_before_the_exchange_clips_each_workers_local_gradient():
    """chain(clip_by_global_norm(c), exchange, sgd): each worker clips its own gradient by
    its own global norm, before compression; the exchange averages the clipped ones."""
    mesh = rr.parallel.make_mesh(W)
    clip, lr = 0.05, 0.5
    tx = optax.chain(
        optax.clip_by_global_norm(clip),
        rr.error_feedback(rr.compressors.none(), min_size=MIN_SIZE),
        optax.sgd(lr),
    )
    step = rr.parallel.data_parallel_step(_loss, tx, mesh)
    params, opt_state = step.init(_mlp_params())
    batch = _batch(0)
    params, _, _ = step(params, opt_state, rr.parallel.shard_batch(batch, mesh))
    clipped, norms = [], []
    per_worker = len(batch["y"]) // W
    for w in range(W):  # worker w's local gradient, on one device, clipped by numpy
        rows = slice(w * per_worker, (w + 1) * per_worker)
        local = {k: v[rows] for k, v in batch.items()}
        grads = jax.tree.map(np.asarray, jax.grad(_loss)(_mlp_params(), local))
        norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in jax.tree.leaves(grads)))
        norms.append(norm)
        clipped.append(jax.tree.map(lambda g, n=norm: g * min(1.0, clip / n), grads))
    assert min(norms) > clip  # every worker's gradient is clipped
    mean = jax.tree.map(lambda *gs: np.mean(gs, axis=0), *clipped)
    expected = jax.tree.map(lambda p, g: p - lr * g, _mlp_params(), mean)
    chex.assert_trees_all_close(jax.device_get(params), expected, rtol=1e-5, atol=1e-6)
    # Not what clipping after the exchange gives: the mean (here the full batch's
    # gradient) clipped by its own norm.
    full = jax.tree.map(np.asarray, jax.grad(_loss)(_mlp_params(), batch))
    full_norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in jax.tree.leaves(full)))
    scaled = jax.tree.map(lambda p, g: p - lr * g * min(1.0, clip / full_norm), _mlp_params(), full)
    assert not np.allclose(jax.device_get(params)["out"]["kernel"], scaled["out"]["kernel"])


def test_the_exchange_page_says_what_clipping_before_the_exchange_does():
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "exchange.md").read_text()
    section = " ".join(page.split("## Where the transforms run", 1)[1].split("\n## ", 1)[0].split())
    assert "`optax.chain(optax.clip_by_global_norm(c), exchange, optimizer)`" in section
    assert "by its own local norm, before compression" in section, section


def _compiled_step(compressor):
    mesh = rr.parallel.make_mesh(W)
    tx = optax.chain(rr.error_feedback(compressor, min_size=MIN_SIZE), optax.sgd(0.1))
    step = rr.parallel.data_parallel_step(_loss, tx, mesh)
    params, opt_state = step.init(_mlp_params())
    return step.lower(params, opt_state, rr.parallel.shard_batch(_batch(0), mesh)).compile()


def test_sparse_step_has_no_gradient_sized_all_reduce_and_moves_payload_bytes():
    compressor = rr.compressors.topk(0.01)
    compiled = _compiled_step(compressor)
    found = hlo.collectives(compiled)
    kernel_sizes = {32 * 64, 64 * 40}
    for c in found:
        if c.op == "all-reduce":
            assert not kernel_sizes & set(c.element_counts), c
    # Gathers carry exactly the two kernels' payloads; all-reduces the dense biases + loss.
    gathered = sum(c.bytes_per_worker for c in found if c.op == "all-gather")
    assert gathered == compressor.payload_bytes((32, 64), np.float32) + compressor.payload_bytes(
        (64, 40), np.float32
    )
    reduced = sum(c.bytes_per_worker for c in found if c.op == "all-reduce")
    assert reduced == (64 + 40 + 1) * 4


def test_dense_step_does_all_reduce_the_kernels():
    """The check above can fail: without compression the kernels are all-reduced."""
    found = hlo.collectives(_compiled_step(rr.compressors.none()))
    counts = {n for c in found if c.op == "all-reduce" for n in c.element_counts}
    assert {32 * 64, 64 * 40} <= counts


def test_model_state_and_rng_flags():
    mesh = rr.parallel.make_mesh(W)

    def loss_fn(params, model_state, batch, rng):
        noise = jax.random.uniform(rng, ())
        loss = jnp.mean((batch["x"] @ params["w"]) ** 2)
        new_state = {"seen": model_state["seen"] + batch["x"].shape[0], "noise": noise}
        return loss, (new_state, {"noise": noise})

    tx = rr.compressed_mean(rr.compressors.none())
    step = rr.parallel.data_parallel_step(
        loss_fn, tx, mesh, has_aux=True, with_model_state=True, with_rng=True
    )
    params, opt_state = step.init({"w": jnp.ones((3, 2))})
    model_state = rr.parallel.replicated({"seen": jnp.zeros(()), "noise": jnp.zeros(())}, mesh)
    rng = jax.random.PRNGKey(7)
    batch = rr.parallel.shard_batch({"x": np.ones((W * 2, 3), np.float32)}, mesh)
    params, opt_state, model_state, metrics = step(params, opt_state, model_state, batch, rng)
    expected_noise = np.mean(
        [jax.random.uniform(jax.random.fold_in(rng, w), ()) for w in range(W)], dtype=np.float32
    )
    np.testing.assert_allclose(metrics["noise"], expected_noise, rtol=1e-6)
    np.testing.assert_allclose(model_state["noise"], expected_noise, rtol=1e-6)
    assert float(model_state["seen"]) == 2.0  # per-worker count, averaged


def test_chain_without_gradient_averaging_is_refused():
    mesh = rr.parallel.make_mesh(W)
    step = rr.parallel.data_parallel_step(_loss, optax.sgd(0.1), mesh)
    params, opt_state = step.init(_mlp_params())
    with pytest.raises(ValueError, match="FIRST in the chain"):
        step(params, opt_state, rr.parallel.shard_batch(_batch(0), mesh))


def test_batch_not_divisible_by_workers_is_refused():
    mesh = rr.parallel.make_mesh(W)
    with pytest.raises(ValueError, match="multiple of the number of workers"):
        rr.parallel.shard_batch({"x": np.zeros((W * 2 + 1, 3))}, mesh)


def test_too_many_workers_is_refused():
    with pytest.raises(ValueError, match="devices are visible"):
        rr.parallel.make_mesh(len(jax.devices()) + 1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_invalid_steps_in_flight_is_refused(bad):
    with pytest.raises(ValueError, match="max_steps_in_flight"):
        rr.parallel.data_parallel_step(
            _loss,
            rr.error_feedback(rr.compressors.topk(0.1)),
            rr.parallel.make_mesh(W),
            max_steps_in_flight=bad,
        )


# A plain loop: a new shard_batch every step, never blocking. On XLA:CPU with 8 simulated
# devices a 256-wide MLP under AdamW aborts in an all-gather's rendezvous within its first
# steps when nothing bounds the queued steps (docs/design.md, "CPU collectives and queued
# steps"); the step's own bound must let it finish, and the bound must change no value
# (the blocked loop's params).
_UNBLOCKED_LOOP = """
from resireduce_jax import runtime
runtime.configure_cpu(8, collective_timeout_s=10)
import jax, jax.numpy as jnp, numpy as np, optax
import resireduce_jax as rr

def loss(p, b):
    h = b["x"]
    for i in range(3):
        h = jnp.tanh(h @ p[f"d{i}"])
    return jnp.mean((h - b["y"]) ** 2)

def train(block):
    keys = jax.random.split(jax.random.key(0), 3)
    params = {f"d{i}": jax.random.normal(keys[i], (256, 256)) / 16 for i in range(3)}
    tx = optax.chain(rr.error_feedback(rr.compressors.topk(0.01)), optax.adamw(1e-3))
    mesh = rr.parallel.make_mesh()
    step = rr.parallel.data_parallel_step(loss, tx, mesh)
    assert step.steps_in_flight_limit == rr.parallel.CPU_STEPS_IN_FLIGHT
    params, state = step.init(params)
    rng = np.random.default_rng(0)
    for _ in range(120):
        x = rng.standard_normal((64, 256), dtype=np.float32)
        batch = rr.parallel.shard_batch({"x": x, "y": np.zeros_like(x)}, mesh)
        params, state, metrics = step(params, state, batch)
        if block:
            jax.block_until_ready(metrics)
    return jax.device_get(params)

free, blocked = train(block=False), train(block=True)
for k in free:
    np.testing.assert_array_equal(free[k], blocked[k])
print("OK")
"""


def test_unblocked_wide_loop_on_cpu_finishes_with_the_blocked_loops_params():
    import os
    import subprocess
    import sys

    # A user's process: its own configure_cpu flags, XLA's default compile (not the session's).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-c", _UNBLOCKED_LOOP],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
