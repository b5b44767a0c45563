"""Leaf-sized maps over their operand's buffer (``resireduce_jax._src.in_place``): values against
numpy, bit-exact sign round trips, and the compiled temp memory they save."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import resireduce_jax as rr
from resireduce_jax import compressors as C
from resireduce_jax import residual_stores as stores
from resireduce_jax._src import in_place

SHAPES = [(97, 129), (4099,), (3, 5, 7, 11), (1, 3000), (3000, 1)]


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of about 1 KiB, so that every test leaf is mapped in several blocks."""
    monkeypatch.setattr(in_place, "BLOCK_BYTES", 1024)


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _awkward(shape, dtype=np.float32, seed=0) -> np.ndarray:
    """Random values with -0.0, +0.0, infinities and NaNs of both signs mixed in."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(dtype).ravel()
    specials = np.array([-0.0, 0.0, np.inf, -np.inf, np.nan, -np.nan], dtype)
    x[: 7 * len(specials) : 7] = specials
    return x.reshape(shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_map_blocks_equals_the_map_of_the_whole_leaf(shape, small_blocks):
    x = _awkward(shape)
    index = np.arange(x.size, dtype=np.int64).reshape(shape)

    def fn(block, row0):  # depends on the element's flat index: a wrong offset shows
        return block * 2.0 + in_place.flat_index(block, row0).astype(block.dtype)

    got = jax.jit(lambda v: in_place.map_blocks(v, fn))(x)
    np.testing.assert_array_equal(np.asarray(got), x * 2.0 + index.astype(np.float32))


@pytest.mark.parametrize(
    "rows, cols, expected_rows",
    [
        (64, 256, 64),  # 64 KiB: one piece
        (256, 256, 32),  # 256 KiB: MIN_BLOCKS blocks of 32 KiB
        (1000, 256, 125),  # under 1 MiB: 8 blocks
        (1024, 256, 1024),  # 1 MiB: one block of BLOCK_BYTES
        (4096, 256, 1024),  # 4 MiB: four blocks of 1 MiB
        (2, 65536, 1),  # 512 KiB in 2 rows: no more blocks than rows
    ],
)
def test_block_rows_cut_a_leaf_at_the_documented_sizes(rows, cols, expected_rows):
    """Float32 leaves, blocks counted by hand from BLOCK_BYTES (1 MiB), MIN_BLOCKS (8 for a
    leaf from 8 x 32 KiB up to 1 MiB) and MAX_BLOCKS."""
    assert in_place.block_rows(rows, cols, 4) == expected_rows


def test_a_leaf_cut_in_min_blocks_maps_to_the_same_values():
    x = _awkward((256, 256))  # 256 KiB: mapped in 8 blocks with the default constants

    def fn(block, row0):
        return block * 2.0 + in_place.flat_index(block, row0).astype(block.dtype)

    got = jax.jit(lambda v: in_place.map_blocks(v, fn))(x)
    index = np.arange(x.size, dtype=np.float32).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(got), x * 2.0 + index)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_magnitudes_and_signs_round_trip_bit_for_bit(shape, dtype, small_blocks):
    x = _awkward(shape, dtype)

    @jax.jit
    def round_trip(v):
        magnitude, bits = in_place.magnitudes(v)
        return magnitude, bits, in_place.with_signs(magnitude, bits)

    magnitude, bits, back = (np.asarray(a) for a in round_trip(x))
    np.testing.assert_array_equal(_bits(back), _bits(x))
    np.testing.assert_array_equal(_bits(magnitude), _bits(np.abs(x)))
    flat = np.arange(x.size)
    negative = (bits[flat // 32] >> (flat % 32).astype(np.uint32)) & 1
    np.testing.assert_array_equal(negative.astype(bool), np.signbit(x).ravel())


def test_signed_at_gives_the_values_at_any_indices():
    x = _awkward((50, 60))
    index = np.random.default_rng(1).choice(x.size, size=(40, 3), replace=False).astype(np.int32)
    bits = in_place.sign_bits(jnp.asarray(x))
    got = in_place.signed_at(jnp.abs(jnp.asarray(x)).ravel()[index], bits, jnp.asarray(index))
    np.testing.assert_array_equal(_bits(np.asarray(got)), _bits(x.ravel()[index]))


def _temp_bytes(fn, shape) -> int:
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.jit(fn).lower(spec, spec).compile().memory_analysis().temp_size_in_bytes


def test_magnitudes_of_a_temporary_need_no_leaf_sized_buffer():
    """``|x|`` of a temporary in its own buffer: the compiled temp holds ``x`` once (plus
    blocks and sign bits), where a plain ``abs`` holds ``x`` and ``|x|`` at once."""
    shape = (1024, 2048)  # 8 MiB: 8 blocks
    leaf = 4 * 1024 * 2048
    top = 1000

    def plain(a, b):
        x = jnp.sin(a) * b  # a temporary, as a compensated gradient is
        values, indices = lax.top_k(jnp.abs(x).ravel(), top)
        values, indices, x = lax.optimization_barrier((values, indices, x))
        return jnp.sum(x, axis=0), values, indices

    def in_its_buffer(a, b):
        x = jnp.sin(a) * b
        magnitude, bits = in_place.magnitudes(x)
        values, indices = lax.top_k(magnitude.ravel(), top)
        magnitude, bits, values, indices = lax.optimization_barrier(
            (magnitude, bits, values, indices)
        )
        return jnp.sum(in_place.with_signs(magnitude, bits), axis=0), values, indices

    assert _temp_bytes(plain, shape) >= 2 * leaf
    assert _temp_bytes(in_its_buffer, shape) <= leaf + leaf // 4


def _reduce_both_ways(compressor, x):
    """``compressor.reduce`` and, as the reference, its plain ``compress`` (``|x|`` in a
    buffer of its own) followed by ``aggregate`` and ``residual``, for 8 workers."""
    mesh = jax.make_mesh((8,), ("data",))

    def both(v):
        v = v[0]
        fast = compressor.reduce(v, (), None, "data")
        payload, _ = compressor.compress(v, (), None)
        like = jax.ShapeDtypeStruct(v.shape, v.dtype)
        mean = compressor.aggregate(payload, like, "data")
        residual = compressor.residual(v, payload)
        return jax.tree.map(lambda a: a[None], (fast.mean, fast.residual, mean, residual))

    spec = jax.sharding.PartitionSpec("data")
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    return jax.jit(jax.shard_map(both, mesh=mesh, in_specs=spec, out_specs=spec))(x)


def test_topk_reduce_equals_compress_aggregate_residual_bit_for_bit(small_blocks):
    x = np.stack([_awkward((97, 129), seed=s) for s in range(8)])
    x[np.isnan(x)] = 0.0  # NaN ranks arbitrarily in Top-k; the guard keeps NaNs out anyway
    mean, residual, mean_ref, residual_ref = (
        np.asarray(a) for a in _reduce_both_ways(C.topk(0.05), x)
    )
    np.testing.assert_array_equal(_bits(mean), _bits(mean_ref))
    np.testing.assert_array_equal(_bits(residual), _bits(residual_ref))


def _np_store(plan, stored) -> tuple[np.ndarray, np.ndarray]:
    """The stored residual as a dense matrix view and the mask of what it keeps."""
    mask = np.zeros(plan.view.shape2d, bool)
    rows = np.asarray(stored.rows)
    if plan.kind == "rows":
        if plan.view.row_axis == 0:
            mask[rows, :] = True
        else:
            mask[:, rows] = True
    else:
        cols = np.asarray(stored.cols)
        i0, i1 = (rows, cols) if plan.view.row_axis == 0 else (cols, rows)
        mask[np.ix_(i0, i1)] = True
    dense = np.zeros(plan.view.shape2d, np.float32)
    dense[mask] = np.asarray(stored.values).ravel()
    return dense, mask


@pytest.mark.parametrize("kind", ["rows", "2d"])
@pytest.mark.parametrize("path", ["embed/embedding", "dense/kernel"])
def test_intra_layer_compensation_and_selection_against_numpy(kind, path, small_blocks):
    """``compensate`` adds the kept values where they belong (and leaves every other bit,
    ``-0.0`` included, alone); ``compress_residual`` keeps ``r``'s top rows/columns by L1
    norm with their signed values."""
    shape = (120, 90)
    view = stores.matrix_view(path, shape)
    group = rr.grouping.resolve(
        {path.split("/")[0]: {path.split("/")[1]: jnp.zeros(shape)}},
        rr.grouping.each_leaf(),
        0,
    )[0]
    plan = stores.StorePlan(group, kind, jnp.float32, view, keep_rows=30, keep_cols=40)
    g = _awkward(shape, seed=4)
    g[np.isnan(g) | np.isinf(g)] = -0.0
    r = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    stored = stores.compress_residual(plan, jnp.asarray(r), None)

    m = r.reshape(view.shape2d)
    row_norms = np.abs(m).sum(axis=1 - view.row_axis)
    rows = np.sort(np.argsort(-row_norms, kind="stable")[: plan.keep_rows])
    np.testing.assert_array_equal(np.asarray(stored.rows), rows)
    if kind == "2d":
        col_norms = np.abs(m).sum(axis=view.row_axis)
        cols = np.sort(np.argsort(-col_norms, kind="stable")[: plan.keep_cols])
        np.testing.assert_array_equal(np.asarray(stored.cols), cols)
    kept, mask = _np_store(plan, stored)
    np.testing.assert_array_equal(kept[mask], m[mask])  # the kept values, signed

    got = np.asarray(jax.jit(lambda v: stores.compensate(plan, stored, v))(g))
    expected = g.reshape(view.shape2d).copy()
    expected[mask] = expected[mask] + kept[mask]
    np.testing.assert_array_equal(_bits(got.reshape(view.shape2d)), _bits(expected))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_gather_as_equals_the_plain_gather_bit_for_bit(dtype):
    values = _awkward((40, 30), dtype, seed=6)
    rng = np.random.default_rng(7)
    index = (rng.integers(0, 40, (25, 17)), rng.integers(0, 30, (25, 17)))
    got = jax.jit(lambda v, i, j: in_place.gather_as(v, (i, j), jnp.float32))(values, *index)
    expected = values[index].astype(np.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), expected)  # NaN where NaN
    np.testing.assert_array_equal(np.signbit(np.asarray(got)), np.signbit(expected))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(16, 3), (300, 40)])
def test_gather_as_inside_a_loop_equals_numpy(dtype, shape):
    """Inside a loop body the gather goes through an optimization barrier: it compiles for
    any size (XLA:CPU's small-loop kernels aborted on a barrier) and its values are
    numpy's."""
    values = _awkward(shape, dtype, seed=8)

    def rows_sum(v):
        def body(i, acc):
            at = (lax.iota(jnp.int32, 4) + i,)
            return acc + in_place.gather_as(v, at, jnp.float32)

        return lax.fori_loop(0, 3, body, jnp.zeros((4, shape[1]), jnp.float32))

    got = np.asarray(jax.jit(rows_sum)(values))
    wide = values.astype(np.float32)
    expected = wide[0:4] + wide[1:5] + wide[2:6]  # the same additions, in the same order
    np.testing.assert_array_equal(got, expected)


def test_a_bfloat16_store_is_compensated_without_a_float32_copy(monkeypatch):
    """A 2-D store kept in bfloat16 adds its values inside the block loop: the compiled temp
    is the float32 store's (no widened and no bit-pattern copy of the store: the gathered
    elements alone are converted), where a plain gather costs a float32 copy of them."""
    shape = (4096, 2048)  # 32 MiB leaf; kept 2048 x 1024 values: 4 MiB in bfloat16
    leaf = {"dense": {"kernel": jnp.zeros(shape)}}
    group = rr.grouping.resolve(leaf, rr.grouping.each_leaf(), 0)[0]
    view = stores.matrix_view("dense/kernel", shape)

    def temp(dtype) -> int:
        plan = stores.StorePlan(group, "2d", dtype, view, keep_rows=2048, keep_cols=1024)
        stored = jax.eval_shape(lambda: stores.init_store(plan))
        g = jax.ShapeDtypeStruct(shape, jnp.float32)
        fn = jax.jit(lambda s, v: stores.compensate(plan, s, jnp.sin(v)))  # v: a temporary
        return fn.lower(stored, g).compile().memory_analysis().temp_size_in_bytes

    values = 2048 * 1024 * 2  # bfloat16 bytes
    in_loop = temp(jnp.bfloat16)
    assert in_loop <= temp(jnp.float32) + values * 0.05, (in_loop, temp(jnp.float32))
    monkeypatch.setattr(in_place, "gather_as", lambda v, i, dtype: v[i].astype(dtype))
    assert temp(jnp.bfloat16) >= in_loop + 2 * values * 0.95  # the float32 copy it avoids


@pytest.mark.parametrize("codes", ["int8", "float8", "int4", "int3"])
def test_a_quantized_2d_store_holds_no_float32_copy_of_its_block(codes):
    """A 2-D store kept as codes decodes each element it adds from its own code inside the
    block loop (``ResidualFormat.values_at``), and encodes the new kept block a part at a
    time from the gather (``encode_gathered``): neither step holds the kept block in
    float32 (8 MiB here), so each compiles to at most one block's temp over the float32
    store's."""
    shape = (4096, 2048)  # 32 MiB leaf; kept 2048 x 1024 values
    leaf = {"dense": {"kernel": jnp.zeros(shape)}}
    group = rr.grouping.resolve(leaf, rr.grouping.each_leaf(), 0)[0]
    view = stores.matrix_view("dense/kernel", shape)
    g = jax.ShapeDtypeStruct(shape, jnp.float32)

    def temps(fmt) -> tuple[int, int]:
        plan = stores.StorePlan(
            group, "2d", jnp.float32, view, keep_rows=2048, keep_cols=1024, format=fmt
        )
        stored = jax.eval_shape(lambda: stores.init_store(plan))
        compensate = jax.jit(lambda s, v: stores.compensate(plan, s, jnp.sin(v)))
        keep = jax.jit(lambda v: stores.compress_residual(plan, jnp.sin(v), None))
        return tuple(
            fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
            for fn, args in ((compensate, (stored, g)), (keep, (g,)))
        )

    f32_compensate, f32_keep = temps(None)
    q_compensate, q_keep = temps(rr.residual_formats.BlockFormat(codes, rounding="nearest"))
    margin = in_place.BLOCK_BYTES + 64 * 1024
    assert q_compensate <= f32_compensate + margin, (q_compensate, f32_compensate)
    assert q_keep <= f32_keep + margin, (q_keep, f32_keep)


@pytest.mark.parametrize(
    "size", [1000, in_place.SUM_CHUNK, in_place.SUM_CHUNK + 1, 5 * in_place.SUM_CHUNK + 7]
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sums_of_several_maps_equal_numpy(size, dtype):
    """Below, at, just above and well above one chunk (the last chunk shifted back and
    masked): the float sums match numpy's float64 ones to float32 rounding, and a count
    accumulated in int32 is exact."""
    x = np.random.default_rng(size).standard_normal(size).astype(np.float32) * 3 - 1
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # the values a 16-bit x holds
    maps = (jnp.abs, jnp.square, lambda c: (c > 0).astype(jnp.int32))
    l1, sq, positive = jax.jit(lambda v: in_place.sums(v, maps, jnp.float32))(jnp.asarray(x, dtype))
    assert positive.dtype == jnp.int32 and int(positive) == int((x > 0).sum())
    np.testing.assert_allclose(float(l1), np.abs(x.astype(np.float64)).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(sq), np.square(x.astype(np.float64)).sum(), rtol=1e-5)


def test_sums_of_a_temporary_need_no_mapped_copy():
    """``sum(|x|)`` and ``sum(x * x)`` of ``x`` (an output here, so not temp): the plain
    reductions materialize a mapped leaf on XLA:CPU; ``sums`` needs a chunk per map."""
    shape = (1024, 2048)  # 8 MiB
    leaf = 4 * 1024 * 2048

    def plain(a, b):
        x = jnp.sin(a) * b
        return jnp.sum(jnp.abs(x)) + jnp.sum(x * x), x

    def chunked(a, b):
        x = jnp.sin(a) * b
        l1, sq = in_place.sums(x, (jnp.abs, jnp.square), jnp.float32)
        return l1 + sq, x

    assert _temp_bytes(plain, shape) >= leaf
    assert _temp_bytes(chunked, shape) <= leaf // 16


def _shared_plan(shape, kind="weighted"):
    leaf = {"a": jnp.zeros(shape), "b": jnp.zeros(shape)}
    group = rr.grouping.resolve(leaf, {"a": "both", "b": "both"}, 0)[0]
    assert len(group.members) == 2
    return stores.StorePlan(group, kind, jnp.float32)


def test_a_shared_group_is_compensated_and_summed_in_its_members_buffers():
    """ResiReduce's shared residual (§4.2), against numpy: ``G~ = G + R`` is written over
    the member's gradient (``R`` stays readable for the other members), the ResiReduce-w
    weight takes no mapped copy of the member, and the running sum ``sum_i w_i r_i`` is
    updated in its own buffer. Compiled for two temporary members of 8 MiB (the result is
    an output, not temp): one member-sized temporary, where plain element-wise ops hold
    two."""
    shape = (1024, 2048)
    leaf = 4 * 1024 * 2048
    plan = _shared_plan(shape)
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)

    def ours(a, b, stored):
        g1 = stores.compensate(plan, stored, jnp.sin(a) * b)  # temporaries, as gradients are
        acc = stores.WeightedSum.first(g1, stores.residual_weight(g1, plan.phi))
        g2 = stores.compensate(plan, stored, jnp.cos(a) * b)
        return acc.add(g2, stores.residual_weight(g2, plan.phi)).finish(plan)

    def plain(a, b, stored):
        g1 = jnp.sin(a) * b + stored
        w1 = plan.phi * jnp.mean(jnp.abs(g1)) + (1 - plan.phi) * jnp.sqrt(jnp.mean(g1 * g1))
        g2 = jnp.cos(a) * b + stored
        w2 = plan.phi * jnp.mean(jnp.abs(g2)) + (1 - plan.phi) * jnp.sqrt(jnp.mean(g2 * g2))
        return (w1 * g1 + w2 * g2) / (w1 + w2)

    rng = np.random.default_rng(0)
    a, b, stored = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    g1 = np.sin(a.astype(np.float64)) * b + stored
    g2 = np.cos(a.astype(np.float64)) * b + stored

    def weight(g):
        return plan.phi * np.abs(g).mean() + (1 - plan.phi) * np.sqrt(np.square(g).mean())

    want = (weight(g1) * g1 + weight(g2) * g2) / (weight(g1) + weight(g2))
    got = jax.jit(ours)(a, b, stored)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    temp = jax.jit(ours).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes
    plain_temp = jax.jit(plain).lower(spec, spec, spec).compile().memory_analysis()
    assert plain_temp.temp_size_in_bytes >= 2 * leaf
    assert temp <= leaf + leaf // 16, (temp, plain_temp.temp_size_in_bytes)
