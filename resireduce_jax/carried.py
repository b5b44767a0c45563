"""A carried leaf's value in its exchange stores, read and written whole.

The one-buffer compressed momentum (docs/design.md, "One-buffer compressed momentum")
keeps a leaf's momentum in its own residual store (``"leaf"``,
:class:`~resireduce_jax.residual_stores.Carry`). During the dense warm-up the optimizer
reads and writes it here: a shard of a hierarchical store is gathered over the node's
devices and written back as this device's rows; a layer stack's slices are its batches'
stores. Inside ``shard_map`` / ``pmap`` only (a worker's own stores).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from resireduce_jax import residual_stores as stores
from resireduce_jax.compressors.base import axis_size
from resireduce_jax.exchange_plan import ExchangePlan

__all__ = ["gather_slices", "own_slice", "read", "replicated", "write"]

AxisName = str | tuple[str, ...]


def own_slice(x: jax.Array, axes: AxisName) -> jax.Array:
    """This worker's ``1/N`` of the flattened ``x`` (zero-padded to ``N`` equal slices)."""
    n = axis_size(axes)
    flat = x.reshape(-1)
    per = -(-flat.size // n)
    flat = jnp.pad(flat, (0, per * n - flat.size))
    return lax.dynamic_slice_in_dim(flat, lax.axis_index(axes) * per, per)


def gather_slices(part: jax.Array, axes: AxisName, shape: tuple[int, ...]) -> jax.Array:
    """The whole ``shape``-d value from every worker's :func:`own_slice`, replicated."""
    full = lax.all_gather(part, axes, axis=0, tiled=True, to="invarying")
    return full[: math.prod(shape)].reshape(shape)


def replicated(x: jax.Array, axes: AxisName) -> jax.Array:
    """``x``, equal on every worker of ``axes`` but varying by type (it was read from
    per-worker stores), as a replicated value: each worker sends its ``1/N`` of the
    flattened ``x`` and all gather them (``N`` floats of ``1/N`` of ``x`` a worker; values
    unchanged). The warm-up's update is made of it, so the parameters stay replicated."""
    return gather_slices(own_slice(x, axes), axes, x.shape)


def _gather(shard: stores.Shard, x: jax.Array) -> jax.Array:
    full = lax.all_gather(x, shard.axis_name, axis=0, tiled=True, to="invarying")
    return full[: shard.shape2d[0]].reshape(shard.leaf_shape)


def _own_rows(shard: stores.Shard, x: jax.Array) -> jax.Array:
    """This device's rows of ``x``'s 2-D view (padded with zeros to ``L`` shards)."""
    m = x.reshape(shard.shape2d)
    pad = shard.rows * shard.count - shard.shape2d[0]
    if pad:
        m = jnp.pad(m, ((0, pad), (0, 0)))
    start = lax.axis_index(shard.axis_name) * shard.rows
    return lax.dynamic_slice_in_dim(m, start, shard.rows, axis=0)


def _value(store: stores.StorePlan, stored: Any, shape: tuple[int, ...], dtype: Any):
    x = store.values(stored, store.group.shape, dtype)
    return x.reshape(shape) if store.shard is None else _gather(store.shard, x)


def _stack_plan(plan: ExchangePlan, leaf: int):
    for stack_plan in plan.stack_plans:
        if stack_plan.stack.leaf == leaf:
            return stack_plan
    return None


def _store_of_leaf(plan: ExchangePlan, leaf: int) -> stores.StorePlan:
    for store in plan.stores:
        if plan.layout.units[store.group.members[0]].leaf == leaf:
            return store
    raise KeyError(leaf)


def read(plan: ExchangePlan, residuals: dict[str, Any], leaf: int, like: jax.Array) -> jax.Array:
    """The value leaf ``leaf`` (carriable: :attr:`ExchangePlan.carriable_leaves`) holds
    in its stores, shaped and typed like ``like``."""
    stack_plan = _stack_plan(plan, leaf)
    if stack_plan is None:
        store = _store_of_leaf(plan, leaf)
        return _value(store, residuals[store.group.label], like.shape, like.dtype)
    stack = stack_plan.stack
    slice_shape = like.shape[: stack.axis] + like.shape[stack.axis + 1 :]
    parts = []
    for batch in stack_plan.batches:
        values = residuals[batch.label]
        parts.append(
            jax.vmap(lambda s, b=batch: _value(b.plan, s, slice_shape, like.dtype))(values)
        )
    return jnp.moveaxis(jnp.concatenate(parts), 0, stack.axis)


def write(
    plan: ExchangePlan,
    residuals: dict[str, Any],
    leaf: int,
    value: jax.Array,
    when: bool | jax.Array = True,
) -> dict[str, Any]:
    """``residuals`` with leaf ``leaf``'s stores holding ``value`` (encoded once by the
    store's format) where ``when`` holds, as they were elsewhere. The rounding is nearest,
    a stochastic format's too: a replicated ``value`` is then kept alike on every worker,
    so what they read back (and the updates made of it) stays replicated."""
    out = dict(residuals)

    def keep(store: stores.StorePlan, x: jax.Array, old: Any) -> Any:
        x = x if store.shard is None else _own_rows(store.shard, x)
        if store.quantized and store.format.stochastic:
            store = dataclasses.replace(
                store, format=dataclasses.replace(store.format, rounding="nearest")
            )
        new = store.keep(x.reshape(store.group.shape))
        if when is True:
            return new
        return jax.tree.map(lambda a, b: jnp.where(when, a, b), new, old)

    stack_plan = _stack_plan(plan, leaf)
    if stack_plan is None:
        store = _store_of_leaf(plan, leaf)
        out[store.group.label] = keep(store, value, residuals[store.group.label])
        return out
    x = jnp.moveaxis(value, stack_plan.stack.axis, 0)
    for batch in stack_plan.batches:
        part = x[batch.start : batch.stop]
        out[batch.label] = jax.vmap(lambda v, o, b=batch: keep(b.plan, v, o))(
            part, residuals[batch.label]
        )
    return out
