"""Pytree paths as strings, and the per-leaf decisions made from them.

Every place in the library that names a leaf (grouping rules, error messages, reports)
uses the same spelling: ``jax.tree_util.keystr(path, simple=True, separator="/")``, e.g.
``Dense_0/kernel`` or ``h_3/attn/c_attn/kernel``.

**Path rules.** Every regex on leaf paths (``grouping.regex`` patterns, ``intra_layers``,
``layer_stacks``, the configs' rules) is ``re.search``-ed in that string, as t5x's and
Flax's partition rules are: anchor it (``^h_0/``, ``kernel$``) to match less. A rule
that matches no leaf raises a ``ValueError`` (:func:`no_match_hint` says what to fix).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any

__all__ = [
    "is_compressible",
    "leaf_paths",
    "no_match_hint",
    "path_to_str",
    "validate_float_leaves",
]


def path_to_str(path: tuple[Any, ...]) -> str:
    """``/``-joined string of a pytree key path (``keystr(..., simple=True)``)."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def leaf_paths(tree: PyTree) -> list[str]:
    """Paths of ``tree``'s leaves, in ``jax.tree.leaves`` order."""
    return [path_to_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def no_match_hint(pattern: str, paths: Sequence[str]) -> str:
    """The end of an error about a path rule that matches no leaf: the paths closest to
    ``pattern`` and the convention (rules are ``re.search``-ed in ``/``-joined paths)."""
    near = difflib.get_close_matches(pattern, list(paths), n=3, cutoff=0.0)
    hint = (
        f"Paths it could have matched: {near}. Rules are re.search-ed in a leaf's "
        "'/'-joined path (resireduce_jax.tree_paths.leaf_paths)"
    )
    if any(p.endswith("/value") for p in paths):
        hint += "; Flax NNX paths end in '/value' (layers/0/kernel/value): no '$' after 'kernel'"
    return hint + "."


def is_compressible(like: Any, min_size: int) -> bool:
    """Whether a leaf is compressed (reference rule; docs/design.md, "Semantics").

    Leaves with ``ndim <= 1`` (biases, norms, scalars) or fewer than ``min_size`` elements
    are not worth compressing: they travel dense and keep no residual. Neither do empty
    leaves (a zero-size dimension), even with ``min_size=0``: there is nothing to select.
    """
    return len(like.shape) >= 2 and math.prod(like.shape) >= max(min_size, 1)


def validate_float_leaves(tree: PyTree, what: str) -> None:
    """Raises a ValueError naming the first leaf of ``tree`` that is not a real float."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{what}: leaf '{path_to_str(path)}' has dtype {dtype}, but only real "
                "floating-point leaves can be averaged across workers. Keep integer, "
                "boolean and complex values out of the parameter tree that the optimizer "
                "sees (e.g. wrap the transform in optax.masked, or store them in model state)."
            )
