"""The compressor interface and the collective exchanges that compressors share.

GRACE's decomposition: Xu et al., "GRACE: A Compressed Communication Framework for
Distributed Machine Learning", ICDCS 2021, §III (https://github.com/sands-lab/grace).
A compressor says how to compress a leaf, decompress a payload, aggregate payloads
over the data axis, and how many bytes a worker sends.
Compressor.reduce composes these; compressors know nothing of residuals, groups or optax.
Every exchange gives all workers a bit-identical mean, summed in worker order.
The interface in detail: docs/design.md, "The compressor interface (compressors/base.py)"
and docs/compressors.md.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PyTree = Any
Randomness = Literal["none", "shared", "per_worker"]
Collective = Literal["all_gather", "all_reduce"]

__all__ = [
    "Collective",
    "Compressor",
    "DecodedMean",
    "Reduced",
    "SummedGradientsError",
    "all_gather",
    "axis_size",
    "check_axis_bound",
    "check_int",
    "check_local_gradients",
    "dense_mean",
    "gathered_mean",
    "indices_within",
    "leaf_window",
    "ordered",
    "sparse_mean",
    "sparse_mean_into",
    "sparse_means",
    "varying_as",
    "zeros_for",
]


class Reduced(NamedTuple):
    """What :meth:`Compressor.reduce` returns for one leaf of one worker.

    Attributes:
      mean: the mean over workers of the decompressed payloads; identical on every worker.
      residual: ``x - D(Q(x))``: what this worker's payload failed to carry (the error that
        error feedback keeps). For compressors whose reconstruction is collective (PowerSGD)
        it is ``x`` minus the reconstruction the method defines.
      state: the compressor's new per-leaf state (``()`` for stateless compressors).
      payload: set by :meth:`Compressor.reduce_carried` only (``mean`` is then ``None``):
        this worker's payload, whose :meth:`Compressor.aggregate` is the mean.
    """

    mean: jax.Array | None
    residual: jax.Array
    state: PyTree
    payload: PyTree = None


class Compressor(abc.ABC):
    """Base class of all compressors. Subclasses are frozen dataclasses of hyper-parameters.

    Class attributes every subclass sets:
      name: registry name, e.g. ``"topk"``.
      biased: ``True`` when ``E[D(Q(x))] != x``; such methods need error feedback to converge
        well (Karimireddy et al., "Error Feedback Fixes SignSGD...", ICML 2019).
      randomness: ``"none"`` (deterministic), ``"shared"`` (every worker must draw the same
        random numbers, e.g. Random-k's indices, so the payload can be summed) or
        ``"per_worker"`` (independent draws per worker, e.g. stochastic rounding).
      collective: how the payload travels: ``"all_gather"`` (every worker receives every
        worker's payload: the sparse, quantized and sign methods) or ``"all_reduce"``
        (payloads summed by ``psum``: dense and cast leaves, Random-k's shared indices,
        PowerSGD's factors). The wire-bytes model of
        :meth:`~resireduce_jax.ExchangeTransformation.wire_bytes` reads it.
    """

    name: ClassVar[str]
    biased: ClassVar[bool]
    randomness: ClassVar[Randomness] = "none"
    collective: ClassVar[Collective] = "all_gather"

    # ----------------------------------------------------------------- per-method parts

    def init(self, like: jax.ShapeDtypeStruct) -> PyTree:
        """Returns the initial per-leaf compressor state (stateless methods: ``()``).

        Must be identical on all workers: use only ``like`` and fixed keys.
        """
        del like
        return ()

    @abc.abstractmethod
    def compress(self, x: jax.Array, state: PyTree, key: jax.Array | None) -> tuple[PyTree, PyTree]:
        """Builds the payload for one worker's leaf ``x``; returns ``(payload, new_state)``."""

    @abc.abstractmethod
    def decompress(self, payload: PyTree, like: jax.ShapeDtypeStruct) -> jax.Array:
        """Rebuilds a dense array shaped and typed like ``like`` from one worker's payload."""

    @abc.abstractmethod
    def aggregate(self, payload: PyTree, like: jax.ShapeDtypeStruct, axis_name: str) -> jax.Array:
        """Exchanges payloads across ``axis_name``; returns the mean of their decompressions."""

    @abc.abstractmethod
    def payload_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
        """Exact number of bytes one worker contributes to the collectives for this leaf."""

    # ------------------------------------------------------------------ shared machinery

    def residual(self, x: jax.Array, payload: PyTree, skip: jax.Array | None = None) -> jax.Array:
        """``x - D(payload)``: what the payload did not carry (error feedback's residual).

        The one hook for skipped steps: where the traced boolean ``skip`` is true, nothing
        was sent and the result is ``x`` itself, bit for bit (subtracting ``+0.0`` keeps
        every value, ``-0.0`` included), in the same elementwise pass so XLA can still
        write it in place. Sparse methods override this with an update of the support only.
        """
        decompressed = self.decompress(payload, jax.ShapeDtypeStruct(x.shape, x.dtype))
        if skip is not None:
            decompressed = jnp.where(skip, jnp.zeros((), x.dtype), decompressed)
        return x - decompressed

    def compress_consuming(
        self, x: jax.Array, state: PyTree, key: jax.Array | None
    ) -> tuple[PyTree, PyTree, jax.Array]:
        """:meth:`compress` inside :meth:`reduce`: returns ``(payload, new_state, x)``.

        ``x`` comes back bit for bit; a compressor may use its buffer as scratch space
        meanwhile (Top-k ranks ``|x|`` there), since :meth:`reduce` reads ``x`` only
        through the returned value.
        """
        payload, new_state = self.compress(x, state, key)
        return payload, new_state, x

    def reduce(
        self,
        x: jax.Array,
        state: PyTree,
        key: jax.Array | None,
        axis_name: str,
        skip: jax.Array | None = None,
    ) -> Reduced:
        """Compresses ``x``, exchanges it over ``axis_name`` and returns mean and residual.

        Args:
          x: this worker's (compensated) leaf.
          state: the compressor's per-leaf state.
          key: PRNG key (``None`` for deterministic compressors).
          axis_name: the mapped axis of the workers.
          skip: optional boolean scalar, equal on all workers, passed to :meth:`residual`
            (where true the residual is ``x``). Gating the mean and the state of a skipped
            step is the exchange transform's business.
        """
        like = jax.ShapeDtypeStruct(x.shape, x.dtype)
        payload, new_state, x = self.compress_consuming(x, state, key)
        mean = self.aggregate(payload, like, axis_name)
        # Order the residual after compression. Without this XLA recomputes ``x = G + R``
        # inside each consumer fusion and cannot prove that writing the new residual into
        # the donated buffer of the old one comes after compression read it, so it copies
        # every residual (measured: +24 MiB temp for 12 layers of 4 MiB). The barrier is
        # a no-op at run time and changes no value.
        x, payload = lax.optimization_barrier((x, payload))
        return Reduced(mean=mean, residual=self.residual(x, payload, skip), state=new_state)

    def reduce_carried(
        self,
        x: jax.Array,
        state: PyTree,
        key: jax.Array | None,
        axis_name: str,
        factor: float,
        skip: jax.Array | None = None,
    ) -> Reduced:
        """:meth:`reduce` for a store that keeps ``factor * mean + residual`` (the one-buffer
        compressed momentum, :class:`~resireduce_jax.residual_stores.Carry`).

        The mean is added into the residual's own buffer (:meth:`aggregate_into`) and not
        returned: ``Reduced.payload`` is, for the caller to take the mean with
        :meth:`aggregate` once it has stored the residual. One leaf-sized buffer is then
        alive at a time, where ``residual + factor * mean`` needs two.
        """
        like = jax.ShapeDtypeStruct(x.shape, x.dtype)
        payload, new_state, x = self.compress_consuming(x, state, key)
        x, payload = ordered_keeping_axes(x, payload)  # as in reduce
        r = self.residual(x, payload, skip)
        r, payload = ordered_keeping_axes(r, payload)
        kept = self.aggregate_into(payload, like, axis_name, r, factor)
        return Reduced(mean=None, residual=kept, state=new_state, payload=payload)

    def aggregate_into(
        self,
        payload: PyTree,
        like: jax.ShapeDtypeStruct,
        axis_name: str,
        acc: jax.Array,
        factor: float,
    ) -> jax.Array:
        """``acc + factor * aggregate(payload)``; sparse compressors add the payloads into
        ``acc``'s buffer without a dense mean."""
        mean = self.aggregate(payload, like, axis_name)
        return acc + factor * mean.astype(acc.dtype)

    def reduce_slices(
        self,
        x: jax.Array,
        state: PyTree,
        keys: jax.Array | None,
        axis_name: str,
        skip: jax.Array | None = None,
    ) -> Reduced:
        """:meth:`reduce` of every slice of ``x`` (``[slices, *shape]``: a layer stack,
        :mod:`resireduce_jax.layer_stacks`), vectorised over the slices: each slice is
        compressed on its own, all of them in one selection and one exchange.

        ``state`` and ``keys`` have a leading slice axis; ``skip`` is a scalar or a boolean
        per slice (``[slices]``). Every slice's mean, residual and state are those of
        :meth:`reduce` on that slice. A compressor may override this to work on the whole
        stack at once (Top-k ranks the stack's magnitudes in its own buffer).
        """
        in_axes = (
            0,
            0,
            None if keys is None else 0,
            None if skip is None or jnp.ndim(skip) == 0 else 0,
        )

        def reduce(x, state, key, skip):
            return self.reduce(x, state, key, axis_name, skip=skip)

        return jax.vmap(reduce, in_axes=in_axes)(x, state, keys, skip)

    def validate(self, path: str, like: jax.ShapeDtypeStruct) -> None:
        """Raises a ValueError if this compressor cannot handle the leaf at ``path``."""
        if not jnp.issubdtype(like.dtype, jnp.floating):
            raise ValueError(
                f"Leaf '{path}' has dtype {like.dtype}; compressor '{self.name}' handles "
                "real floating-point leaves only. Keep integer/complex values out of the "
                "gradient tree (e.g. with optax.masked) or train them uncompressed."
            )

    def compression_ratio(self, shape: tuple[int, ...], dtype: Any) -> float:
        """Dense bytes divided by payload bytes for a leaf of this shape and dtype."""
        dense = math.prod(shape) * np.dtype(dtype).itemsize
        return dense / self.payload_bytes(shape, dtype)


def ordered(x: PyTree, dependency: PyTree) -> tuple[PyTree, PyTree]:
    """``(x, dependency)``, unchanged, with every use of the returned ``x`` ordered after
    ``dependency`` is computed: a data dependency XLA keeps.

    Both go through one ``optimization_barrier`` (not CSE'd on CPU: the
    ``cse_barrier_expander`` pass is disabled by :func:`resireduce_jax.runtime.configure_cpu`).
    **Use the returned dependency** in place of the original: XLA drops the operands of a
    barrier whose results are unused, and with them the ordering (``x, _ =
    optimization_barrier((x, dependency))`` orders nothing). Values are untouched, so
    NaN/Inf in ``dependency`` cannot leak into ``x``.
    """
    return lax.optimization_barrier((x, dependency))


def ordered_keeping_axes(x: PyTree, dependency: PyTree) -> tuple[PyTree, PyTree]:
    """:func:`ordered` for the leaves of ``x`` and ``dependency`` that vary over every mesh
    axis any of them varies over; the others are returned as they are, unordered.

    A barrier's outputs vary over the union of its operands' axes (shard_map's
    ``check_vma``), so through :func:`ordered` a leaf equal on every worker, such as Random-k's
    shared indices, would come out per-worker, and so would what is computed from it (a
    mean, then the optimizer state it updates). Such a leaf depends on no worker's data.
    """

    def axes(leaf) -> frozenset:
        return frozenset(jax.typeof(leaf).manual_axis_type.varying)

    x_leaves, x_tree = jax.tree.flatten(x)
    d_leaves, d_tree = jax.tree.flatten(dependency)
    leaves = [*x_leaves, *d_leaves]
    union = frozenset().union(*(axes(leaf) for leaf in leaves))
    wide = [i for i, leaf in enumerate(leaves) if axes(leaf) == union]
    if wide:  # one barrier, as in ordered
        for i, leaf in zip(wide, lax.optimization_barrier([leaves[i] for i in wide]), strict=True):
            leaves[i] = leaf
    n = len(x_leaves)
    return x_tree.unflatten(leaves[:n]), d_tree.unflatten(leaves[n:])


def check_int(value: Any, name: str, low: int, high: int | None = None) -> int:
    """Validates an integer hyper-parameter in ``[low, high]`` (``high=None``: no upper bound)."""
    valid = f"[{low}, {high}]" if high is not None else f">= {low}"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int {valid}, got {value!r}.")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be an int {valid}, got {value!r}.")
    return int(value)


# ---------------------------------------------------------------------- exchange helpers


def check_axis_bound(axis_name: str) -> None:
    """Raises a clear ValueError when ``axis_name`` is not bound by shard_map / pmap."""
    try:
        lax.axis_index(axis_name)
    except NameError as e:
        raise ValueError(
            f"Axis name '{axis_name}' is not bound here. Compressed-communication transforms "
            f"must run inside jax.shard_map(..., mesh=...) over a mesh axis '{axis_name}' or "
            f"inside jax.pmap(..., axis_name='{axis_name}'); "
            "resireduce_jax.parallel.data_parallel_step builds such a step for you. "
            "flax.nnx.Optimizer and flax.training.train_state.TrainState.create call tx "
            "outside shard_map: see docs/exchange.md, 'Flax NNX and linen TrainState'."
        ) from e


class SummedGradientsError(ValueError):
    """An exchange got gradients that are already equal on every worker
    (:func:`check_local_gradients`)."""


def check_local_gradients(updates: Any, axis_name: str | tuple[str, ...], name: str) -> None:
    """Refuses gradients that are already the same on every worker of ``axis_name``.

    Inside ``jax.shard_map`` (with its default ``check_vma=True``) every value's type says
    which mesh axes it varies over. ``jax.grad`` with respect to replicated parameters
    returns gradients summed over the workers: a dense all-reduce in the backward pass,
    which the exchange would then compress again (docs/design.md, "Hidden dense
    all-reduce"). Such an input can only be that mistake. Under ``jax.pmap`` or
    ``check_vma=False`` the types carry no axes and nothing is checked.
    """
    axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    tracked = jax.typeof(lax.axis_index(axes)).manual_axis_type.varying
    axes = tuple(a for a in axes if a in tracked)
    if not axes:
        return
    flat = jax.tree_util.tree_flatten_with_path(updates)[0]
    summed = [
        jax.tree_util.keystr(path, simple=True, separator="/")
        for path, x in flat
        if not set(axes) <= jax.typeof(x).manual_axis_type.varying
    ]
    if summed:
        data = axes[0] if len(axes) == 1 else axes
        shown = ", ".join(f"'{p}'" for p in summed[:3]) + (" ..." if len(summed) > 3 else "")
        raise SummedGradientsError(
            f"{name} got gradients that are already equal on every worker over {data!r} "
            f"({len(summed)} of {len(flat)} leaves: {shown}): jax.grad with respect to "
            "replicated parameters inside shard_map sums the gradients over the workers, a "
            "dense all-reduce before the compressed exchange. Differentiate with respect to "
            f"lax.pcast(params, {data!r}, to='varying') (resireduce_jax.parallel."
            "data_parallel_step does), as in docs/exchange.md, 'Your own shard_map step'."
        )


def axis_size(axis_name: str | tuple[str, ...]) -> int:
    """Number of workers on ``axis_name``, or on all of a tuple of axes (a Python int at
    trace time)."""
    return lax.axis_size(axis_name)


def all_gather(x: jax.Array, axis_name: str) -> jax.Array:
    """All-gathers ``x`` to shape ``[workers, *x.shape]``, replicated on every worker.

    bfloat16 travels bit-cast to uint16: XLA:CPU otherwise widens a bfloat16 all-gather
    to float32 and sends twice the bytes (an all-gather only moves bits, so this is exact).
    """
    if x.dtype == jnp.bfloat16:
        bits = lax.all_gather(lax.bitcast_convert_type(x, jnp.uint16), axis_name, to="invarying")
        return lax.bitcast_convert_type(bits, jnp.bfloat16)
    return lax.all_gather(x, axis_name, to="invarying")


def zeros_for(shape: tuple[int, ...], dtype: Any, gathered: PyTree) -> tuple[jax.Array, PyTree]:
    """``(zeros, gathered)``: the initial value of a ``fori_loop`` whose body adds the
    ``gathered`` payloads, and ``gathered`` itself, to be used in its place.

    The zeros are this accumulator's own: a fill made after the gather (a zero scalar
    goes through one ``optimization_barrier`` with ``gathered``, and is broadcast from
    there). A plain ``jnp.zeros`` is one constant to XLA, merged with every other leaf's of
    the same shape: the merged fill is alive from the first such leaf's exchange to the
    last, and each loop starts from a copy of it (a 9 MiB fill and its copy at the compiled
    peak of a 1536-wide MLP, for error feedback and ResiReduce alike). Both results must be
    used (:func:`ordered`).

    A payload gathered over one axis of a 2-D mesh still varies over the other (the
    hierarchical exchange gathers over ``data`` values that differ along ``local``); a loop
    carry must keep its type, so the accumulator is as varying as what it receives.
    """
    zero, gathered = ordered(jnp.zeros((), dtype), gathered)
    zeros = jnp.broadcast_to(zero, shape)
    missing = set().union(*map(_varying_axes, jax.tree.leaves(gathered))) - _varying_axes(zeros)
    if missing:  # the barrier may already have made the zero as varying as ``gathered``
        zeros = lax.pcast(zeros, tuple(sorted(missing)), to="varying")
    return zeros, gathered


def varying_as(x: PyTree, like: jax.Array) -> PyTree:
    """``x`` made as varying as ``like`` inside ``shard_map`` (a loop carry that starts
    from a constant and takes ``like``'s values must be typed varying from the start)."""

    def cast(a):
        missing = _varying_axes(like) - _varying_axes(a)
        return lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a

    return jax.tree.map(cast, x)


def _varying_axes(x: jax.Array) -> set[str]:
    """The mapped axes ``x`` varies over inside ``shard_map`` (none outside)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return set(manual.varying) if manual is not None else set()


def dense_mean(x: jax.Array, axis_name: str, out_dtype: Any | None = None) -> jax.Array:
    """All-reduces ``x`` (in its own dtype) and divides by the number of workers."""
    total = lax.psum(x, axis_name)
    out_dtype = out_dtype or x.dtype
    return (total.astype(jnp.promote_types(out_dtype, jnp.float32)) / axis_size(axis_name)).astype(
        out_dtype
    )


def sparse_mean(
    values: jax.Array,
    indices: jax.Array,
    like: jax.ShapeDtypeStruct,
    axis_name: str,
) -> jax.Array:
    """Mean over workers of sparse payloads ``(values, indices)`` into a dense ``like`` array.

    All-gathers values and int32 flat indices, then scatter-adds worker after worker into
    one zero buffer (``lax.fori_loop`` over workers). Indices must be unique within a
    worker; indices ``>= size`` are padding and are dropped. Summation order is fixed, so
    the result is bit-identical on all workers on every backend.
    """
    gathered = (all_gather(values, axis_name), all_gather(indices, axis_name))
    acc_dtype = jnp.promote_types(like.dtype, jnp.float32)
    zeros, gathered = zeros_for((math.prod(like.shape),), acc_dtype, gathered)
    workers = gathered[0].shape[0]
    total = _scatter_workers(*gathered, zeros)
    return (total / workers).astype(like.dtype).reshape(like.shape)


def sparse_mean_into(
    values: jax.Array, indices: jax.Array, acc: jax.Array, axis_name: str, factor: float
) -> jax.Array:
    """``acc + factor * sparse_mean(values, indices, acc, axis_name)``, the payloads
    scatter-added into ``acc``'s own buffer worker after worker (``factor / workers`` times
    each value; indices as :func:`sparse_mean` takes them)."""
    all_values = all_gather(values, axis_name)
    scale = jnp.asarray(factor / all_values.shape[0], acc.dtype)
    flat = _scatter_workers(all_values, all_gather(indices, axis_name), acc.reshape(-1), scale)
    return flat.reshape(acc.shape)


def _scatter_workers(
    all_values: jax.Array, all_indices: jax.Array, flat: jax.Array, scale: jax.Array | None = None
) -> jax.Array:
    """``flat`` with each worker's gathered payload (times ``scale``, where given) scatter-
    added into it, worker after worker (``lax.fori_loop``: a fixed summation order)."""

    def add_worker(w, flat):
        part = all_values[w].astype(flat.dtype)
        part = part if scale is None else part * scale
        return flat.at[all_indices[w]].add(part, mode="drop", unique_indices=True)

    return lax.fori_loop(0, all_values.shape[0], add_worker, flat)


def sparse_means(
    values: jax.Array,
    indices: jax.Array,
    likes: Sequence[jax.ShapeDtypeStruct],
    axis_name: str,
) -> tuple[jax.Array, ...]:
    """:func:`sparse_mean` of one payload whose int32 indices address the concatenation
    of the flattened ``likes`` in increasing order (as
    :func:`~resireduce_jax.compressors.sparse.joint_top_k` sends them), as one mean per
    ``like``.

    One all-gather of values and indices; then each leaf's mean is scatter-added, worker
    after worker, into a buffer of its own from the ``min(k, n)`` entries of each payload
    that can fall in its ``n`` positions (:func:`leaf_window`; those of other leaves are
    dropped). The sums are :func:`sparse_mean`'s of the concatenation, element by element
    and in the same order, without a buffer the size of all the leaves together.
    """
    gathered = (all_gather(values, axis_name), all_gather(indices, axis_name))
    workers = gathered[1].shape[0]
    means: list[jax.Array] = []
    start = 0
    for like in likes:
        n = math.prod(like.shape)
        acc_dtype = jnp.promote_types(like.dtype, jnp.float32)
        # Each fill after the previous leaf's mean: fills of equal shapes made from the
        # same operands would be one constant to XLA, copied into every loop.
        zeros, (gathered, *_) = zeros_for((n,), acc_dtype, (gathered, *means[-1:]))

        def add_worker(w, acc, start=start, n=n, gathered=gathered):
            part, local = leaf_window(gathered[0][w], gathered[1][w], start, n)
            return acc.at[local].add(part.astype(acc.dtype), mode="drop", unique_indices=True)

        total = lax.fori_loop(0, workers, add_worker, zeros)
        means.append((total / workers).astype(like.dtype).reshape(like.shape))
        start += n
    return tuple(means)


def leaf_window(
    values: jax.Array, indices: jax.Array, start: int, n: int
) -> tuple[jax.Array, jax.Array]:
    """The part of a payload whose increasing int32 indices address a concatenation that
    can fall in positions ``start ... start + n - 1``: ``min(k, n)`` consecutive entries
    from the first index at or past ``start`` (moved back to fit at the end), their
    indices as :func:`indices_within` maps them (the entries of other leaves dropped)."""
    size = min(indices.shape[-1], n)
    first = jnp.searchsorted(indices, jnp.asarray(start, indices.dtype), side="left")
    first = jnp.minimum(first, indices.shape[-1] - size).astype(jnp.int32)
    part = lax.dynamic_slice_in_dim(values, first, size)
    local = indices_within(lax.dynamic_slice_in_dim(indices, first, size), start, n)
    return part, local


def indices_within(indices: jax.Array, start: int, n: int) -> jax.Array:
    """Positions ``start ... start + n - 1`` of a concatenation as positions of the leaf
    that holds them; every other index goes to its own position past ``n`` (distinct, so
    a scatter with ``unique_indices`` and ``mode="drop"`` drops them)."""
    local = indices - start
    spare = n + lax.iota(jnp.int32, indices.shape[-1])
    return jnp.where((local >= 0) & (local < n), local, spare)


def gathered_mean(
    payload: PyTree,
    decode: Any,
    like: jax.ShapeDtypeStruct,
    axis_name: str,
) -> jax.Array:
    """Mean over workers of ``decode(payload_w)``, after one all-gather per payload leaf.

    The exchange of quantized and sign payloads: every payload leaf is all-gathered in its
    own (narrow) dtype, then each worker's payload is decoded and added to one accumulator,
    worker after worker (``lax.fori_loop``), so only one decoded leaf is alive at a time
    and the summation order is fixed: the mean is bit-identical on all workers.

    Args:
      payload: one worker's payload (a pytree of arrays).
      decode: maps one worker's payload (same structure, same shapes) to a dense array
        shaped like ``like``.
      like: shape and dtype of the leaf.
      axis_name: the mapped axis of the workers.

    Returns:
      ``sum_w decode(payload_w) / W`` accumulated in (at least) float32, cast to ``like.dtype``.
    """
    gathered = jax.tree.map(lambda p: all_gather(p, axis_name), payload)
    workers = axis_size(axis_name)
    acc_dtype = jnp.promote_types(like.dtype, jnp.float32)

    def add_worker(w, acc):
        one = jax.tree.map(lambda g: lax.dynamic_index_in_dim(g, w, keepdims=False), gathered)
        return acc + decode(one).astype(acc_dtype)

    zeros, gathered = zeros_for(like.shape, acc_dtype, gathered)
    total = lax.fori_loop(0, workers, add_worker, zeros)
    return (total / workers).astype(like.dtype)


class DecodedMean:
    """Mixin: ``aggregate`` is the mean over workers of each worker's payload decompressed
    in float32 (:func:`gathered_mean`), the exchange of the quantizers and of the scaled
    sign compressors. Put it before :class:`Compressor` in the bases."""

    def aggregate(self, payload, like, axis_name):
        f32 = jax.ShapeDtypeStruct(like.shape, jnp.float32)
        return gathered_mean(payload, lambda p: self.decompress(p, f32), like, axis_name)
