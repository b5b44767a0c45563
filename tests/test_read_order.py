"""Ordering each in-place weight update after the last read of the old weight.

The dataflow pass (``rr.read_order``) is checked against partners derived by hand from
the chain rule, and the step it orders against the unordered step: the same values bit for
bit, and no weight copied in the compiled program.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from resireduce_jax._src import read_order

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import guard_cost
import peak_memory

W = 8


def _chain_params(depth: int = 4, width: int = 16):
    rng = np.random.default_rng(0)
    return {
        f"layer_{i}": {
            "kernel": rng.normal(0, 0.3, (width, width)).astype(np.float32),
            "bias": np.zeros(width, np.float32),
        }
        for i in range(depth)
    }


def _chain_loss(params, x, remat: bool = False):
    def layer(p, h):
        return jnp.tanh(h @ p["kernel"] + p["bias"])

    if remat:
        layer = jax.checkpoint(layer)
    for i in range(len(params)):
        x = layer(params[f"layer_{i}"], x)
    return jnp.mean(x**2)


def _partners(loss, params, *args) -> dict[str, str | None]:
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    _, partners = read_order.call_with_read_partners(
        jax.value_and_grad(lambda p: loss(p, *args)), params, lambda out: out[1]
    )
    return {paths[i]: None if j is None else paths[j] for i, j in enumerate(partners)}


@pytest.mark.parametrize("remat", [False, True])
def test_each_kernel_waits_for_the_gradient_of_the_layer_below(remat):
    """Chain rule: the backward pass reads kernel i for dx_i = dy_i·W_iᵀ, which the
    gradients of layer i-1 (and nothing computed before them) depend on; its own gradient
    dW_i = x_iᵀ·dy_i does not. Layer 0's input needs no cotangent, so kernel 0 and every
    bias (read by the forward pass only) wait for their own gradient. With remat the
    forward reads repeat inside the backward pass; the partners are the same."""
    params = _chain_params()
    x = np.random.default_rng(1).normal(size=(8, 16)).astype(np.float32)
    partners = _partners(lambda p, x: _chain_loss(p, x, remat), params, x)
    for i in range(4):
        own = f"['layer_{i}']"
        assert partners[f"{own}['bias']"] == f"{own}['bias']"
        if i == 0:
            assert partners[f"{own}['kernel']"] == f"{own}['kernel']"
        else:
            assert partners[f"{own}['kernel']"] in {
                f"['layer_{i - 1}']['kernel']",
                f"['layer_{i - 1}']['bias']",
            }


def test_tied_weight_waits_for_a_gradient_after_its_last_read():
    """A weight read at both ends of the network (a tied embedding: lookup in, logits
    out) is read by the backward pass at its start (dh = dlogits·E); the first block's
    gradient depends on that read, the embedding's own (the lookup's scatter) does too."""
    rng = np.random.default_rng(0)
    params = {
        "embed": rng.normal(size=(50, 16)).astype(np.float32),
        "block": rng.normal(size=(16, 16)).astype(np.float32),
    }
    tokens = rng.integers(0, 50, (4, 8))

    def loss(p, tokens):
        h = jnp.tanh(p["embed"][tokens] @ p["block"])
        logits = h @ p["embed"].T
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    partners = _partners(loss, params, tokens)
    assert partners["['block']"] == "['embed']" or partners["['block']"] == "['block']"
    assert partners["['embed']"] in {"['embed']", "['block']"}


def test_weight_no_gradient_depends_on_gets_no_partner():
    """A weight whose reads feed only the loss value (its gradient is stopped) has no
    gradient that waits for them: no ordering, XLA decides (it copies, as unordered)."""
    params = {"used": np.ones((4, 4), np.float32), "stopped": np.ones((4, 4), np.float32)}
    x = np.ones((2, 4), np.float32)

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["used"])) + jnp.sum(jax.lax.stop_gradient(p["stopped"]) ** 2)

    partners = _partners(loss, params, x)
    assert partners["['stopped']"] is None
    assert partners["['used']"] == "['used']"


def _mlp_step(order: str):
    mesh = rr.parallel.make_mesh(W)
    tx = optax.chain(
        rr.resireduce(rr.compressors.topk(0.05), min_size=100),
        rr.optimizers.sgd(0.1, momentum=0.9),
    )

    def loss(p, batch):
        return _chain_loss(p, batch["x"])

    return rr.parallel.data_parallel_step(loss, tx, mesh, weight_update_order=order)


@pytest.mark.parametrize("order", ["all_gradients", "unordered"])
def test_ordering_changes_no_value(order):
    """Three steps of the default order and of ``order`` agree to float32 rounding. The
    barriers are identities, but XLA fuses differently around them (an update added to
    its weight in one fusion or in two rounds differently), so not bit for bit: at this
    size the largest difference is 2e-10 on a value of 1e-4."""
    results = []
    for o in ("last_read", order):
        step = _mlp_step(o)
        params, opt_state = step.init(_chain_params())
        losses = []
        for t in range(3):
            x = np.random.default_rng(t).normal(size=(W * 4, 16)).astype(np.float32)
            batch = rr.parallel.shard_batch({"x": x}, step.mesh)
            params, opt_state, metrics = step(params, opt_state, batch)
            losses.append(float(metrics["loss"]))
        results.append((jax.device_get(params), jax.device_get(opt_state), losses))
    (p0, s0, l0), (p1, s1, l1) = results
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-8)
    jax.tree.map(close, p0, p1)
    jax.tree.map(close, s0, s1)


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match=r"weight_update_order='late'.*'last_read'"):
        _mlp_step("late")


SIZES = {
    "transformer": dict(vocab=4096, width=256, depth=4, tokens=32, batch=4),
    "conv": dict(channels=(3, 32, 32, 64, 64), batch=8),
    "mlp": dict(width=512, depth=4, batch=8, features=128, classes=100),
}


def _weight_copies(step: dict) -> list[str]:
    return [
        c["source"]
        for c in peak_memory.copies(step["hlo"])
        if c["origin"] == "argument: params"
        and not (c["fused"] or c["transpose"])
        and c["bytes"] >= 4 * 10_000
    ]


@pytest.mark.parametrize("model", list(SIZES))
def test_default_order_copies_no_weight_and_peaks_no_higher_than_either_alternative(model):
    """Unordered, XLA copies the weights whose backward-pass reads it cannot order before
    the in-place write; ordering every update after every gradient holds every gradient
    alive. The default copies nothing and its compiled peak is the lower of the two (at
    this size within 0.5 %; full size: ``benchmarks/results/guard_cost.md``)."""
    peaks = {}
    for order in rr.parallel.WEIGHT_UPDATE_ORDERS:
        step = guard_cost.compile_peak(
            model, "ef", "sgd", "none", keep_hlo=True, weight_update_order=order, **SIZES[model]
        )
        peaks[order] = step["peak"]
        if order == "unordered":
            assert _weight_copies(step)
        else:
            assert not _weight_copies(step), order
    assert peaks["last_read"] <= 1.005 * min(peaks["unordered"], peaks["all_gradients"])


def test_scanned_layers_compile_without_weight_copies():
    """Stacked weights under ``lax.scan`` (opaque to the pass: the scan's outputs depend on
    every read it makes) still pair every weight with a gradient, and the compiled step
    copies no weight and peaks no higher than the unordered one."""

    def loss(p, batch):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(layer, batch["x"] @ p["inp"], p["stack"])
        return jnp.mean((h @ p["out"]) ** 2)

    shapes = {"inp": (64, 256), "stack": (4, 256, 256), "out": (256, 10)}
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    mesh = rr.parallel.make_mesh(W)
    on = functools.partial(NamedSharding, mesh)
    peaks, copied = {}, {}
    for order in ("unordered", "last_read"):
        tx = optax.chain(
            rr.error_feedback(rr.compressors.topk(0.01)), rr.optimizers.sgd(0.1, momentum=0.9)
        )
        step = rr.parallel.data_parallel_step(loss, tx, mesh, weight_update_order=order)
        step.state_specs, state = rr.parallel.abstract_state(tx, params, mesh)
        sharded = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=on(P())) for k, v in params.items()
        }
        batch = {"x": jax.ShapeDtypeStruct((W * 8, 64), jnp.float32, sharding=on(P("data")))}
        compiled = step.lower(sharded, state, batch).compile()
        peaks[order] = rr.hlo.peak_memory(compiled).peak
        copied[order] = _weight_copies({"hlo": compiled.as_text()})
    assert not copied["last_read"]
    assert peaks["last_read"] <= peaks["unordered"]
