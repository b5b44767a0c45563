"""Next-token prediction over a token stream: pydoc topics, stdlib source, text files, tfds.

A split is one long stream of token ids, documents joined by a separator.
Training windows of context_length + 1 tokens start at an offset drawn per epoch.
Evaluation windows share one token, so each token is a target exactly once.
Batches hold {"tokens": int32 [B, context_length + 1]}.
The window arithmetic: docs/design.md, "Language-model windows
(train/data/language_modeling.py)".
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from train.data import cache, sampling, tfds_sources
from train.data.base import Batch, Dataset
from train.data.tokenization import (
    TextTokenizer,
    iter_file_text,
    load_text_tokenizer,
    token_dtype,
)

__all__ = [
    "PYDOC_TRAIN_FRACTION",
    "LanguageModelingDataset",
    "document_tokens",
    "pydoc_text",
    "stdlib_source",
    "text_files",
    "tfds_text",
]

PYDOC_TRAIN_FRACTION = 0.9

WIKITEXT_HELP = (
    "For WikiText-103 download wikitext-103-raw-v1.zip (Merity et al. 2016; "
    "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip, also "
    "on the HuggingFace Hub as dataset 'Salesforce/wikitext', config "
    "'wikitext-103-raw-v1', whose 'text' rows concatenate to the raw files), unzip it and "
    "set dataset.train_files='.../wikitext-103-raw/wiki.train.raw' and "
    "dataset.eval_files='.../wikitext-103-raw/wiki.valid.raw'."
)


class LanguageModelingDataset(Dataset):
    """Windows of a training and an evaluation token stream (design.md, "Language-model windows").

    Args:
      train_tokens: 1-D integer token stream of the training split (may be a memmap).
      eval_tokens: 1-D integer token stream of the evaluation split.
      vocab_size: number of token ids; every id is ``< vocab_size``.
      context_length: ``T``; examples have ``T + 1`` tokens.
      seed: fixes the window order and per-epoch offsets.
    """

    task = "language_modeling"

    def __init__(
        self,
        *,
        train_tokens: np.ndarray,
        eval_tokens: np.ndarray,
        vocab_size: int,
        context_length: int,
        seed: int,
    ):
        if (
            isinstance(context_length, bool)
            or not isinstance(context_length, int)
            or (context_length < 1)
        ):
            raise ValueError(f"context_length must be a positive int, got {context_length!r}.")
        self._train_tokens = train_tokens
        self._eval_tokens = eval_tokens
        self.vocab_size = int(vocab_size)
        self.context_length = context_length
        self.num_train_tokens = len(train_tokens)
        self.num_eval_tokens = len(eval_tokens)
        window = context_length + 1
        num_train = (len(train_tokens) - context_length) // window
        num_eval = (len(eval_tokens) - 1) // context_length
        for split, tokens, count, need in (
            ("training", train_tokens, num_train, 2 * context_length + 1),
            ("evaluation", eval_tokens, num_eval, context_length + 1),
        ):
            if count < 1:
                raise ValueError(
                    f"the {split} text has {len(tokens)} tokens, too few for one window of "
                    f"context_length={context_length} (need at least {need}); use more text "
                    "or a shorter dataset.context_length."
                )
        super().__init__(seed=seed, num_train_examples=num_train, num_eval_examples=num_eval)

    def epoch_offset(self, epoch: int) -> int:
        """Where the windows of ``epoch`` start in the training stream, in ``[0, T]``."""
        rng = sampling.stream_rng(self.seed, sampling.WINDOW_OFFSET_STREAM, int(epoch))
        return int(rng.integers(0, self.context_length + 1))

    def train_window_starts(self, epochs: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """Start offsets in the training stream of windows ``indices`` of ``epochs``."""
        offsets = np.zeros_like(indices)
        for epoch in np.unique(epochs):
            offsets[epochs == epoch] = self.epoch_offset(int(epoch))
        return offsets + indices * (self.context_length + 1)

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> Batch:
        positions = starts[:, None] + np.arange(self.context_length + 1)
        return {"tokens": np.asarray(tokens[positions], dtype=np.int32)}

    def _train_examples(self, epochs, indices, *, step, rows, global_batch_size) -> Batch:
        return self._windows(self._train_tokens, self.train_window_starts(epochs, indices))

    def _eval_examples(self, indices: np.ndarray) -> Batch:
        return self._windows(self._eval_tokens, indices * self.context_length)


def document_tokens(
    documents: Iterable[Iterable[str]], tokenizer: TextTokenizer
) -> Iterator[np.ndarray]:
    """Token ids of ``documents`` (each an iterable of text pieces), separator between them."""
    separator = tokenizer.document_separator()
    for number, pieces in enumerate(documents):
        if number:
            yield separator
        yield from tokenizer.encode_text(pieces)


def pydoc_text(*, seed: int, context_length: int = 128) -> LanguageModelingDataset:
    """Byte-level language modeling on CPython's ``pydoc_data.topics`` (about 465 KB).

    The topics are joined in sorted key order (blank line between topics) as UTF-8 bytes;
    the first 90 % of the bytes train, the last 10 % evaluate.
    """
    from pydoc_data.topics import topics

    return _embedded_bytes(
        ([topics[key]] for key in sorted(topics)), seed=seed, context_length=context_length
    )


#: The pure-Python standard-library modules whose source :func:`stdlib_source` reads.
STDLIB_SOURCE_MODULES = (
    "argparse", "bisect", "calendar", "csv", "dataclasses", "difflib", "enum", "fractions",
    "functools", "heapq", "pathlib", "pprint", "shlex", "statistics", "string", "textwrap",
)  # fmt: skip


def stdlib_source(*, seed: int, context_length: int = 128) -> LanguageModelingDataset:
    """Byte-level language modeling on Python source: the installed standard library's
    modules :data:`STDLIB_SOURCE_MODULES` (about 620 KB with CPython 3.11).

    Code rather than English prose: with :func:`pydoc_text` it makes a fine-tuning pair
    (pre-train on one, fine-tune on the other). The modules' sources are joined in that
    order (a document each) as UTF-8 bytes; the first 90 % train, the last 10 % evaluate.
    """
    import importlib
    import inspect

    sources = ([inspect.getsource(importlib.import_module(m))] for m in STDLIB_SOURCE_MODULES)
    return _embedded_bytes(sources, seed=seed, context_length=context_length)


def _embedded_bytes(
    documents: Iterable[Iterable[str]], *, seed: int, context_length: int
) -> LanguageModelingDataset:
    tokenizer = load_text_tokenizer("bytes")
    stream = np.concatenate(list(document_tokens(documents, tokenizer)))
    split = int(PYDOC_TRAIN_FRACTION * len(stream))
    return LanguageModelingDataset(
        train_tokens=stream[:split],
        eval_tokens=stream[split:],
        vocab_size=tokenizer.vocab_size,
        context_length=context_length,
        seed=seed,
    )


def _expand_files(patterns: str | Sequence[str], field: str) -> list[str]:
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(
            f"dataset.{field} must be a glob pattern or a list of them, got {patterns!r}. "
            + WIKITEXT_HELP
        )
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise FileNotFoundError(
                f"dataset.{field}={pattern!r} matches no file. " + WIKITEXT_HELP
            )
        files.extend(os.path.abspath(m) for m in matches)
    return files


def _cached_stream(
    cache_dir: str | None,
    name: str,
    key: dict,
    documents: Iterable[Iterable[str]],
    tokenizer: TextTokenizer,
) -> np.ndarray:
    dtype = token_dtype(tokenizer.vocab_size)

    def build(directory: Path) -> None:
        cache.write_stream(directory / "tokens.npy", document_tokens(documents, tokenizer), dtype)

    return cache.cached_arrays(cache.cache_root(cache_dir), name, key, build)["tokens"]


def _cached_dataset(
    splits: Iterable[tuple[str, dict, Iterable[Iterable[str]]]],
    tokenizer: TextTokenizer,
    *,
    cache_dir: str | None,
    context_length: int,
    seed: int,
) -> LanguageModelingDataset:
    """The dataset of a train and an eval split, each ``(cache name, cache key, documents)``:
    tokenized once and cached (:func:`_cached_stream`), in that order."""
    train, evaluation = (
        _cached_stream(cache_dir, name, key, documents, tokenizer)
        for name, key, documents in splits
    )
    return LanguageModelingDataset(
        train_tokens=train,
        eval_tokens=evaluation,
        vocab_size=tokenizer.vocab_size,
        context_length=context_length,
        seed=seed,
    )


def text_files(
    *,
    seed: int,
    train_files: str | Sequence[str],
    eval_files: str | Sequence[str],
    tokenizer: str = "bytes",
    context_length: int = 128,
    cache_dir: str | None = None,
) -> LanguageModelingDataset:
    """Language modeling on raw UTF-8 text files (e.g. WikiText-103 raw).

    The files matched by each glob (sorted) are documents of that split. The token streams
    are tokenized once and cached (see :mod:`train.data.cache`); the cache key includes
    every file's path, size and modification time, and the tokenizer file's hash.
    """
    text_tokenizer = load_text_tokenizer(tokenizer)

    def splits():
        for split, field, patterns in (
            ("train", "train_files", train_files),
            ("eval", "eval_files", eval_files),
        ):
            files = _expand_files(patterns, field)
            key = {
                "kind": "text_files",
                "tokenizer": text_tokenizer.fingerprint,
                "files": [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files],
            }
            yield f"lm-files-{split}", key, (iter_file_text(f) for f in files)

    return _cached_dataset(
        splits(), text_tokenizer, cache_dir=cache_dir, context_length=context_length, seed=seed
    )


def tfds_text(
    *,
    seed: int,
    tfds_name: str,
    text_key: str = "text",
    train_split: str = "train",
    eval_split: str = "validation",
    data_dir: str | None = None,
    tokenizer: str = "bytes",
    context_length: int = 128,
    cache_dir: str | None = None,
) -> LanguageModelingDataset:
    """Language modeling on the ``text_key`` field of a tfds text dataset.

    Each record is a document. The splits are read once through ``tfds.data_source``,
    tokenized and cached as memory-mapped token streams.
    """
    if not isinstance(tfds_name, str) or not tfds_name:
        raise ValueError(
            f"dataset.tfds_name must name a tfds text dataset (e.g. 'lm1b'), got {tfds_name!r}."
        )
    text_tokenizer = load_text_tokenizer(tokenizer)

    def splits():
        for split in (train_split, eval_split):
            source = tfds_sources.open_split(tfds_name, split, data_dir)
            if len(source) == 0:
                raise ValueError(f"split {split!r} of tfds dataset {tfds_name!r} is empty.")
            first = source[0]
            if text_key not in first:
                raise ValueError(
                    f"records of tfds dataset {tfds_name!r} have no field {text_key!r}; set "
                    f"dataset.text_key to one of {sorted(first)}."
                )
            key = {
                "kind": "tfds_text",
                "tokenizer": text_tokenizer.fingerprint,
                "name": tfds_name,
                "split": split,
                "text_key": text_key,
                "data_dir": tfds_sources.resolved_data_dir(data_dir),
                "num_records": len(source),
            }
            documents = ([tfds_sources.text_of(source[i][text_key])] for i in range(len(source)))
            yield f"lm-tfds-{split}", key, documents

    return _cached_dataset(
        splits(), text_tokenizer, cache_dir=cache_dir, context_length=context_length, seed=seed
    )
