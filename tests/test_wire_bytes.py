"""What the network carries: ``tx.wire_bytes`` and ``tx.crossover_workers`` against numbers
derived by hand (ring all-gather: ``(N - 1)`` payloads received per worker; ring all-reduce:
``2 (N - 1) / N`` of the buffer), each compressor's ``collective`` against the collectives
its exchange traces, and the all-gathered payload against a compiled exchange's HLO."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from resireduce_jax import compressors as C

BIG = jax.ShapeDtypeStruct((1000, 1000), np.float32)  # 1e6 float32 elements: 4e6 bytes
BIAS = jax.ShapeDtypeStruct((1000,), np.float32)  # 1-D: travels dense


def ring(n: int) -> float:
    return 2 * (n - 1) / n


def test_topk_one_percent_at_eight_workers():
    tx = rr.compressed_mean(C.topk(0.01), "data")
    params = {"w": BIG}
    payload = 10_000 * (4 + 4)  # k = 1 % of 1e6, value + int32 index
    assert tx.bytes_sent(params, 1) == payload
    wire = tx.wire_bytes(params, 1, 8)
    assert wire.exchange == wire.exchange_across_nodes == 7 * payload == 560_000
    assert wire.dense == wire.dense_across_nodes == 2 * 7 / 8 * 4e6 == 7e6
    assert tx.wire_bytes(params, 3, 8).exchange == 3 * 560_000


def test_topk_one_percent_crosses_dense_after_one_hundred_workers():
    # (N - 1) 0.01 * 8 against 2 (N - 1) / N * 4 per element: equal at N = 100.
    tx = rr.compressed_mean(C.topk(0.01), "data")
    params = {"w": BIG}
    at = {n: tx.wire_bytes(params, 1, n) for n in (99, 100, 101)}
    assert at[99].exchange < at[99].dense
    assert at[100].exchange == pytest.approx(at[100].dense)
    assert at[101].exchange > at[101].dense
    assert tx.crossover_workers(params, 1) == 101


def test_crossover_with_a_dense_leaf_beside():
    # Top-k 0.3 %: k = 3000, G = 24_000 bytes all-gathered; the bias (4000 bytes) is
    # all-reduced in both. N G > 2 (D - d) = 2 * 4e6 <=> N > 333.3.
    tx = rr.compressed_mean(C.topk(0.003), "data")
    params = {"w": BIG, "b": BIAS}
    w = tx.wire_bytes(params, 1, 8)
    assert w.exchange == pytest.approx(7 * 24_000 + ring(8) * 4000)
    assert w.dense == pytest.approx(ring(8) * 4_004_000)
    assert tx.crossover_workers(params, 1) == 334
    assert tx.wire_bytes(params, 1, 333).exchange < tx.wire_bytes(params, 1, 333).dense
    assert tx.wire_bytes(params, 1, 334).exchange > tx.wire_bytes(params, 1, 334).dense


@pytest.mark.parametrize(
    "compressor, payload",
    [
        (C.randomk(0.01), 10_000 * 4),  # shared indices: only the values, psum'd
        (C.powersgd(4), (1000 + 1000) * 4 * 4),  # P and Q: (rows + cols) r entries
        (C.none(), 4_000_000),
    ],
)
def test_all_reduced_payloads_never_cross(compressor, payload):
    tx = rr.compressed_mean(compressor, "data")
    params = {"w": BIG}
    assert tx.bytes_sent(params, 1) == payload
    assert tx.wire_bytes(params, 1, 8).exchange == pytest.approx(ring(8) * payload)
    assert tx.crossover_workers(params, 1) is None


def test_onebit_crosses_at_sixty_four_workers():
    # ceil(n / 8) + 8 bytes all-gathered: N (125_000 + 8) > 2 * 4e6 <=> N > 63.996.
    tx = rr.compressed_mean(C.onebit(), "data")
    assert tx.crossover_workers({"w": BIG}, 1) == 64


def test_dense_warmup_counts_each_phase_by_its_collective():
    tx = rr.compressed_mean(C.topk(C.dense_warmup(10, 0.01)), "data")
    params = {"w": BIG}
    w = tx.wire_bytes(params, 20, 8)
    assert w.exchange == pytest.approx(10 * ring(8) * 4e6 + 10 * 7 * 80_000)
    # 10 * 80_000 N > 2 (20 * 4e6 - 10 * 4e6) <=> N > 100.
    assert tx.crossover_workers(params, 20) == 101
    assert tx.crossover_workers(params, 10) is None  # only the dense phase


def test_hierarchical_exchange():
    # 4 nodes of L = 4: each device compresses a (250, 1000) shard, k = 2500, 20_000 bytes
    # all-gathered over 4 nodes; inside the node the 4e6-byte leaf is reduce-scattered and
    # its mean all-gathered: 2 (L - 1) / L * 4e6.
    tx = rr.compressed_mean(C.topk(0.01), "data", local_axis="local")
    params = {"w": BIG}
    assert tx.bytes_sent(params, 1, local_size=4) == 20_000
    w = tx.wire_bytes(params, 1, 16, local_size=4)
    assert w.exchange_across_nodes == 3 * 20_000
    assert w.exchange == pytest.approx(3 * 20_000 + ring(4) * 4e6)
    assert w.dense == pytest.approx(ring(16) * 4e6)
    assert w.dense_across_nodes == pytest.approx(ring(4) * 4e6 / 4)  # a 2-D ring's
    # Across nodes: (M - 1) 20_000 against 2 (M - 1) / M 1e6: M > 100 nodes, N = 404.
    assert tx.crossover_workers(params, 1, local_size=4) == 404
    assert tx.wire_bytes(params, 1, 4, local_size=4).exchange_across_nodes == 0
    with pytest.raises(ValueError, match="multiple"):
        tx.wire_bytes(params, 1, 10, local_size=4)


def test_hierarchical_shards_are_padded_and_dense_leaves_span_every_device():
    # (1001, 1000) over L = 4: shards of 251 rows (1004 rows padded), k = 2510 per shard.
    tx = rr.compressed_mean(C.topk(0.01), "data", local_axis="local")
    params = {"w": jax.ShapeDtypeStruct((1001, 1000), np.float32), "b": BIAS}
    (store,) = tx.plan(params, local_size=4).stores
    assert store.shard.rows == 251
    w = tx.wire_bytes(params, 1, 8, local_size=4)  # 2 nodes
    inside = ring(4) * (1004 * 1000 * 4 + 4000)
    across = 1 * 2510 * 8 + ring(2) * 4000 / 4
    assert w.exchange_across_nodes == pytest.approx(across)
    assert w.exchange == pytest.approx(inside + across)
    # The bias all-reduced over all 8 devices as a 2-D ring: 2 (N - 1) / N of its bytes.
    assert ring(4) * 4000 + ring(2) * 4000 / 4 == pytest.approx(ring(8) * 4000)
    # M * 20_080 * 4 > 2 (4_004_000 + 4000 - 4000) = 8_008_000 <=> M > 99.7: 100 nodes.
    assert tx.crossover_workers(params, 1, local_size=4) == 400


def _traced_collectives(compressor) -> set[str]:
    like = jax.ShapeDtypeStruct((64, 96), jnp.float32)
    key = None if compressor.randomness == "none" else jax.random.PRNGKey(0)

    def body(x):
        x = jax.lax.pcast(x, "data", to="varying")  # a worker's own gradient
        return compressor.reduce(x, compressor.init(like), key, "data").mean

    mesh = jax.make_mesh((1,), ("data",))
    fn = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())
    text = str(jax.make_jaxpr(fn)(jnp.ones(like.shape, like.dtype)))
    found = re.findall(r"\b(all_gather|psum)(?:_invariant)?\[", text)
    return {"all_gather" if op == "all_gather" else "all_reduce" for op in found}


@pytest.mark.parametrize(
    "compressor",
    [
        C.none(),
        C.bf16(),
        C.topk(0.05),
        C.randomk(0.05),
        C.fast_topk(0.05, exact_below=0),
        C.threshold(1.5, max_density=0.1),
        C.dgc(0.05, sample_ratio=0.2),
        C.qsgd(levels=4, bucket_size=100),
        C.terngrad(),
        C.natural(),
        C.signsgd(),
        C.efsignsgd(),
        C.signum(0.5),
        C.onebit(),
        C.powersgd(3),
    ],
    ids=lambda c: c.name,
)
def test_collective_is_what_the_exchange_traces(compressor):
    assert _traced_collectives(compressor) == {compressor.collective}


def test_all_gathered_bytes_are_the_compiled_exchanges():
    tx = rr.compressed_mean(C.topk(0.05), "data", min_size=1000)
    params = {"w": jnp.zeros((64, 96), jnp.float32)}
    mesh = rr.parallel.make_mesh(8)
    step = rr.parallel.data_parallel_step(
        lambda p, batch: jnp.vdot(p["w"], p["w"]) * batch.sum(),
        optax.chain(tx, optax.sgd(0.1)),
        mesh,
    )
    p, s = step.init(params)
    batch = rr.parallel.shard_batch(np.ones((8, 1), np.float32), mesh)
    found = rr.hlo.collectives(step.lower(p, s, batch).compile())
    gathers = [c for c in found if c.op == "all-gather"]
    payload = 307 * 8  # k = floor(0.05 * 6144)
    assert sum(c.bytes_per_worker for c in gathers) == tx.bytes_sent(params, 1) == payload
    received = sum(c.result_bytes - c.bytes_per_worker for c in gathers)
    assert received == tx.wire_bytes(params, 1, 8).exchange == 7 * payload
