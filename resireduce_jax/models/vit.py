"""Vision Transformer (ViT) image classifier with a class token.

Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for Image Recognition at
Scale", ICLR 2021 (https://arxiv.org/abs/2010.11929), §3.1.
Patches are embedded by a strided convolution; a class token and positions are added.
Pre-LayerNorm blocks with GELU MLPs follow; a linear head reads the class token.
Parameter names follow timm's VisionTransformer; dense kernels are [in, out].
Sizes, names and a calling example: docs/design.md, "ViT (models/vit.py)".
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from resireduce_jax.models import attention
from resireduce_jax.models.config import ChainStage, ImageClassifierConfig, dense, layer_norm

__all__ = [
    "MLP",
    "Attention",
    "Block",
    "Embedding",
    "Head",
    "ViTConfig",
    "VisionTransformer",
    "chain_stages",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ViTConfig(ImageClassifierConfig):
    """Hyperparameters of a Vision Transformer (defaults: ViT-B/16 on 224x224, 1000 classes).

    Attributes:
      image_size: input height and width; must be a multiple of ``patch_size``.
      patch_size: side of the square patches.
      num_channels: input channels.
      num_classes: classifier outputs.
      num_layers: transformer blocks.
      width: token width (hidden size D).
      num_heads: attention heads; must divide ``width``.
      mlp_dim: hidden width of the MLP; ``None`` means ``4 * width``.
      dropout_rate: dropout after the position embedding and in the MLP / projection.
      attention_dropout_rate: dropout on the attention probabilities.
      layer_norm_epsilon: LayerNorm epsilon (1e-6 as in the reference implementations).
    """

    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    num_classes: int = 1000
    num_layers: int = 12
    width: int = 768
    num_heads: int = 12
    mlp_dim: int | None = None
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    layer_norm_epsilon: float = 1e-6

    rng_names: ClassVar[tuple[str, ...]] = ("dropout",)

    def validate(self) -> None:
        self._require_positive(
            "image_size",
            "patch_size",
            "num_channels",
            "num_classes",
            "num_layers",
            "width",
            "num_heads",
            "mlp_dim",
        )
        self._require_divisible("width", "num_heads")
        self._require_rate("dropout_rate", "attention_dropout_rate")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"ViTConfig.image_size={self.image_size} is not a multiple of "
                f"patch_size={self.patch_size}; patches must tile the image."
            )

    @property
    def hidden_dim(self) -> int:
        """Width of the MLP's hidden layer."""
        return self.mlp_dim or 4 * self.width

    @property
    def num_patches(self) -> int:
        """Number of patch tokens (the sequence has one more: the class token)."""
        return (self.image_size // self.patch_size) ** 2

    def build(self) -> VisionTransformer:
        return VisionTransformer(self)

    def chain_stages(self) -> list[ChainStage]:
        return chain_stages(self)


_weight_init = nn.initializers.truncated_normal(0.02)


def _dense(config: ViTConfig, features: int, name: str) -> nn.Dense:
    return dense(config, features, name, _weight_init)


class Attention(nn.Module):
    """Multi-head self-attention over all tokens: ``qkv`` (fused) then ``proj``."""

    config: ViTConfig

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        c = self.config
        qkv = _dense(c, 3 * c.width, "qkv")(x)
        query, key, value = (
            attention.split_heads(part, c.num_heads) for part in jnp.split(qkv, 3, axis=-1)
        )
        probs = attention.attention_probabilities(query, key)
        probs = nn.Dropout(c.attention_dropout_rate)(probs, deterministic=not train)
        out = _dense(c, c.width, "proj")(attention.attend(probs, value))
        return nn.Dropout(c.dropout_rate)(out, deterministic=not train)


class MLP(nn.Module):
    """``fc1`` -> GELU (exact) -> dropout -> ``fc2`` -> dropout."""

    config: ViTConfig

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        c = self.config
        h = jax.nn.gelu(_dense(c, c.hidden_dim, "fc1")(x), approximate=False)
        h = nn.Dropout(c.dropout_rate)(h, deterministic=not train)
        out = _dense(c, c.width, "fc2")(h)
        return nn.Dropout(c.dropout_rate)(out, deterministic=not train)


class Block(nn.Module):
    """One pre-LN ViT block (Eq. 2-3): ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``.

    Maps ``[batch, tokens, width]`` to the same shape; usable on its own as a stage of a
    chain, with the parameter names ``norm1``, ``attn``, ``norm2``, ``mlp``.
    """

    config: ViTConfig

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        x = x + Attention(self.config, name="attn")(
            layer_norm(self.config, "norm1")(x), train=train
        )
        return x + MLP(self.config, name="mlp")(layer_norm(self.config, "norm2")(x), train=train)


def _embed(module: nn.Module, image: jax.Array, train: bool) -> jax.Array:
    """Patch embedding, class token, position embedding, dropout (Eq. 1), in ``module``.

    ``module`` is the compact module being run (its ``config`` is a :class:`ViTConfig`);
    the parameters are its own.
    """
    c = module.config
    expected = (c.image_size, c.image_size, c.num_channels)
    if image.ndim != 4 or tuple(image.shape[1:]) != expected:
        raise ValueError(
            f"VisionTransformer expects NHWC images [batch, {', '.join(map(str, expected))}]"
            f" (the position embedding is sized for them), got {list(image.shape)}; "
            "set image_size / num_channels to match the data."
        )
    patches = nn.Conv(
        c.width,
        (c.patch_size, c.patch_size),
        strides=(c.patch_size, c.patch_size),
        padding="VALID",
        kernel_init=nn.initializers.lecun_normal(),
        dtype=c.dtype,
        param_dtype=c.param_dtype,
        name="patch_embed",
    )(image)
    batch = patches.shape[0]
    x = patches.reshape(batch, -1, c.width)
    cls_token = module.param(
        "cls_token", nn.initializers.normal(1e-6), (1, 1, c.width), c.param_dtype
    )
    pos_embed = module.param(
        "pos_embed", _weight_init, (1, c.num_patches + 1, c.width), c.param_dtype
    )
    cls_tokens = jnp.broadcast_to(cls_token.astype(c.dtype), (batch, 1, c.width))
    x = jnp.concatenate([cls_tokens, x.astype(c.dtype)], axis=1) + pos_embed.astype(c.dtype)
    return nn.Dropout(c.dropout_rate)(x, deterministic=not train)


def _head(c: ViTConfig, x: jax.Array) -> jax.Array:
    """``norm``, then the ``head`` classifier on the class token (Eq. 4); float32 logits."""
    x = layer_norm(c, "norm")(x)
    logits = _dense(c, c.num_classes, "head")(x[:, 0])
    return logits.astype(jnp.float32)


class Embedding(nn.Module):
    """The embedding as a chain stage (``patch_embed``, ``cls_token``, ``pos_embed``)."""

    config: ViTConfig

    @nn.compact
    def __call__(self, image: jax.Array, *, train: bool = False) -> jax.Array:
        return _embed(self, image, train)


class Head(nn.Module):
    """The head as a chain stage (``norm``, ``head``); float32 logits."""

    config: ViTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return _head(self.config, x)


def chain_stages(config: ViTConfig) -> list[ChainStage]:
    """:class:`Embedding`, the blocks ``blocks_{i}``, :class:`Head` (the model's names)."""
    return [
        ChainStage(Embedding(config), names=("patch_embed", "cls_token", "pos_embed")),
        *(ChainStage(Block(config), scope=f"blocks_{i}") for i in range(config.num_layers)),
        ChainStage(Head(config), names=("norm", "head")),
    ]


class VisionTransformer(nn.Module):
    """ViT classifier; returns float32 logits ``[batch, num_classes]``."""

    config: ViTConfig

    @nn.compact
    def __call__(self, image: jax.Array, *, train: bool = False) -> jax.Array:
        x = _embed(self, image, train)
        for i in range(self.config.num_layers):
            x = Block(self.config, name=f"blocks_{i}")(x, train=train)
        return _head(self.config, x)
