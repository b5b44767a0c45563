"""Sparsifying compressors: each worker sends ``k`` values and their int32 flat indices.

A worker sends k * (itemsize + 4) bytes; payloads are all-gathered and scatter-added.
Random-k with shared indices instead all-reduces its k values.
Payload sizes are fixed at trace time: unused slots carry index n and value 0.
Methods: TopK, RandomK, FastTopK, Threshold and DGC's sampled threshold.
GRACE: https://github.com/sands-lab/grace; DGC: https://arxiv.org/abs/1712.01887.
The payload layout: docs/design.md, "Sparse payloads (compressors/sparse.py)".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from resireduce_jax._src import in_place
from resireduce_jax.compressors.base import (
    Compressor,
    Reduced,
    check_int,
    dense_mean,
    leaf_window,
    sparse_mean,
    sparse_mean_into,
    sparse_means,
    varying_as,
)
from resireduce_jax.compressors.schedule import DensitySchedule, as_density, check_density

__all__ = [
    "DGC",
    "FastTopK",
    "RandomK",
    "SparsePayload",
    "Threshold",
    "TopK",
    "check_density",
    "compact_indices",
    "num_selected",
]

# Flat indices are int32 and index n marks padding, so a leaf may have at most this many
# elements.
MAX_SPARSE_SIZE = 2**31 - 2


class SparsePayload(NamedTuple):
    """``k`` values and their flat int32 indices; an index ``>= x.size`` marks padding."""

    values: jax.Array
    indices: jax.Array


def num_selected(n: int, density: float) -> int:
    """``k = max(1, floor(density * n))``: elements sent for a leaf of ``n`` elements."""
    return max(1, math.floor(density * n))


def _add_on_support(x: jax.Array, indices: jax.Array, values: jax.Array) -> jax.Array:
    """``x`` with ``values`` added at the flat ``indices`` (padding indices are dropped)."""
    flat = x.ravel().at[indices].add(values, mode="drop", unique_indices=True)
    return flat.reshape(x.shape)


class _SparseBase(Compressor):
    """Shared decompress / residual / bytes of the values-plus-indices payload.

    The field named by ``density_field`` takes a float or a
    :class:`~resireduce_jax.compressors.schedule.DensitySchedule`; a compressor with a
    schedule describes its phases (:func:`~resireduce_jax.compressors.schedule.phases`),
    which the exchange transforms run, and cannot compress by itself.
    """

    density_field: ClassVar[str] = "density"

    def __post_init__(self):
        field = self.density_field
        object.__setattr__(self, field, as_density(getattr(self, field), field))

    def _density(self) -> float:
        value = getattr(self, self.density_field)
        if isinstance(value, DensitySchedule):
            raise ValueError(
                f"This {self.name} compressor's {self.density_field} is a schedule "
                f"({value}): only the exchange transforms (compressed_mean, error_feedback, "
                "resireduce, dgc_memory, compressed_momentum_adam) run it, one phase at a "
                "time; use compressors.schedule.phases(compressor) to get each phase's "
                "compressor."
            )
        return value

    def k(self, n: int) -> int:
        return num_selected(n, self._density())

    def decompress(self, payload: SparsePayload, like):
        n = math.prod(like.shape)
        dense = (
            jnp.zeros((n,), like.dtype)
            .at[payload.indices]
            .set(payload.values.astype(like.dtype), mode="drop", unique_indices=True)
        )
        return dense.reshape(like.shape)

    def residual(self, x, payload: SparsePayload, skip=None):
        # x - D(P) on the support only: sent entries become x_i - v_i (0 when v_i = x_i),
        # the others keep x_i; no dense D(P) is built. Subtracting the values (rather than
        # setting zeros) also orders this in-place update after the values were gathered.
        # A skipped step adds -0.0, which leaves every value (-0.0 included) unchanged.
        minus = -payload.values.astype(x.dtype)
        if skip is not None:
            minus = jnp.where(skip, jnp.asarray(-0.0, x.dtype), minus)
        return _add_on_support(x, payload.indices, minus)

    def aggregate(self, payload: SparsePayload, like, axis_name):
        return sparse_mean(payload.values, payload.indices, like, axis_name)

    def aggregate_into(self, payload: SparsePayload, like, axis_name, acc, factor):
        return sparse_mean_into(payload.values, payload.indices, acc, axis_name, factor)

    def payload_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
        return self.k(math.prod(shape)) * (np.dtype(dtype).itemsize + 4)

    def validate(self, path: str, like: jax.ShapeDtypeStruct) -> None:
        super().validate(path, like)
        size = math.prod(like.shape)
        if size > MAX_SPARSE_SIZE:
            raise ValueError(
                f"Leaf '{path}' has {size} elements; compressor '{self.name}' sends int32 "
                f"flat indices and handles at most {MAX_SPARSE_SIZE} elements per leaf. "
                "Split the parameter into smaller leaves."
            )


@dataclasses.dataclass(frozen=True)
class TopK(_SparseBase):
    """Exact Top-k on ``|x|`` (Aji & Heafield, "Sparse Communication for Distributed
    Gradient Descent", EMNLP 2017; Stich et al. 2018).

    Sends the ``k = max(1, floor(density * n))`` entries of largest magnitude; ties are
    broken by lower flat index (``lax.top_k``'s order). Biased: use error feedback.

    Attributes:
      density: fraction of entries sent, in (0, 1].
    """

    density: float | DensitySchedule = 0.01
    name: ClassVar[str] = "topk"
    biased: ClassVar[bool] = True

    def compress(self, x, state, key):
        del key
        flat = x.ravel()
        _, indices = lax.top_k(jnp.abs(flat), self.k(flat.size))
        indices = indices.astype(jnp.int32)
        return SparsePayload(flat[indices], indices), state

    def compress_consuming(self, x, state, key):
        """:meth:`compress` with ``|x|`` ranked in ``x``'s own buffer.

        The payload is ``compress``'s, bit for bit, but ``|x|`` is written over ``x`` with
        its signs kept as bits (:func:`resireduce_jax._src.in_place.magnitudes`), Top-k reads it
        there and the signs are put back: no leaf-sized ``|x|`` buffer exists beside ``x``
        at a large layer's exchange (docs/design.md, "Residuals at the compiled peak").
        """
        del key
        payload, x = self._select_in_place(x, None)
        return payload, state, x

    def reduce_slices(self, x, state, keys, axis_name, skip=None):
        """:meth:`reduce` of every slice of a layer stack ``x`` at once: ``|x|`` of the whole
        stack in its buffer (blocks as small as one slice's), one Top-k per slice (a batched
        ``lax.top_k``), one exchange; each slice's mean and residual are :meth:`reduce`'s.
        Under ``jax.vmap`` a slice's in-place maps would cover every slice at once: a
        leaf-sized ``|x|`` of the whole stack beside it."""
        del keys
        like = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        payload, x = self._select_in_place(x, x.shape[0])
        mean = jax.vmap(lambda p: self.aggregate(p, like, axis_name))(payload)
        x, payload = lax.optimization_barrier((x, payload))  # as in reduce
        skip_axis = None if skip is None or jnp.ndim(skip) == 0 else 0
        residual = jax.vmap(self.residual, in_axes=(0, 0, skip_axis))(x, payload, skip)
        return Reduced(mean=mean, residual=residual, state=state)

    def reduce_jointly(
        self,
        xs: tuple[jax.Array, ...],
        axis_name: str,
        skip: jax.Array | None = None,
    ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """Whole-model Top-k: the ``k = density * N`` entries of largest magnitude among
        all ``N`` entries of ``xs`` (one dtype), sent as one payload whose int32 indices
        address the leaves' concatenation; returns each leaf's mean and residual.

        The entries are those of Top-k on the concatenation (ties to the lower position),
        found without sorting and without forming the concatenation
        (:func:`joint_top_k`); they travel in position order. Means
        (:func:`~resireduce_jax.compressors.base.sparse_means`) and residuals are built
        leaf by leaf in buffers of their own, each residual in its leaf's.
        """
        k = self.k(sum(x.size for x in xs))
        values, indices = joint_top_k(xs, k)
        likes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]
        means = sparse_means(values, indices, likes, axis_name)
        # Residuals after the payload was read, as in :meth:`reduce`.
        xs, values, indices = lax.optimization_barrier((xs, values, indices))
        residuals = []
        start = 0
        for x in xs:
            part, local = leaf_window(values, indices, start, x.size)
            residuals.append(self.residual(x, SparsePayload(part, local), skip))
            start += x.size
        return means, tuple(residuals)

    def _select_in_place(self, x, slices: int | None) -> tuple[SparsePayload, jax.Array]:
        """The payload of ``x`` (of each of its ``slices`` along axis 0) and ``x`` again."""
        magnitude, bits = in_place.magnitudes(x, slices=slices or 1)
        n = x.size // (slices or 1)
        ranked = magnitude.ravel() if slices is None else magnitude.reshape(slices, n)
        top, indices = lax.top_k(ranked, self.k(n))
        indices = indices.astype(jnp.int32)
        # Top-k has read |x| before the signs are restored over it.
        magnitude, bits, top, indices = lax.optimization_barrier((magnitude, bits, top, indices))
        flat = indices
        if slices is not None:  # indices into the whole stack, for its sign bits
            flat = indices + n * jnp.arange(slices, dtype=jnp.int32)[:, None]
        payload = SparsePayload(in_place.signed_at(top, bits, flat), indices)
        return payload, in_place.with_signs(magnitude, bits, slices=slices or 1)


@dataclasses.dataclass(frozen=True)
class RandomK(_SparseBase):
    """Random-k sparsification with indices shared by all workers (Stich et al., "Sparsified
    SGD with Memory", NeurIPS 2018; GRACE's RandomK).

    The flat leaf is cut into ``k`` contiguous strata of near-equal size and one index is
    drawn uniformly inside each stratum (stratified sampling, O(k) work instead of a
    permutation of all ``n`` indices). Every element is sent with probability
    ``1 / len(stratum) ≈ k / n``. All workers use the same key, so they select the same
    indices and the ``k`` values are summed with one ``k``-element all-reduce.

    With ``scaled=True`` each value is multiplied by its stratum size, which makes the
    compressor unbiased (``E[D(Q(x))] = x``) at the price of variance; with
    ``scaled=False`` (GRACE's default) it is biased and meant for error feedback.

    Attributes:
      density: fraction of entries sent, in (0, 1].
      scaled: rescale sent values to make the estimator unbiased.
    """

    density: float | DensitySchedule = 0.01
    scaled: bool = False
    name: ClassVar[str] = "randomk"
    randomness: ClassVar[str] = "shared"
    collective: ClassVar[str] = "all_reduce"  # the k values; indices come from the key

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return not self.scaled

    def _strata(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        k = self.k(n)
        starts = (np.arange(k, dtype=np.int64) * n) // k
        sizes = np.diff(np.append(starts, n))
        return starts.astype(np.int32), sizes.astype(np.int32)

    def compress(self, x, state, key):
        if key is None:
            raise ValueError("randomk needs a PRNG key shared by all workers.")
        flat = x.ravel()
        starts, sizes = self._strata(flat.size)
        offsets = jax.random.randint(key, starts.shape, 0, sizes)  # per-stratum maxval
        indices = jnp.asarray(starts) + offsets.astype(jnp.int32)
        values = flat[indices]
        if self.scaled:
            values = values * jnp.asarray(sizes, values.dtype)
        return SparsePayload(values, indices), state

    def residual(self, x, payload: SparsePayload, skip=None):
        if self.scaled:  # D(Q(x)) = size * x_i at the chosen index, not x_i.
            return Compressor.residual(self, x, payload, skip)
        return super().residual(x, payload, skip)

    aggregate_into = Compressor.aggregate_into  # its own aggregate, then the sum

    def aggregate(self, payload: SparsePayload, like, axis_name):
        # Same indices on every worker: sum the k values densely, scatter once.
        mean_values = dense_mean(payload.values, axis_name, like.dtype)
        return self.decompress(SparsePayload(mean_values, payload.indices), like)

    def payload_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
        # Only values travel; indices are regenerated from the shared key.
        return self.k(math.prod(shape)) * np.dtype(dtype).itemsize


# --------------------------------------------------------------- fixed-capacity selection


def compact_indices(mask: jax.Array, capacity: int, fill: int) -> jax.Array:
    """Positions of the first ``capacity`` ``True`` entries of a 1-D ``mask``, in order.

    Stream compaction into a fixed-size buffer: an inclusive prefix count gives every
    selected entry its slot, and one scatter writes the positions. Selected entries beyond
    ``capacity`` are dropped; unused slots hold ``fill``. The prefix count is a
    ``lax.associative_scan``, which XLA:CPU runs about twice as fast as ``jnp.cumsum``.

    Args:
      mask: 1-D boolean array.
      capacity: number of slots (static).
      fill: value of unused slots (e.g. ``mask.size``: out of range, dropped downstream).

    Returns:
      An int32 array of ``capacity`` positions into ``mask``.
    """
    slot = lax.associative_scan(jnp.add, mask.astype(jnp.int32)) - 1
    slot = jnp.where(mask, slot, capacity)  # unselected entries write out of range
    positions = jnp.arange(mask.size, dtype=jnp.int32)
    return jnp.full((capacity,), fill, jnp.int32).at[slot].set(positions, mode="drop")


JOINT_BLOCK = 1 << 16
"""Entries of a leaf that :func:`joint_top_k` compacts at once."""

JOINT_SAMPLE = 1 << 14
"""Entries, evenly spaced over the leaves, whose magnitudes bracket :func:`joint_top_k`'s
threshold before any count over every leaf."""

JOINT_MARGIN = 4.0
"""Binomial standard deviations between the sampled ranks that bracket the threshold and
the rank expected of it (:func:`joint_top_k`)."""


def joint_top_k(xs: Sequence[jax.Array], k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` entries of largest magnitude among all entries of ``xs`` (one dtype), as
    ``(values, indices)`` with int32 indices into the leaves' flat concatenation, in
    position order; ties go to the lower position, as ``lax.top_k``'s do.

    No sort of the leaves and no concatenation. Non-negative floats order as their bit
    patterns, so a threshold is searched for on those integers, each probe ``t`` one count
    ``C(t) = #{|x| >= t}`` over every leaf (written ``x >= t or x <= -t``, so that no
    ``|x|`` is formed once outside the loop: a loop-invariant temporary as large as every
    leaf). The search ends at a ``t`` with ``C(t) = k`` (the entries at or above it are
    the Top-k) or, where ties at the ``k``-th largest magnitude ``T`` leave no such ``t``,
    at ``T`` itself. It starts from a bracket read off a sample (:data:`JOINT_SAMPLE`
    entries, evenly spaced): the sampled magnitudes :data:`JOINT_MARGIN` binomial standard
    deviations below and above the rank expected of ``T``, each checked by a count (where
    a count refutes one, the bracket keeps what the count proves). Inside it, regula falsi
    on ``log C - log k`` (a tail's count falls about exponentially in the bits) with
    Illinois's rule (an end kept twice in a row counts half) aims at ``C = k``; after two
    probes that did not halve the bracket, one bisects it. After the sample's two, that
    is 5-10 probes on 4.8 M normal, Student-t and log-normal entries at densities 1 % and
    0.1 % (bisection alone: 31 for float32), and never more than three times bisection's.
    Then every leaf is compacted into the payload block by block (:data:`JOINT_BLOCK`
    entries at a time), in position order, taking the entries above the threshold and, of
    those equal to ``T``, the first ``k - #{|x| > T}``.
    """
    n_total = sum(x.size for x in xs)
    if not 0 < k <= n_total or n_total >= 2**31:
        raise ValueError(f"joint_top_k takes 0 < k <= {n_total} < 2**31 entries, got k={k}.")
    flats = [x.ravel() for x in xs]
    dtype = flats[0].dtype
    width = jnp.dtype(dtype).itemsize
    itype = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[width]
    wide = jnp.int64 if width == 8 else jnp.int32  # the search's arithmetic
    real = jnp.float64 if width == 8 else jnp.float32  # its interpolation
    top = int(jnp.iinfo(itype).max)  # the largest non-negative bit pattern

    def count_at_least(t: jax.Array, strict: bool = False) -> jax.Array:
        total = jnp.zeros((), jnp.int32)
        for f in flats:
            above = (f > t) | (f < -t) if strict else (f >= t) | (f <= -t)
            total = total + jnp.sum(above, dtype=jnp.int32)
        return total

    def as_float(bits: jax.Array) -> jax.Array:
        return lax.bitcast_convert_type(bits.astype(itype), dtype)

    def as_bits(value: jax.Array) -> jax.Array:
        return lax.bitcast_convert_type(value, itype).astype(wide)

    def observe(state, probe, count):
        """The bracket ``lo <= T <= hi`` with ``C(lo) = c_lo >= k`` and ``C(hi + 1) = c_up
        < k``, narrowed by one count ``C(probe)``."""
        lo, hi, c_lo, c_up = state
        fits = count >= k
        raise_lo = fits & (probe > lo)
        lower_hi = ~fits & (probe - 1 < hi)
        return (
            jnp.where(raise_lo, probe, lo),
            jnp.where(lower_hi, probe - 1, hi),
            jnp.where(raise_lo, count, c_lo),
            jnp.where(lower_hi, count, c_up),
        )

    # The bracket: everything (C(0) = n_total assumed, C(past top) = 0), then the sample's.
    state = (
        jnp.zeros((), wide),
        jnp.asarray(top, wide),
        jnp.asarray(n_total, jnp.int32),
        jnp.zeros((), jnp.int32),
    )
    stride = max(1, n_total // JOINT_SAMPLE)
    sample, start = [], 0
    for f in flats:  # global positions stride // 2 + j * stride
        first = (stride // 2 - start) % stride
        if first < f.size:
            sample.append(f[first::stride])
        start += f.size
    magnitudes = jnp.abs(jnp.concatenate(sample))
    magnitudes = jnp.sort(jnp.where(jnp.isnan(magnitudes), 0, magnitudes))[::-1]  # NaN: uncounted
    if stride == 1:  # the sample is every entry: its k-th magnitude is T
        probe = as_bits(magnitudes[k - 1])
        lo, _, c_lo, c_up = observe(state, probe, count_at_least(as_float(probe)))
        state = (lo, lo, c_lo, c_up)  # nothing above T is counted k times
    else:
        m = magnitudes.size
        expected = k * m / n_total  # the sampled entries at or above T, on average
        spread = JOINT_MARGIN * math.sqrt(expected) + 1
        ranks = {min(m, math.ceil(expected + spread))}  # a magnitude at or below T
        if expected - spread >= 1:
            ranks.add(math.floor(expected - spread))  # one above it
        for rank in sorted(ranks):
            probe = as_bits(magnitudes[rank - 1])
            state = observe(state, probe, count_at_least(as_float(probe)))

    def searching(carry):
        (lo, hi, c_lo, _), *_ = carry
        return (lo < hi) & (c_lo != k)

    def log_over_k(count: jax.Array) -> jax.Array:
        return jnp.log(jnp.maximum(count, 0.5).astype(real)) - math.log(k)

    cap = np.nextafter(np.asarray(float(top), real), 0)  # the largest offset as an integer

    def narrow(carry):
        (lo, hi, c_lo, c_up), (f_lo, f_up), side, stale = carry
        # Regula falsi on log C - log k against the bits (a tail's count falls about
        # exponentially in them), aiming at C = k, the gap below the k-th largest
        # magnitude. Illinois's rule: an end kept twice in a row counts half, so both
        # ends move. Bisection after two probes that did not halve the bracket.
        fraction = f_lo / jnp.maximum(f_lo - f_up, 1e-12)
        offset = jnp.floor(fraction * (hi - lo).astype(real))
        offset = jnp.clip(offset, 0, cap).astype(wide)
        guess = hi - jnp.maximum(hi - lo - 1 - offset, 0)  # lo + 1 + offset, at most hi
        middle = lo + (hi - lo) // 2 + (hi - lo) % 2
        probe = jnp.where(stale >= 2, middle, guess)
        count = count_at_least(as_float(probe))
        narrowed = observe((lo, hi, c_lo, c_up), probe, count)
        raised = count >= k  # lo moved (else hi did)
        f_new = log_over_k(count)
        f_lo = jnp.where(raised, f_new, jnp.where(side < 0, f_lo / 2, f_lo))
        f_up = jnp.where(raised, jnp.where(side > 0, f_up / 2, f_up), f_new)
        halved = (narrowed[1] - narrowed[0]) <= (hi - lo) // 2
        stale = jnp.where(halved | (stale >= 2), 0, stale + 1)
        return narrowed, (f_lo, f_up), jnp.where(raised, 1, -1), stale

    fs = (log_over_k(state[2]), log_over_k(state[3]))
    zero = jnp.zeros((), jnp.int32)
    carry = varying_as((state, fs, zero, zero), flats[0])
    (lo, _, c_lo, _), *_ = lax.while_loop(searching, narrow, carry)
    threshold = as_float(lo)
    all_ties = c_lo == k  # the usual case: no tie to cut (c_lo = C(lo), or n_total at lo = 0)
    ties_wanted = lax.cond(
        all_ties,
        lambda: varying_as(jnp.asarray(k, jnp.int32), flats[0]),
        lambda: k - count_at_least(threshold, strict=True),
    )

    values = jnp.zeros((k,), dtype)
    indices = jnp.full((k,), n_total, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    carry = varying_as((zero, zero, values, indices), flats[0])
    start = 0
    for flat in flats:
        n = flat.size
        block = min(n, JOINT_BLOCK)
        spare = k + lax.iota(jnp.int32, block)

        def compact(b, carry, flat=flat, start=start, n=n, block=block, spare=spare):
            filled, ties, values, indices = carry
            at = jnp.minimum(b * block, n - block)  # the last block ends at the leaf's end
            v = lax.dynamic_slice_in_dim(flat, at, block)
            pos = at + lax.iota(jnp.int32, block)
            fresh = pos >= b * block  # not again where the last block overlaps

            def cut_ties():  # the ties at the threshold, in position order, while wanted
                tie = ((v == threshold) | (v == -threshold)) & fresh
                rank = ties + lax.associative_scan(jnp.add, tie.astype(jnp.int32)) - 1
                above = ((v > threshold) | (v < -threshold)) & fresh
                return above | (tie & (rank < ties_wanted)), ties + jnp.sum(tie, dtype=jnp.int32)

            def every_tie():
                return ((v >= threshold) | (v <= -threshold)) & fresh, ties

            chosen, ties = lax.cond(all_ties, every_tie, cut_ties)
            slot = filled + lax.associative_scan(jnp.add, chosen.astype(jnp.int32)) - 1
            slot = jnp.where(chosen, slot, spare)  # unchosen entries write out of range
            values = values.at[slot].set(v, mode="drop", unique_indices=True)
            indices = indices.at[slot].set(start + pos, mode="drop", unique_indices=True)
            filled = filled + jnp.sum(chosen, dtype=jnp.int32)
            return filled, ties, values, indices

        carry = lax.fori_loop(0, -(-n // block), compact, carry)
        start += n
    return carry[2], carry[3]


def _gather_padded(flat: jax.Array, indices: jax.Array) -> jax.Array:
    """``flat[indices]`` with ``0`` where an index is padding (``>= flat.size``)."""
    return flat.at[indices].get(mode="fill", fill_value=0)


def _top_candidates(magnitudes: jax.Array, positions: jax.Array, k: int, n: int) -> jax.Array:
    """Exact top-``k`` among candidate ``magnitudes`` (``< 0`` marks an empty slot).

    Returns the flat leaf indices of the chosen candidates, ``n`` for empty slots.
    """
    top, j = lax.top_k(magnitudes, k)
    return jnp.where(top >= 0, positions[j], n).astype(jnp.int32)


def _check_fraction_above_zero(value: Any, name: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}.") from None
    if not (out > 0.0 and math.isfinite(out)):  # also rejects NaN
        raise ValueError(f"{name} must be a positive finite number, got {value!r}.")
    return out


@dataclasses.dataclass(frozen=True)
class _TwoLevelPlan:
    """Static sizes of one :class:`FastTopK` selection (all Python ints)."""

    sample_size: int  # m: entries sampled to estimate the threshold
    stride: int  # one sample per stratum of this many entries
    rank: int  # the threshold is the rank-th largest sampled magnitude
    capacity: int  # candidate slots (>= k)
    block: int  # entries per block of the block-level filter


@dataclasses.dataclass(frozen=True)
class FastTopK(_SparseBase):
    """Fast Top-k for large leaves: sampled threshold, two-level compaction, exact top-k of
    the candidates.

    Exact ``lax.top_k`` over tens of millions of entries dominates a compressed step on CPU
    (docs/design.md, "Top-k selection speed on CPU"). This selection touches the full
    leaf only with cheap, streaming passes and runs the exact top-k on about ``k``
    candidates:

    1. Threshold. A stratified sample of ``m = min(n, max(16384, ceil(sample_ratio n)))``
       magnitudes (one per stratum of ``n // m`` entries, at fixed pseudo-random offsets)
       has ``mu = m k / n`` entries above the true k-th largest magnitude on average. The
       threshold ``t`` is the ``r``-th largest sample with ``r = ceil(mu + margin sqrt(mu))``,
       so that about ``r n / m >= k`` entries pass it.
    2. Block filter. The leaf is cut into blocks of ``b`` entries; blocks whose maximum
       passes ``t`` are compacted into ``C`` slots (a prefix count over ``n / b`` block
       maxima), where ``C = ceil((r + margin sqrt(r)) n / m)`` bounds the candidate count.
    3. Element filter. Entries of the kept blocks that pass ``t`` are compacted into ``C``
       slots (a prefix count over ``C b`` entries).
    4. ``lax.top_k`` over the ``C`` candidates picks the ``k`` largest.

    Recall: the result is exactly the Top-k set (up to ties) whenever the number of
    entries passing ``t`` lies in ``[k, C]``; ``margin`` (in binomial standard deviations)
    makes both failures rare for any data distribution, since only sample quantiles are
    used. If fewer than ``k`` pass, the payload is padded (index ``n``, value ``0``); if
    more than ``C`` pass, candidates beyond ``C`` in index order are ignored. Zeros and
    NaNs are never selected. Measured recall and speed: ``benchmarks/compressors.py``.
    Leaves with fewer than ``exact_below`` entries, or where ``C > n / 2``, use exact
    ``lax.top_k``. Biased (like Top-k): use error feedback.

    Payload: ``k = max(1, floor(density n))`` values (leaf dtype) + ``k`` int32 indices,
    ``k (itemsize + 4)`` bytes per worker; exchanged by all-gather + scatter-add.

    Attributes:
      density: fraction of entries sent, in (0, 1].
      sample_ratio: fraction of entries sampled for the threshold, in (0, 1].
      margin: safety margin of the threshold and the capacity, in standard deviations.
      exact_below: leaves with fewer entries use exact ``lax.top_k``.
      seed: seed of the fixed sample offsets (the same on every worker and step).
    """

    density: float | DensitySchedule = 0.01
    sample_ratio: float = 0.01
    margin: float = 4.0
    exact_below: int = 1 << 18
    seed: int = 0
    name: ClassVar[str] = "fast_topk"
    biased: ClassVar[bool] = True

    MIN_SAMPLE: ClassVar[int] = 16384

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "sample_ratio", check_density(self.sample_ratio, "sample_ratio"))
        object.__setattr__(self, "margin", _check_fraction_above_zero(self.margin, "margin"))
        object.__setattr__(self, "exact_below", check_int(self.exact_below, "exact_below", 0))
        object.__setattr__(self, "seed", check_int(self.seed, "seed", 0))

    def plan(self, n: int) -> _TwoLevelPlan | None:
        """The static sizes of the selection for ``n`` entries; ``None`` means exact top-k."""
        if n < max(self.exact_below, 2):
            return None
        k = self.k(n)
        m = min(n, max(self.MIN_SAMPLE, math.ceil(self.sample_ratio * n)))
        stride = n // m
        mu = m * k / n
        rank = min(m, math.ceil(mu + self.margin * math.sqrt(mu)))
        capacity = max(k, math.ceil((rank + self.margin * math.sqrt(rank)) * n / m))
        if 2 * capacity > n:
            return None
        # Balance the two prefix counts: n / b block maxima against C b entries.
        block = int(2 ** round(math.log2(math.sqrt(n / capacity))))
        block = min(max(block, 2), 256)
        return _TwoLevelPlan(m, stride, rank, capacity, block)

    def compress(self, x, state, key):
        del key
        flat = x.ravel()
        n, k = flat.size, self.k(flat.size)
        magnitudes = jnp.abs(flat)
        plan = self.plan(n)
        if plan is None:
            _, indices = lax.top_k(magnitudes, k)
            indices = indices.astype(jnp.int32)
            return SparsePayload(flat[indices], indices), state
        indices = self._select(magnitudes, k, plan)
        return SparsePayload(_gather_padded(flat, indices), indices), state

    def _select(self, magnitudes: jax.Array, k: int, plan: _TwoLevelPlan) -> jax.Array:
        n, b, cap = magnitudes.size, plan.block, plan.capacity
        offsets = jax.random.randint(
            jax.random.PRNGKey(self.seed), (plan.sample_size,), 0, plan.stride, jnp.int32
        )
        sample = magnitudes[jnp.arange(plan.sample_size, dtype=jnp.int32) * plan.stride + offsets]
        threshold = lax.top_k(sample, plan.rank)[0][-1]

        num_blocks = -(-n // b)
        blocks = jnp.pad(magnitudes, (0, num_blocks * b - n), constant_values=-1).reshape(
            num_blocks, b
        )
        block_max = blocks.max(axis=1)
        block_cap = min(num_blocks, cap)
        kept_blocks = compact_indices(
            (block_max >= threshold) & (block_max > 0), block_cap, fill=num_blocks
        )
        candidates = blocks.at[kept_blocks].get(mode="fill", fill_value=-1).ravel()
        slots = compact_indices(
            (candidates >= threshold) & (candidates > 0), cap, fill=candidates.size
        )
        chosen = candidates.at[slots].get(mode="fill", fill_value=-1)
        block_of = kept_blocks.at[slots // b].get(mode="fill", fill_value=num_blocks)
        positions = block_of * b + slots % b
        return _top_candidates(chosen, positions, k, n)


@dataclasses.dataclass(frozen=True)
class Threshold(_SparseBase):
    """Threshold sparsification: send every entry with ``|x| >= tau`` (Strom, "Scalable
    Distributed DNN Training Using Commodity GPU Cloud Computing", Interspeech 2015; the
    "hard threshold" sparsifier of Sahu et al., NeurIPS 2021).

    The number of entries above ``tau`` varies from step to step, but collectives need
    static shapes, so the payload has a fixed capacity ``c = max(1, floor(max_density n))``.
    Passing entries are compacted in flat-index order (prefix count + scatter); **entries
    beyond the capacity stay unsent**: they remain in ``x - D(P)``, so error feedback
    carries them to the next step, but without error feedback they are lost. Unused slots
    are padding (index ``n``, value ``0``). Biased: use error feedback.

    Payload: ``c`` values (leaf dtype) + ``c`` int32 indices, ``c (itemsize + 4)`` bytes
    per worker whatever the number of passing entries; exchanged by all-gather +
    scatter-add.

    Attributes:
      tau: the magnitude threshold, ``> 0``.
      max_density: capacity as a fraction of the leaf's entries, in (0, 1].
    """

    tau: float = 1e-3
    max_density: float | DensitySchedule = 0.01
    name: ClassVar[str] = "threshold"
    biased: ClassVar[bool] = True
    density_field: ClassVar[str] = "max_density"

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "tau", _check_fraction_above_zero(self.tau, "tau"))

    def compress(self, x, state, key):
        del key
        flat = x.ravel()
        indices = compact_indices(jnp.abs(flat) >= self.tau, self.k(flat.size), fill=flat.size)
        return SparsePayload(_gather_padded(flat, indices), indices), state


@dataclasses.dataclass(frozen=True)
class DGC(_SparseBase):
    """Deep Gradient Compression's selection (Lin et al., "Deep Gradient Compression:
    Reducing the Communication Bandwidth for Distributed Training", ICLR 2018, §3.1 and
    Appendix "sampling to reduce top-k selection time").

    DGC avoids a full Top-k: it samples ``m = max(1, ceil(sample_ratio n))`` entries (with
    replacement, a fresh sample per worker and step), takes the threshold ``t`` as the
    ``s``-th largest sampled magnitude (``s = ceil(density m)``), and — where too many or
    too few entries pass — corrects ``t`` in at most ``rounds`` adjustment rounds: each
    counts the passing entries ``c`` (one pass over the leaf) and stops once ``c`` lies in
    ``[k, C]`` with ``C = ceil((1 + tolerance) k)``; otherwise ``t`` doubles (``c > C``) or
    halves (``c < k``) until a too-low and a too-high threshold are known, then
    interpolates between them linearly in ``(log t, log c)`` towards ``c = sqrt(k C)``.
    Passing entries are compacted into ``C`` slots (beyond ``C``: ignored, in index order)
    and, as DGC does when more than ``k`` pass, the exact top-``k`` of these candidates is
    sent.

    The selection equals exact Top-k (up to ties) whenever the final count lies in
    ``[k, C]``; with fewer than ``k`` passing entries the payload is padded (index ``n``,
    value ``0``). Zeros and NaNs are never selected. Biased: use error feedback, or DGC's
    own memory, which replaces it: momentum correction, local gradient clipping and
    momentum factor masking are :func:`resireduce_jax.dgc_memory` (the first transform of
    an optax chain, with this or another sparsifying compressor) and
    :func:`resireduce_jax.deep_gradient_compression` (that memory followed by SGD without
    momentum), both in :mod:`resireduce_jax.dgc`.

    Payload: ``k = max(1, floor(density n))`` values (leaf dtype) + ``k`` int32 indices,
    ``k (itemsize + 4)`` bytes per worker; exchanged by all-gather + scatter-add.

    Attributes:
      density: fraction of entries sent, in (0, 1].
      sample_ratio: fraction of entries sampled, in (0, 1] (the paper uses 0.1 %–1 %).
      rounds: number of threshold adjustment rounds, ``>= 0``.
      tolerance: slack of the candidate capacity above ``k``, ``> 0``.
    """

    density: float | DensitySchedule = 0.01
    sample_ratio: float = 0.01
    rounds: int = 4
    tolerance: float = 0.25
    name: ClassVar[str] = "dgc"
    biased: ClassVar[bool] = True
    randomness: ClassVar[str] = "per_worker"

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "sample_ratio", check_density(self.sample_ratio, "sample_ratio"))
        object.__setattr__(self, "rounds", check_int(self.rounds, "rounds", 0, 100))
        object.__setattr__(
            self, "tolerance", _check_fraction_above_zero(self.tolerance, "tolerance")
        )

    def capacity(self, n: int) -> int:
        """Candidate slots ``C = min(n, ceil((1 + tolerance) k))``."""
        return min(n, math.ceil((1.0 + self.tolerance) * self.k(n)))

    def compress(self, x, state, key):
        if key is None:
            raise ValueError("dgc needs a PRNG key (independent per worker) for its sample.")
        flat = x.ravel()
        n, k, cap = flat.size, self.k(flat.size), self.capacity(flat.size)
        magnitudes = jnp.abs(flat)
        m = max(1, math.ceil(self.sample_ratio * n))
        sample = magnitudes[jax.random.randint(key, (m,), 0, n, jnp.int32)]

        def passing(threshold):
            return (magnitudes >= threshold) & (magnitudes > 0)

        def count(threshold):
            return passing(threshold).sum(dtype=jnp.int32)

        def off_target(carry):
            i, _, c = carry[:3]
            return (i < self.rounds) & ((c < k) | (c > cap))

        log_target = 0.5 * (math.log(k) + math.log(cap))

        def adjust(carry):
            i, t, c, low, c_low, high, c_high = carry
            too_many = c > cap  # else too few
            low, c_low = jnp.where(too_many, t, low), jnp.where(too_many, c, c_low)
            high, c_high = jnp.where(too_many, high, t), jnp.where(too_many, c_high, c)
            bracketed = (low > 0) & jnp.isfinite(high)
            # Bracketed: interpolate log(count) linearly in log(threshold) (exact for
            # power-law tails); with no entry above `high`, bisect geometrically.
            lc_low, lc_high = (
                jnp.log(c_low.astype(jnp.float32)),
                jnp.log(c_high.astype(jnp.float32)),
            )
            frac = (lc_low - log_target) / jnp.where(c_high > 0, lc_low - lc_high, 1.0)
            log_t = jnp.log(low) + frac * (jnp.log(high) - jnp.log(low))
            t = jnp.where(
                bracketed,
                jnp.where(c_high > 0, jnp.exp(log_t), jnp.sqrt(low * high)),
                jnp.where(too_many, 2 * t, t / 2),  # not bracketed yet: expand
            ).astype(t.dtype)
            return i + 1, t, count(t), low, c_low, high, c_high

        t0 = lax.top_k(sample, min(max(1, math.ceil(self._density() * m)), m))[0][-1]
        c0 = count(t0)
        # *_like keeps the carry's varying-ness over a mapped axis equal to t0's.
        low, high, none_yet = jnp.zeros_like(t0), jnp.full_like(t0, jnp.inf), jnp.zeros_like(c0)
        carry = (0, t0, c0, low, none_yet, high, none_yet)
        threshold = lax.while_loop(off_target, adjust, carry)[1]
        slots = compact_indices(passing(threshold), cap, fill=n)
        chosen = magnitudes.at[slots].get(mode="fill", fill_value=-1)
        indices = _top_candidates(chosen, slots, k, n)
        return SparsePayload(_gather_padded(flat, indices), indices), state
