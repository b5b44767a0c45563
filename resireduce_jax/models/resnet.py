"""ResNet with bottleneck blocks; ResNet-50 in the CIFAR layout by default.

He et al., "Deep Residual Learning for Image Recognition", CVPR 2016
(https://arxiv.org/abs/1512.03385): bottleneck blocks in four stages of 3/4/6/3.
As in torchvision, a stage's stride sits on the 3x3 conv ("ResNet v1.5").
stem="cifar" (default) uses a 3x3/1 stem for 32x32 images; stem="imagenet" is torchvision's.
Parameter names follow torchvision; conv kernels are HWIO and have no bias.
bn_axis_name names the mesh axis for synchronized BatchNorm.
Names, sizes and a calling example: docs/design.md, "ResNet (models/resnet.py)".
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from resireduce_jax.models.config import ChainStage, ImageClassifierConfig, batch_norm, dense

__all__ = ["EXPANSION", "Bottleneck", "Head", "ResNet", "ResNetConfig", "Stem", "chain_stages"]

#: Output channels of a bottleneck block per channel of its 3x3 conv (He et al. 2016, Fig. 5).
EXPANSION = 4

# torchvision: kaiming_normal_(mode="fan_out", nonlinearity="relu") for convolutions.
_conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
# torch.nn.Linear's default weight init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
_linear_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResNetConfig(ImageClassifierConfig):
    """Hyperparameters of a bottleneck ResNet (defaults: ResNet-50 for CIFAR-100).

    Attributes:
      num_classes: classifier outputs.
      stage_sizes: bottleneck blocks per stage (ResNet-50: 3, 4, 6, 3).
      width: 3x3-conv channels of the first stage (64); stage ``s`` uses ``width * 2**s``
        and outputs ``4`` times that.
      stem: ``"cifar"`` (3x3/1 conv, no max-pool) or ``"imagenet"`` (7x7/2 conv, 3x3/2
        max-pool).
      image_size: input height and width of :meth:`example_batch`.
      num_channels: input channels.
      bn_momentum: running-statistics decay (``1 - torch momentum``; 0.9 = torch's 0.1).
      bn_epsilon: BatchNorm epsilon.
      bn_axis_name: mesh axis to average batch statistics over (synchronized BatchNorm);
        ``None`` keeps them per worker.
    """

    num_classes: int = 100
    stage_sizes: tuple[int, ...] = (3, 4, 6, 3)
    width: int = 64
    stem: str = "cifar"
    image_size: int = 32
    num_channels: int = 3
    bn_momentum: float = 0.9
    bn_epsilon: float = 1e-5
    bn_axis_name: str | None = None

    mutable_collections: ClassVar[tuple[str, ...]] = ("batch_stats",)

    def validate(self) -> None:
        self._require_positive("num_classes", "width", "image_size", "num_channels")
        self._require_positive_tuple("stage_sizes")
        if self.stem not in ("cifar", "imagenet"):
            raise ValueError(
                f"ResNetConfig.stem={self.stem!r}; choose 'cifar' (3x3/1 conv, no pooling) "
                "or 'imagenet' (7x7/2 conv and 3x3/2 max-pool)."
            )
        if not 0.0 <= self.bn_momentum < 1.0:
            raise ValueError(f"ResNetConfig.bn_momentum must be in [0, 1), got {self.bn_momentum}.")

    def build(self) -> ResNet:
        return ResNet(self)

    def chain_stages(self) -> list[ChainStage]:
        return chain_stages(self)


def _same_padding(kernel: int) -> tuple[tuple[int, int], tuple[int, int]]:
    # torch's symmetric padding (k // 2 on each side); Flax's "SAME" pads asymmetrically
    # for stride 2, which would shift the sampling grid relative to the reference.
    return ((kernel // 2, kernel // 2), (kernel // 2, kernel // 2))


def _conv(config: Any, features: int, kernel: int, strides: int, name: str) -> nn.Conv:
    """A bias-free ``kernel x kernel`` convolution with torch's padding, in ``config``'s
    dtypes (a :class:`ResNetConfig` or a :class:`Bottleneck`)."""
    return nn.Conv(
        features,
        (kernel, kernel),
        strides=(strides, strides),
        padding=_same_padding(kernel),
        use_bias=False,
        kernel_init=_conv_init,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        name=name,
    )


class Bottleneck(nn.Module):
    """Bottleneck block: 1x1 -> 3x3 (stride here) -> 1x1 (x4), each followed by BatchNorm.

    ``relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + shortcut(x))``, where the
    shortcut is ``downsample_bn(downsample_conv(x))`` (1x1, same stride) when the stride is
    not 1 or the channel count changes, else ``x``. Maps ``[batch, h, w, c]`` to
    ``[batch, h / strides, w / strides, EXPANSION * features]``; usable on its own as a
    stage of a chain.

    Attributes:
      features: channels of the 3x3 conv (the block outputs ``EXPANSION * features``).
      strides: stride of the 3x3 conv and of the projection shortcut.
      dtype / param_dtype: computation and parameter dtypes.
      bn_momentum / bn_epsilon / bn_axis_name: BatchNorm settings (see ResNetConfig).
    """

    features: int
    strides: int = 1
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    bn_momentum: float = 0.9
    bn_epsilon: float = 1e-5
    bn_axis_name: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        out_features = EXPANSION * self.features
        y = nn.relu(batch_norm(self, train, "bn1")(_conv(self, self.features, 1, 1, "conv1")(x)))
        y = _conv(self, self.features, 3, self.strides, "conv2")(y)
        y = nn.relu(batch_norm(self, train, "bn2")(y))
        y = batch_norm(self, train, "bn3")(_conv(self, out_features, 1, 1, "conv3")(y))
        shortcut = x
        if self.strides != 1 or x.shape[-1] != out_features:
            shortcut = _conv(self, out_features, 1, self.strides, "downsample_conv")(x)
            shortcut = batch_norm(self, train, "downsample_bn")(shortcut)
        return nn.relu(y + shortcut)


def _stem(c: ResNetConfig, image: jax.Array, train: bool) -> jax.Array:
    """``relu(bn1(conv1(image)))`` (and the ImageNet stem's max-pool), in the caller's scope."""
    if image.ndim != 4 or image.shape[-1] != c.num_channels:
        raise ValueError(
            f"ResNet expects NHWC images with {c.num_channels} channels, got shape "
            f"{list(image.shape)}."
        )
    kernel, stride = (3, 1) if c.stem == "cifar" else (7, 2)
    x = nn.relu(batch_norm(c, train, "bn1")(_conv(c, c.width, kernel, stride, "conv1")(image)))
    if c.stem == "imagenet":
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    return x


def _head(c: ResNetConfig, x: jax.Array) -> jax.Array:
    """Global average pooling and the ``fc`` classifier, in the caller's scope."""
    logits = dense(c, c.num_classes, "fc", _linear_init)(jnp.mean(x, axis=(1, 2)))
    return logits.astype(jnp.float32)


def _blocks(c: ResNetConfig) -> list[tuple[str, dict[str, Any]]]:
    """``(name, Bottleneck fields)`` of every block, in order."""
    settings = dict(
        dtype=c.dtype,
        param_dtype=c.param_dtype,
        bn_momentum=c.bn_momentum,
        bn_epsilon=c.bn_epsilon,
        bn_axis_name=c.bn_axis_name,
    )
    return [
        (
            f"layer{stage + 1}_{block}",
            dict(features=c.width * 2**stage, strides=2 if stage > 0 and block == 0 else 1)
            | settings,
        )
        for stage, count in enumerate(c.stage_sizes)
        for block in range(count)
    ]


class Stem(nn.Module):
    """The stem as a chain stage: image to first-stage input (``conv1``, ``bn1``)."""

    config: ResNetConfig

    @nn.compact
    def __call__(self, image: jax.Array, *, train: bool = False) -> jax.Array:
        return _stem(self.config, image, train)


class Head(nn.Module):
    """The head as a chain stage: pooling and ``fc``; float32 logits."""

    config: ResNetConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return _head(self.config, x)


def chain_stages(config: ResNetConfig) -> list[ChainStage]:
    """:class:`Stem`, one :class:`Bottleneck` per block, :class:`Head` (ResNet's names)."""
    return [
        ChainStage(Stem(config), names=("conv1", "bn1")),
        *(ChainStage(Bottleneck(**fields), scope=name) for name, fields in _blocks(config)),
        ChainStage(Head(config), names=("fc",)),
    ]


class ResNet(nn.Module):
    """Bottleneck ResNet classifier; returns float32 logits ``[batch, num_classes]``."""

    config: ResNetConfig

    @nn.compact
    def __call__(self, image: jax.Array, *, train: bool = False) -> jax.Array:
        x = _stem(self.config, image, train)
        for name, fields in _blocks(self.config):
            x = Bottleneck(name=name, **fields)(x, train=train)
        return _head(self.config, x)
