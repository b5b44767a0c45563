"""Leaf-sized maps written over their operand's buffer, and sums of maps without a mapped copy.

XLA gives an elementwise op on a temporary a second buffer beside its operand.
:func:`map_blocks` applies a map one row block at a time, in the leaf's own buffer.
:func:`magnitudes` writes ``|x|`` over ``x`` and keeps the signs as packed bits.
:func:`with_signs` and :func:`signed_at` give the signed values back, bit for bit.
:func:`sums` takes several sums of maps of a leaf in one chunked pass on XLA:CPU.
Why, and what each map saves: docs/design.md, "Residuals at the compiled peak".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "BLOCK_BYTES",
    "MAX_BLOCKS",
    "MIN_BLOCKS",
    "MIN_BLOCK_BYTES",
    "add_into",
    "add_slices",
    "block_indices",
    "block_rows",
    "flat_index",
    "gather_as",
    "loop_variant",
    "magnitudes",
    "map_blocks",
    "negative_at",
    "read_in_loop",
    "sign_bits",
    "signed_at",
    "sums",
    "with_signs",
    "without_leading_ones",
]

BLOCK_BYTES = 1 << 20
"""A leaf is mapped in blocks of about this many bytes (a smaller one: :data:`MIN_BLOCKS`)."""

MAX_BLOCKS = 64
"""At most this many blocks (loop trips) per map, whatever the leaf's size."""

MIN_BLOCKS = 8
"""A leaf of at least ``MIN_BLOCKS * MIN_BLOCK_BYTES`` and under :data:`BLOCK_BYTES` is
mapped in this many blocks, not in one piece: its map's one extra buffer is an eighth of
it. A leaf of :data:`BLOCK_BYTES` or more is cut in blocks of about that size only (finer
blocks there raise the lean guard's peak)."""

MIN_BLOCK_BYTES = 1 << 15
"""The smallest block :data:`MIN_BLOCKS` cuts: a leaf under ``MIN_BLOCKS`` times this is
mapped in one piece."""

SUM_CHUNK = 1 << 14
"""Elements per step of :func:`sums` on XLA:CPU (64 KiB of float32 scratch)."""


def _rows_view(x: jax.Array) -> jax.Array:
    """``x`` as a matrix whose rows are contiguous: ``(shape[0], rest)``, or a 1-D leaf cut
    into rows of the largest power of two up to 1024 that divides its size."""
    if x.ndim >= 2:
        return x.reshape(x.shape[0], -1)
    n = x.size
    width = math.gcd(n, 1024) if n else 1
    return x.reshape(n // width, width)


def without_leading_ones(x: jax.Array) -> jax.Array:
    """``x`` without its leading size-1 axes (a bitcast), so that :func:`map_blocks` cuts
    it along its first real axis: a ``[1, 1, a, b]`` kernel in ``a``-row blocks, not in one
    piece."""
    shape = x.shape
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return x.reshape(shape)


def block_rows(rows: int, cols: int, itemsize: int) -> int:
    """Rows per block of a ``rows x cols`` leaf of ``itemsize``-byte elements, as
    :func:`map_blocks` cuts it: the leaf in ``ceil(bytes / BLOCK_BYTES)`` blocks
    (``MIN_BLOCKS`` for a leaf of ``MIN_BLOCKS * MIN_BLOCK_BYTES`` up to ``BLOCK_BYTES``),
    at most ``MAX_BLOCKS`` and ``rows``."""
    nbytes = rows * cols * itemsize
    least = MIN_BLOCKS if MIN_BLOCKS * MIN_BLOCK_BYTES <= nbytes < BLOCK_BYTES else 1
    blocks = min(MAX_BLOCKS, rows, max(least, -(-nbytes // BLOCK_BYTES)))
    return -(-rows // blocks)


def map_blocks(
    x: jax.Array, fn: Callable[[jax.Array, jax.Array], jax.Array], *, slices: int = 1
) -> jax.Array:
    """``fn`` applied to ``x`` row block by row block, in ``x``'s own buffer.

    Args:
      x: the array; it must not be read after this call (else XLA copies it first).
      fn: ``fn(block, row0) -> new block`` of the same shape and dtype, where ``block`` is
        rows ``row0 ...`` of ``x``'s rows view (``x.reshape(x.shape[0], -1)``, or a 1-D
        ``x`` cut into rows) and ``row0`` a traced int32. It must be elementwise in the
        block's position (see :func:`flat_index`).
      slices: ``x`` is this many equal slices along its axis 0 (a layer stack,
        :mod:`resireduce_jax.layer_stacks`): the rows view is every slice's rows
        (``x.reshape(slices * x.shape[1], -1)``) and blocks are sized as for one slice,
        so a stack is mapped in blocks as small as one of its layers would be.

    Returns:
      ``x`` with every element mapped, shaped like ``x``.
    """
    m = x.reshape(slices * x.shape[1], -1) if slices > 1 and x.ndim > 2 else _rows_view(x)
    rows, cols = m.shape
    b = block_rows(rows // slices, cols, x.dtype.itemsize)
    if b >= rows:
        return fn(m, jnp.zeros([], jnp.int32)).reshape(x.shape)
    full = rows // b

    def block(i, m):
        row0 = (i * b).astype(jnp.int32)
        new = fn(lax.dynamic_slice_in_dim(m, row0, b, 0), row0)
        return lax.dynamic_update_slice_in_dim(m, new, row0, 0)

    m = lax.fori_loop(0, full, block, m)
    if rows % b:
        row0 = full * b
        m = m.at[row0:].set(fn(m[row0:], jnp.asarray(row0, jnp.int32)))
    return m.reshape(x.shape)


def add_into(x: jax.Array, y: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """``x + y`` (``x + scale * y`` with a ``scale``) written over ``x``'s buffer, block
    by block (:func:`map_blocks`; ``x`` must not be read afterwards). ``y`` has ``x``'s
    shape; each block of it is read in the loop and cast to ``x``'s dtype (a 16-bit ``y``
    through :func:`read_in_loop`).
    For a sum into a temporary whose other operand must stay readable: a shared
    residual added to a member's gradient, a member added to a running sum."""
    shape, x, y = x.shape, without_leading_ones(x), without_leading_ones(y)
    y_rows = _rows_view(y)

    def add(block, row0):
        part = read_in_loop(
            y_rows,
            row0,
            lambda v, r: lax.dynamic_slice_in_dim(v, r, block.shape[0], 0),
            block.dtype,
        )
        return block + (part if scale is None else scale * part)

    return map_blocks(x, add).reshape(shape)


def add_slices(x: jax.Array, values: jax.Array, start: int, index: Any) -> jax.Array:
    """``x`` with ``values[index[i]]`` added to the slice ``x[start + i]`` for every ``i``,
    written over ``x``'s buffer block by block (:func:`map_blocks`; ``x`` must not be read
    afterwards).

    For a layer stack seen slice-major (``x``: ``[slices, *shape]``) and residuals kept
    for runs of its slices (``values``: ``[n, *shape]``, ``index``: a static int array
    mapping each slice of the run to its residual): one residual per slice, or one per
    group of adjacent slices. ``x`` is mapped as rows of its slices (``[slices * a, c]``
    for slices ``(a, c)``), each block reading the residual rows it needs, cast to ``x``'s
    dtype (a 16-bit ``values`` through :func:`read_in_loop`); slices outside the run are
    left as they are, bit for bit.
    """
    slices = x.shape[0]
    a = x.shape[1] if x.ndim > 2 else 1
    c = math.prod(x.shape[1:]) // a
    table = np.full(slices, -1, np.int32)
    table[start : start + len(index)] = index
    table = jnp.asarray(table)
    rows_of = values.reshape(values.shape[0], a, c)

    def add(block, row0):
        rows = row0 + lax.iota(jnp.int32, block.shape[0])
        which = table[rows // a]
        part = gather_as(rows_of, (jnp.maximum(which, 0), rows % a), block.dtype)
        return jnp.where((which >= 0)[:, None], block + part, block)

    return map_blocks(x.reshape(slices, a, c), add, slices=slices).reshape(x.shape)


def block_indices(block: jax.Array, row0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The (row, column) of every element of a block of :func:`map_blocks` in the rows view."""
    rows = lax.broadcasted_iota(jnp.int32, block.shape, 0) + row0
    return rows, lax.broadcasted_iota(jnp.int32, block.shape, 1)


def flat_index(block: jax.Array, row0: jax.Array) -> jax.Array:
    """The flat (``x.ravel()``) index of every element of a block of :func:`map_blocks`."""
    rows, cols = block_indices(block, row0)
    return rows * block.shape[1] + cols


def sign_bits(x: jax.Array) -> jax.Array:
    """The sign bits of ``x.ravel()``, 32 to a ``uint32`` word (bit ``i % 32`` of word
    ``i // 32``); ``-0.0`` and NaNs with the sign bit set count as negative."""
    flat = x.ravel()
    words = -(-flat.size // 32)
    bits = jnp.pad(jnp.signbit(flat).astype(jnp.uint32), (0, words * 32 - flat.size))
    shifts = jnp.arange(32, dtype=jnp.uint32)
    return jnp.sum(bits.reshape(words, 32) << shifts, axis=1, dtype=jnp.uint32)


def negative_at(bits: jax.Array, index: jax.Array) -> jax.Array:
    """Whether the element at flat ``index`` (int32, any shape) had its sign bit set."""
    word = bits[index >> 5]
    return ((word >> (index & 31).astype(jnp.uint32)) & 1) == 1


def signed_at(magnitude: jax.Array, bits: jax.Array, index: jax.Array) -> jax.Array:
    """The signed values at flat ``index`` from their ``magnitude`` (same shape) and ``bits``."""
    return jnp.where(negative_at(bits, index), -magnitude, magnitude)


def magnitudes(x: jax.Array, *, slices: int = 1) -> tuple[jax.Array, jax.Array]:
    """``(|x|, sign_bits(x))`` with ``|x|`` written over ``x``'s buffer.

    ``x`` must not be read afterwards; :func:`with_signs` gives it back. ``slices``: ``x``
    is a layer stack of that many slices (:func:`map_blocks`).
    """
    bits = sign_bits(x)
    x, bits = lax.optimization_barrier((x, bits))  # the signs are read before |x| overwrites x
    magnitude = _map_flat(x, lambda block, row0: jnp.abs(block), slices)
    # Readers of |x| read the buffer: no fusion recomputes abs from x, which would keep x alive.
    return lax.optimization_barrier((magnitude, bits))


def with_signs(magnitude: jax.Array, bits: jax.Array, *, slices: int = 1) -> jax.Array:
    """``x`` again from ``magnitudes(x)``, bit for bit, written over ``magnitude``'s buffer
    (``slices``: as in :func:`magnitudes`)."""

    def restore(block, row0):
        return jnp.where(negative_at(bits, flat_index(block, row0)), -block, block)

    return _map_flat(magnitude, restore, slices)


def _map_flat(x: jax.Array, fn: Callable, slices: int) -> jax.Array:
    """:func:`map_blocks` of a map of the flat index (:func:`flat_index`) or elementwise:
    a leaf with leading size-1 axes is cut along its first real one."""
    if slices > 1:
        return map_blocks(x, fn, slices=slices)
    return map_blocks(without_leading_ones(x), fn).reshape(x.shape)


def loop_variant(values: jax.Array, varying: Any) -> tuple[jax.Array, Any]:
    """``(values, varying)`` unchanged, made to vary with the loop when ``values`` is a
    16-bit float read by a slice or gather inside a loop body.

    XLA:CPU has no 16-bit float gather or dynamic slice: its float normalization converts
    the whole operand to float32 first. When a loop body reads a loop-invariant
    ``values`` (a residual store gathered block by block, a leaf summed chunk by chunk),
    that conversion is loop-invariant too, and XLA hoists it out of the loop, where it is
    a float32 copy of ``values``, twice its bytes; a ``uint16`` bitcast of ``values`` is
    hoisted and materialized the same way, at its own bytes. ``values`` goes through one
    ``optimization_barrier`` together with ``varying``, something that changes from one
    iteration to the next (the index or the slice's start): the barrier's result varies
    too, so what the body computes from it stays in the body and is fused into the gather
    or slice, which reads only its own elements. Both results must be used: XLA drops the
    operands of unused barrier results, and with them the effect.

    The barrier only survives XLA:CPU's pipeline with the flags of
    :func:`resireduce_jax.runtime.configure_cpu`; without them it is removed, and
    :func:`read_in_loop` reads ``values`` as ``uint16`` bits, so that what is hoisted then
    is the view, not a float32 copy.
    """
    if _is_16_bit_float(values):
        return lax.optimization_barrier((values, varying))
    return values, varying


def _is_16_bit_float(x: jax.Array) -> bool:
    """bfloat16 or float16: what XLA:CPU widens to float32 for slices and gathers."""
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2


def read_in_loop(
    values: jax.Array,
    varying: Any,
    read: Callable[[jax.Array, Any], jax.Array],
    dtype: Any,
) -> jax.Array:
    """``read(values, varying).astype(dtype)`` in a loop body, without a widened copy of a
    16-bit float ``values`` hoisted out of the loop.

    ``read`` is a gather or a slice that only moves elements (``lambda v, i: v[i]``,
    ``lambda v, s: lax.dynamic_slice(v, (s,), (n,))``); ``varying`` changes from one
    iteration to the next. A 16-bit ``values`` goes through :func:`loop_variant` and is
    read as its ``uint16`` bit patterns, so only what ``read`` picks is converted. Values
    are bit for bit those of the plain read.
    """
    values, varying = loop_variant(values, varying)
    if not _is_16_bit_float(values):
        return read(values, varying).astype(dtype)
    bits = read(lax.bitcast_convert_type(values, jnp.uint16), varying)
    return lax.bitcast_convert_type(bits, values.dtype).astype(dtype)


def gather_as(values: jax.Array, index: tuple[jax.Array, ...], dtype: Any) -> jax.Array:
    """``values[index].astype(dtype)`` inside a loop body whose ``index`` varies with the
    loop (:func:`read_in_loop`). Values are bit for bit those of the plain gather."""
    return read_in_loop(values, tuple(index), lambda v, i: v[i], dtype)


def sums(
    x: jax.Array, maps: Sequence[Callable[[jax.Array], jax.Array]], dtype: Any
) -> tuple[jax.Array, ...]:
    """``tuple(sum(f(x.astype(dtype))) for f in maps)`` over all of ``x``, without a
    leaf-sized temporary on XLA:CPU.

    XLA:CPU does not fuse an element-wise producer into a reduction: ``sum(x * x)``,
    ``sum(|x|)`` (and ``vdot``, ``einsum``) materialize the mapped leaf first, a temporary
    as large as the leaf (9 MiB for each of ResiReduce-w's two weight norms of a
    1536x1536 member, 147 MiB for a clipping norm of GPT-2's token embedding), right where
    the step peaks. On CPU a leaf above :data:`SUM_CHUNK` elements is therefore read in
    chunks of that many elements in a loop that takes every map of a chunk at once; the
    last chunk is shifted back to stay in bounds and masks what the previous one counted.
    A 16-bit ``x`` is read through :func:`read_in_loop` (each chunk widened exactly).
    Other backends fuse the maps into the reductions and get the plain sums.

    Each map takes a chunk in ``dtype`` and returns an array of the chunk's shape; its sum
    is accumulated in the map's own result dtype (``dtype`` for ``jnp.abs`` or
    ``jnp.square``; cast inside the map for a count). The sums are those of the plain
    reductions up to float rounding (the summation order differs).

    Costs on XLA:CPU (measured, jax 0.10.2): one chunk of scratch per map, and a slot of
    temp per loop that no other buffer shares (XLA gives every while loop's tuple its own).
    """
    flat = x.reshape(-1)
    n = flat.size
    if n <= SUM_CHUNK or jax.default_backend() != "cpu":
        whole = flat.astype(dtype)
        return tuple(jnp.sum(f(whole)) for f in maps)

    def add_chunk(i, totals):
        start = jnp.minimum(i * SUM_CHUNK, n - SUM_CHUNK)
        chunk = read_in_loop(
            flat, start, lambda v, s: lax.dynamic_slice(v, (s,), (SUM_CHUNK,)), dtype
        )
        unseen = start + jnp.arange(SUM_CHUNK) >= i * SUM_CHUNK
        return tuple(
            total + jnp.sum(jnp.where(unseen, f(chunk), jnp.zeros((), total.dtype)))
            for f, total in zip(maps, totals, strict=True)
        )

    chunk_like = jax.ShapeDtypeStruct((SUM_CHUNK,), dtype)
    # zeros_like keeps the leaf's varying-ness over a shard_map axis (a worker's local
    # gradient or residual), as the loop carry must.
    totals = tuple(
        jnp.zeros_like(flat, dtype=jax.eval_shape(f, chunk_like).dtype, shape=()) for f in maps
    )
    return lax.fori_loop(0, -(-n // SUM_CHUNK), add_chunk, totals)
