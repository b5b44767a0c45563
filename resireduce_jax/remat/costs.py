"""Per-stage costs of a chain, read from abstract evaluation and compiled programs.

Beaumont et al., "Optimal checkpointing for heterogeneous chains: how to train deep neural
networks with limited memory", ACM TOMS 2024 (https://arxiv.org/abs/1911.13214), §3.1.
For each stage: input size, what it keeps with full history, forward and backward
temporaries, and the times of its forward, backward and recomputation.
Nothing is allocated: shapes from eval_shape, residuals from jaxprs, memory from
memory_analysis(), time from cost_analysis() FLOPs or, measured, from running the stage.
What each cost is: docs/design.md, "Rotor's stage costs (remat/costs.py)".
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time as _time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

__all__ = [
    "ChainCosts",
    "Stage",
    "chain_shapes",
    "measure_chain",
    "tree_bytes",
]

Stage = Callable[[Any, Any], Any]
"""A stage of a chain: a pure function ``(stage_params, x) -> y``."""


def _leaf_bytes(leaf: Any) -> int:
    return int(math.prod(leaf.shape)) * int(leaf.dtype.itemsize)


def tree_bytes(tree: Any) -> int:
    """Bytes of all array leaves of a pytree (arrays or ``ShapeDtypeStruct``s)."""
    return sum(_leaf_bytes(leaf) for leaf in jax.tree.leaves(tree))


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _is_array(leaf: Any) -> bool:
    """An array or an abstract one: a leaf whose identity can mark a tied weight."""
    return isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _shared_bytes(params: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage parameter and gradient bytes, a leaf that several stages hold counted once.

    Tied weights (GPT-2's ``wte`` in its embedding and its head) are the same leaf object in
    both stages' params: the compiled gradient takes it once and sums the uses' gradients.
    Its bytes count at the first stage that holds it, its gradient's at the last one,
    whose backward writes it first.
    """
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, p in enumerate(params):
        for leaf in jax.tree.leaves(p):
            if _is_array(leaf):
                first.setdefault(id(leaf), i)
                last[id(leaf)] = i
    param_bytes = np.zeros(len(params), dtype=np.int64)
    grad_bytes = np.zeros(len(params), dtype=np.int64)
    for i, p in enumerate(params):
        for leaf in jax.tree.leaves(p):
            shared = _is_array(leaf)
            if not shared or first[id(leaf)] == i:
                param_bytes[i] += _leaf_bytes(leaf)
            if jnp.issubdtype(leaf.dtype, jnp.inexact) and (not shared or last[id(leaf)] == i):
                grad_bytes[i] += _leaf_bytes(leaf)
    return param_bytes, grad_bytes


def chain_shapes(stages: Sequence[Stage], params: Sequence[Any], x: Any) -> list[Any]:
    """Abstract activations ``[x_0, x_1, ..., x_L]`` of a chain, via :func:`jax.eval_shape`.

    Args:
      stages: the ``L`` stage functions ``(p_i, x_i) -> x_{i+1}``.
      params: the ``L`` stage parameter pytrees (arrays or ``ShapeDtypeStruct``s).
      x: the chain input (arrays or ``ShapeDtypeStruct``s).

    Returns:
      ``L + 1`` pytrees of ``jax.ShapeDtypeStruct``.
    """
    _check_chain(stages, params)
    shapes = [_abstract(x)]
    for i, (stage, p) in enumerate(zip(stages, params, strict=True)):
        try:
            shapes.append(jax.eval_shape(stage, _abstract(p), shapes[-1]))
        except Exception as err:
            raise ValueError(
                f"Stage {i} failed on input of shapes {shapes[-1]}: {err}. Each stage must be "
                "a pure function (stage_params, x) -> y that accepts the previous stage's output."
            ) from err
    return shapes


def _check_chain(stages: Sequence[Stage], params: Sequence[Any]) -> None:
    if len(stages) == 0:
        raise ValueError("A chain needs at least one stage; got an empty list of stages.")
    if len(stages) != len(params):
        raise ValueError(
            f"Got {len(stages)} stages but {len(params)} parameter entries; pass one params "
            "pytree per stage (use None or () for a stage without parameters)."
        )
    for i, stage in enumerate(stages):
        if not callable(stage):
            raise ValueError(f"Stage {i} is not callable: {stage!r}.")


@dataclasses.dataclass(frozen=True)
class ChainCosts:
    """Measured costs of a chain of ``L`` stages (all sizes in bytes).

    Attributes:
      activation_bytes: ``[L + 1]``, size of ``x_i``; the last entry is the chain output.
      saved_bytes: ``[L]``, what stage ``i`` keeps when run with full history (``x̄_i`` in
        the paper): its ``jax.vjp`` residuals other than its parameters and its input,
        plus its output ``x_{i+1}``.
      forward_temp_bytes: ``[L]``, compiled temporaries of the stage's forward program.
      backward_temp_bytes: ``[L]``, memory the stage's backward needs beyond ``x̄_i``: the
        compiled temporaries of its forward + backward program minus ``x̄_i`` (at least 0).
      param_bytes: ``[L]``, size of each stage's parameters; a leaf several stages hold
        (tied weights) counts at the first of them.
      grad_bytes: ``[L]``, size of each stage's parameter gradient (floating leaves); a
        tied leaf's counts at the last stage holding it, whose backward writes it first.
      forward_time: ``[L]``, forward cost ``u_f`` (FLOPs or seconds, see ``time_unit``).
      backward_time: ``[L]``, backward cost ``u_b`` without the forward.
      residual_time: ``[L]``, cost of computing only what the backward pass keeps (the
        residuals): a recomputed stage whose output nobody reads (the last stage of a
        checkpointed segment) costs this, as JAX prunes the rest (a linear layer: 0).
      time_unit: ``"flops"`` or ``"seconds"``.
      stage_names: a readable name per stage.
    """

    activation_bytes: np.ndarray
    saved_bytes: np.ndarray
    forward_temp_bytes: np.ndarray
    backward_temp_bytes: np.ndarray
    param_bytes: np.ndarray
    grad_bytes: np.ndarray
    forward_time: np.ndarray
    backward_time: np.ndarray
    residual_time: np.ndarray
    time_unit: str
    stage_names: tuple[str, ...]

    def __post_init__(self):
        n = len(self.saved_bytes)
        if len(self.activation_bytes) != n + 1:
            raise ValueError(
                f"activation_bytes needs L + 1 = {n + 1} entries, got {len(self.activation_bytes)}."
            )
        for name in (
            "forward_temp_bytes",
            "backward_temp_bytes",
            "param_bytes",
            "grad_bytes",
            "forward_time",
            "backward_time",
            "residual_time",
        ):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} needs L = {n} entries, got {len(getattr(self, name))}.")
        if len(self.stage_names) != n:
            raise ValueError(f"stage_names needs {n} entries, got {len(self.stage_names)}.")

    @property
    def num_stages(self) -> int:
        return len(self.saved_bytes)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly view (lists of ints / floats)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = value.tolist() if isinstance(value, np.ndarray) else value
        return out

    def table(self) -> str:
        """A markdown table of the costs, one row per stage."""
        mib = 2.0**20
        unit = "GFLOP" if self.time_unit == "flops" else "ms"
        scale = 1e-9 if self.time_unit == "flops" else 1e3
        rows = [
            f"| stage | x_i MiB | x̄_i MiB | fwd tmp MiB | bwd tmp MiB | params MiB "
            f"| fwd {unit} | bwd {unit} |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for i in range(self.num_stages):
            rows.append(
                f"| {i} {self.stage_names[i]} | {self.activation_bytes[i] / mib:.2f} "
                f"| {self.saved_bytes[i] / mib:.2f} | {self.forward_temp_bytes[i] / mib:.2f} "
                f"| {self.backward_temp_bytes[i] / mib:.2f} | {self.param_bytes[i] / mib:.2f} "
                f"| {self.forward_time[i] * scale:.3f} | {self.backward_time[i] * scale:.3f} |"
            )
        return "\n".join(rows)


@dataclasses.dataclass(frozen=True)
class _StageCost:
    saved: int  # x̄: kept residuals beyond params and input, output included
    forward_temp: int
    backward_temp: int
    forward_time: float
    backward_time: float
    residual_time: float


def _vjp_function(stage: Stage, wrt_input: bool) -> Callable[[Any, Any], Any]:
    """``(p, x) -> (y, vjp)``, differentiating w.r.t. ``p`` (and ``x`` if ``wrt_input``)."""

    def fn(p, x):
        if wrt_input:
            return jax.vjp(stage, p, x)
        return jax.vjp(lambda q: stage(q, x), p)

    return fn


# Cheap elementwise primitives, which XLA duplicates into their consumers' fusions: a
# residual computed from kept values by these alone is recomputed inside the backward
# pass instead of being stored. Transcendental ops (tanh, exp, erf, ...) and divisions are
# left out: XLA keeps their results rather than recomputing them.
_CHEAP_ELEMENTWISE = frozenset(
    {
        "abs",
        "add",
        "and",
        "broadcast_in_dim",
        "ceil",
        "clamp",
        "convert_element_type",
        "copy",
        "copy_p",
        "eq",
        "expand_dims",
        "floor",
        "ge",
        "gt",
        "integer_pow",
        "is_finite",
        "le",
        "lt",
        "max",
        "min",
        "mul",
        "ne",
        "neg",
        "not",
        "or",
        "reshape",
        "round",
        "select_n",
        "shift_left",
        "shift_right_arithmetic",
        "shift_right_logical",
        "sign",
        "square",
        "squeeze",
        "sub",
        "xor",
    }
)
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})


def _producers(jaxpr: Any) -> dict[Any, tuple[Any, int]]:
    return {v: (eqn, k) for eqn in jaxpr.eqns for k, v in enumerate(eqn.outvars)}


def _derivable(v: Any, available: set, producers: dict, memo: dict) -> bool:
    """Whether ``v`` can be recomputed from ``available`` by cheap elementwise operations."""
    if isinstance(v, jex_core.Literal) or v in available:
        return True
    if v in memo:
        return memo[v]
    memo[v] = False  # no cycles in a jaxpr; guards the recursion
    producer = producers.get(v)
    result = False
    if producer is not None:
        eqn, k = producer
        name = eqn.primitive.name
        if name in _CHEAP_ELEMENTWISE:
            result = all(_derivable(u, available, producers, memo) for u in eqn.invars)
        elif name in _CALLS and "jaxpr" in eqn.params:
            inner = eqn.params["jaxpr"]
            inner = getattr(inner, "jaxpr", inner)
            inner_available = set(inner.constvars) | {
                iv
                for iv, ov in zip(inner.invars, eqn.invars, strict=True)
                if _derivable(ov, available, producers, memo)
            }
            result = _derivable(inner.outvars[k], inner_available, _producers(inner), {})
    memo[v] = result
    return result


def _uses_only_cheap(v: Any, jaxpr: Any) -> bool:
    """Whether every consumer of ``v`` in ``jaxpr`` is a cheap elementwise operation.

    A residual read by a ``dot_general``, a convolution or a reduction in the backward pass
    must exist as a buffer, so XLA keeps it from the forward pass.
    """
    for eqn in jaxpr.eqns:
        positions = [k for k, u in enumerate(eqn.invars) if u is v]
        if not positions:
            continue
        name = eqn.primitive.name
        if name in _CHEAP_ELEMENTWISE:
            continue
        if name in _CALLS and "jaxpr" in eqn.params:
            inner = eqn.params["jaxpr"]
            inner = getattr(inner, "jaxpr", inner)
            if all(_uses_only_cheap(inner.invars[k], inner) for k in positions):
                continue
        return False
    return not any(u is v for u in jaxpr.outvars)


def _saved_extra_bytes(stage: Stage, p: Any, x: Any, y: Any, wrt_input: bool) -> tuple[int, str]:
    """Residual bytes kept beyond params, input and output; and a cache key for the stage.

    Residuals are the leaves of the ``jax.vjp`` function object. Tracing the output and the
    residuals into one jaxpr recognises a residual that *is* a parameter, the input, the
    output or a constant by variable identity. A residual is also not counted when cheap
    elementwise operations compute it from the kept values and the backward pass reads it
    only through cheap elementwise operations (``1 - y²`` from the output ``y = tanh(z)``,
    say): XLA then fuses its computation into the backward pass instead of keeping it.
    """
    vjp_fn = _vjp_function(stage, wrt_input)

    def traced(p, x):
        out, pullback = vjp_fn(p, x)
        return jax.tree.leaves(out), jax.tree.leaves(pullback)

    closed = jax.make_jaxpr(traced)(p, x)
    jaxpr = closed.jaxpr
    n_y = len(jax.tree.leaves(y))
    outs = list(jaxpr.outvars)
    held = set(jaxpr.invars) | set(jaxpr.constvars)
    held |= {v for v in outs[:n_y] if not isinstance(v, jex_core.Literal)}

    # How the backward pass reads each residual leaf.
    pullback = jax.eval_shape(lambda p, x: vjp_fn(p, x)[1], p, x)
    residual_leaves, treedef = jax.tree.flatten(pullback)
    ct_leaves, rebuild = _inexact_cotangent(y)
    backward = jax.make_jaxpr(
        lambda leaves, cts: jax.tree.unflatten(treedef, leaves)(rebuild(cts))
    )(residual_leaves, ct_leaves).jaxpr
    fusable = {}
    for v, inner in zip(outs[n_y:], backward.invars[: len(residual_leaves)], strict=True):
        if not isinstance(v, jex_core.Literal):
            fusable[v] = fusable.get(v, True) and _uses_only_cheap(inner, backward)

    producers = _producers(jaxpr)
    order = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    residuals = {v for v in outs[n_y:] if not isinstance(v, jex_core.Literal) and v not in held}
    kept: set = set()
    for v in sorted(residuals, key=lambda v: order.get(v, -1)):
        if not (fusable[v] and _derivable(v, held | kept, producers, {})):
            kept.add(v)
    extra = sum(_leaf_bytes(v.aval) for v in kept)
    return extra, str(closed)


def _inexact_cotangent(y: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """Splits an output's cotangent into its floating leaves and a rebuild function.

    Non-floating outputs (integer arrays, PRNG keys) take ``float0`` zeros as cotangent.
    """
    leaves, treedef = jax.tree.flatten(y)
    floating = [jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in leaves]
    float_leaves = [
        jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        for leaf, f in zip(leaves, floating, strict=True)
        if f
    ]

    def rebuild(cts: list[Any]) -> Any:
        it = iter(cts)
        full = [
            next(it) if f else np.zeros(leaf.shape, jax.dtypes.float0)
            for leaf, f in zip(leaves, floating, strict=True)
        ]
        return jax.tree.unflatten(treedef, full)

    return float_leaves, rebuild


def _compiled_figures(compiled: Any) -> tuple[int, float]:
    memory = compiled.memory_analysis()
    temp = int(memory.temp_size_in_bytes) if memory is not None else 0
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older jax returned one dict per device
        analysis = analysis[0]
    flops = float((analysis or {}).get("flops", 0.0))
    return temp, flops


def _time_call(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())  # warm-up
    samples = []
    for _ in range(repeats):
        start = _time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(_time.perf_counter() - start)
    return statistics.median(samples)


def _measure_stage(
    stage: Stage,
    p: Any,
    x: Any,
    y: Any,
    saved: int,
    wrt_input: bool,
    time: str,
    repeats: int,
    concrete: tuple[Any, Any] | None,
) -> _StageCost:
    """Compiles the stage's forward, its residuals alone, and its forward + backward.

    The backward overhead is what the forward + backward program's temporaries need beyond
    the kept residuals ``saved``: measured on the whole program, it includes XLA's reuse
    of residual buffers that die during the backward pass (the residuals of the backward
    program alone, passed as arguments, would never die).
    """
    forward = jax.jit(stage).lower(p, x).compile()
    forward_temp, forward_flops = _compiled_figures(forward)

    vjp_fn = _vjp_function(stage, wrt_input)
    residuals = jax.jit(lambda p, x: jax.tree.leaves(vjp_fn(p, x)[1])).lower(p, x).compile()
    _, residual_flops = _compiled_figures(residuals)

    ct_leaves, rebuild = _inexact_cotangent(y)

    def forward_backward(p, x, cts):
        out, pullback = vjp_fn(p, x)
        return out, pullback(rebuild(cts))  # returning `out` keeps XLA from pruning it

    both = jax.jit(forward_backward).lower(p, x, ct_leaves).compile()
    both_temp, both_flops = _compiled_figures(both)
    # x̄ counts the output, which this program returns rather than keeps as a temporary.
    backward_temp = max(0, both_temp + tree_bytes(y) - saved)

    if time == "flops":
        return _StageCost(
            saved,
            forward_temp,
            backward_temp,
            forward_flops,
            max(0.0, both_flops - forward_flops),
            min(residual_flops, forward_flops),
        )

    assert concrete is not None
    p_val, x_val = concrete
    cts = [jnp.ones(c.shape, c.dtype) for c in ct_leaves]
    forward_time = _time_call(lambda: forward(p_val, x_val), repeats)
    both_time = _time_call(lambda: both(p_val, x_val, cts), repeats)
    residual_time = _time_call(lambda: residuals(p_val, x_val), repeats)
    return _StageCost(
        saved,
        forward_temp,
        backward_temp,
        forward_time,
        max(0.0, both_time - forward_time),
        min(residual_time, forward_time),
    )


def measure_chain(
    stages: Sequence[Stage],
    params: Sequence[Any],
    x: Any,
    *,
    wrt_input: bool = False,
    time: Literal["flops", "measured"] = "flops",
    repeats: int = 5,
    stage_names: Sequence[str] | None = None,
) -> ChainCosts:
    """Measures the rotor cost model of a chain ``x_{i+1} = stages[i](params[i], x_i)``.

    Stages whose traced ``jax.vjp`` jaxprs are identical (same operations and shapes, e.g.
    the repeated blocks of a transformer) are compiled once.

    Args:
      stages: ``L`` pure functions ``(p_i, x_i) -> x_{i+1}``.
      params: ``L`` parameter pytrees (arrays or ``ShapeDtypeStruct``s). A leaf object
        that several stages hold is a tied weight, counted once.
      x: the chain input (arrays or ``ShapeDtypeStruct``s); may be any pytree (e.g. an
        activation together with a PRNG key).
      wrt_input: whether the gradient is also taken w.r.t. the chain input ``x_0``
        (training differentiates the parameters only: ``False``).
      time: ``"flops"`` reads ``cost_analysis()`` FLOPs of the compiled stage programs
        (deterministic, works everywhere); ``"measured"`` times them on the device (median
        of ``repeats`` runs) and needs concrete ``params`` and ``x``.
      repeats: timed runs per program when ``time="measured"``.
      stage_names: optional readable names, one per stage.

    Returns:
      The :class:`ChainCosts`.

    Raises:
      ValueError: for an inconsistent chain, or ``time="measured"`` with abstract inputs.
    """
    if time not in ("flops", "measured"):
        raise ValueError(f"time must be 'flops' or 'measured', got {time!r}.")
    shapes = chain_shapes(stages, params, x)
    n = len(stages)
    if stage_names is None:
        stage_names = tuple(getattr(s, "__name__", type(s).__name__) for s in stages)
    if len(stage_names) != n:
        raise ValueError(f"stage_names needs {n} entries, got {len(stage_names)}.")

    concrete_x = None
    if time == "measured":
        leaves = jax.tree.leaves((params, x))
        if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
            raise ValueError(
                "time='measured' runs the stages and needs concrete params and x; got "
                "ShapeDtypeStructs. Pass arrays, or use time='flops'."
            )
        concrete_x = x

    cache: dict[str, _StageCost] = {}
    results: list[_StageCost] = []
    for i, (stage, p) in enumerate(zip(stages, params, strict=True)):
        p_abs, x_abs, y_abs = _abstract(p), shapes[i], shapes[i + 1]
        stage_wrt_input = wrt_input or i > 0
        extra, key = _saved_extra_bytes(stage, p_abs, x_abs, y_abs, stage_wrt_input)
        key = f"{stage_wrt_input}|{key}"
        if key not in cache:
            concrete = (p, concrete_x) if time == "measured" else None
            saved = tree_bytes(y_abs) + extra
            cache[key] = _measure_stage(
                stage, p_abs, x_abs, y_abs, saved, stage_wrt_input, time, repeats, concrete
            )
        results.append(cache[key])
        if time == "measured":
            concrete_x = jax.jit(stage)(p, concrete_x)

    activation = np.array([tree_bytes(s) for s in shapes], dtype=np.int64)
    param_bytes, grad_bytes = _shared_bytes(params)
    return ChainCosts(
        activation_bytes=activation,
        saved_bytes=np.array([r.saved for r in results], dtype=np.int64),
        forward_temp_bytes=np.array([r.forward_temp for r in results], dtype=np.int64),
        backward_temp_bytes=np.array([r.backward_temp for r in results], dtype=np.int64),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        forward_time=np.array([r.forward_time for r in results], dtype=np.float64),
        backward_time=np.array([r.backward_time for r in results], dtype=np.float64),
        residual_time=np.array([r.residual_time for r in results], dtype=np.float64),
        time_unit="flops" if time == "flops" else "seconds",
        stage_names=tuple(stage_names),
    )
