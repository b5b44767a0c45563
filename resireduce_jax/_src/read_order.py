"""Ordering each in-place weight update after the last read of the old weight.

A donated step writes the new weights into the old weights' buffers. XLA writes in place
only when data dependencies prove that every read of the old weight comes first.
:func:`last_read_partners` pairs each weight with one gradient that depends on all its reads.
:func:`after_reads` passes the weight and its partner's update through one barrier.
:func:`call_with_read_partners` traces the gradient computation once, pairs and evaluates it.
Why one gradient and not the last: docs/design.md, "Residuals at the compiled peak"
("Each weight after its last read"); the peaks: benchmarks/results/guard_cost.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax
from jax.extend import core as jex_core

from resireduce_jax._src import backward_order, jaxprs

PyTree = Any

__all__ = ["after_reads", "call_with_read_partners", "last_read_partners"]


class _Dataflow:
    """Forward dataflow over a jaxpr: for every value, which weights it stands for
    (``alias``, a bitset over weights) and which weight reads it depends on (``reads``,
    a bitset over read events); every weight's read events; each value's definition
    time in program order."""

    def __init__(self, num_weights: int):
        self.num_weights = num_weights
        self.events_of_weight = [0] * num_weights
        self.next_event = 0
        self.clock = 0

    def _read(self, alias: int) -> int:
        """Records one read of every weight in ``alias``; the new events as a bitset."""
        events = 0
        w = 0
        while alias:
            if alias & 1:
                bit = 1 << self.next_event
                self.next_event += 1
                self.events_of_weight[w] |= bit
                events |= bit
            alias >>= 1
            w += 1
        return events

    def run(
        self, jaxpr: jex_core.Jaxpr, inputs: Sequence[tuple[int, int]]
    ) -> list[tuple[int, int, int]]:
        """``inputs``: ``(alias, reads)`` per invar. Returns ``(alias, reads, time)`` per
        outvar."""
        env: dict[Any, tuple[int, int, int]] = {}
        for v in jaxpr.constvars:
            env[v] = (0, 0, self.clock)
        for v, (alias, reads) in zip(jaxpr.invars, inputs, strict=True):
            env[v] = (alias, reads, self.clock)

        def lookup(v):
            if isinstance(v, jex_core.Literal):
                return (0, 0, 0)
            return env[v]

        for eqn in jaxpr.eqns:
            ins = [lookup(v) for v in eqn.invars]
            outs = self._eqn(eqn, ins)
            for v, out in zip(eqn.outvars, outs, strict=True):
                env[v] = out
        return [lookup(v) for v in jaxpr.outvars]

    def _eqn(self, eqn: Any, ins: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        inner = _inlined_body(eqn)
        if inner is not None:
            return self.run(inner, [(a, r) for a, r, _ in ins])
        self.clock += 1
        reads = 0
        alias_in = 0
        for alias, r, _ in ins:
            reads |= r
            alias_in |= alias
        out_alias = alias_in if _derives_weight(eqn, ins) else 0
        if alias_in:
            # The eqn reads every weight its operands stand for; a derived value also
            # stands for them, so its consumers read them too.
            reads |= self._read(alias_in)
        return [(out_alias, reads, self.clock) for _ in eqn.outvars]


def _derives_weight(eqn: Any, ins: list[tuple[int, int, int]]) -> bool:
    """Whether the eqn computes a function of weights alone (a relayout, a cast, ``W·c``),
    which XLA may fuse into its consumer so that the consumer reads the weights."""
    if len(eqn.outvars) != 1:
        return False
    return all(
        alias or isinstance(v, jex_core.Literal) or (jaxprs.aval_size(v.aval) or 0) <= 1
        for v, (alias, _, _) in zip(eqn.invars, ins, strict=True)
    )


def _inlined_body(eqn: Any) -> jex_core.Jaxpr | None:
    """The body of a call-like eqn (jit, remat, custom derivative calls) whose invars and
    outvars are the eqn's own, or ``None`` for opaque eqns (``cond``, ``while``,
    collectives). Any primitive with such a body counts (:func:`jaxprs.call_body` with
    ``primitives=None``), ``scan`` included: its body is run once. A closed body's
    constants read no weight."""
    call = jaxprs.call_body(eqn, None)
    return None if call is None else call[1]


def last_read_partners(
    jaxpr: jex_core.Jaxpr, num_weights: int, grad_positions: Sequence[int]
) -> list[int | None]:
    """For each weight, the earliest gradient that depends on every read of it.

    Args:
      jaxpr: a jaxpr whose first ``num_weights`` invars are the weights and whose outvars
        include their gradients.
      num_weights: how many leading invars are weights.
      grad_positions: the outvar index of each weight's gradient, in weight order.

    Returns:
      Per weight, the index (in weight order) of the gradient to wait for: its own when
      that depends on all the weight's reads, else the one defined first in program
      order among those that do, or ``None`` when no gradient does.
    """
    flow = _Dataflow(num_weights)
    inputs = [(1 << i, 0) if i < num_weights else (0, 0) for i in range(len(jaxpr.invars))]
    outs = flow.run(jaxpr, inputs)
    grads = [outs[p] for p in grad_positions]
    partners: list[int | None] = []
    for w in range(num_weights):
        needed = flow.events_of_weight[w]
        qualified = [j for j, (_, reads, _) in enumerate(grads) if not needed & ~reads]
        if w in qualified:
            partners.append(w)  # the weight's own update already waits for its reads
        else:
            partners.append(min(qualified, key=lambda j: grads[j][2], default=None))
    return partners


def call_with_read_partners(
    fun: Callable[[PyTree], Any],
    params: PyTree,
    grads_of: Callable[[Any], PyTree],
    *,
    stream_backward: bool = False,
) -> tuple[Any, list[int | None]]:
    """Evaluates ``fun(params)`` and finds, per weight, the gradient its last read precedes.

    Args:
      fun: computes gradients of ``params`` (e.g. ``jax.value_and_grad(loss)``); it is
        traced once to a jaxpr, analysed (:func:`last_read_partners`) and that jaxpr is
        evaluated, so the caller's trace holds one copy of the computation.
      params: the weights.
      grads_of: picks the gradient pytree (structured like ``params``) out of ``fun``'s
        output.
      stream_backward: evaluate the jaxpr with its backward pass ordered to stream
        (:func:`resireduce_jax._src.backward_order.streamed`); the partners are those of the
        traced jaxpr (the ordering adds no read).

    Returns:
      ``(fun(params), partners)``, ``partners`` as :func:`last_read_partners` gives them,
      in the order of ``jax.tree.leaves(params)``.
    """
    flat_params, params_tree = jax.tree.flatten(params)
    closed, out_shape = jax.make_jaxpr(
        lambda *leaves: fun(params_tree.unflatten(leaves)), return_shape=True
    )(*flat_params)
    out_tree = jax.tree.structure(out_shape)
    # Outvar positions of the gradients: flatten a copy of the output whose leaves are
    # their own positions.
    positions = jax.tree.unflatten(out_tree, range(len(closed.jaxpr.outvars)))
    grad_positions = jax.tree.leaves(grads_of(positions))
    if len(grad_positions) != len(flat_params):
        raise ValueError(
            f"grads_of picked {len(grad_positions)} leaves; the weights have {len(flat_params)}."
        )
    partners = last_read_partners(closed.jaxpr, len(flat_params), grad_positions)
    if stream_backward:
        closed, _ = backward_order.streamed(closed, grad_positions)
    flat_out = jex_core.jaxpr_as_fun(closed)(*flat_params)
    return jax.tree.unflatten(out_tree, flat_out), partners


def after_reads(
    params: PyTree, updates: PyTree, partners: Sequence[int | None]
) -> tuple[PyTree, PyTree]:
    """``(params, updates)``, unchanged, with each weight ordered after its partner's update.

    Weight ``i`` and update ``partners[i]`` pass through one ``optimization_barrier``, and
    both results are used (XLA drops barrier operands whose results are unused, and the
    ordering with them): adding update ``i`` to weight ``i`` then depends on update
    ``partners[i]``, hence on gradient ``partners[i]``, hence on every read of weight ``i``.
    """
    p_leaves, p_tree = jax.tree.flatten(params)
    u_leaves, u_tree = jax.tree.flatten(updates)
    waiting: dict[int, list[int]] = {}
    for i, j in enumerate(partners):
        if j is not None and j != i:
            waiting.setdefault(j, []).append(i)
    for j, group in waiting.items():
        tied, u_leaves[j] = lax.optimization_barrier(([p_leaves[i] for i in group], u_leaves[j]))
        for i, leaf in zip(group, tied, strict=True):
            p_leaves[i] = leaf
    return p_tree.unflatten(p_leaves), u_tree.unflatten(u_leaves)
