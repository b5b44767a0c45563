"""Reusable groups: which leaves share one residual (ResiReduce paper §4.1–§4.2).

A grouping maps every leaf to a label; leaves with the same label share one residual.
Only compressed leaves are grouped; labels of leaves that travel dense are ignored.
auto groups adjacent leaves of the same role, shape and dtype, as the paper's Fig. 4.
regex takes ordered (pattern, label) rules; the first pattern re.search finds decides.
report prints what was grouped, to check it before training.
The rules in detail: docs/design.md, "Groupings (grouping.py)".
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np

from resireduce_jax import layer_stacks as layer_stacks_lib
from resireduce_jax.tree_paths import is_compressible, no_match_hint, path_to_str

PyTree = Any
Grouping = PyTree | Callable[[PyTree], PyTree]

__all__ = [
    "Group",
    "GroupingReport",
    "RegexGrouping",
    "auto",
    "each_leaf",
    "regex",
    "report",
    "resolve",
    "role",
]

_INDEX = re.compile(r"\d+")


def role(path: str) -> str:
    """A leaf's role: its path with every number replaced by ``*`` (``h_3/mlp`` → ``h_*/mlp``)."""
    return _INDEX.sub("*", path)


def _layer_order(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in _INDEX.findall(path))


def _flatten(params: PyTree) -> tuple[list[str], list[Any], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    return [path_to_str(p) for p, _ in flat], [x for _, x in flat], treedef


def each_leaf() -> Callable[[PyTree], PyTree]:
    """Every leaf in its own group (labels are the paths): plain error feedback."""

    def labels(params: PyTree) -> PyTree:
        paths, _, treedef = _flatten(params)
        return treedef.unflatten(paths)

    return labels


def auto(max_group_size: int | None = 3) -> Callable[[PyTree], PyTree]:
    """Groups adjacent same-role, same-shape leaves (paper §4.1, "reusable groups").

    Leaves are bucketed by ``(role(path), shape, dtype)``; inside a bucket they are ordered
    by the numbers in their paths (layer order, so ``h_10`` follows ``h_9``) and cut into
    consecutive runs of at most ``max_group_size`` (``None``: no limit). The paper groups
    three adjacent transformer layers and a whole ResNet stage; use :func:`regex` where a
    model's structure (e.g. pooling boundaries in VGG) must be respected exactly.

    Args:
      max_group_size: largest number of leaves sharing one residual, ``>= 1`` or ``None``.

    Returns:
      A callable ``params -> labels``; labels look like ``h_*/attn/c_attn/kernel#0``.
    """
    valid_int = isinstance(max_group_size, int) and not isinstance(max_group_size, bool)
    if max_group_size is not None and not (valid_int and max_group_size >= 1):
        raise ValueError(f"max_group_size must be an int >= 1 or None, got {max_group_size!r}.")

    def labels(params: PyTree) -> PyTree:
        paths, leaves, treedef = _flatten(params)
        buckets: dict[tuple[Any, ...], list[int]] = {}
        for i, (path, leaf) in enumerate(zip(paths, leaves, strict=True)):
            key = (role(path), tuple(np.shape(leaf)), str(getattr(leaf, "dtype", "")))
            buckets.setdefault(key, []).append(i)
        out = list(paths)
        for (leaf_role, _, _), members in buckets.items():
            if len(members) == 1:
                continue
            members.sort(key=lambda i: _layer_order(paths[i]))
            size = max_group_size or len(members)
            for run, start in enumerate(range(0, len(members), size)):
                chunk = members[start : start + size]
                if len(chunk) == 1:
                    continue  # a leftover single leaf keeps its own residual
                shape = "x".join(map(str, np.shape(leaves[chunk[0]])))
                for i in chunk:
                    out[i] = f"{leaf_role}[{shape}]#{run}"
        return treedef.unflatten(out)

    return labels


def regex(
    rules: Mapping[str, str] | Sequence[tuple[str, str]],
    *,
    unmatched: Literal["raise", "warn", "ignore"] = "raise",
) -> RegexGrouping:
    r"""Labels from ordered ``(pattern, template)`` rules on leaf paths.

    The first pattern that ``re.search`` finds in a leaf's path labels it with
    ``match.expand(template)`` (``\g<0>`` is the matched text; ``\1`` or ``\g<name>``
    the pattern's groups); anchor a pattern (``^...$``) to match whole paths. Leaves that
    match no rule are singletons labelled by their path. Labels of leaves that travel
    dense (biases, norms, leaves under ``min_size``) are ignored, so ``r"dense_[123]/"``
    groups the three kernels and leaves their biases dense.

    Example (GPT-2: each weight role across three consecutive layers)::

        regex([(r"^h_(\d+)/(attn|mlp)/(\w+)/kernel$", r"\2/\3")])   # then split by layer:
        regex({r"^h_([0-2])/(.*)": r"h0-2/\2", r"^h_([3-5])/(.*)": r"h3-5/\2"})

    Args:
      rules: an ordered mapping or a sequence of ``(pattern, template)`` pairs.
      unmatched: what a pattern that matches no leaf of the params does: ``"raise"`` a
        ``ValueError`` naming it and the closest paths, ``"warn"``, or ``"ignore"``.

    Returns:
      A callable ``params -> labels`` (:class:`RegexGrouping`).
    """
    if unmatched not in ("raise", "warn", "ignore"):
        raise ValueError(f"unmatched={unmatched!r}; choose 'raise', 'warn' or 'ignore'.")
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    compiled = []
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise ValueError(f"A grouping rule must be a (pattern, template) pair, got {item!r}.")
        pattern, template = item
        try:
            compiled.append((re.compile(pattern), template))
        except re.error as e:
            raise ValueError(f"Invalid grouping pattern {pattern!r}: {e}.") from None
    return RegexGrouping(tuple(compiled), unmatched)


@dataclasses.dataclass(frozen=True)
class RegexGrouping:
    """:func:`regex`'s grouping: call it on params (or their shapes) for their labels.

    Attributes:
      rules: the compiled ``(pattern, template)`` rules, in order.
      unmatched: ``"raise"``, ``"warn"`` or ``"ignore"`` a pattern that matches no leaf.
    """

    rules: tuple[tuple[re.Pattern[str], str], ...]
    unmatched: Literal["raise", "warn", "ignore"] = "raise"

    def __call__(self, params: PyTree) -> PyTree:
        paths, _, treedef = _flatten(params)
        out = []
        for path in paths:
            label = path
            for pattern, template in self.rules:
                m = pattern.search(path)
                if m:
                    label = m.expand(template)
                    break
            out.append(label)
        if self.unmatched != "ignore":
            for pattern, _ in self.rules:
                if any(pattern.search(p) for p in paths):
                    continue
                message = (
                    f"grouping rule {pattern.pattern!r} matches no leaf, so it groups "
                    f"nothing. {no_match_hint(pattern.pattern, paths)}"
                )
                if self.unmatched == "raise":
                    raise ValueError(message)
                warnings.warn(message, stacklevel=2)
        return treedef.unflatten(out)


@dataclasses.dataclass(frozen=True)
class Group:
    """One residual-sharing group of compressed leaves.

    Attributes:
      label: the group's label.
      members: leaf indices (``jax.tree.leaves`` order) in processing order (layer order).
      paths: the members' paths.
      shape: the common leaf shape.
      dtype: the common leaf dtype.
    """

    label: str
    members: tuple[int, ...]
    paths: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: Any

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _labels_for(params: PyTree, grouping: Grouping) -> list[Any]:
    if isinstance(params, layer_stacks_lib.UnstackedView) and not callable(grouping):
        raise ValueError(
            "With layer_stacks the grouping must be a callable (grouping.auto(), "
            "grouping.regex(...)): it sees every slice of a stack at its slice path, while a "
            "labels pytree has one label per stacked leaf."
        )
    labels = grouping(params) if callable(grouping) else grouping
    treedef = jax.tree.structure(params)
    try:
        return treedef.flatten_up_to(labels)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "The grouping labels must have the same tree structure as the params (one label "
            f"per leaf); got {jax.tree.structure(labels)} for params {treedef}."
        ) from e


def resolve(params: PyTree, grouping: Grouping, min_size: int) -> list[Group]:
    """Groups of compressed leaves, validated, in order of their first member.

    Args:
      params: the params (or updates, or ``ShapeDtypeStruct``s): only shapes and dtypes
        are read.
      grouping: labels pytree or callable (docs/design.md, "Groupings (grouping.py)").
      min_size: leaves with fewer elements or ``ndim <= 1`` are not compressed and belong
        to no group.

    Returns:
      The groups. Members of a group are ordered by the numbers in their paths.

    Raises:
      ValueError: if leaves of different shapes or dtypes share a label.
    """
    paths, leaves, _ = _flatten(params)
    labels = _labels_for(params, grouping)
    by_label: dict[str, list[int]] = {}
    for i, (leaf, label) in enumerate(zip(leaves, labels, strict=True)):
        if not is_compressible(leaf, min_size):
            continue
        if not isinstance(label, str):
            raise ValueError(f"Group label of '{paths[i]}' must be a string, got {label!r}.")
        by_label.setdefault(label, []).append(i)
    groups = []
    for label, members in by_label.items():
        members.sort(key=lambda i: (_layer_order(paths[i]), i))
        signatures = {(tuple(np.shape(leaves[i])), np.dtype(leaves[i].dtype)) for i in members}
        if len(signatures) > 1:
            detail = ", ".join(
                f"'{paths[i]}' {tuple(np.shape(leaves[i]))} {np.dtype(leaves[i].dtype)}"
                for i in members
            )
            raise ValueError(
                f"Group '{label}' mixes shapes or dtypes: {detail}. Members of a group share "
                "one residual, so they must have the same shape and dtype; fix the grouping "
                "rules (resireduce_jax.grouping.report shows what each rule matched)."
            )
        first = leaves[members[0]]
        groups.append(
            Group(
                label=label,
                members=tuple(members),
                paths=tuple(paths[i] for i in members),
                shape=tuple(np.shape(first)),
                dtype=np.dtype(first.dtype),
            )
        )
    groups.sort(key=lambda g: g.members[0])
    return groups


@dataclasses.dataclass(frozen=True)
class GroupingReport:
    """What a grouping does to a params tree: groups, members and residual bytes (as
    kept: a row's ``format`` and its ``bytes``, codes and scales of a block format).

    ``str(report)`` is a readable table; ``rows`` holds the same data for programs.
    """

    rows: tuple[dict[str, Any], ...]
    dense_leaves: int
    dense_bytes: int

    @property
    def residual_bytes_per_leaf(self) -> int:
        return sum(r["bytes"] * r["members"] for r in self.rows)

    @property
    def residual_bytes_grouped(self) -> int:
        return sum(r["bytes"] for r in self.rows)

    def __str__(self) -> str:
        header = ("group", "members", "shape", "kept as", "residual", "paths")
        lines = []
        for r in self.rows:
            shown = r["paths"] if len(r["paths"]) <= 3 else [*r["paths"][:2], "…", r["paths"][-1]]
            size = _fmt_bytes(r["bytes"])
            kept = r.get("format", "")
            lines.append((r["group"], str(r["members"]), r["shape"], kept, size, ", ".join(shown)))
        widths = [
            max(len(h), *(len(line[c]) for line in lines)) if lines else len(h)
            for c, h in enumerate(header)
        ]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
        out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        out += [fmt.format(*line) for line in lines]
        shared = sum(1 for r in self.rows if r["members"] > 1)
        out.append(
            f"{len(self.rows)} groups ({shared} shared) over "
            f"{sum(r['members'] for r in self.rows)} compressed leaves: residuals "
            f"{_fmt_bytes(self.residual_bytes_grouped)} instead of "
            f"{_fmt_bytes(self.residual_bytes_per_leaf)} with one residual per leaf; "
            f"{self.dense_leaves} small leaves ({_fmt_bytes(self.dense_bytes)}) travel dense."
        )
        return "\n".join(out)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def report(
    params: PyTree,
    grouping: Grouping,
    min_size: int = 10_000,
    *,
    layer_stacks: layer_stacks_lib.LayerStacks | None = None,
    residual_format: Any = None,
    residual_dtype: Any = None,
) -> GroupingReport:
    """Tabulates the groups ``grouping`` forms on ``params`` (shapes only; nothing allocated).

    Args:
      params: params or ``jax.ShapeDtypeStruct``s (e.g. from ``jax.eval_shape``).
      grouping: labels pytree or callable.
      min_size: as in :func:`resireduce_jax.resireduce`.
      layer_stacks: as in :func:`resireduce_jax.resireduce`: every slice of a stack is a
        layer, reported at its slice path.
      residual_format, residual_dtype: as in :func:`resireduce_jax.resireduce`: each row's
        ``bytes`` are its whole residual as that store keeps it (codes and scales of a
        block format; :meth:`~resireduce_jax.residual_stores.StorePlan.stored_bytes`).
        Default: the leaves' dtype.

    Returns:
      A :class:`GroupingReport`; print it.
    """
    # Imported here: residual_stores imports this module.
    from resireduce_jax import residual_stores
    from resireduce_jax.transforms import residual_storage

    dtype, fmt = residual_storage(residual_format, residual_dtype)
    if layer_stacks is not None:
        params = layer_stacks_lib.layout(params, layer_stacks_lib.check(layer_stacks)).view()
    groups = resolve(params, grouping, min_size)
    _, leaves, _ = _flatten(params)
    grouped = {i for g in groups for i in g.members}
    dense = [x for i, x in enumerate(leaves) if i not in grouped]

    def store(g: Group) -> residual_stores.StorePlan:
        """The group's whole residual as the exchange would keep it."""
        return residual_stores.StorePlan(
            group=g,
            kind="average" if len(g.members) > 1 else "leaf",
            dtype=g.dtype if dtype is None else np.dtype(dtype),
            format=fmt,
        )

    rows = tuple(
        {
            "group": g.label,
            "members": len(g.members),
            "shape": "x".join(map(str, g.shape)),
            "format": fmt.name if fmt is not None else store(g).dtype.name,
            "bytes": store(g).stored_bytes(),
            "paths": list(g.paths),
        }
        for g in groups
    )
    dense_bytes = sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in dense)
    return GroupingReport(rows=rows, dense_leaves=len(dense), dense_bytes=dense_bytes)
