"""Shared test helpers: run a gradient transform on per-worker gradients.

``run_shard_map`` and ``run_pmap`` apply ``tx.update`` for several steps to gradients
given per worker (leading axis = worker), returning the per-step outputs and the final
state with a leading worker axis on every leaf, so tests can compare workers with each
other and with numpy references. ``step_memory`` compiles a data-parallel train step and
reads its peak-memory figures.
"""

from __future__ import annotations

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
    m = on_mesh if on_mesh is not None else mesh(num_workers)
    num_workers = m.size
    axes = tuple(m.axis_names) if len(m.axis_names) > 1 else m.axis_names[0]
    specs = rr.parallel.state_partition_specs(tx, params, m, axes)
    replicated_params = rr.parallel.replicated(params, m)

    def init(p):
        return rr.parallel.stack_per_worker(tx.init(p), specs)

    state = jax.jit(jax.shard_map(init, mesh=m, in_specs=P(), out_specs=specs))(replicated_params)

    def step(p, s, g):
        s = rr.parallel.unstack_per_worker(s, specs)
        g = jax.tree.map(lambda x: x[0], g)
        out, s = tx.update(g, s, p)
        # Every worker's view of the output and the state, stacked for inspection.
        return (
            jax.tree.map(lambda x: x[None], out),
            rr.parallel.stack_per_worker(s, specs),
        )

    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=m,
            in_specs=(P(), specs, P(axes)),
            out_specs=(P(axes), specs),
        )
    )
    outputs = []
    for grads in grads_per_step:
        grads = jax.device_put(grads, NamedSharding(m, P(axes)))
        out, state = fn(replicated_params, state, grads)
        outputs.append(jax.device_get(out))
    return outputs, jax.device_get(_broadcast_replicated(state, specs, num_workers))


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
