"""Running a chain under a checkpointing plan: nested ``jax.checkpoint``, and what it compiles to.

Each Checkpoint item of a plan becomes one jax.checkpoint around its stages.
Under jax.grad, stage i then runs its forward 1 + depth(i) times.
Each stage's backward runs as one unit (a custom_vjp with a barrier), as rotor assumes.
Otherwise XLA:CPU postpones every weight gradient to the end and keeps activations alive.
compile_gradient checks that the barriers survived XLA:CPU's passes.
Why the backward is sequenced, and the barriers: docs/design.md, "Rotor's executor
(remat/executor.py)" and "Remat barriers and cse_barrier_expander".
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from resireduce_jax import hlo
from resireduce_jax.remat.costs import Stage, chain_shapes
from resireduce_jax.remat.solver import Checkpoint, Plan, PlanItem, RunStage

__all__ = [
    "CompiledGradient",
    "apply_plan",
    "compile_gradient",
    "gradient_program",
    "sequenced_loss",
    "sequenced_stage",
    "sum_of_outputs",
]

Loss = Callable[[Any], jax.Array]


def _is_primal(leaf: Any) -> bool:
    return isinstance(leaf, CustomVJPPrimal)


def _instantiate_zeros(tree: Any) -> Any:
    """Replaces ``SymbolicZero`` cotangents by zero arrays (``float0`` for integer outputs)."""

    def instantiate(leaf):
        if not isinstance(leaf, SymbolicZero):
            return leaf
        if leaf.aval.dtype == jax.dtypes.float0:
            return np.zeros(leaf.aval.shape, jax.dtypes.float0)
        zeros = jnp.zeros(leaf.aval.shape, leaf.aval.dtype)
        # Inside shard_map a cotangent varies over the axes its primal varies over (e.g.
        # per-worker batch statistics that the loss does not read).
        manual = getattr(leaf.aval, "manual_axis_type", None)
        varying = tuple(sorted(getattr(manual, "varying", ())))
        return lax.pcast(zeros, varying, to="varying") if varying else zeros

    return jax.tree.map(instantiate, tree, is_leaf=lambda leaf: isinstance(leaf, SymbolicZero))


def _barrier_floating(tree: Any) -> Any:
    """``lax.optimization_barrier`` over the floating leaves of a pytree (others pass through)."""
    leaves, treedef = jax.tree.flatten(tree)
    floating = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    tied = lax.optimization_barrier([leaves[i] for i in floating])
    for i, value in zip(floating, tied, strict=True):
        leaves[i] = value
    return jax.tree.unflatten(treedef, leaves)


def sequenced_stage(stage: Stage) -> Stage:
    """``stage`` with a backward pass that XLA must finish before the previous stage's.

    The returned function has the same value as ``stage``; its VJP is ``jax.vjp(stage)``
    followed by an optimization barrier over the parameter and input cotangents, so that
    no consumer of ``δ_i`` can run before the stage's parameter gradient exists. When the
    input is not differentiated (the chain input, integer tokens), its cotangent is not
    computed, as in plain ``jax.grad``.

    Args:
      stage: a pure function ``(p, x) -> y``.

    Returns:
      The sequenced stage.
    """

    @jax.custom_vjp
    def run(p, x):
        return stage(p, x)

    def forward(p, x):
        values = jax.tree.map(lambda leaf: leaf.value, (p, x), is_leaf=_is_primal)
        x_perturbed = any(leaf.perturbed for leaf in jax.tree.leaves(x, is_leaf=_is_primal))
        if x_perturbed:
            return jax.vjp(stage, *values)
        return jax.vjp(lambda q: stage(q, values[1]), values[0])

    def backward(pullback, ct):
        cotangents = _barrier_floating(pullback(_instantiate_zeros(ct)))
        return cotangents if len(cotangents) == 2 else (cotangents[0], None)

    run.defvjp(forward, backward, symbolic_zeros=True)
    return run


def _run(
    stages: Sequence[Stage],
    items: Sequence[PlanItem],
    params: Sequence[Any],
    offset: int,
    x: Any,
) -> Any:
    for item in items:
        if isinstance(item, RunStage):
            x = stages[item.index](params[item.index - offset], x)
        else:
            segment = _segment_function(stages, item)
            x = jax.checkpoint(segment)(tuple(params[item.start - offset : item.end - offset]), x)
    return x


def _segment_function(stages: Sequence[Stage], item: Checkpoint) -> Callable[[Any, Any], Any]:
    def segment(segment_params, x):
        return _run(stages, item.body, segment_params, item.start, x)

    segment.__name__ = f"rotor_checkpoint_{item.start}_{item.end}"
    return segment


def apply_plan(
    stages: Sequence[Stage], plan: Plan, *, sequence_backward: bool = True
) -> Callable[[Sequence[Any], Any], Any]:
    """The chain as one function whose gradient follows ``plan``.

    Args:
      stages: ``L`` pure functions ``(p_i, x_i) -> x_{i+1}``.
      plan: a :class:`Plan` for ``L`` stages.
      sequence_backward: run each stage's backward as one unit (:func:`sequenced_stage`),
        as the rotor model assumes; ``False`` leaves the order to XLA (plain autodiff).

    Returns:
      ``fn(params, x)``, with ``params`` a sequence of ``L`` per-stage pytrees; its value
      equals ``stages[L-1](params[L-1], ... stages[0](params[0], x))``.
    """
    if plan.num_stages != len(stages):
        raise ValueError(f"The plan is for {plan.num_stages} stages but {len(stages)} were given.")
    stages = tuple(sequenced_stage(s) for s in stages) if sequence_backward else tuple(stages)

    def chain(params: Sequence[Any], x: Any) -> Any:
        if len(params) != len(stages):
            raise ValueError(f"Expected {len(stages)} per-stage params, got {len(params)}.")
        return _run(stages, plan.items, tuple(params), 0, x)

    return chain


def sum_of_outputs(y: Any) -> jax.Array:
    """Default loss for measuring a chain: the float32 sum of its floating output leaves."""
    leaves = [leaf for leaf in jax.tree.leaves(y) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    if not leaves:
        raise ValueError("The chain output has no floating-point leaf to differentiate.")
    return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in leaves)


def sequenced_loss(loss: Loss) -> Loss:
    """``loss`` whose value XLA must compute before the backward pass starts.

    Otherwise XLA may postpone the loss reduction to the end of the program and keep the
    chain output alive through the whole backward pass. Same value and gradient as ``loss``.
    """

    @jax.custom_vjp
    def value(y):
        return loss(y)

    def forward(y):
        result, pullback = jax.vjp(loss, y)
        return result, (pullback, result)

    def backward(residuals, ct):
        pullback, result = residuals
        cotangent, _ = _barrier_floating((pullback(ct), result))
        return cotangent

    value.defvjp(forward, backward)
    return value


def gradient_program(
    fn: Callable[[Any, Any], Any],
    loss: Loss | None = None,
    wrt_input: bool = False,
    sequence_backward: bool = True,
) -> Callable[[Any, Any], Any]:
    """The jitted gradient computation that a memory budget refers to.

    ``jax.jit(jax.value_and_grad(lambda params, x: loss(fn(params, x))))``: arguments are
    the parameters and the input, outputs the loss and the parameter gradients (and the
    input gradient when ``wrt_input``). When the chain's last stage is the loss itself, this
    is exactly the training gradient.

    Args:
      fn: the chain, ``fn(params, x)``.
      loss: maps the chain output to a scalar; defaults to :func:`sum_of_outputs`.
      wrt_input: also differentiate w.r.t. ``x``.
      sequence_backward: compute the loss value before the backward pass
        (:func:`sequenced_loss`).

    Returns:
      The jitted function ``(params, x) -> (loss, grads)``.
    """
    loss = sum_of_outputs if loss is None else loss
    if sequence_backward:
        loss = sequenced_loss(loss)
    argnums = (0, 1) if wrt_input else 0
    return jax.jit(jax.value_and_grad(lambda params, x: loss(fn(params, x)), argnums=argnums))


_DOT = re.compile(r"=\s*\S+\s+(dot|convolution)\(")


@dataclasses.dataclass(frozen=True)
class CompiledGradient:
    """Figures of a compiled gradient computation.

    Attributes:
      memory: the compiled :class:`resireduce_jax.hlo.PeakMemory`; ``memory.peak`` is
        argument + output − alias + temp bytes (parameters and gradients included).
      flops: XLA's ``cost_analysis()`` FLOPs of the whole program.
      dots: number of ``dot`` and ``convolution`` instructions in the optimized HLO.
      barriers: number of ``opt-barrier`` instructions in the optimized HLO.
    """

    memory: hlo.PeakMemory
    flops: float
    dots: int
    barriers: int

    @property
    def peak(self) -> int:
        return self.memory.peak

    def as_dict(self) -> dict[str, Any]:
        return {
            "peak": self.peak,
            **{f"memory_{k}": v for k, v in self.memory.as_dict().items()},
            "flops": self.flops,
            "dots": self.dots,
            "barriers": self.barriers,
        }


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _tied(params: Sequence[Any]) -> tuple[list[Any], Callable[[Sequence[Any]], tuple[Any, ...]]]:
    """The distinct leaves of per-stage params, and the map from them back to the stages.

    A leaf object that several stages hold (tied weights, e.g. GPT-2's ``wte`` from
    :meth:`resireduce_jax.remat.zoo.ModelChain.chain_variables`) is one leaf: the compiled
    program takes it once and its gradient sums every use, as in the model.
    """
    distinct: list[Any] = []
    index: dict[int, int] = {}
    layout = []
    for p in params:
        leaves, treedef = jax.tree.flatten(p)
        positions = []
        for leaf in leaves:
            shared = isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))
            if not shared or id(leaf) not in index:
                if shared:
                    index[id(leaf)] = len(distinct)
                positions.append(len(distinct))
                distinct.append(leaf)
            else:
                positions.append(index[id(leaf)])
        layout.append((treedef, positions))

    def rebuild(values: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(
            jax.tree.unflatten(treedef, [values[k] for k in positions])
            for treedef, positions in layout
        )

    return distinct, rebuild


def compile_gradient(
    stages: Sequence[Stage],
    plan: Plan,
    params: Sequence[Any],
    x: Any,
    *,
    loss: Loss | None = None,
    wrt_input: bool = False,
    sequence_backward: bool = True,
) -> CompiledGradient:
    """Compiles the gradient computation of a planned chain (abstractly) and reads its figures.

    Args:
      stages: the stage functions.
      plan: the :class:`Plan` to follow.
      params: per-stage params (arrays or ``ShapeDtypeStruct``s). A leaf object that
        several stages hold is a tied weight: one argument, one summed gradient.
      x: chain input (arrays or ``ShapeDtypeStruct``s).
      loss: maps the chain output to a scalar; defaults to :func:`sum_of_outputs`.
      wrt_input: also differentiate w.r.t. ``x``.
      sequence_backward: see :func:`apply_plan` and :func:`gradient_program`.

    Returns:
      The :class:`CompiledGradient`.

    Raises:
      RuntimeError: if the plan has checkpoints but the optimized CPU program kept none of
        their optimization barriers (the recomputation would have been merged away).
    """
    chain_shapes(stages, params, x)  # clear errors for a malformed chain
    fn = apply_plan(stages, plan, sequence_backward=sequence_backward)
    leaves, rebuild = _tied(params)
    program = gradient_program(
        lambda leaves, x: fn(rebuild(leaves), x), loss, wrt_input, sequence_backward
    )
    compiled = program.lower(_abstract(leaves), _abstract(x)).compile()
    text = compiled.as_text()
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0]
    result = CompiledGradient(
        memory=hlo.peak_memory(compiled),
        flops=float((analysis or {}).get("flops", 0.0)),
        dots=len(_DOT.findall(text)),
        barriers=text.count("opt-barrier("),
    )
    if plan.num_checkpoints and result.barriers == 0:
        message = (
            "XLA removed all optimization barriers of jax.checkpoint from the compiled "
            "gradient, so CSE merged the recomputation with the forward pass and the plan's "
            "memory saving is lost. On CPU, start the program with XLA_FLAGS containing "
            "--xla_disable_hlo_passes=cse_barrier_expander,small-while-loop-hoisting "
            "(resireduce_jax.runtime.configure_cpu() sets it) before JAX initializes."
        )
        if jax.default_backend() == "cpu":
            raise RuntimeError(message)
        warnings.warn(message, stacklevel=2)
    return result
