"""Models of :mod:`resireduce_jax.models` as sequences of layers, for :class:`RotorSequential`.

A rotor plan checkpoints a *chain*: the model zoo's repeated blocks
(:class:`resireduce_jax.models.resnet.Bottleneck`, :class:`resireduce_jax.models.gpt2.Block`,
:class:`resireduce_jax.models.vit.Block`) are its stages as they are; this module adds the
two ends (stem or embedding, and head) as layers of their own, built from the same
configuration::

    layers = sequential_layers("resnet50_cifar")      # stem, 16 bottlenecks, head
    model = RotorSequential(layers)

Differences from the monolithic modules: parameters are named ``layers_<i>/...``; GPT-2's
output projection is a separate ``[width, vocab]`` matrix instead of being tied to the token
embedding (a chain stage owns its parameters), which adds ``width · vocab`` parameters
(38.6M for GPT-2 small).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from resireduce_jax.models import get_config
from resireduce_jax.models.gpt2 import Block as GPT2Block
from resireduce_jax.models.gpt2 import GPT2Config
from resireduce_jax.models.resnet import Bottleneck, ResNetConfig
from resireduce_jax.models.vit import Block as ViTBlock
from resireduce_jax.models.vit import ViTConfig

__all__ = [
    "GPT2Embedding",
    "GPT2Head",
    "ResNetHead",
    "ResNetStem",
    "ViTEmbedding",
    "ViTHead",
    "sequential_layers",
]


def _same_padding(kernel: int) -> tuple[tuple[int, int], tuple[int, int]]:
    return ((kernel // 2, kernel // 2), (kernel // 2, kernel // 2))


class ResNetStem(nn.Module):
    """``relu(bn1(conv1(image)))`` (and the ImageNet stem's max-pool), as in ``ResNet``."""

    config: ResNetConfig

    @nn.compact
    def __call__(self, image: jax.Array, *, train: bool = False) -> jax.Array:
        c = self.config
        kernel, stride = (3, 1) if c.stem == "cifar" else (7, 2)
        x = nn.Conv(
            c.width,
            (kernel, kernel),
            strides=(stride, stride),
            padding=_same_padding(kernel),
            use_bias=False,
            kernel_init=nn.initializers.variance_scaling(2.0, "fan_out", "normal"),
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            name="conv1",
        )(image)
        x = nn.BatchNorm(
            use_running_average=not train,
            momentum=c.bn_momentum,
            epsilon=c.bn_epsilon,
            axis_name=c.bn_axis_name,
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            name="bn1",
        )(x)
        x = nn.relu(x)
        if c.stem == "imagenet":
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        return x


class ResNetHead(nn.Module):
    """Global average pooling and the ``fc`` classifier; float32 logits."""

    config: ResNetConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        logits = nn.Dense(
            c.num_classes,
            kernel_init=nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform"),
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            name="fc",
        )(jnp.mean(x, axis=(1, 2)))
        return logits.astype(jnp.float32)


class GPT2Embedding(nn.Module):
    """Token and position embeddings, then dropout: ``[batch, length]`` ids to activations."""

    config: GPT2Config

    @nn.compact
    def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
        c = self.config
        init = nn.initializers.normal(c.initializer_range)
        settings = dict(embedding_init=init, dtype=c.dtype, param_dtype=c.param_dtype)
        x = nn.Embed(c.vocab_size, c.width, name="wte", **settings)(tokens)
        x = x + nn.Embed(c.max_len, c.width, name="wpe", **settings)(
            jnp.arange(tokens.shape[1])[None, :]
        )
        return nn.Dropout(c.dropout_rate)(x, deterministic=not train)


class GPT2Head(nn.Module):
    """Final LayerNorm and an (untied) ``[width, vocab]`` projection; float32 logits."""

    config: GPT2Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        x = nn.LayerNorm(
            epsilon=c.layer_norm_epsilon, dtype=c.dtype, param_dtype=c.param_dtype, name="ln_f"
        )(x)
        logits = nn.Dense(
            c.vocab_size,
            use_bias=False,
            kernel_init=nn.initializers.normal(c.initializer_range),
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            name="lm_head",
        )(x)
        return logits.astype(jnp.float32)


class ViTEmbedding(nn.Module):
    """Patch embedding, class token and position embedding, then dropout."""

    config: ViTConfig

    @nn.compact
    def __call__(self, image: jax.Array, *, train: bool = False) -> jax.Array:
        c = self.config
        patches = nn.Conv(
            c.width,
            (c.patch_size, c.patch_size),
            strides=(c.patch_size, c.patch_size),
            padding="VALID",
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            name="patch_embed",
        )(image)
        batch = patches.shape[0]
        x = patches.reshape(batch, -1, c.width)
        cls_token = self.param(
            "cls_token", nn.initializers.normal(1e-6), (1, 1, c.width), c.param_dtype
        )
        pos_embed = self.param(
            "pos_embed",
            nn.initializers.normal(0.02),
            (1, c.num_patches + 1, c.width),
            c.param_dtype,
        )
        cls_tokens = jnp.broadcast_to(cls_token.astype(c.dtype), (batch, 1, c.width))
        x = jnp.concatenate([cls_tokens, x.astype(c.dtype)], axis=1) + pos_embed.astype(c.dtype)
        return nn.Dropout(c.dropout_rate)(x, deterministic=not train)


class ViTHead(nn.Module):
    """Final LayerNorm and the classifier on the class token; float32 logits."""

    config: ViTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        x = nn.LayerNorm(
            epsilon=c.layer_norm_epsilon, dtype=c.dtype, param_dtype=c.param_dtype, name="norm"
        )(x)
        logits = nn.Dense(c.num_classes, dtype=c.dtype, param_dtype=c.param_dtype, name="head")(
            x[:, 0]
        )
        return logits.astype(jnp.float32)


def sequential_layers(name: str, **overrides: Any) -> list[nn.Module]:
    """The layers of model ``name`` as a chain: stem/embedding, blocks, head.

    Args:
      name: a model of :data:`resireduce_jax.models.MODELS` built from ResNet, GPT-2 or
        ViT configurations (``"resnet50_cifar"``, ``"gpt2_small"``, ``"vit_s16"`` ...).
      **overrides: configuration fields to replace (see
        :func:`resireduce_jax.models.get_config`).

    Returns:
      A list of linen modules; apply them with :class:`RotorSequential`.

    Raises:
      ValueError: for a model that is not one of these families.
    """
    config = get_config(name, **overrides)
    if isinstance(config, ResNetConfig):
        blocks = [
            Bottleneck(
                features=config.width * 2**stage,
                strides=2 if stage > 0 and block == 0 else 1,
                dtype=config.dtype,
                param_dtype=config.param_dtype,
                bn_momentum=config.bn_momentum,
                bn_epsilon=config.bn_epsilon,
                bn_axis_name=config.bn_axis_name,
            )
            for stage, count in enumerate(config.stage_sizes)
            for block in range(count)
        ]
        return [ResNetStem(config), *blocks, ResNetHead(config)]
    if isinstance(config, GPT2Config):
        blocks = [GPT2Block(config) for _ in range(config.num_layers)]
        return [GPT2Embedding(config), *blocks, GPT2Head(config)]
    if isinstance(config, ViTConfig):
        blocks = [ViTBlock(config) for _ in range(config.num_layers)]
        return [ViTEmbedding(config), *blocks, ViTHead(config)]
    raise ValueError(
        f"Model {name!r} ({type(config).__name__}) has no sequential form here; supported "
        "families are ResNet, GPT-2 and ViT configurations."
    )
