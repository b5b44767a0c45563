"""Compressed-momentum Adam: dense Adam, then the momentum sent compressed, error-fed.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed", ICML 2021 (https://arxiv.org/abs/2102.02888), §3 and Algorithm 1.
Adam and error feedback do not commute, so Adam runs densely for a warm-up first.
Then the second moment is frozen and each worker's momentum is sent compressed.
The momentum error lives in the exchange's stores, so ResiReduce's stores apply to it.
Where a leaf's store is its own (``"leaf"``), the momentum lives there too: one buffer
``w_i = b1 m + e_i`` per worker (``one_buffer``).
The transform replaces both the exchange and the optimizer of a chain.
The algorithm step by step and its warm-up: docs/design.md, "Compressed-momentum Adam
(compressed_momentum.py)" and "One-buffer compressed momentum".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from resireduce_jax import carried as carried_lib
from resireduce_jax import nonfinite
from resireduce_jax.compressors import schedule
from resireduce_jax.compressors.base import axis_size
from resireduce_jax.compressors.dense import is_dense
from resireduce_jax.exchange import ExchangePlan, ExchangeState, ExchangeTransformation
from resireduce_jax.optimizers._common import (
    MaskOrFn,
    ScalarOrSchedule,
    check_hyperparameters,
    check_max_grad_norm,
    check_non_negative,
    clip_factor,
    decay_flags,
    descend,
    global_norm,
    require_params,
    scalar_as,
    value_at,
)
from resireduce_jax.residual_stores import Carry

PyTree = Any

__all__ = [
    "CompressedMomentumState",
    "FrozenNu",
    "NuFormat",
    "WarmSlices",
    "buffer_bytes",
    "compressed_momentum_adam",
    "compressed_momentum_sgd",
    "resize_frozen_nu",
    "warm_slices",
    "warmup_steps",
]


@nonfinite.register_skip_aware
class CompressedMomentumState(NamedTuple):
    """State of :func:`compressed_momentum_adam`.

    Attributes:
      count: steps taken (int32): bias correction, schedules and the warm-up's end. Not
        advanced by a skipped step.
      mu: the first moment :math:`m`, like ``params``; replicated. In the one-buffer form
        a carried leaf's entry is an empty ``optax.MaskedNode()``: its momentum is in
        the exchange's store (``b1 m + e_i``; :math:`m` itself during the warm-up).
      nu: the second moment :math:`v`, like ``params``; replicated, frozen after the
        warm-up.
      exchange: the exchange's state; its residuals hold each worker's momentum error.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    exchange: ExchangeState


class FrozenNu(NamedTuple):
    """A leaf's second moment in a quantized ``frozen_nu_format``: float32 slices while
    warm, 8-bit codes with per-block scales once frozen (Li et al., "Memory Efficient
    Optimizers with 4-bit States", NeurIPS 2023: blocks, and no zero code where v divides).

    While warm, the codes' bytes are unused, so they hold this worker's float32 slices
    (:func:`warm_slices`): :math:`m`'s first (the one-buffer ``"update"`` form) where they
    have room for one slice, then :math:`v`'s where they have room for two.

    Attributes:
      warm: float32 ``[ceil(n / N)]``: this worker's ``1/N`` of :math:`v` during the
        warm-up (``N`` workers) where the codes cannot hold it, else ``[1]``, unused
        (orbax saves no empty array, and the state's structure and partitioning stay
        those of every worker count); kept, unused, after the freeze.
      codes: uint8 ``[blocks, block]``: :math:`s = \\sqrt{\\max(v, f)}` as
        ``round(255 s / scale)`` clipped to 1 ... 255: no code decodes to zero.
      scales: float32 ``[blocks]``: each block's largest :math:`s`.
      floor: float32 ``[]``: :math:`f` = ``nu_floor`` times the leaf's mean :math:`v`.
    """

    warm: jax.Array
    codes: jax.Array
    scales: jax.Array
    floor: jax.Array


@dataclasses.dataclass(frozen=True)
class NuFormat:
    """8-bit codes of the frozen :math:`\\sqrt v` in blocks of ``block_size`` (one float32
    scale each): one rounding in the whole run, at the freeze (:class:`FrozenNu`)."""

    block_size: int = 256

    def blocks(self, size: int) -> int:
        return -(-size // self.block_size)

    def init(self, size: int, workers: int) -> FrozenNu:
        blocks = self.blocks(size)
        slices = warm_slices(size, workers, blocks * self.block_size)
        return FrozenNu(
            warm=jnp.zeros([1 if slices.nu_in_codes else slices.size], jnp.float32),
            codes=jnp.zeros([blocks, self.block_size], jnp.uint8),
            scales=jnp.zeros([blocks], jnp.float32),
            floor=jnp.zeros([], jnp.float32),
        )

    def freeze(self, v: jax.Array, nu_floor: float, warm: jax.Array) -> FrozenNu:
        """The codes of the whole float32 ``v`` (``warm``: the slice kept as it is)."""
        v = v.astype(jnp.float32)
        floor = nu_floor * jnp.mean(v)
        root = jnp.sqrt(jnp.maximum(v, floor)).reshape(-1)
        blocks = self.blocks(root.size)
        b = jnp.pad(root, (0, blocks * self.block_size - root.size)).reshape(blocks, -1)
        scales = jnp.max(b, axis=1)
        safe = jnp.where(scales > 0, scales, 1.0)
        codes = jnp.clip(jnp.round(b / safe[:, None] * 255), 1, 255).astype(jnp.uint8)
        return FrozenNu(warm, codes, scales, floor)

    def root(self, nu: FrozenNu, shape: tuple[int, ...]) -> jax.Array:
        """:math:`\\sqrt{\\max(v, f)}` as decoded, float32, floored at :math:`\\sqrt f`."""
        s = nu.codes.astype(jnp.float32) * (nu.scales[:, None] / 255)
        s = s.reshape(-1)[: math.prod(shape)].reshape(shape)
        return jnp.maximum(s, jnp.sqrt(nu.floor))


class WarmSlices(NamedTuple):
    """Where a :class:`FrozenNu` leaf's warm-up slices live (:func:`warm_slices`)."""

    size: int  # elements of one worker's slice, ceil(n / N)
    mu_in_codes: bool  # m's slice in the codes' first 4 size bytes (where the form uses it)
    nu_in_codes: bool  # v's slice in the next 4 size bytes, else FrozenNu.warm


def warm_slices(size: int, workers: int, code_bytes: int) -> WarmSlices:
    """The float32 slices an ``size``-element leaf's ``code_bytes`` of codes hold during
    the warm-up, for ``workers`` workers: :math:`m`'s where they have room for one
    (``N >= 4`` workers), :math:`v`'s too where they have room for two (``N >= 8``)."""
    per = -(-size // workers)
    return WarmSlices(per, 4 * per <= code_bytes, 8 * per <= code_bytes)


def resize_frozen_nu(nu: FrozenNu, size: int, num_workers: int, *, frozen: bool) -> FrozenNu:
    """A leaf's :class:`FrozenNu` saved by ``W`` workers, as host arrays (``warm`` and
    ``codes`` with a leading worker axis, ``scales`` and ``floor`` replicated), for
    ``num_workers`` workers; ``size``: the leaf's number of elements.

    ``frozen`` (the compressed phase): every worker holds the same codes; they are kept,
    repeated for the new workers, with the scales and the floor, so :math:`v` is not
    rounded again. ``warm``, unused once frozen, becomes what the new worker count's
    :meth:`NuFormat.init` holds (zeros of a slice, or the one-element placeholder where
    the codes hold it).
    During the warm-up each worker holds its own ``1/W`` of :math:`v` (and, in the codes,
    of :math:`m`), which another worker count cannot take: ``ValueError``.
    """
    codes = np.asarray(nu.codes)
    if not frozen:
        raise ValueError(
            f"The second moment of a {size}-element leaf is kept as {codes.shape[0]} "
            "workers' slices during the compressed-momentum warm-up, which no other worker "
            "count can take: resume with the saved number of workers until the warm-up "
            "ends (v is then frozen and replicated), or use frozen_nu_format='float32'."
        )
    if not (codes == codes[:1]).all():
        raise ValueError(
            "A frozen second moment whose codes differ between the saved workers: the "
            "checkpoint's optimizer state is not one compressed_momentum_adam wrote."
        )
    slices = warm_slices(size, num_workers, codes[0].size)
    return FrozenNu(
        warm=np.zeros((num_workers, 1 if slices.nu_in_codes else slices.size), np.float32),
        codes=np.ascontiguousarray(np.broadcast_to(codes[0], (num_workers, *codes.shape[1:]))),
        scales=nu.scales,
        floor=nu.floor,
    )


def parse_nu_format(value: str) -> NuFormat | None:
    """``"float32"`` (``None``: v kept as it is), ``"int8"`` or ``"int8/<block size>"``."""
    parts = str(value).split("/")
    if value == "float32":
        return None
    if parts[0] == "int8" and len(parts) <= 2 and (len(parts) == 1 or parts[1].isdigit()):
        block = int(parts[1]) if len(parts) == 2 else 256
        if block >= 1:
            return NuFormat(block)
    raise ValueError(
        f"frozen_nu_format={value!r}: choose 'float32' or 'int8' (8-bit codes of sqrt(v), "
        "blocks of 256), 'int8/<block size>'."
    )


def _tree_bytes(tree: PyTree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def buffer_bytes(state: PyTree) -> dict[str, int] | None:
    """One worker's bytes of each buffer of the compressed-momentum states in ``state``
    (arrays or ``jax.ShapeDtypeStruct`` s of one worker's state): ``"m"`` (the replicated
    momentum of the leaves whose store does not carry it: all of them for two buffers),
    ``"v"`` (the second moment) and ``"residuals"`` (the exchange's stores: ``w_i = b1 m +
    e_i`` where carried, ``e_i`` elsewhere); ``None`` where ``state`` holds none."""
    found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, CompressedMomentumState))
    found = [x for x in found if isinstance(x, CompressedMomentumState)]
    if not found:
        return None
    return {
        "m": sum(_tree_bytes(x.mu) for x in found),
        "v": sum(_tree_bytes(x.nu) for x in found),
        "residuals": sum(_tree_bytes(x.exchange.residuals) for x in found),
    }


def _check_exchange(exchange: Any) -> None:
    if not isinstance(exchange, ExchangeTransformation) or not hasattr(
        exchange._core, "compressor"
    ):
        raise ValueError(
            "A compressed-momentum optimizer takes an exchange transform (error_feedback, "
            f"resireduce or compressed_mean), got {exchange!r}."
        )


def _check_one_buffer(one_buffer: bool | None) -> bool | None:
    if one_buffer not in (None, True, False):
        raise ValueError(f"one_buffer must be None, True or False, got {one_buffer!r}.")
    return one_buffer


def warmup_steps(exchange: ExchangeTransformation) -> int | None:
    """The steps of ``exchange``'s leading dense phase (``None``: dense throughout; ``0``:
    it starts compressed). Dense: :func:`~resireduce_jax.compressors.dense.is_dense`,
    float32 or a 16-bit cast that keeps no residual."""
    found = schedule.phases(exchange._core.compressor)
    if not is_dense(found[0].compressor):
        return 0
    return found[1].start if len(found) > 1 else None


def _select(
    warm: bool | jax.Array,
    in_warmup: Callable[[], jax.Array],
    compressed: Callable[[], jax.Array],
) -> jax.Array:
    """``jnp.where(warm, in_warmup(), compressed())``; a Python ``warm`` (a program of one
    phase) traces only the branch it takes."""
    if isinstance(warm, bool):
        return in_warmup() if warm else compressed()
    return jnp.where(warm, in_warmup(), compressed())


@dataclasses.dataclass(frozen=True)
class _CompressedMomentum:
    """One compressed-momentum step; ``adam``: divided by the frozen second moment (else
    SGD with heavy-ball momentum, ``m <- b1 m + g``)."""

    adam: bool
    learning_rate: ScalarOrSchedule
    exchange: ExchangeTransformation
    warmup: int | None  # None: never compressed; 0: compressed from the first step
    b1: float
    b2: float
    eps: float
    weight_decay: ScalarOrSchedule
    mask: MaskOrFn
    max_grad_norm: float | None
    nu_floor: float
    compressed: str = "momentum"  # or "update": the momentum divided by sqrt(v_hat) + eps
    one_buffer: bool | None = False  # None: wherever the stores carry (Carry)
    nu_format: NuFormat | None = None  # the frozen v's codes (None: float32 throughout)

    # The exchange's plan and byte count are this transform's (ExchangeTransformation).
    def plan(self, params: PyTree, *, local_size: int | None = None) -> ExchangePlan:
        return self.exchange.plan(params, local_size=local_size)

    def bytes_sent(self, params: PyTree, steps: int, *, local_size: int | None = None) -> int:
        return self.exchange.bytes_sent(params, steps, local_size=local_size)

    def carried(self, params: PyTree, *, local_size: int | None = None) -> frozenset[int]:
        """The leaves (``jax.tree.leaves`` order) whose momentum lives in their exchange
        store (the one-buffer form); empty for the two-buffer form."""
        if self.one_buffer is False or self.warmup is None:
            return frozenset()
        plan = self.plan(params, local_size=local_size)
        compressed = {plan.layout.units[i].leaf for p in plan.stores for i in p.group.members}
        carriable = plan.carriable_leaves
        if self.exchange._core.selection_scope != "leaf":
            carriable = frozenset()
        if self.one_buffer and (not compressed or compressed - carriable):
            paths = sorted(
                {p.group.paths[0] for p in plan.stores if not p.carries}
                | ({"selection_scope='global'"} if not carriable and compressed else set())
            )
            raise ValueError(
                "one_buffer=True keeps each worker's momentum in its leaf's own residual "
                "store (kind 'leaf': error_feedback, or resireduce without shared groups "
                "or intra-layer storage, selection_scope='leaf'); a shared or 2-D store "
                "cannot hold a member's momentum. Not carried: "
                f"{paths[:8] or ['no compressed leaf']}. Use one_buffer=None (one buffer "
                "where the store allows it) or one_buffer=False."
            )
        if self.one_buffer is None:  # by default only where it is the two buffers' arithmetic
            rounded = {
                plan.layout.units[i].leaf
                for p in plan.stores
                for i in p.group.members
                if p.quantized or jnp.dtype(p.dtype) != jnp.dtype(p.group.dtype)
            }
            carriable = carriable - rounded
        return carriable & compressed

    def quantized_nu(self, params: PyTree) -> frozenset[int]:
        """The leaves whose frozen v is kept in :attr:`nu_format` (:class:`FrozenNu`):
        the compressed ones (the others are small and keep float32)."""
        if self.nu_format is None or not self.adam or self.warmup is None:
            return frozenset()
        plan = self.plan(params)
        return frozenset(plan.layout.units[i].leaf for p in plan.stores for i in p.group.members)

    def init(self, params: PyTree) -> CompressedMomentumState:
        carried = self.carried(params)
        quantized = self.quantized_nu(params)
        leaves, treedef = jax.tree.flatten(params)
        mu = [
            optax.MaskedNode() if j in carried else jnp.zeros_like(x) for j, x in enumerate(leaves)
        ]
        workers = 1
        if quantized:
            try:
                workers = axis_size(self.exchange._core.worker_axes)
            except NameError:  # outside shard_map / pmap: one worker's slice is the leaf
                workers = 1
        nu = [
            self.nu_format.init(x.size, workers) if j in quantized else jnp.zeros_like(x)
            for j, x in enumerate(leaves)
        ]
        return CompressedMomentumState(
            count=jnp.zeros([], jnp.int32),
            mu=treedef.unflatten(mu),
            nu=treedef.unflatten(nu) if self.adam else (),
            exchange=self.exchange.init(params),
        )

    def _momentum(self, g: jax.Array, mu: jax.Array) -> jax.Array:
        """Adam's average ``(1 - b1) g + b1 m``, or SGD's trace ``g + b1 m``."""
        if self.adam:
            return (1 - self.b1) * g + self.b1 * mu.astype(g.dtype)
        return g + self.b1 * mu.astype(g.dtype)

    def update(
        self,
        updates: optax.Updates,
        state: CompressedMomentumState,
        params: optax.Params | None = None,
        *,
        skip: jax.Array | None = None,
        density_phase: int | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, CompressedMomentumState]:
        del extra_args
        require_params(
            params, "compressed-momentum optimizers need the parameters for weight decay"
        )
        b1, b2 = self.b1, self.b2
        count_inc = optax.safe_increment(state.count)
        # ``warm`` is a Python bool where the program is of one phase (only that phase's
        # arithmetic is traced), else a traced bool that switches on the count.
        warm: bool | jax.Array
        if self.warmup is None:
            warm = True
            frozen_at = count_inc
        else:
            if density_phase is None:  # the exchange switches phases on the count, as here
                warm = state.count < self.warmup
            else:  # one program per phase: the leading dense phase is phase 0
                warm = self.warmup > 0 and density_phase == 0
            frozen_at = jnp.minimum(count_inc, max(self.warmup, 1))
        lr = value_at(self.learning_rate, state.count)
        decay = value_at(self.weight_decay, state.count)
        flags = decay_flags(self.mask, params)
        if not self.adam:  # SGD: L2 weight decay in the gradient, as torch.optim.SGD
            updates = jax.tree.map(
                lambda g, p, d: g + decay * p if d else g, updates, params, flags
            )

        # What each worker sends: its gradient while warm (the exchange is dense), then its
        # local momentum from the replicated one (one-buffer: the new part of it alone, the
        # store holding b1 m + e_i).
        if self.max_grad_norm is not None and self.warmup is not None:
            workers = axis_size(self.exchange._core.worker_axes)  # all worker axes
            local = clip_factor(global_norm(updates), self.max_grad_norm * math.sqrt(workers))

        bias2 = 1 - b2**frozen_at
        scaled = self.adam and self.compressed == "update"

        def floored(nu):
            if not self.nu_floor:
                return nu
            return jnp.maximum(nu, self.nu_floor * jnp.mean(nu))

        def denominator(nu, like=None):
            """sqrt(v_hat) + eps; after the warm-up v is frozen, floored at ``nu_floor``
            of its leaf's mean (a :class:`FrozenNu`: decoded, compressed phase only)."""
            if isinstance(nu, FrozenNu):
                return frozen_denominator(nu, like)
            if self.nu_floor:
                nu = _select(warm, lambda: nu, lambda: floored(nu))
            return jnp.sqrt(nu / bias2.astype(nu.dtype)) + self.eps

        def frozen_denominator(nu, like):
            """The compressed phase's sqrt(v_hat) + eps, from v frozen and floored."""
            if isinstance(nu, FrozenNu):
                root = self.nu_format.root(nu, like.shape)
                return (root / jnp.sqrt(bias2).astype(root.dtype) + self.eps).astype(like.dtype)
            return jnp.sqrt(floored(nu) / bias2.astype(nu.dtype)) + self.eps

        carried = self.carried(updates)
        leaves, treedef = jax.tree.flatten(updates)
        mus = treedef.flatten_up_to(state.mu)
        nus = treedef.flatten_up_to(state.nu) if self.adam else [None] * len(leaves)

        def to_send(j, g, mu, nu):
            if self.warmup is None:
                return g

            def momentum():
                g_local = g if self.max_grad_norm is None else g * scalar_as(local, g)
                if j in carried:  # c_i = w_i + (1 - b1) g_i: the exchange adds w_i
                    m = (1 - self.b1) * g_local if self.adam else g_local
                else:
                    m = self._momentum(g_local, mu)
                return m / denominator(nu, g).astype(g.dtype) if scaled else m

            return _select(warm, lambda: g, momentum)

        sent = [to_send(j, *args) for j, args in enumerate(zip(leaves, mus, nus, strict=True))]
        extra = {"carry": Carry(b1, warm, carried)} if carried else {}
        means, exchange_state = self.exchange.update(
            treedef.unflatten(sent),
            state.exchange,
            params,
            skip=skip,
            density_phase=density_phase,
            **extra,
        )
        if self.max_grad_norm is not None:
            mean_factor = clip_factor(global_norm(means), self.max_grad_norm)
        plan = self.plan(updates) if carried and warm is not False else None
        residuals = exchange_state.residuals
        axes = self.exchange._core.worker_axes

        def leaf(j, mean, mu, nu, p, decayed):
            nonlocal residuals
            # Recompute the denominator from v after the exchange: without the barrier XLA
            # merges it with the one `to_send` computed, and every leaf's denominator stays
            # alive across the exchange (a parameter-sized temp). Not for a FrozenNu: its
            # slices vary over the workers, and the barrier's outputs would all vary.
            if scaled and not isinstance(nu, FrozenNu):
                mean, nu = jax.lax.optimization_barrier((mean, nu))
            g = mean
            if self.max_grad_norm is not None:
                g = mean * scalar_as(mean_factor, mean)
            # m's float32 warm-up slice in the unused codes of an int8 frozen v ("update":
            # the update is then mean / bias1, no varying divisor), else m held in the store.
            slices = self._warm_slices(nu, g) if isinstance(nu, FrozenNu) else None
            sliced = j in carried and slices is not None and scaled and slices.mu_in_codes
            if sliced:
                mu_new = mean  # warm: its slice in the codes; compressed: m' is the mean
            elif j in carried:  # warm: m is held in the store; compressed: m' is the mean

                def held_momentum():  # equal on every worker; replicated by its gather
                    m = self._momentum(g, carried_lib.read(plan, residuals, j, mean))
                    if isinstance(nu, FrozenNu):  # the update is gathered from slices
                        return m
                    return carried_lib.replicated(m, axes)

                mu_new = _select(warm, held_momentum, lambda: mean)
            else:

                def momentum():
                    m = mean * denominator(nu, mean).astype(mean.dtype) if scaled else mean
                    return m.astype(mu.dtype)

                mu_new = _select(warm, lambda: self._momentum(g, mu), momentum)
            if self.adam and isinstance(nu, FrozenNu):
                bias1 = (1 - b1**count_inc).astype(mu_new.dtype)

                def warm_step():  # on this worker's slice; the update gathered
                    nonlocal residuals
                    g_k = carried_lib.own_slice(g, axes)
                    v_held = _slice_in(nu.codes, 1, slices.size) if slices.nu_in_codes else nu.warm
                    v_k = (1 - b2) * (g_k * g_k) + b2 * v_held
                    if sliced:
                        m_k = self._momentum(g_k, _slice_in(nu.codes, 0, slices.size))
                    else:
                        m_k = carried_lib.own_slice(mu_new, axes)
                    u_k = (m_k / bias1) / (jnp.sqrt(v_k / bias2.astype(v_k.dtype)) + self.eps)
                    if decayed:
                        u_k = u_k + decay * carried_lib.own_slice(p, axes)
                    held = [m_k if sliced else None] + [v_k] * slices.nu_in_codes
                    kept = nu._replace(  # the placeholder per-worker, as where warm holds v
                        warm=_vary_like(nu.warm, v_k) if slices.nu_in_codes else v_k,
                        codes=_slices_out(nu.codes, *held)
                        if sliced or slices.nu_in_codes
                        else nu.codes,
                    )
                    last = count_inc >= self.warmup

                    def freeze():  # the last warm-up step: v's one rounding
                        frozen = self.nu_format.freeze(
                            carried_lib.gather_slices(v_k, axes, g.shape), self.nu_floor, kept.warm
                        )
                        if not sliced:
                            return _vary_like(frozen, kept), ()
                        m = carried_lib.gather_slices(m_k, axes, g.shape)
                        w = self.b1 * m / frozen_denominator(frozen, m)  # w = b1 m / d
                        return _vary_like(frozen, kept), _vary_like(w, m_k)

                    def warm_on():
                        zeros = () if not sliced else jnp.zeros(g.shape, m_k.dtype) * m_k[0]
                        return kept, zeros

                    frozen, w = jax.lax.cond(last, freeze, warm_on)
                    if sliced:  # the store holds zeros until then, and w = b1 m / d after
                        residuals = carried_lib.write(
                            plan, residuals, j, w, _and_not(jnp.logical_and(warm, last), skip)
                        )
                    return frozen, carried_lib.gather_slices(u_k, axes, g.shape)

                def compressed_step():
                    d = denominator(nu, mean)
                    u = mean / bias1 if scaled else (mu_new / bias1) / d
                    return nu, u + decay * p if decayed else u

                nu_new, u = _select_tree(warm, warm_step, compressed_step)
            elif self.adam:
                nu_new = _select(warm, lambda: (1 - b2) * (g * g) + b2 * nu, lambda: nu)
                bias1 = (1 - b1**count_inc).astype(mu_new.dtype)

                def adam_step():
                    return (mu_new / bias1) / denominator(nu_new)

                # Compressed, the mean is the direction m / d already.
                u = _select(warm, adam_step, lambda: mean / bias1) if scaled else adam_step()
                if decayed:
                    u = u + decay * p
            else:
                nu_new, u = None, mu_new
            u = descend(u, lr, scheduled=callable(self.learning_rate))
            if skip is not None:
                u = jnp.where(skip, jnp.zeros((), u.dtype), u)
                if j not in carried:
                    mu_new = jnp.where(skip, mu, mu_new)
                if self.adam:
                    nu_new = jax.tree.map(lambda a, b: jnp.where(skip, a, b), nu, nu_new)
            if j in carried:
                if warm is not False and not sliced:  # m held, b1 m (w's units) at last
                    d = frozen_denominator(nu_new, mu_new) if scaled else None
                    residuals = carried_lib.write(
                        plan, residuals, j, self._held(mu_new, d, count_inc), _and_not(warm, skip)
                    )
                mu_new = optax.MaskedNode()
            return u, mu_new, nu_new if self.adam else None

        out = [
            leaf(j, *args)
            for j, args in enumerate(
                zip(
                    treedef.flatten_up_to(means),
                    mus,
                    nus,
                    treedef.flatten_up_to(params),
                    treedef.flatten_up_to(flags),
                    strict=True,
                )
            )
        ]
        new_updates = treedef.unflatten([o[0] for o in out])
        mu = treedef.unflatten([o[1] for o in out])
        nu = treedef.unflatten([o[2] for o in out]) if self.adam else ()
        count = count_inc if skip is None else jnp.where(skip, state.count, count_inc)
        exchange_state = exchange_state._replace(residuals=residuals)
        return new_updates, CompressedMomentumState(count, mu, nu, exchange_state)

    def _warm_slices(self, nu: FrozenNu, like: jax.Array) -> WarmSlices:
        """Where ``nu``'s warm-up slices live for this program's worker count."""
        slices = warm_slices(like.size, axis_size(self.exchange._core.worker_axes), nu.codes.size)
        expected = 1 if slices.nu_in_codes else slices.size
        if nu.warm.size != expected:
            raise ValueError(
                f"A frozen-second-moment state of a {like.size}-element leaf holds a warm "
                f"slice of {nu.warm.size} elements, not this program's {expected}: "
                "initialise the optimizer state inside the same shard_map / pmap (worker "
                "count) that updates it."
            )
        return slices

    def _held(self, m: jax.Array, d: jax.Array | None, count_inc: jax.Array) -> jax.Array:
        """What a carried leaf's store holds after a warm-up step: ``m``, and at the last
        one ``w = b1 m`` in the units the exchange then sends (``m / d`` for ``"update"``,
        ``d`` the frozen, floored denominator), so the first compressed step compensates
        with ``b1 m + e`` (``e = 0``), as the two-buffer form."""
        w = self.b1 * m
        if d is not None:
            w = w / d.astype(w.dtype)
        return jnp.where(count_inc >= self.warmup, w, m)


def _vary_like(tree: Any, like: Any) -> Any:
    """``tree`` cast to vary over the mesh axes each leaf of ``like`` varies over."""

    def cast(x, y):
        have, want = (set(jax.typeof(v).manual_axis_type.varying) for v in (x, y))
        missing = tuple(sorted(want - have))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree, like)


def _slice_in(codes: jax.Array, index: int, size: int) -> jax.Array:
    """The float32 ``[size]`` slice ``index`` kept in ``codes`` (bytes ``4 size index`` on)."""
    start = 4 * size * index
    held = codes.reshape(-1)[start : start + 4 * size].reshape(size, 4)
    return jax.lax.bitcast_convert_type(held, jnp.float32)


def _slices_out(codes: jax.Array, *slices: jax.Array | None) -> jax.Array:
    """Float32 ``slices`` (each ``[size]``; ``None``: zeros) as the first bytes of a uint8
    buffer shaped like ``codes``, slice ``i`` at :func:`_slice_in`'s index ``i``."""
    size = next(x.size for x in slices if x is not None)
    parts = [
        jax.lax.bitcast_convert_type(
            (jnp.zeros([size], jnp.float32) if x is None else x.astype(jnp.float32)), jnp.uint8
        ).reshape(-1)
        for x in slices
    ]
    bits = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    return jnp.pad(bits, (0, codes.size - bits.size)).reshape(codes.shape)


def _select_tree(
    warm: bool | jax.Array, in_warmup: Callable[[], Any], compressed: Callable[[], Any]
) -> Any:
    """:func:`_select` for pytrees of arrays."""
    if isinstance(warm, bool):
        return in_warmup() if warm else compressed()
    return jax.tree.map(lambda a, b: jnp.where(warm, a, b), in_warmup(), compressed())


def _and_not(warm: bool | jax.Array, skip: jax.Array | None) -> bool | jax.Array:
    """``warm and not skip`` (``skip``: ``None`` for no skip flag)."""
    if skip is None:
        return warm
    return jnp.logical_and(warm, jnp.logical_not(skip))


def compressed_momentum_adam(
    learning_rate: ScalarOrSchedule,
    exchange: ExchangeTransformation,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: MaskOrFn = None,
    max_grad_norm: float | None = None,
    nu_floor: float = 0.01,
    compressed: str = "update",
    one_buffer: bool | None = None,
    frozen_nu_format: str = "float32",
) -> ExchangeTransformation:
    r"""Adam whose momentum is exchanged compressed with error feedback after a dense
    warm-up that fixes the second moment (1-bit Adam, Tang et al., ICML 2021, Alg. 1).

    Example (Top-k 1 % after 100 dense steps, ResiReduce-w+2d storing the momentum error)::

        exchange = rr.resireduce(
            compressors.topk(compressors.dense_warmup(100, 0.01)),
            grouping=grouping.auto(3), inter="weighted", intra="2d")
        tx = rr.compressed_momentum_adam(1e-3, exchange, b2=0.95, weight_decay=0.01)
        step = rr.parallel.data_parallel_step(loss_fn, rr.skip_nonfinite(tx), mesh)

    Args:
      learning_rate: η, a float or an optax schedule of the step count (0-based).
      exchange: an exchange transform (:func:`~resireduce_jax.error_feedback`,
        :func:`~resireduce_jax.resireduce`, :func:`~resireduce_jax.compressed_mean`)
        whose compressor starts with a dense phase: its length is the warm-up, after which
        :math:`v` is frozen. A compressor that is dense throughout gives AdamW on the
        dense mean.
      b1, b2: decays of the first and second moment, in [0, 1).
      eps: ε added to :math:`\sqrt{\hat v}`.
      weight_decay: λ, decoupled (AdamW), float or schedule.
      mask: which leaves are decayed (as ``optax.adamw``).
      max_grad_norm: clip by global L2 norm: the mean gradient during the warm-up to
        ``max_grad_norm``; afterwards each worker's local gradient (before it enters the
        momentum) to ``max_grad_norm`` :math:`\cdot\sqrt N` for :math:`N` workers: where
        the workers' gradients are independent noise about their mean, the mean of
        :math:`N` has :math:`1/\sqrt N` of a local gradient's norm, so the local threshold
        is the mean's (DGC §3.2 divides by :math:`\sqrt N` instead because it sums the
        workers' gradients; clipping each local gradient at the mean's threshold would
        shrink most steps).
      nu_floor: after the warm-up, each coordinate is divided by at least
        :math:`\sqrt{\texttt{nu\_floor}\,\bar v}`, :math:`\bar v` its leaf's mean frozen
        :math:`v` (the state keeps :math:`v` as it was). A coordinate that had (almost) no
        gradient during the warm-up (an input feature that was zero in every warm-up
        batch) would otherwise be divided by :math:`ε` once its gradient appears, and its
        step would be unbounded; with the floor it is at most
        :math:`1/\sqrt{\texttt{nu\_floor}}` times its leaf's typical step. ``0`` freezes
        :math:`v` as it is (Tang et al.). ``density_phase`` (an extra argument of
        ``update``, a Python int): compile one phase of the exchange's schedule; the
        warm-up is then phase 0.
      compressed: what each worker compresses after the warm-up: ``"update"`` (default,
        beyond the paper): its momentum divided by the frozen :math:`\sqrt{\hat v} + ε`,
        the update's direction, so that the compressor keeps the coordinates that move
        the weights most and error feedback conserves the update itself (the error is
        kept in those units); ``"momentum"``: its momentum, as Tang et al.
      one_buffer: keep each worker's momentum and its error as one buffer
        :math:`w_i = β_1 m + e_i` in the leaf's own residual store, in the store's
        residual format and the units sent (docs/design.md, "One-buffer compressed
        momentum"): in exact arithmetic the same steps as the two buffers, warm-up and
        freeze included. ``None`` (default): for every leaf whose store allows it (kind
        ``"leaf"``, ``selection_scope="leaf"``) and keeps the leaf's dtype (no residual
        format or narrower cast, which would round :math:`β_1 m` too), two buffers
        elsewhere; ``True``: every
        compressed leaf, else ``ValueError`` (shared and 2-D stores cannot hold a
        member's momentum); ``False``: two buffers. A leaf that travels dense keeps its
        replicated :math:`m` either way. During the warm-up the store holds :math:`m`
        (rounded by a quantized format each step).
      frozen_nu_format: how the frozen :math:`v` of the compressed leaves is kept:
        ``"float32"`` (default, as estimated); ``"int8"`` (``"int8/<block size>"``,
        blocks of 256 by default): 8-bit codes of :math:`\sqrt{\max(v, f)}` with a
        float32 scale per block and no zero code (Li et al., NeurIPS 2023; :math:`f` the
        ``nu_floor``), rounded once, at the freeze: 1 byte a parameter after it. During the
        warm-up :math:`v` stays float32, each worker keeping ``1/N`` of it and the update
        all-gathered from the workers' slices (:class:`FrozenNu`).

    Returns:
      An :class:`~resireduce_jax.exchange.ExchangeTransformation` (``tx.plan(params)``,
      ``tx.bytes_sent(params, steps)``) whose state is a :class:`CompressedMomentumState`.
      ``update`` takes an optional ``skip`` (:func:`~resireduce_jax.skip_nonfinite`):
      zero update, moments and count unchanged, the exchange's state as it documents.

    Raises:
      ValueError: for betas outside [0, 1), negative ``eps``, learning rate or weight
        decay, a non-positive ``max_grad_norm``, an exchange that starts compressed
        (the second moment needs dense steps to be estimated), or ``compressed="momentum"``
        with an int8 ``frozen_nu_format``.

    References:
      Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
      Convergence Speed", ICML 2021 (https://arxiv.org/abs/2102.02888).
    """
    check_hyperparameters(
        learning_rate, weight_decay, betas={"b1": b1, "b2": b2}, non_negative={"eps": eps}
    )
    check_non_negative("nu_floor", nu_floor)
    if compressed not in ("momentum", "update"):
        raise ValueError(f"compressed={compressed!r}: choose 'momentum' or 'update'.")
    nu_format = parse_nu_format(frozen_nu_format)
    if compressed == "momentum" and nu_format is not None:
        raise ValueError(
            f"compressed='momentum' with frozen_nu_format={frozen_nu_format!r}: the int8 "
            "frozen v's codes are a per-worker buffer (they hold the workers' warm-up "
            "slices), so dividing the averaged momentum by a sqrt(v) decoded from them would "
            "give each worker its own update. Choose compressed='update' (the divisor is "
            "applied before the exchange) or frozen_nu_format='float32'."
        )
    _check_exchange(exchange)
    warmup = warmup_steps(exchange)
    if warmup == 0:
        raise ValueError(
            "compressed_momentum_adam freezes Adam's second moment after a dense warm-up, "
            "but the exchange's compressor starts compressed. Give it a dense phase first, "
            "e.g. compressors.topk(compressors.dense_warmup(100, 0.01)) or "
            "compressors.schedule.with_dense_start(100, compressor)."
        )
    core = _CompressedMomentum(
        adam=True,
        learning_rate=learning_rate,
        exchange=exchange,
        warmup=warmup,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        mask=mask,
        max_grad_norm=check_max_grad_norm(max_grad_norm),
        nu_floor=float(nu_floor),
        compressed=compressed,
        one_buffer=_check_one_buffer(one_buffer),
        nu_format=nu_format,
    )
    return ExchangeTransformation(core.init, core.update)


def compressed_momentum_sgd(
    learning_rate: ScalarOrSchedule,
    exchange: ExchangeTransformation,
    *,
    momentum: float = 0.9,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: MaskOrFn = None,
    max_grad_norm: float | None = None,
    one_buffer: bool | None = None,
) -> ExchangeTransformation:
    r"""SGD with heavy-ball momentum whose momentum is exchanged compressed with error
    feedback: :func:`compressed_momentum_adam`'s scheme without a second moment.

    Per worker :math:`i`: :math:`m_i = β m + g_i` (:math:`g_i` with L2 weight decay, clipped
    by its own global norm), :math:`m = \frac1N\sum_i D(Q(m_i + e_i))`, :math:`e_i`
    keeps the rest, :math:`u = -η m`. The momentum is accumulated before compression, as
    DGC's momentum correction does (Lin et al. 2018, §3.2), but the error is an exchange
    store, so ResiReduce's stores hold it, and the momentum stays replicated. During a
    leading dense phase of the exchange's compressor (optional here) this is SGD with
    momentum on the exact mean gradient (clipped by its global norm), step for step
    ``optax.sgd(momentum=...)``.

    Args:
      learning_rate: η, a float or an optax schedule of the step count (0-based).
      exchange: an exchange transform (``error_feedback``, ``resireduce``, ...).
      momentum: β in [0, 1).
      weight_decay: L2 coefficient added to each gradient (``g + λ p``), float or schedule.
      mask: which leaves are decayed (as ``optax.add_decayed_weights``).
      max_grad_norm: clip by global L2 norm: the mean gradient in a dense phase to
        ``max_grad_norm``, each worker's local gradient otherwise to ``max_grad_norm``
        :math:`\cdot\sqrt N` (as :func:`compressed_momentum_adam`).
      one_buffer: :math:`w_i = β m + e_i` in the leaf's own store, :math:`c_i = w_i +
        g_i` (as :func:`compressed_momentum_adam`'s; ``None``: where the store allows it).

    Returns:
      An :class:`~resireduce_jax.exchange.ExchangeTransformation` whose state is a
      :class:`CompressedMomentumState` (``nu`` empty).

    References:
      Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
      Convergence Speed", ICML 2021 (https://arxiv.org/abs/2102.02888), whose error-
      compensated momentum exchange this is without Adam's second moment.
    """
    check_hyperparameters(learning_rate, weight_decay, betas={"momentum": momentum})
    _check_exchange(exchange)
    core = _CompressedMomentum(
        adam=False,
        learning_rate=learning_rate,
        exchange=exchange,
        warmup=warmup_steps(exchange),
        b1=momentum,
        b2=0.0,
        eps=0.0,
        weight_decay=weight_decay,
        mask=mask,
        max_grad_norm=check_max_grad_norm(max_grad_norm),
        nu_floor=0.0,
        one_buffer=_check_one_buffer(one_buffer),
    )
    return ExchangeTransformation(core.init, core.update)
