"""Helpers shared by the passes over jaxprs: the body of a call, and a value's size.

:func:`call_body` finds the jaxpr that a call-like equation runs once on its own operands.
:func:`aval_size` and :func:`aval_nbytes` give an abstract value's elements and bytes.
Their users: ``backward_order``, ``read_order`` and ``varying_dependence`` (docs/design.md,
"Module boundaries").
"""

from __future__ import annotations

import math
from collections.abc import Container
from typing import Any

from jax.extend import core as jex_core

__all__ = [
    "BODY_PARAMS",
    "CALLS",
    "CUSTOM_DERIVATIVE_CALLS",
    "PLAIN_CALLS",
    "aval_nbytes",
    "aval_size",
    "call_body",
]

PLAIN_CALLS = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2"}
)
"""Primitives that call one body once on the equation's operands and give its outputs.
``jit`` and ``jax.checkpoint`` (bound as ``remat2`` in JAX 0.10; the older names kept).
Their parameters hold nothing else that computes, so a rewritten body is a rewritten call."""

CUSTOM_DERIVATIVE_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call"})
"""Calls of a function with a custom derivative. Their body gives the values; their
parameters also hold the derivative rules, which a rewritten body would not match."""

CALLS = PLAIN_CALLS | CUSTOM_DERIVATIVE_CALLS
"""Every call-like primitive whose body a pass here may follow."""

BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
"""The parameters in which call-like primitives keep their body, open or closed."""


def call_body(
    eqn: Any, primitives: Container[str] | None = CALLS
) -> tuple[str, jex_core.Jaxpr] | None:
    """``(parameter name, open jaxpr)`` of the body ``eqn`` calls, or ``None``.

    The body is the first of :data:`BODY_PARAMS` that holds a jaxpr with as many invars
    and outvars as ``eqn``: its invars are the equation's operands, its outvars its results.
    A ``ClosedJaxpr`` gives its ``.jaxpr``; its constants are no operand of the equation.

    Args:
      eqn: a jaxpr equation.
      primitives: the primitive names to look into (``eqn`` of another gives ``None``).
        ``None``: any primitive with such a parameter; ``scan``'s body then qualifies too,
        as its invars and outvars line up with the equation's.
    """
    if primitives is not None and eqn.primitive.name not in primitives:
        return None
    for key in BODY_PARAMS:
        inner = eqn.params.get(key)
        body = inner.jaxpr if isinstance(inner, jex_core.ClosedJaxpr) else inner
        if (
            isinstance(body, jex_core.Jaxpr)
            and len(body.invars) == len(eqn.invars)
            and len(body.outvars) == len(eqn.outvars)
        ):
            return key, body
    return None


def aval_size(aval: Any) -> int | None:
    """Elements of an array value; ``None`` for tokens and other values without a shape."""
    shape = getattr(aval, "shape", None)
    return None if shape is None else math.prod(int(d) for d in shape)


def aval_nbytes(aval: Any) -> int:
    """Bytes of an array value; 0 for tokens and other values without a shape."""
    size = aval_size(aval)
    return 0 if size is None else size * aval.dtype.itemsize
