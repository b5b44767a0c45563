"""A multilayer perceptron classifier with equal-width hidden layers (the CPU digits job).

Built for scikit-learn's 8x8 digits, so that a ResiReduce run fits on a laptop CPU.
Its three adjacent same-shape hidden kernels form a reusable group (ResiReduce §4.1).
Parameter names: hidden_{i} and head; kernels are Flax's [in, out].
Any input shape is flattened per sample.
Layout and a calling example: docs/design.md, "MLP (models/mlp.py)".
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from resireduce_jax.models.config import ImageClassifierConfig, dense, image_batch

__all__ = ["MLPClassifier", "MLPConfig"]

# torch.nn.Linear's default weight init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
_linear_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPConfig(ImageClassifierConfig):
    """Hyperparameters of the MLP classifier (defaults: the digits job).

    Attributes:
      image_shape: ``(height, width, channels)`` of :meth:`example_batch` images; the model
        itself accepts any per-sample shape and flattens it.
      num_layers: hidden layers (ReLU), all ``width`` wide.
      width: hidden width.
      num_classes: classifier outputs.
    """

    image_shape: tuple[int, ...] = (8, 8, 1)
    num_layers: int = 4
    width: int = 256
    num_classes: int = 10

    def validate(self) -> None:
        self._require_positive("num_layers", "width", "num_classes")
        self._require_positive_tuple("image_shape")
        if len(self.image_shape) != 3:
            raise ValueError(
                f"MLPConfig.image_shape={self.image_shape} must be (height, width, channels)."
            )

    @property
    def input_dim(self) -> int:
        """Number of input features per sample."""
        return math.prod(self.image_shape)

    def build(self) -> MLPClassifier:
        return MLPClassifier(self)

    def example_batch(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        """float32 NHWC ``image`` and int32 ``label``."""
        return image_batch(batch_size, *self.image_shape)


class MLPClassifier(nn.Module):
    """``head(relu(hidden_{n-1}(... relu(hidden_0(flatten(x))))))``; float32 logits."""

    config: MLPConfig

    @nn.compact
    def __call__(self, image: jax.Array, *, train: bool = False) -> jax.Array:
        del train  # no dropout or batch statistics: training and evaluation are the same
        c = self.config
        x = image.reshape(image.shape[0], -1)
        for i in range(c.num_layers):
            x = nn.relu(dense(c, c.width, f"hidden_{i}", _linear_init)(x))
        return dense(c, c.num_classes, "head", _linear_init)(x).astype(jnp.float32)
