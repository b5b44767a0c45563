"""Exact bytes of residual formats wherever they are reported: ``grouping.report``'s rows,
``memory.model_state_bytes`` and the exchange's ``plan.residual_bytes()``, against counts
derived by hand from what a format stores (whole blocks of codes, one float32 scale each)."""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest

import resireduce_jax as rr


def _params():
    """Two 1000 x 300 kernels of one role (auto shares them), one 500 x 64, and a bias."""
    return {
        "h_0": {"w": jax.ShapeDtypeStruct((1000, 300), np.float32)},
        "h_1": {"w": jax.ShapeDtypeStruct((1000, 300), np.float32)},
        "out": {
            "w": jax.ShapeDtypeStruct((500, 64), np.float32),
            "b": jax.ShapeDtypeStruct((64,), np.float32),
        },
    }


# By hand. int4, blocks of 128: 300000 values are 2343.75 blocks, so 2344 (the last padded),
# each 64 bytes of codes (two a byte) and a 4-byte scale; 32000 values are 250 blocks.
# int3, blocks of 128: 48 bytes of codes a block (eight codes in three bytes) and a scale.
# int8 / float8, blocks of 256: 1172 blocks (1171.875) of 256 bytes + 4; 125 blocks.
# bfloat16: two bytes a value, no scales. float32 (the default): four.
BIG = {
    "int4": 2344 * (64 + 4),
    "int3": 2344 * (48 + 4),
    "int8": 1172 * (256 + 4),
    "float8": 1172 * (256 + 4),
    "int4/64/stochastic": 4688 * (32 + 4),  # 300000 / 64 = 4687.5
    "bfloat16": 300_000 * 2,
    None: 300_000 * 4,
}
SMALL = {
    "int4": 250 * (64 + 4),
    "int3": 250 * (48 + 4),
    "int8": 125 * (256 + 4),
    "float8": 125 * (256 + 4),
    "int4/64/stochastic": 500 * (32 + 4),
    "bfloat16": 32_000 * 2,
    None: 32_000 * 4,
}
FORMATS = list(BIG)


def test_the_hand_counts_are_the_arithmetic_they_say():
    assert math.ceil(300_000 / 128) == 2344 and math.ceil(32_000 / 128) == 250
    assert math.ceil(300_000 / 256) == 1172 and math.ceil(32_000 / 256) == 125
    assert math.ceil(300_000 / 64) == 4688 and math.ceil(32_000 / 64) == 500
    assert BIG["int4"] == 159_392  # vs. ceil(300000 / 2) + 4 * 2344 = 159376 unpadded


@pytest.mark.parametrize("name", FORMATS)
def test_grouping_report_rows_count_codes_and_scales(name):
    report = rr.grouping.report(
        _params(), rr.grouping.auto(), min_size=10_000, residual_format=name
    )
    rows = {r["group"]: r for r in report.rows}
    (shared,) = [r for r in report.rows if r["members"] == 2]
    (single,) = [r for r in report.rows if r["members"] == 1]
    assert len(rows) == 2 and single["paths"] == ["out/w"]
    assert shared["bytes"] == BIG[name] and single["bytes"] == SMALL[name]
    assert report.residual_bytes_grouped == BIG[name] + SMALL[name]
    assert report.residual_bytes_per_leaf == 2 * BIG[name] + SMALL[name]
    kept = rr.residual_formats.parse_format(name or "float32").name
    assert shared["format"] == kept and kept in str(report)
    # The exchange that keeps these groups counts the same bytes (one source: StorePlan).
    exchange = rr.resireduce(
        rr.compressors.topk(0.01), grouping=rr.grouping.auto(), residual_format=name
    )
    assert exchange.plan(_params()).residual_bytes() == report.residual_bytes_grouped


def test_grouping_report_takes_residual_dtype_as_a_float_format():
    report = rr.grouping.report(_params(), rr.grouping.auto(), residual_dtype=np.dtype("bfloat16"))
    assert report.residual_bytes_grouped == BIG["bfloat16"] + SMALL["bfloat16"]
    with pytest.raises(ValueError, match="not both"):
        rr.grouping.report(
            _params(), rr.grouping.auto(), residual_format="int8", residual_dtype="bfloat16"
        )


@pytest.mark.parametrize("name", FORMATS)
def test_model_state_bytes_count_codes_and_scales(name):
    ef = optax.chain(
        rr.error_feedback(rr.compressors.topk(0.01), residual_format=name), optax.sgd(0.1)
    )
    m = rr.memory.model_state_bytes(_params(), ef)
    assert m.residuals == 2 * BIG[name] + SMALL[name]
    assert m.params == m.grads == (2 * 300_000 + 32_000 + 64) * 4
    shared = optax.chain(
        rr.resireduce(rr.compressors.topk(0.01), grouping=rr.grouping.auto(), residual_format=name),
        optax.sgd(0.1),
    )
    assert rr.memory.model_state_bytes(_params(), shared).residuals == BIG[name] + SMALL[name]
    comparison = rr.memory.compare(_params(), shared, ef)
    assert comparison.baseline.residuals - comparison.reduced.residuals == BIG[name]


def test_rows_and_2d_stores_count_their_kept_block_and_indices():
    """ResiReduce-2d on out/w ([in 500, out 64]: rows are the 64 output units, columns the
    500 inputs), half of each kept: a 32 x 250 block (8000 values: 63 int8 blocks of 256,
    the last padded) and 32 + 250 int32 indices."""
    exchange = rr.resireduce(
        rr.compressors.topk(0.01),
        grouping=rr.grouping.auto(),
        intra="2d",
        intra_layers=r"out/",
        residual_format="int8",
    )
    block = math.ceil(32 * 250 / 256) * (256 + 4) + (32 + 250) * 4
    assert exchange.plan(_params()).residual_bytes() == BIG["int8"] + block
    m = rr.memory.model_state_bytes(_params(), optax.chain(exchange, optax.sgd(0.1)))
    assert m.residuals == BIG["int8"] + block
