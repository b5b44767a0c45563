"""Models scanned over their layers: ``nn.scan`` of one layer, and its parameters.

nn.scan applies one block num_layers times; each weight is one leaf with a layer axis.
The scanned program compiles in a time independent of depth.
The zoo's transformers take scan_layers=True; their layer_stacks makes each slice a layer.
stack_layers and unstack_layers map parameters between the two forms.
Details: docs/design.md, "Scanned models (models/scan.py)" and "Layer stacks".
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["apply_layers", "stack_layers", "unstack_layers"]


def apply_layers(
    layer: nn.Module, x: jax.Array, num_layers: int, *args: Any, train: bool
) -> jax.Array:
    """``x`` through ``num_layers`` copies of ``layer`` (``layer(x, *args, train=train)``
    each), scanned: the layer's parameters get a leading layer axis, its parameter and
    dropout keys are split per layer. ``args`` are the same for every layer."""

    def body(module: nn.Module, carry: jax.Array, _: None) -> tuple[jax.Array, None]:
        return module(carry, *args, train=train), None

    scan = nn.scan(
        body,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        length=num_layers,
    )
    return scan(layer, x, None)[0]


def _parent(tree: dict[str, Any], scope: str) -> tuple[dict[str, Any], list[str], str]:
    """The dict holding ``scope``'s last name, the names leading to it, and that name."""
    *parents, name = scope.split("/")
    for parent in parents:
        tree = tree[parent]
    return tree, parents, name


def _with_parent(tree: dict[str, Any], parents: list[str], new: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``tree`` whose dict at ``parents`` is ``new``."""
    if not parents:
        return new
    return {**tree, parents[0]: _with_parent(tree[parents[0]], parents[1:], new)}


def stack_layers(tree: dict[str, Any], scope: str, num_layers: int) -> dict[str, Any]:
    """The unrolled ``tree`` (``{scope}_0`` ... ``{scope}_{n-1}``) in the scanned form:
    one ``{scope}`` whose leaves stack the layers' on a leading axis."""
    parent, parents, name = _parent(tree, scope)
    names = [f"{name}_{i}" for i in range(num_layers)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(parent[n] for n in names))
    rest = {k: v for k, v in parent.items() if k not in names}
    return _with_parent(tree, parents, {**rest, name: stacked})


def unstack_layers(tree: dict[str, Any], scope: str) -> dict[str, Any]:
    """The scanned ``tree`` in the unrolled form (:func:`stack_layers` inverted)."""
    parent, parents, name = _parent(tree, scope)
    stacked = parent[name]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    rest = {k: v for k, v in parent.items() if k != name}
    layers = {f"{name}_{i}": jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num_layers)}
    return _with_parent(tree, parents, {**rest, **layers})
