"""Residual formats (``resireduce_jax.residual_formats``): round-trip bounds against numpy
references, exact zeros, exact byte counts, the block-wise add, int4 and int3 packing, unbiased
stochastic rounding, jit/vmap, and parsing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from resireduce_jax._src import in_place
from resireduce_jax.residual_formats import (
    DEFAULT_BLOCK_SIZES,
    BlockFormat,
    FloatFormat,
    Quantized,
    parse_format,
)

SHAPES = [(97, 129), (4099,), (3, 5, 7, 11), (1, 300), (300, 1), (), (256,)]
CODE_MAX = {"int8": 127.0, "float8": 448.0, "int4": 7.0, "int3": 3.0}
INTEGER_CODES = ["int8", "int4", "int3"]
ALL_CODES = ["int8", "float8", "int4", "int3"]


@pytest.fixture
def small_blocks(monkeypatch):
    """``map_blocks`` in blocks of about 1 KiB: block edges fall inside quantization blocks."""
    monkeypatch.setattr(in_place, "BLOCK_BYTES", 1024)


def _data(shape, seed=0) -> np.ndarray:
    """Heavy-tailed values with a wide range of magnitudes."""
    rng = np.random.default_rng(seed)
    return (rng.standard_t(3, size=shape) * rng.lognormal(0, 2, size=shape)).astype(np.float32)


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    """numpy reference layout: flattened, zero-padded, ``[blocks, block]``."""
    flat = x.reshape(-1).astype(np.float32)
    nb = -(-flat.size // block)
    return np.pad(flat, (0, nb * block - flat.size)).reshape(nb, block)


def _ref_scales(x: np.ndarray, codes: str, block: int) -> np.ndarray:
    return (np.abs(_blocks(x, block)).max(axis=1) / np.float32(CODE_MAX[codes])).astype(np.float32)


def _per_element(v: np.ndarray, shape, block: int) -> np.ndarray:
    """A per-block value broadcast to the leaf's elements."""
    size = int(np.prod(shape))
    return np.repeat(v, block)[:size].reshape(shape)


# ------------------------------------------------------------------ round trip bounds


@pytest.mark.parametrize("codes", INTEGER_CODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_nearest_integer_codes_within_half_a_step(codes, shape):
    fmt = BlockFormat(codes, rounding="nearest")
    x = _data(shape)
    stored = fmt.encode(jnp.asarray(x))
    scales = _ref_scales(x, codes, fmt.block_size)
    np.testing.assert_allclose(np.asarray(stored.scales), scales, rtol=1e-6)  # XLA: x * (1/c)
    y = np.asarray(fmt.decode(stored, shape, jnp.float32))
    assert y.shape == x.shape and y.dtype == np.float32
    step = _per_element(scales, shape, fmt.block_size)
    err = np.abs(x - y)
    assert np.all(err <= step / 2 * (1 + 1e-5) + 1e-30), float(np.max(err / step))
    # nearest is nearest: the numpy reference codes, exactly
    ref_codes = np.clip(
        np.round(_blocks(x, fmt.block_size) / np.where(scales > 0, scales, 1)[:, None]),
        -CODE_MAX[codes],
        CODE_MAX[codes],
    )
    got = _np_codes(codes, np.asarray(stored.codes))
    assert np.abs(got - ref_codes).max() <= 1  # ties at .5 may go either way after division
    assert np.mean(got == ref_codes) > 0.999


@pytest.mark.parametrize("shape", SHAPES)
def test_float8_relative_bound(shape):
    fmt = BlockFormat("float8")
    x = _data(shape, seed=1)
    stored = fmt.encode(jnp.asarray(x))
    assert stored.codes.dtype == jnp.float8_e4m3fn
    scales = _ref_scales(x, "float8", fmt.block_size)
    np.testing.assert_allclose(np.asarray(stored.scales), scales, rtol=1e-6)  # XLA: x * (1/c)
    scale = _per_element(scales, shape, fmt.block_size)
    y = np.asarray(fmt.decode(stored, shape))
    # in scaled units: relative error <= 2^-4 (3 mantissa bits), or half the subnormal step 2^-9
    scaled = np.abs(x) / np.where(scale > 0, scale, 1)
    bound = np.maximum(scaled * 2.0**-4, 2.0**-10) * scale * (1 + 1e-5)
    assert np.all(np.abs(x - y) <= bound)
    # the codes are ml_dtypes' nearest e4m3fn of x / scale
    ref = (_blocks(x, fmt.block_size) / np.where(scales > 0, scales, 1)[:, None]).astype(
        ml_dtypes.float8_e4m3fn
    )
    same = np.asarray(stored.codes).view(np.uint8) == ref.view(np.uint8)
    assert np.mean(same) > 0.999


def test_float_formats_are_casts():
    x = _data((33, 7))
    for name in ("float32", "bfloat16", "float8_e4m3fn"):
        fmt = FloatFormat(name)
        stored = fmt.encode(jnp.asarray(x))
        assert stored.dtype == jnp.dtype(name) and stored.shape == x.shape
        np.testing.assert_array_equal(
            np.asarray(stored).view(np.uint8), x.astype(jnp.dtype(name)).view(np.uint8)
        )
        back = np.asarray(fmt.decode(stored, x.shape, jnp.float32))
        np.testing.assert_array_equal(back, x.astype(jnp.dtype(name)).astype(np.float32))
        assert fmt.stored_bytes(x.shape) == stored.nbytes
        init = fmt.init(x.shape, jnp.float32)
        assert init.dtype == jnp.dtype(name) and not np.any(np.asarray(init))


# ------------------------------------------------------------------ exact zeros


@pytest.mark.parametrize("codes", ALL_CODES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_zeros_are_exact(codes, rounding):
    fmt = BlockFormat(codes, 64, rounding)
    key = jax.random.key(3)
    zeros = np.zeros((5, 100), np.float32)
    stored = fmt.encode(jnp.asarray(zeros), key)
    assert not np.any(np.asarray(stored.scales))
    back = np.asarray(fmt.decode(stored, zeros.shape))
    np.testing.assert_array_equal(back.view(np.uint32), zeros.view(np.uint32))  # +0.0, bit for bit
    # a whole block of zeros inside a nonzero leaf, and the padding of the last block
    x = _data((5, 100), seed=2)
    x.reshape(-1)[64:128] = 0  # exactly block 1
    stored = fmt.encode(jnp.asarray(x), key)
    assert float(stored.scales[1]) == 0.0
    back = np.asarray(fmt.decode(stored, x.shape))
    np.testing.assert_array_equal(back.reshape(-1)[64:128].view(np.uint32), 0)
    codes_ = np.asarray(stored.codes)
    tail = 500 % 64  # padding codes of the last block stay zero
    last = codes_[-1:].view(np.uint8)
    pad = (last if codes == "float8" else _np_codes(codes, last))[0, tail:]
    assert not np.any(pad)
    # zeros inside a nonzero block are exact for the symmetric codes
    x2 = _data((256,), seed=4)
    x2[::3] = 0
    back2 = np.asarray(fmt.decode(fmt.encode(jnp.asarray(x2), key), x2.shape))
    np.testing.assert_array_equal(back2[::3], 0)
    # init is the encoded zero
    init = fmt.init((5, 100), jnp.float32)
    ref = fmt.encode(jnp.asarray(zeros), key)
    for a, b in zip(init, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# ------------------------------------------------------------------ bytes and layout


@pytest.mark.parametrize("codes", ALL_CODES)
@pytest.mark.parametrize("shape", [*SHAPES, (0,), (2, 0)])
def test_stored_bytes_are_the_encoded_arrays(codes, shape):
    small = (24, 8) if codes == "int3" else (6, 2)  # int3: whole groups of eight codes
    for block in (DEFAULT_BLOCK_SIZES[codes], *small):
        fmt = BlockFormat(codes, block, "nearest")
        stored = fmt.encode(jnp.zeros(shape, jnp.float32))
        assert isinstance(stored, Quantized)
        nbytes = sum(a.nbytes for a in jax.tree.leaves(stored))
        assert fmt.stored_bytes(shape) == nbytes
        size = int(np.prod(shape))
        blocks = -(-size // block)
        per_block = {"int4": block // 2, "int3": block * 3 // 8}.get(codes, block)
        assert nbytes == blocks * (per_block + 4)
        like = fmt.stored_like(shape)
        assert jax.tree.map(lambda s: (s.shape, s.dtype), like) == jax.tree.map(
            lambda a: (a.shape, a.dtype), stored
        )


# ------------------------------------------------------------------ the block-wise add


@pytest.mark.parametrize(
    "fmt",
    [
        BlockFormat("int8"),
        BlockFormat("float8"),
        BlockFormat("int4"),
        BlockFormat("int8", 7),
        BlockFormat("int4", 10, "stochastic"),
        BlockFormat("int3"),
        BlockFormat("int3", 16, "nearest"),
        FloatFormat("bfloat16"),
        FloatFormat("float8_e4m3fn"),
    ],
    ids=lambda f: f.name,
)
@pytest.mark.parametrize("shape", [(97, 129), (4099,), (3, 5, 7, 11), (300, 1)])
def test_add_decoded_is_g_plus_decode(small_blocks, fmt, shape):
    x = _data(shape, seed=5) * 1e-2
    g = np.random.default_rng(6).normal(size=shape).astype(np.float32)
    stored = fmt.encode(jnp.asarray(x), jax.random.key(0))
    ref = g + np.asarray(fmt.decode(stored, shape, jnp.float32))
    for add in (fmt.add_decoded, jax.jit(fmt.add_decoded)):
        out = add(jnp.asarray(g), stored)
        assert out.shape == g.shape and out.dtype == g.dtype
        np.testing.assert_array_equal(np.asarray(out).view(np.uint32), ref.view(np.uint32))
    g16 = jnp.asarray(g, jnp.bfloat16)
    out16 = jax.jit(fmt.add_decoded)(g16, stored)
    assert out16.dtype == jnp.bfloat16 and out16.shape == shape
    ref16 = np.asarray(g16) + np.asarray(fmt.decode(stored, shape, jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(out16).view(np.uint16), ref16.view(np.uint16))


@pytest.mark.parametrize("codes", ALL_CODES)
def test_add_decoded_has_no_leaf_sized_temporary(codes):
    fmt = BlockFormat(codes, rounding="nearest")
    g = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)  # 4 MiB
    compiled = (
        jax.jit(fmt.add_decoded, donate_argnums=0).lower(g, fmt.stored_like(g.shape)).compile()
    )
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= in_place.BLOCK_BYTES + 64 * 1024, temp  # one block, not 4 MiB


GATHER_FORMATS = [
    BlockFormat("int8"),
    BlockFormat("float8"),
    BlockFormat("int4"),
    BlockFormat("int4", 10, "nearest"),
    BlockFormat("int3"),
    BlockFormat("int3", 16, "nearest"),
    BlockFormat("int8", 7, "stochastic"),
    BlockFormat("float8", 256, "stochastic"),
    FloatFormat("bfloat16"),
]


@pytest.mark.parametrize("fmt", GATHER_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", [(97, 129), (4099,), (300, 1)])
def test_values_at_are_the_decoded_elements(fmt, shape):
    """Each element decoded from its own code equals the whole leaf decoded, bit for bit,
    at every position of a packed group and in the last, padded block."""
    stored = fmt.encode(jnp.asarray(_data(shape, seed=7)), jax.random.key(1))
    size = int(np.prod(shape))
    index = np.random.default_rng(8).integers(0, size, size=(37, 41)).astype(np.int32)
    index[0, :16] = np.arange(size - 16, size)  # the last, padded block
    ref = np.asarray(fmt.decode(stored, shape, jnp.float32)).reshape(-1)[index]
    values = jax.jit(lambda st, i: fmt.values_at(st, shape, i, i[0, 0]))(stored, index)
    assert values.shape == index.shape and values.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(values).view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("fmt", GATHER_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", [(97, 129), (300, 1), (1031, 777)])
def test_encode_gathered_is_encode_of_the_gathered_leaf(small_blocks, fmt, shape):
    """Encoded a part at a time (1 KiB parts here, so every leaf is cut, mostly with a
    remainder), the codes and scales are :meth:`encode`'s of the whole leaf bit for bit,
    the stochastic draws included: each is indexed by its element's place in the leaf."""
    source = jnp.asarray(_data((5, *shape), seed=9))
    picked = 3

    def gathered(src, key):
        flat = src[picked].reshape(-1)
        return fmt.encode_gathered(lambda i: flat[i], shape, key)

    key = jax.random.key(2)
    want = fmt.encode(source[picked], key)
    got = jax.jit(gathered)(source, key)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("codes", ALL_CODES)
def test_encode_gathered_holds_one_part_of_float32_values(codes):
    """Encoding a gathered 4 MiB leaf from a 16 MiB source holds about one part
    (``in_place.BLOCK_BYTES``) of float32 values, not the gathered leaf."""
    fmt = BlockFormat(codes, rounding="stochastic")
    shape = (1024, 1024)

    def encode(src, key):
        return fmt.encode_gathered(lambda i: src[i // 1024 * 2, i % 1024 * 2], shape, key)

    src = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)
    compiled = jax.jit(encode).lower(src, jax.random.key(0)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= in_place.BLOCK_BYTES + 64 * 1024, temp  # one part, not 4 MiB


# ------------------------------------------------------------------ int4 and int3 packing


def _np_unpack(packed: np.ndarray) -> np.ndarray:
    """numpy reference: low nibble element 2i, high nibble 2i + 1, 4-bit two's complement."""
    low = (packed & 0x0F).astype(np.int16)
    high = (packed >> 4).astype(np.int16)
    low = np.where(low >= 8, low - 16, low)
    high = np.where(high >= 8, high - 16, high)
    return np.stack([low, high], axis=-1).reshape(packed.shape[0], -1)


def _np_pack(q: np.ndarray) -> np.ndarray:
    nib = (q.astype(np.int16) & 0x0F).astype(np.uint8)
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def _np_unpack_int3(packed: np.ndarray) -> np.ndarray:
    """numpy reference: the bytes as one little-endian bit stream, three bits a code (least
    significant first), 3-bit two's complement."""
    bits = np.unpackbits(packed, axis=1, bitorder="little")
    triplets = bits.reshape(packed.shape[0], -1, 3).astype(np.int16)
    q = triplets[..., 0] + 2 * triplets[..., 1] + 4 * triplets[..., 2]
    return np.where(q >= 4, q - 8, q)


def _np_pack_int3(q: np.ndarray) -> np.ndarray:
    bits = (((q.astype(np.int16) & 0x07)[..., None] >> np.arange(3)) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(q.shape[0], -1), axis=1, bitorder="little")


_NP_PACKERS = {"int4": (_np_unpack, _np_pack), "int3": (_np_unpack_int3, _np_pack_int3)}
"""numpy (unpack, pack) of the codes kept below a byte."""


def _np_codes(codes: str, stored: np.ndarray) -> np.ndarray:
    """The integer codes of ``[blocks, width]`` stored codes, unpacked in numpy."""
    return _NP_PACKERS[codes][0](stored) if codes in _NP_PACKERS else np.asarray(stored)


@pytest.mark.parametrize(
    "codes, block, width, code_max",
    [("int4", 8, 4, 7), ("int3", 16, 6, 3)],  # two codes a byte; eight in three bytes
)
def test_packed_codes_match_numpy(codes, block, width, code_max):
    fmt = BlockFormat(codes, block, "nearest")
    unpack, pack = _NP_PACKERS[codes]
    x = _data((13, 11), seed=7)
    stored = fmt.encode(jnp.asarray(x))
    packed = np.asarray(stored.codes)
    assert packed.dtype == np.uint8 and packed.shape == (-(-143 // block), width)
    q = unpack(packed)
    assert q.min() >= -code_max and q.max() <= code_max
    assert {-code_max, code_max} <= set(q.ravel().tolist())  # each block's absmax code
    np.testing.assert_array_equal(pack(q), packed)
    scales = np.asarray(stored.scales)
    ref = (q.astype(np.float32) * scales[:, None]).reshape(-1)[: x.size].reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(fmt.decode(stored, x.shape)), ref)


def test_every_int3_code_survives_packing_at_every_position_of_a_group():
    codes = np.arange(-3, 4, dtype=np.int8)
    runs = np.stack([np.roll(np.resize(codes, 8), shift) for shift in range(8)]).reshape(1, -1)
    stored = Quantized(jnp.asarray(_np_pack_int3(runs)), jnp.ones((1,), jnp.float32))
    fmt = BlockFormat("int3", runs.shape[1], "nearest")
    np.testing.assert_array_equal(np.asarray(fmt.decode(stored, (runs.shape[1],))), runs[0])


def test_every_int4_code_survives_packing_in_both_nibbles():
    codes = np.arange(-7, 8, dtype=np.int8)
    pairs = np.stack(np.meshgrid(codes, codes), -1).reshape(1, -1)
    stored = Quantized(jnp.asarray(_np_pack(pairs)), jnp.ones((1,), jnp.float32))
    fmt2 = BlockFormat("int4", pairs.shape[1], "nearest")
    np.testing.assert_array_equal(np.asarray(fmt2.decode(stored, (pairs.shape[1],))), pairs[0])


# ------------------------------------------------------------------ stochastic rounding


@pytest.mark.parametrize("codes", ALL_CODES)
def test_stochastic_rounding_is_unbiased(codes):
    fmt = BlockFormat(codes, 32, "stochastic")
    x = _data((4, 32), seed=8)
    trials = 2000
    keys = jax.random.split(jax.random.key(11), trials)
    decoded = jax.vmap(lambda k: fmt.decode(fmt.encode(jnp.asarray(x), k), x.shape))(keys)
    decoded = np.asarray(decoded, np.float64)
    scale = _per_element(_ref_scales(x, codes, 32), x.shape, 32).astype(np.float64)
    if codes == "float8":  # the gap between the two neighbouring e4m3fn values
        scaled = np.abs(x) / scale
        lo = np.asarray(jnp.asarray(scaled, jnp.float32).astype(jnp.float8_e4m3fn), np.float64)
        gap = np.maximum(np.abs(lo) * 2.0**-3, 2.0**-9)
        step = gap * scale
    else:
        step = scale
    # each draw is within one step of x; variance <= step^2 / 4: 6 standard errors of the mean
    assert np.all(np.abs(decoded - x) <= step * (1 + 1e-5))
    mean = decoded.mean(axis=0)
    tol = 6 * np.sqrt(step**2 / 4 / trials) + 1e-6 * np.abs(x)
    assert np.all(np.abs(mean - x) <= tol), float(np.max(np.abs(mean - x) / tol))
    # nearest rounding of the same values is biased on some elements (the test could fail)
    near = BlockFormat(codes, 32, "nearest")
    nearest = np.asarray(near.decode(near.encode(x), x.shape))
    assert np.any(np.abs(nearest - x) > tol)


def test_the_rounding_uniforms_are_uniform_and_independent():
    """The counter-based draw behind stochastic rounding: over 2**20 values, each of 64
    equal bins within 5 standard deviations of its expected count, mean and variance
    those of U[0, 1), neighbours (within a block, across blocks) and two keys
    uncorrelated, and both raw and typed keys accepted."""
    from resireduce_jax.residual_formats import _uniform

    shape = (2**13, 128)
    u = np.asarray(_uniform(jax.random.PRNGKey(3), shape), np.float64)
    assert u.min() >= 0.0 and u.max() < 1.0
    n = u.size
    counts = np.bincount((u.ravel() * 64).astype(int), minlength=64)
    expected = n / 64
    assert np.all(np.abs(counts - expected) <= 5 * np.sqrt(expected * (1 - 1 / 64)))
    assert abs(u.mean() - 0.5) <= 5 * np.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) <= 5 * np.sqrt(1 / 180 / n)
    limit = 5 / np.sqrt(n)  # a correlation coefficient's standard error is 1 / sqrt(n)
    flat = u.ravel()
    assert abs(np.corrcoef(flat[:-1], flat[1:])[0, 1]) <= limit
    assert abs(np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]) <= limit
    other = np.asarray(_uniform(jax.random.PRNGKey(4), shape), np.float64)
    assert abs(np.corrcoef(flat, other.ravel())[0, 1]) <= limit
    typed = np.asarray(_uniform(jax.random.wrap_key_data(jax.random.PRNGKey(3)), shape))
    np.testing.assert_array_equal(typed, u.astype(np.float32))


@pytest.mark.parametrize("codes", ALL_CODES)
def test_stochastic_rounding_depends_on_the_key_only(codes):
    fmt = BlockFormat(codes, rounding="stochastic")
    x = jnp.asarray(_data((40, 30), seed=9))
    a = fmt.encode(x, jax.random.key(1))
    b = fmt.encode(x, jax.random.key(1))
    c = fmt.encode(x, jax.random.key(2))
    bits = lambda s: np.asarray(s.codes).view(np.uint8)
    np.testing.assert_array_equal(bits(a), bits(b))
    assert np.any(bits(a) != bits(c))
    np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(c.scales))
    with pytest.raises(ValueError, match=r"needs a jax\.random key"):
        fmt.encode(x)
    assert fmt.stochastic and not BlockFormat(codes, rounding="nearest").stochastic


# ------------------------------------------------------------------ jit and vmap


@pytest.mark.parametrize(
    "fmt",
    [
        BlockFormat("int8"),
        BlockFormat("float8", 64, "stochastic"),
        BlockFormat("int4", 20, "stochastic"),
        BlockFormat("int3", 24, "stochastic"),
        FloatFormat("bfloat16"),
    ],
    ids=lambda f: f.name,
)
def test_jit_and_vmap_match_eager(fmt):
    stack = jnp.asarray(_data((3, 17, 19), seed=10))
    keys = jax.random.split(jax.random.key(5), 3)
    eager = [fmt.encode(stack[i], keys[i]) for i in range(3)]
    mapped = jax.jit(jax.vmap(fmt.encode))(stack, keys)
    for i in range(3):
        row = jax.tree.leaves(jax.tree.map(lambda s, i=i: s[i], mapped))
        for a, b in zip(jax.tree.leaves(eager[i]), row, strict=True):
            np.testing.assert_array_equal(
                np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
            )
    jitted = jax.jit(fmt.encode)(stack[0], keys[0])
    for a, b in zip(jax.tree.leaves(eager[0]), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    decoded = jax.jit(jax.vmap(lambda s: fmt.decode(s, (17, 19))))(mapped)
    for i in range(3):
        np.testing.assert_array_equal(
            np.asarray(decoded[i]), np.asarray(fmt.decode(eager[i], (17, 19)))
        )
    g = jnp.asarray(np.random.default_rng(1).normal(size=(3, 17, 19)), jnp.float32)
    added = jax.jit(jax.vmap(fmt.add_decoded))(g, mapped)
    np.testing.assert_array_equal(np.asarray(added), np.asarray(g) + np.asarray(decoded))


# ------------------------------------------------------------------ parsing


def test_parse_format_accepts():
    assert parse_format("int8") == BlockFormat("int8", 256, "nearest")
    assert parse_format("float8") == BlockFormat("float8", 256)
    assert parse_format("int4") == BlockFormat("int4", 128, "stochastic")
    assert parse_format("int3") == BlockFormat("int3", 128, "stochastic")
    # the rounding's default is per code: stochastic for the 4- and 3-bit codes
    assert [BlockFormat(c).rounding for c in ALL_CODES] == [
        "nearest",
        "nearest",
        "stochastic",
        "stochastic",
    ]
    assert parse_format("int3/64/nearest") == BlockFormat("int3", 64, "nearest")
    assert parse_format("int4/64") == BlockFormat("int4", 64, "stochastic")
    assert parse_format("int4/64/nearest").rounding == "nearest"
    assert parse_format("float32") == FloatFormat("float32")
    assert parse_format("bfloat16") == FloatFormat("bfloat16")
    assert parse_format("float8_e4m3fn") == FloatFormat("float8_e4m3fn")
    assert parse_format(jnp.bfloat16) == FloatFormat("bfloat16")
    assert parse_format(np.float32) == FloatFormat("float32")
    assert parse_format(jnp.float8_e4m3fn) == FloatFormat("float8_e4m3fn")
    assert parse_format(np.dtype("float16")) == FloatFormat("float16")
    fmt = BlockFormat("int4", 64, "stochastic")
    assert parse_format(fmt) is fmt
    assert parse_format(fmt.name) == fmt
    assert parse_format("int8/32") == BlockFormat("int8", 32)
    assert {parse_format(n).name for n in ("int8", "float32")} == {"int8/256/nearest", "float32"}
    hash(fmt)  # static arguments of jit


@pytest.mark.parametrize(
    "value", ["int16", "fp8", "", "int8/x", "int8/8/up", "int8/8/nearest/1", None, 3, jnp.int8]
)
def test_parse_format_rejects(value):
    with pytest.raises(ValueError, match=r"expected a ResidualFormat|must be"):
        parse_format(value)


def test_invalid_formats_say_how_to_fix():
    with pytest.raises(ValueError, match=r"multiple of 2.*use 8"):
        BlockFormat("int4", 7)
    with pytest.raises(ValueError, match=r"multiple of 8.*use 104"):
        BlockFormat("int3", 100)
    with pytest.raises(ValueError, match="positive int"):
        BlockFormat("int8", 0)
    with pytest.raises(ValueError, match="positive int"):
        BlockFormat("int8", 2.5)
    with pytest.raises(ValueError, match="codes must be one of"):
        BlockFormat("int2")
    with pytest.raises(ValueError, match="rounding must be"):
        BlockFormat("int8", rounding="up")
    with pytest.raises(ValueError, match="floating dtype"):
        FloatFormat("int8")
