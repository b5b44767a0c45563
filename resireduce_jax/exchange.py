"""The gradient exchange: one optax transform behind every compressed-communication mode.

:func:`~resireduce_jax.compressed_mean`, :func:`~resireduce_jax.error_feedback` and
:func:`~resireduce_jax.resireduce` are three views of one algorithm (ResiReduce paper §2.2,
§4): every compressed leaf is *compensated* with the residual its store holds, compressed,
exchanged over the data axis, and what the payload did not carry is handed back to the
store. They differ only in how the residuals are stored, which an :class:`ExchangePlan`
decides from shapes alone:

========================  ==============================================================
store kind                what it keeps per worker
========================  ==============================================================
``"none"``                nothing (``compressed_mean``: no error feedback)
``"leaf"``                the leaf's own dense residual (``error_feedback``, singletons)
``"average"``             one residual shared by a group, rebuilt as the members' mean (§4.2)
``"weighted"``            the same, weighted mean ``sum w_i r_i / sum w_i`` (§4.2)
``"rows"`` / ``"2d"``     part of a large layer's residual: top rows / rows × columns (§4.3)
========================  ==============================================================

Leaves with ``ndim <= 1`` or fewer than ``min_size`` elements are in no store: they travel
dense (``pmean``), as in the reference code.

**Hierarchical exchange** (``local_axis``, beyond the paper; docs/design.md, "Hierarchical
exchange"). On a mesh ``(nodes, L)`` whose ``local`` axis spans the fast links of one node,
every compressed leaf is first reduce-scattered densely over ``local``: each device gets
``1/L`` of its node's mean gradient (the leaf's 2-D view split along axis 0, see
:class:`~resireduce_jax.residual_stores.Shard`). The device compensates that shard with its
shard of the residual, compresses it, exchanges the payload over the ``data`` axis only
(one device per node takes part in each exchange), and the means are all-gathered densely
over ``local``. Stores hold one shard per device, so residual memory per device is the flat
transform's divided by ``L``; error feedback acts on node means. With a local axis of size
1 the transform is the flat one over both axes, bit for bit.

**Whole-model Top-k** (``selection_scope="global"``, beyond the paper). A Top-k phase
selects ``k = density * N`` entries of the ``N`` entries of every compressed leaf at once,
by magnitude, instead of ``density`` of each leaf's own: the bytes are the same, but a leaf
whose compensated gradient is large gets more of them (under SGD, gradient scales differ
several-fold between layers; per-leaf quotas send a layer of tiny gradients as many entries
as one of large gradients). Every kind of store works unchanged: each member is compensated
with its store's residual before the selection, and each store keeps what its members did
not send after it (a shared group's weighted mean, a 2-D store's rows and columns). The
leaves are never concatenated: a threshold is searched for by counts over every leaf,
from a bracket a sample gives, and each leaf is compacted into the payload block by block
(:meth:`TopK.reduce_jointly`). Memory at
the compiled peak (``benchmarks/results/peak_memory_global``): EF keeps each compensated
gradient in its residual's buffer, as per leaf; a shared or 2-D store cannot, and no member
is finished before the joint selection, so every such member's compensated gradient is
alive at once (GPT-2 medium width and ResNet-50: w+2d's peak above EF's).

**Layer stacks** (``layer_stacks``; docs/design.md, "Layer stacks"). A leaf that stacks one
weight of every layer (a scanned model) is one unit per slice: plans are made on the
unstacked pytree, the stores of runs of slices are kept as slice ranges of the stack, and
each stack is exchanged in one vectorised pass (:meth:`Compressor.reduce_slices`).

This module owns the state (:class:`ExchangeState`, one type for all modes), the plan
(``tx.plan(params)``), the update loop, the handling of a skipped step (the ``skip``
extra argument that :func:`~resireduce_jax.skip_nonfinite` passes), and every operation
on per-worker state that a training program needs: finding exchange states inside an
optax state (:func:`exchange_states`), per-leaf residual views (:func:`leaf_residuals`)
and resizing to another number of workers (:func:`resize_workers`).

Memory at the compiled peak (docs/design.md, "Residuals at the compiled peak"): members
of a shared group are processed in layer order with a real data dependency of member
``i+1``'s compensation on the running sum of member ``i``, so at most one member's
transient residual is alive at a time; compressors order the residual write after the
compression read, so per-leaf residuals are updated in their donated buffers; and maps over
a leaf-sized temporary (Top-k's ``|G~|``, a 2-D store's compensation and norms) are written
over that temporary block by block (:mod:`resireduce_jax.in_place`), so the exchange of one
large layer never holds it twice.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from resireduce_jax import grouping as grouping_lib
from resireduce_jax import in_place
from resireduce_jax import layer_stacks as layer_stacks_lib
from resireduce_jax import residual_stores as stores
from resireduce_jax.compressors import schedule
from resireduce_jax.compressors.base import (
    Compressor,
    Reduced,
    axis_size,
    check_axis_bound,
    check_local_gradients,
    dense_mean,
    ordered,
)
from resireduce_jax.compressors.dense import is_dense
from resireduce_jax.compressors.sparse import TopK
from resireduce_jax.tree_paths import validate_float_leaves

PyTree = Any
AxisName = str | tuple[str, ...]
StorePlanner = Callable[[PyTree], Sequence[stores.StorePlan]]

__all__ = [
    "DEFAULT_MIN_SIZE",
    "ExchangePlan",
    "ExchangeState",
    "ExchangeTransformation",
    "StackPlan",
    "WireBytes",
    "dense_bytes",
    "exchange",
    "exchange_states",
    "leaf_key",
    "leaf_residuals",
    "resize_workers",
    "store_residuals",
]

DEFAULT_MIN_SIZE = 10_000
"""Leaves with fewer elements travel dense with no residual (the reference code's rule)."""

# Distinct stream for the keys of residual row/column sampling (vs. the compressor's keys).
_SELECTION_STREAM = 0x5E1EC7


class ExchangeState(NamedTuple):
    """State of every exchange transform.

    Attributes:
      count: number of updates so far (int32); drives the per-step PRNG keys. Not
        advanced by a skipped step.
      residuals: ``{store label: stored residual}`` for the stores that keep one: a dense
        array (``"leaf"``, ``"average"``, ``"weighted"``), a
        :class:`~resireduce_jax.residual_stores.RowsResidual` or a
        :class:`~resireduce_jax.residual_stores.BlockResidual`. A ``"leaf"`` store's label
        is the leaf's path (``"dense_1/kernel"``). The stores of a run of slices of a layer
        stack are one entry, ``"{stack path}[{start}:{stop}]"``, with a leading store axis
        (:class:`~resireduce_jax.residual_stores.StoreBatch`). Per worker: under ``shard_map`` these
        carry a leading worker axis sharded on the data axis. Empty for
        ``compressed_mean``.
      compressor_state: per-leaf compressor state with the params' structure;
        ``optax.MaskedNode()`` for leaves that travel dense.
    """

    count: jax.Array
    residuals: dict[str, Any]
    compressor_state: PyTree


class PhaseStates(NamedTuple):
    """A leaf's compressor state when the phases of its schedule keep differently shaped
    states (a dense warm-up before PowerSGD: none, then ``Q``): one state per phase, each
    carried unchanged through the other phases, so one program can switch between them.
    Phases that keep the same state share it instead (the sparsifiers' ``()``)."""

    phases: tuple[PyTree, ...]


@dataclasses.dataclass(frozen=True)
class StackPlan:
    """How the exchange treats one layer stack (:mod:`resireduce_jax.layer_stacks`).

    Attributes:
      stack: the stacked leaf, its layer axis and the unit index of every slice.
      batches: the stores of runs of consecutive slices, kept as one array each
        (:class:`~resireduce_jax.residual_stores.StoreBatch`), in slice order.
      pieces: ``(store, start, stop)``: slices ``start ... stop - 1`` are members of a
        shared group that also has members elsewhere (another stack, a whole leaf, or
        slices that are not adjacent); its residual is the group's own.
      dense: every slice travels dense (too small to compress).
      shard: how every slice is sharded over the local axis (hierarchical), or ``None``.
    """

    stack: layer_stacks_lib.Stack
    batches: tuple[stores.StoreBatch, ...]
    pieces: tuple[tuple[stores.StorePlan, int, int], ...]
    dense: bool
    shard: stores.Shard | None


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """Where every leaf's residual lives: decided from shapes, before any data is seen.

    With ``layer_stacks`` a stacked leaf is one *unit* per slice (a layer, named by its
    slice path, :mod:`resireduce_jax.layer_stacks`); otherwise every unit is a leaf, in
    ``jax.tree.leaves`` order.

    Attributes:
      paths: every unit's path, in the unstacked pytree's order.
      stores: one :class:`~resireduce_jax.residual_stores.StorePlan` per store, in order of
        their first member; every compressed unit is a member of exactly one.
      dense: indices of the units that travel dense, with no residual.
      layout: the units and the layer stacks.
      batches: the stores kept together as slice ranges of a stack; their values are
        ``ExchangeState.residuals[batch.label]``, every other kept store's is
        ``residuals[store.group.label]``.
    """

    paths: tuple[str, ...]
    stores: tuple[stores.StorePlan, ...]
    dense: tuple[int, ...]
    layout: layer_stacks_lib.Layout
    batches: tuple[stores.StoreBatch, ...] = ()

    def store_of(self, path: str) -> stores.StorePlan | None:
        """The store holding the residual of the unit at ``path`` (``None``: dense)."""
        for plan in self.stores:
            if path in plan.group.paths:
                return plan
        return None

    @property
    def kept(self) -> tuple[stores.StorePlan, ...]:
        """The stores that keep a residual (all but kind ``"none"``)."""
        return tuple(p for p in self.stores if p.kind != "none")

    def residual_bytes(self) -> int:
        """Bytes of one worker's stored residuals (indices of intra-layer stores included)."""
        return sum(stores.stored_bytes(p) for p in self.kept)

    @functools.cached_property
    def loose(self) -> tuple[stores.StorePlan, ...]:
        """The kept stores in no batch: each is ``residuals[store.group.label]``."""
        batched = {p.group.label for b in self.batches for p in b.stores}
        return tuple(p for p in self.kept if p.group.label not in batched)

    @functools.cached_property
    def stack_plans(self) -> tuple[StackPlan, ...]:
        """One :class:`StackPlan` per layer stack, in leaf order."""
        batched = {p.group.label for b in self.batches for p in b.stores}
        dense = set(self.dense)
        out = []
        for stack in self.layout.stacks:
            position = {u: s for s, u in enumerate(stack.units)}
            pieces = []
            shard = None
            for store in self.stores:
                slices = [position[m] for m in store.group.members if m in position]
                if slices:
                    shard = store.shard
                if not slices or store.group.label in batched:
                    continue
                for run in _runs(sorted(slices)):
                    pieces.append((store, run[0], run[-1] + 1))
            out.append(
                StackPlan(
                    stack=stack,
                    batches=tuple(b for b in self.batches if b.leaf == stack.leaf),
                    pieces=tuple(pieces),
                    dense=stack.units[0] in dense,
                    shard=shard,
                )
            )
        return tuple(out)


def _runs(indices: list[int]) -> list[list[int]]:
    """Sorted ``indices`` cut into runs of consecutive integers."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class WireBytes(NamedTuple):
    """Bytes one worker receives per run of exchanges: a model of ring collectives, in which
    each worker receives what it sends (docs/exchange.md, "What the network carries").

    With ``N`` workers in ``M = N / L`` nodes of ``L`` devices (flat: ``L = 1``, ``M = N``),
    a payload of ``p`` bytes costs ``(M - 1) p`` all-gathered and ``2 (M - 1) / M p``
    all-reduced across nodes; a hierarchical exchange adds, inside the node, ``2 (L - 1) / L``
    times each compressed leaf (reduce-scatter, then all-gather of the means), and leaves in
    no store are all-reduced over all ``N`` workers, ``2 (N - 1) / N`` times their bytes.

    Attributes:
      exchange: this exchange's bytes over every collective.
      exchange_across_nodes: the part across nodes (all of ``exchange`` when flat).
      dense: a ring all-reduce of every gradient uncompressed, ``2 (N - 1) / N`` times
        :func:`dense_bytes`.
      dense_across_nodes: the part of that all-reduce across nodes when it runs as a 2-D
        ring (``2 (M - 1) / M`` times :func:`dense_bytes` ``/ L``; ``dense`` when flat).
    """

    exchange: float
    exchange_across_nodes: float
    dense: float
    dense_across_nodes: float


class _Traffic(NamedTuple):
    """The terms of :class:`WireBytes` over some steps, per device (integer bytes)."""

    gathered: int  # payloads all-gathered across nodes (shards' when hierarchical)
    reduced: int  # payloads all-reduced across nodes
    loose: int  # leaves in no store, all-reduced over every worker
    sharded: int  # compressed leaves reduce-scattered inside a node, padding included
    every: int  # all leaves, dense (the baseline)
    local: int  # L: devices per node (1: flat)


def _ring_share(workers: int) -> Fraction:
    """``2 (n - 1) / n``: the share of its buffer a ring all-reduce sends per worker."""
    return Fraction(2 * (workers - 1), workers)


class ExchangeTransformation(optax.GradientTransformationExtraArgs):
    """An ``optax.GradientTransformationExtraArgs`` that also tells its residual plan.

    ``tx.plan(params)`` returns the :class:`ExchangePlan` for ``params`` (or their
    ``jax.ShapeDtypeStruct``s) without tracing anything.
    """

    __slots__ = ()

    def plan(self, params: PyTree, *, local_size: int | None = None) -> ExchangePlan:
        """The residual plan; ``local_size``: the local axis size of a hierarchical
        transform (read from the mesh when called inside ``shard_map``)."""
        return self._core.plan(params, local_size=local_size)

    def bytes_sent(self, params: PyTree, steps: int, *, local_size: int | None = None) -> int:
        """Payload bytes one worker sends in the first ``steps`` exchanges.

        Exact, from the compressors' ``payload_bytes``: every compressed leaf at the size
        of its density-schedule phase at each step, every dense leaf all-reduced in its
        own dtype. Hierarchical (``local_size > 1``): what one device sends across nodes,
        its shard's payload (the dense exchange inside a node is not counted).
        """
        return self._core.bytes_sent(params, steps, local_size=local_size)

    def wire_bytes(
        self, params: PyTree, steps: int, num_workers: int, *, local_size: int | None = None
    ) -> WireBytes:
        """What one of ``num_workers`` workers receives in the first ``steps`` exchanges,
        each payload by the collective it takes (its compressor's ``collective``): the
        :meth:`bytes_sent` payloads in the model of :class:`WireBytes`, beside a dense
        all-reduce's. Hierarchical: ``num_workers`` devices, ``local_size`` per node."""
        return self._core.wire_bytes(params, steps, num_workers, local_size=local_size)

    def crossover_workers(
        self, params: PyTree, steps: int, *, local_size: int | None = None
    ) -> int | None:
        """The fewest workers at which :meth:`wire_bytes` across nodes exceed the dense
        all-reduce's (``None``: at no number of workers); hierarchical: a multiple of
        ``local_size``. Solved from the model's terms, not searched."""
        return self._core.crossover_workers(params, steps, local_size=local_size)

    @property
    def _core(self):
        return self.init.__self__  # ``init`` is a bound method of the core


def leaf_key(
    seed: int,
    count: jax.Array,
    leaf_index: int,
    compressor: Compressor,
    axis_name: AxisName,
    shard_axis: str | None = None,
) -> jax.Array | None:
    """The PRNG key of one leaf at one step (``None`` for deterministic compressors).

    ``fold_in(fold_in(PRNGKey(seed), count), leaf_index)`` is the same on every worker;
    a sharded leaf folds in the shard's index on ``shard_axis`` (shard ``j`` of every node
    draws alike), and for ``randomness == "per_worker"`` the worker index is folded in as
    well.
    """
    if compressor.randomness == "none":
        return None
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), count), leaf_index)
    if shard_axis is not None:
        key = jax.random.fold_in(key, lax.axis_index(shard_axis))
    if compressor.randomness == "per_worker":
        key = jax.random.fold_in(key, lax.axis_index(axis_name))
    return key


def _selection_key(
    seed: int, count, leaf_index: int, axis_name: AxisName, plan: stores.StorePlan
) -> jax.Array | None:
    if plan.selection != "softmax_sample":
        return None
    key = jax.random.fold_in(jax.random.PRNGKey(seed ^ _SELECTION_STREAM), count)
    key = jax.random.fold_in(key, leaf_index)
    return jax.random.fold_in(key, lax.axis_index(axis_name))  # residuals differ per worker


def _node_mean_shard(shard: stores.Shard, g: jax.Array) -> jax.Array:
    """This device's shard of the node's mean of ``g``: a dense reduce-scatter over local."""
    m = g.reshape(shard.shape2d)
    pad = shard.rows * shard.count - shard.shape2d[0]
    if pad:
        m = jnp.pad(m, ((0, pad), (0, 0)))
    total = lax.psum_scatter(m, shard.axis_name, scatter_dimension=0, tiled=True)
    return (total.astype(jnp.promote_types(g.dtype, jnp.float32)) / shard.count).astype(g.dtype)


def _gather_shards(shard: stores.Shard, x: jax.Array) -> jax.Array:
    """The whole leaf from every device's shard: a dense all-gather over local."""
    if x.dtype == jnp.bfloat16:  # XLA:CPU widens bfloat16 all-gathers (compressors.base)
        bits = lax.bitcast_convert_type(x, jnp.uint16)
        bits = lax.all_gather(bits, shard.axis_name, axis=0, tiled=True, to="invarying")
        full = lax.bitcast_convert_type(bits, jnp.bfloat16)
    else:
        full = lax.all_gather(x, shard.axis_name, axis=0, tiled=True, to="invarying")
    return full[: shard.shape2d[0]].reshape(shard.leaf_shape)


def _where_skip(skip: jax.Array | None, if_skipped: PyTree, otherwise: PyTree) -> PyTree:
    if skip is None:
        return otherwise
    return jax.tree.map(lambda a, b: jnp.where(skip, a, b), if_skipped, otherwise)


@dataclasses.dataclass(frozen=True)
class _Exchange:
    """The one exchange algorithm; ``init``/``update`` are the transform's functions."""

    compressor: Compressor
    axis_name: AxisName
    planner: StorePlanner
    min_size: int
    seed: int
    name: str
    local_axis: str | None = None
    layer_stacks: tuple[tuple[str, int], ...] | None = None
    selection_scope: str = "leaf"  # or "global": one Top-k over every compressed leaf

    @functools.cached_property
    def phases(self) -> tuple[schedule.Phase, ...]:
        """The compressor's phases: one per density of its schedule, or just itself."""
        return schedule.phases(self.compressor)

    @property
    def worker_axes(self) -> AxisName:
        """Every axis the workers are mapped over (``data`` and, if set, ``local``)."""
        if self.local_axis is None:
            return self.axis_name
        data = self.axis_name if isinstance(self.axis_name, tuple) else (self.axis_name,)
        return (*data, self.local_axis)

    def _local_size(self) -> int:
        """Devices on the local axis (1 without one); inside shard_map / pmap only."""
        return 1 if self.local_axis is None else axis_size(self.local_axis)

    # ------------------------------------------------------------------------ plan

    def plan(self, params: PyTree, *, local_size: int | None = None) -> ExchangePlan:
        if self.local_axis is None:
            local_size = 1
        elif local_size is None:
            try:
                local_size = self._local_size()
            except NameError:
                raise ValueError(
                    f"{self.name} is hierarchical (local_axis='{self.local_axis}'): its plan "
                    "depends on the local axis size. Call tx.plan(params, local_size=L) "
                    "outside shard_map."
                ) from None
        shapes = tuple(
            (tuple(np.shape(x)), np.dtype(x.dtype).name) for x in jax.tree.leaves(params)
        )
        return self._plan_for(jax.tree.structure(params), shapes, int(local_size))

    @functools.lru_cache(maxsize=8)  # noqa: B019 - keyed by (treedef, shapes, L): hashable, tiny
    def _plan_for(self, treedef, shapes, local_size: int) -> ExchangePlan:
        like = treedef.unflatten([jax.ShapeDtypeStruct(s, d) for s, d in shapes])
        layout = layer_stacks_lib.layout(like, self.layer_stacks)
        store_plans = tuple(self.planner(like if layout.trivial else layout.view()))
        if local_size > 1:
            store_plans = tuple(
                stores.shard_store(p, self.local_axis, local_size) for p in store_plans
            )
        members = {i for p in store_plans for i in p.group.members}
        dense = tuple(i for i in range(len(layout.units)) if i not in members)
        slice_of = {k: (u.leaf, u.index) for k, u in enumerate(layout.units) if u.index is not None}
        batches = stores.batch_stores(
            store_plans, slice_of, {stack.leaf: stack.path for stack in layout.stacks}
        )
        if self.selection_scope == "global":
            _check_global_stores(self.name, store_plans, layout)
        return ExchangePlan(layout.paths, store_plans, dense, layout, batches)

    def bytes_sent(self, params: PyTree, steps: int, *, local_size: int | None = None) -> int:
        plan = self.plan(params, local_size=local_size)
        units = plan.layout.units
        total = 0
        if self.selection_scope == "global" and plan.stores:  # one payload for all of them
            size = sum(
                math.prod(store.group.shape) * len(store.group.members) for store in plan.stores
            )
            dtype = units[plan.stores[0].group.members[0]].dtype
            total += schedule.bytes_sent(self.compressor, (size,), dtype, steps)
        for store in plan.stores if self.selection_scope == "leaf" else ():
            for i in store.group.members:
                total += schedule.bytes_sent(
                    self.compressor, store.group.shape, units[i].dtype, steps
                )
        for i in plan.dense:
            like = jax.ShapeDtypeStruct(units[i].shape, units[i].dtype)
            total += steps * dense_bytes(like)
        return int(total)

    def _traffic(self, params: PyTree, steps: int, local_size: int | None) -> _Traffic:
        """The payloads of :meth:`bytes_sent`, split by collective, and the dense terms."""
        plan = self.plan(params, local_size=local_size)
        local = 1 if self.local_axis is None else int(local_size or self._local_size())
        units = plan.layout.units
        sent = {"all_gather": 0, "all_reduce": 0}

        def add(shape: tuple[int, ...], dtype: Any) -> None:
            for how, n in schedule.bytes_sent_by_collective(
                self.compressor, shape, dtype, steps
            ).items():
                sent[how] += n

        sharded = 0
        if self.selection_scope == "global" and plan.stores:  # one payload for all of them
            size = sum(
                math.prod(store.group.shape) * len(store.group.members) for store in plan.stores
            )
            add((size,), units[plan.stores[0].group.members[0]].dtype)
        for store in plan.stores:
            for i in store.group.members:
                if self.selection_scope == "leaf":
                    add(store.group.shape, units[i].dtype)
                if store.shard is not None:  # the node's padded leaf, every step
                    padded = store.shard.rows * store.shard.count * store.shard.shape2d[1]
                    sharded += steps * padded * np.dtype(units[i].dtype).itemsize
        loose = sum(
            steps * math.prod(units[i].shape) * np.dtype(units[i].dtype).itemsize
            for i in plan.dense
        )
        every = steps * dense_bytes(params)
        return _Traffic(sent["all_gather"], sent["all_reduce"], loose, sharded, every, local)

    def wire_bytes(
        self, params: PyTree, steps: int, num_workers: int, *, local_size: int | None = None
    ) -> WireBytes:
        t = self._traffic(params, steps, local_size)
        n = int(num_workers)
        if n < 1 or n % t.local:
            raise ValueError(
                f"num_workers must be a positive multiple of the {t.local} devices per node, "
                f"got {num_workers!r}."
            )
        nodes = n // t.local
        across = (nodes - 1) * t.gathered + _ring_share(nodes) * (
            t.reduced + Fraction(t.loose, t.local)
        )
        inside = _ring_share(t.local) * (t.sharded + t.loose)
        return WireBytes(
            exchange=float(across + inside),
            exchange_across_nodes=float(across),
            dense=float(_ring_share(n) * t.every),
            dense_across_nodes=float(_ring_share(nodes) * Fraction(t.every, t.local)),
        )

    def crossover_workers(
        self, params: PyTree, steps: int, *, local_size: int | None = None
    ) -> int | None:
        # Across nodes, with M nodes: (M - 1) G + 2 (M - 1) / M (R + d / L) against
        # 2 (M - 1) / M D / L. Equal at M = 1; for M >= 2 the first exceeds the second
        # iff M G L > 2 (D - d - L R) =: C.
        t = self._traffic(params, steps, local_size)
        c = 2 * (t.every - t.loose - t.local * t.reduced)
        if t.gathered == 0:
            return 2 * t.local if c < 0 else None
        return max(2, c // (t.gathered * t.local) + 1) * t.local

    # ------------------------------------------------------------------------ init

    def init(self, params: PyTree) -> ExchangeState:
        validate_float_leaves(params, self.name)
        plan = self.plan(params)
        leaves, treedef = jax.tree.flatten(params)
        units = plan.layout.units
        cstates: list[Any] = [optax.MaskedNode()] * len(leaves)
        for store in plan.stores:
            for i in store.group.members:
                like = jax.ShapeDtypeStruct(store.group.shape, leaves[units[i].leaf].dtype)
                for phase in self.phases:  # a shard's, a slice's
                    phase.compressor.validate(plan.paths[i], like)
                cstates[units[i].leaf] = self._init_compressor_state(like)
        for stack_plan in plan.stack_plans:  # one state per slice, on a leading slice axis
            j, size = stack_plan.stack.leaf, stack_plan.stack.size
            cstates[j] = jax.tree.map(
                lambda x, size=size: jnp.broadcast_to(x, (size, *x.shape)), cstates[j]
            )
        residuals = {p.group.label: stores.init_store(p) for p in plan.loose}
        for batch in plan.batches:
            if batch.plan.kind != "none":
                residuals[batch.label] = stores.init_batch(batch)
        return ExchangeState(
            count=jnp.zeros([], jnp.int32),
            residuals=residuals,
            compressor_state=treedef.unflatten(cstates),
        )

    def _init_compressor_state(self, like: jax.ShapeDtypeStruct) -> Any:
        """The per-leaf compressor state: the phases' common state, or a
        :class:`PhaseStates` where their states differ in structure, shape or dtype."""
        states = [p.compressor.init(like) for p in self.phases]
        shapes = [jax.eval_shape(lambda s=s: s) for s in states]
        if all(shape == shapes[0] for shape in shapes[1:]):
            return states[0]
        return PhaseStates(tuple(states))

    def _phase_reduce(self, k: int, reduce_with: Callable[..., tuple]) -> Callable[..., tuple]:
        """Phase ``k``'s ``reduce_with(compressor, x, cstate) -> (mean, residual, cstate)``
        as ``f(x, cstate)``: with :class:`PhaseStates` it reads and replaces phase ``k``'s
        entry only."""
        compressor = self.phases[k].compressor

        def run(x: jax.Array, cstate: Any) -> tuple:
            if not isinstance(cstate, PhaseStates):
                return reduce_with(compressor, x, cstate)
            mean, residual, new = reduce_with(compressor, x, cstate.phases[k])
            return (
                mean,
                residual,
                PhaseStates(tuple(new if n == k else c for n, c in enumerate(cstate.phases))),
            )

        return run

    def _reduce_in_phase(
        self,
        reduce_with: Callable[..., tuple],
        x: jax.Array,
        cstate: Any,
        static: int | None,
        phase: jax.Array,
    ) -> tuple:
        """``reduce_with`` in the static phase ``static``, or switched on ``phase`` (one
        static-size branch per phase of the density schedule)."""
        if static is not None:
            return self._phase_reduce(static, reduce_with)(x, cstate)
        branches = [self._phase_reduce(k, reduce_with) for k in range(len(self.phases))]
        return lax.switch(phase, branches, x, cstate)

    # ---------------------------------------------------------------------- update

    def update(
        self,
        updates,
        state: ExchangeState,
        params=None,
        *,
        skip=None,
        density_phase: int | None = None,
        **extra_args,
    ):
        """One exchange. ``skip``: optional boolean scalar, equal on every worker.

        ``density_phase``: a Python int, the phase of the compressor's density schedule to
        compile statically (one program per phase, each with its own compiled peak);
        ``None`` (default): one program that switches between the phases on the step
        count (``lax.switch``: the peak of every phase's branch at once).

        On a skipped step the output is zero, ``count`` and the compressor state do not
        change, shared and intra-layer stores keep their residual exactly, and a leaf's
        own residual becomes the compensated gradient ``G + R`` (nothing was sent, so
        nothing is taken out of it). :func:`~resireduce_jax.skip_nonfinite` passes
        ``skip`` together with sanitized (strict mode: ``-0.0``) gradients.
        """
        del params, extra_args
        check_axis_bound(self.worker_axes)
        check_local_gradients(updates, self.worker_axes, self.name)
        local_size = self._local_size()
        plan = self.plan(updates, local_size=local_size)
        units = plan.layout.units
        leaves, treedef = jax.tree.flatten(updates)
        cstates = treedef.flatten_up_to(state.compressor_state)
        out: list[Any] = [None] * len(leaves)
        new_cstates = list(cstates)
        new_residuals: dict[str, Any] = {}
        # Payloads cross the data axis only when leaves are sharded over a local axis;
        # otherwise (no local axis, or one of size 1) they cross every worker axis.
        payload_axes = self.axis_name if local_size > 1 else self.worker_axes
        # Units that are whole leaves; the slices of layer stacks are exchanged together.
        arrays = {i: leaves[u.leaf] for i, u in enumerate(units) if u.index is None}
        shards = {i: p.shard for p in plan.stores for i in p.group.members if p.shard}
        for i in arrays:
            if i in shards:
                arrays[i] = _node_mean_shard(shards[i], arrays[i])

        static = schedule.static_phase_index(self.phases, density_phase)
        phase = schedule.phase_index([p.start for p in self.phases], state.count)
        zero_stores = self._zero_stores(density_phase)

        def send(i: int, x: jax.Array, residual_skip: jax.Array | None) -> jax.Array:
            """Exchanges unit ``i``'s compensated ``x``; returns this worker's residual."""
            j, shard = units[i].leaf, shards.get(i)

            def reduce_with(compressor: Compressor, x, cstate) -> tuple[Any, Any, Any]:
                key = leaf_key(
                    self.seed, state.count, i, compressor, payload_axes, shard and shard.axis_name
                )
                reduced = compressor.reduce(x, cstate, key, payload_axes, skip=residual_skip)
                return reduced.mean, reduced.residual, reduced.state

            mean, residual, cstate = self._reduce_in_phase(
                reduce_with, x, cstates[j], static, phase
            )
            mean = mean if shard is None else _gather_shards(shard, mean)
            out[j] = _where_skip(skip, jnp.zeros((), mean.dtype), mean)
            new_cstates[j] = _where_skip(skip, cstates[j], cstate)
            return residual

        # Layer stacks: every slice of a stack at once (the slices of loose shared groups
        # leave partial sums for their groups).
        partial_sums: dict[str, list[stores.WeightedSum]] = {}
        for stack_plan in plan.stack_plans:
            j = stack_plan.stack.leaf
            out[j], new_cstates[j] = self._update_stack(
                stack_plan,
                leaves[j],
                cstates[j],
                state,
                skip,
                payload_axes,
                new_residuals,
                partial_sums,
                static,
                phase,
                zero_stores,
            )

        batched = {p.group.label for b in plan.batches for p in b.stores}
        shared_residuals: dict[str, jax.Array] = {}  # shared groups' new residuals
        if self.selection_scope == "global" and plan.stores:
            self._update_global(
                plan,
                arrays,
                state,
                skip,
                static,
                phase,
                payload_axes,
                out,
                new_residuals,
                zero_stores,
            )
        for store in plan.stores if self.selection_scope == "leaf" else ():
            label = store.group.label
            if label in batched:
                continue
            stored = state.residuals.get(label)
            if zero_stores and store.kind not in ("none", "leaf"):
                for i in store.group.members:  # slices of stacks were sent with them
                    if i in arrays:
                        send(i, arrays[i], None)
                new_residuals[label] = stored  # zeros, kept as they are
                continue
            if store.kind == "none":
                (i,) = store.group.members
                send(i, arrays[i], None)
            elif store.kind == "leaf":
                # The skip hook gives back G~ itself on a skipped step, in the same pass.
                (i,) = store.group.members
                r = send(i, stores.compensate(store, stored, arrays[i]), skip)
                new_residuals[label] = r.astype(store.dtype)
            elif store.shared:
                shared_residuals[label] = self._update_shared(
                    store, stored, arrays, send, partial_sums.get(label, ())
                )
            else:  # "rows" / "2d"
                (i,) = store.group.members
                compensated = stores.compensate(store, stored, arrays[i])
                norms = None
                if store.norm_source == "compensated":  # the reference code's rows/columns
                    # Two vectors of G~, taken before G~ is consumed, with |G~| in its buffer.
                    compensated, norms = stores.dimension_norms_in_place(store, compensated)
                r = send(i, compensated, None)
                key = _selection_key(self.seed, state.count, i, self.worker_axes, store)
                kept = stores.compress_residual(store, r, key, norms)
                new_residuals[label] = _where_skip(skip, stored, kept)

        for label, residual in shared_residuals.items():
            new_residuals[label] = _where_skip(skip, state.residuals[label], residual)
        for i in plan.dense:  # small leaves: plain all-reduce, no residual
            if units[i].index is None:
                mean = dense_mean(arrays[i], self.worker_axes)
                out[units[i].leaf] = _where_skip(skip, jnp.zeros((), mean.dtype), mean)
        count = optax.safe_int32_increment(state.count)
        new_state = ExchangeState(
            count=_where_skip(skip, state.count, count),
            residuals=new_residuals,
            compressor_state=treedef.unflatten(new_cstates),
        )
        return treedef.unflatten(out), new_state

    def _update_global(
        self,
        plan: ExchangePlan,
        arrays: dict[int, jax.Array],
        state: ExchangeState,
        skip: jax.Array | None,
        static: int | None,
        phase: jax.Array,
        payload_axes: AxisName,
        out: list[Any],
        new_residuals: dict[str, Any],
        zero_stores: bool,
    ) -> None:
        """Every store at once (``selection_scope="global"``): each member compensated
        with its store's residual, then a Top-k phase selects over all of them
        (:meth:`TopK.reduce_jointly`) and any other phase reduces member by member. Each store
        then keeps what its members did not send, as the per-leaf pass does: a leaf's own
        residual, a shared group's (weighted) mean of its members' (§4.2), a singleton's
        rows or rows × columns (§4.3). Writes the means into ``out`` and the stores into
        ``new_residuals``. ``zero_stores``: the program of a leading dense phase, whose
        stores hold zeros and stay so (:meth:`_zero_stores`)."""
        units = plan.layout.units
        # A group's members last to first, as the per-leaf pass adds them (§4.2's sum).
        members = [(store, i) for store in plan.stores for i in reversed(store.group.members)]
        compensated: list[jax.Array] = []
        weights: dict[int, jax.Array] = {}  # ResiReduce-w weights taken of G~
        norms: dict[int, Any] = {}  # a 2-D store's row/column norms taken of G~
        for store, i in members:
            if store.kind == "none" or (zero_stores and store.kind != "leaf"):
                compensated.append(arrays[i])
                continue
            x = stores.compensate(store, state.residuals[store.group.label], arrays[i])
            if store.kind == "weighted" and store.weight_source == "compensated":
                weights[i] = stores.residual_weight(x, store.phi, store.shard)
            elif store.kind in ("rows", "2d") and store.norm_source == "compensated":
                x, norms[i] = stores.dimension_norms_in_place(store, x)
            compensated.append(x)

        def branch(k: int) -> Callable[[tuple], tuple]:
            compressor = self.phases[k].compressor

            def run(xs: tuple) -> tuple:
                if isinstance(compressor, TopK):
                    return compressor.reduce_jointly(xs, payload_axes, skip)
                reduced = [compressor.reduce(x, (), None, payload_axes, skip=skip) for x in xs]
                return tuple(r.mean for r in reduced), tuple(r.residual for r in reduced)

            return run

        xs = tuple(compensated)
        if static is not None:
            means, residuals = branch(static)(xs)
        else:
            means, residuals = lax.switch(phase, [branch(k) for k in range(len(self.phases))], xs)
        sums: dict[str, stores.WeightedSum] = {}
        for (store, i), mean, r in zip(members, means, residuals, strict=True):
            out[units[i].leaf] = _where_skip(skip, jnp.zeros((), mean.dtype), mean)
            label, stored = store.group.label, state.residuals.get(store.group.label)
            if store.kind == "none":
                continue
            if store.kind == "leaf":  # a skipped step's residual is G~ (nothing was sent)
                new_residuals[label] = r.astype(store.dtype)
            elif zero_stores:
                new_residuals[label] = stored  # zeros, kept as they are
            elif store.shared:
                if store.kind == "average":
                    weight = jnp.ones([], jnp.float32)
                else:
                    weight = weights.get(i)
                    if weight is None:
                        weight = stores.residual_weight(r, store.phi, store.shard)
                acc = sums.get(label)
                sums[label] = (
                    stores.WeightedSum.first(r, weight) if acc is None else acc.add(r, weight)
                )
            else:  # "rows" / "2d"
                key = _selection_key(self.seed, state.count, i, self.worker_axes, store)
                kept = stores.compress_residual(store, r, key, norms.get(i))
                new_residuals[label] = _where_skip(skip, stored, kept)
        for store in plan.stores:
            if store.group.label in sums:
                residual = sums[store.group.label].finish(store)
                new_residuals[store.group.label] = _where_skip(
                    skip, state.residuals[store.group.label], residual
                )

    def _zero_stores(self, density_phase: int | None) -> bool:
        """Whether this program is the leading phase of a schedule and that phase is dense
        (:func:`~resireduce_jax.compressors.dense.is_dense`: float32 or a 16-bit cast).

        Every store starts at zero (``init``) and a dense phase sends all of ``G + R``,
        leaving a residual of exactly zero; shared and intra-layer stores also keep their
        residual on a skipped step. So through a leading dense phase (a dense warm-up, the
        compressed-momentum optimizers' Adam phase) those stores hold zeros, and its
        program sends the gradients as they are and keeps them: it neither compensates
        the members nor rebuilds a group's residual, whose leaf-sized temporaries would
        otherwise set the phase's peak above plain EF's. A leaf's own residual (kind
        ``"leaf"``) takes ``G + R`` on a skipped step, so it goes the general way.
        """
        return density_phase == 0 and len(self.phases) > 1 and is_dense(self.phases[0].compressor)

    @staticmethod
    def _update_shared(store, stored, arrays, send, partial_sums=()):
        """One step of a shared group (§4.2): members one by one, running weighted sum.

        Each member starts after the previous one was added to the sum, so one running
        sum and one member's transient residual are alive at a time. The members go from
        the last layer to the first, the order in which the backward pass produces their
        gradients: in layer order, the chain would hold the later layers' gradients until
        the group's first layer had its own (measured at the compiled peak of ResNet-50
        width 32, w against EF: drop/saving -0.27 in layer order). Groups are not ordered
        among themselves, for the same reason. Members that are slices of layer stacks
        were exchanged with their stacks and come in as ``partial_sums``.
        """
        acc = None
        for part in partial_sums:
            acc = part if acc is None else acc.merge(part)
        for i in reversed(store.group.members):
            if i not in arrays:  # a slice: in partial_sums
                continue
            g = arrays[i]
            if acc is not None:
                g, acc = ordered(g, acc)
            compensated = stores.compensate(store, stored, g)
            if store.kind == "weighted" and store.weight_source == "compensated":
                weight = stores.residual_weight(compensated, store.phi, store.shard)
                compensated, weight = ordered(compensated, weight)  # read G~ before update
            r = send(i, compensated, None)
            if store.kind == "average":
                weight = jnp.ones([], jnp.float32)
            elif store.weight_source == "residual":
                weight = stores.residual_weight(r, store.phi, store.shard)
            acc = stores.WeightedSum.first(r, weight) if acc is None else acc.add(r, weight)
        return acc.finish(store)

    def _update_stack(
        self,
        stack_plan: StackPlan,
        g: jax.Array,
        cstate: PyTree,
        state: ExchangeState,
        skip: jax.Array | None,
        payload_axes: AxisName,
        new_residuals: dict[str, Any],
        partial_sums: dict[str, list[stores.WeightedSum]],
        static: int | None = None,
        phase: jax.Array | None = None,
        zero_stores: bool = False,
    ) -> tuple[jax.Array, PyTree]:
        """One step of a layer stack: every slice a layer, all slices at once.

        The stack is seen slice-major (``[layers, *slice]``); each slice is compensated
        with its store's residual (a batch's slice range, read in place), the compressor
        runs over the slices vectorised (``jax.vmap``: a batched Top-k, one exchange), and
        every batch's residuals are rebuilt from its slice range of the fresh residuals.
        Returns the stack's mean and compressor state. ``zero_stores``: a leading dense
        phase (:meth:`_zero_stores`); a stack whose slices keep no residual of their own
        is then sent as it is and its stores kept.
        """
        stack, shard = stack_plan.stack, stack_plan.shard
        zero = jnp.zeros((), g.dtype)
        if stack_plan.dense:
            return _where_skip(skip, zero, dense_mean(g, self.worker_axes)), cstate
        as_is = zero_stores and all(plan.kind != "leaf" for plan, _, _ in _ranges(stack_plan))
        x = jnp.moveaxis(g, stack.axis, 0)
        if shard is not None:
            x = jax.vmap(functools.partial(_node_mean_shard, shard))(x)
        if not as_is:
            x = _compensate_stack(stack_plan, state.residuals, x)

        # What is read of G~ before it is consumed: compensated norms and weights.
        before: dict[int, Any] = {}
        for n, (plan, start, stop) in enumerate([] if as_is else _ranges(stack_plan)):
            if plan.kind in ("rows", "2d") and plan.norm_source == "compensated":
                x, before[n] = _map_range(
                    x,
                    start,
                    stop,
                    jax.vmap(functools.partial(stores.dimension_norms_in_place, plan)),
                )
            elif plan.kind == "weighted" and plan.weight_source == "compensated":
                weights = _slice_weights(plan, x[start:stop])
                x, before[n] = ordered(x, weights)

        units = jnp.asarray(stack.units, jnp.int32)

        def reduce_with(compressor: Compressor, x, cstate) -> tuple[Any, Any, Any]:
            keys = None
            if compressor.randomness != "none":  # each slice's key is its unit's
                shard_axis = shard and shard.axis_name
                keys = jax.vmap(
                    lambda i: leaf_key(
                        self.seed, state.count, i, compressor, payload_axes, shard_axis
                    )
                )(units)
            reduced = compressor.reduce_slices(
                x, cstate, keys, payload_axes, _residual_skip(stack_plan, skip)
            )
            return reduced.mean, reduced.residual, reduced.state

        mean, residual, new_cstate = self._reduce_in_phase(reduce_with, x, cstate, static, phase)
        reduced = Reduced(mean, residual, new_cstate)
        mean = reduced.mean
        if shard is not None:
            mean = jax.vmap(functools.partial(_gather_shards, shard))(mean)
        mean = jnp.moveaxis(mean, 0, stack.axis)
        if as_is:  # zeros, kept as they are (a loose group's are kept with the group)
            for batch in stack_plan.batches:
                new_residuals[batch.label] = state.residuals.get(batch.label)
        else:
            self._rebuild_stores(
                stack_plan, reduced.residual, before, state, skip, new_residuals, partial_sums
            )
        return _where_skip(skip, zero, mean), _where_skip(skip, cstate, reduced.state)

    def _rebuild_stores(
        self,
        stack_plan: StackPlan,
        r: jax.Array,
        before: dict[int, Any],
        state: ExchangeState,
        skip: jax.Array | None,
        new_residuals: dict[str, Any],
        partial_sums: dict[str, list[stores.WeightedSum]],
    ) -> None:
        """Every batch's new residuals from its slice range of the stack's fresh residuals
        ``r`` (and of the loose pieces, partial sums for their groups). ``before``: what
        was read of ``G~`` for each range (compensated weights or norms)."""
        units = jnp.asarray(stack_plan.stack.units, jnp.int32)
        for n, (plan, start, stop) in enumerate(_ranges(stack_plan)):
            part = r[start:stop]
            weights = before.get(n)
            if plan.shared and weights is None:
                weights = _slice_weights(plan, part)
            if n >= len(stack_plan.batches):  # a loose group's slices: a partial sum
                partial = stores.WeightedSum.of_slices(part, weights)
                partial_sums.setdefault(plan.group.label, []).append(partial)
                continue
            batch = stack_plan.batches[n]
            stored = state.residuals.get(batch.label)
            if plan.kind == "leaf":
                new_residuals[batch.label] = part.astype(plan.dtype)
            elif plan.shared:
                sums = stores.WeightedSum.of_groups(part, weights, batch.sizes)
                new_residuals[batch.label] = _where_skip(skip, stored, sums.finish(plan))
            elif plan.kind in ("rows", "2d"):
                selection_keys = jax.vmap(
                    lambda i, plan=plan: _selection_key(
                        self.seed, state.count, i, self.worker_axes, plan
                    )
                )(units[start:stop])
                kept = jax.vmap(functools.partial(stores.compress_residual, plan))(
                    part, selection_keys, before.get(n)
                )
                new_residuals[batch.label] = _where_skip(skip, stored, kept)


def _residual_skip(stack_plan: StackPlan, skip: jax.Array | None) -> jax.Array | None:
    """The skip hook's argument for a stack: ``skip`` for the slices that keep their own
    residual (a scalar when all do, one flag per slice when some do), ``None`` if none."""
    own = np.zeros(stack_plan.stack.size, bool)
    for batch in stack_plan.batches:
        own[batch.start : batch.stop] = batch.plan.kind == "leaf"
    if skip is None or not own.any():
        return None
    return skip if own.all() else jnp.logical_and(skip, jnp.asarray(own))


def _ranges(stack_plan: StackPlan) -> list[tuple[stores.StorePlan, int, int]]:
    """``(store plan, start, stop)`` of every batch, then of every loose piece."""
    batches = [(b.plan, b.start, b.stop) for b in stack_plan.batches]
    return batches + list(stack_plan.pieces)


def _map_range(x: jax.Array, start: int, stop: int, fn: Callable) -> tuple[jax.Array, Any]:
    """``fn`` of slices ``start ... stop - 1`` of ``x``, which returns ``(new slices,
    extra)``; the new slices are written back into ``x``."""
    if (start, stop) == (0, x.shape[0]):
        return fn(x)
    new, extra = fn(x[start:stop])
    return x.at[start:stop].set(new), extra


def _slice_weights(plan: stores.StorePlan, x: jax.Array) -> jax.Array:
    """Every slice's member weight (§4.2), float32 ``[slices]``; ones for ``"average"``."""
    if plan.kind == "average":
        return jnp.ones(x.shape[:1], jnp.float32)
    return jax.vmap(lambda s: stores.residual_weight(s, plan.phi, plan.shard))(x)


def _compensate_stack(stack_plan: StackPlan, residuals: dict[str, Any], x: jax.Array) -> jax.Array:
    """``G~ = G + R`` for every slice of a slice-major stack ``x``, with its store's ``R``.

    A stack that is one plain error-feedback batch is compensated into its donated
    residual, as a leaf's own residual is; otherwise every slice range gets its residuals
    added in ``x``'s own buffer (:func:`resireduce_jax.in_place.add_slices`).
    """
    batches = stack_plan.batches
    if (
        len(batches) == 1
        and not stack_plan.pieces
        and batches[0].plan.kind == "leaf"
        and (batches[0].start, batches[0].stop) == (0, x.shape[0])
    ):
        return x + residuals[batches[0].label].astype(x.dtype)
    for batch in batches:
        plan = batch.plan
        stored = residuals.get(batch.label)
        if plan.kind == "leaf":
            x = in_place.add_slices(x, stored, batch.start, np.arange(len(batch.stores)))
        elif plan.shared:
            x = in_place.add_slices(x, stored, batch.start, batch.store_of_slice)
        elif plan.kind in ("rows", "2d"):
            x, _ = _map_range(
                x,
                batch.start,
                batch.stop,
                lambda part, plan=plan, stored=stored: (
                    jax.vmap(functools.partial(stores.compensate, plan))(stored, part),
                    None,
                ),
            )
    for plan, start, stop in stack_plan.pieces:
        stored = residuals[plan.group.label]
        x = in_place.add_slices(x, stored[None], start, np.zeros(stop - start, np.int32))
    return x


def _check_global_stores(
    name: str, plans: Sequence[stores.StorePlan], layout: layer_stacks_lib.Layout
) -> None:
    """``selection_scope="global"`` selects over whole leaves of one dtype."""
    if not layout.trivial or any(p.shard for p in plans):
        found = "layer stacks" if not layout.trivial else "sharded stores"
        raise ValueError(
            f"{name}: selection_scope='global' ranks whole leaves on a flat exchange "
            f"without layer stacks; found {found}. Use selection_scope='leaf' here."
        )
    dtypes = sorted({p.group.dtype.name for p in plans})
    if len(dtypes) > 1:
        raise ValueError(
            f"{name}: selection_scope='global' ranks every compressed leaf together, so they "
            f"must share one dtype; found {dtypes}."
        )


def exchange(
    compressor: Compressor,
    axis_name: AxisName,
    *,
    planner: StorePlanner,
    min_size: int = DEFAULT_MIN_SIZE,
    seed: int = 0,
    name: str = "exchange",
    local_axis: str | None = None,
    layer_stacks: layer_stacks_lib.LayerStacks | None = None,
    selection_scope: str = "leaf",
) -> ExchangeTransformation:
    """The exchange transform with the residual stores that ``planner`` decides.

    The public factories (:func:`~resireduce_jax.compressed_mean`,
    :func:`~resireduce_jax.error_feedback`, :func:`~resireduce_jax.resireduce`) call this
    with their planners; use those unless you write a new way of storing residuals.

    Args:
      compressor: a compressor from :mod:`resireduce_jax.compressors`.
      axis_name: the mapped axis (or tuple of axes) of the data-parallel workers.
      planner: ``params -> [StorePlan, ...]`` covering every compressed leaf once.
      min_size: leaves with fewer elements (or ``ndim <= 1``) travel dense.
      seed: seed of the per-step keys (compressor randomness, residual sampling).
      name: the public factory's name, for error messages.
      local_axis: the axis of a node's devices for the hierarchical exchange (module
        docstring), or ``None`` (flat).
      layer_stacks: ``{regex: axis}``: the leaves that stack a weight of every layer, and
        their layer axis (:mod:`resireduce_jax.layer_stacks`); ``planner`` then sees the
        unstacked pytree (every slice a leaf at its slice path).
      selection_scope: ``"leaf"``: a sparsifier sends its density of each leaf;
        ``"global"``: a Top-k phase sends its density of all compressed leaves together
        (module docstring; singleton stores of one dtype, flat, no layer stacks; every
        phase of the compressor Top-k or dense).

    Returns:
      An :class:`ExchangeTransformation` whose state is an :class:`ExchangeState`.
    """
    if local_axis is not None:
        data = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        if not isinstance(local_axis, str) or local_axis in data:
            raise ValueError(
                f"local_axis must be the name of a mesh axis other than {data}, got {local_axis!r}."
            )
    stacks = layer_stacks_lib.check(layer_stacks)
    if selection_scope not in ("leaf", "global"):
        raise ValueError(f"selection_scope must be 'leaf' or 'global', got {selection_scope!r}.")
    if selection_scope == "global":
        others = sorted(
            p.compressor.name
            for p in schedule.phases(compressor)
            if p.compressor.name != TopK.name and not is_dense(p.compressor)
        )
        if others or local_axis is not None or stacks is not None:
            found = ", ".join(others) or ("local_axis" if local_axis else "layer_stacks")
            raise ValueError(
                f"{name}: selection_scope='global' is whole-model Top-k: every phase of the "
                f"compressor must be topk (or dense), on a flat exchange without layer "
                f"stacks; found {found}."
            )
    core = _Exchange(
        compressor, axis_name, planner, min_size, seed, name, local_axis, stacks, selection_scope
    )
    return ExchangeTransformation(core.init, core.update)


def dense_bytes(params: PyTree) -> int:
    """Bytes one worker sends per step when every leaf of ``params`` is all-reduced
    uncompressed in its own dtype (the baseline of :meth:`ExchangeTransformation.bytes_sent`)."""
    return sum(
        int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)
    )


def singleton_stores(
    params: PyTree, min_size: int, kind: str, dtype: Any = None
) -> list[stores.StorePlan]:
    """One ``kind`` store (``"none"`` or ``"leaf"``) per compressed leaf, labelled by path,
    its residual in ``dtype`` (``None``: the leaf's)."""
    groups = grouping_lib.resolve(params, grouping_lib.each_leaf(), min_size)
    return [
        stores.StorePlan(group=g, kind=kind, dtype=g.dtype if dtype is None else np.dtype(dtype))
        for g in groups
    ]


# ------------------------------------------------------------- state surgery (per worker)


def _is_exchange_state(x: Any) -> bool:
    return isinstance(x, ExchangeState)


def exchange_states(opt_state: PyTree) -> list[ExchangeState]:
    """Every :class:`ExchangeState` inside an optax state (chains, wrappers), in order."""
    return [
        x for x in jax.tree.leaves(opt_state, is_leaf=_is_exchange_state) if _is_exchange_state(x)
    ]


def store_residuals(state: ExchangeState, plan: ExchangePlan) -> dict[str, Any]:
    """``{group label: stored residual}`` of every store that keeps one.

    The state of a transform with ``layer_stacks`` keeps the stores of a run of slices
    together (:class:`~resireduce_jax.residual_stores.StoreBatch`); here each store's value
    is its own, as the same transform keeps it on the unstacked pytree. Arrays have a
    leading worker axis (a state gathered from the workers, or restored).
    """
    out = {}
    for p in plan.loose:
        value = state.residuals[p.group.label]
        like = jax.eval_shape(functools.partial(stores.init_store, p))
        _check_worker_axis(p.group.label, value, like)
        out[p.group.label] = value
    for batch in plan.batches:
        if batch.plan.kind == "none":
            continue
        value = state.residuals[batch.label]
        like = jax.eval_shape(functools.partial(stores.init_batch, batch))
        _check_worker_axis(batch.label, value, like)
        for n, store in enumerate(batch.stores):
            out[store.group.label] = jax.tree.map(lambda x, n=n: x[:, n], value)
    return out


def _check_worker_axis(label: str, value: Any, like: Any) -> None:
    """Raises unless every array of a stored residual is ``like`` behind a worker axis."""
    for x, want in zip(jax.tree.leaves(value), jax.tree.leaves(like), strict=True):
        if tuple(np.shape(x)[1:]) != tuple(want.shape):
            raise ValueError(
                f"The residual of store '{label}' has shape {tuple(np.shape(x))}, but a "
                f"worker's is {tuple(want.shape)} and the state must hold them on a leading "
                "worker axis, [workers, *shape]. A state built as shard_map(tx.init, "
                "out_specs=specs) puts the workers' residuals end to end instead: build it "
                "with resireduce_jax.parallel.init_state(tx, params, mesh) (or "
                "DataParallelStep.init), as docs/exchange.md, 'Your own shard_map step', shows."
            )


def _state_residuals(plan: ExchangePlan, values: dict[str, Any]) -> dict[str, Any]:
    """The state's residuals from every store's value (:func:`store_residuals` inverted)."""
    out = {p.group.label: values[p.group.label] for p in plan.loose}
    for batch in plan.batches:
        if batch.plan.kind != "none":
            parts = [values[p.group.label] for p in batch.stores]
            out[batch.label] = jax.tree.map(lambda *xs: np.stack(xs, axis=1), *parts)
    return out


def leaf_residuals(
    state: ExchangeState, plan: ExchangePlan, *, dense_only: bool = True
) -> dict[str, Any]:
    """``{unit path: residual}`` for units (leaves, or slices of layer stacks) whose
    residual is their own.

    With ``dense_only`` (default) only ``"leaf"`` stores (the unit's full residual, as in
    plain error feedback); otherwise intra-layer stores too, densified with zeros where
    nothing is kept. Shared group residuals belong to no single unit and are left out.
    Arrays keep their leading worker axis.
    """
    values = store_residuals(state, plan)
    out = {}
    for store in plan.kept:
        if store.shared or (dense_only and store.kind != "leaf"):
            continue
        value = values[store.group.label]
        if store.kind != "leaf":
            value = jax.vmap(functools.partial(stores.densify, store))(value)
        out[store.group.paths[0]] = value
    return out


def _node_residuals(store: stores.StorePlan, stored: Any) -> list[jax.Array]:
    """The residuals a saved store owes, one leaf-shaped array per old node (per old worker
    when the store is not sharded), in float32 or wider."""
    old_devices = jax.tree.leaves(stored)[0].shape[0]

    def device(d):
        dense = stores.densify(store, jax.tree.map(lambda x: x[d], stored))
        return np.asarray(dense, np.promote_types(dense.dtype, np.float32))

    shard = store.shard
    if shard is None:
        return [device(d) for d in range(old_devices)]
    nodes = []
    for n in range(old_devices // shard.count):
        parts = [device(n * shard.count + j) for j in range(shard.count)]
        nodes.append(np.concatenate(parts)[: shard.shape2d[0]].reshape(shard.leaf_shape))
    return nodes


def _store_residual(store: stores.StorePlan, mean: np.ndarray, num_workers: int) -> Any:
    """Every new device's stored residual for the owed ``mean`` (leading device axis)."""
    top = dataclasses.replace(store, selection="top")
    shard = store.shard
    if shard is None:
        kept = stores.compress_residual(top, mean, None) if store.kind in ("rows", "2d") else mean
        parts = [kept] * num_workers
    else:
        m = np.zeros((shard.rows * shard.count, shard.shape2d[1]), mean.dtype)
        m[: shard.shape2d[0]] = mean.reshape(shard.shape2d)
        whole = np.abs(m).sum(axis=0)  # norms of axis-1 indices: over the whole layer
        per_shard = []
        for j in range(shard.count):
            part = m[j * shard.rows : (j + 1) * shard.rows]
            if store.kind in ("rows", "2d"):
                local = np.abs(part).sum(axis=1)  # norms of the shard's own axis-0 indices
                rows, cols = (whole, local) if store.view.row_axis == 1 else (local, whole)
                norms = stores.DimensionNorms(rows, cols if store.kind == "2d" else None)
                part = stores.compress_residual(top, part, None, norms)
            per_shard.append(part)
        parts = [per_shard[d % shard.count] for d in range(num_workers)]

    def cast(x):  # values in the store's dtype; indices stay int32
        x = np.asarray(x)
        return x.astype(store.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    parts = [jax.tree.map(cast, p) for p in parts]
    return jax.tree.map(lambda *xs: np.stack(xs), *parts)


def resize_workers(
    state: ExchangeState,
    specs: ExchangeState,
    plan: ExchangePlan,
    num_workers: int,
    *,
    new_plan: ExchangePlan | None = None,
) -> ExchangeState:
    """An exchange state saved by ``W_old`` workers, as the state of ``num_workers`` workers.

    Per-worker arrays (``specs`` leaf ``!= P()``) have a leading old-worker axis. Each new
    worker gets the old workers' mean residual, so the update still owed, ``mean_w R_w``,
    is preserved: dense stores are averaged exactly; intra-layer stores are densified per
    old worker, averaged and re-selected (top rows/columns of the mean), losing what the
    mean keeps outside the new selection, as any step of ResiReduce-d/-2d does. Other
    per-worker floating state (compressor state) is averaged; replicated leaves are kept.

    Hierarchical exchanges (sharded stores) owe ``mean_n R_n`` over nodes, where node
    ``n``'s residual is its devices' shards put together; the mean is re-sharded for the
    new layout (``new_plan``), so a change of the devices per node ``L`` is covered too.

    Args:
      state: the restored state, as host (numpy) arrays.
      specs: its PartitionSpecs (:func:`resireduce_jax.parallel.state_partition_specs`).
      plan: the plan the state was saved with (``tx.plan(params, local_size=L_old)``).
      num_workers: the new number of workers (devices).
      new_plan: the plan of the new layout (``tx.plan(params, local_size=L_new)``);
        default ``plan``.

    Raises:
      ValueError: when per-worker compressor state is shaped by the shards and the shard
        layout changes, or cannot be averaged.
    """
    new_plan = new_plan or plan

    def repeat(x):
        x = np.asarray(x)
        return np.ascontiguousarray(np.broadcast_to(x, (num_workers, *x.shape)))

    saved = store_residuals(state, plan)
    values = {}
    for old, new in zip(plan.kept, new_plan.kept, strict=True):
        owed = _node_residuals(old, saved[old.group.label])
        mean = sum(owed) / len(owed)
        values[new.group.label] = _store_residual(new, mean, num_workers)
    residuals = _state_residuals(new_plan, values)

    relaid = any(a.shard != b.shard for a, b in zip(plan.stores, new_plan.stores, strict=True))

    def per_worker_mean(x, spec):
        if spec == P():
            return x
        x = np.asarray(x)
        if relaid:
            raise ValueError(
                "The compressor keeps per-worker state shaped by the residual shards, and the "
                "devices per node changed; restart with the saved local_devices or a "
                "stateless compressor."
            )
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(
                f"A per-worker compressor state leaf of dtype {x.dtype} cannot be averaged "
                "over workers; restart with the original number of workers."
            )
        return repeat(x.astype(np.promote_types(x.dtype, np.float32)).mean(0).astype(x.dtype))

    compressor_state = jax.tree.map(per_worker_mean, state.compressor_state, specs.compressor_state)
    return state._replace(residuals=residuals, compressor_state=compressor_state)
