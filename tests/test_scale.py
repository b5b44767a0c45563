"""Bookkeeping at scale: byte accounting and grouping of a 7B LLaMA-2, init of 2,048 leaves.

Everything here works on shapes (``jax.ShapeDtypeStruct``); nothing parameter-sized is
allocated. The figures are checked against hand-derived counts; the time bounds are
generous hang guards (measured timings: ``benchmarks/results/reliability.md``).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax

import resireduce_jax as rr

# LLaMA-2 7B (Touvron et al. 2023, Table 1 / the released config): 32 layers, d = 4096,
# SwiGLU MLP 11008, vocabulary 32000, untied output head, RMSNorm scales only.
LAYERS, D, MLP, VOCAB = 32, 4096, 11008, 32000
LLAMA2_7B_PARAMETERS = 6_738_415_616  # the published count
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GENEROUS_S = 60.0


def llama2_7b(dtype=jnp.float32) -> dict:
    """Abstract LLaMA-2 7B params with Hugging Face's module names (Flax [in, out] kernels)."""
    f = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)

    def layer():
        return {
            "self_attn": {name: {"kernel": f(D, D)} for name in ATTENTION},
            "mlp": {
                "gate_proj": {"kernel": f(D, MLP)},
                "up_proj": {"kernel": f(D, MLP)},
                "down_proj": {"kernel": f(MLP, D)},
            },
            "input_layernorm": {"scale": f(D)},
            "post_attention_layernorm": {"scale": f(D)},
        }

    params = {
        "embed_tokens": {"embedding": f(VOCAB, D)},
        "norm": {"scale": f(D)},
        "lm_head": {"kernel": f(D, VOCAB)},
    }
    params.update({f"layers_{i}": layer() for i in range(LAYERS)})
    return params


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    elapsed = time.perf_counter() - start
    assert elapsed < GENEROUS_S, f"{fn.__name__} took {elapsed:.1f} s"
    return out, elapsed


def test_llama2_7b_model_states_and_groups_from_shapes():
    params = llama2_7b()
    n = sum(x.size for x in jax.tree.leaves(params))
    assert n == LLAMA2_7B_PARAMETERS
    norms = 2 * LAYERS + 1  # 1-D: travel dense, no residual
    matrices = n - norms * D

    reduced = optax.chain(rr.resireduce(rr.compressors.topk(0.01)), optax.adamw(1e-4))
    baseline = optax.chain(rr.error_feedback(rr.compressors.topk(0.01)), optax.adamw(1e-4))
    comparison, _ = timed(rr.memory.compare, params, reduced, baseline)

    # Auto grouping: each of the 7 per-layer roles in runs of 3 layers: 32 = 10 x 3 + 2,
    # so 11 residuals instead of 32; embedding and head stay singletons (each 1.9 % of
    # the compressed elements, under the 10 % of intra="2d"'s auto rule).
    per_layer = len(ATTENTION) * D * D + 3 * D * MLP
    grouped = 11 * per_layer + 2 * VOCAB * D
    assert comparison.baseline.residuals == 4 * matrices
    assert comparison.reduced.residuals == 4 * grouped
    for states in (comparison.baseline, comparison.reduced):
        assert states.params == states.grads == 4 * n
        assert 8 * n <= states.optimizer <= 8 * n + 64  # AdamW's mu and nu, and counters
    assert abs(comparison.saving - 4 * (matrices - grouped) / comparison.baseline.total) < 1e-12

    report, _ = timed(rr.grouping.report, params, rr.grouping.auto())
    assert len(report.rows) == 7 * 11 + 2
    assert sum(r["members"] > 1 for r in report.rows) == 7 * 11
    assert report.residual_bytes_grouped == 4 * grouped
    assert report.residual_bytes_per_leaf == 4 * matrices
    assert report.dense_leaves == norms


def many_leaves(blocks: int = 256, width: int = 64) -> dict:
    """``blocks`` residual blocks of 8 leaves (3 kernels, 3 biases, a norm): 2,048 leaves."""
    f = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    return {
        f"block_{i}": {
            "attn": {"kernel": f(width, width), "bias": f(width)},
            "mlp": {"kernel": f(width, 4 * width), "bias": f(4 * width)},
            "out": {"kernel": f(4 * width, width), "bias": f(width)},
            "norm": {"scale": f(width), "bias": f(width)},
        }
        for i in range(blocks)
    }


def test_init_of_2048_leaves_compiles_in_bounded_time():
    params = many_leaves()
    assert len(jax.tree.leaves(params)) == 2048
    tx = rr.skip_nonfinite(
        optax.chain(
            rr.resireduce(rr.compressors.topk(0.01), min_size=1000),
            optax.sgd(0.1, momentum=0.9),
        )
    )
    timed(lambda p: jax.jit(tx.init).lower(p).compile(), params)
    state = jax.eval_shape(tx.init, params)
    residuals = state.inner[0].residuals
    # 3 kernel roles x 256 blocks; groups of 3 consecutive blocks: 85 groups and one
    # leftover block that keeps its own residual, per role.
    assert len(residuals) == 3 * 86
    assert sum(1 for label in residuals if label.endswith("#85")) == 0
    assert len(jax.tree.leaves(state.inner[1])) == 2048  # one momentum buffer per leaf
