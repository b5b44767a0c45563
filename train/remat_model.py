"""``remat.budget``: train a sequential zoo model under an activation-memory budget.

With remat.budget set, the model runs as its chain of stages under a rotor plan.
Rotor: Beaumont et al., ACM TOMS 2024 (https://arxiv.org/abs/1911.13214); docs/remat.md.
The plan is chosen once, before training, on one worker's shapes.
The budget is one worker's compiled peak of value_and_grad of the model.
Variables are the monolithic model's, so grouping rules and checkpoints carry over.
With dropout the masks differ from the model's.
Details: docs/design.md, "Training under a remat budget (train/remat_model.py)".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from resireduce_jax import remat

__all__ = ["SequentialModel", "budget_value", "plan_sequential_model"]


def budget_value(budget: str) -> float | str:
    """``remat.budget`` as :func:`resireduce_jax.remat.parse_budget` reads it.

    A plain number is a fraction of the no-remat peak (``<= 1``) or bytes (``> 1``);
    strings with a unit (``"2GiB"``) or a percentage (``"60%"``) pass through.
    """
    try:
        return float(budget)
    except ValueError:
        return budget


@dataclasses.dataclass(frozen=True)
class SequentialModel:
    """A :class:`RotorSequential` behind the zoo models' calling convention and names.

    :class:`train.tasks.Task` calls ``model.init(key, tokens=...)`` and
    ``model.apply(variables, tokens=..., train=..., rngs=..., mutable=...)`` with the
    monolithic model's variables; the chain takes its single input positionally and its
    variables per layer (``chain`` translates both ways).
    """

    rotor: remat.RotorSequential
    input_name: str
    model: Any
    chain: remat.zoo.ModelChain

    def _input(self, inputs: dict[str, Any]) -> Any:
        if set(inputs) - {self.input_name} or self.input_name not in inputs:
            raise ValueError(
                f"The sequential model takes one input, {self.input_name!r}; got {sorted(inputs)}."
            )
        return inputs[self.input_name]

    def init(self, key: jax.Array, **inputs: Any) -> dict[str, Any]:
        return self.model.init(key, self._input(inputs), train=False)

    def apply(self, variables, *, rngs=None, mutable=False, train: bool = False, **inputs):
        out = self.rotor.apply(
            self.chain.chain_variables(variables),
            self._input(inputs),
            rngs=rngs,
            mutable=mutable,
            train=train,
        )
        if mutable is False or mutable == []:
            return out
        outputs, updates = out
        return outputs, self.chain.model_variables(updates)


def plan_sequential_model(
    model_name: str,
    model_config: Any,
    model_overrides: dict[str, Any],
    budget: str,
    example_inputs: dict[str, Any],
) -> tuple[SequentialModel, remat.RematChoice]:
    """Builds the chain form of a zoo model and plans it for ``budget``.

    Args:
      model_name: the zoo name (``config.model.name``).
      model_config: its configuration (inputs, mutable collections and PRNG streams).
      model_overrides: the configuration fields that were overridden (``model.overrides``).
      budget: ``config.remat.budget``.
      example_inputs: one worker's model inputs (arrays or ``ShapeDtypeStruct``s).

    Returns:
      ``(model, choice)``: the model whose gradient follows the chosen plan, and the
      choice (compiled peak, FLOPs overhead, plan) for the run's report.

    Raises:
      ValueError: for a model that is not a ResNet, GPT-2 or ViT configuration, or a
        budget below the smallest compiled peak any plan reaches (the message states it).
    """
    (input_name,) = model_config.input_names
    chain = remat.zoo.model_chain(model_name, **model_overrides)
    rotor = remat.RotorSequential(chain.layers)
    model = model_config.build()
    x = jax.ShapeDtypeStruct(example_inputs[input_name].shape, example_inputs[input_name].dtype)
    variables = chain.chain_variables(
        jax.eval_shape(lambda k, x: model.init(k, x, train=False), jax.random.key(0), x)
    )
    rngs = {name: jax.random.key(i) for i, name in enumerate(model_config.rng_names)}
    mutable = list(model_config.mutable_collections) or False
    planned, choice = rotor.with_budget(
        variables,
        x,
        budget_value(budget),
        rngs=rngs or None,
        mutable=mutable,
        train=True,
    )
    return SequentialModel(planned, input_name, model, chain), choice
