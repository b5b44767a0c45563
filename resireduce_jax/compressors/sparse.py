"""Sparsifying compressors: each worker sends ``k`` values and their int32 flat indices.

Payload layout (all methods here): ``values`` (``k`` elements of the leaf's dtype) and
``indices`` (``k`` int32 flat indices into ``x.ravel()``), so a worker sends
``k * (itemsize + 4)`` bytes. Payloads are all-gathered and scatter-added
(:func:`~resireduce_jax.compressors.base.sparse_mean`); no dense all-reduce of the leaf
remains. Random-k with indices shared by all workers is the exception: its values are
summed with a ``k``-element all-reduce.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from resireduce_jax.compressors.base import Compressor, dense_mean, sparse_mean

__all__ = ["RandomK", "SparsePayload", "TopK", "check_density", "num_selected"]


class SparsePayload(NamedTuple):
    """``k`` values and their flat int32 indices; an index ``>= x.size`` marks padding."""

    values: jax.Array
    indices: jax.Array


def check_density(density: float, name: str = "density") -> float:
    """Validates a fraction in (0, 1] and returns it as a float."""
    try:
        value = float(density)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in (0, 1], got {density!r}.") from None
    if not (0.0 < value <= 1.0):  # also rejects NaN
        raise ValueError(
            f"{name} must be in (0, 1], got {density!r}: it is the fraction of elements "
            "each worker sends (0.01 sends 1 %)."
        )
    return value


def num_selected(n: int, density: float) -> int:
    """``k = max(1, floor(density * n))``: elements sent for a leaf of ``n`` elements."""
    return max(1, math.floor(density * n))


class _SparseBase(Compressor):
    """Shared decompress / residual / bytes of the values-plus-indices payload."""

    def k(self, n: int) -> int:
        raise NotImplementedError

    def decompress(self, payload: SparsePayload, like):
        n = math.prod(like.shape)
        dense = (
            jnp.zeros((n,), like.dtype)
            .at[payload.indices]
            .set(payload.values.astype(like.dtype), mode="drop", unique_indices=True)
        )
        return dense.reshape(like.shape)

    def residual(self, x, payload: SparsePayload):
        # x - D(P) on the support only: sent entries become x_i - v_i (0 when v_i = x_i),
        # the others keep x_i; no dense D(P) is built. Subtracting the values (rather than
        # setting zeros) also orders this in-place update after the values were gathered.
        flat = x.ravel().at[payload.indices].add(
            -payload.values.astype(x.dtype), mode="drop", unique_indices=True
        )
        return flat.reshape(x.shape)

    def aggregate(self, payload: SparsePayload, like, axis_name):
        return sparse_mean(payload.values, payload.indices, like, axis_name)

    def payload_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
        return self.k(math.prod(shape)) * (np.dtype(dtype).itemsize + 4)


@dataclasses.dataclass(frozen=True)
class TopK(_SparseBase):
    """Exact Top-k on ``|x|`` (Aji & Heafield, "Sparse Communication for Distributed
    Gradient Descent", EMNLP 2017; Stich et al. 2018).

    Sends the ``k = max(1, floor(density * n))`` entries of largest magnitude; ties are
    broken by lower flat index (``lax.top_k``'s order). Biased: use error feedback.

    Attributes:
      density: fraction of entries sent, in (0, 1].
    """

    density: float = 0.01
    name: ClassVar[str] = "topk"
    biased: ClassVar[bool] = True

    def __post_init__(self):
        object.__setattr__(self, "density", check_density(self.density))

    def k(self, n: int) -> int:
        return num_selected(n, self.density)

    def compress(self, x, state, key):
        del key
        flat = x.ravel()
        _, indices = lax.top_k(jnp.abs(flat), self.k(flat.size))
        indices = indices.astype(jnp.int32)
        return SparsePayload(flat[indices], indices), state


@dataclasses.dataclass(frozen=True)
class RandomK(_SparseBase):
    """Random-k sparsification with indices shared by all workers (Stich et al., "Sparsified
    SGD with Memory", NeurIPS 2018; GRACE's RandomK).

    The flat leaf is cut into ``k`` contiguous strata of near-equal size and one index is
    drawn uniformly inside each stratum (stratified sampling, O(k) work instead of a
    permutation of all ``n`` indices). Every element is sent with probability
    ``1 / len(stratum) ≈ k / n``. All workers use the same key, so they select the same
    indices and the ``k`` values are summed with one ``k``-element all-reduce.

    With ``scaled=True`` each value is multiplied by its stratum size, which makes the
    compressor unbiased (``E[D(Q(x))] = x``) at the price of variance; with
    ``scaled=False`` (GRACE's default) it is biased and meant for error feedback.

    Attributes:
      density: fraction of entries sent, in (0, 1].
      scaled: rescale sent values to make the estimator unbiased.
    """

    density: float = 0.01
    scaled: bool = False
    name: ClassVar[str] = "randomk"
    randomness: ClassVar[str] = "shared"

    def __post_init__(self):
        object.__setattr__(self, "density", check_density(self.density))

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return not self.scaled

    def k(self, n: int) -> int:
        return num_selected(n, self.density)

    def _strata(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        k = self.k(n)
        starts = (np.arange(k, dtype=np.int64) * n) // k
        sizes = np.diff(np.append(starts, n))
        return starts.astype(np.int32), sizes.astype(np.int32)

    def compress(self, x, state, key):
        if key is None:
            raise ValueError("randomk needs a PRNG key shared by all workers.")
        flat = x.ravel()
        starts, sizes = self._strata(flat.size)
        offsets = jax.random.randint(key, starts.shape, 0, sizes)  # per-stratum maxval
        indices = jnp.asarray(starts) + offsets.astype(jnp.int32)
        values = flat[indices]
        if self.scaled:
            values = values * jnp.asarray(sizes, values.dtype)
        return SparsePayload(values, indices), state

    def residual(self, x, payload: SparsePayload):
        if self.scaled:  # D(Q(x)) = size * x_i at the chosen index, not x_i.
            return x - self.decompress(payload, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return super().residual(x, payload)

    def aggregate(self, payload: SparsePayload, like, axis_name):
        # Same indices on every worker: sum the k values densely, scatter once.
        mean_values = dense_mean(payload.values, axis_name, like.dtype)
        return self.decompress(SparsePayload(mean_values, payload.indices), like)

    def payload_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
        # Only values travel; indices are regenerated from the shared key.
        return self.k(math.prod(shape)) * np.dtype(dtype).itemsize
