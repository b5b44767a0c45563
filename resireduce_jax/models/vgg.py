"""VGG with batch normalization, in torchvision's ``vgg19_bn`` layout.

Simonyan & Zisserman, "Very Deep Convolutional Networks for Large-Scale Image Recognition",
ICLR 2015 (https://arxiv.org/abs/1409.1556), configuration E with BatchNorm.
The 1000-class classifier is the default: the ResiReduce paper's model size implies it.
On 32x32 images the adaptive pool replicates the last pixel to 7x7, as torch does.
Parameter names are torchvision's indices with "_"; kernels are HWIO and [in, out].
Names, layout and a calling example: docs/design.md, "VGG (models/vgg.py)".
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from resireduce_jax.models.config import ImageClassifierConfig, batch_norm, dense

__all__ = ["VGG", "VGGConfig", "adaptive_avg_pool", "feature_layout"]

# torchvision's VGG init: kaiming_normal_(fan_out, relu) for convs, N(0, 0.01) for linears.
_conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
_linear_init = nn.initializers.normal(0.01)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VGGConfig(ImageClassifierConfig):
    """Hyperparameters of a VGG-BN network (defaults: torchvision's vgg19_bn on 32x32 input).

    Attributes:
      num_classes: classifier outputs.
      stage_depths: 3x3 convolutions per stage (VGG-19: 2, 2, 4, 4, 4).
      width: channels of the first stage; stage ``s`` has ``width * min(2**s, 8)``
        (64, 128, 256, 512, 512).
      classifier_width: width of the two hidden fully connected layers.
      pool_size: side of the adaptive average pool before the classifier.
      dropout_rate: dropout after each hidden fully connected layer.
      image_size: input height and width of :meth:`example_batch`; at least
        ``2 ** len(stage_depths)`` so that every max-pool has a 2x2 window.
      num_channels: input channels.
      bn_momentum / bn_epsilon / bn_axis_name: BatchNorm settings (see ResNetConfig).
    """

    num_classes: int = 1000
    stage_depths: tuple[int, ...] = (2, 2, 4, 4, 4)
    width: int = 64
    classifier_width: int = 4096
    pool_size: int = 7
    dropout_rate: float = 0.5
    image_size: int = 32
    num_channels: int = 3
    bn_momentum: float = 0.9
    bn_epsilon: float = 1e-5
    bn_axis_name: str | None = None

    mutable_collections: ClassVar[tuple[str, ...]] = ("batch_stats",)
    rng_names: ClassVar[tuple[str, ...]] = ("dropout",)

    def validate(self) -> None:
        self._require_positive(
            "num_classes", "width", "classifier_width", "pool_size", "image_size", "num_channels"
        )
        self._require_positive_tuple("stage_depths")
        self._require_rate("dropout_rate")
        if not 0.0 <= self.bn_momentum < 1.0:
            raise ValueError(f"VGGConfig.bn_momentum must be in [0, 1), got {self.bn_momentum}.")
        smallest = 2 ** len(self.stage_depths)
        if self.image_size < smallest:
            raise ValueError(
                f"VGGConfig.image_size={self.image_size} is too small for "
                f"{len(self.stage_depths)} 2x2 max-pools; use at least {smallest}."
            )

    def stage_channels(self, stage: int) -> int:
        """Output channels of the convolutions of ``stage`` (0-based)."""
        return self.width * min(2**stage, 8)

    def build(self) -> VGG:
        return VGG(self)


def feature_layout(stage_depths: tuple[int, ...]) -> list[tuple[str, int]]:
    """torchvision's ``features`` sequence as ``(kind, index)`` pairs.

    Each conv contributes conv, BatchNorm and ReLU (three indices), each stage ends with a
    max-pool (one index): ``[("conv", 0), ("bn", 1), ("relu", 2), ("conv", 3), ...]``.
    """
    layout, index = [], 0
    for depth in stage_depths:
        for _ in range(depth):
            layout += [("conv", index), ("bn", index + 1), ("relu", index + 2)]
            index += 3
        layout.append(("pool", index))
        index += 1
    return layout


def _adaptive_pool_matrix(in_size: int, out_size: int) -> np.ndarray:
    """``[out, in]`` averaging weights of torch's adaptive pooling along one axis.

    Output cell ``i`` averages inputs ``floor(i * in / out)`` to ``ceil((i + 1) * in / out)``
    (exclusive), so windows may overlap and an input smaller than the output is replicated.
    """
    weights = np.zeros((out_size, in_size), np.float32)
    for i in range(out_size):
        start = (i * in_size) // out_size
        end = -((-(i + 1) * in_size) // out_size)
        weights[i, start:end] = 1.0 / (end - start)
    return weights


def adaptive_avg_pool(x: jax.Array, output_size: int) -> jax.Array:
    """``torch.nn.AdaptiveAvgPool2d(output_size)`` for NHWC arrays.

    Args:
      x: ``[batch, height, width, channels]``.
      output_size: side of the square output.

    Returns:
      ``[batch, output_size, output_size, channels]`` in ``x.dtype``.
    """
    x = jnp.asarray(x)
    rows = jnp.asarray(_adaptive_pool_matrix(x.shape[1], output_size), x.dtype)
    cols = jnp.asarray(_adaptive_pool_matrix(x.shape[2], output_size), x.dtype)
    return jnp.einsum("ih,bhwc,jw->bijc", rows, x, cols)


class VGG(nn.Module):
    """VGG-BN classifier; returns float32 logits ``[batch, num_classes]``."""

    config: VGGConfig

    @nn.compact
    def __call__(self, image: jax.Array, *, train: bool = False) -> jax.Array:
        c = self.config
        smallest = 2 ** len(c.stage_depths)
        if image.ndim != 4 or image.shape[-1] != c.num_channels or min(image.shape[1:3]) < smallest:
            raise ValueError(
                f"VGG expects NHWC images with {c.num_channels} channels and sides of at "
                f"least {smallest}, got shape {list(image.shape)}."
            )
        x = image
        stage = 0
        for kind, index in feature_layout(c.stage_depths):
            if kind == "conv":
                x = nn.Conv(
                    c.stage_channels(stage),
                    (3, 3),
                    padding=((1, 1), (1, 1)),
                    kernel_init=_conv_init,
                    dtype=c.dtype,
                    param_dtype=c.param_dtype,
                    name=f"features_{index}",
                )(x)
            elif kind == "bn":
                x = batch_norm(c, train, f"features_{index}")(x)
            elif kind == "relu":
                x = nn.relu(x)
            else:
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
                stage += 1
        x = adaptive_avg_pool(x, c.pool_size)
        x = x.reshape(x.shape[0], -1)
        for index, features in ((0, c.classifier_width), (3, c.classifier_width)):
            x = dense(c, features, f"classifier_{index}", _linear_init)(x)
            x = nn.Dropout(c.dropout_rate)(nn.relu(x), deterministic=not train)
        return dense(c, c.num_classes, "classifier_6", _linear_init)(x).astype(jnp.float32)
