"""What an exchange sends and what the network carries, from shapes alone.

Each worker's own payloads (:func:`bytes_sent`), and the bytes a worker receives over
the collective each payload takes, in a model of ring collectives (:class:`WireBytes`,
:func:`wire_bytes`), beside a dense all-reduce's, with the worker count at which the
exchange carries more (:func:`crossover_workers`). docs/exchange.md, "What the network
carries".
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import numpy as np

from resireduce_jax.compressors import schedule
from resireduce_jax.exchange_plan import dense_bytes

PyTree = Any

__all__ = ["WireBytes", "bytes_sent", "crossover_workers", "wire_bytes"]


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


def bytes_sent(exchange: Any, params: PyTree, steps: int, local_size: int | None = None) -> int:
    """Bytes one worker sends in the first ``steps`` exchanges (its own payloads)."""
    plan = exchange.plan(params, local_size=local_size)
    units = plan.layout.units
    total = 0
    if exchange.selection_scope == "global" and plan.stores:  # one payload for all of them
        size = sum(math.prod(store.group.shape) * len(store.group.members) for store in plan.stores)
        dtype = units[plan.stores[0].group.members[0]].dtype
        total += schedule.bytes_sent(exchange.compressor, (size,), dtype, steps)
    for store in plan.stores if exchange.selection_scope == "leaf" else ():
        for i in store.group.members:
            total += schedule.bytes_sent(
                exchange.compressor, store.group.shape, units[i].dtype, steps
            )
    for i in plan.dense:
        like = jax.ShapeDtypeStruct(units[i].shape, units[i].dtype)
        total += steps * dense_bytes(like)
    return int(total)


def _traffic(exchange: Any, params: PyTree, steps: int, local_size: int | None) -> _Traffic:
    """The payloads of :meth:`bytes_sent`, split by collective, and the dense terms."""
    plan = exchange.plan(params, local_size=local_size)
    local = 1 if exchange.local_axis is None else int(local_size or exchange._local_size())
    units = plan.layout.units
    sent = {"all_gather": 0, "all_reduce": 0}

    def add(shape: tuple[int, ...], dtype: Any) -> None:
        for how, n in schedule.bytes_sent_by_collective(
            exchange.compressor, shape, dtype, steps
        ).items():
            sent[how] += n

    sharded = 0
    if exchange.selection_scope == "global" and plan.stores:  # one payload for all of them
        size = sum(math.prod(store.group.shape) * len(store.group.members) for store in plan.stores)
        add((size,), units[plan.stores[0].group.members[0]].dtype)
    for store in plan.stores:
        for i in store.group.members:
            if exchange.selection_scope == "leaf":
                add(store.group.shape, units[i].dtype)
            if store.shard is not None:  # the node's padded leaf, every step
                padded = store.shard.rows * store.shard.count * store.shard.shape2d[1]
                sharded += steps * padded * np.dtype(units[i].dtype).itemsize
    loose = sum(
        steps * math.prod(units[i].shape) * np.dtype(units[i].dtype).itemsize for i in plan.dense
    )
    every = steps * dense_bytes(params)
    return _Traffic(sent["all_gather"], sent["all_reduce"], loose, sharded, every, local)


def wire_bytes(
    exchange: Any, params: PyTree, steps: int, num_workers: int, local_size: int | None = None
) -> WireBytes:
    """What one of ``num_workers`` workers receives in the first ``steps`` exchanges, in
    the model of :class:`WireBytes`, beside a dense all-reduce's."""
    t = _traffic(exchange, params, steps, local_size)
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
    exchange: Any, params: PyTree, steps: int, local_size: int | None = None
) -> int | None:
    """The fewest workers at which the exchange carries more than dense across nodes."""
    # Across nodes, with M nodes: (M - 1) G + 2 (M - 1) / M (R + d / L) against
    # 2 (M - 1) / M D / L. Equal at M = 1; for M >= 2 the first exceeds the second
    # iff M G L > 2 (D - d - L R) =: C.
    t = _traffic(exchange, params, steps, local_size)
    c = 2 * (t.every - t.loose - t.local * t.reduced)
    if t.gathered == 0:
        return 2 * t.local if c < 0 else None
    return max(2, c // (t.gathered * t.local) + 1) * t.local
