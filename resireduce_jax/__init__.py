"""resireduce_jax: memory-lean, communication-efficient data-parallel training in JAX."""

from resireduce_jax import compressors, parallel, runtime
from resireduce_jax.transforms import (
    CompressedMeanState,
    ErrorFeedbackState,
    compressed_mean,
    error_feedback,
)

__version__ = "0.1.0"

__all__ = [
    "CompressedMeanState",
    "ErrorFeedbackState",
    "compressed_mean",
    "compressors",
    "error_feedback",
    "parallel",
    "runtime",
]
