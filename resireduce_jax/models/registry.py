"""The named models: their configurations, building them, and their example inputs.

``MODELS`` maps each name to the configuration dataclass of the published architecture;
keyword overrides (``num_layers=2``, ``width=64``, ``dtype="bfloat16"`` ...) replace fields
of that dataclass, so every model can also be built at a reduced size for tests and CPU runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax

from resireduce_jax.models.bert import BertConfig
from resireduce_jax.models.config import ModelConfig
from resireduce_jax.models.gpt2 import GPT2Config
from resireduce_jax.models.mlp import MLPConfig
from resireduce_jax.models.resnet import ResNetConfig
from resireduce_jax.models.vgg import VGGConfig
from resireduce_jax.models.vit import ViTConfig

__all__ = ["MODELS", "abstract_variables", "example_batch", "get_config", "get_model"]

MODELS: dict[str, ModelConfig] = {
    # He et al. 2016, ResNet-50 with the CIFAR stem, 100 classes (ResiReduce §5.1).
    "resnet50_cifar": ResNetConfig(),
    # Simonyan & Zisserman 2014, configuration E with BN: torchvision's vgg19_bn, fed 32x32.
    "vgg19_bn": VGGConfig(),
    # Radford et al. 2019, Table 2 (sizes as released: 124M / 355M / 774M parameters).
    "gpt2_small": GPT2Config(num_layers=12, width=768, num_heads=12),
    "gpt2_medium": GPT2Config(num_layers=24, width=1024, num_heads=16),
    "gpt2_large": GPT2Config(num_layers=36, width=1280, num_heads=20),
    # scikit-learn's 8x8 digits: 64 -> 256 x 4 -> 10, for the embedded CPU training job.
    "digits_mlp": MLPConfig(),
    # GPT-2 on raw bytes for the embedded CPU training job. Dropout off: short runs on a
    # few hundred KB of text are far from overfitting.
    "byte_gpt": GPT2Config(
        vocab_size=256,
        max_len=128,
        num_layers=4,
        width=128,
        num_heads=4,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
    ),
    # Devlin et al. 2018, Table/§3: BERT-base and BERT-large, with a SQuAD span head.
    "bert_base": BertConfig(num_layers=12, width=768, num_heads=12),
    "bert_large": BertConfig(num_layers=24, width=1024, num_heads=16),
    # Dosovitskiy et al. 2021, Table 1 (ViT-S: Touvron et al. 2021 / Steiner et al. 2022).
    "vit_s16": ViTConfig(num_layers=12, width=384, num_heads=6),
    "vit_b16": ViTConfig(num_layers=12, width=768, num_heads=12),
    "vit_l16": ViTConfig(num_layers=24, width=1024, num_heads=16),
}


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """The configuration registered as ``name`` with ``overrides`` applied.

    Args:
      name: one of ``MODELS``.
      **overrides: fields of that configuration dataclass to replace.

    Returns:
      A validated configuration.

    Raises:
      ValueError: for an unknown name, an unknown field, or an invalid value.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names are {sorted(MODELS)}.")
    base = MODELS[name]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"model {name!r} ({type(base).__name__}) has no field(s) {unknown}; "
            f"valid overrides are {sorted(fields)}."
        )
    return dataclasses.replace(base, **overrides)


def get_model(name: str, **overrides: Any) -> nn.Module:
    """The Flax module of model ``name`` (see :func:`get_config` for ``overrides``)."""
    return get_config(name, **overrides).build()


def example_batch(name: str, batch_size: int, **overrides: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of one batch of model ``name``: ``apply``'s inputs and the targets.

    The keys named by the configuration's ``input_names`` are the keyword arguments of
    ``model.apply``; those named by ``target_names`` are the loss targets.
    """
    return get_config(name, **overrides).example_batch(batch_size)


def abstract_variables(name: str, **overrides: Any) -> dict[str, Any]:
    """Shapes and dtypes of the variables of model ``name`` (``params``, ``batch_stats`` ...).

    Traces ``init`` with :func:`jax.eval_shape`, so even the largest model costs no memory.
    """
    config = get_config(name, **overrides)
    batch = config.example_batch(1)
    inputs = {key: batch[key] for key in config.input_names}
    model = config.build()
    return jax.eval_shape(lambda key, inputs: model.init(key, **inputs), jax.random.key(0), inputs)
