"""Shared test helpers: run a gradient transform on per-worker gradients.

``run_shard_map`` and ``run_pmap`` apply ``tx.update`` for several steps to gradients
given per worker (leading axis = worker), returning the per-step outputs and the final
state with a leading worker axis on every leaf, so tests can compare workers with each
other and with numpy references. ``step_memory`` compiles a data-parallel train step and
reads its peak-memory figures (``abstract_step_memory``: from shapes alone).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr

AXIS = "data"


def mesh(num_workers: int = 8):
    return rr.parallel.make_mesh(num_workers, AXIS)


def step_memory(
    loss_fn: Any, tx: optax.GradientTransformation, params: Any, batch: Any, mesh, **lower
) -> rr.hlo.PeakMemory:
    """The compiled peak-memory figures of ``rr.parallel.data_parallel_step(loss_fn, tx,
    mesh)`` on ``params`` and the sharded ``batch`` (``lower``: e.g. ``density_phase``);
    nothing runs."""
    step = rr.parallel.data_parallel_step(loss_fn, tx, mesh)
    p, s = step.init(params)
    return rr.hlo.peak_memory(step.lower(p, s, batch, **lower).compile())


def abstract_step_memory(
    loss_fn: Any, tx: optax.GradientTransformation, params: Any, batch: Any, mesh, **lower
) -> rr.hlo.PeakMemory:
    """:func:`step_memory` from ``jax.ShapeDtypeStruct`` s alone: ``params`` replicated,
    ``batch`` (global shapes) split over the workers (every axis of ``mesh``), the state
    abstract; nothing is allocated."""
    two_d = len(mesh.axis_names) > 1  # (nodes, local): workers span both axes
    local = {"local_axis": mesh.axis_names[1]} if two_d else {}
    step = rr.parallel.data_parallel_step(loss_fn, tx, mesh, **local)
    workers = tuple(mesh.axis_names) if two_d else AXIS
    step.state_specs, state = rr.parallel.abstract_state(tx, params, mesh, workers)

    def placed(tree, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
        )

    lowered = step.lower(placed(params, P()), state, placed(batch, P(workers)), **lower)
    return rr.hlo.peak_memory(lowered.compile())


class ShardMapStep:
    """``tx``'s init and one update under shard_map on ``on_mesh`` (default: a 1-D mesh of
    ``num_workers``), every state leaf per worker: ``init(params)`` and ``step(params,
    state, grads)``, jitted; grads and outputs have a leading worker axis."""

    def __init__(
        self,
        tx: optax.GradientTransformation,
        params: Any,
        num_workers: int = 8,
        *,
        on_mesh: Any = None,
    ):
        self.mesh = on_mesh if on_mesh is not None else mesh(num_workers)
        names = self.mesh.axis_names
        self.axes = tuple(names) if len(names) > 1 else names[0]
        self.specs = specs = rr.parallel.state_partition_specs(tx, params, self.mesh, self.axes)
        self.params = rr.parallel.replicated(params, self.mesh)

        def init(p):
            return rr.parallel.stack_per_worker(tx.init(p), specs)

        def step(p, s, g, density_phase):
            s = rr.parallel.unstack_per_worker(s, specs)
            phase = {} if density_phase is None else {"density_phase": density_phase}
            out, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p, **phase)
            # Every worker's view of the output and the state, stacked for inspection.
            return jax.tree.map(lambda x: x[None], out), rr.parallel.stack_per_worker(s, specs)

        self.init = jax.jit(jax.shard_map(init, mesh=self.mesh, in_specs=P(), out_specs=specs))
        self._step = step
        self._steps: dict[int | None, Any] = {}

    def step(self, params: Any, state: Any, grads: Any, density_phase: int | None = None):
        """One jitted update; ``density_phase``: the schedule's phase compiled statically
        (one program per phase, as the training program compiles), ``None``: switched."""
        if density_phase not in self._steps:
            self._steps[density_phase] = jax.jit(
                jax.shard_map(
                    functools.partial(self._step, density_phase=density_phase),
                    mesh=self.mesh,
                    in_specs=(P(), self.specs, P(self.axes)),
                    out_specs=(P(self.axes), self.specs),
                )
            )
        return self._steps[density_phase](params, state, grads)

    def shard_grads(self, grads: Any) -> Any:
        return jax.device_put(grads, NamedSharding(self.mesh, P(self.axes)))


def run_shard_map(
    tx: optax.GradientTransformation,
    params: Any,
    grads_per_step: list[Any],
    num_workers: int = 8,
    *,
    on_mesh: Any = None,
) -> tuple[list[Any], Any]:
    """Runs ``tx`` under shard_map. ``grads_per_step[t]`` leaves have a leading worker axis.

    ``on_mesh``: a mesh to run on instead of the 1-D mesh of ``num_workers`` (e.g. a 2-D
    ``(nodes, local)`` mesh; workers are then its devices in row-major order).

    Returns ``(outputs, state)``: ``outputs[t]`` leaves have a leading worker axis (each
    worker's copy of the update); ``state`` leaves have a leading worker axis (every leaf,
    replicated ones included, so workers can be compared).
    """
    run = ShardMapStep(tx, params, num_workers, on_mesh=on_mesh)
    state = run.init(run.params)
    outputs = []
    for grads in grads_per_step:
        out, state = run.step(run.params, state, run.shard_grads(grads))
        outputs.append(jax.device_get(out))
    return outputs, jax.device_get(_broadcast_replicated(state, run.specs, run.mesh.size))


def _broadcast_replicated(state, specs, num_workers):
    return jax.tree.map(
        lambda x, s: x if s != P() else jnp.broadcast_to(x, (num_workers, *jnp.shape(x))),
        state,
        specs,
    )


def run_pmap(
    tx: optax.GradientTransformation,
    params: Any,
    grads_per_step: list[Any],
    num_workers: int = 8,
) -> tuple[list[Any], Any]:
    """Same as :func:`run_shard_map` but with ``jax.pmap`` (every leaf per device)."""
    devices = jax.devices()[:num_workers]
    stacked_params = jax.tree.map(lambda p: np.broadcast_to(p, (num_workers, *p.shape)), params)
    state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(stacked_params)
    update = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name=AXIS, devices=devices)
    outputs = []
    for grads in grads_per_step:
        out, state = update(grads, state, stacked_params)
        outputs.append(jax.device_get(out))
    return outputs, jax.device_get(state)


def random_grads(
    rng: np.random.Generator,
    shapes: dict[str, tuple[int, ...]],
    workers: int,
    steps: int,
    dtype=np.float32,
) -> list[dict[str, np.ndarray]]:
    """``steps`` dicts of per-worker gradients (leading axis ``workers``), heavy-tailed."""
    return [
        {k: rng.standard_t(3, size=(workers, *s)).astype(dtype) for k, s in shapes.items()}
        for _ in range(steps)
    ]


def zero_params(shapes: dict[str, Any]) -> dict[str, Any]:
    """float32 zeros of the nested ``shapes`` (a dict whose leaves are shape tuples)."""
    return jax.tree.map(
        lambda s: np.zeros(s, np.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def random_grad_trees(rng: np.random.Generator, params: Any, workers: int, steps: int) -> list[Any]:
    """``steps`` float32 gradient trees like ``params`` with a leading axis ``workers``,
    heavy-tailed (Student t, 3 degrees of freedom), drawn leaf by leaf from ``rng``."""
    return [
        jax.tree.map(
            lambda p: rng.standard_t(3, size=(workers, *p.shape)).astype(np.float32), params
        )
        for _ in range(steps)
    ]


def np_topk_sparsify(x: np.ndarray, density: float) -> np.ndarray:
    """Independent numpy Top-k: keep the k = max(1, floor(density n)) largest |x|."""
    flat = x.ravel()
    k = max(1, int(np.floor(density * flat.size)))
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    out = np.zeros_like(flat)
    out[keep] = flat[keep]
    return out.reshape(x.shape)
