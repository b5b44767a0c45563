"""Dense "compressors": no compression, and casts to 16-bit floats.

``none`` is the uncompressed baseline (a plain all-reduce); ``fp16`` / ``bf16`` halve the
bytes of a float32 gradient by casting before the all-reduce (GRACE's FP16 compressor).
:func:`is_dense` tells the exchanges and the compressed-momentum optimizers which phases
of a schedule are dense: every coordinate sent, no residual kept.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from resireduce_jax.compressors.base import Compressor, dense_mean

__all__ = ["Cast", "NoCompression", "is_dense"]


def _no_residual(x: jax.Array, skip: jax.Array | None) -> jax.Array:
    """The residual of a phase that keeps none: zero, or ``x`` itself on a skipped step
    (nothing was sent; :meth:`Compressor.residual`'s contract)."""
    if skip is None:
        return jnp.zeros_like(x)
    return jnp.where(skip, x, jnp.zeros((), x.dtype))


@dataclasses.dataclass(frozen=True)
class NoCompression(Compressor):
    """Sends the gradient unchanged: ``mean = psum(x) / W``. Unbiased and lossless."""

    name: ClassVar[str] = "none"
    biased: ClassVar[bool] = False
    collective: ClassVar[str] = "all_reduce"

    def compress(self, x, state, key):
        del key
        return x, state

    def decompress(self, payload, like):
        return payload

    def aggregate(self, payload, like, axis_name):
        return dense_mean(payload, axis_name, like.dtype)

    def residual(self, x, payload, skip=None):
        return _no_residual(x, skip)

    def payload_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
        return math.prod(shape) * np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Cast(Compressor):
    """Casts to a 16-bit float before a dense all-reduce in that dtype.

    Biased only by rounding (round-to-nearest-even); with error feedback the rounding error
    is carried to the next step. The sum over workers is accumulated in the 16-bit dtype, as
    an all-reduce in that dtype does: with ``float16`` a sum beyond ±65504 overflows to
    ±Inf, so prefer ``bfloat16`` unless gradients are known to be small.

    Attributes:
      dtype: ``"float16"`` or ``"bfloat16"``.
      feedback: keep the rounding error as the residual (default). ``False``: drop it,
        as a 16-bit all-reduce without error feedback does; the residual is then zero
        and the cast is a dense phase (:func:`is_dense`), e.g. the 16-bit warm-up of
        :func:`~resireduce_jax.compressors.schedule.with_dense_dtype`.
    """

    dtype: str = "bfloat16"
    feedback: bool = True
    name: ClassVar[str] = "cast"
    biased: ClassVar[bool] = True
    collective: ClassVar[str] = "all_reduce"

    def __post_init__(self):
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"Cast dtype must be 'float16' or 'bfloat16', got {self.dtype!r}.")

    def compress(self, x, state, key):
        del key
        return x.astype(self.dtype), state

    def decompress(self, payload, like):
        return payload.astype(like.dtype)

    def aggregate(self, payload, like, axis_name):
        return dense_mean(payload, axis_name, like.dtype)

    def residual(self, x, payload, skip=None):
        if self.feedback:
            return super().residual(x, payload, skip)
        return _no_residual(x, skip)

    def payload_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
        return math.prod(shape) * jnp.dtype(self.dtype).itemsize


def is_dense(compressor: Any) -> bool:
    """Whether ``compressor`` sends every coordinate and keeps no residual:
    :class:`NoCompression`, or a :class:`Cast` without feedback. A leading dense phase
    leaves every residual store at zero (the exchanges rely on it), and its steps are the
    warm-up of the compressed-momentum optimizers."""
    return isinstance(compressor, NoCompression) or (
        isinstance(compressor, Cast) and not compressor.feedback
    )
