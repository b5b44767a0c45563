"""Where the bytes of a training run go: model-state accounting from abstract shapes.

The ResiReduce paper (§3, §5.2) counts one worker's model states.
They are parameters, gradients, optimizer state and error-feedback residuals.
model_state_bytes computes them from shapes alone, so nothing full-size is allocated.
Compressor state (PowerSGD's Q) has a category of its own; gradients count one buffer.
DGC's velocity v counts as residuals, its momentum u as optimizer state.
Stored bytes are exact: a residual format's codes and scales as kept.
The compiled step's real peak is read with hlo.peak_memory.
The category rules: docs/design.md, "Model-state accounting (memory.py)".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
import optax

from resireduce_jax.dgc import DGCState
from resireduce_jax.exchange import ExchangeState

PyTree = Any

__all__ = ["MemoryComparison", "ModelStateBytes", "compare", "model_state_bytes", "tree_bytes"]


def tree_bytes(tree: PyTree) -> int:
    """Total bytes of the array leaves (or ``ShapeDtypeStruct``s) of ``tree``."""
    return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of one worker's model states, by category."""

    params: int
    grads: int
    optimizer: int
    residuals: int
    compressor: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.residuals + self.compressor

    @property
    def residual_share(self) -> float:
        """Residuals as a fraction of all model states (the paper's Fig. 2)."""
        return self.residuals / self.total if self.total else 0.0

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def _abstract(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def model_state_bytes(params: PyTree, tx: optax.GradientTransformation) -> ModelStateBytes:
    """Model-state bytes of one worker training ``params`` with ``tx`` (shapes only).

    Args:
      params: params, or their ``jax.ShapeDtypeStruct``s (``jax.eval_shape(model.init, ...)``).
      tx: the whole optax chain (compression transform first, then the optimizer).

    Returns:
      A :class:`ModelStateBytes`.
    """
    abstract = _abstract(params)
    state = jax.eval_shape(tx.init, abstract)
    residuals = compressor = optimizer = 0
    stores = (ExchangeState, DGCState)
    for node in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, stores)):
        if isinstance(node, ExchangeState):
            residuals += tree_bytes(node.residuals)
            compressor += tree_bytes(node.compressor_state)
            optimizer += tree_bytes(node.count)
        elif isinstance(node, DGCState):  # v is what is not sent yet; u is the momentum
            residuals += tree_bytes(node.velocity)
            compressor += tree_bytes(node.compressor_state)
            optimizer += tree_bytes((node.count, node.momentum, node.dense_momentum))
        else:
            optimizer += tree_bytes(node)
    size = tree_bytes(abstract)
    return ModelStateBytes(
        params=size, grads=size, optimizer=optimizer, residuals=residuals, compressor=compressor
    )


@dataclasses.dataclass(frozen=True)
class MemoryComparison:
    """Model states of a baseline and a reduced configuration, side by side."""

    baseline: ModelStateBytes
    reduced: ModelStateBytes

    @property
    def normalized(self) -> float:
        """Reduced model states / baseline model states (the paper's Fig. 9)."""
        return self.reduced.total / self.baseline.total

    @property
    def saving(self) -> float:
        """Fraction of the baseline's model-state bytes saved."""
        return 1.0 - self.normalized

    def __str__(self) -> str:
        rows = [("category", "baseline", "reduced", "change")]
        for field in ("params", "grads", "optimizer", "residuals", "compressor", "total"):
            b = getattr(self.baseline, field)
            r = getattr(self.reduced, field)
            change = f"{(r - b) / b:+.1%}" if b else ("" if r == 0 else "new")
            rows.append((field, _size(b), _size(r), change))
        widths = [max(len(row[c]) for row in rows) for c in range(4)]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(
            f"model states: {self.normalized:.3f} of the baseline ({self.saving:.1%} saved); "
            f"residuals were {self.baseline.residual_share:.1%} of the baseline's model states"
        )
        return "\n".join(lines)


def _size(n: int) -> str:
    """``n`` bytes in MiB, or in KiB where one decimal of MiB would round them to zero."""
    if 0 < n < 2**20 / 20:
        return f"{n / 2**10:,.1f} KiB"
    return f"{n / 2**20:,.1f} MiB"


def compare(
    params: PyTree,
    reduced_tx: optax.GradientTransformation,
    baseline_tx: optax.GradientTransformation,
) -> MemoryComparison:
    """Model-state bytes of ``reduced_tx`` next to ``baseline_tx`` (e.g. plain EF)."""
    return MemoryComparison(
        baseline=model_state_bytes(params, baseline_tx),
        reduced=model_state_bytes(params, reduced_tx),
    )
