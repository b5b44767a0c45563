"""Which optimizer-state leaves are per-worker: ``parallel.state_partition_specs``.

The reference is the fixed point written out: trace the update with the leaves found so far
cast to varying, again and again, until the set stops growing. The library stops after one
trace when no other leaf depends on the new ones (``varying_dependence``); both must give
the same layout for every transform the library builds, and for transforms whose layout
needs a second trace.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from resireduce_jax._src import varying_dependence
from tests import test_layer_stacks as stacks
from tests import transform_harness as th

C = rr.compressors


def fixed_point_specs(tx, params, mesh, axis_name):
    """The per-worker leaves by tracing until nothing changes (no dependence analysis)."""
    axes = set(axis_name if isinstance(axis_name, tuple) else (axis_name,))
    sharded = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(mesh, P())),
        params,
    )
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P())
    flags = jax.tree.map(lambda _: False, jax.eval_shape(init, sharded))
    found = []

    def probe(params, flags):
        state = jax.tree.map(
            lambda s, v: lax.pcast(s, axis_name, to="varying") if v else s,
            tx.init(params),
            flags,
        )
        grads = jax.tree.map(
            lambda p: lax.pcast(jnp.zeros_like(p), axis_name, to="varying"), params
        )
        _, new = tx.update(grads, state, params)
        found.append(
            jax.tree.map(lambda x: bool(axes & set(jax.typeof(x).manual_axis_type.varying)), new)
        )
        return jax.tree.map(lambda x: x[None], new)

    rounds = 0
    while True:
        rounds += 1
        found.clear()
        fn = jax.shard_map(
            functools.partial(probe, flags=flags), mesh=mesh, in_specs=P(), out_specs=P(axis_name)
        )
        jax.eval_shape(fn, sharded)
        new = jax.tree.map(lambda a, b: a or b, flags, found[-1])
        if new == flags:
            break
        flags = new
    return jax.tree.map(lambda v: P(axis_name) if v else P(), flags), rounds


def assert_same_layout(tx, params, mesh=None, axis_name=th.AXIS):
    mesh = mesh if mesh is not None else th.mesh(8)
    got = rr.parallel.state_partition_specs(tx, params, mesh, axis_name)
    want, rounds = fixed_point_specs(tx, params, mesh, axis_name)
    assert got == want
    return want, rounds


STACK_PARAMS = stacks.unstack(stacks.zeros(stacks.stacked_shapes()))


@pytest.mark.parametrize("variant", list(stacks.VARIANTS))
def test_every_exchange_variant_has_the_fixed_points_layout(variant):
    make = stacks.VARIANTS[variant]
    specs, _ = assert_same_layout(make(), STACK_PARAMS)
    if variant != "compressed_mean":  # no state of its own but the count
        assert P(th.AXIS) in jax.tree.leaves(specs)  # its residuals are per worker
    hierarchical = rr.parallel.make_mesh(stacks.W, local_devices=stacks.L)
    assert_same_layout(make(local_axis="local"), STACK_PARAMS, hierarchical, ("data", "local"))


MLP = {
    "hidden": {"kernel": np.zeros((64, 96), np.float32), "bias": np.zeros(96, np.float32)},
    "out": {"kernel": np.zeros((96, 40), np.float32)},
}


def _exchange():
    return rr.resireduce(C.topk(0.05), min_size=1000, intra_layers="hidden/kernel")


CHAINS = {
    "guard-loss-adamw": lambda: rr.skip_nonfinite(
        optax.chain(_exchange(), optax.adamw(1e-3)), th.AXIS
    ),
    "guard-strict-sgd": lambda: rr.skip_nonfinite(
        optax.chain(_exchange(), optax.sgd(0.1, momentum=0.9)), th.AXIS, mode="strict"
    ),
    "guard-lean-adamw": lambda: rr.skip_nonfinite(
        optax.chain(_exchange(), optax.adamw(1e-3)), th.AXIS, mode="lean"
    ),
    "adamw_r": lambda: optax.chain(_exchange(), rr.optimizers.adamw_r(1e-3)),
    "adan_r": lambda: optax.chain(_exchange(), rr.optimizers.adan_r(1e-3)),
    "lion_r": lambda: optax.chain(_exchange(), rr.optimizers.lion_r(1e-4)),
    "dgc": lambda: rr.deep_gradient_compression(C.topk(0.05), 0.1, min_size=1000),
    "compressed_momentum_adam": lambda: rr.compressed_momentum_adam(
        1e-3,
        rr.resireduce(C.topk(C.dense_warmup(2, 0.05)), min_size=1000, intra_layers="hidden/k.*"),
    ),
}


@pytest.mark.parametrize("chain", list(CHAINS))
def test_optimizer_chains_have_the_fixed_points_layout(chain):
    assert_same_layout(CHAINS[chain](), MLP)


class Relay(NamedTuple):
    first: jax.Array
    second: jax.Array
    total: jax.Array
    count: jax.Array


def relay(through_psum: bool) -> optax.GradientTransformation:
    """``first`` takes the worker's gradient; ``second`` takes ``first`` (directly, or
    through a psum over the workers); ``total`` the psum of the gradient; ``count`` steps."""

    def init(params):
        z = jnp.zeros_like(params["w"])
        return Relay(z, z, z, jnp.zeros([], jnp.int32))

    def update(grads, state, params=None):
        g = grads["w"]
        passed = lax.psum(state.first, th.AXIS) if through_psum else state.first
        new = Relay(state.first + g, state.second + passed, lax.psum(g, th.AXIS), state.count + 1)
        return grads, new

    return optax.GradientTransformation(init, update)


def test_a_leaf_varying_through_another_needs_the_second_trace():
    specs, rounds = assert_same_layout(relay(through_psum=False), {"w": np.zeros(8, np.float32)})
    assert specs == Relay(P(th.AXIS), P(th.AXIS), P(), P()) and rounds == 3


def test_a_leaf_fed_through_a_psum_stays_replicated():
    specs, _ = assert_same_layout(relay(through_psum=True), {"w": np.zeros(8, np.float32)})
    assert specs == Relay(P(th.AXIS), P(), P(), P())


# ------------------------------------------------------------------ the analysis itself


def _reached(fn, flags, *args):
    """``reached_outputs`` of ``fn`` traced inside shard_map on the 8-worker mesh."""
    out = []

    def body(*xs):
        xs = [lax.pcast(x, th.AXIS, to="varying") for x in xs]
        jaxpr = jax.make_jaxpr(fn)(*xs).jaxpr
        out.append(varying_dependence.reached_outputs(jaxpr, flags, frozenset({th.AXIS})))
        return xs[0][None]

    jax.eval_shape(
        jax.shard_map(body, mesh=th.mesh(8), in_specs=P(), out_specs=P(th.AXIS)),
        *[jax.ShapeDtypeStruct(np.shape(a), jnp.float32) for a in args],
    )
    return out[0]


def test_dependence_through_calls_barriers_scans_and_conds():
    x = np.zeros(4, np.float32)

    def barrier(a, b):
        a2, b2 = lax.optimization_barrier((a, b))
        return a2 * 2, b2 + 1

    assert _reached(barrier, [True, False], x, x) == [True, False]

    def jitted(a, b):
        return jax.jit(lambda u, v: (u + 1, v * 3))(a, b)

    assert _reached(jitted, [False, True], x, x) == [False, True]

    def carried(a, b, c):
        # b feeds the second carry only from the second iteration on (through the first).
        def body(carry, _):
            first, second = carry
            return (first + b, second + first), None

        (first, second), _ = lax.scan(body, (a, c), None, length=3)
        return first, second, c

    assert _reached(carried, [False, True, False], x, x, x) == [True, True, False]

    def branched(a, b):
        return lax.cond(a.sum() > 0, lambda u, v: (u, u), lambda u, v: (u, v * 2), a, b)

    assert _reached(branched, [False, True], x, x) == [False, True]
    assert _reached(branched, [True, False], x, x) == [True, True]  # the predicate

    def reduced(a, b):
        return lax.psum(a, th.AXIS), jnp.sort(b)  # sort: an equation not modelled

    assert _reached(reduced, [True, True], x, x) == [False, True]


def test_mismatched_flags_are_refused():
    jaxpr = jax.make_jaxpr(lambda a: a + 1)(1.0).jaxpr
    with pytest.raises(ValueError, match="2 flags for a jaxpr of 1 inputs"):
        varying_dependence.reached_outputs(jaxpr, [True, False], frozenset({"data"}))
