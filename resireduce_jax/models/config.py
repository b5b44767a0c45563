"""What every model configuration shares: dtypes, validation, example inputs, how to apply it.

Each architecture has a frozen, keyword-only dataclass derived from ModelConfig.
A configuration builds its Flax module and names its inputs, targets and mutable collections.
Invalid values raise a ValueError when the configuration is made, before any tracing.
Chain models (ResNet, GPT-2, ViT) also give their stages, with the model's own names.
The configuration's parts in detail: docs/design.md, "Model configurations
(models/config.py)".
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = [
    "ChainStage",
    "ImageClassifierConfig",
    "ModelConfig",
    "as_dtype",
    "batch_norm",
    "check_batch_size",
    "dense",
    "image_batch",
    "layer_norm",
]


def as_dtype(value: Any, field: str) -> jnp.dtype:
    """Turns ``"bfloat16"``, ``jnp.bfloat16`` or a numpy dtype into a floating ``jnp.dtype``."""
    try:
        dtype = jnp.dtype(value)
    except TypeError as error:
        raise ValueError(
            f"{field}={value!r} is not a dtype; use e.g. 'float32', 'bfloat16' or jnp.float16."
        ) from error
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{field}={value!r} must be a floating-point dtype, got {dtype}.")
    return dtype


@dataclasses.dataclass(frozen=True)
class ChainStage:
    """One stage of a model's chain form and where its variables sit in the model's.

    Attributes:
      module: a linen module mapping the previous stage's output (the model's input for
        the first stage) to its own; it takes ``train=`` when the model does.
      scope: the model's submodule this stage is (``"h_3"``): the stage's variables are
        the model's ``variables[collection][scope]``.
      names: for a stage that is not one submodule (stems, heads), the model's top-level
        entries it holds (``("conv1", "bn1")``); each ``variables[collection][name]`` is
        the stage's ``[name]``. Two stages may hold the same entry (GPT-2's embedding and
        tied head both hold ``wte``).
    """

    module: nn.Module
    scope: str | None = None
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.scope is None) == (not self.names):
            raise ValueError("A ChainStage has either a scope or top-level names, not both.")

    def select(self, tree: dict[str, Any]) -> dict[str, Any]:
        """This stage's part of one collection of the model's variables (may be empty)."""
        if self.scope is not None:
            return tree.get(self.scope, {})
        return {name: tree[name] for name in self.names if name in tree}

    def place(self, tree: dict[str, Any], stage_tree: dict[str, Any]) -> None:
        """Writes this stage's part of a collection back into the model's ``tree``.

        A top-level entry two stages hold is taken from the first (tied weights).
        """
        if self.scope is not None:
            tree[self.scope] = stage_tree
        else:
            for name, value in stage_tree.items():
                tree.setdefault(name, value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Base class of the model configurations.

    Attributes:
      dtype: computation dtype of the layers (e.g. ``bfloat16`` for mixed precision).
        Normalizations reduce in float32 and logits are returned in float32 whatever
        this is, so that losses are computed at full precision.
      param_dtype: dtype in which parameters are created and stored.
      scan_layers: apply the repeated layers with ``nn.scan`` (one set of weights with a
        leading layer axis, at :attr:`layer_scope`; :mod:`resireduce_jax.models.scan`)
        instead of writing them out. Models with a :attr:`layer_scope` only.
    """

    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    scan_layers: bool = False

    #: What the model predicts: "classification", "causal_lm" or "span_qa".
    task: ClassVar[str]
    #: Keyword arguments of ``model.apply`` filled from a batch, in call order.
    input_names: ClassVar[tuple[str, ...]]
    #: Keys of a batch that hold the targets of the loss.
    target_names: ClassVar[tuple[str, ...]]
    #: Collections to pass as ``mutable=`` to ``model.apply`` when ``train=True``.
    mutable_collections: ClassVar[tuple[str, ...]] = ()
    #: PRNG streams ``model.apply`` draws from when ``train=True`` (pass them in ``rngs=``).
    rng_names: ClassVar[tuple[str, ...]] = ()
    #: Where the repeated layers sit: ``{layer_scope}_{i}`` written out, ``{layer_scope}``
    #: scanned (``"h"``, ``"encoder/layer"``); ``None`` for models that cannot scan.
    layer_scope: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype, "dtype"))
        object.__setattr__(self, "param_dtype", as_dtype(self.param_dtype, "param_dtype"))
        # Configs arrive from ml_collections as lists; tuples keep the dataclass hashable,
        # which Flax needs for module attributes.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, list):
                object.__setattr__(self, field.name, tuple(value))
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers must be True or False, got {self.scan_layers!r}.")
        if self.scan_layers and self.layer_scope is None:
            raise ValueError(
                f"{type(self).__name__} has no repeated layers to scan; scan_layers=True "
                "applies to the GPT-2 and BERT configurations."
            )
        self.validate()

    def validate(self) -> None:
        """Raises ``ValueError`` for invalid field values (subclasses extend it)."""

    @property
    def layer_stacks(self) -> dict[str, int] | None:
        """``{layer_scope: 0}`` for a model scanned over its layers, else ``None``: the
        ``layer_stacks`` of the exchange transforms (:mod:`resireduce_jax.layer_stacks`),
        under which slice ``i`` of ``h/attn/c_attn/kernel`` is ``h/i/attn/c_attn/kernel``."""
        return {self.layer_scope: 0} if self.scan_layers else None

    def build(self) -> nn.Module:
        """The Flax module this configuration describes."""
        raise NotImplementedError

    def example_batch(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of one batch: the inputs of ``model.apply`` and the targets."""
        raise NotImplementedError

    def chain_stages(self) -> list[ChainStage]:
        """The model as a chain of stages (stem or embedding, blocks, head).

        Applying the stages' modules in turn, each to the previous output and with its part
        of the model's variables (:meth:`ChainStage.select`), computes the model's output.

        Raises:
          ValueError: for a model that is not a chain of single-input stages.
        """
        raise ValueError(
            f"{type(self).__name__} models have no sequential form; the chain-able models are "
            "the ResNet, GPT-2 and ViT configurations."
        )

    # Helpers for subclasses' validate().

    def _require_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"{type(self).__name__}.{name} must be a positive integer, got {value!r}."
                )

    def _require_rate(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(
                    f"{type(self).__name__}.{name} must be a probability in [0, 1), got {value!r}."
                )

    def _require_positive_tuple(self, name: str) -> None:
        value = getattr(self, name)
        if (
            not isinstance(value, tuple)
            or not value
            or not all(isinstance(v, int) and v >= 1 for v in value)
        ):
            raise ValueError(
                f"{type(self).__name__}.{name} must be a non-empty tuple of positive "
                f"integers, got {value!r}."
            )

    def _require_divisible(self, width_name: str, heads_name: str) -> None:
        width, heads = getattr(self, width_name), getattr(self, heads_name)
        if width % heads:
            raise ValueError(
                f"{type(self).__name__}: {width_name}={width} is not divisible by "
                f"{heads_name}={heads}; every attention head needs the same width."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageClassifierConfig(ModelConfig):
    """Base class of the image classifiers: ``model.apply(image=...)`` with the class
    ``label`` as target.

    Adds no field; :meth:`example_batch` gives square NHWC images of the subclass's fields
    ``image_size`` (height and width) and ``num_channels`` (a subclass with other image
    fields overrides it).
    """

    task: ClassVar[str] = "classification"
    input_names: ClassVar[tuple[str, ...]] = ("image",)
    target_names: ClassVar[tuple[str, ...]] = ("label",)

    def example_batch(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        """float32 NHWC ``image`` and int32 ``label``."""
        return image_batch(batch_size, self.image_size, self.image_size, self.num_channels)


def image_batch(
    batch_size: int, height: int, width: int, channels: int
) -> dict[str, jax.ShapeDtypeStruct]:
    """NHWC float32 images under ``"image"`` and int32 class labels under ``"label"``."""
    check_batch_size(batch_size)
    return {
        "image": jax.ShapeDtypeStruct((batch_size, height, width, channels), jnp.float32),
        "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }


def check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")


# Layers in a configuration's dtypes. ``config`` is a model configuration, or a module
# with the same fields (``dtype``, ``param_dtype``, and the fields each layer names).


def dense(config: Any, features: int, name: str, kernel_init: Any) -> nn.Dense:
    """A dense layer computing in ``config.dtype`` with ``config.param_dtype`` parameters."""
    return nn.Dense(
        features,
        kernel_init=kernel_init,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        name=name,
    )


def layer_norm(config: Any, name: str) -> nn.LayerNorm:
    """LayerNorm with ``config.layer_norm_epsilon``, in the config's dtypes."""
    return nn.LayerNorm(
        epsilon=config.layer_norm_epsilon,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        name=name,
    )


def batch_norm(config: Any, train: bool, name: str) -> nn.BatchNorm:
    """BatchNorm with ``config.bn_momentum``, ``bn_epsilon`` and ``bn_axis_name``, in the
    config's dtypes: batch statistics when ``train``, the running averages otherwise."""
    return nn.BatchNorm(
        use_running_average=not train,
        momentum=config.bn_momentum,
        epsilon=config.bn_epsilon,
        axis_name=config.bn_axis_name,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        name=name,
    )
