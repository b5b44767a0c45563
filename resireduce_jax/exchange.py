"""The gradient exchange: one optax transform behind every compressed-communication mode.

:func:`~resireduce_jax.compressed_mean`, :func:`~resireduce_jax.error_feedback` and
:func:`~resireduce_jax.resireduce` are views of one algorithm (Zheng et al., "Saving Memory
via Residual Reduction for DNN Training with Compressed Communication", §2.2 and §4; code:
https://github.com/YuchongHu/ResiReduce). Each compressed leaf is compensated with the
residual its store holds, compressed and exchanged; the store keeps what the payload
missed. Stores are objects (:mod:`~resireduce_jax.residual_stores`): the three passes here
(per leaf, whole-model Top-k, layer stacks) call their methods. Details: docs/design.md,
"Exchange core and the non-finite guard".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from resireduce_jax import layer_stacks as layer_stacks_lib
from resireduce_jax import residual_stores as stores
from resireduce_jax import traffic
from resireduce_jax._src import in_place
from resireduce_jax.compressors import schedule
from resireduce_jax.compressors.base import (
    Compressor,
    axis_size,
    check_axis_bound,
    check_local_gradients,
    dense_mean,
    ordered,
    ordered_keeping_axes,
)
from resireduce_jax.compressors.dense import is_dense
from resireduce_jax.compressors.sparse import TopK
from resireduce_jax.exchange_plan import ExchangePlan, StackPlan, dense_bytes, singleton_stores
from resireduce_jax.exchange_state import (
    ExchangeState,
    exchange_states,
    leaf_residuals,
    resize_workers,
    store_residuals,
)
from resireduce_jax.traffic import WireBytes
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
    "singleton_stores",
    "store_residuals",
]

DEFAULT_MIN_SIZE = 10_000
"""Leaves with fewer elements travel dense with no residual (the reference code's rule)."""

# Distinct stream for the keys of residual row/column sampling (vs. the compressor's keys).
_SELECTION_STREAM = 0x5E1EC7
_ROUNDING_STREAM = 0x20A11D  # and of the stochastic rounding of quantized residuals


class PhaseStates(NamedTuple):
    """A leaf's compressor state when the phases of its schedule keep differently shaped
    states (a dense warm-up before PowerSGD: none, then ``Q``): one state per phase, each
    carried unchanged through the other phases, so one program can switch between them.
    Phases that keep the same state share it instead (the sparsifiers' ``()``)."""

    phases: tuple[PyTree, ...]


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


def _rounding_key(seed: int, count, unit: int | jax.Array, axis_name: AxisName) -> jax.Array:
    """The key of a stored residual's stochastic rounding: per step, unit and worker."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed ^ _ROUNDING_STREAM), count)
    return jax.random.fold_in(jax.random.fold_in(key, unit), lax.axis_index(axis_name))


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


_where_skip = stores.where_skip


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
        return traffic.bytes_sent(self, params, steps, local_size)

    def wire_bytes(
        self, params: PyTree, steps: int, num_workers: int, *, local_size: int | None = None
    ) -> WireBytes:
        return traffic.wire_bytes(self, params, steps, num_workers, local_size)

    def crossover_workers(
        self, params: PyTree, steps: int, *, local_size: int | None = None
    ) -> int | None:
        return traffic.crossover_workers(self, params, steps, local_size)

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
            if batch.plan.keeps_residual:
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
        carry: stores.Carry | None = None,
        **extra_args,
    ):
        """One exchange. ``skip``: optional boolean scalar, equal on every worker.

        ``carry``: the stores of ``carry.leaves`` keep the exchange's output carried into
        their residual (:class:`~resireduce_jax.residual_stores.Carry`, the one-buffer
        compressed momentum); only stores that can carry accept it (``ValueError``).

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
        if carry is not None:
            _check_carry(self.name, plan, carry, self.selection_scope)
        units = plan.layout.units
        leaves, treedef = jax.tree.flatten(updates)
        cstates = treedef.flatten_up_to(state.compressor_state)
        # Units that are whole leaves (a shard of their node's mean where the store is
        # sharded); the slices of layer stacks are exchanged together, stack by stack.
        arrays = {
            i: leaves[u.leaf]
            if plan.store_shard(i) is None
            else _node_mean_shard(plan.store_shard(i), leaves[u.leaf])
            for i, u in enumerate(units)
            if u.index is None
        }
        step = _Step(
            exchange=self,
            plan=plan,
            count=state.count,
            skip=skip,
            static=schedule.static_phase_index(self.phases, density_phase),
            phase=schedule.phase_index([p.start for p in self.phases], state.count),
            # Payloads cross the data axis only when leaves are sharded over a local axis;
            # otherwise (no local axis, or one of size 1) they cross every worker axis.
            payload_axes=self.axis_name if local_size > 1 else self.worker_axes,
            zero_stores=self._zero_stores(density_phase),
            carry=carry,
        )
        sent, residuals, partial_sums = _stacks_pass(step, leaves, cstates, state.residuals)
        if self.selection_scope == "global" and plan.stores:
            means, kept = _global_pass(step, arrays, state.residuals)
            sent.update({j: _Sent(mean, cstates[j]) for j, mean in means.items()})
            residuals.update(kept)
        elif self.selection_scope == "leaf":
            leaf = _leaf_pass(step, arrays, cstates, state.residuals, partial_sums)
            sent.update(leaf.sent)
            residuals.update(leaf.residuals)
            for label, residual in leaf.late.items():  # shared groups keep theirs on a skip
                residuals[label] = _where_skip(skip, state.residuals[label], residual)
        for i in plan.dense:  # small leaves: plain all-reduce, no residual
            if units[i].index is None:
                mean = dense_mean(arrays[i], self.worker_axes)
                j = units[i].leaf
                sent[j] = _Sent(_where_skip(skip, jnp.zeros((), mean.dtype), mean), cstates[j])
        count = optax.safe_int32_increment(state.count)
        new_state = ExchangeState(
            count=_where_skip(skip, state.count, count),
            residuals=residuals,
            compressor_state=treedef.unflatten(
                [sent[j].cstate if j in sent else c for j, c in enumerate(cstates)]
            ),
        )
        return treedef.unflatten([sent[j].mean for j in range(len(leaves))]), new_state

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


class _Sent(NamedTuple):
    """What the exchange gives back for one leaf: its mean and its compressor state, both
    as they are after a skipped step where ``skip`` holds; ``local``: the mean in the
    store's coordinates (a shard's), before a skip zeroes it (what a :class:`Carry` adds)."""

    mean: jax.Array
    cstate: Any
    local: jax.Array | None = None


def _check_carry(name: str, plan: ExchangePlan, carry: stores.Carry, scope: str) -> None:
    """A :class:`~resireduce_jax.residual_stores.Carry` names leaves whose stores all carry."""
    refused = sorted(carry.leaves - plan.carriable_leaves)
    if scope != "leaf" or refused:
        kinds = sorted(
            {type(p).__name__ for p in plan.stores if not p.carries}
            | ({"dense leaves"} if plan.dense else set())
        )
        found = f"selection_scope={scope!r}" if scope != "leaf" else f"leaves {refused}"
        raise ValueError(
            f"{name}: the one-buffer momentum lives in a leaf's own residual store (kind "
            f"'leaf': error_feedback, or resireduce's singleton groups without intra-layer "
            f"storage, selection_scope='leaf'); {found} are kept otherwise (this plan also "
            f"has {kinds}). Use one_buffer=False (two buffers) for such stores."
        )


def _held(hold: Any, held: Any, value: Any) -> Any:
    """``held`` where ``hold`` (a Python or traced bool), else ``value``; leafwise."""
    if isinstance(hold, bool):
        return held if hold else value
    return jax.tree.map(lambda a, b: jnp.where(hold, a, b), held, value)


@dataclasses.dataclass(frozen=True)
class _Step:
    """What every pass of one exchange needs: the exchange and its plan, the count, the skip flag,
    the density phase (a static index, or a traced one to switch on), the axes payloads
    cross, and whether this program keeps the stores at zero (:meth:`_Exchange._zero_stores`)."""

    exchange: _Exchange
    plan: ExchangePlan
    count: jax.Array
    skip: jax.Array | None
    static: int | None
    phase: jax.Array
    payload_axes: AxisName
    zero_stores: bool
    carry: stores.Carry | None = None

    def carried(self, leaf: int) -> bool:
        """Whether ``leaf``'s stores carry its momentum (:class:`~resireduce_jax.
        residual_stores.Carry`)."""
        return self.carry is not None and leaf in self.carry.leaves

    def reduce(self, reduce_with: Callable[..., tuple], x: jax.Array, cstate: Any) -> tuple:
        """``reduce_with(compressor, x, cstate)`` in this step's density phase."""
        return self.exchange._reduce_in_phase(reduce_with, x, cstate, self.static, self.phase)

    def selection_key(
        self, unit: int | jax.Array, store: stores.StorePlan, purpose: str = "selection"
    ) -> jax.Array | None:
        """The key of an intra-layer store's sampled selection for ``unit``, or with
        ``purpose="rounding"`` of its format's stochastic rounding (seed, count, unit and
        worker folded in, so a resumed run draws the same bits)."""
        exchange = self.exchange
        if purpose == "rounding":
            return _rounding_key(exchange.seed, self.count, unit, exchange.worker_axes)
        return _selection_key(exchange.seed, self.count, unit, exchange.worker_axes, store)

    def send(self, unit: int, x: jax.Array, cstate: Any, residual_skip: jax.Array | None):
        """Exchanges unit ``unit``'s compensated ``x``: ``(this worker's residual, _Sent)``."""
        shard = self.plan.store_shard(unit)

        def reduce_with(compressor: Compressor, x, cstate) -> tuple[Any, Any, Any]:
            key = self._key(unit, compressor)
            reduced = compressor.reduce(x, cstate, key, self.payload_axes, skip=residual_skip)
            return reduced.mean, reduced.residual, reduced.state

        local, residual, new_cstate = self.reduce(reduce_with, x, cstate)
        mean = local if shard is None else _gather_shards(shard, local)
        mean = _where_skip(self.skip, jnp.zeros((), mean.dtype), mean)
        return residual, _Sent(mean, _where_skip(self.skip, cstate, new_cstate), local)

    def _key(self, unit: int, compressor: Compressor) -> jax.Array | None:
        """The compressor's key for ``unit`` this step (:func:`leaf_key`)."""
        shard = self.plan.store_shard(unit)
        return leaf_key(
            self.exchange.seed,
            self.count,
            unit,
            compressor,
            self.payload_axes,
            shard and shard.axis_name,
        )

    def carries_in_place(self, unit: int) -> bool:
        """Whether unit ``unit``'s carried store takes the exchange's mean into its own
        buffer (:meth:`send_carried`): a flat store in a program of one density phase.
        A node's shard (hierarchical) need not: its temporaries are ``1/L`` of the leaf,
        and the guarded step's peak gets the whole saving without (test_one_buffer_peak)."""
        return self.static is not None and self.plan.store_shard(unit) is None

    def send_carried(
        self, unit: int, x: jax.Array, cstate: Any, residual_skip: jax.Array | None
    ) -> tuple[jax.Array, Callable[[Any], tuple[_Sent, Any]]]:
        """:meth:`send` for a carried store (:meth:`carries_in_place`): ``(factor * mean +
        residual, sent)``, where ``sent(kept) -> (_Sent, kept)`` takes the mean once ``kept``
        (the stored value, returned to be used in its place) is made, so the residual's
        buffer and the mean's are not alive together."""
        compressor = self.exchange.phases[self.static].compressor

        def reduce_with(compressor: Compressor, x, cstate) -> tuple[Any, Any, Any]:
            key = self._key(unit, compressor)
            reduced = compressor.reduce_carried(
                x, cstate, key, self.payload_axes, self.carry.factor, skip=residual_skip
            )
            return reduced.payload, reduced.residual, reduced.state

        payload, kept_value, new_cstate = self.exchange._phase_reduce(self.static, reduce_with)(
            x, cstate
        )

        def sent(kept: Any) -> tuple[_Sent, Any]:
            gathered, kept = ordered_keeping_axes(payload, kept)
            like = jax.ShapeDtypeStruct(x.shape, x.dtype)
            mean = compressor.aggregate(gathered, like, self.payload_axes)
            mean = _where_skip(self.skip, jnp.zeros((), mean.dtype), mean)
            return _Sent(mean, _where_skip(self.skip, cstate, new_cstate), mean), kept

        return kept_value, sent


class _LeafPass(NamedTuple):
    """The per-leaf pass's results: what was sent per leaf, the new stored residuals, and
    the shared groups' residuals before a skip keeps the old ones (``late``)."""

    sent: dict[int, _Sent]
    residuals: dict[str, Any]
    late: dict[str, jax.Array]


def _leaf_pass(
    step: _Step,
    arrays: dict[int, jax.Array],
    cstates: list[Any],
    residuals: dict[str, Any],
    partial_sums: dict[str, list[stores.WeightedSum]],
) -> _LeafPass:
    """Every store in no layer-stack batch, store by store (``selection_scope="leaf"``):
    compensate, read what the store needs of ``G~``, send, keep what was not sent."""
    plan, skip = step.plan, step.skip
    units = plan.layout.units
    batched = {p.group.label for b in plan.batches for p in b.stores}
    sent: dict[int, _Sent] = {}
    kept: dict[str, Any] = {}
    late: dict[str, jax.Array] = {}
    for store in plan.stores:
        label = store.group.label
        if label in batched:
            continue
        stored = residuals.get(label)
        if step.zero_stores and store.keeps_residual and not store.own_residual:
            for i in store.group.members:  # slices of stacks were sent with them
                if i in arrays:
                    j = units[i].leaf
                    _, sent[j] = step.send(i, arrays[i], cstates[j], None)
            kept[label] = stored  # zeros, kept as they are
            continue
        if store.shared:
            late[label], members = _shared_members(
                step, store, stored, arrays, cstates, partial_sums.get(label, ())
            )
            sent.update(members)
            continue
        (i,) = store.group.members
        j = units[i].leaf
        hold = step.carried(j) and step.carry.hold
        if store.keeps_residual and hold is not True:  # a carried store held: as it is
            x = _held(hold, arrays[i], store.compensate(stored, arrays[i]))
        else:
            x = arrays[i]
        x, read = store.read_compensated(x, ordered_reads=True)
        if step.carried(j) and hold is False and step.carries_in_place(i):
            w, sent_after = step.send_carried(i, x, cstates[j], store.residual_skip(skip))
            key = functools.partial(step.selection_key, i, store)
            new = store.finish(w, stored, read, key, skip)
            if skip is not None:  # skipped: the value as it was
                new = _held(skip, stored, new)
            sent[j], kept[label] = sent_after(new)
            continue
        r, sent[j] = step.send(i, x, cstates[j], store.residual_skip(skip))
        if hold is True:
            kept[label] = stored
        elif store.keeps_residual:
            key = functools.partial(step.selection_key, i, store)
            if step.carried(j):
                r = store.carry(r, sent[j].local, step.carry.factor)
            kept[label] = store.finish(r, stored, read, key, skip)
            if step.carried(j):  # held, or skipped: the value as it was
                kept[label] = _held(_or(hold, skip), stored, kept[label])
    return _LeafPass(sent, kept, late)


def _or(hold: Any, skip: jax.Array | None) -> Any:
    """``hold or skip`` (``skip``: ``None`` for no skip flag)."""
    if skip is None:
        return hold
    return skip if hold is False else jnp.logical_or(hold, skip)


def _shared_members(step, store, stored, arrays, cstates, partial_sums=()):
    """One step of a shared group (§4.2): members one by one, running weighted sum.

    Each member starts after the previous one was added to the sum, so one running sum
    and one member's transient residual are alive at a time. The members go from the last
    layer to the first, the order in which the backward pass produces their gradients
    (docs/design.md, "Residuals at the compiled peak"). Members that are slices of layer
    stacks were exchanged with their stacks and come in as ``partial_sums``. Returns the
    group's new residual and what was sent for each member's leaf.
    """
    units = step.plan.layout.units
    sent: dict[int, _Sent] = {}
    acc = None
    for part in partial_sums:
        acc = part if acc is None else acc.merge(part)
    for i in reversed(store.group.members):
        if i not in arrays:  # a slice: in partial_sums
            continue
        g = arrays[i]
        if acc is not None:
            g, acc = ordered(g, acc)
        compensated = store.compensate(stored, g)
        compensated, read = store.read_compensated(compensated, ordered_reads=True)
        j = units[i].leaf
        r, sent[j] = step.send(i, compensated, cstates[j], None)
        weight = store.member_weight(r, read)
        acc = stores.WeightedSum.first(r, weight) if acc is None else acc.add(r, weight)
    key = functools.partial(step.selection_key, store.group.members[0], store)
    return acc.finish(store, key), sent


def _global_pass(
    step: _Step, arrays: dict[int, jax.Array], residuals: dict[str, Any]
) -> tuple[dict[int, jax.Array], dict[str, Any]]:
    """Every store at once (``selection_scope="global"``): each member compensated with
    its store's residual, then a Top-k phase selects over all of them
    (:meth:`TopK.reduce_jointly`) and any other phase reduces member by member. Each store
    then keeps what its members did not send, as the per-leaf pass does. Returns the
    leaves' means and the new stored residuals."""
    plan, skip, zero_stores = step.plan, step.skip, step.zero_stores
    units = plan.layout.units
    # A group's members last to first, as the per-leaf pass adds them (§4.2's sum).
    members = [(store, i) for store in plan.stores for i in reversed(store.group.members)]
    compensated: list[jax.Array] = []
    reads: dict[int, Any] = {}  # what each member's store read of G~
    for store, i in members:
        if not store.keeps_residual or (zero_stores and not store.own_residual):
            compensated.append(arrays[i])
            continue
        x = store.compensate(residuals[store.group.label], arrays[i])
        x, reads[i] = store.read_compensated(x, ordered_reads=False)
        compensated.append(x)
    means_of, fresh = _reduce_jointly(step, tuple(compensated))
    means: dict[int, jax.Array] = {}
    kept: dict[str, Any] = {}
    sums: dict[str, stores.WeightedSum] = {}
    for (store, i), mean, r in zip(members, means_of, fresh, strict=True):
        means[units[i].leaf] = _where_skip(skip, jnp.zeros((), mean.dtype), mean)
        label, stored = store.group.label, residuals.get(store.group.label)
        if not store.keeps_residual:
            continue
        if zero_stores and not store.own_residual:
            kept[label] = stored  # zeros, kept as they are
        elif store.shared:
            weight = store.member_weight(r, reads.get(i))
            acc = sums.get(label)
            sums[label] = stores.WeightedSum.first(r, weight) if acc is None else acc.add(r, weight)
        else:  # a skipped step's own residual is G~ (nothing was sent)
            key = functools.partial(step.selection_key, i, store)
            kept[label] = store.finish(r, stored, reads.get(i), key, skip)
    for store in plan.stores:
        label = store.group.label
        if label in sums:
            key = functools.partial(step.selection_key, store.group.members[0], store)
            kept[label] = _where_skip(skip, residuals[label], sums[label].finish(store, key))
    return means, kept


def _reduce_jointly(step: _Step, xs: tuple[jax.Array, ...]) -> tuple[tuple, tuple]:
    """The means and fresh residuals of the compensated ``xs`` in this step's phase: one
    selection over all of them in a Top-k phase, member by member in any other."""
    exchange, skip = step.exchange, step.skip

    def branch(k: int) -> Callable[[tuple], tuple]:
        compressor = exchange.phases[k].compressor

        def run(xs: tuple) -> tuple:
            if isinstance(compressor, TopK):
                return compressor.reduce_jointly(xs, step.payload_axes, skip)
            reduced = [compressor.reduce(x, (), None, step.payload_axes, skip=skip) for x in xs]
            return tuple(r.mean for r in reduced), tuple(r.residual for r in reduced)

        return run

    if step.static is not None:
        return branch(step.static)(xs)
    return lax.switch(step.phase, [branch(k) for k in range(len(exchange.phases))], xs)


class _StackPass(NamedTuple):
    """One layer stack's results: what was sent for its leaf, its batches' new stored
    residuals, and the partial sums its slices leave for loose shared groups."""

    sent: _Sent
    residuals: dict[str, Any]
    partial_sums: dict[str, list[stores.WeightedSum]]


def _stacks_pass(step: _Step, leaves: list, cstates: list, residuals: dict[str, Any]):
    """:func:`_stack_pass` for every layer stack: what was sent per stacked leaf, the
    batches' new residuals, and the partial sums left for loose shared groups."""
    sent: dict[int, _Sent] = {}
    kept: dict[str, Any] = {}
    partial_sums: dict[str, list[stores.WeightedSum]] = {}
    for stack_plan in step.plan.stack_plans:
        j = stack_plan.stack.leaf
        stack = _stack_pass(step, stack_plan, leaves[j], cstates[j], residuals)
        sent[j] = stack.sent
        kept.update(stack.residuals)
        for label, sums in stack.partial_sums.items():
            partial_sums.setdefault(label, []).extend(sums)
    return sent, kept, partial_sums


def _stack_pass(
    step: _Step, stack_plan: StackPlan, g: jax.Array, cstate: PyTree, residuals: dict[str, Any]
) -> _StackPass:
    """One step of a layer stack: every slice a layer, all slices at once.

    The stack is seen slice-major (``[layers, *slice]``); each slice is compensated with
    its store's residual (a batch's slice range, read in place), the compressor runs over
    the slices vectorised (``jax.vmap``: a batched Top-k, one exchange), and every batch's
    residuals are rebuilt from its slice range of the fresh residuals. In a leading dense
    phase (:meth:`_Exchange._zero_stores`) a stack whose slices keep no residual of their
    own is sent as it is and its stores kept.
    """
    exchange, skip = step.exchange, step.skip
    stack, shard = stack_plan.stack, stack_plan.shard
    zero = jnp.zeros((), g.dtype)
    if stack_plan.dense:
        mean = dense_mean(g, exchange.worker_axes)
        return _StackPass(_Sent(_where_skip(skip, zero, mean), cstate), {}, {})
    ranges = _ranges(stack_plan)
    hold = step.carried(stack.leaf) and step.carry.hold
    as_is = hold is True or (
        step.zero_stores and not any(plan.own_residual for plan, _, _ in ranges)
    )
    x = jnp.moveaxis(g, stack.axis, 0)
    if shard is not None:
        x = jax.vmap(functools.partial(_node_mean_shard, shard))(x)
    reads: dict[int, Any] = {}  # what each range's store reads of G~ before it is consumed
    if not as_is:
        x = _held(hold, x, _compensate_stack(stack_plan, residuals, x))
        for n, (plan, start, stop) in enumerate(ranges):
            x, reads[n] = plan.read_slices(x, start, stop)

    units = jnp.asarray(stack.units, jnp.int32)

    def reduce_with(compressor: Compressor, x, cstate) -> tuple[Any, Any, Any]:
        keys = None
        if compressor.randomness != "none":  # each slice's key is its unit's
            shard_axis = shard and shard.axis_name
            keys = jax.vmap(
                lambda i: leaf_key(
                    exchange.seed, step.count, i, compressor, step.payload_axes, shard_axis
                )
            )(units)
        reduced = compressor.reduce_slices(
            x, cstate, keys, step.payload_axes, _residual_skip(stack_plan, skip)
        )
        return reduced.mean, reduced.residual, reduced.state

    local, residual, new_cstate = step.reduce(reduce_with, x, cstate)
    mean = local
    if shard is not None:
        mean = jax.vmap(functools.partial(_gather_shards, shard))(mean)
    mean = jnp.moveaxis(mean, 0, stack.axis)
    if as_is:  # zeros or held, kept as they are (a loose group's are kept with the group)
        kept = {batch.label: residuals.get(batch.label) for batch in stack_plan.batches}
        partial_sums = {}
    else:
        carried = step.carried(stack.leaf)
        kept, partial_sums = _rebuild_stores(
            step, stack_plan, residual, reads, residuals, local if carried else None
        )
        if carried:  # held, or skipped: the values as they were
            for label in kept:
                kept[label] = _held(_or(hold, skip), residuals[label], kept[label])
    sent = _Sent(_where_skip(skip, zero, mean), _where_skip(skip, cstate, new_cstate))
    return _StackPass(sent, kept, partial_sums)


def _rebuild_stores(step, stack_plan, r, reads, residuals, local=None):
    """Every batch's new residuals from its slice range of the stack's fresh residuals
    ``r``, and the loose pieces' partial sums for their groups. ``reads``: what each
    range's store read of ``G~``; ``local``: the slice-major mean that carrying batches
    add (:class:`~resireduce_jax.residual_stores.Carry`), or ``None``."""
    units = jnp.asarray(stack_plan.stack.units, jnp.int32)
    kept: dict[str, Any] = {}
    partial_sums: dict[str, list[stores.WeightedSum]] = {}
    for n, (plan, start, stop) in enumerate(_ranges(stack_plan)):
        part = r[start:stop]
        if n >= len(stack_plan.batches):  # a loose group's slices: a partial sum
            weights = reads.get(n)
            weights = plan.slice_weights(part) if weights is None else weights
            partial = stores.WeightedSum.of_slices(part, weights)
            partial_sums.setdefault(plan.group.label, []).append(partial)
            continue
        batch = stack_plan.batches[n]
        if not plan.keeps_residual:
            continue

        def keys(purpose="selection", plan=plan, units=units[start:stop]):
            return jax.vmap(lambda i: step.selection_key(i, plan, purpose))(units)

        stored = residuals.get(batch.label)
        if local is not None:
            part = plan.carry(part, local[start:stop], step.carry.factor)
        kept[batch.label] = plan.finish_slices(part, reads.get(n), batch, stored, keys, step.skip)
    return kept, partial_sums


def _residual_skip(stack_plan: StackPlan, skip: jax.Array | None) -> jax.Array | None:
    """The skip hook's argument for a stack: ``skip`` for the slices that keep their own
    residual (a scalar when all do, one flag per slice when some do), ``None`` if none."""
    own = np.zeros(stack_plan.stack.size, bool)
    for batch in stack_plan.batches:
        own[batch.start : batch.stop] = batch.plan.own_residual
    if skip is None or not own.any():
        return None
    return skip if own.all() else jnp.logical_and(skip, jnp.asarray(own))


def _ranges(stack_plan: StackPlan) -> list[tuple[stores.StorePlan, int, int]]:
    """``(store plan, start, stop)`` of every batch, then of every loose piece."""
    batches = [(b.plan, b.start, b.stop) for b in stack_plan.batches]
    return batches + list(stack_plan.pieces)


def _compensate_stack(stack_plan: StackPlan, residuals: dict[str, Any], x: jax.Array) -> jax.Array:
    """``G~ = G + R`` for every slice of a slice-major stack ``x``, with its store's ``R``.

    A stack that is one plain error-feedback batch is compensated into its donated
    residual, as a leaf's own residual is; otherwise every slice range gets its residuals
    added in ``x``'s own buffer (:func:`resireduce_jax._src.in_place.add_slices`).
    """
    batches = stack_plan.batches
    if (
        len(batches) == 1
        and not stack_plan.pieces
        and batches[0].plan.own_residual
        and not batches[0].plan.quantized
        and (batches[0].start, batches[0].stop) == (0, x.shape[0])
    ):
        return x + residuals[batches[0].label].astype(x.dtype)
    for batch in batches:
        x = batch.plan.compensate_slices(x, residuals.get(batch.label), batch)
    for plan, start, stop in stack_plan.pieces:
        stored = plan.stacked_values(
            jax.tree.map(lambda v: v[None], residuals[plan.group.label]), x.dtype
        )
        x = in_place.add_slices(x, stored, start, np.zeros(stop - start, np.int32))
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
      local_axis: the axis of a node's devices for the hierarchical exchange
        (docs/design.md, "Hierarchical exchange"), or ``None`` (flat).
      layer_stacks: ``{regex: axis}``: the leaves that stack a weight of every layer, and
        their layer axis (:mod:`resireduce_jax.layer_stacks`); ``planner`` then sees the
        unstacked pytree (every slice a leaf at its slice path).
      selection_scope: ``"leaf"``: a sparsifier sends its density of each leaf;
        ``"global"``: a Top-k phase sends its density of all compressed leaves together
        (docs/design.md, "Whole-model Top-k"; singleton stores of one dtype, flat, no
        layer stacks; every phase of the compressor Top-k or dense).

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
