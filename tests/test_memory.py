"""Model-state accounting from abstract shapes, checked against hand-counted bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import resireduce_jax as rr

F32 = 4


def _params():
    s = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)
    return {
        "block_0": {"kernel": s(100, 200), "bias": s(200)},
        "block_1": {"kernel": s(100, 200), "bias": s(200)},
        "block_2": {"kernel": s(100, 200), "bias": s(200)},
        "embed": {"embedding": s(1000, 100)},
        "tiny": {"kernel": s(10, 10)},
    }


KERNEL = 100 * 200
EMBED = 1000 * 100
PARAMS = 3 * KERNEL + 3 * 200 + EMBED + 100


def test_error_feedback_with_momentum():
    tx = optax.chain(rr.error_feedback(rr.compressors.topk(0.01)), optax.sgd(0.1, momentum=0.9))
    m = rr.memory.model_state_bytes(_params(), tx)
    assert m.params == m.grads == PARAMS * F32
    assert m.optimizer == PARAMS * F32 + 4  # momentum + the EF step counter
    assert m.residuals == (3 * KERNEL + EMBED) * F32  # biases and the 10x10 leaf stay dense
    assert m.compressor == 0
    assert m.total == m.params + m.grads + m.optimizer + m.residuals


def test_resireduce_weighted_2d_with_adam_and_bf16():
    rules = rr.grouping.regex({r"block_\d/kernel": "blocks"})
    reduced = rr.resireduce(
        rr.compressors.topk(0.01), grouping=rules, intra="2d", intra_layers="embed"
    )
    adam = optax.adam(1e-3)
    m = rr.memory.model_state_bytes(_params(), optax.chain(reduced, adam))
    # One shared [100, 200] residual; the embedding keeps rows x cols = 500 x 50 values and
    # their int32 indices (rows are vocabulary entries for a table).
    assert m.residuals == KERNEL * F32 + (500 * 50) * F32 + (500 + 50) * 4
    assert m.optimizer == 2 * PARAMS * F32 + 4 + 4  # mu, nu, adam count, resireduce count

    bf16 = rr.resireduce(
        rr.compressors.topk(0.01),
        grouping=rules,
        intra="2d",
        intra_layers="embed",
        residual_dtype="bfloat16",
    )
    m16 = rr.memory.model_state_bytes(_params(), optax.chain(bf16, adam))
    assert m16.residuals == KERNEL * 2 + 500 * 50 * 2 + (500 + 50) * 4


def test_comparison_saving_and_table():
    base = optax.chain(rr.error_feedback(rr.compressors.topk(0.01)), optax.sgd(0.1, momentum=0.9))
    reduced = optax.chain(
        rr.resireduce(rr.compressors.topk(0.01), intra="none"), optax.sgd(0.1, momentum=0.9)
    )
    cmp = rr.memory.compare(_params(), reduced, base)
    saved = 2 * KERNEL * F32  # auto() groups the three block kernels
    assert cmp.baseline.total - cmp.reduced.total == saved
    np.testing.assert_allclose(cmp.saving, saved / cmp.baseline.total)
    text = str(cmp)
    assert "residuals" in text and f"{cmp.saving:.1%} saved" in text


def test_compressor_state_is_its_own_category():
    class WithState(rr.compressors.TopK):
        def init(self, like):
            return np.zeros((like.shape[0], 4), np.float32)

    tx = rr.error_feedback(WithState(0.01))
    m = rr.memory.model_state_bytes(_params(), tx)
    assert m.compressor == (3 * 100 + 1000) * 4 * F32


def test_the_table_gives_kib_where_mib_would_round_to_zero():
    """A 64 x 64 float32 kernel is 16 KiB: "16.0 KiB", not "0.0 MiB"; a 1024 x 1024
    one 4 MiB."""
    tx = optax.chain(rr.error_feedback(rr.compressors.topk(0.01)), optax.sgd(0.1))
    small = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    assert "params      16.0 KiB" in str(rr.memory.compare(small, tx, tx))
    large = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    assert "params      4.0 MiB" in str(rr.memory.compare(large, tx, tx))
