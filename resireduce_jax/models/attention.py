"""Scaled dot-product attention shared by the transformer models (GPT-2, BERT, ViT).

Vaswani et al., "Attention Is All You Need" (2017), §3.2.1:
``softmax(Q Kᵀ / sqrt(d_k)) V``, computed per head. The projections around it (fused
``c_attn``/``qkv`` or separate ``query``/``key``/``value``) belong to each model, so that
their parameter names follow the reference implementations; dropout on the attention
probabilities is applied by the caller between :func:`attention_probabilities` and
:func:`attend`.

Arrays are laid out ``[batch, length, heads, head_dim]``. Logits and the softmax are
computed in float32 whatever the computation dtype, then cast back.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = [
    "attend",
    "attention_probabilities",
    "causal_mask",
    "merge_heads",
    "padding_mask",
    "split_heads",
]


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
    """``[batch, length, width]`` -> ``[batch, length, num_heads, width // num_heads]``."""
    *lead, width = x.shape
    return x.reshape(*lead, num_heads, width // num_heads)


def merge_heads(x: jax.Array) -> jax.Array:
    """``[batch, length, heads, head_dim]`` -> ``[batch, length, heads * head_dim]``."""
    *lead, heads, head_dim = x.shape
    return x.reshape(*lead, heads * head_dim)


def causal_mask(length: int) -> jax.Array:
    """Boolean ``[1, 1, length, length]``: query ``i`` may attend to keys ``j <= i``."""
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def padding_mask(attention_mask: jax.Array) -> jax.Array:
    """``[batch, length]`` of 1 (token) / 0 (padding) -> boolean ``[batch, 1, 1, length]``."""
    return (attention_mask > 0)[:, None, None, :]


def attention_probabilities(
    query: jax.Array, key: jax.Array, mask: jax.Array | None = None
) -> jax.Array:
    """``softmax(q kᵀ / sqrt(head_dim))`` over keys, as ``[batch, heads, q_len, k_len]``.

    Args:
      query: ``[batch, q_len, heads, head_dim]``.
      key: ``[batch, k_len, heads, head_dim]``.
      mask: boolean, broadcastable to ``[batch, heads, q_len, k_len]``; ``False`` entries
        get (numerically) zero probability. A query whose keys are all masked gets uniform
        probabilities rather than NaN.

    Returns:
      Attention probabilities in ``query.dtype``.
    """
    scale = 1.0 / math.sqrt(query.shape[-1])
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key).astype(jnp.float32) * scale
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(logits, axis=-1).astype(query.dtype)


def attend(probabilities: jax.Array, value: jax.Array) -> jax.Array:
    """Weighted sum of values: ``[b, h, q, k] x [b, k, h, d]`` -> ``[b, q, h * d]``."""
    return merge_heads(jnp.einsum("bhqk,bkhd->bqhd", probabilities, value))
