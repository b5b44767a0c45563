"""Streaming the backward pass: each weight gradient before the backward pass moves on.

A layer's weight gradient ``dW`` and input cotangent ``dx`` are siblings, not ancestors.
So XLA may run every ``dW`` after the last ``dx``, holding every layer's ``dy`` and ``x``.
:func:`streamed` makes the streaming order a data dependency of the traced jaxpr.
Where a gradient frees more than it holds, the equations that go on from its inputs
wait for it through one ``optimization_barrier``. :func:`ties` lists those orderings.
Call bodies (``jit``, ``jax.checkpoint``) are ordered the same way; loop bodies are not.
How, and the peaks measured: docs/design.md, "Streaming the backward pass".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax import lax
from jax.extend import core as jex_core

from resireduce_jax._src import jaxprs

__all__ = ["Tie", "streamed", "ties"]


class Tie(NamedTuple):
    """One ordering: the results of equation ``eqn`` wait for the gradient at outvar
    position ``grad``; the barrier goes after equation ``after``."""

    eqn: int
    grad: int
    after: int


def _is_var(v: Any) -> bool:
    return isinstance(v, jex_core.Var) and not isinstance(v, jex_core.DropVar)


class _Dataflow:
    """One jaxpr's dataflow, with every value's reach counted in the *outermost* outputs.

    ``reach[v]`` is the bitset of outermost outvar positions ``v`` contributes to:
    the outermost jaxpr seeds its outvar ``k`` with bit ``k``; a body seeds its outvar
    ``k`` with the reach of the calling equation's output ``k``. A value is *backward* when
    it reaches gradients and nothing else and (in a body that computes no forward output,
    such as a rematerialized segment) depends on a backward input of the call: the
    segment's recomputed forward values reach only gradients too, but are not the
    backward pass. ``held`` values (the step's inputs) are alive throughout: computing a
    gradient early frees none of their bytes.
    """

    def __init__(
        self,
        jaxpr: jex_core.Jaxpr,
        out_reach: Sequence[int],
        other_bits: int,
        backward_in: Sequence[bool] | None,
        held: set[Any],
    ):
        self.jaxpr, self.other_bits, self.held = jaxpr, other_bits, held
        eqns = jaxpr.eqns
        self.producer: dict[Any, int] = {}
        self.consumers: dict[Any, list[int]] = {}
        for i, eqn in enumerate(eqns):
            for v in eqn.outvars:
                self.producer[v] = i
            for v in eqn.invars:
                if _is_var(v):
                    self.consumers.setdefault(v, []).append(i)
        reach: dict[Any, int] = {}
        for v, bits in zip(jaxpr.outvars, out_reach, strict=True):
            if _is_var(v):
                reach[v] = reach.get(v, 0) | bits
        self.eqn_reach = [0] * len(eqns)
        for i in range(len(eqns) - 1, -1, -1):
            total = 0
            for v in eqns[i].outvars:
                bits = reach.get(v, 0)
                for c in self.consumers.get(v, ()):
                    bits |= self.eqn_reach[c]
                reach[v] = bits
                total |= bits
            self.eqn_reach[i] = total
        self.reach = reach
        self.tainted: set[Any] | None = None
        if backward_in is not None:
            tainted = {v for v, b in zip(jaxpr.invars, backward_in, strict=True) if b}
            for eqn in eqns:
                if any(_is_var(v) and v in tainted for v in eqn.invars):
                    tainted.update(eqn.outvars)
            self.tainted = tainted

    def backward(self, v: Any) -> bool:
        bits = self.reach.get(v, 0)
        if not bits or bits & self.other_bits:
            return False
        return self.tainted is None or v in self.tainted

    def continuation(self, i: int) -> bool:
        """Equation ``i`` goes on with the backward pass: it contributes to two or more
        gradients, to nothing else, and computes backward values."""
        bits = self.eqn_reach[i]
        if bits & self.other_bits or bits & (bits - 1) == 0:
            return False
        return any(self.backward(v) for v in self.jaxpr.eqns[i].outvars if _is_var(v))


def _level_ties(flow: _Dataflow, gradients: dict[int, list[int]]) -> list[Tie]:
    """The ties of one jaxpr; ``gradients`` maps a gradient's bit to the outvar positions
    of this jaxpr that hold it (or the part of it computed here) and nothing else."""
    jaxpr = flow.jaxpr
    eqns = jaxpr.eqns
    own: dict[int, list[int]] = {}  # gradient bit -> its own equations
    for i, bits in enumerate(flow.eqn_reach):
        if bits and bits & (bits - 1) == 0:
            own.setdefault(bits.bit_length() - 1, []).append(i)
    result = []
    for p, positions in gradients.items():
        outs = [jaxpr.outvars[k] for k in positions]
        mine = set(own.get(p, ()))
        made = {
            k: flow.producer[v]
            for k, v in zip(positions, outs, strict=True)
            if _is_var(v) and flow.producer.get(v) in mine
        }
        if not made:
            continue
        frontier: set[Any] = set()
        for i in mine:
            for v in eqns[i].invars:
                if _is_var(v) and v not in flow.held and flow.producer.get(v) not in mine:
                    frontier.add(v)
        held_bytes = sum(jaxprs.aval_nbytes(v.aval) for v in frontier)
        if held_bytes <= sum(jaxprs.aval_nbytes(v.aval) for v in outs):
            continue  # computing it early would hold more than it frees
        grad = max(made, key=made.__getitem__)  # the part finished last
        tied = set()
        for v in frontier:
            if not flow.backward(v):
                continue  # a forward value: its other readers are not the continuation
            for c in flow.consumers.get(v, ()):
                if c not in mine and flow.continuation(c):
                    tied.add(c)
        result.extend(Tie(c, grad, max(c, made[grad])) for c in sorted(tied))
    return result


def _outermost(
    jaxpr: jex_core.Jaxpr, grad_positions: Sequence[int]
) -> tuple[_Dataflow, int, list[Tie]]:
    """The outermost jaxpr's dataflow, the bits of its gradients and its own ties."""
    grad_bits = 0
    for p in grad_positions:
        grad_bits |= 1 << p
    other_bits = ((1 << len(jaxpr.outvars)) - 1) & ~grad_bits
    seeds = [1 << k for k in range(len(jaxpr.outvars))]
    held = {*jaxpr.invars, *jaxpr.constvars}
    flow = _Dataflow(jaxpr, seeds, other_bits, None, held)
    return flow, grad_bits, _level_ties(flow, {p: [p] for p in grad_positions})


def ties(jaxpr: jex_core.Jaxpr, grad_positions: Sequence[int]) -> list[Tie]:
    """The orderings :func:`streamed` adds to ``jaxpr`` itself (docs/design.md, "Streaming the
    backward pass"; those inside call bodies are not listed).

    Args:
      jaxpr: the gradient computation; its outvars include the gradients.
      grad_positions: the outvar index of every gradient.
    """
    return _outermost(jaxpr, grad_positions)[2]


@functools.cache
def _barrier_primitive() -> tuple[Any, dict[str, Any]]:
    """``optimization_barrier``'s primitive and parameters, taken from a traced call."""
    eqn = jax.make_jaxpr(lambda x, y: lax.optimization_barrier((x, y)))(0.0, 0.0).jaxpr.eqns[0]
    return eqn.primitive, dict(eqn.params)


def _rewrite(flow: _Dataflow, found: list[Tie], grad_bits: int) -> tuple[jex_core.Jaxpr, int]:
    """``flow``'s jaxpr with ``found`` placed and every call body rewritten in turn."""
    jaxpr = flow.jaxpr
    count = len(found)
    bodies: dict[int, tuple[str, jex_core.Jaxpr]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        # Bodies of plain calls only (jaxprs.PLAIN_CALLS): loops and conditionals run their
        # bodies per iteration or per branch, and a custom derivative's rules would not
        # match a rewritten body.
        call = jaxprs.call_body(eqn, jaxprs.PLAIN_CALLS)
        if call is None:
            continue
        key, body = call
        out_reach = [flow.reach.get(v, 0) if _is_var(v) else 0 for v in eqn.outvars]
        if not any(bits & grad_bits for bits in out_reach):
            continue
        # A body that computes forward outputs is ordered like the outermost jaxpr; one
        # that only goes on with the backward pass (a rematerialized segment) tells its
        # recomputed forward values from the backward ones by what they depend on.
        computes_forward = any(bits & flow.other_bits for bits in out_reach)
        backward_in = (
            None if computes_forward else [_is_var(v) and flow.backward(v) for v in eqn.invars]
        )
        # The body's inputs are the call's operands: held for the whole step where they
        # are the step's inputs, else buffers that computing a gradient early can free.
        held = {*body.constvars}
        operands = zip(body.invars, eqn.invars, strict=True)
        held.update(b for b, v in operands if _is_var(v) and v in flow.held)
        inner = _Dataflow(body, out_reach, flow.other_bits, backward_in, held)
        gradients: dict[int, list[int]] = {}
        for k, bits in enumerate(out_reach):
            if bits & grad_bits and bits & (bits - 1) == 0:
                gradients.setdefault(bits.bit_length() - 1, []).append(k)
        rewritten, n = _rewrite(inner, _level_ties(inner, gradients), grad_bits)
        if n:
            bodies[i] = (key, rewritten)
            count += n
    if not count:
        return jaxpr, 0
    placed: dict[int, list[Tie]] = {}
    for tie in found:
        placed.setdefault(tie.after, []).append(tie)
    primitive, params = _barrier_primitive()
    renamed: dict[Any, Any] = {}

    def current(v: Any) -> Any:
        return renamed.get(v, v) if isinstance(v, jex_core.Var) else v

    new_eqns = []
    for i, eqn in enumerate(jaxpr.eqns):
        changes: dict[str, Any] = {"invars": [current(v) for v in eqn.invars]}
        if i in bodies:
            key, body = bodies[i]
            old = eqn.params[key]
            new = (
                jex_core.ClosedJaxpr(body, old.consts)
                if isinstance(old, jex_core.ClosedJaxpr)
                else body
            )
            changes["params"] = {**eqn.params, key: new}
        new_eqns.append(eqn.replace(**changes))
        for tie in placed.get(i, ()):
            source = jaxpr.eqns[tie.eqn]
            results = [v for v in source.outvars if _is_var(v)]
            grad = jaxpr.outvars[tie.grad]
            operands = [current(v) for v in (*results, grad)]
            outs = [jex_core.Var(v.aval) for v in operands]
            new_eqns.append(
                jex_core.new_jaxpr_eqn(
                    operands, outs, primitive, params, frozenset(), source.source_info, source.ctx
                )
            )
            # Both the tied results and the gradient are used from here on: XLA drops
            # barrier operands whose results are unused, and the ordering with them.
            for old_var, new_var in zip((*results, grad), outs, strict=True):
                renamed[old_var] = new_var
    rewritten = jaxpr.replace(eqns=new_eqns, outvars=[current(v) for v in jaxpr.outvars])
    return rewritten, count


def streamed(
    closed: jex_core.ClosedJaxpr, grad_positions: Sequence[int]
) -> tuple[jex_core.ClosedJaxpr, int]:
    """``closed`` with the backward pass ordered to stream (docs/design.md, "Streaming the backward
    pass").

    Args:
      closed: the traced gradient computation.
      grad_positions: the outvar index of every gradient.

    Returns:
      The rewritten jaxpr (same inputs and outputs, values equal up to float32 rounding)
      and the number of ties added, in call bodies included.
    """
    flow, grad_bits, found = _outermost(closed.jaxpr, grad_positions)
    rewritten, count = _rewrite(flow, found, grad_bits)
    if not count:
        return closed, 0
    return jex_core.ClosedJaxpr(rewritten, closed.consts), count
