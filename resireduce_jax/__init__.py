"""resireduce_jax: memory-lean, communication-efficient data-parallel training in JAX.

* Compressed gradient exchange with error feedback, and ResiReduce's reduced residuals:
  :func:`compressed_mean`, :func:`error_feedback`, :func:`resireduce`, with
  :mod:`compressors` and :mod:`grouping`.
* Compressed-momentum Adam and SGD (1-bit Adam's scheme with any compressor and
  ResiReduce's stores for the momentum error): :func:`compressed_momentum_adam`,
  :func:`compressed_momentum_sgd`.
* Deep Gradient Compression's memory (momentum correction, local clipping, momentum
  factor masking): :func:`dgc_memory`, :func:`deep_gradient_compression`.
* The data-parallel step under ``jax.shard_map``: :mod:`parallel`.
* Reading compiled programs (collectives, copies, peak memory): :mod:`hlo`.
* Memory-reduced optimizers AdamW-R, Adan-R, Lion-R: :mod:`optimizers`.
* Optimal activation checkpointing of layer chains under a memory budget: :mod:`remat`.
* Non-finite gradient guard: :func:`skip_nonfinite`; model-state accounting: :mod:`memory`.
"""

from resireduce_jax import (
    compressed_momentum,
    compressors,
    dgc,
    exchange,
    grouping,
    hlo,
    layer_stacks,
    memory,
    models,
    optimizers,
    parallel,
    remat,
    residual_stores,
    runtime,
    tree_paths,
)
from resireduce_jax.compressed_momentum import (
    CompressedMomentumState,
    compressed_momentum_adam,
    compressed_momentum_sgd,
)
from resireduce_jax.dgc import DGCState, deep_gradient_compression, dgc_memory
from resireduce_jax.exchange import ExchangeState, ExchangeTransformation
from resireduce_jax.nonfinite import SkipNonFiniteState, skip_nonfinite, value_and_guarded_grad
from resireduce_jax.optimizers import adamw_r, adan_r, lion_r, optimizer_step
from resireduce_jax.residual_reduction import resireduce
from resireduce_jax.transforms import compressed_mean, error_feedback

__version__ = "0.1.0"

__all__ = [
    "CompressedMomentumState",
    "DGCState",
    "ExchangeState",
    "ExchangeTransformation",
    "SkipNonFiniteState",
    "adamw_r",
    "adan_r",
    "compressed_mean",
    "compressed_momentum",
    "compressed_momentum_adam",
    "compressed_momentum_sgd",
    "compressors",
    "deep_gradient_compression",
    "dgc",
    "dgc_memory",
    "error_feedback",
    "exchange",
    "grouping",
    "hlo",
    "layer_stacks",
    "lion_r",
    "memory",
    "models",
    "optimizer_step",
    "optimizers",
    "parallel",
    "remat",
    "residual_stores",
    "resireduce",
    "runtime",
    "skip_nonfinite",
    "tree_paths",
    "value_and_guarded_grad",
]
