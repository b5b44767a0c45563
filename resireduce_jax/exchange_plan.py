"""Where the exchange keeps every residual: its plan, decided from shapes alone.

:class:`ExchangePlan` lists every store (:mod:`resireduce_jax.residual_stores`), the leaves
that travel dense, and how layer stacks are exchanged (:class:`StackPlan`);
``tx.plan(params)`` returns it without tracing (docs/design.md, "Exchange core and the
non-finite guard" and "Layer stacks").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from resireduce_jax import grouping as grouping_lib
from resireduce_jax import layer_stacks as layer_stacks_lib
from resireduce_jax import residual_stores as stores

PyTree = Any

__all__ = ["ExchangePlan", "StackPlan", "dense_bytes", "singleton_stores"]


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

    def store_shard(self, unit: int) -> stores.Shard | None:
        """The shard of the store keeping ``unit`` (``None``: not sharded)."""
        return self._shards.get(unit)

    @functools.cached_property
    def _shards(self) -> dict[int, stores.Shard]:
        return {i: p.shard for p in self.stores for i in p.group.members if p.shard}

    def store_of(self, path: str) -> stores.StorePlan | None:
        """The store holding the residual of the unit at ``path`` (``None``: dense)."""
        for plan in self.stores:
            if path in plan.group.paths:
                return plan
        return None

    @functools.cached_property
    def carriable_leaves(self) -> frozenset[int]:
        """The leaves (``jax.tree.leaves`` order) whose every unit is in a store that can
        carry its momentum (:attr:`~resireduce_jax.residual_stores.StorePlan.carries`)."""
        carried: dict[int, bool] = {}
        for plan in self.stores:
            for i in plan.group.members:
                leaf = self.layout.units[i].leaf
                carried[leaf] = carried.get(leaf, True) and plan.carries
        for i in self.dense:
            carried[self.layout.units[i].leaf] = False
        return frozenset(leaf for leaf, ok in carried.items() if ok)

    @property
    def kept(self) -> tuple[stores.StorePlan, ...]:
        """The stores that keep a residual (all but kind ``"none"``)."""
        return tuple(p for p in self.stores if p.keeps_residual)

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


def dense_bytes(params: PyTree) -> int:
    """Bytes one worker sends per step when every leaf of ``params`` is all-reduced
    uncompressed in its own dtype (the baseline of :meth:`ExchangeTransformation.bytes_sent`)."""
    return sum(
        int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)
    )


def singleton_stores(
    params: PyTree, min_size: int, kind: str, dtype: Any = None, residual_format: Any = None
) -> list[stores.StorePlan]:
    """One ``kind`` store (``"none"`` or ``"leaf"``) per compressed leaf, labelled by path,
    its residual in ``dtype`` (``None``: the leaf's), or as ``residual_format``'s codes."""
    groups = grouping_lib.resolve(params, grouping_lib.each_leaf(), min_size)
    return [
        stores.StorePlan(
            group=g,
            kind=kind,
            dtype=g.dtype if dtype is None else np.dtype(dtype),
            format=residual_format,
        )
        for g in groups
    ]
