"""BERT encoder with a SQuAD span-prediction head (start and end logits per token).

Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for Language
Understanding", NAACL 2019 (https://arxiv.org/abs/1810.04805), §3 and §4.2.
Post-LayerNorm transformer layers; a linear qa_outputs gives a start and an end logit.
Parameter names follow Hugging Face's BertModel; kernels are Flax's [in, out].
With scan_layers=True the layers are one nn.scan named encoder/layer.
attention_mask is 1 for real tokens; token_type_ids is 1 for the context.
Sizes, names and a calling example: docs/design.md, "BERT (models/bert.py)".
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from resireduce_jax.models import attention, scan
from resireduce_jax.models.config import ModelConfig, check_batch_size, dense, layer_norm

__all__ = [
    "Attention",
    "BertConfig",
    "BertForQuestionAnswering",
    "Embeddings",
    "Encoder",
    "Intermediate",
    "Layer",
    "ResidualOutput",
    "SelfAttention",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BertConfig(ModelConfig):
    """Hyperparameters of BERT for question answering (defaults: BERT-base, SQuAD length 384).

    Attributes:
      vocab_size: WordPiece vocabulary size.
      max_len: number of learned positions (``max_position_embeddings``).
      type_vocab_size: number of segment types.
      num_layers: transformer layers.
      width: hidden size.
      num_heads: attention heads; must divide ``width``.
      mlp_dim: intermediate size; ``None`` means ``4 * width``.
      dropout_rate: dropout on embeddings and on each sub-layer's output
        (``hidden_dropout_prob``).
      attention_dropout_rate: dropout on attention probabilities
        (``attention_probs_dropout_prob``).
      layer_norm_epsilon: LayerNorm epsilon.
      initializer_range: std of the truncated-normal initializer.
      seq_len: length of :meth:`example_batch` sequences (384 = the usual SQuAD
        ``max_seq_length``); at most ``max_len``.
    """

    vocab_size: int = 30522
    max_len: int = 512
    type_vocab_size: int = 2
    num_layers: int = 12
    width: int = 768
    num_heads: int = 12
    mlp_dim: int | None = None
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-12
    initializer_range: float = 0.02
    seq_len: int = 384

    task: ClassVar[str] = "span_qa"
    input_names: ClassVar[tuple[str, ...]] = ("input_ids", "token_type_ids", "attention_mask")
    target_names: ClassVar[tuple[str, ...]] = ("start_positions", "end_positions")
    rng_names: ClassVar[tuple[str, ...]] = ("dropout",)
    layer_scope: ClassVar[str] = "encoder/layer"

    def validate(self) -> None:
        self._require_positive(
            "vocab_size",
            "max_len",
            "type_vocab_size",
            "num_layers",
            "width",
            "num_heads",
            "mlp_dim",
            "seq_len",
        )
        self._require_divisible("width", "num_heads")
        self._require_rate("dropout_rate", "attention_dropout_rate")
        if self.seq_len > self.max_len:
            raise ValueError(
                f"BertConfig.seq_len={self.seq_len} exceeds max_len={self.max_len}; "
                "raise max_len or shorten the sequences."
            )

    @property
    def hidden_dim(self) -> int:
        """Width of the intermediate (feed-forward) layer."""
        return self.mlp_dim or 4 * self.width

    def build(self) -> BertForQuestionAnswering:
        return BertForQuestionAnswering(self)

    def example_batch(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        """int32 ``input_ids``, ``token_type_ids``, ``attention_mask`` ``[batch, seq_len]``
        and the answer span's ``start_positions`` / ``end_positions`` ``[batch]``."""
        check_batch_size(batch_size)
        tokens = jax.ShapeDtypeStruct((batch_size, self.seq_len), jnp.int32)
        positions = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
        return {
            "input_ids": tokens,
            "token_type_ids": tokens,
            "attention_mask": tokens,
            "start_positions": positions,
            "end_positions": positions,
        }


def _dense(config: BertConfig, features: int, name: str) -> nn.Dense:
    return dense(config, features, name, nn.initializers.truncated_normal(config.initializer_range))


class Embeddings(nn.Module):
    """Sum of word, position and token-type embeddings, then LayerNorm and dropout."""

    config: BertConfig

    @nn.compact
    def __call__(
        self, input_ids: jax.Array, token_type_ids: jax.Array, *, train: bool = False
    ) -> jax.Array:
        c = self.config

        def table(rows: int, name: str) -> nn.Embed:
            return nn.Embed(
                rows,
                c.width,
                embedding_init=nn.initializers.truncated_normal(c.initializer_range),
                dtype=c.dtype,
                param_dtype=c.param_dtype,
                name=name,
            )

        positions = jnp.arange(input_ids.shape[1])[None, :]
        x = (
            table(c.vocab_size, "word_embeddings")(input_ids)
            + table(c.max_len, "position_embeddings")(positions)
            + table(c.type_vocab_size, "token_type_embeddings")(token_type_ids)
        )
        x = layer_norm(c, "LayerNorm")(x)
        return nn.Dropout(c.dropout_rate)(x, deterministic=not train)


class SelfAttention(nn.Module):
    """Multi-head attention with separate ``query``, ``key``, ``value`` projections.

    Returns the concatenated heads ``[batch, length, width]`` (before the output dense).
    """

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None, *, train: bool = False) -> jax.Array:
        c = self.config
        query, key, value = (
            attention.split_heads(_dense(c, c.width, name)(x), c.num_heads)
            for name in ("query", "key", "value")
        )
        probs = attention.attention_probabilities(query, key, mask)
        probs = nn.Dropout(c.attention_dropout_rate)(probs, deterministic=not train)
        return attention.attend(probs, value)


class ResidualOutput(nn.Module):
    """``LayerNorm(residual + dropout(dense(x)))``: HF's ``BertSelfOutput`` / ``BertOutput``."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array, *, train: bool = False) -> jax.Array:
        c = self.config
        x = nn.Dropout(c.dropout_rate)(_dense(c, c.width, "dense")(x), deterministic=not train)
        return layer_norm(c, "LayerNorm")(residual + x)


class Attention(nn.Module):
    """``self`` (the attention) followed by ``output`` (dense, dropout, residual, LayerNorm)."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None, *, train: bool = False) -> jax.Array:
        context = SelfAttention(self.config, name="self")(x, mask, train=train)
        return ResidualOutput(self.config, name="output")(context, x, train=train)


class Intermediate(nn.Module):
    """``gelu(dense(x))`` with the erf form of GELU, as in BERT."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(
            _dense(self.config, self.config.hidden_dim, "dense")(x), approximate=False
        )


class Layer(nn.Module):
    """One post-LN BERT layer: ``attention``, ``intermediate``, ``output``.

    Maps ``[batch, length, width]`` (and an optional boolean attention mask broadcastable
    to ``[batch, heads, length, length]``, see :func:`attention.padding_mask`) to
    ``[batch, length, width]``; usable on its own as a stage of a chain.
    """

    config: BertConfig

    @nn.compact
    def __call__(
        self, x: jax.Array, mask: jax.Array | None = None, *, train: bool = False
    ) -> jax.Array:
        x = Attention(self.config, name="attention")(x, mask, train=train)
        h = Intermediate(self.config, name="intermediate")(x)
        return ResidualOutput(self.config, name="output")(h, x, train=train)


class Encoder(nn.Module):
    """The stack of ``layer_{i}``, or one scanned ``layer`` with ``scan_layers=True``."""

    config: BertConfig

    @nn.compact
    def __call__(
        self, x: jax.Array, mask: jax.Array | None = None, *, train: bool = False
    ) -> jax.Array:
        c = self.config
        if c.scan_layers:
            return scan.apply_layers(Layer(c, name="layer"), x, c.num_layers, mask, train=train)
        for i in range(c.num_layers):
            x = Layer(c, name=f"layer_{i}")(x, mask, train=train)
        return x


class BertForQuestionAnswering(nn.Module):
    """BERT with a span head; returns float32 ``(start_logits, end_logits)``, ``[batch, len]``."""

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        train: bool = False,
    ) -> tuple[jax.Array, jax.Array]:
        c = self.config
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(
                f"BERT expects integer input_ids of shape [batch, length], got "
                f"{input_ids.dtype}{list(input_ids.shape)}."
            )
        if input_ids.shape[1] > c.max_len:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} exceeds the {c.max_len} learned "
                "positions; truncate the inputs (SQuAD uses a sliding window of 384)."
            )
        for name, value in (("token_type_ids", token_type_ids), ("attention_mask", attention_mask)):
            if value is not None and value.shape != input_ids.shape:
                raise ValueError(
                    f"{name} has shape {list(value.shape)}, but input_ids has "
                    f"{list(input_ids.shape)}; they must match."
                )
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        mask = None if attention_mask is None else attention.padding_mask(attention_mask)
        x = Embeddings(c, name="embeddings")(input_ids, token_type_ids, train=train)
        x = Encoder(c, name="encoder")(x, mask, train=train)
        logits = _dense(c, 2, "qa_outputs")(x).astype(jnp.float32)
        return logits[..., 0], logits[..., 1]
