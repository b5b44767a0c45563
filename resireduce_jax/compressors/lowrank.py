"""Low-rank compression: PowerSGD.

PowerSGD's exchange is interleaved with its compression (the second factor is computed
from the *averaged* first one), so it overrides :meth:`Compressor.reduce`; ``aggregate``
on its own is not defined for it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from resireduce_jax.compressors.base import Compressor, Reduced, check_int, dense_mean

__all__ = ["LowRankPayload", "PowerSGD", "orthonormalize"]


class LowRankPayload(NamedTuple):
    """The two factors of a rank-``r`` approximation ``P Q^T`` of the leaf matrix."""

    p: jax.Array  # [rows, r], orthonormal columns
    q: jax.Array  # [cols, r]


def orthonormalize(a: jax.Array) -> jax.Array:
    """Orthonormal columns spanning ``a``'s columns (Gram-Schmidt, each column twice).

    Classical Gram-Schmidt with one re-orthogonalization pass ("twice is enough"), column
    by column in a ``lax.fori_loop``: plain XLA ops, so identical inputs give bit-identical
    outputs on every worker (no LAPACK call whose threading could change the rounding). A
    column that is zero or linearly dependent on the previous ones becomes zero.
    """
    a32 = a.astype(jnp.float32)
    cols = a32.shape[1]
    tiny = jnp.finfo(jnp.float32).tiny

    def column(i, basis):
        v = lax.dynamic_index_in_dim(a32, i, axis=1, keepdims=False)
        for _ in range(2):  # basis has zeros in columns >= i, so this projects on 0..i-1
            v = v - basis @ (basis.T @ v)
        norm = jnp.sqrt(jnp.sum(v * v))
        v = jnp.where(norm > jnp.sqrt(tiny), v / jnp.maximum(norm, tiny), 0.0)
        return lax.dynamic_update_index_in_dim(basis, v, i, axis=1)

    basis = lax.fori_loop(0, cols, column, jnp.zeros_like(a32))  # as varying as a
    return basis.astype(a.dtype)


@dataclasses.dataclass(frozen=True)
class PowerSGD(Compressor):
    """PowerSGD (Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
    Distributed Optimization", NeurIPS 2019, Algorithm 1 with warm start, §3).

    The leaf is viewed as a matrix ``M`` of shape ``[prod(shape[:-1]), shape[-1]]``: fan-in
    by output units, a Flax ``Dense`` kernel ``[in, out]`` as is and a ``Conv`` kernel
    ``[kh, kw, in, out]`` as ``[kh * kw * in, out]``, which is the transpose of the
    ``[out, in * kh * kw]`` view PyTorch implementations use (GRACE, Vogels et al.'s code)
    up to the order of the fan-in entries, so the matrix approximated at rank ``r`` and the
    payload bytes are theirs (rank 4 on ``[3, 3, 64, 128]``: ``(576 + 128) * 4 * 4 = 11,264`` B).
    This is the kernel view of :func:`resireduce_jax.residual_stores.matrix_view` (an
    embedding table ``[vocab, features]`` is the same matrix there). Leaves of another
    layout (e.g. a ``DenseGeneral`` kernel ``[in, heads, head_dim]``, whose output units
    are the last two axes) should be reshaped by the caller. With
    ``r = min(rank, rows, cols)`` and the compressor state ``Q`` (``[cols, r]``, identical
    on all workers), one step is::

        P = M Q;        P = mean_w P     # all-reduce of rows * r entries
        P = orthonormalize(P)
        Q = M^T P;      Q = mean_w Q     # all-reduce of cols * r entries
        mean = P Q^T                     # the same on every worker
        residual = M - P Q^T             # this worker's error, kept by error feedback

    ``Q`` starts from a standard normal draw with a fixed key (so every worker starts
    from the same ``Q``) and is warm-started with the averaged ``Q`` of the previous step,
    which stays identical across workers. A column of the new ``Q`` that is entirely zero
    (e.g. after an all-zero gradient) keeps its previous value, so the power iteration
    cannot stall. Biased: the paper uses it with error feedback.

    Payload: ``(rows + cols) r`` entries of the leaf's dtype over two all-reduces,
    ``(rows + cols) r itemsize`` bytes per worker. Leaves must have ``ndim >= 2``.

    ``compress`` / ``decompress`` describe one worker alone (the factors of its own
    ``M`` without averaging; equal to :meth:`reduce` with one worker). ``aggregate`` is not
    defined: use :meth:`reduce`.

    Attributes:
      rank: the target rank ``r >= 1`` (clipped to ``min(rows, cols)``).
      seed: seed of the initial ``Q``.
    """

    rank: int = 4
    seed: int = 0
    name: ClassVar[str] = "powersgd"
    biased: ClassVar[bool] = True
    collective: ClassVar[str] = "all_reduce"  # P and Q, one psum each

    def __post_init__(self):
        object.__setattr__(self, "rank", check_int(self.rank, "rank", 1))
        object.__setattr__(self, "seed", check_int(self.seed, "seed", 0))

    def matrix_shape(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """``(rows, cols, r)`` of the matrix view ``[prod(shape[:-1]), shape[-1]]``."""
        rows, cols = math.prod(shape[:-1]), shape[-1]
        return rows, cols, min(self.rank, rows, cols)

    def validate(self, path: str, like: jax.ShapeDtypeStruct) -> None:
        super().validate(path, like)
        if len(like.shape) < 2:
            raise ValueError(
                f"Leaf '{path}' has shape {tuple(like.shape)}; powersgd compresses matrices "
                "and needs ndim >= 2. Let 1-D leaves travel dense (the transforms' min_size "
                "rule does this for ndim <= 1)."
            )

    def init(self, like):
        _, cols, r = self.matrix_shape(tuple(like.shape))
        q = jax.random.normal(jax.random.PRNGKey(self.seed), (cols, r), jnp.float32)
        return q.astype(like.dtype)

    def _matrix(self, x: jax.Array) -> jax.Array:
        rows, cols, _ = self.matrix_shape(tuple(x.shape))
        return x.reshape(rows, cols)

    @staticmethod
    def _keep_nonzero_columns(q_new: jax.Array, q_old: jax.Array) -> jax.Array:
        alive = jnp.any(q_new != 0, axis=0, keepdims=True)
        return jnp.where(alive, q_new, q_old)

    def compress(self, x, state, key):
        del key
        m = self._matrix(x)
        p = orthonormalize(m @ state)
        q = m.T @ p
        return LowRankPayload(p, q), self._keep_nonzero_columns(q, state)

    def decompress(self, payload: LowRankPayload, like):
        return (payload.p @ payload.q.T).reshape(like.shape).astype(like.dtype)

    def aggregate(self, payload, like, axis_name):
        raise ValueError(
            "powersgd averages its first factor before computing the second, so its "
            "exchange cannot be separated from compression: call reduce(x, state, key, "
            "axis_name) (what the transforms do)."
        )

    def reduce(self, x, state, key, axis_name, skip=None) -> Reduced:
        del key
        m = self._matrix(x)
        p = dense_mean(m @ state, axis_name)
        p = orthonormalize(p)
        q = dense_mean(m.T @ p, axis_name)
        approx = p @ q.T
        sent = approx if skip is None else jnp.where(skip, jnp.zeros((), approx.dtype), approx)
        return Reduced(
            mean=approx.reshape(x.shape),
            residual=(m - sent).reshape(x.shape),
            state=self._keep_nonzero_columns(q, state),
        )

    def payload_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
        rows, cols, r = self.matrix_shape(tuple(shape))
        return (rows + cols) * r * np.dtype(dtype).itemsize
