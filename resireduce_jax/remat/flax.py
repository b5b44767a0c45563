"""A sequence of Flax linen layers run as a rotor-checkpointed chain.

RotorSequential turns each layer's apply into a pure stage of a chain.
The planner can then measure the stages and the executor wrap them in jax.checkpoint.
It mirrors a linen module's init and apply; with_budget picks the plan.
Variables are {collection: {"layers_<i>": ...}}; the gradient is taken for params.
Other collections and per-layer PRNG keys are closed over, so recomputation matches.
A calling example and the variable layout: docs/design.md, "RotorSequential
(remat/flax.py)" and docs/remat.md.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from resireduce_jax.remat.budget_search import Budget, ChainPlanner, RematChoice
from resireduce_jax.remat.costs import chain_shapes
from resireduce_jax.remat.executor import Loss, apply_plan, sum_of_outputs
from resireduce_jax.remat.solver import Plan

__all__ = ["RotorSequential"]

Mutable = bool | str | Sequence[str]


def _layer_name(i: int) -> str:
    return f"layers_{i}"


def _accepted_kwargs(layer: nn.Module, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``layer.__call__`` accepts (all of them if it takes ``**kw``)."""
    parameters = inspect.signature(type(layer).__call__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in parameters}


def _as_rng_dict(rngs: Any) -> dict[str, jax.Array]:
    if rngs is None:
        return {}
    if isinstance(rngs, Mapping):
        return dict(rngs)
    return {"params": rngs}


def _layer_keys(streams: Mapping[str, jax.Array], num_layers: int) -> dict[str, jax.Array]:
    """One key per layer and stream: ``jax.random.split(key, num_layers)``."""
    return {name: jax.random.split(key, num_layers) for name, key in streams.items()}


def _concrete(tree: Any) -> Any:
    """Zeros for abstract leaves (small non-parameter collections during planning)."""
    return jax.tree.map(
        lambda a: jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a, tree
    )


@dataclasses.dataclass(frozen=True)
class RotorSequential:
    """Flax linen layers applied in sequence, with a rotor checkpointing plan.

    Attributes:
      layers: the linen modules; layer ``i`` maps the output of layer ``i - 1``.
      plan: the :class:`Plan` the gradient follows; ``None`` checkpoints nothing.
      sequence_backward: run each layer's backward as one unit (see
        :func:`resireduce_jax.remat.apply_plan`).
    """

    layers: tuple[nn.Module, ...]
    plan: Plan | None = None
    sequence_backward: bool = True

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ValueError("RotorSequential needs at least one layer.")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, nn.Module):
                raise ValueError(f"Layer {i} is not a flax.linen Module: {layer!r}.")
        if self.plan is not None and self.plan.num_stages != len(self.layers):
            raise ValueError(
                f"The plan is for {self.plan.num_stages} stages but there are "
                f"{len(self.layers)} layers."
            )

    def init(self, rngs: Any, x: Any, **kwargs: Any) -> dict[str, dict[str, Any]]:
        """Initialises every layer in turn on the previous layer's output.

        Args:
          rngs: a PRNG key (for ``params``) or a dict of keys per stream.
          x: an example input.
          **kwargs: keyword arguments for the layers (passed to those that accept them).

        Returns:
          ``{collection: {"layers_<i>": variables}}``.
        """
        streams = _layer_keys(_as_rng_dict(rngs), len(self.layers))
        variables: dict[str, dict[str, Any]] = {}
        h = x
        for i, layer in enumerate(self.layers):
            layer_rngs = {name: keys[i] for name, keys in streams.items()}
            h, layer_vars = layer.init_with_output(layer_rngs, h, **_accepted_kwargs(layer, kwargs))
            for collection, value in layer_vars.items():
                variables.setdefault(collection, {})[_layer_name(i)] = value
        return variables

    def _chain(
        self,
        variables: Mapping[str, Any],
        rngs: Any,
        mutable: Mutable,
        kwargs: Mapping[str, Any],
    ) -> tuple[list[Callable[[Any, Any], Any]], list[Any]]:
        """Pure stages ``(params_i, carry) -> carry`` and the per-layer params."""
        streams = _layer_keys(_as_rng_dict(rngs), len(self.layers))
        has_updates = mutable is not False and mutable != []
        stages, params = [], []
        for i, layer in enumerate(self.layers):
            name = _layer_name(i)
            others = {
                c: tree[name] for c, tree in variables.items() if c != "params" and name in tree
            }
            layer_rngs = {s: keys[i] for s, keys in streams.items()}
            layer_kwargs = _accepted_kwargs(layer, kwargs)
            params.append(variables.get("params", {}).get(name, {}))

            def stage(p, carry, layer=layer, others=others, rngs=layer_rngs, kw=layer_kwargs):
                h, updates = carry if has_updates else (carry, None)
                out = layer.apply(
                    {"params": p, **others},
                    h,
                    rngs=rngs or None,
                    mutable=mutable if has_updates else False,
                    **kw,
                )
                if not has_updates:
                    return out
                h, layer_updates = out
                return h, (*updates, layer_updates)

            stage.__name__ = f"{name}_{type(layer).__name__}"
            stages.append(stage)
        return stages, params

    def apply(
        self,
        variables: Mapping[str, Any],
        x: Any,
        *,
        rngs: Any = None,
        mutable: Mutable = False,
        **kwargs: Any,
    ) -> Any:
        """Runs the layers; the gradient of the result follows :attr:`plan`.

        Args:
          variables: as returned by :meth:`init`.
          x: the input.
          rngs: a dict of PRNG keys per stream (e.g. ``{"dropout": key}``); layer ``i``
            uses ``jax.random.split(key, len(layers))[i]``.
          mutable: collections the layers may update (linen's ``mutable``).
          **kwargs: keyword arguments for the layers (e.g. ``train=True``).

        Returns:
          The output, or ``(output, updated_collections)`` when ``mutable`` is set.
        """
        stages, params = self._chain(variables, rngs, mutable, kwargs)
        plan = self.plan or Plan.unwrapped(len(self.layers))
        fn = apply_plan(stages, plan, sequence_backward=self.sequence_backward)
        has_updates = mutable is not False and mutable != []
        out = fn(params, (x, ()) if has_updates else x)
        if not has_updates:
            return out
        h, layer_updates = out
        updates: dict[str, dict[str, Any]] = {}
        for i, layer_update in enumerate(layer_updates):
            for collection, value in layer_update.items():
                updates.setdefault(collection, {})[_layer_name(i)] = value
        return h, updates

    def activation_shapes(
        self,
        variables: Mapping[str, Any],
        x: Any,
        *,
        rngs: Any = None,
        mutable: Mutable = False,
        **kwargs: Any,
    ) -> list[Any]:
        """The activations between the layers, ``[x, h_1, ..., h_L]``, as
        ``jax.ShapeDtypeStruct``s (``jax.eval_shape``: nothing is computed; the updates of
        ``mutable`` collections are left out). Arguments as for :meth:`planner`."""
        others = {c: _concrete(tree) for c, tree in variables.items() if c != "params"}
        concrete_vars = {**others, "params": variables.get("params", {})}
        stages, params = self._chain(concrete_vars, rngs, mutable, kwargs)
        if mutable is False or mutable == []:
            return chain_shapes(stages, params, x)
        return [h for h, _ in chain_shapes(stages, params, (x, ()))]

    def planner(
        self,
        variables: Mapping[str, Any],
        x: Any,
        *,
        loss: Loss | None = None,
        rngs: Any = None,
        mutable: Mutable = False,
        slots: int = 500,
        time: Literal["flops", "measured"] = "flops",
        **kwargs: Any,
    ) -> ChainPlanner:
        """A :class:`ChainPlanner` for these layers (parameters may be abstract).

        The budget then refers to the compiled peak of
        ``jax.value_and_grad(lambda params: loss(apply(...)))`` w.r.t. the ``params``
        collection; ``loss`` maps the model output to a scalar (default: its sum).
        """
        others = {c: _concrete(tree) for c, tree in variables.items() if c != "params"}
        concrete_vars = {**others, "params": variables.get("params", {})}
        stages, params = self._chain(concrete_vars, rngs, mutable, kwargs)
        has_updates = mutable is not False and mutable != []
        if has_updates:
            output_loss = sum_of_outputs if loss is None else loss

            def chain_loss(carry):
                return output_loss(carry[0])

            carry = (x, ())
        else:
            chain_loss, carry = loss, x
        return ChainPlanner(
            stages,
            params,
            carry,
            loss=chain_loss,
            slots=slots,
            time=time,
            stage_names=[type(layer).__name__ for layer in self.layers],
            sequence_backward=self.sequence_backward,
        )

    def with_budget(
        self,
        variables: Mapping[str, Any],
        x: Any,
        budget: Budget,
        *,
        loss: Loss | None = None,
        rngs: Any = None,
        mutable: Mutable = False,
        search: Literal["bisect", "scan"] = "bisect",
        slots: int = 500,
        time: Literal["flops", "measured"] = "flops",
        **kwargs: Any,
    ) -> tuple[RotorSequential, RematChoice]:
        """A copy whose plan is the fastest whose compiled gradient peak fits ``budget``.

        Args:
          variables: as returned by :meth:`init` (``params`` may be ``ShapeDtypeStruct``s).
          x: an example input (arrays or ``ShapeDtypeStruct``s).
          budget: bytes, a fraction of the no-remat compiled peak, or a string such as
            ``"2GiB"`` / ``"60%"`` (see :func:`resireduce_jax.remat.parse_budget`).
          loss: maps the model output to the differentiated scalar (default: its sum).
          rngs, mutable, **kwargs: as for :meth:`apply` in the training step.
          search: ``"bisect"`` or ``"scan"`` (see :class:`ChainPlanner`).
          slots: memory slots of the dynamic program.
          time: ``"flops"`` or ``"measured"`` stage times.

        Returns:
          ``(model_with_plan, choice)``.

        Raises:
          ValueError: if the budget is below the smallest reachable compiled peak (the
            message states it).
        """
        planner = self.planner(
            variables,
            x,
            loss=loss,
            rngs=rngs,
            mutable=mutable,
            slots=slots,
            time=time,
            **kwargs,
        )
        choice = planner.select(budget, search=search)
        return dataclasses.replace(self, plan=choice.plan), choice
