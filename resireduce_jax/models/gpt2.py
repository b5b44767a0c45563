"""GPT-2: a decoder-only, pre-LayerNorm transformer language model with a tied LM head.

Radford et al., "Language Models are Unsupervised Multitask Learners", 2019, §2.3.
LayerNorm sits at each sub-block's input; the output projection shares wte's weights.
Parameter names follow OpenAI's code and Hugging Face's GPT2LMHeadModel.
With scan_layers=True the blocks are one nn.scan named h, each leaf with a layer axis.
Position t's logits predict token t + 1.
Sizes, names and a calling example: docs/design.md, "GPT-2 (models/gpt2.py)".
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from resireduce_jax.models import attention, scan
from resireduce_jax.models.config import (
    ChainStage,
    ModelConfig,
    check_batch_size,
    dense,
    layer_norm,
)

__all__ = ["GPT2", "MLP", "Attention", "Block", "Embedding", "GPT2Config", "Head", "chain_stages"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config(ModelConfig):
    """Hyperparameters of GPT-2 (defaults: GPT-2 small).

    Attributes:
      vocab_size: number of token ids (50,257 for GPT-2's BPE, 256 for bytes).
      max_len: number of learned positions (``n_positions``); inputs may be shorter.
      num_layers: number of transformer blocks.
      width: model width (``n_embd``).
      num_heads: attention heads; must divide ``width``.
      mlp_dim: hidden width of the MLP; ``None`` means ``4 * width``.
      dropout_rate: dropout on the embeddings and on each sub-block's output
        (``embd_pdrop`` / ``resid_pdrop``).
      attention_dropout_rate: dropout on the attention probabilities (``attn_pdrop``).
      layer_norm_epsilon: LayerNorm epsilon.
      initializer_range: std of the normal initializer of weights and embeddings.
      seq_len: length of :meth:`example_batch` sequences; ``None`` means ``max_len``.
    """

    vocab_size: int = 50257
    max_len: int = 1024
    num_layers: int = 12
    width: int = 768
    num_heads: int = 12
    mlp_dim: int | None = None
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    seq_len: int | None = None

    task: ClassVar[str] = "causal_lm"
    input_names: ClassVar[tuple[str, ...]] = ("tokens",)
    target_names: ClassVar[tuple[str, ...]] = ("targets",)
    rng_names: ClassVar[tuple[str, ...]] = ("dropout",)
    layer_scope: ClassVar[str] = "h"

    def validate(self) -> None:
        self._require_positive(
            "vocab_size", "max_len", "num_layers", "width", "num_heads", "mlp_dim", "seq_len"
        )
        self._require_divisible("width", "num_heads")
        self._require_rate("dropout_rate", "attention_dropout_rate")
        if self.seq_len is not None and self.seq_len > self.max_len:
            raise ValueError(
                f"GPT2Config.seq_len={self.seq_len} exceeds max_len={self.max_len}; "
                "raise max_len or shorten the sequences."
            )

    @property
    def hidden_dim(self) -> int:
        """Width of the MLP's hidden layer."""
        return self.mlp_dim or 4 * self.width

    @property
    def sequence_length(self) -> int:
        """Length of :meth:`example_batch` sequences."""
        return self.seq_len or self.max_len

    def build(self) -> GPT2:
        return GPT2(self)

    def chain_stages(self) -> list[ChainStage]:
        return chain_stages(self)

    def example_batch(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        """``tokens`` and next-token ``targets``, both int32 ``[batch, seq_len]``."""
        check_batch_size(batch_size)
        shape = (batch_size, self.sequence_length)
        return {
            "tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
            "targets": jax.ShapeDtypeStruct(shape, jnp.int32),
        }


def _dense(config: GPT2Config, features: int, name: str, std: float) -> nn.Dense:
    return dense(config, features, name, nn.initializers.normal(std))


def _residual_std(config: GPT2Config) -> float:
    # Radford et al. 2019, §2.3: residual-path weights scaled by 1/sqrt(N), N = 2 * layers.
    return config.initializer_range / math.sqrt(2 * config.num_layers)


class Attention(nn.Module):
    """Causal multi-head self-attention: ``c_attn`` (fused q/k/v) then ``c_proj``."""

    config: GPT2Config

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        c = self.config
        qkv = _dense(c, 3 * c.width, "c_attn", c.initializer_range)(x)
        query, key, value = (
            attention.split_heads(part, c.num_heads) for part in jnp.split(qkv, 3, axis=-1)
        )
        probs = attention.attention_probabilities(query, key, attention.causal_mask(x.shape[-2]))
        probs = nn.Dropout(c.attention_dropout_rate)(probs, deterministic=not train)
        out = _dense(c, c.width, "c_proj", _residual_std(c))(attention.attend(probs, value))
        return nn.Dropout(c.dropout_rate)(out, deterministic=not train)


class MLP(nn.Module):
    """``c_fc`` -> GELU (tanh approximation, as in GPT-2) -> ``c_proj``."""

    config: GPT2Config

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        c = self.config
        h = _dense(c, c.hidden_dim, "c_fc", c.initializer_range)(x)
        h = jax.nn.gelu(h, approximate=True)
        out = _dense(c, c.width, "c_proj", _residual_std(c))(h)
        return nn.Dropout(c.dropout_rate)(out, deterministic=not train)


class Block(nn.Module):
    """One pre-LN GPT-2 block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    Maps ``[batch, length, width]`` to the same shape; usable on its own as a stage of a
    chain (e.g. for rematerialization), with the parameter names ``ln_1``, ``attn``,
    ``ln_2``, ``mlp``.
    """

    config: GPT2Config

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        x = x + Attention(self.config, name="attn")(layer_norm(self.config, "ln_1")(x), train=train)
        return x + MLP(self.config, name="mlp")(layer_norm(self.config, "ln_2")(x), train=train)


def _embedding(c: GPT2Config, rows: int, name: str) -> nn.Embed:
    return nn.Embed(
        rows,
        c.width,
        embedding_init=nn.initializers.normal(c.initializer_range),
        dtype=c.dtype,
        param_dtype=c.param_dtype,
        name=name,
    )


def _token_embedding(c: GPT2Config) -> nn.Embed:
    """``wte``: the token embedding, also the (tied) output projection."""
    return _embedding(c, c.vocab_size, "wte")


def _embed(c: GPT2Config, wte: nn.Embed, tokens: jax.Array, train: bool) -> jax.Array:
    """Token and position embeddings, then dropout, in the caller's scope."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"GPT2 expects integer token ids of shape [batch, length], got "
            f"{tokens.dtype}{list(tokens.shape)}."
        )
    length = tokens.shape[1]
    if length > c.max_len:
        raise ValueError(
            f"sequence length {length} exceeds the {c.max_len} learned positions; "
            "pass shorter sequences or build the model with a larger max_len."
        )
    wpe = _embedding(c, c.max_len, "wpe")
    x = wte(tokens) + wpe(jnp.arange(length)[None, :])
    return nn.Dropout(c.dropout_rate)(x, deterministic=not train)


def _head(c: GPT2Config, wte: nn.Embed, x: jax.Array) -> jax.Array:
    """``ln_f``, then the tied projection ``wte.attend``; float32 logits."""
    return wte.attend(layer_norm(c, "ln_f")(x)).astype(jnp.float32)


class Embedding(nn.Module):
    """The embedding as a chain stage: token ids to activations (``wte``, ``wpe``)."""

    config: GPT2Config

    @nn.compact
    def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
        return _embed(self.config, _token_embedding(self.config), tokens, train)


class Head(nn.Module):
    """The head as a chain stage: ``ln_f`` and the projection by ``wte`` (tied)."""

    config: GPT2Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return _head(self.config, _token_embedding(self.config), x)


def chain_stages(config: GPT2Config) -> list[ChainStage]:
    """:class:`Embedding`, the blocks ``h_{i}``, :class:`Head`; both ends hold ``wte``.

    Raises:
      ValueError: for a model scanned over its blocks (``scan_layers=True``): its blocks
        are one scanned stage, and rotor does not plan inside a scan.
    """
    if config.scan_layers:
        raise ValueError(
            "GPT-2 with scan_layers=True applies its blocks as one nn.scan: rotor does not "
            "plan checkpoints inside a scan, so the model has no chain of stages; train it "
            "without remat (or with scan_layers=False for a rotor plan)."
        )
    return [
        ChainStage(Embedding(config), names=("wte", "wpe")),
        *(ChainStage(Block(config), scope=f"h_{i}") for i in range(config.num_layers)),
        ChainStage(Head(config), names=("ln_f", "wte")),
    ]


class GPT2(nn.Module):
    """GPT-2 language model; returns float32 next-token logits ``[batch, length, vocab]``."""

    config: GPT2Config

    @nn.compact
    def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
        c = self.config
        wte = _token_embedding(c)
        x = _embed(c, wte, tokens, train)
        if c.scan_layers:
            x = scan.apply_layers(Block(c, name="h"), x, c.num_layers, train=train)
        else:
            for i in range(c.num_layers):
                x = Block(c, name=f"h_{i}")(x, train=train)
        return _head(c, wte, x)
