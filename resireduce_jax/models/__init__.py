"""Flax (linen) models with parameter names that mirror the PyTorch reference code.

``get_model(name, **overrides)`` builds one of ``MODELS``; ``example_batch`` gives the
shapes of its inputs and targets. Parameter paths (``jax.tree_util.keystr(path,
simple=True, separator="/")`` of the ``params`` collection) follow the reference
implementations, so regex rules written for the PyTorch layer names carry over; see
``docs/models.md`` for the full naming contract and how to call each model.
"""

from resireduce_jax.models import attention, bert, gpt2, mlp, resnet, vgg, vit
from resireduce_jax.models.config import ModelConfig
from resireduce_jax.models.registry import (
    MODELS,
    abstract_variables,
    example_batch,
    get_config,
    get_model,
)

__all__ = [
    "MODELS",
    "ModelConfig",
    "abstract_variables",
    "attention",
    "bert",
    "example_batch",
    "get_config",
    "get_model",
    "gpt2",
    "mlp",
    "resnet",
    "vgg",
    "vit",
]
