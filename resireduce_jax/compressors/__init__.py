"""Gradient compressors (GRACE-style): one factory per method.

Each factory returns a :class:`~resireduce_jax.compressors.base.Compressor`; pass it to
:func:`resireduce_jax.compressed_mean`, :func:`resireduce_jax.error_feedback` or
:func:`resireduce_jax.resireduce`. :func:`get` builds one from a name and keyword
arguments (what configs use).

Sparsifiers (``topk``, ``fast_topk``, ``randomk``, ``threshold``, ``dgc``) take a float
density or a :class:`~resireduce_jax.compressors.schedule.DensitySchedule`
(``dense_warmup(100, 0.01)``, ``dgc_warmup(0.01, 200)``, ``piecewise({0: 0.1, 500:
0.01})``): see :mod:`resireduce_jax.compressors.schedule`.
"""

from __future__ import annotations

from typing import Any

from resireduce_jax.compressors import schedule
from resireduce_jax.compressors.base import Compressor, Reduced
from resireduce_jax.compressors.dense import Cast, NoCompression, is_dense
from resireduce_jax.compressors.lowrank import LowRankPayload, PowerSGD
from resireduce_jax.compressors.quantize import (
    QSGD,
    NaturalCompression,
    NaturalPayload,
    QuantizedPayload,
    TernaryPayload,
    TernGrad,
)
from resireduce_jax.compressors.schedule import (
    DensitySchedule,
    dense_warmup,
    dgc_warmup,
    piecewise,
)
from resireduce_jax.compressors.sign import (
    EFSignSGD,
    OneBit,
    OneBitPayload,
    ScaledSignPayload,
    SignSGD,
    Signum,
)
from resireduce_jax.compressors.sparse import (
    DGC,
    FastTopK,
    RandomK,
    SparsePayload,
    Threshold,
    TopK,
)


def none() -> NoCompression:
    """No compression: a dense all-reduce (the uncompressed baseline)."""
    return NoCompression()


def fp16() -> Cast:
    """Cast to float16 before a float16 all-reduce (overflows past ±65504).

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return Cast("float16")


def bf16() -> Cast:
    """Cast to bfloat16 before a bfloat16 all-reduce.

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return Cast("bfloat16")


Density = float | DensitySchedule


def topk(density: Density = 0.01) -> TopK:
    """Exact Top-k on |x| with ``k = max(1, floor(density * n))``. Biased: use EF.

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return TopK(density)


def randomk(density: Density = 0.01, scaled: bool = False) -> RandomK:
    """Random-k with indices shared by all workers; unbiased iff ``scaled``.

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return RandomK(density, scaled)


def fast_topk(
    density: Density = 0.01,
    sample_ratio: float = 0.01,
    margin: float = 4.0,
    exact_below: int = 1 << 18,
    seed: int = 0,
) -> FastTopK:
    """Fast Top-k for large leaves (sampled threshold + two-level compaction + exact top-k
    of the candidates); exact Top-k whenever the candidate count lands in range. Biased.

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return FastTopK(density, sample_ratio, margin, exact_below, seed)


def threshold(tau: float, max_density: Density = 0.01) -> Threshold:
    """Sends entries with ``|x| >= tau``, at most ``max_density * n`` of them. Biased.

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return Threshold(tau, max_density)


def dgc(
    density: Density = 0.01, sample_ratio: float = 0.01, rounds: int = 4, tolerance: float = 0.25
) -> DGC:
    """Deep Gradient Compression's sampled-threshold selection of ``density * n`` entries.

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
      Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
      Distributed Training", ICLR 2018 (https://arxiv.org/abs/1712.01887).
    """
    return DGC(density, sample_ratio, rounds, tolerance)


def qsgd(levels: int = 127, norm: str = "l2", bucket_size: int | None = 512) -> QSGD:
    """QSGD stochastic quantization to ``levels`` int8 levels per bucket norm. Unbiased.

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return QSGD(levels, norm, bucket_size)


def terngrad() -> TernGrad:
    """TernGrad: stochastic ternary {-1, 0, 1} * max|x|, 2 bits per entry. Unbiased.

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return TernGrad()


def natural() -> NaturalCompression:
    """Natural compression: stochastic rounding to powers of two, 1 byte per entry. Unbiased.

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return NaturalCompression()


def signsgd() -> SignSGD:
    """signSGD with majority vote: 1 bit per entry, the update is the vote. Biased.

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return SignSGD()


def efsignsgd() -> EFSignSGD:
    """Scaled sign ``||x||_1 / n * sign(x)`` (EF-signSGD), for error feedback. Biased.

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return EFSignSGD()


def signum(beta: float = 0.9) -> Signum:
    """Signum: per-worker momentum, sign of momentum, majority vote. Biased.

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return Signum(beta)


def onebit() -> OneBit:
    """1-bit SGD: sign bits + means of the non-negative / negative entries. Biased.

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return OneBit()


def powersgd(rank: int = 4, seed: int = 0) -> PowerSGD:
    """PowerSGD rank-``rank`` approximation with warm start (two small all-reduces).

    References:
      Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
      Learning", ICDCS 2021 (https://github.com/sands-lab/grace).
    """
    return PowerSGD(rank, seed)


REGISTRY: dict[str, Any] = {
    "none": none,
    "fp16": fp16,
    "bf16": bf16,
    "topk": topk,
    "randomk": randomk,
    "fast_topk": fast_topk,
    "threshold": threshold,
    "dgc": dgc,
    "qsgd": qsgd,
    "terngrad": terngrad,
    "natural": natural,
    "signsgd": signsgd,
    "efsignsgd": efsignsgd,
    "signum": signum,
    "onebit": onebit,
    "powersgd": powersgd,
}


def get(name: str, **kwargs: Any) -> Compressor:
    """Builds a compressor by registry name, e.g. ``get("topk", density=0.01)``."""
    if name not in REGISTRY:
        raise ValueError(f"Unknown compressor {name!r}; choose one of {sorted(REGISTRY)}.")
    try:
        return REGISTRY[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"Bad arguments for compressor {name!r}: {e}") from None


__all__ = [
    "DGC",
    "QSGD",
    "REGISTRY",
    "Cast",
    "Compressor",
    "DensitySchedule",
    "EFSignSGD",
    "FastTopK",
    "LowRankPayload",
    "NaturalCompression",
    "NaturalPayload",
    "NoCompression",
    "OneBit",
    "OneBitPayload",
    "PowerSGD",
    "QuantizedPayload",
    "RandomK",
    "Reduced",
    "ScaledSignPayload",
    "SignSGD",
    "Signum",
    "SparsePayload",
    "TernGrad",
    "TernaryPayload",
    "Threshold",
    "TopK",
    "bf16",
    "dense_warmup",
    "dgc",
    "dgc_warmup",
    "efsignsgd",
    "fast_topk",
    "fp16",
    "get",
    "is_dense",
    "natural",
    "none",
    "onebit",
    "piecewise",
    "powersgd",
    "qsgd",
    "randomk",
    "schedule",
    "signsgd",
    "signum",
    "terngrad",
    "threshold",
    "topk",
]
