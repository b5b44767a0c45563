"""How an error-feedback residual is kept: a float cast, or block-scaled low-bit codes.

A :class:`ResidualFormat` encodes a leaf-shaped residual into what a store keeps and decodes
it back. :class:`FloatFormat` is a plain cast (``residual_dtype=``); :class:`BlockFormat`
keeps int8, float8 (e4m3fn) or packed int4 or int3 codes with one float32 scale per block of
the flattened leaf, as block-wise quantized optimizer states do:

- Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022,
  https://arxiv.org/abs/2110.02861 (an absmax per block of the flattened state);
- Li et al., "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023,
  https://arxiv.org/abs/2309.01507 (4-bit states, blocks of 128);
- Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space Overhead and
  Provable Convergence", NeurIPS 2024, https://arxiv.org/abs/2405.15593 (4-bit error
  feedback with per-block statistics).

Layout, scale rule, rounding and the int4 / int3 choices: docs/design.md, "Residual formats
(residual_formats.py)".
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from resireduce_jax._src import in_place

__all__ = [
    "DEFAULT_BLOCK_SIZES",
    "DEFAULT_ROUNDINGS",
    "BlockFormat",
    "FloatFormat",
    "Quantized",
    "ResidualFormat",
    "parse_format",
]

Codes = Literal["int8", "float8", "int4", "int3"]
Rounding = Literal["nearest", "stochastic"]

DEFAULT_BLOCK_SIZES: dict[str, int] = {"int8": 256, "float8": 256, "int4": 128, "int3": 128}
"""Elements per scale: 256 for int8 and float8 (finer than Dettmers et al.'s 2048),
Li et al.'s 128 for int4 and int3."""

DEFAULT_ROUNDINGS: dict[str, str] = {
    "int8": "nearest",
    "float8": "nearest",
    "int4": "stochastic",
    "int3": "stochastic",
}
"""Stochastic for int4 and int3: a residual below half a code step rounds to zero every step
under nearest rounding, so error feedback never accumulates it, and int4's step is eighteen
times int8's (int3's forty-two times). docs/design.md, "Residual formats"."""

_CODE_MAX = {
    "int8": 127.0,
    "float8": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
    "int4": 7.0,
    "int3": 3.0,
}
_CODE_DTYPE = {"int8": jnp.int8, "float8": jnp.float8_e4m3fn, "int4": jnp.uint8, "int3": jnp.uint8}
_PACKING = {"int8": (1, 1), "float8": (1, 1), "int4": (2, 1), "int3": (8, 3)}
"""(codes, bytes) of one packed group: int4 two codes a byte, int3 eight codes in three."""


class Quantized(NamedTuple):
    """A leaf kept as block codes: ``codes`` ``[blocks, block_size]`` (int4: two codes a
    byte, ``[blocks, block_size // 2]`` uint8; int3: eight codes in three bytes,
    ``[blocks, 3 * block_size // 8]`` uint8) and ``scales`` ``[blocks]`` float32."""

    codes: jax.Array
    scales: jax.Array


class ResidualFormat(abc.ABC):
    """How a residual leaf is kept: ``encode`` to the stored pytree, ``decode`` back."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """A short name; :func:`parse_format` of it gives this format back."""

    @property
    def stochastic(self) -> bool:
        """Whether :meth:`encode` needs a key (stochastic rounding)."""
        return False

    @abc.abstractmethod
    def stored_like(self, shape: tuple[int, ...]) -> Any:
        """The stored pytree of a leaf of ``shape``, as ``jax.ShapeDtypeStruct`` leaves."""

    @abc.abstractmethod
    def encode(self, x: jax.Array, key: jax.Array | None = None) -> Any:
        """``x`` as kept (``key``: the stochastic rounding's ``jax.random`` key)."""

    def encode_gathered(
        self,
        value_at: Callable[[jax.Array], jax.Array],
        shape: tuple[int, ...],
        key: jax.Array | None = None,
    ) -> Any:
        """``encode(x, key)`` of the leaf ``x`` of ``shape`` whose flat element ``i`` is
        ``value_at(i)`` (``value_at``: int32 flat indices to values, elementwise), for an
        ``x`` that is computed rather than held, such as a store's gathered kept block. A
        format that can encodes it a part at a time, so that ``x`` is never formed whole."""
        index = lax.iota(jnp.int32, math.prod(shape))
        return self.encode(value_at(index).reshape(shape), key)

    @abc.abstractmethod
    def decode(self, stored: Any, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        """The kept values of a leaf of ``shape`` back as ``dtype``."""

    def values_at(
        self, stored: Any, shape: tuple[int, ...], index: jax.Array, varying: Any = None
    ) -> jax.Array:
        """float32 values of flat elements ``index`` (int32, any shape) of a kept leaf of
        ``shape``: ``decode(stored, shape).ravel()[index]``. ``varying``: something that
        changes from one iteration to the next where this is read in a loop body."""
        del varying
        return self.decode(stored, shape).reshape(-1)[index]

    @abc.abstractmethod
    def add_decoded(self, g: jax.Array, stored: Any) -> jax.Array:
        """``g + decode(stored, g.shape, g.dtype)``, written over ``g``'s buffer block by
        block (``g`` must not be read afterwards): no leaf-sized decoded copy is formed."""

    def init(self, shape: tuple[int, ...], dtype: Any = None) -> Any:
        """The stored zero residual of a leaf of ``shape`` (``dtype``: the leaf's, unused:
        the stored dtypes are the format's)."""
        del dtype
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.stored_like(shape))

    def stored_bytes(self, shape: tuple[int, ...]) -> int:
        """Exact bytes kept for a leaf of ``shape`` (codes, scales and padding)."""
        return sum(
            math.prod(s.shape) * np.dtype(s.dtype).itemsize
            for s in jax.tree.leaves(self.stored_like(shape))
        )


@dataclasses.dataclass(frozen=True)
class FloatFormat(ResidualFormat):
    """The residual cast to a floating ``dtype`` (nearest) and back: ``"float32"``,
    ``"bfloat16"``, ...; ``"float8_e4m3fn"`` is the legacy unscaled cast (values beyond
    448 overflow, small ones flush: prefer ``BlockFormat("float8")``)."""

    dtype: str = "float32"

    def __post_init__(self):
        try:
            dtype = jnp.dtype(self.dtype)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"FloatFormat.dtype must be a floating dtype, got {self.dtype!r}."
            ) from e
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"FloatFormat.dtype must be a floating dtype, got {self.dtype!r}.")
        object.__setattr__(self, "dtype", dtype.name)

    @property
    def name(self) -> str:
        return self.dtype

    def stored_like(self, shape):
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(self.dtype))

    def encode(self, x, key=None):
        del key
        return jnp.asarray(x).astype(self.dtype)

    def decode(self, stored, shape, dtype=jnp.float32):
        return jnp.asarray(stored).reshape(shape).astype(dtype)

    def add_decoded(self, g, stored):
        return in_place.add_into(g, stored.reshape(g.shape))


def _num_blocks(size: int, block_size: int) -> int:
    return -(-size // block_size)


@dataclasses.dataclass(frozen=True)
class BlockFormat(ResidualFormat):
    """Block-scaled codes: the flattened leaf, zero-padded to whole blocks of
    ``block_size``, with one float32 scale per block (:class:`Quantized`).

    ``codes``: ``"int8"`` (symmetric, ``[-127, 127]``, scale ``absmax / 127``),
    ``"float8"`` (e4m3fn codes of ``x / scale``, scale ``absmax / 448``), ``"int4"``
    (symmetric, ``[-7, 7]``, scale ``absmax / 7``, two codes a byte) or ``"int3"``
    (symmetric, ``[-3, 3]``, scale ``absmax / 3``, eight codes in three bytes). int4 and int3
    are symmetric rather than min/scale: at equal bytes per element a per-block minimum
    barely lowers the reconstruction error of gradients and top-k residuals, while the
    symmetric code keeps every zero exact (the coordinates just sent, dead units, padding)
    with one float a block; int3 leaves its eighth code, ``-4``, unused for that symmetry.

    A block of zeros has scale 0 and decodes to exact zeros. ``rounding="stochastic"``
    rounds ``x / scale`` down or up to a neighbouring code with the probabilities that make
    it unbiased (int8, int4: ``floor(x / scale + u)``, ``u ~ U[0, 1)``; float8: between the
    two neighbouring e4m3fn values); :meth:`encode` then needs a key. The default,
    ``None``, is :data:`DEFAULT_ROUNDINGS`' (stochastic for int4). Inputs must be finite.
    """

    codes: Codes = "int8"
    block_size: int | None = None
    rounding: Rounding | None = None  # None: DEFAULT_ROUNDINGS[codes]

    def __post_init__(self):
        if self.codes not in _CODE_MAX:
            raise ValueError(
                f"BlockFormat.codes must be one of {sorted(_CODE_MAX)}, got {self.codes!r}."
            )
        if self.rounding is None and self.codes in _CODE_MAX:
            object.__setattr__(self, "rounding", DEFAULT_ROUNDINGS[self.codes])
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(
                f"BlockFormat.rounding must be 'nearest' or 'stochastic', got {self.rounding!r}."
            )
        size = DEFAULT_BLOCK_SIZES[self.codes] if self.block_size is None else self.block_size
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise ValueError(
                f"BlockFormat.block_size must be a positive int, got {self.block_size!r} "
                f"(default for {self.codes}: {DEFAULT_BLOCK_SIZES[self.codes]})."
            )
        group = _PACKING[self.codes][0]
        if size % group:
            raise ValueError(
                f"{self.codes} packs {group} codes a group: block_size must be a positive "
                f"multiple of {group}, got {size} (use {size + group - size % group}, or the "
                f"default {DEFAULT_BLOCK_SIZES[self.codes]})."
            )
        object.__setattr__(self, "block_size", int(size))

    @property
    def name(self) -> str:
        return f"{self.codes}/{self.block_size}/{self.rounding}"

    @property
    def stochastic(self) -> bool:
        return self.rounding == "stochastic"

    @property
    def _code_width(self) -> int:
        """Stored code entries per block (int4, int3: packed bytes)."""
        codes, stored = _PACKING[self.codes]
        return self.block_size // codes * stored

    def stored_like(self, shape):
        blocks = _num_blocks(math.prod(shape), self.block_size)
        return Quantized(
            jax.ShapeDtypeStruct((blocks, self._code_width), np.dtype(_CODE_DTYPE[self.codes])),
            jax.ShapeDtypeStruct((blocks,), np.dtype(np.float32)),
        )

    # --------------------------------------------------------------------- encode

    def encode(self, x, key=None):
        self._check_key(key)
        x = jnp.asarray(x)
        size = x.size
        blocks = _num_blocks(size, self.block_size)
        flat = x.reshape(-1).astype(jnp.float32)
        flat = jnp.pad(flat, (0, blocks * self.block_size - size))
        return self._encode_blocks(flat.reshape(blocks, self.block_size), key, 0)

    def encode_gathered(self, value_at, shape, key=None):
        """:meth:`encode` of the computed leaf, in parts of whole blocks as
        :func:`resireduce_jax._src.in_place.map_blocks` cuts a float32 leaf: each part's
        values are computed, encoded and written into the codes and scales, so at most one
        part's float32 values are alive. The codes and scales equal :meth:`encode`'s bit
        for bit: the stochastic draw is indexed by the element's place in the whole leaf."""
        self._check_key(key)
        size = math.prod(shape)
        if size == 0:
            return self.init(shape)
        bs = self.block_size
        blocks = _num_blocks(size, bs)

        def part(first: jax.Array, count: int, padded: bool = False) -> Quantized:
            index = first * bs + lax.iota(jnp.int32, count * bs)
            if not padded:
                values = value_at(index).astype(jnp.float32)
            else:  # the last block's padding: zeros, as encode pads
                values = value_at(jnp.minimum(index, size - 1)).astype(jnp.float32)
                values = jnp.where(index < size, values, 0.0)
            return self._encode_blocks(values.reshape(count, bs), key, first)

        span = in_place.block_rows(blocks, bs, 4)
        whole = size // (span * bs)  # parts without padding; the rest is one part at most
        if whole == 0:
            return part(jnp.zeros([], jnp.int32), blocks, padded=blocks * bs > size)

        def write(stored: Quantized, new: Quantized, first: jax.Array) -> Quantized:
            return jax.tree.map(
                lambda old, n: lax.dynamic_update_slice_in_dim(old, n, first, 0), stored, new
            )

        def body(i, stored):
            first = (i * span).astype(jnp.int32)
            return write(stored, part(first, span), first)

        # The loop's zeros vary over the mesh axes that a part's codes vary over (shard_map).
        like = jax.eval_shape(lambda first: part(first, span), jnp.zeros([], jnp.int32))
        stored = lax.fori_loop(0, whole, body, jax.tree.map(_zeros_like, self.init(shape), like))
        if blocks > whole * span:
            first = jnp.asarray(whole * span, jnp.int32)
            last = part(first, blocks - whole * span, padded=blocks * bs > size)
            stored = write(stored, last, first)
        return stored

    def _check_key(self, key: jax.Array | None) -> None:
        if self.stochastic and key is None:
            raise ValueError(
                f"BlockFormat({self.codes!r}, rounding='stochastic') needs a jax.random key: "
                "encode(x, key)."
            )

    def _encode_blocks(self, b: jax.Array, key: jax.Array | None, first: Any) -> Quantized:
        """Codes and scales of float32 blocks ``b`` ``[n, block_size]`` that are blocks
        ``first ...`` of a leaf (``first`` indexes the stochastic draw)."""
        code_max = _CODE_MAX[self.codes]
        # max |b| as max(max b, -min b): XLA:CPU would materialize |b| for the reduction.
        absmax = jnp.abs(jnp.maximum(jnp.max(b, axis=1), -jnp.min(b, axis=1)))
        scales = absmax / code_max
        safe = jnp.where(scales > 0, scales, 1.0)  # a zero block: y = 0, codes 0, scale 0
        y = jnp.clip(b / safe[:, None], -code_max, code_max)
        u = _uniform(key, b.shape, first) if self.stochastic else None
        if self.codes == "float8":
            codes = _float8_round(y, u)
        else:
            q = jnp.round(y) if u is None else jnp.floor(y + u)
            q = jnp.clip(q, -code_max, code_max).astype(jnp.int8)
            codes = _PACKERS[self.codes][0](q) if self.codes in _PACKERS else q
        return Quantized(codes, scales)

    # --------------------------------------------------------------------- decode

    def _block_values(self, codes: jax.Array, scales: jax.Array) -> jax.Array:
        """float32 values of blocks ``[n, code_width]`` codes with ``[n]`` scales."""
        q = _PACKERS[self.codes][1](codes) if self.codes in _PACKERS else codes
        return q.astype(jnp.float32) * scales[:, None]

    def decode(self, stored, shape, dtype=jnp.float32):
        size = math.prod(shape)
        values = self._block_values(stored.codes, stored.scales).reshape(-1)
        return values[:size].reshape(shape).astype(dtype)

    def values_at(self, stored, shape, index, varying=None):
        """Each element decoded from its own code and block scale, gathered from the
        codes' bytes: no block is decoded whole. Values equal :meth:`decode`'s bit for bit."""
        del shape
        codes, scales = stored
        bs = self.block_size
        block, offset = index // bs, index % bs
        if self.codes == "float8":
            # Gathered as bytes, made loop-variant: XLA:CPU would widen the whole float8
            # operand first, and hoist a bitcast of loop-invariant codes out as a copy.
            codes, _ = lax.optimization_barrier((codes, varying))
            bits = lax.bitcast_convert_type(codes, jnp.uint8)[block, offset]
            q = lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
        elif self.codes == "int4":
            byte = lax.bitcast_convert_type(codes[block, offset // 2], jnp.int8)
            shift = (4 * (1 - offset % 2)).astype(jnp.int8)  # the code to the high nibble
            q = jnp.right_shift(jnp.left_shift(byte, shift), jnp.int8(4))  # sign-extended
        elif self.codes == "int3":
            group, j = offset // 8, (offset % 8).astype(jnp.uint32)
            word = codes[block, 3 * group].astype(jnp.uint32)
            word = word | (codes[block, 3 * group + 1].astype(jnp.uint32) << 8)
            word = word | (codes[block, 3 * group + 2].astype(jnp.uint32) << 16)
            triplet = ((word >> (3 * j)) & 0x07).astype(jnp.int8)
            q = (triplet ^ 4) - 4
        else:
            q = codes[block, offset]
        return q.astype(jnp.float32) * scales[block]

    def add_decoded(self, g, stored):
        size = g.size
        if size == 0:
            return g
        bs = self.block_size
        blocks = stored.codes.shape[0]
        codes, scales = stored

        def code_bytes(varying):
            if self.codes != "float8":
                return codes
            # Made loop-variant, so that the bitcast is not hoisted out as a copy of the codes.
            varying_codes, _ = lax.optimization_barrier((codes, varying))
            return lax.bitcast_convert_type(varying_codes, jnp.uint8)

        def add(block, row0):
            n = block.size  # static: the block's rows are a contiguous run of g.ravel()
            first = row0 * block.shape[1]  # flat index of the block's first element
            count = min(blocks, -(-(n + bs - 1) // bs))  # code blocks that cover it
            start = jnp.clip(first // bs, 0, blocks - count)
            # Codes are sliced as bytes: XLA:CPU would widen a whole float8 operand first.
            part_codes = lax.dynamic_slice_in_dim(code_bytes(start), start, count, 0)
            if self.codes == "float8":
                part_codes = lax.bitcast_convert_type(part_codes, jnp.float8_e4m3fn)
            part = self._block_values(
                part_codes, lax.dynamic_slice_in_dim(scales, start, count, 0)
            ).reshape(-1)
            part = lax.dynamic_slice_in_dim(part, first - start * bs, n, 0)
            # The barrier keeps the decoded block exact (no multiply-add fused into one FMA).
            part = lax.optimization_barrier(part.reshape(block.shape).astype(block.dtype))
            return block + part

        return in_place.map_blocks(in_place.without_leading_ones(g), add).reshape(g.shape)


def _zeros_like(zeros: jax.Array, like: jax.ShapeDtypeStruct) -> jax.Array:
    """``zeros`` made to vary over the shard_map axes that ``like`` varies over."""
    manual = getattr(like, "manual_axis_type", None)
    axes = tuple(sorted(manual.varying)) if manual is not None else ()
    return lax.pcast(zeros, axes, to="varying") if axes else zeros


def _mix32(x: jax.Array) -> jax.Array:
    """A bijective avalanche on uint32 (the "lowbias32" integer hash)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _uniform(key: jax.Array, shape: tuple[int, int], first: Any = 0) -> jax.Array:
    """float32 uniforms in ``[0, 1)`` for blocks ``[n, block_size]``, one per element, that
    are blocks ``first ...`` of a leaf.

    A counter-based draw: each value is a hash of the key and the element's flat index, so
    it is elementwise and XLA fuses it into the encoding (``jax.random.uniform``'s threefry
    is materialized, a leaf-sized float32 temporary). 24 random bits per value, which is
    all a float32 in ``[0, 1)`` holds.
    """
    words = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    words = jnp.asarray(words, jnp.uint32).reshape(-1)
    rows = lax.broadcasted_iota(jnp.uint32, shape, 0) + jnp.asarray(first).astype(jnp.uint32)
    index = rows * jnp.uint32(shape[1])
    index = index + lax.broadcasted_iota(jnp.uint32, shape, 1)
    bits = _mix32(_mix32(index ^ words[0]) + words[-1])
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def _float8_round(y: jax.Array, u: jax.Array | None) -> jax.Array:
    """``y`` (``|y| <= 448``) as e4m3fn: nearest, or with ``u`` stochastically between the
    two neighbouring e4m3fn values (the upper one with probability ``(|y| - lo) / (hi - lo)``)."""
    nearest = y.astype(jnp.float8_e4m3fn)
    if u is None:
        return nearest
    a = jnp.abs(y)
    bits = lax.bitcast_convert_type(nearest, jnp.uint8) & 0x7F  # magnitude bits: monotonic
    above = jnp.abs(nearest.astype(jnp.float32)) > a
    lo_bits = jnp.where(above, bits - 1, bits)
    hi_bits = jnp.where(above, bits, jnp.minimum(bits + 1, 0x7E))  # 0x7E: 448, 0x7F: NaN

    def value(b):
        return lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float32)

    lo, hi = value(lo_bits), value(hi_bits)
    gap = hi - lo
    p = jnp.where(gap > 0, (a - lo) / jnp.where(gap > 0, gap, 1.0), 0.0)
    magnitude = jnp.where(u < p, hi_bits, lo_bits)
    sign = jnp.where(jnp.signbit(y) & (magnitude > 0), jnp.uint8(0x80), jnp.uint8(0))
    return lax.bitcast_convert_type(magnitude | sign, jnp.float8_e4m3fn)


def _pack_int4(q: jax.Array) -> jax.Array:
    """int8 codes in ``[-7, 7]``, ``[n, 2m]``, as ``[n, m]`` uint8: element ``2i`` in the
    low nibble, ``2i + 1`` in the high one, each as 4-bit two's complement."""
    nibbles = lax.bitcast_convert_type(q, jnp.uint8) & 0x0F
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def _unpack_int4(packed: jax.Array) -> jax.Array:
    """:func:`_pack_int4` inverted: ``[n, m]`` uint8 to ``[n, 2m]`` int8 codes."""
    signed = lax.bitcast_convert_type(packed, jnp.int8)
    low = jnp.right_shift(jnp.left_shift(signed, 4), 4)  # arithmetic shifts sign-extend
    high = jnp.right_shift(signed, 4)
    return jnp.stack([low, high], axis=-1).reshape(packed.shape[0], -1)


def _pack_int3(q: jax.Array) -> jax.Array:
    """int8 codes in ``[-3, 3]``, ``[n, 8m]``, as ``[n, 3m]`` uint8: each run of eight
    codes, as 3-bit two's complement, is one little-endian 24-bit word with code ``j`` at
    bits ``[3j, 3j + 3)``."""
    triplets = lax.bitcast_convert_type(q, jnp.uint8) & 0x07
    triplets = triplets.astype(jnp.uint32).reshape(q.shape[0], q.shape[1] // 8, 8)
    word = triplets[..., 0]
    for j in range(1, 8):
        word = word | (triplets[..., j] << (3 * j))
    packed = jnp.stack([(word >> shift) & 0xFF for shift in (0, 8, 16)], axis=-1)
    return packed.astype(jnp.uint8).reshape(q.shape[0], q.shape[1] // 8 * 3)


def _unpack_int3(packed: jax.Array) -> jax.Array:
    """:func:`_pack_int3` inverted: ``[n, 3m]`` uint8 to ``[n, 8m]`` int8 codes."""
    b = packed.astype(jnp.uint32).reshape(packed.shape[0], packed.shape[1] // 3, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    triplets = jnp.stack([(word >> (3 * j)) & 0x07 for j in range(8)], axis=-1)
    signed = (triplets.astype(jnp.int8) ^ 4) - 4  # sign-extends the 3-bit code
    return signed.reshape(packed.shape[0], packed.shape[1] // 3 * 8)


_PACKERS = {"int4": (_pack_int4, _unpack_int4), "int3": (_pack_int3, _unpack_int3)}
"""(pack, unpack) of the codes kept below a byte."""

_FLOAT_NAMES = ("float32", "bfloat16", "float8_e4m3fn")


def parse_format(value: Any) -> ResidualFormat:
    """A :class:`ResidualFormat` from a format, a name or a floating dtype.

    Names: ``"float32"``, ``"bfloat16"`` (and other floating dtype names, ``"float8_e4m3fn"``
    the legacy unscaled cast) give a :class:`FloatFormat`; ``"int8"``, ``"float8"``,
    ``"int4"``, ``"int3"`` a :class:`BlockFormat` with the default block size and rounding, and
    ``"int4/64/stochastic"`` (a :attr:`BlockFormat.name`) one with both given. A dtype
    (``jnp.bfloat16``, ``np.float32``, ...) gives its :class:`FloatFormat`: ``residual_dtype=``.
    """
    if isinstance(value, ResidualFormat):
        return value
    accepted = (
        "a ResidualFormat, one of 'float32', 'bfloat16', 'int8', 'float8', 'int4', 'int3', "
        "'float8_e4m3fn' (legacy unscaled cast), "
        "'<int8|float8|int4|int3>/<block_size>[/<rounding>]', "
        "or a floating dtype such as jnp.bfloat16"
    )
    if isinstance(value, str):
        parts = value.split("/")
        if parts[0] in _CODE_MAX and len(parts) <= 3:
            block = None
            if len(parts) > 1:
                if not parts[1].isdigit():
                    raise ValueError(
                        f"Bad block size in residual format {value!r}; expected {accepted}."
                    )
                block = int(parts[1])
            rounding = parts[2] if len(parts) > 2 else None
            return BlockFormat(parts[0], block, rounding)
        if len(parts) == 1:
            try:
                dtype = jnp.dtype(value)
            except (TypeError, ValueError):
                dtype = None
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
                return FloatFormat(dtype.name)
        raise ValueError(f"Unknown residual format {value!r}; expected {accepted}.")
    try:
        dtype = None if value is None else jnp.dtype(value)
    except (TypeError, ValueError):
        dtype = None
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        return FloatFormat(dtype.name)
    raise ValueError(f"Unknown residual format {value!r}; expected {accepted}.")
