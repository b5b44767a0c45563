"""Models of :mod:`resireduce_jax.models` as chains for :class:`RotorSequential`.

The chain models (ResNet, GPT-2, ViT) give their own stages: stem, blocks, head.
This module runs them as a RotorSequential and maps variables between the two layouts.
chain_variables and model_variables translate names, so training keeps the model's names.
Tied weights (GPT-2's wte) go to every stage that uses them; their gradients add up.
A calling example: docs/design.md, "Zoo chains (remat/zoo.py)".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn

from resireduce_jax.models import get_config
from resireduce_jax.models.config import ChainStage

__all__ = ["ModelChain", "model_chain", "sequential_layers"]


def _layer_name(i: int) -> str:
    # RotorSequential's naming of layer i's variables.
    return f"layers_{i}"


@dataclasses.dataclass(frozen=True)
class ModelChain:
    """A model's stages, and the map between its variables and its chain's.

    Attributes:
      stages: the model's :class:`ChainStage` list.
    """

    stages: tuple[ChainStage, ...]

    def __post_init__(self):
        object.__setattr__(self, "stages", tuple(self.stages))

    @property
    def layers(self) -> list[nn.Module]:
        """The stages' modules, for :class:`RotorSequential`."""
        return [stage.module for stage in self.stages]

    def chain_variables(self, variables: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """The model's variables laid out for :class:`RotorSequential` (``layers_<i>``)."""
        out: dict[str, dict[str, Any]] = {}
        for collection, tree in variables.items():
            layers = {}
            for i, stage in enumerate(self.stages):
                part = stage.select(tree)
                if part:
                    layers[_layer_name(i)] = part
            out[collection] = layers
        return out

    def model_variables(self, chain_variables: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """:class:`RotorSequential` variables (or updates) under the model's names.

        An entry two stages hold (tied weights) is taken from the first of them.
        """
        out: dict[str, dict[str, Any]] = {}
        for collection, layers in chain_variables.items():
            tree: dict[str, Any] = {}
            for i, stage in enumerate(self.stages):
                if _layer_name(i) in layers:
                    stage.place(tree, layers[_layer_name(i)])
            out[collection] = tree
        return out


def model_chain(name: str, **overrides: Any) -> ModelChain:
    """The chain form of model ``name`` of :data:`resireduce_jax.models.MODELS`.

    Args:
      name: a chain-able model (``"resnet50_cifar"``, ``"gpt2_small"``, ``"vit_s16"`` ...).
      **overrides: configuration fields to replace (see
        :func:`resireduce_jax.models.get_config`).

    Raises:
      ValueError: for a model that has no sequential form (``digits_mlp``, BERT, VGG).
    """
    return ModelChain(tuple(get_config(name, **overrides).chain_stages()))


def sequential_layers(name: str, **overrides: Any) -> Sequence[nn.Module]:
    """The layers of model ``name`` as a chain: ``model_chain(name, ...).layers``."""
    return model_chain(name, **overrides).layers
