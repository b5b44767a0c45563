"""Compressors against numpy references: selections, unbiasedness, conservation, compiled
collective bytes, worker-mean exchanges (bit-identical on all workers) and bad input."""

from __future__ import annotations

import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from resireduce_jax import compressors as C
from resireduce_jax.hlo import collectives
from tests import transform_harness as th

W = 8
AXIS = "data"
SHAPE = (97, 129)  # 12513 entries: not a multiple of 8 (bits), 4 (2-bit codes) or buckets
N = math.prod(SHAPE)
SEED = 3

# One configuration per method; small densities/levels so that compression is visible.
CASES = {
    "none": C.none(),
    "fp16": C.fp16(),
    "bf16": C.bf16(),
    "topk": C.topk(0.05),
    "randomk": C.randomk(0.05),
    "randomk_scaled": C.randomk(0.05, scaled=True),
    "fast_topk": C.fast_topk(0.05, exact_below=0),
    "threshold": C.threshold(1.5, max_density=0.1),  # ~23 % pass: capacity overflows
    "dgc": C.dgc(0.05, sample_ratio=0.2),
    "qsgd": C.qsgd(levels=4, bucket_size=100),
    "qsgd_inf": C.qsgd(levels=127, norm="inf", bucket_size=None),
    "terngrad": C.terngrad(),
    "natural": C.natural(),
    "signsgd": C.signsgd(),
    "efsignsgd": C.efsignsgd(),
    "signum": C.signum(0.5),
    "onebit": C.onebit(),
    "powersgd": C.powersgd(3),
}
DENSE = {"none", "fp16", "bf16"}
SPARSE = {"topk", "randomk", "randomk_scaled", "fast_topk", "threshold", "dgc"}
VOTE = {"signsgd", "signum"}


def mesh():
    return jax.make_mesh((W,), (AXIS,))


def worker_key(comp: C.Compressor, w) -> jax.Array | None:
    """The key worker ``w`` uses (the convention of resireduce_jax.exchange.leaf_key)."""
    if comp.randomness == "none":
        return None
    key = jax.random.PRNGKey(SEED)
    return jax.random.fold_in(key, w) if comp.randomness == "per_worker" else key


def heavy_tailed(seed: int, shape=(W, *SHAPE), dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_t(3, size=shape).astype(dtype)


# --------------------------------------------------------------- running one exchange


@functools.cache
def exchange_fn(name: str, dtype: str = "float32"):
    """Jitted shard_map: per worker ``(payload, mean, residual, state)`` after one reduce.

    Returns ``(fn, compiled)``; ``fn(xs, states)`` takes per-worker leaves and states.
    """
    comp = CASES[name]
    like = jax.ShapeDtypeStruct(SHAPE, dtype)

    def body(x, state):
        x, state = x[0], jax.tree.map(lambda s: s[0], state)
        key = worker_key(comp, lax.axis_index(AXIS))
        payload = () if name == "powersgd" else comp.compress(x, state, key)[0]
        red = comp.reduce(x, state, key, AXIS)
        return jax.tree.map(lambda a: a[None], (payload, red.mean, red.residual, red.state))

    m = mesh()
    fn = jax.jit(jax.shard_map(body, mesh=m, in_specs=P(AXIS), out_specs=P(AXIS)))
    xs = jax.ShapeDtypeStruct((W, *SHAPE), dtype, sharding=NamedSharding(m, P(AXIS)))
    state = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((W, *s.shape), s.dtype, sharding=NamedSharding(m, P(AXIS))),
        jax.eval_shape(comp.init, like),
    )
    return fn, fn.lower(xs, state).compile()


def init_states(comp: C.Compressor, dtype="float32"):
    state = comp.init(jax.ShapeDtypeStruct(SHAPE, dtype))
    return jax.tree.map(lambda s: np.broadcast_to(np.asarray(s), (W, *s.shape)), state)


def run_exchange(name: str, xs: np.ndarray, states=None):
    fn, _ = exchange_fn(name, str(xs.dtype))
    if states is None:
        states = init_states(CASES[name], str(xs.dtype))
    sharding = NamedSharding(mesh(), P(AXIS))
    out = fn(jax.device_put(xs, sharding), jax.device_put(states, sharding))
    return jax.device_get(out)


# ------------------------------------------------------------------ numpy decoders


def np_decode(name: str, payload, n: int = N) -> np.ndarray:
    """Independent numpy decoder of one worker's payload, flat float32 of ``n`` entries."""
    comp = CASES[name]
    if name in SPARSE:
        out = np.zeros(n, np.float32)
        idx = np.asarray(payload.indices)
        keep = idx < n
        assert len(set(idx[keep].tolist())) == keep.sum()  # unique within a worker
        out[idx[keep]] = np.asarray(payload.values)[keep]
        return out
    if name.startswith("qsgd"):
        b = n if comp.bucket_size is None else min(comp.bucket_size, n)
        norms = np.asarray(payload.norms, np.float32)
        levels = np.zeros(len(norms) * b, np.float32)
        levels[:n] = np.asarray(payload.levels)
        scaled = levels.reshape(len(norms), b) / np.float32(comp.levels)
        return (norms[:, None] * scaled).ravel()[:n]
    if name == "terngrad":
        packed = np.asarray(payload.packed)
        codes = ((packed[:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).ravel()[:n]
        assert set(np.unique(codes)) <= {0, 1, 2}
        signs = np.select([codes == 1, codes == 2], [1.0, -1.0], 0.0).astype(np.float32)
        return np.float32(payload.scale) * signs
    if name == "natural":
        codes = np.asarray(payload.codes).astype(np.int64)
        code = codes & 127
        mag = np.ldexp(np.float32(1), int(payload.max_exponent) + 2 - code).astype(np.float32)
        mag[code == 0] = 0
        return np.where(codes >= 128, -mag, mag).astype(np.float32)
    bits = np.unpackbits(np.asarray(payload if name in VOTE else payload.packed))[:n]
    if name in VOTE:
        return np.where(bits == 1, 1.0, -1.0).astype(np.float32)
    if name == "efsignsgd":
        return np.float32(payload.scale) * np.where(bits == 1, 1.0, -1.0).astype(np.float32)
    if name == "onebit":
        c = np.asarray(payload.centers, np.float32)
        return np.where(bits == 1, c[0], c[1]).astype(np.float32)
    raise AssertionError(name)


def np_worker_mean(decoded: list[np.ndarray]) -> np.ndarray:
    """Sum in worker order in float32, then divide: the exchange's summation order."""
    acc = np.zeros_like(decoded[0])
    for d in decoded:
        acc = acc + d
    return acc / np.float32(len(decoded))


# ---------------------------------------------------------------- selection references


def np_topk_set(x: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-np.abs(x.ravel()), kind="stable")[:k].tolist())


@functools.cache
def jitted_compress(comp: C.Compressor):
    return jax.jit(comp.compress)


def single(comp: C.Compressor, x: np.ndarray, key=None):
    """One worker's payload, outside any mapped axis."""
    state = comp.init(jax.ShapeDtypeStruct(x.shape, x.dtype))
    return jax.device_get(jitted_compress(comp)(x, state, key)[0])


def assert_sparse_payload_is(payload, x: np.ndarray, expected: set[int], size: int):
    idx, vals = np.asarray(payload.indices), np.asarray(payload.values)
    assert idx.shape == (size,) and vals.shape == (size,)
    sent = idx < x.size
    assert set(idx[sent].tolist()) == expected
    np.testing.assert_array_equal(vals[sent], x.ravel()[idx[sent]])  # values exact
    np.testing.assert_array_equal(vals[~sent], 0)  # padding carries nothing


def test_topk_selects_largest_magnitudes():
    x = heavy_tailed(0, SHAPE)
    k = math.floor(0.05 * N)
    assert_sparse_payload_is(single(C.topk(0.05), x), x, np_topk_set(x, k), k)


@pytest.mark.parametrize("layout", ["iid", "clustered_rows", "sparse_tail"])
def test_fast_topk_sampled_path_equals_exact_topk(layout):
    rng = np.random.default_rng(1)
    shape = (512, 1024)
    x = rng.standard_t(3, size=shape).astype(np.float32)
    if layout == "clustered_rows":  # large entries packed in a few rows
        x *= np.where(np.arange(512) % 97 == 0, 100.0, 1.0).astype(np.float32)[:, None]
    if layout == "sparse_tail":  # fewer non-zeros than k, all at the end
        x[:] = 0
        x[-1, -300:] = rng.standard_normal(300)
    comp = C.fast_topk(0.01)
    k = comp.k(x.size)
    plan = comp.plan(x.size)
    assert plan is not None and plan.sample_size < x.size  # the sampled, two-level path
    expected = np_topk_set(x, k) if layout != "sparse_tail" else set(np.flatnonzero(x).tolist())
    assert_sparse_payload_is(single(comp, x), x, expected, k)


def test_fast_topk_uses_exact_topk_on_small_leaves():
    comp = C.fast_topk(0.05)
    assert comp.plan(N) is None  # below exact_below
    x = heavy_tailed(2, SHAPE)
    k = comp.k(N)
    assert_sparse_payload_is(single(comp, x), x, np_topk_set(x, k), k)


def test_threshold_sends_first_entries_above_tau_up_to_capacity():
    x = heavy_tailed(3, SHAPE)
    above = np.flatnonzero(np.abs(x.ravel()) >= 2.5)
    roomy = C.threshold(2.5, max_density=0.2)
    cap = math.floor(0.2 * N)
    assert len(above) < cap
    assert_sparse_payload_is(single(roomy, x), x, set(above.tolist()), cap)
    tight = C.threshold(2.5, max_density=0.02)  # overflow: index order decides
    cap = math.floor(0.02 * N)
    assert len(above) > cap
    payload = single(tight, x)
    assert_sparse_payload_is(payload, x, set(above[:cap].tolist()), cap)
    unsent = above[cap:]  # entries beyond capacity stay in the residual for EF
    r = np.asarray(tight.residual(jnp.asarray(x), payload)).ravel()
    np.testing.assert_array_equal(r[unsent], x.ravel()[unsent])


def test_dgc_selection_equals_topk_when_count_lands_in_range():
    x = heavy_tailed(4, (256, 512))
    comp = C.dgc(0.01, sample_ratio=0.01, rounds=3)
    k = comp.k(x.size)
    for seed in range(3):
        payload = single(comp, x, jax.random.PRNGKey(seed))
        assert_sparse_payload_is(payload, x, np_topk_set(x, k), k)


def test_dgc_adjustment_rounds_fix_a_poor_sample():
    # A sample this small misplaces the threshold; without rounds DGC sends a different set.
    x = heavy_tailed(5, (256, 512))
    k = C.dgc(0.01).k(x.size)
    exact = np_topk_set(x, k)
    recalls = {}
    for rounds in (0, 8):
        comp = C.dgc(0.01, sample_ratio=0.0005, rounds=rounds)
        hits = []
        for seed in range(6):
            idx = np.asarray(single(comp, x, jax.random.PRNGKey(seed)).indices)
            hits.append(len(exact & set(idx[idx < x.size].tolist())) / k)
        recalls[rounds] = np.mean(hits)
    assert recalls[0] < 0.9 and recalls[8] > 0.99, recalls


def test_quantizer_levels_are_neighbouring_grid_points():
    x = heavy_tailed(6, SHAPE)
    flat = x.ravel()
    key = jax.random.PRNGKey(0)
    # QSGD: |level| in {floor(s|v|/N), floor + 1}, signs kept, bucket norms as numpy.
    comp = CASES["qsgd"]
    p = single(comp, x, key)
    buckets = np.pad(flat, (0, -N % 100)).reshape(-1, 100)
    np.testing.assert_allclose(p.norms, np.linalg.norm(buckets, axis=1), rtol=1e-6)
    scaled = (np.abs(buckets) / p.norms[:, None] * 4).ravel()[:N]
    level = np.abs(np.asarray(p.levels, np.int64))
    assert np.all((level == np.floor(scaled)) | (level == np.floor(scaled) + 1))
    assert np.all(level <= 4) and np.all(np.sign(p.levels) * np.sign(flat) >= 0)
    # TernGrad: scale = max|x|, every entry 0 or sign(x) * scale.
    p = single(C.terngrad(), x, key)
    assert p.scale == np.abs(x).max() and p.packed.shape == (math.ceil(N / 4),)
    d = np_decode("terngrad", p)
    assert np.all((d == 0) | (d == np.sign(flat) * p.scale))
    # Natural: 2^floor(log2|x|) or twice that, sign kept.
    p = single(C.natural(), x, key)
    assert p.max_exponent == np.floor(np.log2(np.abs(x).max()))
    d = np_decode("natural", p)
    low = np.exp2(np.floor(np.log2(np.abs(flat)))).astype(np.float32)
    assert np.all((np.abs(d) == low) | (np.abs(d) == 2 * low))
    assert np.all(np.sign(d) == np.sign(flat))


def test_sign_payloads_match_numpy():
    x = heavy_tailed(7, SHAPE)
    x.ravel()[:5] = 0.0  # zero counts as positive
    bits = np.packbits(x.ravel() >= 0)
    np.testing.assert_array_equal(single(C.signsgd(), x), bits)
    p = single(C.efsignsgd(), x)
    np.testing.assert_array_equal(p.packed, bits)
    np.testing.assert_allclose(p.scale, np.abs(x).mean(), rtol=1e-6)
    p = single(C.onebit(), x)
    np.testing.assert_array_equal(p.packed, bits)
    flat = x.ravel().astype(np.float64)
    np.testing.assert_allclose(p.centers, [flat[flat >= 0].mean(), flat[flat < 0].mean()], 1e-6)


def torch_conv_matrix(x: np.ndarray) -> np.ndarray:
    """GRACE's PowerSGD matrix of a Flax conv kernel ``[kh, kw, in, out]``: the PyTorch
    weight ``[out, in, kh, kw]`` viewed as ``[out, in * kh * kw]``."""
    return x.transpose(3, 2, 0, 1).reshape(x.shape[3], -1)


def fan_in_by_out(t: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """GRACE's ``[out, in * kh * kw]`` matrix, transposed to ``[kh * kw * in, out]``."""
    kh, kw, cin, cout = shape
    return t.reshape(cout, cin, kh * kw).transpose(2, 1, 0).reshape(kh * kw * cin, cout)


def test_powersgd_single_worker_is_one_power_iteration():
    # A conv kernel [kh, kw, in, out]. The matrix is fan-in x output units, [kh*kw*in, out]
    # (until the fix, [kh, kw*in*out]: rank clipped to kh and a payload above dense).
    x = heavy_tailed(8, (3, 3, 16, 32))
    comp = C.powersgd(4)
    q0 = np.asarray(comp.init(jax.ShapeDtypeStruct(x.shape, x.dtype)), np.float64)
    assert q0.shape == (32, 4)  # one row per output unit
    # Our [kh*kw*in, out] matrix is GRACE's [out, in*kh*kw] transposed, up to the order of
    # the fan-in entries: rebuild it from the torch layout independently of the reshape.
    m = fan_in_by_out(torch_conv_matrix(x).astype(np.float64), x.shape)  # [144, 32]
    np.testing.assert_array_equal(m, x.reshape(144, 32))
    basis, _ = np.linalg.qr(m @ q0)
    approx = basis @ basis.T @ m  # P Q^T with Q = M^T P; independent of column signs
    p = single(comp, x)
    assert p.p.shape == (144, 4) and p.q.shape == (32, 4)
    np.testing.assert_allclose(p.p.T @ p.p, np.eye(4), atol=1e-5)
    np.testing.assert_allclose(p.p @ p.q.T, approx, rtol=1e-4, atol=1e-4)
    decompressed = comp.decompress(p, jax.ShapeDtypeStruct(x.shape, x.dtype))
    np.testing.assert_allclose(decompressed, approx.reshape(x.shape), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "shape", [(3, 3, 64, 128), (3, 3, 3, 64), (1, 1, 256, 64), (7, 7, 3, 64), (3, 3, 512, 512)]
)
def test_powersgd_conv_payload_is_fan_in_plus_out_times_rank(shape):
    kh, kw, cin, cout = shape
    rank = 4
    dense = kh * kw * cin * cout * 4
    payload = C.powersgd(rank).payload_bytes(shape, jnp.float32)
    assert payload == (kh * kw * cin + cout) * 4 * rank
    assert payload < dense / 4


def test_powersgd_conv_kernel_exchange_bytes_and_mean():
    """GRACE's example kernel [3, 3, 64, 128] at rank 4: 11,264 B per worker on the wire,
    and the mean is PowerSGD on the [576, 128] fan-in x output-units matrix."""
    shape, rank = (3, 3, 64, 128), 4
    comp = C.powersgd(rank)
    like = jax.ShapeDtypeStruct(shape, jnp.float32)
    assert comp.payload_bytes(shape, jnp.float32) == 11_264

    def body(x, q):
        red = comp.reduce(x[0], q[0], None, AXIS)
        return red.mean[None], red.state[None]

    m = mesh()
    sharding = NamedSharding(m, P(AXIS))
    fn = jax.jit(jax.shard_map(body, mesh=m, in_specs=P(AXIS), out_specs=P(AXIS)))
    xs = heavy_tailed(9, (W, *shape))
    q0 = np.asarray(comp.init(like))
    qs = np.broadcast_to(q0, (W, *q0.shape))
    compiled = fn.lower(jax.device_put(xs, sharding), jax.device_put(qs, sharding)).compile()
    assert sum(c.bytes_per_worker for c in collectives(compiled)) == 11_264
    mean, _ = jax.device_get(fn(jax.device_put(xs, sharding), jax.device_put(qs, sharding)))
    # numpy: GRACE's torch-layout matrices, transposed back to [kh*kw*in, out].
    ms = [fan_in_by_out(torch_conv_matrix(x).astype(np.float64), shape) for x in xs]
    p = np.linalg.qr(np.mean([mw @ q0 for mw in ms], axis=0))[0]
    q = np.mean([mw.T @ p for mw in ms], axis=0)
    for w in range(W):
        np.testing.assert_array_equal(mean[w], mean[0])
    np.testing.assert_allclose(mean[0].reshape(576, 128), p @ q.T, rtol=2e-4, atol=2e-4)


# -------------------------------------------------------------------- unbiasedness


def draws(comp: C.Compressor, x: np.ndarray, count: int) -> np.ndarray:
    like = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def one(key):
        payload, _ = comp.compress(jnp.asarray(x), comp.init(like), key)
        return comp.decompress(payload, like)

    keys = jax.random.split(jax.random.PRNGKey(11), count)
    return np.asarray(jax.jit(jax.vmap(one))(keys), np.float64)


def z_scores(samples: np.ndarray, x: np.ndarray) -> np.ndarray:
    mean, std = samples.mean(0), samples.std(0, ddof=1)
    se = std / math.sqrt(len(samples))
    err = mean - x
    return np.where(se > 0, err / np.maximum(se, 1e-30), np.where(err == 0, 0.0, np.inf))


def largest_z(samples: np.ndarray, x: np.ndarray) -> float:
    """The largest ``|z|`` of the samples' mean against ``x``, entry by entry (float64)."""
    return float(np.abs(z_scores(samples, x.astype(np.float64))).max())


UNBIASED = {
    "randomk_scaled": C.randomk(0.1, scaled=True),
    "qsgd": C.qsgd(levels=2, bucket_size=50),
    "qsgd_inf": C.qsgd(levels=3, norm="inf", bucket_size=None),
    "terngrad": C.terngrad(),
    "natural": C.natural(),
}


@pytest.mark.parametrize("name", sorted(UNBIASED))
def test_unbiased_compressors_are_unbiased(name):
    comp = UNBIASED[name]
    assert comp.biased is False
    x = heavy_tailed(12, (10, 20))
    samples = draws(comp, x, 3000)
    z = largest_z(samples, x)
    assert z < 5.0, z  # 200 entries: a 5-sigma miss is ~1e-4
    assert samples.std(0).max() > 0  # really random


BIASED = {
    "topk": C.topk(0.1),
    "randomk": C.randomk(0.1),
    "fast_topk": C.fast_topk(0.1),
    "threshold": C.threshold(1.0),
    "dgc": C.dgc(0.1),
    "signsgd": C.signsgd(),
    "efsignsgd": C.efsignsgd(),
    "signum": C.signum(),
    "onebit": C.onebit(),
    "powersgd": C.powersgd(2),
    "fp16": C.fp16(),
}


@pytest.mark.parametrize("name", sorted(BIASED))
def test_biased_compressors_are_biased(name):
    comp = BIASED[name]
    assert comp.biased is True
    x = heavy_tailed(13, (10, 20))
    if name == "fp16":  # biased by rounding only: visible on values fp16 cannot represent
        x = x + np.float32(1e-4)
    samples = draws(comp, x, 200 if comp.randomness != "none" else 2)
    assert largest_z(samples, x) > 50  # the mean is off by far more than sampling noise


def test_registry_attributes():
    expected_biased = {"none": False, "fp16": True, "bf16": True, "topk": True}
    expected_biased |= {n: False for n in ("terngrad", "natural", "qsgd")}
    for name, factory in C.REGISTRY.items():
        comp = factory(1.0) if name == "threshold" else factory()
        assert comp.name == ("cast" if name in ("fp16", "bf16") else name)
        assert comp.randomness in ("none", "shared", "per_worker")
        if name in expected_biased:
            assert comp.biased is expected_biased[name], name
    assert C.get("qsgd", levels=8).levels == 8


# ------------------------------------------------------------------------ conservation


@pytest.mark.parametrize("name", sorted(set(CASES) - {"powersgd"}))
def test_decompressed_payload_plus_residual_is_the_input(name):
    comp = CASES[name]
    x = heavy_tailed(20, SHAPE)
    like = jax.ShapeDtypeStruct(SHAPE, x.dtype)

    @jax.jit
    def parts(x):
        payload, _ = comp.compress(x, comp.init(like), worker_key(comp, 0))
        return comp.decompress(payload, like), comp.residual(x, payload)

    d, r = jax.device_get(parts(x))
    if name in SPARSE and name != "randomk_scaled":  # exact: sent entries carry x itself
        np.testing.assert_array_equal(d + r, x)
        np.testing.assert_array_equal(r[d != 0], 0)
    else:  # r = x - D(P) in float32 (XLA may fuse it into one FMA): equal up to ulps
        ulp = np.spacing(np.maximum(np.abs(x), np.abs(d)))
        assert np.all(np.abs(r - (x - d)) <= ulp)
        assert np.all(np.abs(d + r - x) <= 2 * ulp)
        if name != "none":
            assert np.abs(r).max() > 0  # lossy: something was left for error feedback


def test_powersgd_residual_is_input_minus_global_approximation():
    xs = heavy_tailed(21)
    _, mean, residual, _ = run_exchange("powersgd", xs)
    np.testing.assert_array_equal(residual, xs - mean)


# ------------------------------------------------------------- compiled collective bytes


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_collective_bytes_equal_payload_bytes(name):
    comp = CASES[name]
    _, compiled = exchange_fn(name)
    found = collectives(compiled)
    assert found, "no collective in the compiled exchange"
    wire = comp.payload_bytes(SHAPE, jnp.float32)
    if name == "bf16" and jax.default_backend() == "cpu":
        wire *= 2  # XLA:CPU runs a bfloat16 all-reduce in float32 (a sum, so no bit-cast)
    assert sum(c.bytes_per_worker for c in found) == wire
    if name not in DENSE:
        # No all-reduce of the leaf's size: the exchange is all-gathers of narrow payloads
        # (Random-k and PowerSGD all-reduce only k or (rows + cols) * r entries).
        for c in found:
            if c.op == "all-reduce":
                assert max(c.element_counts) < N // 4, c
        assert comp.compression_ratio(SHAPE, jnp.float32) > 3


def test_payload_bytes_formulas():
    n = N
    assert C.qsgd(bucket_size=512).payload_bytes(SHAPE, jnp.float32) == n + 4 * math.ceil(n / 512)
    assert C.terngrad().payload_bytes(SHAPE, jnp.float32) == math.ceil(n / 4) + 4
    assert C.natural().payload_bytes(SHAPE, jnp.bfloat16) == n + 4
    assert C.signsgd().payload_bytes(SHAPE, jnp.float32) == math.ceil(n / 8)
    assert C.onebit().payload_bytes(SHAPE, jnp.float32) == math.ceil(n / 8) + 8
    assert C.powersgd(3).payload_bytes(SHAPE, jnp.bfloat16) == (97 + 129) * 3 * 2
    assert C.powersgd(500).payload_bytes((4, 6), jnp.float32) == (4 + 6) * 4 * 4  # rank clips
    assert C.fast_topk(0.01).payload_bytes(SHAPE, jnp.bfloat16) == 125 * 6


# ------------------------------------------------------------------- worker-mean exchange


@pytest.mark.parametrize("name", sorted(set(CASES) - {"powersgd"}))
def test_exchange_mean_matches_numpy_and_is_identical_on_all_workers(name):
    xs = heavy_tailed(30)
    payload, mean, residual, _ = run_exchange(name, xs)
    for w in range(1, W):  # bit-identical on every worker
        np.testing.assert_array_equal(mean[w], mean[0])
    if name in DENSE:  # a dense all-reduce: summation order is the backend's
        sent = xs.astype(np.float16 if name == "fp16" else jnp.bfloat16).astype(np.float64)
        np.testing.assert_allclose(mean[0], sent.mean(0), rtol=1e-2, atol=1e-2)
        return
    decoded = [np_decode(name, jax.tree.map(lambda a, w=w: a[w], payload)) for w in range(W)]
    if name in VOTE:
        ref = np.sign(np.sum(decoded, axis=0))  # majority vote, 0 on a tie
        np.testing.assert_array_equal(mean[0].ravel(), ref)
        assert (ref == 0).any() and (ref != 0).any()  # 8 workers: ties happen
    elif name.startswith("randomk"):  # shared indices: a k-element psum of the values
        np.testing.assert_allclose(mean[0].ravel(), np.mean(decoded, axis=0), rtol=1e-6)
        assert len({tuple(payload.indices[w]) for w in range(W)}) == 1
    elif name.startswith("qsgd"):  # norm * level / s + acc may be fused into an FMA
        ref = np_worker_mean(decoded)
        np.testing.assert_allclose(mean[0].ravel(), ref, rtol=0, atol=4 * np.spacing(ref.max()))
    else:  # all-gathered and summed in worker order: exactly numpy's float32 sums
        np.testing.assert_array_equal(mean[0].ravel(), np_worker_mean(decoded))
    for w in range(W):  # the residual each worker keeps is its own x - D(P_w), up to ulps
        x, d = xs[w].ravel(), decoded[w]
        assert np.all(np.abs(residual[w].ravel() - (x - d)) <= np.spacing(np.abs(x) + np.abs(d)))


def np_powersgd_step(xs: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ms = xs.reshape(W, SHAPE[0], -1).astype(np.float64)
    p = np.mean([m @ q for m in ms], axis=0)
    p, _ = np.linalg.qr(p)
    q_new = np.mean([m.T @ p for m in ms], axis=0)
    return p @ q_new.T, q_new


def test_powersgd_exchange_matches_numpy_over_two_steps():
    comp = CASES["powersgd"]
    q = np.asarray(comp.init(jax.ShapeDtypeStruct(SHAPE, jnp.float32)), np.float64)
    states = init_states(comp)
    for step in range(2):  # warm start: the second step starts from the averaged Q
        xs = heavy_tailed(40 + step)
        _, mean, _, states = run_exchange("powersgd", xs, states)
        approx, q = np_powersgd_step(xs, q)
        for w in range(W):
            np.testing.assert_array_equal(mean[w], mean[0])
            np.testing.assert_array_equal(states[w], states[0])  # Q stays replicated
        np.testing.assert_allclose(mean[0].reshape(SHAPE[0], -1), approx, rtol=2e-4, atol=2e-4)
        # Q is determined up to column signs by the orthonormalization.
        np.testing.assert_allclose(np.abs(states[0]), np.abs(q), rtol=2e-3, atol=2e-3)


def test_powersgd_keeps_q_after_an_all_zero_gradient():
    comp = CASES["powersgd"]
    states = init_states(comp)
    _, mean, _, after_zero = run_exchange("powersgd", np.zeros((W, *SHAPE), np.float32), states)
    np.testing.assert_array_equal(mean, 0)
    np.testing.assert_array_equal(after_zero, states)  # not stalled at Q = 0
    _, mean, _, _ = run_exchange("powersgd", heavy_tailed(42), after_zero)
    assert np.abs(mean).max() > 0


def test_signum_momentum_is_per_worker_state_and_vote_matches_numpy():
    comp = CASES["signum"]
    states = init_states(comp)
    momentum = np.zeros((W, *SHAPE), np.float32)
    for step in range(2):
        xs = heavy_tailed(50 + step)
        _, vote, _, states = run_exchange("signum", xs, states)
        momentum = np.float32(0.5) * momentum + np.float32(0.5) * xs
        np.testing.assert_allclose(states, momentum, rtol=1e-6)
        signs = np.where(momentum >= 0, 1, -1).sum(0)
        np.testing.assert_array_equal(vote[0], np.sign(signs))


@pytest.mark.parametrize("name", ["fast_topk", "qsgd", "signsgd", "natural", "powersgd"])
def test_pmap_exchange_equals_shard_map(name):
    comp = CASES[name]
    xs = heavy_tailed(60)
    states = init_states(comp)

    def body(x, state):
        key = worker_key(comp, lax.axis_index(AXIS))
        red = comp.reduce(x, state, key, AXIS)
        return red.mean, red.residual, red.state

    pm = jax.device_get(jax.pmap(body, axis_name=AXIS)(xs, states))
    _, mean, residual, state = run_exchange(name, xs, states)
    chex.assert_trees_all_equal(pm, (mean, residual, state))


@pytest.mark.parametrize("name", ["topk", "qsgd", "powersgd"])
def test_bfloat16_leaf_bytes_and_mean(name):
    xs = heavy_tailed(70).astype(jnp.bfloat16)
    _, compiled = exchange_fn(name, "bfloat16")
    found = sum(c.bytes_per_worker for c in collectives(compiled))
    wire = CASES[name].payload_bytes(SHAPE, jnp.bfloat16)
    if name == "powersgd" and jax.default_backend() == "cpu":
        wire *= 2  # XLA:CPU runs bfloat16 all-reduces in float32
    assert found == wire  # sparse values travel as 2 bytes: all_gather bit-casts bfloat16
    payload, mean, _, _ = run_exchange(name, xs)
    assert mean.dtype == jnp.bfloat16 and np.isfinite(mean.astype(np.float32)).all()
    if name == "topk":
        decoded = [np_decode(name, jax.tree.map(lambda a, w=w: a[w], payload)) for w in range(W)]
        ref = np.sum([d.astype(np.float32) for d in decoded], axis=0) / np.float32(W)
        np.testing.assert_array_equal(mean[0].ravel(), ref.astype(jnp.bfloat16))


# ---------------------------------------------------------- inside the optax transforms


def test_transforms_keep_signum_state_per_worker_and_powersgd_q_replicated():
    params = {"w": np.zeros((60, 40), np.float32)}
    m = th.mesh()
    signum = rr.compressed_mean(C.signum(), min_size=100)
    specs = rr.parallel.state_partition_specs(signum, params, m, th.AXIS)
    assert specs.compressor_state["w"] == P(AXIS)
    power = rr.error_feedback(C.powersgd(2), min_size=100)
    specs = rr.parallel.state_partition_specs(power, params, m, th.AXIS)
    assert specs.compressor_state["w"] == P() and specs.residuals["w"] == P(AXIS)
    grads = th.random_grads(np.random.default_rng(0), {"w": (60, 40)}, W, steps=3)
    outputs, state = th.run_shard_map(power, params, grads)
    # EF conservation over the run: sum of outputs + mean residual = sum of mean gradients.
    total = sum(o["w"][0].astype(np.float64) for o in outputs)
    mean_grads = sum(g["w"].mean(0).astype(np.float64) for g in grads)
    np.testing.assert_allclose(total + state.residuals["w"].mean(0), mean_grads, atol=1e-4)
    assert not isinstance(state.compressor_state["w"], optax.MaskedNode)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: C.topk(0.0), r"density must be in \(0, 1\]"),
        (lambda: C.fast_topk(1.5), r"density must be in \(0, 1\]"),
        (lambda: C.dgc(float("nan")), r"density must be in \(0, 1\]"),
        (lambda: C.dgc(0.01, sample_ratio=0), r"sample_ratio must be in \(0, 1\]"),
        (lambda: C.dgc(0.01, rounds=-1), r"rounds must be an int \[0, 100\]"),
        (lambda: C.randomk(-0.1), r"density must be in \(0, 1\]"),
        (lambda: C.threshold(0.0), r"tau must be a positive finite number"),
        (lambda: C.threshold(float("nan")), r"tau must be a positive finite number"),
        (lambda: C.threshold(1.0, max_density=2), r"max_density must be in \(0, 1\]"),
        (lambda: C.qsgd(levels=0), r"levels must be an int \[1, 127\]"),
        (lambda: C.qsgd(levels=128), r"levels must be an int \[1, 127\]"),
        (lambda: C.qsgd(levels=2.5), r"levels must be an int \[1, 127\]"),
        (lambda: C.qsgd(norm="l1"), r"norm must be 'l2' or 'inf'"),
        (lambda: C.qsgd(bucket_size=0), r"bucket_size must be an int >= 1"),
        (lambda: C.signum(beta=1.0), r"beta must be in \[0, 1\)"),
        (lambda: C.powersgd(0), r"rank must be an int >= 1"),
        (lambda: C.powersgd(2.0), r"rank must be an int >= 1"),
        (lambda: C.fast_topk(0.01, margin=-1), r"margin must be a positive"),
        (lambda: C.get("zipper"), r"Unknown compressor 'zipper'"),
        (lambda: C.get("qsgd", bits=4), r"Bad arguments for compressor 'qsgd'"),
    ],
)
def test_bad_hyperparameters_raise_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_validate_names_the_leaf():
    with pytest.raises(ValueError, match=r"Leaf 'net/bias' has shape \(10,\).*ndim >= 2"):
        C.powersgd(2).validate("net/bias", jax.ShapeDtypeStruct((10,), jnp.float32))
    with pytest.raises(ValueError, match=r"Leaf 'net/step' has dtype int32"):
        C.qsgd().validate("net/step", jax.ShapeDtypeStruct((10, 10), jnp.int32))
    C.powersgd(2).validate("net/kernel", jax.ShapeDtypeStruct((10, 3, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"Leaf 'emb' has 2147483648 elements.*int32"):
        C.topk(0.01).validate("emb", jax.ShapeDtypeStruct((2**16, 2**15), jnp.float32))


@pytest.mark.parametrize("name", ["qsgd", "terngrad", "natural", "dgc", "randomk"])
def test_random_compressors_need_a_key(name):
    comp = CASES[name]
    with pytest.raises(ValueError, match="PRNG key"):
        comp.compress(jnp.ones(SHAPE), (), None)


def test_powersgd_aggregate_alone_is_refused():
    with pytest.raises(ValueError, match="call reduce"):
        C.powersgd(2).aggregate((), jax.ShapeDtypeStruct(SHAPE, jnp.float32), AXIS)


@pytest.mark.parametrize("name", ["topk", "qsgd", "signsgd"])
def test_each_exchange_fills_its_own_accumulator(name):
    """A gathered exchange adds every worker's payload into zeros of its own, made after
    its gather. ``jnp.zeros`` of one shape is a single constant to XLA: the leaves' loops
    then started from copies of one shared fill, alive from the first exchange to the
    last (a 9 MiB fill and its copy at the compiled peak of a 1536-wide MLP)."""
    compressor = CASES[name]
    shape = (256, 1024)  # 1 MiB per leaf
    mesh = jax.make_mesh((W,), (AXIS,))
    spec = P(AXIS)

    def exchange(*xs):
        key = jax.random.key(0)
        return tuple(compressor.reduce(x[0], (), key, AXIS).mean[None] for x in xs)

    step = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=spec, out_specs=spec))
    like = jax.ShapeDtypeStruct((W, *shape), jnp.float32, sharding=NamedSharding(mesh, spec))
    text = step.lower(like, like, like).compile().as_text()
    fills = [line for line in text.splitlines() if re.search(r" copy\(%\S*broadcast", line)]
    assert not fills


def _joint_cases():
    """``(leaves, k)`` cases: magnitudes that a strided sample brackets well, badly (the
    large entries where it never looks), not at all (k below one sampled entry), and
    ties at the k-th magnitude that no count can split (integers, zeros, bfloat16)."""
    rng = np.random.default_rng(5)
    sizes = [9000, 1, 300, 21000]  # 30,301 entries; stride 59 for a 512-entry sample
    n = sum(sizes)

    def split(flat):
        return np.split(flat, np.cumsum(sizes)[:-1])

    normal = rng.standard_normal(n).astype(np.float32)
    hidden = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    hidden[::59] = rng.standard_normal(hidden[::59].size).astype(np.float32)  # unsampled
    sparse = np.zeros(n, np.float32)
    sparse[rng.choice(n, 100, replace=False)] = rng.standard_normal(100)
    cases = [
        ("normal", split(normal), n // 100),
        ("heavy-tailed", split(rng.standard_cauchy(n).astype(np.float32)), n // 100),
        ("unsampled", split(hidden), n // 100),
        ("three entries", split(normal), 3),
        ("every entry", split(normal), n),
        ("integers", split(rng.integers(-4, 5, n).astype(np.float32)), n // 100),
        ("zeros", split(sparse), n // 100),
        ("bfloat16", split(normal.astype(jnp.bfloat16)), n // 100),
    ]
    return [pytest.param(leaves, k, id=name) for name, leaves, k in cases]


@pytest.mark.parametrize("leaves, k", _joint_cases())
def test_joint_top_k_against_numpy(leaves, k, monkeypatch):
    """compressors.sparse.joint_top_k against numpy's stable order of the magnitudes (ties
    to the lower position) over the concatenated leaves: the same values at the same
    indices, whichever way its threshold search ends."""
    monkeypatch.setattr(C.sparse, "JOINT_SAMPLE", 512)
    flat = np.concatenate(leaves).astype(np.float32)
    order = np.lexsort((np.arange(flat.size), -np.abs(flat)))
    expected = np.sort(order[:k])
    values, indices = jax.jit(C.sparse.joint_top_k, static_argnums=1)(
        [jnp.asarray(leaf) for leaf in leaves], k
    )
    np.testing.assert_array_equal(np.asarray(indices), expected)
    np.testing.assert_array_equal(np.asarray(values, np.float32), flat[expected])


def test_a_leaf_window_holds_every_entry_of_its_leaf():
    """compressors.base.leaf_window: of a payload in increasing index order, the window of
    each leaf (smaller and larger than the payload, first, middle and last, one without
    entries) scatters exactly what the whole payload's entries in the leaf do."""
    rng = np.random.default_rng(3)
    sizes = [50, 400, 3, 40, 120, 9]  # the last: its window moved back to fit
    bounds = np.cumsum([0, *sizes])
    chosen = np.sort(rng.choice(bounds[-1], 60, replace=False))
    chosen = chosen[(chosen < bounds[3]) | (chosen >= bounds[4])]  # leaf 3 gets none
    k = chosen.size
    values = rng.standard_normal(k).astype(np.float32)
    for start, n in zip(bounds[:-1], sizes, strict=True):
        part, local = jax.jit(C.base.leaf_window, static_argnums=(2, 3))(
            jnp.asarray(values), jnp.asarray(chosen, jnp.int32), int(start), n
        )
        assert part.shape == (min(k, n),)
        got = jnp.zeros(n).at[local].set(part, mode="drop")
        inside = (chosen >= start) & (chosen < start + n)
        expected = np.zeros(n, np.float32)
        expected[chosen[inside] - start] = values[inside]
        np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("values_kind", ["tied", "continuous"])
@pytest.mark.parametrize("block", [None, 64])
def test_joint_topk_equals_topk_of_the_concatenation(values_kind, block, monkeypatch):
    """TopK.reduce_jointly (whole-model Top-k) against TopK.reduce of the concatenated
    leaves: the same entries sent, means and residuals bit for bit, with magnitudes tied
    across leaves (integers: the ties are cut by position) or not, a leaf smaller than k,
    and leaves compacted in one block or in many (the last overlapping); one all-gather
    per payload array, as a single leaf's exchange."""
    if block is not None:
        monkeypatch.setattr(C.sparse, "JOINT_BLOCK", block)
    rng = np.random.default_rng(11)
    shapes = [(30, 20), (7,), (40, 25)]  # k = 0.05 * 1607 = 80 > 7
    if values_kind == "tied":
        xs = [rng.integers(-4, 5, size=(W, *s)).astype(np.float32) for s in shapes]
    else:
        xs = [rng.standard_normal((W, *s)).astype(np.float32) for s in shapes]
    comp = C.topk(0.05)
    m = mesh()
    placed = [jax.device_put(x, NamedSharding(m, P(AXIS))) for x in xs]
    sizes = [math.prod(s) for s in shapes]

    def joint(*leaves):
        means, residuals = comp.reduce_jointly(tuple(x[0] for x in leaves), AXIS)
        return tuple(a[None] for a in (*means, *residuals))

    def concatenated(*leaves):
        flat = jnp.concatenate([x[0].ravel() for x in leaves])
        red = comp.reduce(flat, (), None, AXIS)
        payload = comp.compress(flat, (), None)[0]
        return red.mean[None], red.residual[None], payload.values[None], payload.indices[None]

    spec = (P(AXIS),) * len(shapes)
    joint_fn = jax.jit(jax.shard_map(joint, mesh=m, in_specs=spec, out_specs=P(AXIS)))
    got = jax.device_get(joint_fn(*placed))
    ref_fn = jax.jit(jax.shard_map(concatenated, mesh=m, in_specs=spec, out_specs=P(AXIS)))
    mean, residual, sent_values, indices = jax.device_get(ref_fn(*placed))
    bounds = np.cumsum([0, *sizes])
    if values_kind == "tied":  # ties were cut
        assert len(set(np.abs(sent_values[0]).tolist())) < comp.k(sum(sizes))
    for n, (shape, a, b) in enumerate(zip(shapes, bounds[:-1], bounds[1:], strict=True)):
        np.testing.assert_array_equal(got[n], mean[:, a:b].reshape(W, *shape))
        np.testing.assert_array_equal(got[len(shapes) + n], residual[:, a:b].reshape(W, *shape))
    # The entries sent are those of the concatenation's Top-k on every worker.
    for w in range(W):
        sent = np.concatenate([(xs[n][w] - got[len(shapes) + n][w]).ravel() for n in range(3)])
        expected = np.sort(indices[w][sent_values[w] != 0])
        np.testing.assert_array_equal(np.flatnonzero(sent), expected)
    text = joint_fn.lower(*placed).compile().as_text()
    assert [c.op for c in collectives(text)].count("all-gather") == 2
