"""The exchange's state, and the per-worker surgery a training program needs.

Every exchange transform keeps an :class:`ExchangeState`. This module finds those states
inside an optax state, reads per-unit residuals out of them, and turns a checkpoint of
one number of workers into one for another. Stored arrays carry a leading worker axis
(docs/design.md, "Per-worker state layout"; state surgery: "Exchange core and the
non-finite guard").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from resireduce_jax import residual_stores as stores

if TYPE_CHECKING:
    from resireduce_jax.exchange_plan import ExchangePlan

PyTree = Any

__all__ = [
    "ExchangeState",
    "exchange_states",
    "leaf_residuals",
    "resize_workers",
    "store_residuals",
]


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
        if not batch.plan.keeps_residual:
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
        if batch.plan.keeps_residual:
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
        if store.shared or (dense_only and not store.own_residual):
            continue
        value = values[store.group.label]
        if not store.own_residual or store.quantized:
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


def _intra(store: stores.StorePlan) -> bool:
    """Whether ``store`` keeps part of one layer's residual (rows, or rows × columns)."""
    return isinstance(store, stores.RowsStore)


def _store_residual(store: stores.StorePlan, mean: np.ndarray, num_workers: int) -> Any:
    """Every new device's stored residual for the owed ``mean`` (leading device axis)."""
    top = dataclasses.replace(store, selection="top")
    rounding = jax.random.PRNGKey(0)  # a stochastic format's re-encoding: deterministic
    shard = store.shard

    def keep(x):  # a dense store's values as the store keeps them
        return store.keep(jnp.asarray(x), lambda _: rounding) if store.quantized else x

    if shard is None:
        if _intra(store):
            kept = stores.compress_residual(top, mean, None, rounding=rounding)
        else:
            kept = keep(mean)
        parts = [kept] * num_workers
    else:
        m = np.zeros((shard.rows * shard.count, shard.shape2d[1]), mean.dtype)
        m[: shard.shape2d[0]] = mean.reshape(shard.shape2d)
        whole = np.abs(m).sum(axis=0)  # norms of axis-1 indices: over the whole layer
        per_shard = []
        for j in range(shard.count):
            part = m[j * shard.rows : (j + 1) * shard.rows]
            if _intra(store):
                local = np.abs(part).sum(axis=1)  # norms of the shard's own axis-0 indices
                rows, cols = (whole, local) if store.view.row_axis == 1 else (local, whole)
                norms = stores.DimensionNorms(rows, cols if store.keeps_columns else None)
                part = stores.compress_residual(top, part, None, norms, rounding)
            else:
                part = keep(part)
            per_shard.append(part)
        parts = [per_shard[d % shard.count] for d in range(num_workers)]

    def cast(x):  # values in the store's dtype; indices stay int32
        x = np.asarray(x)
        return x.astype(store.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    parts = [jax.tree.map(cast if not store.quantized else np.asarray, p) for p in parts]
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
