"""The residual formats' saving at the compiled peak of the donated, guarded step.

Error feedback's per-leaf store in bfloat16, int8, float8, int4 or int3 against float32 EF on
an MLP whose largest leaf is a ``[1, 1, a, b]`` kernel, 8 simulated workers, Top-k 1 %,
``skip_nonfinite``, compiled from abstract shapes (nothing runs). What kept the saving
from the peak: docs/design.md, "Residuals at the compiled peak" (a residual kept in fewer
bytes than the gradient); full-size figures: benchmarks/results/peak_memory_formats/.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import resireduce_jax as rr
from tests import transform_harness as th

WORKERS = 8
BATCH = 512  # per worker: the activations alive when the last layers are exchanged
SHAPES = {
    "input": (256, 1024),
    "conv": (1, 1, 1024, 2048),  # 8 MiB, a 1x1 kernel: one row in map_blocks' rows view
    "head": (2048, 10),
}


def _loss(params: dict, batch: dict) -> jax.Array:
    x = jax.nn.relu(batch["x"] @ params["input"])
    x = jax.nn.relu(x @ params["conv"].reshape(1024, 2048))
    logits = x @ params["head"]
    picked = jnp.take_along_axis(logits, batch["label"][:, None], -1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


@functools.cache
def _compiled(residual_format: str | None) -> tuple[int, int, int]:
    """``(peak, temp, residual bytes)`` per worker of the guarded EF step."""
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    exchange = rr.error_feedback(rr.compressors.topk(0.01), residual_format=residual_format)
    tx = rr.skip_nonfinite(optax.chain(exchange, optax.sgd(0.1, momentum=0.9)))
    batch = {
        "x": jax.ShapeDtypeStruct((WORKERS * BATCH, 256), jnp.float32),
        "label": jax.ShapeDtypeStruct((WORKERS * BATCH,), jnp.int32),
    }
    peak = th.abstract_step_memory(_loss, tx, params, batch, th.mesh(WORKERS))
    residuals = rr.memory.model_state_bytes(params, tx).residuals
    return peak.peak, peak.temp, residuals


@pytest.mark.parametrize(
    "residual_format",
    ["bfloat16", "int8", "float8", "int4", "int4/128/nearest", "float8/256/stochastic", "int3"],
)
def test_the_residual_formats_saving_reaches_the_guarded_peak(residual_format):
    """The peak drops by at least 0.9 of the residual bytes saved: compensating, sending
    and re-encoding a leaf holds no leaf-sized float32 temporary that float32 EF does not
    (the decoded residual, ``|r|`` for the block scales, a second buffer for ``G~``, the
    stochastic rounding's random numbers)."""
    peak, temp, residuals = _compiled(residual_format)
    ef_peak, ef_temp, ef_residuals = _compiled(None)
    saving = ef_residuals - residuals
    assert saving > 0
    assert ef_peak - peak >= 0.9 * saving, (ef_peak - peak, saving)
    assert temp <= ef_temp + rr._src.in_place.BLOCK_BYTES, (temp, ef_temp)


def test_the_saving_reaches_the_peak_of_the_digits_default_whose_leaves_are_small():
    """The training program's guarded step of configs/default.py (8 workers, 16 a worker),
    whose leaves (256 KiB) are under ``in_place.BLOCK_BYTES``: each map still runs in
    ``MIN_BLOCKS`` blocks. Mapped in one piece, the guard's select, the decoded block and
    the sign restore after Top-k would each hold a second leaf beside their operand, and
    a leaf of each format's saving would miss the peak."""
    from tests.test_train import load_config
    from train import compiled_step

    report = compiled_step.memory_report(
        load_config("default"), variants=("ef", "ef+int8", "ef+int3", "w+2d", "w+2d+int3")
    )
    rows = {row["variant"]: row for row in report.rows}

    def drop_over_saving(variant: str, baseline: str) -> float:
        a, b = rows[baseline], rows[variant]
        return (a["peak"] - b["peak"]) / (a["residuals"] - b["residuals"])

    assert drop_over_saving("ef+int8", "ef") >= 0.9
    assert drop_over_saving("ef+int3", "ef") >= 0.9
    assert drop_over_saving("w+2d+int3", "w+2d") >= 0.9  # the format's own saving
