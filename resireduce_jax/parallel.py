"""Data-parallel training steps under ``jax.shard_map``: mesh, state layout and the step.

Each worker computes its local gradient; the optax chain's exchange turns it into the mean.
Parameters are cast to varying before differentiating, so no dense all-reduce is hidden.
Per-worker state leaves (residuals) have a leading worker axis sharded on the data axis.
state_partition_specs finds them by tracing one abstract update.
On CPU the step bounds how many of its calls are queued, so collectives do not starve.
The layout rules: docs/design.md, "One training step", "Hidden dense all-reduce", "CPU
collectives and queued steps" and "The data-parallel step (parallel.py)".
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend.core import ClosedJaxpr
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from resireduce_jax._src import read_order, varying_dependence
from resireduce_jax.compressors.base import SummedGradientsError, varying_as
from resireduce_jax.nonfinite import SkipNonFiniteState, value_and_guarded_grad

PyTree = Any
AxisName = str | tuple[str, ...]

__all__ = [
    "BACKWARD_ORDERS",
    "CPU_STEPS_IN_FLIGHT",
    "LOCAL_AXIS",
    "WEIGHT_UPDATE_ORDERS",
    "DataParallelStep",
    "abstract_state",
    "data_parallel_step",
    "init_state",
    "make_mesh",
    "replicated",
    "shard_batch",
    "stack_per_worker",
    "state_partition_specs",
    "unstack_per_worker",
]


LOCAL_AXIS = "local"
"""Name of the mesh axis over one node's devices (:func:`make_mesh` with ``local_devices``)."""

WEIGHT_UPDATE_ORDERS = ("last_read", "all_gradients", "unordered")
"""Values of :func:`data_parallel_step`'s ``weight_update_order``."""

BACKWARD_ORDERS = ("streamed", "free")
"""Values of :func:`data_parallel_step`'s ``backward_order``."""

CPU_STEPS_IN_FLIGHT = 2
"""Calls of a CPU step queued at once by default: the next step is dispatched while the
previous one runs, never more (docs/design.md, "CPU collectives and queued steps")."""


def make_mesh(
    num_workers: int | None = None,
    axis_name: str = "data",
    local_devices: int | None = None,
) -> Mesh:
    """The data-parallel mesh: all workers on one axis, or nodes × devices per node.

    Args:
      num_workers: devices used (default: all devices, across all processes).
      axis_name: name of the (node) data axis.
      local_devices: ``L``, devices per node. ``None``: a 1-D mesh ``(num_workers,)``.
        Otherwise a 2-D mesh of shape ``(num_workers // L, L)`` with axes
        ``(axis_name, "local")`` for the hierarchical exchange (``local_axis="local"`` in
        the transforms): every row is one node, and with several processes every row's
        devices belong to one process (run one process per node).
    """
    devices = jax.devices()
    if num_workers is None:
        num_workers = len(devices)
    if not 1 <= num_workers <= len(devices):
        raise ValueError(
            f"num_workers={num_workers} but {len(devices)} devices are visible. On CPU, "
            "simulate more with resireduce_jax.runtime.configure_cpu(num_devices=N) at "
            "program start (or XLA_FLAGS=--xla_force_host_platform_device_count=N)."
        )
    if local_devices is None:
        return jax.make_mesh((num_workers,), (axis_name,), devices=devices[:num_workers])
    if isinstance(local_devices, bool) or not isinstance(local_devices, int) or local_devices < 1:
        raise ValueError(f"local_devices must be a positive int, got {local_devices!r}.")
    if num_workers % local_devices:
        raise ValueError(
            f"num_workers={num_workers} is not a multiple of local_devices={local_devices}: "
            "every node must have the same number of devices."
        )
    by_process = sorted(devices[:num_workers], key=lambda d: (d.process_index, d.id))
    grid = np.array(by_process, dtype=object).reshape(-1, local_devices)
    for row in grid:
        processes = {d.process_index for d in row}
        if len(processes) > 1:
            raise ValueError(
                f"local_devices={local_devices} puts devices of processes {sorted(processes)} "
                "on one node, but a node's devices must belong to one process (one process "
                "per node). Use local_devices <= the devices per process "
                f"({jax.local_device_count()} here) that divides it."
            )
    return Mesh(grid, (axis_name, LOCAL_AXIS), axis_types=(AxisType.Explicit,) * 2)


def replicated(tree: PyTree, mesh: Mesh) -> PyTree:
    """Copies every leaf of ``tree`` onto all devices of ``mesh`` (``P()``).

    The result never shares a buffer with ``tree``, so a step that donates it leaves the
    caller's arrays intact.
    """
    # device_put keeps the buffer of a leaf that already sits on one of the mesh's devices
    # (whatever its may_alias says), so jax.Array leaves are copied first.
    tree = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)
    return jax.device_put(tree, NamedSharding(mesh, P()))


def _axes(axis_name: AxisName) -> tuple[str, ...]:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def shard_batch(batch: PyTree, mesh: Mesh, axis_name: AxisName | None = None) -> PyTree:
    """Shards the leading (batch) axis of every leaf over ``axis_name`` (default: every
    axis of ``mesh``, nodes first: one shard per device).

    Single process: ``batch`` is the global batch (``workers * per_worker`` rows).
    Multi-process: ``batch`` is this process's part (its local workers' rows), assembled
    into a global array with ``jax.make_array_from_process_local_data``.
    """
    if axis_name is None:
        axis_name = tuple(mesh.axis_names) if len(mesh.axis_names) > 1 else mesh.axis_names[0]
    sharding = NamedSharding(mesh, P(axis_name))
    workers_here = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)

    def place(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.ndim == 0 or x.shape[0] % workers_here:
            raise ValueError(
                f"A batch leaf of shape {tuple(x.shape)} cannot be split over the "
                f"{workers_here} local workers: its leading axis must be a multiple of "
                "the number of workers. Change the batch size or the number of workers."
            )
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree.map(place, batch)


def _varies(aval: Any, axis_name: AxisName) -> bool:
    """Does a value of this abstract type vary over (any of) ``axis_name``?"""
    return any(a in aval.manual_axis_type.varying for a in _axes(axis_name))


def _varying_leaves(tree: PyTree, axis_name: AxisName) -> PyTree:
    """Per leaf: does its (abstract) value vary over (any of) ``axis_name``? Trace time only."""
    return jax.tree.map(lambda x: _varies(jax.typeof(x), axis_name), tree)


def _specs_from_flags(flags: PyTree, axis_name: AxisName) -> PyTree:
    return jax.tree.map(lambda v: P(axis_name) if v else P(), flags)


def stack_per_worker(tree: PyTree, specs: PyTree) -> PyTree:
    """Inside shard_map: adds the leading worker axis (size 1 locally) to per-worker leaves.

    A per-worker leaf that varies over only some of the worker axes (e.g. over nodes but
    not over a node's devices) is cast to varying over all of them first: every device
    keeps its own copy.

    The leaf passes through an ``optimization_barrier`` before the new axis is added, so
    XLA cannot fuse that reshape into the producer: a fusion whose result has another shape
    than the donated buffer it reads may not write into that buffer, and a new state
    computed elementwise from the old one (e.g. ``where(skip, R_old, R_new)``) would be
    computed elsewhere and copied back (see :func:`unstack_per_worker`).
    """

    def stack(x, spec):
        if spec == P():
            return x
        varying = jax.typeof(x).manual_axis_type.varying
        missing = tuple(a for a in _axes(spec[0]) if a not in varying)
        if varying and missing:
            x = lax.pcast(x, missing, to="varying")
        return lax.optimization_barrier(x)[None]

    return jax.tree.map(stack, tree, specs)


def unstack_per_worker(tree: PyTree, specs: PyTree) -> PyTree:
    """Inside shard_map: removes the local leading worker axis of per-worker leaves.

    Each squeezed leaf passes through an ``optimization_barrier``, which changes no value.
    Without it XLA fuses the squeeze (a bitcast) into the first consumer, e.g. the
    compensation ``G + R`` of error feedback; a fusion that reads a donated buffer through
    a bitcast may not write its result into that buffer, so the new residual is computed
    elsewhere and copied back at the end of the step: one residual-sized copy per leaf
    (measured: 22.5 MiB on ResNet-50 width 32, 88 MiB on the 6-block transformer of
    ``benchmarks/guard_cost.py``). Behind the barrier the consumer reads the donated buffer
    itself and updates it in place (docs/design.md, "Residuals at the compiled peak").
    """

    def unstack(x, spec):
        return x if spec == P() else lax.optimization_barrier(x[0])

    return jax.tree.map(unstack, tree, specs)


def state_partition_specs(
    tx: optax.GradientTransformation,
    params: PyTree,
    mesh: Mesh,
    axis_name: AxisName = "data",
) -> PyTree:
    """PartitionSpecs of ``tx``'s state for ``shard_map``: ``P(axis)`` for per-worker leaves.

    Traces (abstractly, nothing is computed or allocated) ``init`` and ``update`` with
    worker-local gradients inside ``shard_map``, the leaves found so far cast to varying,
    until the set of state leaves whose value varies over ``axis_name`` stops growing.
    Usually one trace settles it: when no other new state leaf depends on the ones it
    found (:func:`resireduce_jax._src.varying_dependence.reached_outputs` on the update's
    jaxpr), casting those to varying could not change the set. Those leaves hold
    per-worker data (residuals, per-worker compressor state) and get ``P(axis_name)`` with
    a leading worker axis in the global array; all others are replicated (``P()``).

    Args:
      tx: the optax transform (chain) used in the step.
      params: the parameters or their ``jax.ShapeDtypeStruct``s.
      mesh: the device mesh.
      axis_name: the data-parallel axis of ``mesh``, or all worker axes as a tuple
        (``("data", "local")`` for the hierarchical exchange): a leaf varying over any of
        them is per-device, ``P(("data", "local"))``.

    Returns:
      A pytree of ``PartitionSpec`` with the structure of ``tx.init(params)``.
    """
    abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    updates: list[ClosedJaxpr] = []

    def probe(params, flags):
        state = tx.init(params)
        state = jax.tree.map(
            lambda s, v: lax.pcast(s, axis_name, to="varying") if v else s, state, flags
        )
        grads = jax.tree.map(
            lambda p: lax.pcast(jnp.zeros_like(p), axis_name, to="varying"), params
        )
        # The update as a jaxpr of the state leaves (grads and params are its constants).
        updates.append(jax.make_jaxpr(lambda s: tx.update(grads, s, params)[1])(state))
        return jax.tree.map(lambda x: x[None], state)

    sharded = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(mesh, P())),
        abstract,
    )
    # init inside shard_map: a hierarchical exchange's plan reads the local axis size.
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P())
    flags, treedef = jax.tree.flatten(jax.tree.map(lambda _: False, jax.eval_shape(init, sharded)))
    axes = frozenset(_axes(axis_name))
    try:
        flags = _settle(probe, flags, treedef, sharded, mesh, axis_name, updates)
    except (TypeError, SummedGradientsError) as e:
        # A transform that feeds state to the exchange (optax.MultiSteps' accumulated
        # gradients), or a lax.cond that passes state through in one branch and updates it
        # in the other, fails to trace until the per-worker leaves are known. Find them by
        # dataflow on an unchecked trace, then check them.
        if isinstance(e, TypeError) and "branches must have equal output types" not in str(e):
            raise
        flags = _unchecked_per_worker(tx, sharded, mesh, axis_name, axes)
        flags = _settle(probe, flags, treedef, sharded, mesh, axis_name, updates)
    return _specs_from_flags(treedef.unflatten(flags), axis_name)


def _settle(probe, flags, treedef, sharded, mesh, axis_name, updates) -> list[bool]:
    """The fixed point of "per-worker iff its new value varies", from ``flags`` up."""
    axes = frozenset(_axes(axis_name))
    for _ in range(8):  # monotone: ends after at most (number of state leaves) rounds
        updates.clear()
        fn = jax.shard_map(
            functools.partial(probe, flags=treedef.unflatten(flags)),
            mesh=mesh,
            in_specs=P(),
            out_specs=P(axis_name),
        )
        jax.eval_shape(fn, sharded)
        (update,) = updates
        varying = [_varies(a, axis_name) for a in update.out_avals]
        new_flags = [a or b for a, b in zip(flags, varying, strict=True)]
        if new_flags == flags:
            break
        # Tracing again with the new per-worker leaves varying can only change the outputs
        # that depend on them; when all of those are per-worker already, it changes nothing.
        added = [new and not old for new, old in zip(new_flags, flags, strict=True)]
        reached = varying_dependence.reached_outputs(update.jaxpr, added, axes)
        flags = new_flags
        if not any(r and not f for r, f in zip(reached, flags, strict=True)):
            break
    return flags


def _unchecked_per_worker(tx, sharded, mesh, axis_name, axes) -> list[bool]:
    """Per-worker state leaves by dataflow from the local gradients, on one trace of the
    update under ``check_vma=False`` (no axis types, so no branch types to match)."""
    traced: list[ClosedJaxpr] = []

    def probe(params):
        state = tx.init(params)
        grads = jax.tree.map(jnp.zeros_like, params)
        traced.append(jax.make_jaxpr(lambda g, s: tx.update(g, s, params)[1])(grads, state))
        return jax.tree.map(lambda x: x[None], state)

    fn = jax.shard_map(probe, mesh=mesh, in_specs=P(), out_specs=P(axis_name), check_vma=False)
    jax.eval_shape(fn, sharded)
    (update,) = traced
    num_grads = len(jax.tree.leaves(sharded))
    flags = [False] * (len(update.jaxpr.invars) - num_grads)
    while True:  # monotone in the flags
        reached = varying_dependence.reached_outputs(
            update.jaxpr, [True] * num_grads + flags, axes, unchecked=True
        )
        grown = [a or b for a, b in zip(flags, reached, strict=True)]
        if grown == flags:
            return flags
        flags = grown


def abstract_state(
    tx: optax.GradientTransformation,
    params: PyTree,
    mesh: Mesh,
    axis_name: AxisName = "data",
) -> tuple[PyTree, PyTree]:
    """``(state specs, state)`` of ``tx`` for ``params`` with nothing allocated.

    The state is the global layout :meth:`DataParallelStep.init` produces (per-worker leaves
    with a leading worker axis), as ``jax.ShapeDtypeStruct``s carrying their shardings, so
    ``step.lower(params, state, ...)`` can compile a step for a model that would not fit.
    """
    specs = state_partition_specs(tx, params, mesh, axis_name)
    replicated = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(mesh, P())),
        params,
    )
    init = _stacked_init(tx, mesh, specs)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        jax.eval_shape(init, replicated),
        specs,
    )
    return specs, state


def init_state(
    tx: optax.GradientTransformation,
    params: PyTree,
    mesh: Mesh,
    axis_name: AxisName = "data",
) -> tuple[PyTree, PyTree]:
    """``(state specs, state)`` of ``tx`` for ``params``, for a step of your own.

    The state has the layout of :meth:`DataParallelStep.init`: per-worker leaves on a
    leading worker axis sharded over ``axis_name`` (``[workers, *shape]``), all others
    replicated. Pass the specs as the state's ``in_specs`` and ``out_specs`` of your
    ``shard_map`` step, and inside it remove and restore the worker axis with
    :func:`unstack_per_worker` and :func:`stack_per_worker` (docs/exchange.md, "Your own
    shard_map step"). :func:`resireduce_jax.exchange.leaf_residuals` and
    :func:`~resireduce_jax.exchange.resize_workers` read this layout.
    """
    specs = state_partition_specs(tx, params, mesh, axis_name)
    return specs, jax.jit(_stacked_init(tx, mesh, specs))(replicated(params, mesh))


def _stacked_init(tx: optax.GradientTransformation, mesh: Mesh, specs: PyTree) -> Callable:
    """``tx.init`` inside ``shard_map``, per-worker leaves given their worker axis."""
    return jax.shard_map(
        lambda p: stack_per_worker(tx.init(p), specs), mesh=mesh, in_specs=P(), out_specs=specs
    )


def _pmean_floats(tree: PyTree, axis_name: AxisName) -> PyTree:
    def mean(x):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return lax.pmean(x, axis_name)
        return lax.pmax(x, axis_name)  # integers (counters): equal on all workers anyway

    return jax.tree.map(mean, tree)


def _has_guard(state_specs: PyTree) -> bool:
    """Whether the optimizer state (or its specs) holds a ``skip_nonfinite`` state."""

    def is_guard(x):
        return isinstance(x, SkipNonFiniteState)

    return any(is_guard(x) for x in jax.tree.leaves(state_specs, is_leaf=is_guard))


def _assert_invariant(updates: PyTree, axis_name: AxisName) -> None:
    for path, flag in jax.tree_util.tree_flatten_with_path(_varying_leaves(updates, axis_name))[0]:
        if flag:
            name = jax.tree_util.keystr(path, simple=True, separator="/")
            raise ValueError(
                f"The update for '{name}' still differs between workers after the optax "
                "chain, so parameters would diverge. Put resireduce_jax.compressed_mean, "
                "error_feedback or resireduce FIRST in the chain: it turns local gradients "
                "into the global mean."
            )


def _accumulate(value_and_grad, params, model_state, batch, rng, *, steps, guarded, axis):
    """``value_and_grad(model_state, batch, rng)(params)``'s output, for the mean gradient
    of ``steps`` micro-batches.

    This worker's batch is split along its leading axis into ``steps`` equal micro-batches,
    whose gradients are summed in a ``lax.scan`` (in float32 at least) and averaged: one
    exchange follows for all of them. Model state threads through the micro-batches in
    order, the rng is folded with the micro-batch index, the loss and float metrics are
    averaged, and a guarded step's ``loss_ok`` holds for every micro-batch.
    """

    def split(x):
        rows = np.shape(x)[0] if np.ndim(x) else 0
        if rows == 0 or rows % steps:
            raise ValueError(
                f"accumulation_steps={steps}: a worker's batch leaf of shape {np.shape(x)} "
                f"cannot be split into {steps} equal micro-batches. Give each worker a "
                f"multiple of {steps} rows."
            )
        return x.reshape(steps, rows // steps, *np.shape(x)[1:])

    micro = jax.tree.map(split, batch)
    zeros = jax.tree.map(
        lambda p: varying_as(jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), p),
        params,
    )
    if model_state is not None:  # a worker's statistics differ from the others' in the loop
        model_state = jax.tree.map(
            lambda x: lax.pcast(x, axis, to="varying") if not _varies(jax.typeof(x), axis) else x,
            model_state,
        )

    def body(carry, xs):
        total, model_state, ok = carry
        mb, i = xs
        key = None if rng is None else jax.random.fold_in(rng, i)
        out = value_and_grad(model_state, mb, key)(params)
        (loss, (new_model_state, aux)), grads = out[:2]
        if guarded:
            ok = jnp.logical_and(ok, out[2])
        total = jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, grads)
        model_state = model_state if new_model_state is None else new_model_state
        return (total, model_state, ok), (loss, aux)

    init = (zeros, model_state, jnp.array(True))
    (total, model_state, ok), (losses, auxs) = lax.scan(body, init, (micro, jnp.arange(steps)))
    grads = jax.tree.map(lambda t, p: (t / steps).astype(p.dtype), total, params)

    def mean(x):
        return jnp.mean(x, axis=0) if jnp.issubdtype(x.dtype, jnp.inexact) else x[-1]

    head = (jnp.mean(losses), (model_state, jax.tree.map(mean, auxs)))
    return (head, grads, ok) if guarded else (head, grads)


@dataclasses.dataclass
class DataParallelStep:
    """A jitted, donated, ``shard_map``-ped train step and its state layout.

    Build it with :func:`data_parallel_step`. Call :meth:`init` once, then call the object.
    Argument order of a call: ``(params, opt_state[, model_state], batch[, rng])``;
    ``params``, ``opt_state`` and ``model_state`` are donated.

    A call returns as soon as its step is dispatched, unless ``max_steps_in_flight`` steps
    would then be queued: it first waits for the oldest queued step to finish (its
    metrics). ``max_steps_in_flight=None`` (default) is :data:`CPU_STEPS_IN_FLIGHT` on the
    CPU backend and unbounded elsewhere.
    :meth:`compile` compiles a phase's step ahead of its first call (for its memory
    figures); the calls then run that executable, so the program is compiled once.
    """

    loss_fn: Callable[..., Any]
    tx: optax.GradientTransformation
    mesh: Mesh
    axis_name: str = "data"
    local_axis: str | None = None
    has_aux: bool = False
    with_model_state: bool = False
    with_rng: bool = False
    donate: bool = True
    weight_update_order: str = "last_read"
    backward_order: str = "streamed"
    max_steps_in_flight: int | None = None
    accumulation_steps: int = 1
    state_specs: PyTree = None
    _init: Callable[..., Any] | None = dataclasses.field(default=None, repr=False)
    _steps: dict[int | None, Callable[..., Any]] = dataclasses.field(
        default_factory=dict, repr=False
    )
    _in_flight: collections.deque = dataclasses.field(default_factory=collections.deque, repr=False)
    _compiled: dict[int | None, jax.stages.Compiled] = dataclasses.field(
        default_factory=dict, repr=False
    )

    @property
    def worker_axes(self) -> AxisName:
        """The mesh axes the workers are mapped over: ``data`` (and ``local``)."""
        if self.local_axis is None:
            return self.axis_name
        return (self.axis_name, self.local_axis)

    @property
    def num_workers(self) -> int:
        """Devices that each compute a gradient (nodes × devices per node)."""
        return int(np.prod([self.mesh.shape[a] for a in _axes(self.worker_axes)]))

    def init(self, params: PyTree) -> tuple[PyTree, PyTree]:
        """Replicates ``params`` and builds the optimizer state inside ``shard_map``.

        ``params`` is copied, never consumed: the step donates the returned params, and the
        caller's arrays stay valid.

        Returns:
          ``(params, opt_state)`` as global arrays: params replicated; per-worker state
          leaves with a leading axis of size ``num_workers`` sharded over the data axis.
        """
        params = replicated(params, self.mesh)
        if self.state_specs is None:
            self.state_specs = state_partition_specs(self.tx, params, self.mesh, self.worker_axes)
        if self._init is None:
            self._init = jax.jit(_stacked_init(self.tx, self.mesh, self.state_specs))
        return params, self._init(params)

    def _build(self, density_phase: int | None = None) -> Callable[..., Any]:
        axis, specs = self.worker_axes, self.state_specs
        guarded = _has_guard(specs)
        # A static phase of the exchange's density schedule: one program per phase.
        phase = {} if density_phase is None else {"density_phase": density_phase}

        def train_step(params, opt_state, model_state, batch, rng):
            opt_state = unstack_per_worker(opt_state, specs)
            local_params = lax.pcast(params, axis, to="varying")
            if rng is not None:
                rng = jax.random.fold_in(rng, lax.axis_index(axis))

            def value_and_grad(model_state, batch, rng):
                def objective(p):
                    args = [p]
                    if self.with_model_state:
                        args.append(model_state)
                    args.append(batch)
                    if self.with_rng:
                        args.append(rng)
                    out = self.loss_fn(*args)
                    if not self.has_aux:
                        out = (out, {})
                    loss, aux = out
                    if self.with_model_state:
                        new_model_state, aux = aux
                    else:
                        new_model_state = None
                    return loss, (new_model_state, aux)

                if guarded:
                    # The guard's "loss" mode decides between the forward and the backward
                    # pass (docs/design.md, "The non-finite guard"); other modes ignore it.
                    return value_and_guarded_grad(objective, axis, has_aux=True)
                return jax.value_and_grad(objective, has_aux=True)

            partners = None
            if self.accumulation_steps > 1:
                micro = functools.partial(
                    _accumulate, steps=self.accumulation_steps, guarded=guarded, axis=axis
                )
                out = micro(value_and_grad, local_params, model_state, batch, rng)
            else:
                grad_fn = value_and_grad(model_state, batch, rng)
                streamed = self.backward_order == "streamed"
                if self.weight_update_order == "last_read" or streamed:
                    out, partners = read_order.call_with_read_partners(
                        grad_fn, local_params, lambda out: out[1], stream_backward=streamed
                    )
                    if self.weight_update_order != "last_read":
                        partners = None
                else:
                    out = grad_fn(local_params)
            if guarded:
                (loss, (new_model_state, aux)), grads, loss_ok = out
                updates, opt_state = self.tx.update(
                    grads, opt_state, params, loss_ok=loss_ok, **phase
                )
            else:
                (loss, (new_model_state, aux)), grads = out
                updates, opt_state = self.tx.update(grads, opt_state, params, **phase)
            _assert_invariant(updates, axis)
            # Write each new weight in place only once the backward pass has read the old
            # one (docs/design.md, "Residuals at the compiled peak"). The barriers are
            # identities.
            if partners is not None:
                params, updates = read_order.after_reads(params, updates, partners)
            elif self.weight_update_order == "all_gradients":
                params, updates = lax.optimization_barrier((params, updates))
            params = optax.apply_updates(params, updates)
            metrics = _pmean_floats({"loss": loss, **aux}, axis)
            if self.with_model_state:
                new_model_state = _pmean_floats(new_model_state, axis)
            return params, stack_per_worker(opt_state, specs), new_model_state, metrics

        batch_spec = P(axis)
        fn = jax.shard_map(
            train_step,
            mesh=self.mesh,
            in_specs=(P(), specs, P(), batch_spec, P()),
            out_specs=(P(), specs, P(), P()),
        )
        return jax.jit(fn, donate_argnums=(0, 1, 2) if self.donate else ())

    def lower(self, params, opt_state, *args, density_phase: int | None = None):
        """``jax.jit(...).lower`` of the step, for HLO and memory inspection."""
        return self._jitted(density_phase).lower(*self._full_args(params, opt_state, *args))

    def compile(
        self, params, opt_state, *args, density_phase: int | None = None
    ) -> jax.stages.Compiled:
        """Compiles the step of ``density_phase`` (see :meth:`__call__`) for these arguments
        and runs that executable in the phase's calls from then on.

        The arguments are a call's (arrays, or ``jax.ShapeDtypeStruct``s with the
        shardings the calls will have). The returned executable's ``memory_analysis()``
        describes the program the phase's calls run: nothing is compiled again.
        """
        compiled = self.lower(params, opt_state, *args, density_phase=density_phase).compile()
        self._compiled[density_phase] = compiled
        return compiled

    def _jitted(self, density_phase: int | None = None):
        if self.state_specs is None:
            raise ValueError("Call init(params) before the first step.")
        if density_phase not in self._steps:
            self._steps[density_phase] = self._build(density_phase)
        return self._steps[density_phase]

    def _full_args(self, params, opt_state, *args):
        expected = 1 + int(self.with_model_state) + int(self.with_rng)
        if len(args) != expected:
            names = ["model_state"] * self.with_model_state + ["batch"] + ["rng"] * self.with_rng
            raise TypeError(
                f"Expected (params, opt_state, {', '.join(names)}); got {len(args)} "
                "extra arguments."
            )
        args = list(args)
        model_state = args.pop(0) if self.with_model_state else None
        batch = args.pop(0)
        rng = args.pop(0) if self.with_rng else None
        return params, opt_state, model_state, batch, rng

    @property
    def steps_in_flight_limit(self) -> int | None:
        """The bound :meth:`__call__` keeps on queued steps (``None``: unbounded)."""
        if self.max_steps_in_flight is not None:
            return self.max_steps_in_flight
        return CPU_STEPS_IN_FLIGHT if self.mesh.devices.flat[0].platform == "cpu" else None

    def __call__(self, params, opt_state, *args, density_phase: int | None = None):
        """One step. Returns ``(params, opt_state[, model_state], metrics)``.

        ``density_phase``: a Python int, the phase of the exchange's density schedule this
        step is in (:func:`resireduce_jax.compressors.schedule.phase_at`); each phase is
        compiled once into its own program, with its own compiled peak. ``None``
        (default): one program that switches phases on the exchange's step count.
        """
        full = self._full_args(params, opt_state, *args)
        limit = self.steps_in_flight_limit
        if limit is not None:
            while len(self._in_flight) >= limit:
                jax.block_until_ready(self._in_flight.popleft())
        run = self._compiled.get(density_phase) or self._jitted(density_phase)
        params, opt_state, new_ms, metrics = run(*full)
        if limit is not None:
            self._in_flight.append(metrics)
        if self.with_model_state:
            return params, opt_state, new_ms, metrics
        return params, opt_state, metrics


def data_parallel_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis_name: str = "data",
    local_axis: str | None = None,
    has_aux: bool = False,
    with_model_state: bool = False,
    with_rng: bool = False,
    donate: bool = True,
    weight_update_order: str = "last_read",
    backward_order: str = "streamed",
    max_steps_in_flight: int | None = None,
    accumulation_steps: int = 1,
) -> DataParallelStep:
    """Builds the jitted, donated data-parallel train step over ``mesh``.

    The loss function sees one worker's shard of the batch. Its signature follows the
    flags: ``loss_fn(params[, model_state], batch[, rng])`` returning ``loss``, or
    ``(loss, aux)`` with ``has_aux``; with ``with_model_state`` the aux is
    ``(new_model_state, aux)`` (e.g. BatchNorm statistics, averaged over workers after the
    step like Flax's examples do). ``rng`` is a replicated key; each worker receives it
    folded with its worker index (dropout differs between workers).

    Metrics returned by the step: ``{"loss": ..., **aux}`` averaged over workers.

    Args:
      loss_fn: the per-worker loss.
      tx: an optax transform whose first element averages gradients over ``axis_name``.
      mesh: a mesh with the axis ``axis_name`` (see :func:`make_mesh`).
      axis_name: the data-parallel mesh axis.
      local_axis: the mesh axis of a node's devices (``make_mesh(local_devices=L)``):
        the batch, per-worker state and the non-finite decision span both axes; ``tx``
        must then be hierarchical (``local_axis=...`` in the transforms) or flat over both
        axes (``axis_name=("data", "local")``). Default: the mesh's axis named
        ``"local"`` if it has one.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      with_model_state: the step carries non-trainable model state.
      with_rng: the step takes a PRNG key.
      donate: donate params, optimizer state and model state to the step.
      weight_update_order: what orders the in-place write of each new weight after
        the reads of the old one (the forward pass, and ``dx = dy·Wᵀ`` in the backward
        pass); where XLA cannot prove that order from data dependencies it copies the
        weight. ``"last_read"`` (default): each weight waits for the update of the
        earliest gradient that depends on all its reads, found by a dataflow pass over
        the traced gradient computation (:mod:`resireduce_jax._src.read_order`); nothing is
        copied and gradients still stream. ``"all_gradients"``: every weight waits for
        every update, which holds every gradient alive until the last one exists.
        ``"unordered"``: no ordering; XLA copies the weights it cannot prove. Measured
        peaks: ``benchmarks/results/guard_cost.md``. A chain guarded in
        :func:`~resireduce_jax.skip_nonfinite`'s strict or lean mode orders every update
        after its decision anyway.
      backward_order: ``"streamed"`` (default): the backward pass waits for each weight
        gradient whose computation frees more than it holds (a layer's ``dW = xᵀ·dy``
        before the backward pass goes on from ``dy``), so that the gradients stream
        through the exchange whatever order XLA's scheduler would prefer
        (:mod:`resireduce_jax._src.backward_order`). ``"free"``: XLA's scheduler alone
        decides, and may run every weight gradient after the last layer's cotangent.
      max_steps_in_flight: at most this many calls of the step are queued at once; a call
        that would exceed it first waits for the oldest to finish. ``None`` (default):
        :data:`CPU_STEPS_IN_FLIGHT` (2) on the CPU backend, where more queued steps can
        starve a collective's rendezvous until it aborts the process (docs/design.md,
        "CPU collectives and queued steps"), and unbounded on GPU and TPU.
      accumulation_steps: ``k``, gradient accumulation: each call splits every worker's
        batch along its leading axis into ``k`` equal micro-batches, computes their
        gradients one after the other (a ``lax.scan``: the activations of one micro-batch
        at a time) and hands their mean to ``tx``: one exchange and one optimizer step
        per ``k`` micro-batches. Model state threads through the micro-batches, each gets
        its own rng (folded with its index), the metrics are their means, and a guarded
        step is skipped if any micro-batch's loss is non-finite. The gradients then exist
        only after the last micro-batch, so ``weight_update_order`` and
        ``backward_order`` have nothing to order and are ignored.

    With a guarded ``tx`` (a :class:`~resireduce_jax.SkipNonFiniteState` in its state) the
    step takes its gradients from :func:`~resireduce_jax.nonfinite.value_and_guarded_grad`
    and passes ``loss_ok`` to ``tx.update``: the guard's default ``"loss"`` mode decides
    before the backward pass.

    Returns:
      A :class:`DataParallelStep`.
    """
    if axis_name not in mesh.shape:
        raise ValueError(f"Mesh axes are {tuple(mesh.shape)}; axis_name '{axis_name}' is not one.")
    if local_axis is None and LOCAL_AXIS in mesh.shape and axis_name != LOCAL_AXIS:
        local_axis = LOCAL_AXIS
    if local_axis is not None and (local_axis not in mesh.shape or local_axis == axis_name):
        raise ValueError(
            f"Mesh axes are {tuple(mesh.shape)}; local_axis '{local_axis}' is not one other "
            f"than axis_name '{axis_name}'."
        )
    if weight_update_order not in WEIGHT_UPDATE_ORDERS:
        raise ValueError(
            f"weight_update_order={weight_update_order!r}: choose one of "
            f"{', '.join(map(repr, WEIGHT_UPDATE_ORDERS))}."
        )
    if backward_order not in BACKWARD_ORDERS:
        raise ValueError(
            f"backward_order={backward_order!r}: choose one of "
            f"{', '.join(map(repr, BACKWARD_ORDERS))}."
        )
    if max_steps_in_flight is not None and (
        isinstance(max_steps_in_flight, bool)
        or not isinstance(max_steps_in_flight, int)
        or max_steps_in_flight < 1
    ):
        raise ValueError(
            f"max_steps_in_flight={max_steps_in_flight!r}: give a positive int, or None for "
            "the backend's default."
        )
    if (
        isinstance(accumulation_steps, bool)
        or not isinstance(accumulation_steps, int | np.integer)
        or accumulation_steps < 1
    ):
        raise ValueError(
            f"accumulation_steps={accumulation_steps!r}: give a positive int, the number of "
            "micro-batches per exchange (1: no accumulation)."
        )
    workers = {axis_name, local_axis} - {None}
    if set(mesh.axis_names) != workers:
        raise ValueError(
            f"The mesh has axes {tuple(mesh.axis_names)} but the step maps workers over "
            f"{tuple(sorted(workers))}: every mesh axis must be a data-parallel axis. Build "
            "the mesh with resireduce_jax.parallel.make_mesh."
        )
    return DataParallelStep(
        loss_fn=loss_fn,
        tx=tx,
        mesh=mesh,
        axis_name=axis_name,
        local_axis=local_axis,
        has_aux=has_aux,
        with_model_state=with_model_state,
        with_rng=with_rng,
        donate=donate,
        weight_update_order=weight_update_order,
        backward_order=backward_order,
        max_steps_in_flight=max_steps_in_flight,
        accumulation_steps=int(accumulation_steps),
    )
