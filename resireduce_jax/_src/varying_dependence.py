"""Which outputs of a jaxpr depend on given inputs as a worker's value.

Inside ``shard_map`` an output that does not depend on an input keeps its varying-axis
type, whatever that input's type is. :func:`reached_outputs` finds the outputs that do.
A collective over every worker axis gives every worker one value and ends the dependence.
The analysis errs only towards "reached". :func:`resireduce_jax.parallel.state_partition_specs`
uses it to stop its fixed-point search after one trace. What it models and why it is
sound: docs/design.md, "One training step" and "Per-worker leaves through a ``lax.cond``".
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.extend.core import Jaxpr, Var

from resireduce_jax._src import jaxprs

__all__ = ["reached_outputs"]

# ``remat2`` (``jax.checkpoint``'s primitive in JAX 0.10) is not followed here: like any
# equation not modelled, it reaches all its outputs from any reached operand.
_CALLS = jaxprs.CALLS - {"remat2"}
_INVARIANT_COLLECTIVES = ("psum_invariant", "all_gather_invariant")
# Traced with ``check_vma=False``, a reduction over every worker axis keeps its plain name.
_UNCHECKED_INVARIANT = ("psum",)


def _axes_of(value) -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        return frozenset((value,))
    return frozenset(value)


def _equation(eqn, reached: list[bool], worker_axes: frozenset[str], unchecked: bool) -> list[bool]:
    """Which of ``eqn``'s outputs depend on its ``reached`` operands."""
    name, params, outs = eqn.primitive.name, eqn.params, len(eqn.outvars)
    if name == "optimization_barrier":
        return list(reached)
    if name in _INVARIANT_COLLECTIVES or (unchecked and name in _UNCHECKED_INVARIANT):
        axes = _axes_of(params.get("axes", params.get("axis_name")))
        if worker_axes <= axes:
            return [False] * outs
        return list(reached) if len(reached) == outs else [True] * outs
    call = jaxprs.call_body(eqn, _CALLS)
    if call is not None:
        return reached_outputs(call[1], reached, worker_axes, unchecked=unchecked)
    if name == "scan":
        body = params["jaxpr"].jaxpr
        consts, carries = params["num_consts"], params["num_carry"]
        carry = list(reached[consts : consts + carries])
        while True:  # a carry reached in one iteration is reached in the next
            inputs = [*reached[:consts], *carry, *reached[consts + carries :]]
            result = reached_outputs(body, inputs, worker_axes, unchecked=unchecked)
            grown = [a or b for a, b in zip(carry, result[:carries], strict=True)]
            if grown == carry:
                return result
            carry = grown
    if name == "cond":
        if reached[0]:  # the branch index
            return [True] * outs
        result = [False] * outs
        for branch in params["branches"]:
            branch_reached = reached_outputs(
                branch.jaxpr, reached[1:], worker_axes, unchecked=unchecked
            )
            result = [a or b for a, b in zip(result, branch_reached, strict=True)]
        return result
    return [True] * outs


def reached_outputs(
    jaxpr: Jaxpr,
    reached_inputs: Sequence[bool],
    worker_axes: frozenset[str],
    *,
    unchecked: bool = False,
) -> list[bool]:
    """Per output of ``jaxpr``: does it depend on an input marked in ``reached_inputs``?

    Args:
      jaxpr: an open jaxpr (a ``ClosedJaxpr``'s ``.jaxpr``); its constants are not reached.
      reached_inputs: one flag per ``jaxpr.invars``.
      worker_axes: the mesh axes of the workers; a collective reducing over all of them
        ends the dependence.
      unchecked: ``jaxpr`` was traced under ``shard_map(..., check_vma=False)``, whose
        values carry no axis types: ``axis_index`` also starts a dependence, and a plain
        ``psum`` over every worker axis ends one, as a checked trace would type them.

    Returns:
      One flag per ``jaxpr.outvars``; ``True`` may be a false alarm, ``False`` is certain.
    """
    if len(reached_inputs) != len(jaxpr.invars):
        raise ValueError(f"{len(reached_inputs)} flags for a jaxpr of {len(jaxpr.invars)} inputs.")
    reached = {v for v, r in zip(jaxpr.invars, reached_inputs, strict=True) if r}

    def is_reached(v) -> bool:
        return isinstance(v, Var) and v in reached

    for eqn in jaxpr.eqns:
        if (
            unchecked
            and eqn.primitive.name == "axis_index"
            and _axes_of(eqn.params.get("axis_name")) & worker_axes
        ):
            reached.update(eqn.outvars)
            continue
        operands = [is_reached(v) for v in eqn.invars]
        if not any(operands):
            continue
        outs = _equation(eqn, operands, worker_axes, unchecked)
        for v, r in zip(eqn.outvars, outs, strict=True):
            if r:
                reached.add(v)
    return [is_reached(v) for v in jaxpr.outvars]
