"""Layer stacks: leaves that hold one weight of every layer, seen layer by layer.

Scanned models keep each weight of all their layers in one leaf with a layer axis.
ResiReduce works per layer, so layer_stacks={regex: axis} makes every slice a layer.
A pattern must match a whole run of path keys: "h" matches h/..., not head/...
Slice i of a stack is named by inserting /i where the prefix ends.
Layout lists the slices in the unstacked pytree's flatten order; view gives their shapes.
Without layer_stacks every unit is a whole leaf.
Which leaves, slice paths and the unstacked pytree: docs/design.md, "Layer stacks" and
"Layer stacks' view (layer_stacks.py)".
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from resireduce_jax.tree_paths import no_match_hint, path_to_str

PyTree = Any
LayerStacks = Mapping[str, int]

__all__ = ["LayerStacks", "Layout", "Stack", "Unit", "UnstackedView", "check", "layout"]


def check(layer_stacks: Any) -> tuple[tuple[str, int], ...] | None:
    """Validates ``layer_stacks`` (``None`` or ``{regex: axis}``); returns it as a tuple of
    pairs (hashable, in the mapping's order)."""
    if layer_stacks is None:
        return None
    if not isinstance(layer_stacks, Mapping):
        raise ValueError(
            "layer_stacks must be a mapping {regex on leaf paths: layer axis}, e.g. "
            f"{{'h': 0}} for GPT-2 scanned over its blocks; got {layer_stacks!r}."
        )
    items = []
    for pattern, axis in layer_stacks.items():
        if not isinstance(pattern, str):
            raise ValueError(f"layer_stacks keys must be regex strings, got {pattern!r}.")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"layer_stacks pattern {pattern!r} is invalid: {e}.") from None
        if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
            raise ValueError(
                f"layer_stacks[{pattern!r}] must be the int index of the layer axis, got {axis!r}."
            )
        items.append((pattern, int(axis)))
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class Stack:
    """How one leaf holds layers: ``size`` slices along ``axis``, named at ``prefix``.

    Attributes:
      leaf: the leaf's index in ``jax.tree.leaves`` order.
      path: the leaf's path.
      axis: the layer axis (non-negative).
      size: number of slices (layers).
      prefix: the path before the slice index (``"h"``); slice ``i`` is named
        ``prefix/i`` followed by the rest of the path.
      units: the unit index of every slice, in slice order.
    """

    leaf: int
    path: str
    axis: int
    size: int
    prefix: str
    units: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Unit:
    """One leaf of the unstacked pytree: a whole leaf, or one slice of a stack.

    Attributes:
      leaf: index of the (stacked or plain) leaf it lives in.
      index: the slice index along the stack's axis; ``None`` for a whole leaf.
      path: its path (a slice path for a slice).
      shape: its shape (a slice's: the stack's without the layer axis).
      dtype: its dtype.
    """

    leaf: int
    index: int | None
    path: str
    shape: tuple[int, ...]
    dtype: Any


@jax.tree_util.register_pytree_with_keys_class
class UnstackedView:
    """A pytree whose leaves are given in order, each keyed by its path: the unstacked
    pytree's leaves, as grouping rules and planners see them (``keystr`` of a leaf is its
    slice path)."""

    def __init__(self, paths: tuple[str, ...], children: list[Any]):
        self.paths = tuple(paths)
        self.children = list(children)

    def tree_flatten_with_keys(self):
        keys = (jax.tree_util.DictKey(p) for p in self.paths)
        return list(zip(keys, self.children, strict=True)), self.paths

    def tree_flatten(self):
        return self.children, self.paths

    @classmethod
    def tree_unflatten(cls, paths, children):
        return cls(paths, list(children))

    def __repr__(self) -> str:
        return f"UnstackedView({dict(zip(self.paths, self.children, strict=True))!r})"


@dataclasses.dataclass(frozen=True)
class Layout:
    """The units of a params tree (:class:`Unit`, in unstacked order) and its stacks.

    Attributes:
      units: every unit, in the unstacked pytree's flatten order.
      stacks: the stacked leaves, in leaf order.
    """

    units: tuple[Unit, ...]
    stacks: tuple[Stack, ...]

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(u.path for u in self.units)

    @property
    def trivial(self) -> bool:
        """Whether every unit is a whole leaf, in leaf order (no stacks)."""
        return not self.stacks

    def view(self) -> PyTree:
        """The unstacked pytree's leaves as ``jax.ShapeDtypeStruct``s, keyed by path."""
        like = [jax.ShapeDtypeStruct(u.shape, u.dtype) for u in self.units]
        return UnstackedView(self.paths, like)

    def stack_of(self, leaf: int) -> Stack | None:
        for stack in self.stacks:
            if stack.leaf == leaf:
                return stack
        return None


def _first_match(patterns, path: str) -> tuple[str, int, int, int] | None:
    """``(pattern, axis, start, end)`` of the prefix ``path[start:end]`` named by the first
    pattern that ``re.search`` finds in ``path`` aligned on its keys: starting at the
    path's start or after a ``/``, and ending at a ``/`` (or just after one, which is then
    not part of the prefix) or at the end of the path."""
    for pattern, axis in patterns:
        m = re.search(rf"(?:^|(?<=/))(?:{pattern})(?:(?=/|$)|(?<=/))", path)
        if m:
            end = m.end() - 1 if m.end() > m.start() and path[m.end() - 1] == "/" else m.end()
            return pattern, axis, m.start(), end
    return None


def layout(params: PyTree, layer_stacks: tuple[tuple[str, int], ...] | None) -> Layout:
    """The :class:`Layout` of ``params`` (arrays or ``jax.ShapeDtypeStruct``s) for checked
    ``layer_stacks`` (:func:`check`).

    Raises:
      ValueError: a pattern matches no leaf; a matched leaf has no such axis or a zero-size
        one; leaves under one stack prefix do not all stack the same number of slices.
    """
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    keypaths = [kp for kp, _ in flat]
    paths = [path_to_str(kp) for kp in keypaths]
    shapes = [tuple(np.shape(x)) for _, x in flat]
    dtypes = [np.dtype(x.dtype) for _, x in flat]
    if not layer_stacks:
        units = tuple(Unit(j, None, paths[j], shapes[j], dtypes[j]) for j in range(len(paths)))
        return Layout(units, ())

    # depth[j]: number of path keys before the slice index; axis[j], for stacked leaves.
    stacked: dict[int, tuple[int, int]] = {}
    used = set()
    for j, path in enumerate(paths):
        found = _first_match(layer_stacks, path)
        if found is None:
            continue
        pattern, axis, start, end = found
        used.add(pattern)
        shape = shapes[j]
        if axis < 0:
            axis += len(shape)
        if not 0 <= axis < len(shape) or shape[axis] == 0:
            raise ValueError(
                f"layer_stacks: leaf '{path}' of shape {shape} has no layer axis {found[1]}; "
                "fix the axis or narrow the pattern."
            )
        prefixes = [len(path_to_str(keypaths[j][:d])) for d in range(len(keypaths[j]) + 1)]
        if end not in prefixes or not (start == 0 or start - 1 in prefixes):
            raise ValueError(
                f"layer_stacks: the match of {pattern!r} in '{path}' does not start and end "
                "between two path keys (a key holds a '/')."
            )
        stacked[j] = (axis, prefixes.index(end))
    unused = [p for p, _ in layer_stacks if p not in used]
    if unused:
        raise ValueError(
            f"layer_stacks pattern {unused[0]!r} matches no leaf, so nothing would be treated "
            "as a layer stack; a match must start and end between two path keys. "
            f"{no_match_hint(unused[0], paths)}"
        )

    # rank[j][d]: the first leaf under keypaths[j][:d+1]: sorting by it is flatten order.
    first: dict[tuple[Any, ...], int] = {}
    for j, kp in enumerate(keypaths):
        for d in range(1, len(kp) + 1):
            first.setdefault(tuple(kp[:d]), j)
    rank = [[first[tuple(kp[:d])] for d in range(1, len(kp) + 1)] for kp in keypaths]

    # Every leaf under a stack's prefix must be a stack of as many slices at that prefix.
    prefix_of = {j: tuple(keypaths[j][:depth]) for j, (_, depth) in stacked.items()}
    sizes = {j: shapes[j][axis] for j, (axis, _) in stacked.items()}
    for j, prefix in prefix_of.items():
        for i, kp in enumerate(keypaths):
            if tuple(kp[: len(prefix)]) != prefix:
                continue
            if prefix_of.get(i) != prefix or sizes[i] != sizes[j]:
                raise ValueError(
                    f"layer_stacks: '{paths[i]}' lies under the stack prefix "
                    f"'{path_to_str(prefix)}' of '{paths[j]}' ({sizes[j]} slices) but is "
                    "not a stack of as many slices there; every leaf under a stack's "
                    "prefix must be one (declare it, or use a longer prefix)."
                )

    entries = []  # (sort key, Unit)
    for j in range(len(paths)):
        if j not in stacked:
            entries.append((tuple(rank[j]), Unit(j, None, paths[j], shapes[j], dtypes[j])))
            continue
        axis, depth = stacked[j]
        prefix = path_to_str(keypaths[j][:depth])
        rest = paths[j][len(prefix) :]
        slice_shape = shapes[j][:axis] + shapes[j][axis + 1 :]
        for s in range(shapes[j][axis]):
            path = f"{prefix}/{s}{rest}" if prefix else f"{s}{rest}"
            key = (*rank[j][:depth], s, *rank[j][depth:])
            entries.append((key, Unit(j, s, path, slice_shape, dtypes[j])))
    entries.sort(key=lambda e: e[0])
    units = tuple(u for _, u in entries)
    stacks = []
    for j in sorted(stacked):
        axis, depth = stacked[j]
        slices = sorted((u.index, k) for k, u in enumerate(units) if u.leaf == j)
        stacks.append(
            Stack(
                leaf=j,
                path=paths[j],
                axis=axis,
                size=shapes[j][axis],
                prefix=path_to_str(keypaths[j][:depth]),
                units=tuple(k for _, k in slices),
            )
        )
    return Layout(units, tuple(stacks))
