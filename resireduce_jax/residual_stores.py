"""How residuals are stored: per leaf, shared per group, or compressed inside one layer.

The storage side of ResiReduce (Zheng et al., "Saving Memory via Residual Reduction for
DNN Training with Compressed Communication", §4.2 and §4.3; code:
https://github.com/YuchongHu/ResiReduce). Each store kind is a class: no residual, the
leaf's own, one shared by a group (average / weighted), a layer's top rows, or its rows
× columns. Each class compensates, reads what it needs of ``G~`` and keeps the new
residual; the exchange calls them. Details, the 2-D view and sharded stores:
docs/design.md, "Residual stores (residual_stores.py)".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from resireduce_jax._src import in_place
from resireduce_jax.compressors.base import ordered
from resireduce_jax.grouping import Group

__all__ = [
    "BlockResidual",
    "BlockStore",
    "Carry",
    "DimensionNorms",
    "LeafStore",
    "MatrixView",
    "NoStore",
    "RowsResidual",
    "RowsStore",
    "Shard",
    "SharedStore",
    "StorePlan",
    "WeightedSum",
    "compensate",
    "compress_residual",
    "densify",
    "dimension_norms",
    "dimension_norms_in_place",
    "init_store",
    "matrix_view",
    "residual_weight",
    "shard_store",
    "stored_bytes",
    "where_skip",
]

Kind = Literal["none", "leaf", "average", "weighted", "rows", "2d"]
Selection = Literal["top", "softmax_sample"]
NormSource = Literal["residual", "compensated"]


class MatrixView(NamedTuple):
    """A leaf seen as a matrix ``M = x.reshape(shape2d)`` whose rows lie on ``row_axis``."""

    shape2d: tuple[int, int]
    row_axis: int

    @property
    def num_rows(self) -> int:
        return self.shape2d[self.row_axis]

    @property
    def num_cols(self) -> int:
        return self.shape2d[1 - self.row_axis]


def matrix_view(path: str, shape: tuple[int, ...]) -> MatrixView:
    """The 2-D view of a leaf for intra-layer compression (docs/design.md, "Residual
    stores")."""
    if len(shape) < 2:
        raise ValueError(f"Leaf '{path}' of shape {shape} has no 2-D view (needs ndim >= 2).")
    if path.rsplit("/", 1)[-1] == "embedding":
        return MatrixView((shape[0], math.prod(shape[1:])), row_axis=0)
    return MatrixView((math.prod(shape[:-1]), shape[-1]), row_axis=1)


class Shard(NamedTuple):
    """How a sharded store's arrays relate to the leaf: its 2-D view split along axis 0.

    Attributes:
      axis_name: the local mesh axis the shards are spread over.
      count: shards per leaf (``L``, the local axis size).
      leaf_shape: the full leaf's shape.
      shape2d: the full leaf's 2-D view ``(A, B)``; a shard is ``(ceil(A / L), B)``.
    """

    axis_name: str
    count: int
    leaf_shape: tuple[int, ...]
    shape2d: tuple[int, int]

    @property
    def rows(self) -> int:
        """Rows of the 2-D view per shard (``ceil(A / L)``)."""
        return -(-self.shape2d[0] // self.count)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.shape2d[1])

    @property
    def leaf_size(self) -> int:
        return math.prod(self.leaf_shape)


class RowsResidual(NamedTuple):
    """ResiReduce-d storage: ``values`` are the kept rows of ``M`` in ``M``'s layout."""

    rows: jax.Array  # int32[k_r], indices along the view's row axis
    values: jax.Array  # M[rows, :] (row_axis 0) or M[:, rows] (row_axis 1)


class BlockResidual(NamedTuple):
    """ResiReduce-2d storage: the sub-block of ``M`` at the kept rows × kept columns."""

    rows: jax.Array  # int32[k_r]
    cols: jax.Array  # int32[k_c]
    values: jax.Array  # M[rows][:, cols] in M's layout (axes ordered as in M)


@dataclasses.dataclass(frozen=True)
class StorePlan:
    """How one group's residual is kept.

    Attributes:
      group: the group (members, shape, dtype).
      kind: ``"none"`` (compressed, no residual kept: no error feedback), ``"leaf"``
        (its own dense residual: plain error feedback), ``"average"`` /
        ``"weighted"`` (one shared residual), ``"rows"`` / ``"2d"`` (intra-layer).
      dtype: storage dtype of the residual values.
      view: 2-D view for intra-layer kinds.
      keep_rows: rows kept (intra kinds).
      keep_cols: columns kept (``"2d"``).
      phi: weight of the L1 term in ResiReduce-w's weights.
      weight_source: ``"residual"`` or ``"compensated"``.
      selection: ``"top"`` or ``"softmax_sample"`` (intra kinds).
      norm_source: what the row and column L1 norms of intra kinds are taken of:
        ``"residual"`` (the fresh residual, the paper §4.3) or ``"compensated"`` (the
        compensated gradient ``G~``, the reference code).
      shard: set for a sharded store (:func:`shard_store`): ``group.shape`` and ``view``
        are then one device's shard.
    """

    group: Group
    kind: Kind
    dtype: Any
    view: MatrixView | None = None
    keep_rows: int = 0
    keep_cols: int = 0
    phi: float = 0.5
    weight_source: Literal["residual", "compensated"] = "residual"
    selection: Selection = "top"
    norm_source: NormSource = "residual"
    shard: Shard | None = None
    format: Any = None

    keeps_residual: ClassVar[bool] = True
    """Whether the store keeps a residual at all (all but ``"none"``)."""
    own_residual: ClassVar[bool] = False
    """The unit's whole residual, as plain error feedback keeps it (``"leaf"``): on a
    skipped step it takes ``G + R`` through the compressor's skip hook, and a leading dense
    phase updates it like any other phase. Every other store keeps its residual exactly on
    a skipped step and holds zeros through a leading dense phase."""
    shared: ClassVar[bool] = False
    """Whether the members of a group share the residual (``"average"``, ``"weighted"``)."""
    carries: ClassVar[bool] = False
    """Whether the store can hold a unit's carried momentum (:class:`Carry`): only a
    unit's own dense residual (``"leaf"``); a shared or intra-layer store cannot."""

    def __new__(cls, *args: Any, **kwargs: Any) -> StorePlan:
        """``StorePlan(group, kind, ...)`` is an instance of the kind's class."""
        kind = kwargs.get("kind", args[1] if len(args) > 1 else None)
        return object.__new__(_STORE_CLASSES.get(kind, cls))  # no kind: unpickling

    # ------------------------------------------------------------------ what is kept

    @property
    def quantized(self) -> bool:
        """Whether the values are kept as block-scaled codes (:attr:`format`)."""
        return self.format is not None

    def keep(self, x: jax.Array, key: Callable | None = None) -> Any:
        """Values ``x`` as the store keeps them: cast to :attr:`dtype`, or encoded by
        :attr:`format` (``key("rounding")``: the stochastic rounding's key)."""
        if not self.quantized:
            return x.astype(self.dtype)
        rounding = key("rounding") if key is not None and self.format.stochastic else None
        return self.format.encode(x, rounding)

    def values(self, stored: Any, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        """Kept values of ``shape`` back as ``dtype`` (:meth:`keep` inverted)."""
        if not self.quantized:
            return stored.astype(dtype)
        return self.format.decode(stored, shape, dtype)

    def init(self) -> Any:
        """Zero residual (the first step starts with ``R = 0``)."""
        if self.quantized:
            return self.format.init(self.group.shape, self.dtype)
        return jnp.zeros(self.group.shape, self.dtype)

    def stored_bytes(self) -> int:
        """Bytes the stored residual occupies (indices and scales included)."""
        if self.quantized:
            return self.format.stored_bytes(self.group.shape)
        return self.group.size * np.dtype(self.dtype).itemsize

    def densify(self, stored: Any) -> jax.Array:
        """The stored residual as a dense leaf-shaped array (zeros where nothing is kept)."""
        if self.quantized:
            return self.values(stored, self.group.shape, jnp.promote_types(self.dtype, jnp.float32))
        return jnp.asarray(stored)

    # ------------------------------------------------------------------ one step

    def compensate(self, stored: Any, g: jax.Array) -> jax.Array:
        """``G~ = G + R``, written into the donated residual's buffer (block by block over
        ``G``'s own buffer for codes: :meth:`ResidualFormat.add_decoded`)."""
        if self.quantized:
            return self.format.add_decoded(g, stored)
        if stored.dtype != g.dtype:  # a narrower cast: added block by block into G's buffer
            return in_place.add_into(g, stored.reshape(g.shape))
        return g + stored.astype(g.dtype)

    def read_compensated(self, x: jax.Array, *, ordered_reads: bool) -> tuple[jax.Array, Any]:
        """What the store reads of ``G~`` before the exchange consumes it: ``(G~, what
        was read)``. ``ordered_reads``: order the read before ``G~``'s next use."""
        del ordered_reads
        return x, None

    def residual_skip(self, skip: jax.Array | None) -> jax.Array | None:
        """The compressor's skip hook for this store's units (:attr:`own_residual`)."""
        return skip if self.own_residual else None

    def carry(self, r: jax.Array, mean: jax.Array, factor: float) -> jax.Array:
        """What a carrying store keeps instead of the fresh residual ``r``:
        ``factor * mean + r`` (:class:`Carry`), rounded once by :meth:`finish` after."""
        if not self.carries:
            raise TypeError(f"A '{self.kind}' store cannot carry a unit's momentum.")
        return r + factor * mean.astype(r.dtype)

    def finish(self, r: jax.Array, stored: Any, read: Any, key: Callable, skip: Any) -> Any:
        """The new stored residual of a singleton store from the unit's fresh residual
        ``r``. ``read``: :meth:`read_compensated`'s; ``key()``: the selection key,
        ``key("rounding")`` the stochastic rounding's."""
        del stored, read, skip
        return self.keep(r, key)

    # ------------------------------------------------------------ layer-stack slices

    def compensate_slices(self, x: jax.Array, stored: Any, batch: StoreBatch) -> jax.Array:
        """:meth:`compensate` for the slices of ``batch`` in the slice-major stack ``x``."""
        return in_place.add_slices(
            x, self.stacked_values(stored, x.dtype), batch.start, np.arange(len(batch.stores))
        )

    def stacked_values(self, stored: Any, dtype: Any) -> Any:
        """A batch's stored residuals (a leading store axis) as values, or as they are."""
        if not self.quantized:
            return stored
        return jax.vmap(lambda s: self.values(s, self.group.shape, dtype))(stored)

    def read_slices(self, x: jax.Array, start: int, stop: int) -> tuple[jax.Array, Any]:
        """:meth:`read_compensated` for slices ``start ... stop - 1`` of ``x``."""
        del start, stop
        return x, None

    def finish_slices(
        self, part: jax.Array, read: Any, batch: StoreBatch, stored: Any, keys: Callable, skip: Any
    ) -> Any:
        """The batch's new stored residuals from its slices' fresh residuals ``part``;
        ``keys()``: the slices' selection keys, ``keys("rounding")`` their rounding keys."""
        del read, batch, stored, skip
        if not self.quantized:
            return part.astype(self.dtype)
        if not self.format.stochastic:
            return jax.vmap(self.keep)(part)
        return jax.vmap(lambda x, k: self.keep(x, lambda _: k))(part, keys("rounding"))


def shard_store(plan: StorePlan, axis_name: str, count: int) -> StorePlan:
    """``plan`` for one of ``count`` devices sharing the store over ``axis_name``.

    The leaf's 2-D view (:func:`matrix_view` of the group's shape) is split along axis 0;
    the plan's group shape and view become the shard's, and the intra-layer selection
    along the split dimension keeps ``ceil(keep / count)`` indices per shard
    (docs/design.md, "Residual stores"). Per-device stored bytes are the unsharded plan's
    ``/ count``, up to padding and indices.
    """
    group = plan.group
    full_view = matrix_view(group.paths[0], group.shape)
    shard = Shard(axis_name, count, tuple(group.shape), full_view.shape2d)
    view = MatrixView(shard.shape, full_view.row_axis)
    keep_rows, keep_cols = plan.keep_rows, plan.keep_cols
    split = -(-(keep_rows if view.row_axis == 0 else keep_cols) // count)
    if plan.kind in ("rows", "2d") and view.row_axis == 0:
        keep_rows = min(split, shard.rows)
    elif plan.kind == "2d":
        keep_cols = min(split, shard.rows)
    return dataclasses.replace(
        plan,
        group=dataclasses.replace(group, shape=shard.shape),
        view=view if plan.kind in ("rows", "2d") else None,
        keep_rows=keep_rows,
        keep_cols=keep_cols,
        shard=shard,
    )


@dataclasses.dataclass(frozen=True)
class NoStore(StorePlan):
    """Compressed with no residual: no error feedback (``"none"``)."""

    keeps_residual: ClassVar[bool] = False

    def compensate(self, stored: Any, g: jax.Array) -> jax.Array:
        return g

    def compensate_slices(self, x: jax.Array, stored: Any, batch: StoreBatch) -> jax.Array:
        return x


@dataclasses.dataclass(frozen=True)
class LeafStore(StorePlan):
    """The unit's own dense residual: plain error feedback (``"leaf"``); it can carry the
    unit's momentum too (:class:`Carry`)."""

    own_residual: ClassVar[bool] = True
    carries: ClassVar[bool] = True


class Carry(NamedTuple):
    """The one-buffer compressed momentum's request to the exchange (docs/design.md,
    "One-buffer compressed momentum"; Tang et al. 2021, §3, Algorithm 1).

    The stores of ``leaves`` keep ``w = factor * mean + (G~ - D(Q(G~)))``, the exchange's
    output (in the store's coordinates, a shard's for a sharded store) carried into the
    residual, instead of the residual alone: one buffer for a worker's momentum and its
    error. While ``hold`` is true (a dense warm-up) those stores are neither added to the
    gradient nor changed: they hold what the optimizer writes. On a skipped step they keep
    their value exactly. Only stores with :attr:`StorePlan.carries` accept it.

    Attributes:
      factor: the momentum's decay (β₁), or ``0`` for a residual of its own.
      hold: a Python bool, or a traced bool equal on every worker.
      leaves: indices (``jax.tree.leaves`` order) of the leaves whose stores carry.
    """

    factor: float
    hold: Any
    leaves: frozenset[int]


@dataclasses.dataclass(frozen=True)
class SharedStore(StorePlan):
    """One residual for a group's members (§4.2): ResiReduce-a (``"average"``) or -w
    (``"weighted"``). Rebuilt after each step from the members' weighted fresh residuals."""

    shared: ClassVar[bool] = True

    @property
    def reads_weights(self) -> bool:
        """Whether member weights are taken of ``G~`` (the reference code's reading)."""
        return self.kind == "weighted" and self.weight_source == "compensated"

    def compensate(self, stored: Any, g: jax.Array) -> jax.Array:
        # R stays readable for the other members: added into G's own buffer.
        if self.quantized:
            return self.format.add_decoded(g, stored)
        return in_place.add_into(g, stored)

    def read_compensated(self, x: jax.Array, *, ordered_reads: bool) -> tuple[jax.Array, Any]:
        if not self.reads_weights:
            return x, None
        weight = residual_weight(x, self.phi, self.shard)
        return ordered(x, weight) if ordered_reads else (x, weight)

    def member_weight(self, r: jax.Array, read: Any) -> jax.Array:
        """A member's weight in the group's sum: 1 (``"average"``), or §4.2's weight of
        ``G~`` (``read``) or of the fresh residual ``r``."""
        if self.kind == "average":
            return jnp.ones([], jnp.float32)
        return residual_weight(r, self.phi, self.shard) if read is None else read

    def slice_weights(self, x: jax.Array) -> jax.Array:
        """Every slice's member weight, float32 ``[slices]``."""
        if self.kind == "average":
            return jnp.ones(x.shape[:1], jnp.float32)
        return jax.vmap(lambda s: residual_weight(s, self.phi, self.shard))(x)

    def finish(self, r, stored, read, key, skip):
        raise TypeError("A shared group's residual is a sum over its members (WeightedSum).")

    def compensate_slices(self, x: jax.Array, stored: Any, batch: StoreBatch) -> jax.Array:
        values = self.stacked_values(stored, x.dtype)
        return in_place.add_slices(x, values, batch.start, batch.store_of_slice)

    def read_slices(self, x: jax.Array, start: int, stop: int) -> tuple[jax.Array, Any]:
        if not self.reads_weights:
            return x, None
        return ordered(x, self.slice_weights(x[start:stop]))

    def finish_slices(self, part, read, batch, stored, keys, skip):
        weights = self.slice_weights(part) if read is None else read
        sums = WeightedSum.of_groups(part, weights, batch.sizes)
        return where_skip(skip, stored, sums.finish(self, keys))


@dataclasses.dataclass(frozen=True)
class RowsStore(StorePlan):
    """ResiReduce-d (§4.3): a singleton layer keeps its rows of largest L1 norm
    (``"rows"``)."""

    keeps_columns: ClassVar[bool] = False

    @property
    def block_shape(self) -> tuple[int, int]:
        """The shape of the kept values (in the matrix view's layout)."""
        return _rows_block_shape(self.view, self.keep_rows)

    def init(self) -> Any:
        return RowsResidual(rows=jnp.arange(self.keep_rows, dtype=jnp.int32), values=self._zeros())

    def _zeros(self) -> Any:
        if self.quantized:
            return self.format.init(self.block_shape, self.dtype)
        return jnp.zeros(self.block_shape, self.dtype)

    def _values_bytes(self) -> int:
        if self.quantized:
            return self.format.stored_bytes(self.block_shape)
        return math.prod(self.block_shape) * np.dtype(self.dtype).itemsize

    def stored_bytes(self) -> int:
        return self._values_bytes() + self.keep_rows * 4

    def densify(self, stored: Any) -> jax.Array:
        zeros = jnp.zeros(self.group.shape, jnp.promote_types(self.dtype, jnp.float32))
        return self.compensate(stored, zeros)

    def compensate(self, stored: Any, g: jax.Array) -> jax.Array:
        return _compensate_kept(self, stored, g)

    def read_compensated(self, x: jax.Array, *, ordered_reads: bool) -> tuple[jax.Array, Any]:
        del ordered_reads
        if self.norm_source != "compensated":
            return x, None
        # Two vectors of G~, taken before G~ is consumed, with |G~| in its buffer.
        return dimension_norms_in_place(self, x)

    def finish(self, r, stored, read, key, skip):
        rounding = key("rounding") if self.quantized and self.format.stochastic else None
        return where_skip(skip, stored, compress_residual(self, r, key(), read, rounding))

    def compensate_slices(self, x: jax.Array, stored: Any, batch: StoreBatch) -> jax.Array:
        x, _ = _map_range(
            x,
            batch.start,
            batch.stop,
            lambda part: (jax.vmap(self.compensate)(stored, part), None),
        )
        return x

    def read_slices(self, x: jax.Array, start: int, stop: int) -> tuple[jax.Array, Any]:
        if self.norm_source != "compensated":
            return x, None
        norms = jax.vmap(functools.partial(dimension_norms_in_place, self))
        return _map_range(x, start, stop, norms)

    def finish_slices(self, part, read, batch, stored, keys, skip):
        rounding = keys("rounding") if self.quantized and self.format.stochastic else None
        kept = jax.vmap(functools.partial(compress_residual, self))(part, keys(), read, rounding)
        return where_skip(skip, stored, kept)


@dataclasses.dataclass(frozen=True)
class BlockStore(RowsStore):
    """ResiReduce-2d (§4.3): a singleton layer keeps the block at its top rows × top
    columns (``"2d"``)."""

    keeps_columns: ClassVar[bool] = True

    @property
    def block_shape(self) -> tuple[int, int]:
        return _block_shape(self.view, self.keep_rows, self.keep_cols)

    def init(self) -> Any:
        return BlockResidual(
            rows=jnp.arange(self.keep_rows, dtype=jnp.int32),
            cols=jnp.arange(self.keep_cols, dtype=jnp.int32),
            values=self._zeros(),
        )

    def stored_bytes(self) -> int:
        return self._values_bytes() + (self.keep_rows + self.keep_cols) * 4


_STORE_CLASSES: dict[str, type[StorePlan]] = {
    "none": NoStore,
    "leaf": LeafStore,
    "average": SharedStore,
    "weighted": SharedStore,
    "rows": RowsStore,
    "2d": BlockStore,
}


def where_skip(skip: jax.Array | None, if_skipped: Any, otherwise: Any) -> Any:
    """``otherwise``, or ``if_skipped`` on a skipped step (``skip``: a boolean scalar)."""
    if skip is None:
        return otherwise
    return jax.tree.map(lambda a, b: jnp.where(skip, a, b), if_skipped, otherwise)


def _map_range(x: jax.Array, start: int, stop: int, fn: Callable) -> tuple[jax.Array, Any]:
    """``fn`` of slices ``start ... stop - 1`` of ``x``, which returns ``(new slices,
    extra)``; the new slices are written back into ``x``."""
    if (start, stop) == (0, x.shape[0]):
        return fn(x)
    new, extra = fn(x[start:stop])
    return x.at[start:stop].set(new), extra


def stored_bytes(plan: StorePlan) -> int:
    """Bytes the stored residual of ``plan`` occupies (indices included)."""
    return plan.stored_bytes()


def init_store(plan: StorePlan) -> Any:
    """Zero residual of ``plan`` (the first step starts with ``R = 0``)."""
    return plan.init()


def _rows_block_shape(view: MatrixView, k: int) -> tuple[int, int]:
    a, b = view.shape2d
    return (k, b) if view.row_axis == 0 else (a, k)


def _block_shape(view: MatrixView, kr: int, kc: int) -> tuple[int, int]:
    return (kr, kc) if view.row_axis == 0 else (kc, kr)


def _axis_indices(view: MatrixView, rows: jax.Array, cols: jax.Array | None):
    """(index along M's axis 0, index along M's axis 1) for a rows/cols selection."""
    if view.row_axis == 0:
        return rows, cols
    return cols, rows


def compensate(plan: StorePlan, stored: Any, g: jax.Array) -> jax.Array:
    """``G~ = G + R`` with the (possibly shared or compressed) residual ``R``.

    A leaf's own residual is donated, so ``G + R`` is written into it. A shared residual
    is read by every member of its group, so it is added into ``G``'s own buffer, block
    by block (:func:`resireduce_jax._src.in_place.map_blocks`). An intra-layer residual is
    added where it belongs in ``G``'s own buffer, block by block: every element is read
    and written once, and no index array the size of the kept block is formed (a scatter
    at rows × columns needs one, 2 int32 per kept element: twice the stored residual).
    """
    return plan.compensate(stored, g)


def _compensate_kept(plan: RowsStore, stored: Any, g: jax.Array) -> jax.Array:
    """An intra-layer residual added where it belongs in ``G``'s own buffer."""
    size0, size1 = plan.view.shape2d
    kept0, kept1 = _kept_indices(plan, stored)
    where0 = None if kept0 is None else _positions(kept0, size0)
    where1 = None if kept1 is None else _positions(kept1, size1)
    values = stored.values  # in the store's dtype: cast block by block, never as a whole
    cols = None if where1 is None else jnp.maximum(where1, 0)
    kept_cols = True if where1 is None else (where1 >= 0)[None, :]

    def kept_values(at0: jax.Array, block: jax.Array) -> jax.Array:
        """The kept values at rows ``at0`` (and columns ``cols``) of the kept block."""
        if plan.quantized:  # codes: each element decoded from its own code, in the block
            width = plan.block_shape[1]
            at1 = lax.iota(jnp.int32, width) if cols is None else cols
            index = jnp.maximum(at0, 0)[:, None] * width + at1[None, :]
            value = plan.format.values_at(values, plan.block_shape, index, at0)
            # The barrier keeps the decoded values exact (no multiply-add fused into one FMA).
            return lax.optimization_barrier(value.astype(block.dtype))
        # The kept values form a grid: each block gathers its rows of it, then the columns,
        # with one index per row and per column (a per-element index is 2 int32 per element).
        value = in_place.gather_as(values, (jnp.maximum(at0, 0),), block.dtype)
        return value if cols is None else value[:, cols]

    def add(block, row0):
        rows = row0 + lax.iota(jnp.int32, block.shape[0])
        at0 = rows if where0 is None else where0[rows]
        value = kept_values(at0, block)
        return jnp.where((at0 >= 0)[:, None] & kept_cols, block + value, block)

    return in_place.map_blocks(g.reshape(plan.view.shape2d), add).reshape(g.shape)


def _kept_indices(plan: RowsStore, stored: Any) -> tuple[jax.Array | None, jax.Array | None]:
    """Indices of the stored values along the matrix view's axes 0 and 1 (``None``: all)."""
    if not plan.keeps_columns:
        return (stored.rows, None) if plan.view.row_axis == 0 else (None, stored.rows)
    return _axis_indices(plan.view, stored.rows, stored.cols)


def _positions(indices: jax.Array, size: int) -> jax.Array:
    """``p[j]`` = position of ``j`` in ``indices`` (unique), ``-1`` where it is absent."""
    positions = jnp.arange(indices.shape[0], dtype=jnp.int32)
    return jnp.full((size,), -1, jnp.int32).at[indices].set(positions, unique_indices=True)


def residual_weight(x: jax.Array, phi: float, shard: Shard | None = None) -> jax.Array:
    """ResiReduce-w weight ``phi ||x||_1 / n + (1 - phi) ||x||_2 / sqrt(n)`` (§4.2), float32.

    For a shard of a leaf (``shard``), the sums are taken over the whole leaf (``psum``
    over the local axis) and ``n`` is the leaf's size, so every device of a node computes
    the weight of the whole member.
    """
    # Both sums in one pass, with no |x| or x*x as large as the member (in_place.sums).
    sums = jnp.stack(
        in_place.sums(x, (jnp.abs, jnp.square), jnp.promote_types(x.dtype, jnp.float32))
    )
    if shard is None:
        n = x.size
    else:
        n = shard.leaf_size
        sums = lax.psum(sums, shard.axis_name)
    l1 = sums[0] / n
    l2 = jnp.sqrt(sums[1]) / math.sqrt(n)
    return phi * l1 + (1.0 - phi) * l2


class WeightedSum(NamedTuple):
    """Running ``(sum_i w_i r_i, sum_i w_i)`` of a shared group, in float32 or wider."""

    total: jax.Array
    weight: jax.Array

    @classmethod
    def first(cls, r: jax.Array, weight: jax.Array) -> WeightedSum:
        """Starts the sum from the first member (no separate zero buffer), written over
        ``r``'s buffer when ``r`` is already in the sum's dtype."""
        dtype = jnp.promote_types(r.dtype, jnp.float32)
        weight = weight.astype(dtype)
        return cls(in_place.map_blocks(r.astype(dtype), lambda block, _: weight * block), weight)

    def add(self, r: jax.Array, weight: jax.Array) -> WeightedSum:
        """Adds ``weight * r`` to the sum in the sum's own buffer
        (:mod:`~resireduce_jax._src.in_place`: an element-wise add on XLA:CPU would give the
        new sum a second member-sized buffer while the old one is still read)."""
        weight = weight.astype(self.weight.dtype)
        return WeightedSum(in_place.add_into(self.total, r, weight), self.weight + weight)

    def merge(self, other: WeightedSum) -> WeightedSum:
        """The sum of two partial sums of one group (e.g. slices of two layer stacks)."""
        return WeightedSum(in_place.add_into(self.total, other.total), self.weight + other.weight)

    @classmethod
    def of_slices(cls, r: jax.Array, weights: jax.Array) -> WeightedSum:
        """The sum over the leading (slice) axis of ``r``: members that are consecutive
        slices of a layer stack, weighted by ``weights`` (float32 ``[slices]``)."""
        sums = cls.of_groups(r, weights, (r.shape[0],))
        return cls(sums.total[0], sums.weight[0])

    @classmethod
    def of_groups(cls, r: jax.Array, weights: jax.Array, sizes: tuple[int, ...]) -> WeightedSum:
        """The sums of consecutive groups of slices: group ``g`` is the next ``sizes[g]``
        slices of ``r`` (``[sum(sizes), *shape]``); returns ``total`` ``[groups, *shape]``
        and ``weight`` ``[groups]``, in float32 or wider.

        Every group's members are added from the last to the first, as :meth:`first` and
        :meth:`add` add a group's members one by one, but for all groups of one size at
        once: an element-wise expression of the slices of ``r`` that XLA fuses into one
        pass (no weighted copy of the slices), which :meth:`finish` and a skip's select can
        write over the stored residuals.
        """
        dtype = jnp.promote_types(r.dtype, jnp.float32)
        totals, weight_sums, start = [], [], 0
        for size, groups in _equal_runs(sizes):
            stop = start + size * groups
            part = r[start:stop].reshape(groups, size, *r.shape[1:])
            w = weights[start:stop].astype(dtype).reshape(groups, size)
            expand = (slice(None),) + (None,) * (r.ndim - 1)
            total = w[:, -1][expand] * part[:, -1].astype(dtype)
            weight = w[:, -1]
            for t in reversed(range(size - 1)):
                total = total + w[:, t][expand] * part[:, t].astype(dtype)
                weight = weight + w[:, t]
            totals.append(total)
            weight_sums.append(weight)
            start = stop
        if len(totals) == 1:
            return cls(totals[0], weight_sums[0])
        return cls(jnp.concatenate(totals), jnp.concatenate(weight_sums))

    def finish(self, plan: StorePlan, key: Callable | None = None) -> Any:
        """The group residual as ``plan`` keeps it; zero when all weights are zero (all
        members' x_i = 0). With a leading group axis (:meth:`of_groups`), every group's
        (``key("rounding")``: one rounding key per group)."""
        weight = self.weight.reshape(
            self.weight.shape + (1,) * (self.total.ndim - self.weight.ndim)
        )
        safe = jnp.where(weight > 0, weight, 1)
        mean = jnp.where(weight > 0, self.total / safe, 0)
        if not plan.quantized:
            return mean.astype(plan.dtype)
        if self.weight.ndim == 0:
            return plan.keep(mean, key)
        if not plan.format.stochastic:
            return jax.vmap(plan.keep)(mean)
        groups = key("rounding")[: mean.shape[0]]  # distinct keys, one per group
        return jax.vmap(lambda x, k: plan.keep(x, lambda _: k))(mean, groups)


def _equal_runs(sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(size, count)`` of every run of equal consecutive ``sizes``."""
    runs: list[list[int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return [(size, count) for size, count in runs]


def _select(norms: jax.Array, k: int, selection: Selection, key: jax.Array | None) -> jax.Array:
    """Indices of ``k`` entries: the largest norms, or a softmax(norms) sample without
    replacement (Gumbel-top-k), as the reference code samples rows."""
    if selection == "softmax_sample":
        if key is None:
            raise ValueError("softmax_sample selection needs a PRNG key.")
        norms = norms + jax.random.gumbel(key, norms.shape, norms.dtype)
    _, idx = lax.top_k(norms, k)
    return jnp.sort(idx.astype(jnp.int32))


class DimensionNorms(NamedTuple):
    """L1 norms of the rows (and, for ``"2d"``, the columns) of a leaf's matrix view."""

    rows: jax.Array  # float32[num_rows]
    cols: jax.Array | None  # float32[num_cols], None for "rows"


def dimension_norms(plan: StorePlan, x: jax.Array) -> DimensionNorms:
    """L1 norms of ``x``'s rows (and columns for ``"2d"``) in ``plan``'s view (§4.3).

    Accumulated in float32 or wider. The result is two vectors, never a leaf-sized buffer,
    so the exchange can take them of ``G~`` before ``G~`` is consumed
    (``norm_source="compensated"``).
    """
    return _l1_norms(plan, jnp.abs(x.astype(jnp.promote_types(x.dtype, jnp.float32))))


def dimension_norms_in_place(plan: StorePlan, x: jax.Array) -> tuple[jax.Array, DimensionNorms]:
    """:func:`dimension_norms` of ``x`` taken of ``|x|`` written over ``x``'s buffer
    (:func:`resireduce_jax._src.in_place.magnitudes`); returns ``x`` again, bit for bit, with the
    norms. For a temporary ``x`` (``G~`` of a 2-D store) that must live on afterwards."""
    magnitude, bits = in_place.magnitudes(x)
    norms = _l1_norms(plan, magnitude)
    magnitude, norms = lax.optimization_barrier((magnitude, norms))  # read before restored
    return in_place.with_signs(magnitude, bits), norms


def _l1_norms(plan: StorePlan, magnitude: jax.Array) -> DimensionNorms:
    """:func:`dimension_norms` from the magnitudes ``|x|`` themselves."""
    view = plan.view
    a = magnitude.reshape(view.shape2d).astype(jnp.promote_types(magnitude.dtype, jnp.float32))
    rows = jnp.sum(a, axis=1 - view.row_axis)
    cols = jnp.sum(a, axis=view.row_axis) if plan.keeps_columns else None
    if plan.shard is not None:  # sums over axis 0 are partial on a shard: whole-layer norms
        if view.row_axis == 1:
            rows = lax.psum(rows, plan.shard.axis_name)
        elif cols is not None:
            cols = lax.psum(cols, plan.shard.axis_name)
    return DimensionNorms(rows, cols)


def compress_residual(
    plan: StorePlan,
    r: jax.Array,
    key: jax.Array | None,
    norms: DimensionNorms | None = None,
    rounding: jax.Array | None = None,
) -> Any:
    """Keeps the part of a fresh singleton residual ``r`` that ``plan`` stores (§4.3).

    Without ``norms`` the rows and columns are ranked by ``r``'s own norms, taken of
    ``|r|`` written over ``r``'s buffer (:func:`resireduce_jax._src.in_place.magnitudes`); the
    kept values get their signs back from the sign bits. ``r`` must not be read afterwards.

    Args:
      plan: an intra-layer (``"rows"`` / ``"2d"``) store plan.
      r: the leaf's fresh residual ``G~ - D(P)``.
      key: PRNG key for ``selection="softmax_sample"`` (else ``None``).
      norms: the norms that rank rows and columns (:func:`dimension_norms` of ``G~`` for
        ``norm_source="compensated"``); default: those of ``r``.
      rounding: the key of a stochastically rounding :attr:`StorePlan.format`.
    """
    view = plan.view
    width = view.shape2d[1]
    r = jnp.asarray(r)  # a host array too (resizing a checkpoint): gathered at traced indices
    if norms is None:
        magnitude, bits = in_place.magnitudes(r)
        m = magnitude.reshape(view.shape2d)
        norms = _l1_norms(plan, m)

        def take(i0, i1):
            return in_place.signed_at(m[i0, i1], bits, i0 * width + i1)
    else:
        m = r.reshape(view.shape2d)

        def take(i0, i1):
            return m[i0, i1]

    def keep(i0: jax.Array, i1: jax.Array) -> Any:
        """The kept block ``m[i0[:, None], i1[None, :]]`` as the store keeps it."""
        if not plan.quantized:
            return plan.keep(take(i0[:, None], i1[None, :]))
        width = i1.shape[0]

        def value_at(index):  # one part's values in one buffer, its gathers fused into it
            return lax.optimization_barrier(take(i0[index // width], i1[index % width]))

        # Codes: encoded a part at a time from the gather, never gathered whole in float32.
        return plan.format.encode_gathered(value_at, (i0.shape[0], width), rounding)

    if key is not None:
        key_rows, key_cols = jax.random.split(key)
    else:
        key_rows = key_cols = None
    rows = _select(norms.rows, plan.keep_rows, plan.selection, key_rows)
    if not plan.keeps_columns:
        every = jnp.arange(view.shape2d[1 - view.row_axis], dtype=jnp.int32)
        i0, i1 = (rows, every) if view.row_axis == 0 else (every, rows)
        return RowsResidual(rows, keep(i0, i1))
    cols = _select(norms.cols, plan.keep_cols, plan.selection, key_cols)
    i0, i1 = _axis_indices(view, rows, cols)
    return BlockResidual(rows, cols, keep(i0, i1))


def densify(plan: StorePlan, stored: Any) -> jax.Array:
    """The stored residual as a dense leaf-shaped array (zeros where nothing is kept)."""
    return plan.densify(stored)


# ------------------------------------------------------------------ layer stacks: batches


@dataclasses.dataclass(frozen=True)
class StoreBatch:
    """Stores of consecutive slices of one layer stack, kept as one array per field.

    A scanned model keeps every layer of a weight in one leaf (:mod:`resireduce_jax.
    layer_stacks`); its slices are layers with stores of their own, and the stores of a
    run of consecutive slices that are stored alike are kept together: the batch's value
    is their values stacked on a leading axis (``[len(stores), *store shape]``), so the
    exchange works on a slice range of the stack, never on per-layer arrays. Store ``i``
    keeps slices ``starts[i] ... starts[i] + sizes[i] - 1``: one slice for a singleton
    store (``"none"``, ``"leaf"``, ``"rows"``, ``"2d"``), a range of adjacent slices for a
    shared group (``"average"``, ``"weighted"``).

    Attributes:
      label: the key of the batch's value in ``ExchangeState.residuals``:
        ``"{stack path}[{start}:{stop}]"``.
      leaf: index of the stacked leaf.
      start: first slice.
      stop: one past the last slice.
      stores: the batched stores, in slice order; they differ only in their groups.
    """

    label: str
    leaf: int
    start: int
    stop: int
    stores: tuple[StorePlan, ...]

    @property
    def plan(self) -> StorePlan:
        """The first store: kind, dtype and options of every store of the batch."""
        return self.stores[0]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(p.group.members) for p in self.stores)

    @property
    def store_of_slice(self) -> np.ndarray:
        """For every slice of ``start ... stop - 1``, the index of the store keeping it."""
        return np.repeat(np.arange(len(self.stores), dtype=np.int32), self.sizes)


def _batch_signature(plan: StorePlan) -> StorePlan:
    return dataclasses.replace(plan, group=None)


def batch_stores(
    plans: tuple[StorePlan, ...], slice_of: dict[int, tuple[int, int]], stack_paths: dict[int, str]
) -> tuple[StoreBatch, ...]:
    """The :class:`StoreBatch` es of the stores whose members are consecutive slices of one
    stack, stored alike; a store with members elsewhere (another stack, a whole leaf, slices
    that are not adjacent) is in no batch.

    Args:
      plans: every store plan; members are unit indices.
      slice_of: ``{unit index: (stacked leaf, slice index)}`` for every slice unit.
      stack_paths: ``{stacked leaf: its path}``.
    """
    ranges = []  # (leaf, start, stop, plan)
    for plan in plans:
        where = [slice_of.get(m) for m in plan.group.members]
        if any(w is None for w in where) or len({leaf for leaf, _ in where}) > 1:
            continue
        indices = [s for _, s in where]
        if indices != list(range(indices[0], indices[0] + len(indices))):
            continue
        ranges.append((where[0][0], indices[0], indices[-1] + 1, plan))
    ranges.sort(key=lambda r: (r[0], r[1]))
    batches: list[list[tuple[int, int, int, StorePlan]]] = []
    for r in ranges:
        last = batches[-1][-1] if batches else None
        if (
            last is not None
            and last[0] == r[0]
            and last[2] == r[1]
            and _batch_signature(last[3]) == _batch_signature(r[3])
        ):
            batches[-1].append(r)
        else:
            batches.append([r])
    return tuple(
        StoreBatch(
            label=f"{stack_paths[run[0][0]]}[{run[0][1]}:{run[-1][2]}]",
            leaf=run[0][0],
            start=run[0][1],
            stop=run[-1][2],
            stores=tuple(r[3] for r in run),
        )
        for run in batches
    )


def init_batch(batch: StoreBatch) -> Any:
    """Zero residuals of every store of ``batch``, stacked (:func:`init_store`)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *(p.init() for p in batch.stores))
