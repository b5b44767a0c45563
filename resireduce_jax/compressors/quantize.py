"""Unbiased stochastic quantizers: QSGD, TernGrad and natural compression.

Every method here rounds each entry stochastically to one of two neighbouring points of a
coarse grid, with the probabilities that make the rounding unbiased:
``E[D(Q(x))] = x`` (exactly, up to the 2^-24 resolution of ``jax.random.uniform``).
The random draws are independent per worker (``randomness = "per_worker"``).

Exchange (all methods): the narrow payload arrays are all-gathered in their own dtype, and
every worker decodes each worker's payload and averages them in worker order
(:func:`~resireduce_jax.compressors.base.gathered_mean`): bit-identical on all workers and
no dense all-reduce of the leaf. Payload bytes count exactly what the all-gathers carry.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from resireduce_jax.compressors.base import Compressor, DecodedMean, check_int

__all__ = [
    "QSGD",
    "NaturalCompression",
    "NaturalPayload",
    "QuantizedPayload",
    "TernGrad",
    "TernaryPayload",
    "pack_2bit",
    "unpack_2bit",
]


def _require_key(key: jax.Array | None, name: str) -> jax.Array:
    if key is None:
        raise ValueError(
            f"{name} rounds stochastically and needs a PRNG key (independent per worker)."
        )
    return key


def _round_up_probability(fraction: jax.Array, key: jax.Array) -> jax.Array:
    """Bernoulli(``fraction``) draws as booleans: ``u < fraction`` with ``u ~ U[0, 1)``."""
    return jax.random.uniform(key, fraction.shape, jnp.float32) < fraction


# ---------------------------------------------------------------------------------- QSGD


class QuantizedPayload(NamedTuple):
    """QSGD payload: signed integer levels and one float32 norm per bucket."""

    levels: jax.Array  # int8 [n]: sign(x) * level, |level| <= s
    norms: jax.Array  # float32 [ceil(n / bucket)]


@dataclasses.dataclass(frozen=True)
class QSGD(DecodedMean, Compressor):
    """QSGD stochastic quantization (Alistarh et al., "QSGD: Communication-Efficient SGD via
    Gradient Quantization and Encoding", NeurIPS 2017, §3.1 eq. (1) and the bucketing of
    §5 / Appendix).

    The flat leaf is split into buckets of ``bucket_size`` entries (the last one shorter;
    ``None``: one bucket). With ``s = levels`` and ``N = ||v||`` the bucket's L2 norm
    (``norm="l2"``, the paper's) or max-norm (``norm="inf"``, tighter grid), each entry
    becomes ``sign(v_i) * l_i`` with ``l_i = floor(s |v_i| / N) + Bernoulli(frac)``, so
    ``D(Q(v))_i = N * (l_i / s)`` is an unbiased estimate of ``v_i``. A zero bucket sends
    zeros. Unbiased; the variance grows as ``s`` shrinks (Lemma 3.1).

    Payload: ``levels`` int8 ``[n]`` (``levels <= 127``) + ``norms`` float32
    ``[ceil(n / bucket_size)]``: ``n + 4 ceil(n / bucket_size)`` bytes per worker (Elias
    coding of the levels, §3.2 of the paper, is not used: it has no fixed size).
    Exchange: all-gather both, decode each worker's payload, average in worker order.

    Attributes:
      levels: number of positive levels ``s``, in [1, 127].
      norm: ``"l2"`` or ``"inf"``.
      bucket_size: entries per bucket (>= 1), or ``None`` for one bucket per leaf.
    """

    levels: int = 127
    norm: str = "l2"
    bucket_size: int | None = 512
    name: ClassVar[str] = "qsgd"
    biased: ClassVar[bool] = False
    randomness: ClassVar[str] = "per_worker"

    def __post_init__(self):
        object.__setattr__(self, "levels", check_int(self.levels, "levels", 1, 127))
        if self.norm not in ("l2", "inf"):
            raise ValueError(f"norm must be 'l2' or 'inf', got {self.norm!r}.")
        if self.bucket_size is not None:
            object.__setattr__(self, "bucket_size", check_int(self.bucket_size, "bucket_size", 1))

    def _bucket(self, n: int) -> int:
        return n if self.bucket_size is None else min(self.bucket_size, n)

    def _buckets(self, flat: jax.Array) -> jax.Array:
        """``[num_buckets, bucket]`` view of ``flat`` padded with zeros."""
        n, b = flat.size, self._bucket(flat.size)
        nb = -(-n // b)
        return jnp.pad(flat, (0, nb * b - n)).reshape(nb, b)

    def compress(self, x, state, key):
        key = _require_key(key, "qsgd")
        flat = x.ravel().astype(jnp.float32)
        buckets = self._buckets(flat)
        magnitudes = jnp.abs(buckets)
        if self.norm == "l2":
            norms = jnp.sqrt(jnp.sum(buckets * buckets, axis=1))
        else:
            norms = jnp.max(magnitudes, axis=1)
        safe = jnp.where(norms > 0, norms, 1.0)[:, None]
        scaled = jnp.minimum(magnitudes / safe * self.levels, float(self.levels))
        lower = jnp.floor(scaled)
        level = lower + _round_up_probability(scaled - lower, key)
        signed = jnp.where(buckets < 0, -level, level).astype(jnp.int8)
        return QuantizedPayload(signed.ravel()[: flat.size], norms), state

    def decompress(self, payload: QuantizedPayload, like):
        n = math.prod(like.shape)
        b = self._bucket(n)
        nb = payload.norms.shape[0]
        levels = jnp.pad(payload.levels, (0, nb * b - n)).reshape(nb, b)
        values = payload.norms[:, None] * (levels.astype(jnp.float32) / self.levels)
        return values.ravel()[:n].reshape(like.shape).astype(like.dtype)

    def payload_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
        n = math.prod(shape)
        return n + 4 * -(-n // self._bucket(n))


# ------------------------------------------------------------------------------ TernGrad


def pack_2bit(codes: jax.Array) -> jax.Array:
    """Packs 2-bit codes (uint8 in [0, 3]) four per byte, first code in the low bits."""
    n = codes.size
    padded = jnp.pad(codes.astype(jnp.uint8), (0, -n % 4)).reshape(-1, 4)
    shifts = jnp.arange(0, 8, 2, dtype=jnp.uint8)
    return jnp.bitwise_or.reduce(padded << shifts, axis=1)


def unpack_2bit(packed: jax.Array, n: int) -> jax.Array:
    """Inverse of :func:`pack_2bit`: the first ``n`` codes as uint8."""
    shifts = jnp.arange(0, 8, 2, dtype=jnp.uint8)
    return ((packed[:, None] >> shifts) & 3).reshape(-1)[:n]


class TernaryPayload(NamedTuple):
    """TernGrad payload: 2-bit codes packed four per byte and the float32 scale."""

    packed: jax.Array  # uint8 [ceil(n / 4)]: code 0 -> 0, 1 -> +1, 2 -> -1
    scale: jax.Array  # float32 []: max |x|


@dataclasses.dataclass(frozen=True)
class TernGrad(DecodedMean, Compressor):
    """TernGrad (Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
    Distributed Deep Learning", NeurIPS 2017, §3 eq. (3)-(4)).

    With the per-leaf scale ``s = max_i |x_i|``, each entry becomes
    ``s * sign(x_i) * b_i`` with ``b_i ~ Bernoulli(|x_i| / s)``: an unbiased ternary
    estimate in ``{-s, 0, +s}``. (The paper's optional gradient clipping at 2.5 standard
    deviations, §4, trades bias for variance; it is not applied here.) Unbiased.

    Payload: 2-bit codes packed four per byte (``0 -> 0``, ``1 -> +1``, ``2 -> -1``; the
    first entry in the low bits) + the float32 scale: ``ceil(n / 4) + 4`` bytes per
    worker. Exchange: all-gather both, decode each worker's payload, average in worker
    order.
    """

    name: ClassVar[str] = "terngrad"
    biased: ClassVar[bool] = False
    randomness: ClassVar[str] = "per_worker"

    def compress(self, x, state, key):
        key = _require_key(key, "terngrad")
        flat = x.ravel().astype(jnp.float32)
        magnitudes = jnp.abs(flat)
        scale = jnp.max(magnitudes)
        probability = magnitudes / jnp.where(scale > 0, scale, 1.0)
        keep = _round_up_probability(probability, key)
        codes = jnp.where(keep, jnp.where(flat < 0, 2, 1), 0).astype(jnp.uint8)
        return TernaryPayload(pack_2bit(codes), scale), state

    def decompress(self, payload: TernaryPayload, like):
        codes = unpack_2bit(payload.packed, math.prod(like.shape))
        signs = jnp.where(codes == 1, 1.0, jnp.where(codes == 2, -1.0, 0.0))
        return (payload.scale * signs).reshape(like.shape).astype(like.dtype)

    def payload_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
        return -(-math.prod(shape) // 4) + 4


# ------------------------------------------------------------------- natural compression


class NaturalPayload(NamedTuple):
    """Natural-compression payload: one code byte per entry and the leaf's max exponent."""

    codes: jax.Array  # uint8 [n]: bit 7 = sign, bits 0-6 = exponent code (0: zero)
    max_exponent: jax.Array  # int32 []: E = floor(log2(max |x|))


@dataclasses.dataclass(frozen=True)
class NaturalCompression(DecodedMean, Compressor):
    """Natural compression (Horváth et al., "Natural Compression for Distributed Deep
    Learning", 2019, §3 eq. (5), C_nat).

    Each entry with ``2^e <= |x| < 2^(e+1)`` is rounded to ``sign(x) 2^e`` or
    ``sign(x) 2^(e+1)``, up with probability ``|x| / 2^e - 1``: unbiased, and the
    relative variance is at most 1/8 (Theorem 1).

    Payload: one byte per entry — bit 7 the sign, bits 0–6 a code ``c``: ``c = 0`` means
    zero, ``c in [1, 127]`` means ``|value| = 2^(E + 2 - c)`` — plus the leaf's maximum
    exponent ``E = floor(log2 max|x|)`` as int32: ``n + 4`` bytes per worker. Codes cover
    ``2^(E+1)`` (the largest entry rounded up) down to ``2^(E-125)``. Entries below
    ``2^(E-125)`` (126 binades under the largest, far below float32 resolution of any sum
    with it) are rounded stochastically between ``0`` and ``2^(E-125)``, which keeps the
    estimate unbiased. Limits of float32: subnormal inputs (``|x| < 2^-126``) and decoded
    values under ``2^-126`` flush to zero; a leaf whose largest entry is ``>= 2^127`` may
    round it up to ``inf``; inputs must be finite. Float16/bfloat16 leaves are quantized in
    float32 and cast back, which adds that dtype's rounding.

    Implementation: exponent, mantissa and sign are read from the float32 bit pattern;
    rounding up with probability ``mantissa / 2^23`` is an exact integer comparison with 23
    random bits. Exchange: all-gather both, decode each worker's payload, average in
    worker order.
    """

    name: ClassVar[str] = "natural"
    biased: ClassVar[bool] = False
    randomness: ClassVar[str] = "per_worker"

    def compress(self, x, state, key):
        key = _require_key(key, "natural")
        # Work on the float32 bit pattern: sign | 8-bit biased exponent | 23-bit mantissa.
        bits = lax.bitcast_convert_type(x.ravel().astype(jnp.float32), jnp.uint32)
        magnitude_bits = bits & 0x7FFFFFFF
        exponent = (magnitude_bits >> 23).astype(jnp.int32)  # biased; 0: zero/subnormal
        mantissa = (magnitude_bits & 0x7FFFFF).astype(jnp.int32)
        top = jnp.max(exponent)  # biased exponent of max |x|
        lowest = top - 125  # biased exponent of code 127
        random = (jax.random.bits(key, bits.shape, jnp.uint32) >> 9).astype(jnp.int32)
        # In range: |x| = 2^e (1 + mantissa / 2^23) rounds up to 2^(e+1) with probability
        # mantissa / 2^23, compared exactly on 23 random bits.
        in_range = exponent >= jnp.maximum(lowest, 1)
        up = random < mantissa
        code = jnp.where(in_range, top + 2 - (exponent + up.astype(jnp.int32)), 0)
        # Below the range (normal numbers only): 0 or 2^lowest with probability |x| / 2^lowest.
        below = (exponent >= 1) & ~in_range
        inverse_low = lax.bitcast_convert_type(
            (jnp.clip(254 - lowest, 1, 254).astype(jnp.uint32) << 23), jnp.float32
        )  # 2^-(lowest - 127), a normal float whenever `below` can hold
        fraction = lax.bitcast_convert_type(magnitude_bits, jnp.float32) * inverse_low
        up_below = random.astype(jnp.float32) * (2.0**-23) < fraction
        code = jnp.where(below & up_below, 127, code)
        codes = (bits >> 24).astype(jnp.uint8) & 128 | code.astype(jnp.uint8)
        return NaturalPayload(codes, (top - 127).astype(jnp.int32)), state

    def decompress(self, payload: NaturalPayload, like):
        codes = payload.codes.astype(jnp.uint32)
        code = (codes & 127).astype(jnp.int32)
        exponent = payload.max_exponent + 127 + 2 - code  # biased exponent of the value
        valid = (code > 0) & (exponent >= 1)  # underflow below 2^-126 decodes to 0
        value_bits = ((codes >> 7) << 31) | (jnp.clip(exponent, 0, 255).astype(jnp.uint32) << 23)
        values = lax.bitcast_convert_type(jnp.where(valid, value_bits, 0), jnp.float32)
        return values.reshape(like.shape).astype(like.dtype)

    def payload_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
        return math.prod(shape) + 4
