"""Dense "compressors": no compression, and casts to 16-bit floats.

``none`` is the uncompressed baseline (a plain all-reduce); ``fp16`` / ``bf16`` halve the
bytes of a float32 gradient by casting before the all-reduce (GRACE's FP16 compressor).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from resireduce_jax.compressors.base import Compressor, dense_mean

__all__ = ["Cast", "NoCompression"]


@dataclasses.dataclass(frozen=True)
class NoCompression(Compressor):
    """Sends the gradient unchanged: ``mean = psum(x) / W``. Unbiased and lossless."""

    name: ClassVar[str] = "none"
    biased: ClassVar[bool] = False

    def compress(self, x, state, key):
        del key
        return x, state

    def decompress(self, payload, like):
        return payload

    def aggregate(self, payload, like, axis_name):
        return dense_mean(payload, axis_name, like.dtype)

    def residual(self, x, payload, skip=None):
        if skip is None:
            return jnp.zeros_like(x)
        return jnp.where(skip, x, jnp.zeros((), x.dtype))

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
    """

    dtype: str = "bfloat16"
    name: ClassVar[str] = "cast"
    biased: ClassVar[bool] = True

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

    def payload_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
        return math.prod(shape) * jnp.dtype(self.dtype).itemsize
