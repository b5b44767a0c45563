"""resireduce_jax: memory-lean, communication-efficient data-parallel training in JAX."""

from resireduce_jax import runtime

__version__ = "0.1.0"

__all__ = ["runtime"]
