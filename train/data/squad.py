"""SQuAD v1.1 extractive question answering: BERT WordPiece features and F1 / exact match.

Devlin et al., BERT (https://arxiv.org/abs/1810.04805), §4.2; features as run_squad.py.
Each context window becomes one feature: [CLS] question [SEP] window [SEP], padded.
Labels are the gold answer's first and last token; a window without it points at [CLS].
Tokens keep their character offsets, so a predicted span maps back to context text.
Scoring uses the official SQuAD v1.1 normalization, best F1 and exact match over answers.
The windows, labels and scoring: docs/design.md, "SQuAD features (train/data/squad.py)".
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import re
import string
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from train.data import cache, sampling, tfds_sources
from train.data.base import Batch, Dataset

__all__ = [
    "SquadDataset",
    "SquadExample",
    "WordPieceTokenizer",
    "best_spans",
    "build_features",
    "exact_match_score",
    "f1_score",
    "normalize_answer",
]

BERT_VOCAB_HELP = (
    "Download the bert-base-uncased vocabulary "
    "(https://huggingface.co/google-bert/bert-base-uncased/resolve/main/vocab.txt, or "
    "vocab.txt inside Google's uncased_L-12_H-768_A-12.zip) and set dataset.vocab_file "
    "to its path."
)

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


# --------------------------------------------------------------------------- metrics


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalization: lower-case, drop punctuation and articles, squeeze spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match_score(prediction: str, truth: str) -> float:
    """1.0 when the normalized strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(truth))


def f1_score(prediction: str, truth: str) -> float:
    """Harmonic mean of token precision and recall between the normalized strings."""
    predicted = normalize_answer(prediction).split()
    gold = normalize_answer(truth).split()
    shared = sum((collections.Counter(predicted) & collections.Counter(gold)).values())
    if shared == 0:
        return 0.0
    precision = shared / len(predicted)
    recall = shared / len(gold)
    return 2 * precision * recall / (precision + recall)


def best_spans(
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    valid: np.ndarray,
    max_answer_length: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The highest-scoring valid span of every row.

    A span ``(i, j)`` is valid when ``i <= j``, ``j - i < max_answer_length`` and both
    tokens are context tokens (``valid``); its score is ``start_logits[i] +
    end_logits[j]``. The search is exhaustive over valid spans.

    Args:
      start_logits: ``[B, T]``.
      end_logits: ``[B, T]``.
      valid: ``[B, T]`` bool, context tokens.
      max_answer_length: longest span in tokens.

    Returns:
      ``(scores, starts, ends)``, each ``[B]``; rows without a valid span score ``-inf``.
    """
    start_logits = np.asarray(start_logits).astype(np.float64)
    end_logits = np.asarray(end_logits).astype(np.float64)
    valid = np.asarray(valid, dtype=bool)
    rows, length = start_logits.shape
    width = max_answer_length
    end_padded = np.concatenate([end_logits, np.zeros((rows, width - 1))], axis=1)
    valid_padded = np.concatenate([valid, np.zeros((rows, width - 1), dtype=bool)], axis=1)
    scores = start_logits[:, :, None] + sliding_window_view(end_padded, width, axis=1)
    allowed = valid[:, :, None] & sliding_window_view(valid_padded, width, axis=1)
    scores = np.where(allowed, scores, -np.inf).reshape(rows, length * width)
    flat = scores.argmax(axis=1)
    starts, offsets = np.divmod(flat, width)
    return scores[np.arange(rows), flat], starts, starts + offsets


# ----------------------------------------------------------------------- tokenization


class WordPieceTokenizer:
    """BERT WordPiece from a standard ``vocab.txt``, with character offsets.

    Args:
      vocab_file: one token per line; must contain ``[PAD] [UNK] [CLS] [SEP]``.
      lowercase: lower-case and strip accents first (True for ``bert-base-uncased``).
    """

    def __init__(self, vocab_file: str, *, lowercase: bool = True):
        if not vocab_file or not os.path.isfile(os.path.expanduser(vocab_file)):
            raise FileNotFoundError(
                f"WordPiece vocabulary dataset.vocab_file={vocab_file!r} does not exist. "
                + BERT_VOCAB_HELP
            )
        vocab_file = os.path.expanduser(vocab_file)
        try:
            from tokenizers import BertWordPieceTokenizer
        except ImportError as err:
            raise ImportError(
                "SQuAD features use the 'tokenizers' package for BERT WordPiece: "
                "pip install tokenizers."
            ) from err
        with open(vocab_file, "rb") as f:
            content = f.read()
        self.fingerprint = hashlib.sha256(content).hexdigest()
        self.lowercase = bool(lowercase)
        self._tokenizer = BertWordPieceTokenizer(vocab_file, lowercase=self.lowercase)
        self.vocab_size = self._tokenizer.get_vocab_size()
        ids = {}
        for token in ("[PAD]", "[UNK]", "[CLS]", "[SEP]"):
            ids[token] = self._tokenizer.token_to_id(token)
            if ids[token] is None:
                raise ValueError(
                    f"{vocab_file} has no {token} token; it is not a BERT vocab.txt. "
                    + BERT_VOCAB_HELP
                )
        self.pad_id, self.cls_id, self.sep_id = ids["[PAD]"], ids["[CLS]"], ids["[SEP]"]

    def encode(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(ids [n], offsets [n, 2])`` per text, without special tokens."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [
            (
                np.asarray(e.ids, dtype=np.int64),
                np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2),
            )
            for e in encodings
        ]


# ------------------------------------------------------------------- feature creation


@dataclasses.dataclass(frozen=True)
class SquadExample:
    """One question about one context, with its gold answers (text and character start)."""

    question: str
    context: str
    answers: tuple[str, ...]
    answer_starts: tuple[int, ...]

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> SquadExample:
        """From a tfds ``squad`` record (text as ``str`` or ``bytes``)."""
        answers = record["answers"]
        texts = tuple(tfds_sources.text_of(t) for t in np.asarray(answers["text"]).ravel())
        starts = tuple(int(s) for s in np.asarray(answers["answer_start"]).ravel())
        return cls(
            question=tfds_sources.text_of(record["question"]),
            context=tfds_sources.text_of(record["context"]),
            answers=texts,
            answer_starts=starts[: len(texts)],
        )

    def answer_char_span(self) -> tuple[int, int] | None:
        """``[start, end)`` of the first answer in the context, or None if it is not there.

        The context text at the offset must equal the answer up to whitespace.
        """
        if not self.answers or not self.answer_starts:
            return None
        text, start = self.answers[0], self.answer_starts[0]
        end = start + len(text)
        if start < 0 or end > len(self.context):
            return None
        if " ".join(self.context[start:end].split()) != " ".join(text.split()):
            return None
        return start, end


def _windows(num_tokens: int, max_tokens: int, stride: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the context windows (at least one, even for no tokens)."""
    windows = []
    start = 0
    while True:
        length = min(num_tokens - start, max_tokens)
        windows.append((start, length))
        if start + length >= num_tokens:
            return windows
        start += min(length, stride)


def build_features(
    examples: Iterable[SquadExample],
    tokenizer: WordPieceTokenizer,
    *,
    context_length: int,
    doc_stride: int,
    max_query_length: int,
    drop_unanswerable: bool,
    batch_examples: int = 1024,
) -> dict[str, np.ndarray]:
    """Turns examples into fixed-length features (docs/design.md, "SQuAD features").

    Args:
      examples: the examples, in order; their position is their ``example_index``.
      tokenizer: the WordPiece tokenizer.
      context_length: tokens per feature, ``T``.
      doc_stride: tokens between the starts of consecutive context windows.
      max_query_length: question tokens kept.
      drop_unanswerable: drop examples whose first answer is not at its offset (train).
      batch_examples: examples tokenized per call to the tokenizer.

    Returns:
      ``input_ids [F, T]`` (pad id after the sequence), ``question_length [F]``,
      ``sequence_length [F]`` (tokens before padding), ``start_positions [F]``,
      ``end_positions [F]``, ``example_index [F]``, ``context_offsets [F, T, 2]``
      (character ``[start, end)`` of context tokens, -1 elsewhere), and
      ``num_skipped`` (a 0-d array: examples dropped).
    """
    if context_length < max_query_length + 4:
        raise ValueError(
            f"context_length={context_length} leaves no room for the context after a "
            f"question of up to max_query_length={max_query_length} tokens and 3 special "
            "tokens; increase context_length or decrease max_query_length."
        )
    id_dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
    columns: dict[str, list] = collections.defaultdict(list)
    skipped = 0
    for first_index, chunk in _chunks(examples, batch_examples):
        questions = tokenizer.encode([e.question for e in chunk])
        contexts = tokenizer.encode([e.context for e in chunk])
        for offset, example in enumerate(chunk):
            answer = example.answer_char_span()
            if answer is None and drop_unanswerable:
                skipped += 1
                continue
            question_ids = questions[offset][0][:max_query_length]
            context_ids, context_offsets = contexts[offset]
            answer_tokens = None
            if answer is not None and len(context_ids):
                first = int(np.searchsorted(context_offsets[:, 1], answer[0], side="right"))
                last = int(np.searchsorted(context_offsets[:, 0], answer[1], side="left")) - 1
                if first <= last:
                    answer_tokens = (first, last)
            if answer_tokens is None and drop_unanswerable:
                skipped += 1
                continue
            prefix = len(question_ids) + 2
            for start, length in _windows(
                len(context_ids), context_length - prefix - 1, doc_stride
            ):
                ids = np.full(context_length, tokenizer.pad_id, dtype=id_dtype)
                ids[0] = tokenizer.cls_id
                ids[1 : prefix - 1] = question_ids
                ids[prefix - 1] = tokenizer.sep_id
                ids[prefix : prefix + length] = context_ids[start : start + length]
                ids[prefix + length] = tokenizer.sep_id
                offsets = np.full((context_length, 2), -1, dtype=np.int32)
                offsets[prefix : prefix + length] = context_offsets[start : start + length]
                start_position = end_position = 0
                if answer_tokens is not None and (
                    start <= answer_tokens[0] and answer_tokens[1] < start + length
                ):
                    start_position = answer_tokens[0] - start + prefix
                    end_position = answer_tokens[1] - start + prefix
                columns["input_ids"].append(ids)
                columns["context_offsets"].append(offsets)
                columns["question_length"].append(len(question_ids))
                columns["sequence_length"].append(prefix + length + 1)
                columns["start_positions"].append(start_position)
                columns["end_positions"].append(end_position)
                columns["example_index"].append(first_index + offset)
    features = {
        "input_ids": np.stack(columns["input_ids"])
        if columns["input_ids"]
        else np.zeros((0, context_length), id_dtype),
        "context_offsets": np.stack(columns["context_offsets"])
        if columns["context_offsets"]
        else np.zeros((0, context_length, 2), np.int32),
    }
    for name in (
        "question_length",
        "sequence_length",
        "start_positions",
        "end_positions",
        "example_index",
    ):
        features[name] = np.asarray(columns[name], dtype=np.int32)
    features["num_skipped"] = np.asarray(skipped, dtype=np.int64)
    return features


def _chunks(items: Iterable[Any], size: int) -> Iterator[tuple[int, list[Any]]]:
    chunk: list[Any] = []
    first = 0
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield first, chunk
            first += size
            chunk = []
    if chunk:
        yield first, chunk


def feature_rows(features: Mapping[str, np.ndarray], indices: np.ndarray) -> Batch:
    """Model inputs and labels of features ``indices`` (int32 arrays)."""
    positions = np.arange(features["input_ids"].shape[1])
    question_length = np.asarray(features["question_length"][indices])[:, None]
    sequence_length = np.asarray(features["sequence_length"][indices])[:, None]
    return {
        "input_ids": np.asarray(features["input_ids"][indices], dtype=np.int32),
        "token_type_ids": (
            (positions >= question_length + 2) & (positions < sequence_length)
        ).astype(np.int32),
        "attention_mask": (positions < sequence_length).astype(np.int32),
        "start_positions": np.asarray(features["start_positions"][indices], dtype=np.int32),
        "end_positions": np.asarray(features["end_positions"][indices], dtype=np.int32),
    }


# ----------------------------------------------------------------------------- dataset


class SquadDataset(Dataset):
    """SQuAD v1.1 from ``tfds.data_source("squad/v1.1")`` as BERT features.

    A training example is a feature (one context window); ``num_train_examples`` counts
    features. ``num_eval_examples`` counts questions of the evaluation split. Features are
    built once and cached (:mod:`train.data.cache`).

    Evaluation batches keep all windows of a question in one process's rows, so that
    :meth:`squad_metrics` can pick each question's best span without state across
    batches: features are packed greedily, in order, into per-process blocks of
    ``global_batch_size // process_count`` rows (a question never straddles two blocks;
    the rest of a block is padding), and global batch ``g`` is blocks
    ``g * process_count ... g * process_count + process_count - 1``. Besides the model
    inputs and labels, evaluation batches carry ``"mask"`` (float32), ``"example_index"``
    (int32, -1 on padding) and ``"context_offsets"`` (int32 ``[B, T, 2]``, character
    offsets of context tokens, -1 elsewhere), which only :meth:`squad_metrics` reads.
    """

    task = "span_qa"

    def __init__(
        self,
        *,
        seed: int,
        vocab_file: str,
        data_dir: str | None = None,
        context_length: int = 384,
        doc_stride: int = 128,
        max_query_length: int = 64,
        max_answer_length: int = 30,
        lowercase: bool = True,
        cache_dir: str | None = None,
        tfds_name: str = "squad/v1.1",
        train_split: str = "train",
        eval_split: str = "validation",
    ):
        for name, value in (
            ("context_length", context_length),
            ("doc_stride", doc_stride),
            ("max_query_length", max_query_length),
            ("max_answer_length", max_answer_length),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dataset.{name} must be a positive int, got {value!r}.")
        self._tokenizer = WordPieceTokenizer(vocab_file, lowercase=lowercase)
        self.vocab_size = self._tokenizer.vocab_size
        self.context_length = context_length
        self.doc_stride = doc_stride
        self.max_query_length = max_query_length
        self.max_answer_length = max_answer_length
        self._eval_source = tfds_sources.open_split(tfds_name, eval_split, data_dir)
        if len(self._eval_source) == 0:
            raise ValueError(f"evaluation split {eval_split!r} of {tfds_name!r} is empty.")
        train_source = tfds_sources.open_split(tfds_name, train_split, data_dir)
        settings = {
            "kind": "squad",
            "vocab": self._tokenizer.fingerprint,
            "lowercase": self._tokenizer.lowercase,
            "context_length": context_length,
            "doc_stride": doc_stride,
            "max_query_length": max_query_length,
            "tfds_name": tfds_name,
            "data_dir": tfds_sources.resolved_data_dir(data_dir),
        }
        root = cache.cache_root(cache_dir)
        self._train = self._features(root, train_source, train_split, settings, train=True)
        self._eval = self._features(root, self._eval_source, eval_split, settings, train=False)
        self.num_skipped_train_examples = int(self._train["num_skipped"])
        self.num_eval_features = len(self._eval["example_index"])
        if len(self._train["example_index"]) == 0:
            raise ValueError(
                f"none of the {len(train_source)} training examples of {tfds_name!r} has its "
                "first answer at its answer_start offset in the context; is this SQuAD data?"
            )
        self._eval_texts: tuple[list[str], list[tuple[str, ...]]] | None = None
        self._packings: dict[int, list[np.ndarray]] = {}
        super().__init__(
            seed=seed,
            num_train_examples=len(self._train["example_index"]),
            num_eval_examples=len(self._eval_source),
        )

    def _features(
        self,
        root: Path,
        source: Sequence[Any],
        split: str,
        settings: dict,
        *,
        train: bool,
    ) -> dict[str, np.ndarray]:
        def record_id(index: int) -> str:
            return tfds_sources.text_of(source[index]["id"]) if len(source) else ""

        key = {
            **settings,
            "split": split,
            "train": train,
            "num_records": len(source),
            "first_id": record_id(0),
            "last_id": record_id(len(source) - 1),
        }

        def build(directory: Path) -> None:
            examples = (SquadExample.from_record(source[i]) for i in range(len(source)))
            features = build_features(
                examples,
                self._tokenizer,
                context_length=self.context_length,
                doc_stride=self.doc_stride,
                max_query_length=self.max_query_length,
                drop_unanswerable=train,
            )
            for name, array in features.items():
                np.save(directory / f"{name}.npy", array)

        safe_split = re.sub(r"[^A-Za-z0-9_.-]", "_", split)
        return cache.cached_arrays(root, f"squad-{safe_split}", key, build)

    # -------------------------------------------------------------------- training

    def _train_examples(self, epochs, indices, *, step, rows, global_batch_size) -> Batch:
        return feature_rows(self._train, indices)

    def _eval_examples(self, indices: np.ndarray) -> Batch:
        batch = feature_rows(self._eval, indices)
        batch["example_index"] = np.asarray(self._eval["example_index"][indices], np.int32)
        batch["context_offsets"] = np.asarray(self._eval["context_offsets"][indices], np.int32)
        return batch

    # ------------------------------------------------------------------ evaluation

    def _packing(self, block_size: int) -> list[np.ndarray]:
        """Feature indices of each per-process evaluation block (see the class docstring)."""
        if block_size in self._packings:
            return self._packings[block_size]
        example_index = np.asarray(self._eval["example_index"])
        bounds = np.flatnonzero(np.diff(example_index)) + 1
        groups = np.split(np.arange(len(example_index)), bounds)
        largest = max(len(group) for group in groups)
        if largest > block_size:
            raise ValueError(
                f"an evaluation question has {largest} windows (features) but each process "
                f"gets only {block_size} rows per evaluation batch, and a question's windows "
                "must stay together; use an evaluation global batch size of at least "
                f"{largest} x process_count."
            )
        blocks: list[np.ndarray] = []
        current: list[np.ndarray] = []
        filled = 0
        for group in groups:
            if filled + len(group) > block_size:
                blocks.append(np.concatenate(current))
                current, filled = [], 0
            current.append(group)
            filled += len(group)
        if current:
            blocks.append(np.concatenate(current))
        self._packings[block_size] = blocks
        return blocks

    def eval_batches(
        self, global_batch_size: int, process_index: int = 0, process_count: int = 1
    ) -> Iterator[Batch]:
        """This process's rows of every evaluation batch (packing: see the class docstring)."""
        rows = sampling.local_rows(global_batch_size, process_index, process_count)
        block_size = rows.stop - rows.start
        blocks = self._packing(block_size)
        num_batches = -(-len(blocks) // process_count)
        for number in range(num_batches):
            block = number * process_count + process_index
            features = blocks[block] if block < len(blocks) else np.zeros(0, np.int64)
            indices = np.zeros(block_size, dtype=np.int64)
            indices[: len(features)] = features
            batch = self._eval_examples(indices)
            padding = np.arange(block_size) >= len(features)
            for value in batch.values():
                value[padding] = 0
            batch["example_index"][padding] = -1
            batch["context_offsets"][padding] = -1
            batch["mask"] = (~padding).astype(np.float32)
            yield batch

    def eval_texts(self) -> tuple[list[str], list[tuple[str, ...]]]:
        """Contexts and gold answers of the evaluation questions (read once, on first use)."""
        if self._eval_texts is None:
            examples = [
                SquadExample.from_record(self._eval_source[i])
                for i in range(len(self._eval_source))
            ]
            self._eval_texts = (
                [e.context for e in examples],
                [e.answers for e in examples],
            )
        return self._eval_texts

    def predictions(
        self, start_logits: np.ndarray, end_logits: np.ndarray, batch: Mapping[str, np.ndarray]
    ) -> dict[int, str]:
        """Each question's predicted answer text: the best valid span over its windows."""
        example_index = np.asarray(batch["example_index"])
        offsets = np.asarray(batch["context_offsets"])
        real = (np.asarray(batch["mask"]) > 0) & (example_index >= 0)
        scores, starts, ends = best_spans(
            start_logits, end_logits, offsets[..., 0] >= 0, self.max_answer_length
        )
        contexts, _ = self.eval_texts()
        best: dict[int, tuple[float, str]] = {}
        for row in np.flatnonzero(real):
            example = int(example_index[row])
            if np.isfinite(scores[row]):
                char_start = int(offsets[row, starts[row], 0])
                char_end = int(offsets[row, ends[row], 1])
                candidate = (float(scores[row]), contexts[example][char_start:char_end])
            else:
                candidate = (-np.inf, "")
            if example not in best or candidate[0] > best[example][0]:
                best[example] = candidate
        return {example: text for example, (_, text) in best.items()}

    def squad_metrics(
        self, start_logits: np.ndarray, end_logits: np.ndarray, batch: Mapping[str, np.ndarray]
    ) -> dict[str, float | int]:
        """Sums of SQuAD v1.1 F1 and exact match over the questions of one eval batch.

        Args:
          start_logits: ``[B, T]`` span-start logits for the rows of ``batch`` (numpy or
            jax, any float dtype).
          end_logits: ``[B, T]`` span-end logits.
          batch: the evaluation batch (or this process's rows of it) from
            :meth:`eval_batches`.

        Returns:
          ``{"sum_f1", "sum_em", "count"}``: F1 and exact match in ``[0, 1]`` summed over
          the ``count`` questions in the batch. Summed over all evaluation batches (and
          processes), ``sum_f1 / count`` is the SQuAD F1 (x100 for the usual percent).
        """
        _, answers = self.eval_texts()
        sum_f1 = sum_em = 0.0
        predicted = self.predictions(start_logits, end_logits, batch)
        for example, text in predicted.items():
            golds = answers[example]
            sum_f1 += max((f1_score(text, gold) for gold in golds), default=0.0)
            sum_em += max((exact_match_score(text, gold) for gold in golds), default=0.0)
        return {"sum_f1": sum_f1, "sum_em": sum_em, "count": len(predicted)}
