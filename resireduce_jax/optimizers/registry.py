"""Optimizers by name, for configs such as ``optimizer.name = "adamw_r"``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from resireduce_jax.optimizers.adamw_r import adamw_r
from resireduce_jax.optimizers.adan_r import adan_r
from resireduce_jax.optimizers.lion_r import lion_r
from resireduce_jax.optimizers.sgd import sgd

__all__ = ["OPTIMIZERS", "get_optimizer", "optax_optimizer_names", "optimizer_factory"]

# This library's optimizers. "sgd" and "adamw" are this library's skip-aware equivalents
# of optax's (bit-identical updates; under resireduce_jax.skip_nonfinite they keep their
# moments on a skipped step in place instead of through a copy). Any other name is looked
# up among optax's optimizer aliases (``optax.lion``, ``optax.adan``, ...).
OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "adamw": adamw_r,
    "adamw_r": adamw_r,
    "adan_r": adan_r,
    "lion_r": lion_r,
    "sgd": sgd,
}


_OPTAX_ALIAS_MODULE = "optax._src.alias"  # where optax defines its optimizer aliases


def optax_optimizer_names() -> list[str]:
    """The names of optax's optimizer aliases (``"adamw"``, ``"lion"``, ...), sorted."""
    return sorted(
        name
        for name in dir(optax)
        if not name.startswith("_")
        and getattr(getattr(optax, name), "__module__", "") == _OPTAX_ALIAS_MODULE
    )


def optimizer_factory(name: str) -> Callable[..., optax.GradientTransformation]:
    """The function that builds optimizer ``name`` (ours, else optax's alias of that name).

    Raises:
      ValueError: for an unknown name, listing the known ones.
    """
    if name in OPTIMIZERS:
        return OPTIMIZERS[name]
    known = optax_optimizer_names()
    if name in known:
        return getattr(optax, name)
    raise ValueError(
        f"Unknown optimizer {name!r}. This library provides {sorted(OPTIMIZERS)}; "
        f"optax provides {known}."
    )


def get_optimizer(name: str, **hyperparams: Any) -> optax.GradientTransformation:
    """Builds the optimizer called ``name`` with ``hyperparams`` (keyword arguments).

    Args:
      name: ``"adamw_r"``, ``"adan_r"``, ``"lion_r"``, or the name of an optax optimizer
        (``"adamw"``, ``"lion"``, ``"adan"``, ``"sgd"``, ...).
      **hyperparams: passed to the factory, e.g. ``learning_rate=1e-3, weight_decay=0.05``.

    Returns:
      The ``optax.GradientTransformation``.

    Raises:
      ValueError: for an unknown name, listing the known ones.
    """
    return optimizer_factory(name)(**hyperparams)
