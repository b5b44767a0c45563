"""Property-based tests (hypothesis): the exchange transforms on random parameter trees.

Trees nest dicts, lists and tuples; leaves are 0-D to 4-D with sizes around ``min_size``
(so some travel dense and some are compressed), float32 / bfloat16 / float16, and may
contain a stack of identically shaped "layers" (so that ResiReduce forms shared groups).
For every tree and transform, on 4 workers:

* the output is the same on every worker, shaped and typed like the gradient, and finite;
* the state keeps its structure, shapes and dtypes from step to step;
* error feedback conserves the gradient exactly: ``D(P) + R_new == G + R_old``;
* a lossless compressor gives the exact mean and keeps zero residuals;
* a NaN/Inf anywhere (``skip_nonfinite(mode="strict")``) skips the step as if it never
  happened;
* integer, boolean and complex leaves are rejected with a ValueError naming the leaf.

Example counts are small (CI time); ``derandomize=True`` makes every run test the same
examples, and ``--hypothesis-show-statistics`` shows what they covered (compressed leaves,
shared groups, low-precision leaves). Each example compiles one init and one step, reused
for all its runs.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from tests import transform_harness as th

W = 4
MIN_SIZE = 48
DENSITY = 0.1
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
# Dimension range per rank, so that 2-D to 4-D leaves straddle MIN_SIZE (2-D: 16 to 144
# elements, 3-D: 8 to 216, 4-D: 16 to 256); 1-D leaves travel dense whatever their size.
DIMS = {0: (1, 1), 1: (1, 80), 2: (4, 12), 3: (2, 6), 4: (2, 4)}
# No shrinking: every shrink step compiles anew (minutes per failure); a failure prints
# the example as generated.
SETTINGS = dict(
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

C = rr.compressors
TRANSFORMS = {
    "compressed_mean/topk": lambda: rr.compressed_mean(C.topk(DENSITY), min_size=MIN_SIZE),
    "error_feedback/topk": lambda: rr.error_feedback(C.topk(DENSITY), min_size=MIN_SIZE),
    "error_feedback/randomk": lambda: rr.error_feedback(C.randomk(DENSITY), min_size=MIN_SIZE),
    "resireduce/a": lambda: rr.resireduce(
        C.topk(DENSITY), inter="average", intra="none", min_size=MIN_SIZE
    ),
    "resireduce/w+2d": lambda: rr.resireduce(C.topk(DENSITY), min_size=MIN_SIZE),
    "resireduce/a+rows/softmax": lambda: rr.resireduce(
        C.topk(DENSITY),
        inter="average",
        intra="rows",
        selection="softmax_sample",
        min_size=MIN_SIZE,
    ),
    "resireduce/w+2d/compensated/bf16-store": lambda: rr.resireduce(
        C.topk(DENSITY),
        weight_source="compensated",
        residual_dtype=jnp.bfloat16,
        min_size=MIN_SIZE,
    ),
    "resireduce/w/qsgd": lambda: rr.resireduce(C.qsgd(), intra="none", min_size=MIN_SIZE),
}
# Error feedback whose decompression copies the selected entries of G~ (Top-k, Random-k).
EF_SPARSE = ("error_feedback/topk", "error_feedback/randomk")


# ------------------------------------------------------------------ strategies


def leaf_specs(ranks=(0, 1, 2, 3, 4)):
    shape = st.sampled_from(ranks).flatmap(
        lambda ndim: st.tuples(*[st.integers(*DIMS[ndim]) for _ in range(ndim)])
    )
    return st.tuples(shape, st.sampled_from(FLOAT_DTYPES))


NAMES = st.sampled_from(["kernel", "bias", "scale", "embedding", "w", "attn", "mlp", "head"])


def subtrees():
    return st.recursive(
        leaf_specs(),
        lambda children: st.one_of(
            st.dictionaries(NAMES, children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=2).map(tuple),
        ),
        max_leaves=5,
    )


@st.composite
def param_specs(draw):
    """A random tree of (shape, dtype): nested leaves, matrices near the size threshold,
    and possibly a stack of identically shaped layers."""
    big = st.sampled_from([2, 3]).flatmap(  # always at least one compressed leaf
        lambda ndim: st.tuples(*[st.integers(7 if ndim == 2 else 4, 12 if ndim == 2 else 6)] * ndim)
    )
    tree = {
        "body": draw(subtrees()),
        "matrices": draw(st.lists(leaf_specs(ranks=(2, 3, 4)), min_size=0, max_size=2)),
        "big": (draw(big), draw(st.sampled_from(FLOAT_DTYPES))),
    }
    layers = draw(st.integers(0, 4))
    if layers:
        block = draw(st.dictionaries(NAMES, leaf_specs(ranks=(1, 2, 2, 3)), min_size=1, max_size=3))
        tree["stack"] = {f"layer_{i}": block for i in range(layers)}
    return tree


def is_spec(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], np.dtype)


def make_params(specs):
    return jax.tree.map(lambda s: np.zeros(s[0], s[1]), specs, is_leaf=is_spec)


def make_grads(params, seed: int, steps: int):
    rng = np.random.default_rng(seed)
    return [
        jax.tree.map(
            lambda p: (rng.standard_t(3, size=(W, *p.shape)) * 0.5).astype(p.dtype), params
        )
        for _ in range(steps)
    ]


# ------------------------------------------------------------------ runner


@functools.cache
def mesh():
    return th.mesh(W)


class Compiled:
    """``tx`` compiled once for ``params`` on the shared 4-worker mesh; run many sequences.

    Outputs and states carry a leading worker axis on every leaf (replicated leaves are
    broadcast), as in ``tests/transform_harness.py``.
    """

    def __init__(self, tx: optax.GradientTransformation, params: Any):
        m = mesh()
        self.specs = specs = rr.parallel.state_partition_specs(tx, params, m, th.AXIS)
        self.params = rr.parallel.replicated(params, m)
        self._init = jax.jit(
            jax.shard_map(
                lambda p: rr.parallel.stack_per_worker(tx.init(p), specs),
                mesh=m,
                in_specs=P(),
                out_specs=specs,
            )
        )

        def step(p, s, g):
            s = rr.parallel.unstack_per_worker(s, specs)
            out, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
            return jax.tree.map(lambda x: x[None], out), rr.parallel.stack_per_worker(s, specs)

        self._step = jax.jit(
            jax.shard_map(
                step, mesh=m, in_specs=(P(), specs, P(th.AXIS)), out_specs=(P(th.AXIS), specs)
            )
        )

    def run(self, grads_per_step) -> tuple[list[Any], list[Any]]:
        """Returns (outputs per step, states: init then after every step), as numpy."""
        state = self._init(self.params)
        outputs, states = [], [self._host(state)]
        for grads in grads_per_step:
            grads = jax.device_put(grads, NamedSharding(mesh(), P(th.AXIS)))
            out, state = self._step(self.params, state, grads)
            outputs.append(jax.device_get(out))
            states.append(self._host(state))
        return outputs, states

    def _host(self, state):
        return jax.device_get(th._broadcast_replicated(state, self.specs, W))


def assert_same_on_every_worker(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        for w in range(1, W):
            np.testing.assert_array_equal(leaf[w], leaf[0])


def float_leaves(tree):
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(np.asarray(x).dtype, jnp.floating)]


def compressed_paths(params) -> list[str]:
    paths, leaves = rr.tree_paths.leaf_paths(params), jax.tree.leaves(params)
    return [
        p for p, x in zip(paths, leaves, strict=True) if rr.tree_paths.is_compressible(x, MIN_SIZE)
    ]


def record_coverage(params) -> None:
    """Hypothesis statistics (``--hypothesis-show-statistics``): what the examples hold."""
    groups = rr.grouping.resolve(params, rr.grouping.auto(), MIN_SIZE)
    event(f"compressed leaves: {min(len(compressed_paths(params)), 3)}+")
    event(f"shared groups: {sum(len(g.members) > 1 for g in groups) > 0}")
    dtypes = {np.dtype(x.dtype).name for x in jax.tree.leaves(params)}
    event(f"low-precision leaves: {bool(dtypes - {'float32'})}")


# ------------------------------------------------------------------ properties


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@settings(max_examples=4, **SETTINGS)
@given(specs=param_specs(), seed=st.integers(0, 2**16))
def test_exchange_invariants(name, specs, seed):
    params = make_params(specs)
    record_coverage(params)
    grads = make_grads(params, seed, steps=2)
    outputs, states = Compiled(TRANSFORMS[name](), params).run(grads)

    for out, g in zip(outputs, grads, strict=True):
        chex.assert_trees_all_equal_shapes_and_dtypes(out, g)
        assert_same_on_every_worker(out)
        for leaf in jax.tree.leaves(out):
            assert np.isfinite(np.asarray(leaf, np.float32)).all()
    for state in states[1:]:
        chex.assert_trees_all_equal_structs(state, states[0])
        chex.assert_trees_all_equal_shapes_and_dtypes(state, states[0])
        for leaf in float_leaves(state):
            assert np.isfinite(np.asarray(leaf, np.float32)).all()

    if name in EF_SPARSE:
        check_error_feedback_conservation(params, grads, outputs, states, name)


def check_error_feedback_conservation(params, grads, outputs, states, name):
    """Per worker, step and compressed leaf: ``D(P) + R_new == G + R_old`` exactly.

    Sparsifiers send entries of ``G~ = G + R_old`` unchanged, so ``D(P) = G~ - R_new``
    must be, entry by entry, either ``G~`` (sent; ``R_new == 0``) or ``0`` (kept;
    ``R_new == G~``): nothing is lost or invented, in any dtype. Top-k sends the largest
    entries; Random-k sends the same positions on every worker. The output is the workers'
    mean of ``D(P)``.
    """
    paths = rr.tree_paths.leaf_paths(params)
    for path in compressed_paths(params):
        i = paths.index(path)
        for t in range(len(grads)):
            g = jax.tree.leaves(grads[t])[i]
            r_old = states[t].residuals[path]  # a leaf's own residual is keyed by its path
            r_new = states[t + 1].residuals[path]
            compensated = g + r_old.astype(g.dtype)
            sent = r_new == 0
            assert np.all(sent | (r_new == compensated)), path
            k = rr.compressors.sparse.num_selected(g[0].size, DENSITY)
            flat_sent = sent.reshape(W, -1)
            assert np.all(flat_sent.sum(1) >= k), path
            decompressed = np.where(sent, compensated, 0).astype(np.float32)
            if name == "error_feedback/topk":
                for w in range(W):  # every sent |entry| >= every kept |entry|
                    mag = np.abs(compensated[w].astype(np.float32)).ravel()
                    kept = mag[~flat_sent[w]]  # R_new != 0; zeros of G~ are either
                    sent_mag = mag[flat_sent[w] & (mag > 0)]
                    assert kept.size == 0 or sent_mag.size == 0 or sent_mag.min() >= kept.max()
            else:
                nonzero = decompressed.reshape(W, -1) != 0
                assert not np.any(nonzero & ~flat_sent[0]), path  # same positions for all
            out = jax.tree.leaves(outputs[t])[i][0].astype(np.float32)
            eps = float(jnp.finfo(g.dtype).eps)
            np.testing.assert_allclose(
                out, decompressed.mean(0), rtol=4 * eps, atol=4 * eps * np.abs(decompressed).max()
            )


@settings(max_examples=12, **SETTINGS)
@given(
    specs=param_specs(),
    variant=st.sampled_from(["ef", "a", "w+2d", "a+rows"]),
    seed=st.integers(0, 2**16),
)
def test_lossless_compression_gives_the_mean_and_zero_residuals(specs, variant, seed):
    params = make_params(specs)
    record_coverage(params)
    grads = make_grads(params, seed, steps=2)
    if variant == "ef":
        tx = rr.error_feedback(C.none(), min_size=MIN_SIZE)
    else:
        inter, intra = {"a": ("average", "none"), "w+2d": ("weighted", "2d")}.get(
            variant, ("average", "rows")
        )
        tx = rr.resireduce(C.none(), inter=inter, intra=intra, min_size=MIN_SIZE)
    outputs, states = Compiled(tx, params).run(grads)
    for out, g in zip(outputs, grads, strict=True):
        assert_same_on_every_worker(out)
        for o, x in zip(jax.tree.leaves(out), jax.tree.leaves(g), strict=True):
            eps = float(jnp.finfo(x.dtype).eps)
            mean = x.astype(np.float64).mean(0)
            np.testing.assert_allclose(
                o[0].astype(np.float64), mean, rtol=2 * eps, atol=2 * eps * np.abs(x).max()
            )
    for leaf in float_leaves(states[-1].residuals):
        np.testing.assert_array_equal(np.asarray(leaf, np.float32), 0.0)


@settings(max_examples=12, **SETTINGS)
@given(
    specs=param_specs(),
    name=st.sampled_from(sorted(TRANSFORMS)),
    bad=st.sampled_from([np.nan, np.inf, -np.inf]),
    where=st.tuples(st.integers(0, 10**6), st.integers(0, W - 1), st.integers(0, 10**6)),
    seed=st.integers(0, 2**16),
)
def test_skip_nonfinite_skips_the_step_as_if_it_never_happened(specs, name, bad, where, seed):
    params = make_params(specs)
    record_coverage(params)
    g0, g1, g2 = make_grads(params, seed, steps=3)
    leaf_index, worker, position = where
    poisoned = [np.array(x) for x in jax.tree.leaves(g1)]
    flat = poisoned[leaf_index % len(poisoned)].reshape(W, -1)  # a view
    flat[worker, position % flat.shape[1]] = bad
    g1 = jax.tree.unflatten(jax.tree.structure(g1), poisoned)

    chain = optax.chain(TRANSFORMS[name](), optax.sgd(0.1, momentum=0.9))
    tx = rr.skip_nonfinite(chain, mode="strict")
    compiled = Compiled(tx, params)
    out_bad, states_bad = compiled.run([g0, g1, g2])
    out_ref, states_ref = compiled.run([g0, g2])

    for leaf in jax.tree.leaves(out_bad[1]):
        np.testing.assert_array_equal(np.asarray(leaf, np.float32), 0.0)
    chex.assert_trees_all_equal(states_bad[2].inner, states_bad[1].inner)
    chex.assert_trees_all_equal(out_bad[2], out_ref[1])
    chex.assert_trees_all_equal(states_bad[3].inner, states_ref[2].inner)
    np.testing.assert_array_equal(states_bad[3].skipped, 1)
    for leaf in float_leaves(states_bad[3]):
        assert np.isfinite(np.asarray(leaf, np.float32)).all()


BAD_LEAVES = {
    "int32": np.zeros((12, 10), np.int32),
    "bool": np.zeros((3,), bool),
    "complex64": np.zeros((8, 8), np.complex64),
    "uint8": np.zeros((), np.uint8),
}


@settings(max_examples=25, **SETTINGS)
@given(
    specs=param_specs(),
    name=st.sampled_from(sorted(TRANSFORMS)),
    bad=st.sampled_from(sorted(BAD_LEAVES)),
    guarded=st.booleans(),
)
def test_non_float_leaves_are_rejected_naming_the_leaf(specs, name, bad, guarded):
    params = make_params(specs)
    params["body"] = {"counter": BAD_LEAVES[bad], "rest": params["body"]}
    tx = TRANSFORMS[name]()
    if guarded:
        tx = rr.skip_nonfinite(optax.chain(tx, optax.sgd(0.1)))
    with pytest.raises(ValueError, match=f"'body/counter' has dtype {np.dtype(bad)}"):
        tx.init(params)


def test_integer_leaves_pass_through_optax_masked():
    """The remedy the error message suggests: mask non-float leaves out of the exchange."""
    params = {"w": np.zeros((16, 8), np.float32), "steps": np.zeros((4,), np.int32)}
    is_float = {"w": True, "steps": False}
    tx = optax.masked(rr.error_feedback(C.topk(DENSITY), min_size=MIN_SIZE), is_float)
    grads = make_grads(params, 0, steps=2)
    grads = [{"w": g["w"], "steps": np.zeros((W, 4), np.int32)} for g in grads]
    outputs, states = Compiled(tx, params).run(grads)
    for out, g in zip(outputs, grads, strict=True):
        np.testing.assert_array_equal(out["steps"], g["steps"])  # untouched
        assert_same_on_every_worker(out["w"])
    assert states[-1].inner_state.residuals["w"].shape == (W, 16, 8)


@pytest.mark.parametrize("name", ["compressed_mean", "error_feedback", "resireduce"])
def test_empty_leaves_travel_dense_even_with_min_size_zero(name):
    """A zero-size leaf has nothing to select: with ``min_size=0`` it used to reach
    ``lax.top_k`` with k=1 > 0 elements and fail inside JAX; now it travels dense."""
    make = {"compressed_mean": rr.compressed_mean, "error_feedback": rr.error_feedback}
    tx = make.get(name, functools.partial(rr.resireduce, intra="none"))(C.topk(DENSITY), min_size=0)
    params = {"empty": np.zeros((0, 5), np.float32), "w": np.zeros((3, 4), np.float32)}
    outputs, _ = Compiled(tx, params).run(make_grads(params, 0, steps=1))
    assert outputs[0]["empty"].shape == (W, 0, 5)
    assert_same_on_every_worker(outputs[0]["w"])
