"""Layer stacks: the stacked transform is the same transform on the unstacked pytree.

Every test builds the unstacked pytree by hand (a list of slice subtrees at the stack's
prefix, as a model written out would hold its layers), runs the transform without
``layer_stacks`` on it, and compares with the transform with ``layer_stacks`` on the
stacked tree: outputs (sliced), every store's residual, residual bytes, and the state
surgery (resizing, per-unit views). Stacks along axis 0 (``nn.scan``) and along axis 1
(MaxText) are in the same tree; the hierarchical exchange runs on 2 nodes x 4 devices.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from tests import transform_harness as th

W, L, S = 8, 4, 4
MIN_SIZE = 1000
DENSITY = 0.05
STACKS = {"blocks": 0, "decoder/layers": 1}


def stacked_shapes():
    """A scanned model's params: ``blocks`` stacked on axis 0, ``decoder/layers`` on axis 1,
    per-layer scales that travel dense, and two plain leaves (one shaped like a slice)."""
    return {
        "blocks": {
            "attn": {"kernel": (S, 30, 50)},
            "ln": {"scale": (S, 30)},
            "mlp": {"kernel": (S, 50, 30)},
        },
        "decoder": {"layers": {"wi": {"kernel": (30, S, 40)}}},
        "extra": {"kernel": (30, 50)},
        "wte": {"embedding": (120, 30)},
    }


def zeros(shapes):
    return jax.tree.map(
        lambda s: np.zeros(s, np.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def unstack(tree, lead: int = 0):
    """The unstacked pytree, by hand: each stack a list of its slices at its prefix.
    ``lead``: leading axes before the params' own (1 for per-worker arrays)."""

    def take(x, s, axis):
        return np.take(x, s, axis=axis + lead)

    blocks, wi = tree["blocks"], tree["decoder"]["layers"]["wi"]["kernel"]
    return {
        "blocks": [jax.tree.map(lambda x, s=s: take(x, s, 0), blocks) for s in range(S)],
        "decoder": {"layers": [{"wi": {"kernel": take(wi, s, 1)}} for s in range(S)]},
        "extra": tree["extra"],
        "wte": tree["wte"],
    }


def grads(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = stacked_shapes()
    return [
        jax.tree.map(
            lambda s: rng.standard_t(3, size=(W, *s)).astype(np.float32),
            shapes,
            is_leaf=lambda x: isinstance(x, tuple),
        )
        for _ in range(steps)
    ]


# Groups that cut across stacks: two adjacent slices with a plain leaf of their shape, ranges
# of adjacent slices, two slices of the axis-1 stack that are not adjacent; the rest are
# singletons (the last mlp slice is a 2-D store in the w+2d variants).
MIXED = rr.grouping.regex(
    [
        (r"blocks/(0|1)/attn/kernel|extra/kernel", "attn01+extra"),
        (r"blocks/(2|3)/attn/kernel", "attn23"),
        (r"blocks/(0|1|2)/mlp/kernel", "mlp012"),
        (r"decoder/layers/(0|2)/wi/kernel", "wi02"),
    ]
)
C = rr.compressors


def resireduce(**options):
    """A factory of ``resireduce`` (top-k) with ``options``, taking ``layer_stacks`` etc."""
    return lambda **kw: rr.resireduce(C.topk(DENSITY), min_size=MIN_SIZE, **options, **kw)


VARIANTS = {
    "compressed_mean": lambda **kw: rr.compressed_mean(C.topk(DENSITY), min_size=MIN_SIZE, **kw),
    "ef": lambda **kw: rr.error_feedback(C.topk(DENSITY), min_size=MIN_SIZE, **kw),
    "ef-randomk": lambda **kw: rr.error_feedback(C.randomk(DENSITY), min_size=MIN_SIZE, **kw),
    "ef-qsgd": lambda **kw: rr.error_feedback(C.qsgd(16), min_size=MIN_SIZE, **kw),
    "ef-powersgd": lambda **kw: rr.error_feedback(C.powersgd(2), min_size=MIN_SIZE, **kw),
    "a": resireduce(grouping=MIXED, inter="average", intra="none"),
    "w": resireduce(grouping=MIXED, intra="none"),
    "d": resireduce(inter="none", intra="rows", intra_layers=r"wte|blocks/\d+/mlp"),
    "2d": resireduce(inter="none", intra_layers=r"wte|blocks/\d+/mlp|decoder/layers/3"),
    "w+2d": resireduce(grouping=MIXED, intra_layers="wte|blocks/3/mlp"),
    "w+2d-auto": resireduce(intra_layers="wte"),
    "w+2d-compensated": resireduce(
        grouping=MIXED,
        weight_source="compensated",
        norm_source="compensated",
        selection="softmax_sample",
        intra_layers="wte|blocks/3/mlp",
    ),
    "w+2d-bf16": resireduce(
        grouping=MIXED, intra_layers="wte|blocks/3/mlp", residual_dtype=jnp.bfloat16
    ),
    "ef-int8": lambda **kw: rr.error_feedback(
        C.topk(DENSITY), min_size=MIN_SIZE, residual_format="int8", **kw
    ),
    "w+2d-int4-stochastic": resireduce(
        grouping=MIXED, intra_layers="wte|blocks/3/mlp", residual_format="int4/64/stochastic"
    ),
}


def run_both(make, steps=3, hierarchical=False, wrap=lambda tx: tx, grads_per_step=None):
    """Runs ``make(layer_stacks=STACKS)`` on the stacked tree and ``make()`` on the
    unstacked one; returns both ``(outputs, state, plan)``."""
    kwargs, mesh, size = {}, None, 1
    if hierarchical:
        kwargs, mesh, size = {"local_axis": "local"}, rr.parallel.make_mesh(W, local_devices=L), L
    grads_per_step = grads_per_step or grads(steps)
    params = zeros(stacked_shapes())
    stacked_tx, unstacked_tx = make(layer_stacks=STACKS, **kwargs), make(**kwargs)
    stacked = th.run_shard_map(wrap(stacked_tx), params, grads_per_step, on_mesh=mesh)
    unstacked = th.run_shard_map(
        wrap(unstacked_tx), unstack(params), [unstack(g, 1) for g in grads_per_step], on_mesh=mesh
    )
    return (
        (*stacked, stacked_tx.plan(params, local_size=size)),
        (*unstacked, unstacked_tx.plan(unstack(params), local_size=size)),
    )


def exchange_state(state):
    (found,) = rr.exchange.exchange_states(state)
    return found


def assert_same_tree(got, want, atol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=atol
        )


def assert_equivalent(stacked, unstacked, atol=1e-5):
    (out_s, state_s, plan_s), (out_u, state_u, plan_u) = stacked, unstacked
    for a, b in zip(out_s, out_u, strict=True):
        assert_same_tree(unstack(a, 1), b, atol)
    state_s, state_u = exchange_state(state_s), exchange_state(state_u)
    # Every store's residual, as the unstacked state keeps it (by group label).
    by_store = rr.exchange.store_residuals(state_s, plan_s)
    assert set(by_store) == set(state_u.residuals)
    for label, value in state_u.residuals.items():
        assert_same_tree(by_store[label], value, atol)
    assert plan_s.residual_bytes() == plan_u.residual_bytes()
    assert rr.memory.tree_bytes(state_s.residuals) == rr.memory.tree_bytes(state_u.residuals)
    assert plan_s.paths == plan_u.paths


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stacked_equals_unstacked(variant, hierarchical):
    stacked, unstacked = run_both(VARIANTS[variant], hierarchical=hierarchical)
    bf16 = variant.endswith("bf16")
    assert_equivalent(stacked, unstacked, atol=2e-2 if bf16 else 1e-5)


def test_skipped_steps_equal_unstacked_in_every_guard_mode():
    """A NaN on one worker in step 2: the guard skips it alike (lean: EF residuals take G~)."""
    steps = grads(3)
    steps[1]["blocks"]["attn"]["kernel"][2, 1, 3, 4] = np.nan
    for mode in ("strict", "lean"):
        stacked, unstacked = run_both(
            VARIANTS["w+2d"],
            wrap=lambda tx, mode=mode: rr.skip_nonfinite(tx, th.AXIS, mode=mode),
            grads_per_step=steps,
        )
        assert_equivalent(stacked, unstacked)
        assert int(stacked[1].skipped[0]) == 1


# ------------------------------------------------------------------ the layout


def test_units_follow_the_unstacked_pytree():
    layout = rr.layer_stacks.layout(zeros(stacked_shapes()), rr.layer_stacks.check(STACKS))
    assert [u.path for u in layout.units] == rr.tree_paths.leaf_paths(
        unstack(zeros(stacked_shapes()))
    )
    (blocks_attn, *_, wi) = layout.stacks
    assert (blocks_attn.path, blocks_attn.axis, blocks_attn.prefix) == (
        "blocks/attn/kernel",
        0,
        "blocks",
    )
    assert (wi.path, wi.axis, wi.size) == ("decoder/layers/wi/kernel", 1, S)
    assert layout.units[wi.units[2]].path == "decoder/layers/2/wi/kernel"
    assert layout.units[wi.units[2]].shape == (30, 40)
    # A pattern that matches a whole path appends the index.
    whole = rr.layer_stacks.layout({"w": np.zeros((3, 4, 5))}, (("w", 0),))
    assert [u.path for u in whole.units] == ["w/0", "w/1", "w/2"]


def _stack_prefixes(params, layer_stacks) -> dict[str, str]:
    layout = rr.layer_stacks.layout(params, rr.layer_stacks.check(layer_stacks))
    return {stack.path: stack.prefix for stack in layout.stacks}


def test_pattern_ending_in_a_slash_names_the_prefix_before_it():
    """'^layers/' (the NNX spelling) is a prefix: the slice index goes before the '/'."""
    params = {"layers": {"mlp": {"kernel": {"value": np.zeros((S, 8, 4))}}}, "head": np.zeros(3)}
    layout = rr.layer_stacks.layout(params, rr.layer_stacks.check({"^layers/": 0}))
    assert [u.path for u in layout.units[:2]] == [
        "head",
        "layers/0/mlp/kernel/value",
    ]
    assert [s.prefix for s in layout.stacks] == ["layers"]


def test_patterns_are_searched_but_match_whole_keys():
    params = {
        "h": {"attn": {"kernel": np.zeros((S, 4, 4))}},
        "head": {"kernel": np.zeros((4, 4))},
        "lm_head": {"kernel": np.zeros((4, 4))},
        "model": {"layers": {"kernel": np.zeros((S, 4, 4))}},
        "ah": {"h": {"kernel": np.zeros((S, 4, 4))}},
    }
    got = _stack_prefixes(params, {"h": 0, "layers": 0})
    # Not head/ nor lm_head/ (not key-aligned); 'ah/h' past the unaligned match in 'ah'.
    assert got == {
        "h/attn/kernel": "h",
        "ah/h/kernel": "ah/h",
        "model/layers/kernel": "model/layers",
    }
    # Anchors keep their meaning: '^h' is the top-level h only.
    assert _stack_prefixes({k: params[k] for k in ("h", "head")}, {"^h": 0}) == {
        "h/attn/kernel": "h"
    }
    with pytest.raises(ValueError, match=r"pattern '\^h/a' matches no leaf.*h/attn/kernel"):
        _stack_prefixes(params, {"^h/a": 0})  # ends inside the key 'attn'


def test_state_keeps_slice_ranges_of_the_stack():
    params = zeros(stacked_shapes())
    tx = VARIANTS["w+2d-auto"](layer_stacks=STACKS)
    state = jax.eval_shape(tx.init, params)
    # Groups of three adjacent slices: one residual each, kept together; the slice left
    # over keeps its own; per-layer scales keep none.
    assert state.residuals["blocks/attn/kernel[0:3]"].shape == (1, 30, 50)
    assert state.residuals["blocks/attn/kernel[3:4]"].shape == (1, 30, 50)
    assert state.residuals["decoder/layers/wi/kernel[0:3]"].shape == (1, 30, 40)
    assert not any(label.startswith("blocks/ln") for label in state.residuals)
    ef = rr.error_feedback(C.topk(DENSITY), min_size=MIN_SIZE, layer_stacks=STACKS)
    ef_state = jax.eval_shape(ef.init, params)
    assert ef_state.residuals["blocks/mlp/kernel[0:4]"].shape == (S, 50, 30)
    assert ef_state.residuals["decoder/layers/wi/kernel[0:4]"].shape == (S, 30, 40)


def test_grouping_report_and_model_state_bytes_count_slices():
    params = zeros(stacked_shapes())
    got = rr.grouping.report(params, rr.grouping.auto(), MIN_SIZE, layer_stacks=STACKS)
    want = rr.grouping.report(unstack(params), rr.grouping.auto(), MIN_SIZE)
    assert got.rows == want.rows
    assert (got.dense_leaves, got.dense_bytes) == (want.dense_leaves, want.dense_bytes)
    assert str(got) == str(want)
    for make in (VARIANTS["ef"], VARIANTS["w+2d-bf16"]):
        tx = optax.chain(make(layer_stacks=STACKS), optax.adam(1e-3))
        stacked = rr.memory.model_state_bytes(params, tx)
        unstacked = rr.memory.model_state_bytes(
            unstack(params), optax.chain(make(), optax.adam(1e-3))
        )
        assert stacked == unstacked


def test_resize_workers_and_unit_views_equal_unstacked():
    stacked, unstacked = run_both(VARIANTS["w+2d"], steps=2)
    (_, state_s, plan_s), (_, state_u, plan_u) = stacked, unstacked
    state_s, state_u = exchange_state(state_s), exchange_state(state_u)
    mesh = th.mesh(W)
    params = zeros(stacked_shapes())
    specs_s = rr.parallel.state_partition_specs(VARIANTS["w+2d"](layer_stacks=STACKS), params, mesh)
    specs_u = rr.parallel.state_partition_specs(VARIANTS["w+2d"](), unstack(params), mesh)
    resized_s = rr.exchange.resize_workers(state_s, specs_s, plan_s, 3)
    resized_u = rr.exchange.resize_workers(state_u, specs_u, plan_u, 3)
    by_store = rr.exchange.store_residuals(resized_s, plan_s)
    for label, value in resized_u.residuals.items():
        assert_same_tree(by_store[label], value, 1e-6)
    for dense_only in (True, False):
        got = rr.exchange.leaf_residuals(state_s, plan_s, dense_only=dense_only)
        want = rr.exchange.leaf_residuals(state_u, plan_u, dense_only=dense_only)
        assert set(got) == set(want) and "blocks/3/attn/kernel" not in got
        assert_same_tree(got, want, 1e-5)


def test_slices_are_exchanged_together_not_one_by_one():
    """The traced update of a stack of 12 layers (groups of 3) has the same operations as
    that of 6 (one vectorised exchange per stack: no loop over layers, no per-layer
    copies), where 12 layers written out have twice the selections of 6."""

    def primitives(params, layer_stacks):
        tx = rr.resireduce(
            C.topk(DENSITY), min_size=MIN_SIZE, intra="none", layer_stacks=layer_stacks
        )
        state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(tx.init, params))
        update = jax.shard_map(
            lambda g, s: tx.update(jax.lax.pcast(g, th.AXIS, to="varying"), s)[0],
            mesh=th.mesh(W),
            in_specs=(P(), P()),
            out_specs=P(),
        )
        return collections.Counter(
            re.findall(r"= (\w+)\[", str(jax.make_jaxpr(update)(params, state)))
        )

    def stacked(layers):
        return {"h": {"w": jnp.zeros((layers, 40, 50))}, "out": {"w": jnp.zeros((40, 50))}}

    def written_out(layers):
        return {"h": [{"w": jnp.zeros((40, 50))} for _ in range(layers)]}

    six, twelve = (primitives(stacked(n), {"h": 0}) for n in (6, 12))
    assert six == twelve
    assert six["top_k"] == 2 and six["all_gather_invariant"] >= 2
    selections = [primitives(written_out(n), None)["top_k"] for n in (6, 12)]
    assert selections[1] == 2 * selections[0]


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "layer_stacks, message",
    [
        (["blocks"], "must be a mapping"),
        ({"blocks(": 0}, "is invalid"),
        ({"blocks": "0"}, "must be the int index"),
        ({"nothing": 0}, "matches no leaf"),
        ({"blocks": 3}, "has no layer axis"),
        ({"blocks/attn": 0, "blocks": 0}, "lies under the stack prefix"),
    ],
)
def test_invalid_layer_stacks(layer_stacks, message):
    with pytest.raises(ValueError, match=message):
        tx = rr.error_feedback(C.topk(DENSITY), min_size=MIN_SIZE, layer_stacks=layer_stacks)
        tx.init(zeros(stacked_shapes()))


def test_labels_pytree_grouping_is_refused_for_stacks():
    params = zeros(stacked_shapes())
    labels = jax.tree.map(lambda _: "x", params)
    tx = rr.resireduce(C.topk(DENSITY), grouping=labels, layer_stacks=STACKS, min_size=MIN_SIZE)
    with pytest.raises(ValueError, match="grouping must be a callable"):
        tx.init(params)


# ------------------------------------------------------------------ compiled peak


def test_compiled_peak_of_a_scanned_model_drops_by_the_residual_saving():
    """9 scanned layers of 512x512 (1 MiB each), groups of 3: w keeps 3 residuals where EF
    keeps 9. The donated step's peak drops by at least 90 % of the 6 MiB saved."""
    layers, width = 9, 512
    params = {"layers": {"kernel": np.zeros((layers, width, width), np.float32)}}
    mesh = rr.parallel.make_mesh(W)
    batch = rr.parallel.shard_batch({"x": np.ones((W * 2, width), np.float32)}, mesh)

    def loss(params, batch):
        def layer(h, kernel):
            return jnp.tanh(h @ kernel), None

        return jnp.mean(jax.lax.scan(layer, batch["x"], params["layers"]["kernel"])[0] ** 2)

    def peak(transform):
        tx = optax.chain(transform, optax.sgd(0.1, momentum=0.9))
        return th.step_memory(loss, tx, params, batch, mesh).peak

    topk, stacks = C.topk(0.01), {"layers": 0}
    baseline = peak(rr.error_feedback(topk, layer_stacks=stacks))
    saving = 6 * width * width * 4
    for inter in ("average", "weighted"):
        reduced = peak(rr.resireduce(topk, inter=inter, intra="none", layer_stacks=stacks))
        assert baseline - reduced >= 0.9 * saving, (inter, baseline, reduced)


# ------------------------------------------------------------------ random trees


@st.composite
def stacked_trees(draw):
    """Random stacks (axis 0 to 2, 1 to 4 slices, slice shapes around MIN_SIZE), a plain
    leaf, and a random grouping of same-shape units into shared groups."""
    tree, unstacked_builders = {}, []
    for n in range(draw(st.integers(1, 3))):
        slice_shape = draw(
            st.sampled_from([(30, 40), (8, 5, 30), (40, 30), (12, 10)])
        )  # 12x10 travels dense
        axis = draw(st.integers(0, len(slice_shape)))
        size = draw(st.integers(1, 4))
        shape = (*slice_shape[:axis], size, *slice_shape[axis:])
        tree[f"stack{n}"] = {"w": shape}
        unstacked_builders.append((f"stack{n}", axis, size))
    tree["plain"] = {"w": draw(st.sampled_from([(30, 40), (40, 30)]))}
    seed = draw(st.integers(0, 2**16))
    variant = draw(st.sampled_from(["ef", "a", "w", "w+2d", "d", "w+2d-bf16"]))
    hierarchical = draw(st.booleans())
    return tree, unstacked_builders, seed, variant, hierarchical


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)
@given(stacked_trees())
def test_random_stacks_and_groupings_equal_unstacked(example):
    tree, builders, seed, variant, hierarchical = example
    rng = np.random.default_rng(seed)
    shapes = jax.tree.map(lambda s: s, tree, is_leaf=lambda x: isinstance(x, tuple))

    def unstacked(t, lead=0):
        out = {"plain": t["plain"]}
        for name, axis, size in builders:
            out[name] = [{"w": np.take(t[name]["w"], s, axis=axis + lead)} for s in range(size)]
        return out

    units = unstacked(zeros(shapes))
    unit_shapes = {
        rr.tree_paths.path_to_str(path): x.shape
        for path, x in jax.tree_util.tree_flatten_with_path(units)[0]
    }
    # A random partition of the units into groups, within each shape.
    labels = {
        p: f"g{rng.integers(3)}-{shape}" if rng.random() < 0.7 else p
        for p, shape in unit_shapes.items()
    }

    def grouping(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: labels[rr.tree_paths.path_to_str(path)], params
        )

    stacks = {name: axis for name, axis, _ in builders}
    options = {
        "ef": dict(inter="none", intra="none"),
        "a": dict(inter="average", intra="none"),
        "w": dict(inter="weighted", intra="none"),
        "w+2d": dict(intra="2d"),
        "d": dict(inter="none", intra="rows"),
        "w+2d-bf16": dict(intra="2d", residual_dtype=jnp.bfloat16),
    }[variant]
    if options.get("intra", "2d") != "none":  # intra-layer stores on singletons only
        shared = {label for label in labels.values() if list(labels.values()).count(label) > 1}
        if options.get("inter") == "none":
            shared = set()
        singles = {p for p in ("plain/w", "stack0/0/w") if labels[p] not in shared}
        compressed = {p for p, s in unit_shapes.items() if np.prod(s) >= MIN_SIZE}
        singles &= compressed
        if singles:
            options["intra_layers"] = lambda path, shape: path in singles
        else:
            options["intra"] = "none"

    def make(**kw):
        return rr.resireduce(C.topk(0.1), grouping=grouping, min_size=MIN_SIZE, **options, **kw)

    kwargs, mesh, size = {}, None, 1
    if hierarchical:
        kwargs, mesh, size = {"local_axis": "local"}, rr.parallel.make_mesh(W, local_devices=2), 2
    steps = [
        jax.tree.map(
            lambda s: rng.standard_t(3, size=(W, *s)).astype(np.float32),
            shapes,
            is_leaf=lambda x: isinstance(x, tuple),
        )
        for _ in range(2)
    ]
    params = zeros(shapes)
    plan_u = make(**kwargs).plan(unstacked(params), local_size=size)
    stacked_tx = make(layer_stacks=stacks, **kwargs)
    out_s, state_s = th.run_shard_map(stacked_tx, params, steps, on_mesh=mesh)
    out_u, state_u = th.run_shard_map(
        make(**kwargs), unstacked(params), [unstacked(g, 1) for g in steps], on_mesh=mesh
    )
    atol = 2e-2 if variant.endswith("bf16") else 1e-5
    for a, b in zip(out_s, out_u, strict=True):
        assert_same_tree(unstacked(a, 1), b, atol)
    plan_s = stacked_tx.plan(params, local_size=size)
    by_store = rr.exchange.store_residuals(state_s, plan_s)
    assert set(by_store) == set(state_u.residuals)
    for label, value in state_u.residuals.items():
        assert_same_tree(by_store[label], value, atol)
    assert plan_s.residual_bytes() == plan_u.residual_bytes()
