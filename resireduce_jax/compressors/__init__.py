"""Gradient compressors (GRACE-style): one factory per method.

Each factory returns a :class:`~resireduce_jax.compressors.base.Compressor`; pass it to
:func:`resireduce_jax.compressed_mean`, :func:`resireduce_jax.error_feedback` or
:func:`resireduce_jax.resireduce`. :func:`get` builds one from a name and keyword
arguments (what configs use).
"""

from __future__ import annotations

from typing import Any

from resireduce_jax.compressors.base import Compressor, Reduced
from resireduce_jax.compressors.dense import Cast, NoCompression
from resireduce_jax.compressors.sparse import RandomK, SparsePayload, TopK


def none() -> NoCompression:
    """No compression: a dense all-reduce (the uncompressed baseline)."""
    return NoCompression()


def fp16() -> Cast:
    """Cast to float16 before a float16 all-reduce (overflows past ±65504)."""
    return Cast("float16")


def bf16() -> Cast:
    """Cast to bfloat16 before a bfloat16 all-reduce."""
    return Cast("bfloat16")


def topk(density: float = 0.01) -> TopK:
    """Exact Top-k on |x| with ``k = max(1, floor(density * n))``. Biased: use EF."""
    return TopK(density)


def randomk(density: float = 0.01, scaled: bool = False) -> RandomK:
    """Random-k with indices shared by all workers; unbiased iff ``scaled``."""
    return RandomK(density, scaled)


REGISTRY: dict[str, Any] = {
    "none": none,
    "fp16": fp16,
    "bf16": bf16,
    "topk": topk,
    "randomk": randomk,
}


def get(name: str, **kwargs: Any) -> Compressor:
    """Builds a compressor by registry name, e.g. ``get("topk", density=0.01)``."""
    if name not in REGISTRY:
        raise ValueError(f"Unknown compressor {name!r}; choose one of {sorted(REGISTRY)}.")
    try:
        return REGISTRY[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"Bad arguments for compressor {name!r}: {e}") from None


__all__ = [
    "REGISTRY",
    "Cast",
    "Compressor",
    "NoCompression",
    "RandomK",
    "Reduced",
    "SparsePayload",
    "TopK",
    "bf16",
    "fp16",
    "get",
    "none",
    "randomk",
    "topk",
]
