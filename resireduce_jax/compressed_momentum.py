"""Compressed-momentum Adam: dense Adam, then the momentum sent compressed, error-fed.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed", ICML 2021 (https://arxiv.org/abs/2102.02888), §3 and Algorithm 1.
Adam and error feedback do not commute, so Adam runs densely for a warm-up first.
Then the second moment is frozen and each worker's momentum is sent compressed.
The momentum error lives in the exchange's stores, so ResiReduce's stores apply to it.
The transform replaces both the exchange and the optimizer of a chain.
The algorithm step by step and its warm-up: docs/design.md, "Compressed-momentum Adam
(compressed_momentum.py)".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

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

PyTree = Any

__all__ = [
    "CompressedMomentumState",
    "compressed_momentum_adam",
    "compressed_momentum_sgd",
    "warmup_steps",
]


@nonfinite.register_skip_aware
class CompressedMomentumState(NamedTuple):
    """State of :func:`compressed_momentum_adam`.

    Attributes:
      count: steps taken (int32): bias correction, schedules and the warm-up's end. Not
        advanced by a skipped step.
      mu: the first moment :math:`m`, like ``params``; replicated.
      nu: the second moment :math:`v`, like ``params``; replicated, frozen after the
        warm-up.
      exchange: the exchange's state; its residuals hold each worker's momentum error.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    exchange: ExchangeState


def _check_exchange(exchange: Any) -> None:
    if not isinstance(exchange, ExchangeTransformation) or not hasattr(
        exchange._core, "compressor"
    ):
        raise ValueError(
            "A compressed-momentum optimizer takes an exchange transform (error_feedback, "
            f"resireduce or compressed_mean), got {exchange!r}."
        )


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

    # The exchange's plan and byte count are this transform's (ExchangeTransformation).
    def plan(self, params: PyTree, *, local_size: int | None = None) -> ExchangePlan:
        return self.exchange.plan(params, local_size=local_size)

    def bytes_sent(self, params: PyTree, steps: int, *, local_size: int | None = None) -> int:
        return self.exchange.bytes_sent(params, steps, local_size=local_size)

    def init(self, params: PyTree) -> CompressedMomentumState:
        return CompressedMomentumState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params),
            nu=optax.tree.zeros_like(params) if self.adam else (),
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
        # local momentum from the replicated one.
        if self.max_grad_norm is not None and self.warmup is not None:
            workers = axis_size(self.exchange._core.worker_axes)  # all worker axes
            local = clip_factor(global_norm(updates), self.max_grad_norm * math.sqrt(workers))

        bias2 = 1 - b2**frozen_at
        scaled = self.adam and self.compressed == "update"

        def denominator(nu):
            """sqrt(v_hat) + eps; after the warm-up v is frozen, floored at ``nu_floor``
            of its leaf's mean."""
            if self.nu_floor:
                nu = _select(
                    warm, lambda: nu, lambda: jnp.maximum(nu, self.nu_floor * jnp.mean(nu))
                )
            return jnp.sqrt(nu / bias2.astype(nu.dtype)) + self.eps

        def to_send(g, mu, nu):
            if self.warmup is None:
                return g

            def momentum():
                g_local = g if self.max_grad_norm is None else g * scalar_as(local, g)
                m = self._momentum(g_local, mu)
                return m / denominator(nu).astype(g.dtype) if scaled else m

            return _select(warm, lambda: g, momentum)

        nus = state.nu if self.adam else jax.tree.map(lambda _: None, state.mu)
        sent = jax.tree.map(to_send, updates, state.mu, nus)
        means, exchange_state = self.exchange.update(
            sent, state.exchange, params, skip=skip, density_phase=density_phase
        )
        if self.max_grad_norm is not None:
            mean_factor = clip_factor(global_norm(means), self.max_grad_norm)

        def leaf(mean, mu, nu, p, decayed):
            if scaled:
                # Recompute the denominator from v after the exchange: without the barrier
                # XLA merges it with the one `to_send` computed, and every leaf's
                # denominator stays alive across the exchange (a parameter-sized temp).
                mean, nu = jax.lax.optimization_barrier((mean, nu))
            g = mean
            if self.max_grad_norm is not None:
                g = mean * scalar_as(mean_factor, mean)

            def momentum():
                m = mean * denominator(nu).astype(mean.dtype) if scaled else mean
                return m.astype(mu.dtype)

            mu_new = _select(warm, lambda: self._momentum(g, mu), momentum)
            if self.adam:
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
                mu_new = jnp.where(skip, mu, mu_new)
                if self.adam:
                    nu_new = jnp.where(skip, nu, nu_new)
            return u, mu_new, nu_new if self.adam else ()

        out = jax.tree.map(leaf, means, state.mu, nus, params, flags)
        treedef = jax.tree.structure(updates)
        inner = jax.tree.structure((0, 0, 0 if self.adam else ()))
        new_updates, mu, nu = jax.tree.transpose(treedef, inner, out)
        count = count_inc if skip is None else jnp.where(skip, state.count, count_inc)
        nu = nu if self.adam else ()
        return new_updates, CompressedMomentumState(count, mu, nu, exchange_state)


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

    Returns:
      An :class:`~resireduce_jax.exchange.ExchangeTransformation` (``tx.plan(params)``,
      ``tx.bytes_sent(params, steps)``) whose state is a :class:`CompressedMomentumState`.
      ``update`` takes an optional ``skip`` (:func:`~resireduce_jax.skip_nonfinite`):
      zero update, moments and count unchanged, the exchange's state as it documents.

    Raises:
      ValueError: for betas outside [0, 1), negative ``eps``, learning rate or weight
        decay, a non-positive ``max_grad_norm``, or an exchange that starts compressed
        (the second moment needs dense steps to be estimated).

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
    )
    return ExchangeTransformation(core.init, core.update)
