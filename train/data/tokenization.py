"""Tokenizers for language modeling: UTF-8 bytes, or a HuggingFace ``tokenizer.json``.

``"bytes"`` maps text to its UTF-8 bytes (vocabulary 256) and needs nothing installed.
Any other ``dataset.tokenizer`` value is a path to a HuggingFace ``tokenizers`` file, for
example GPT-2's byte-level BPE
(https://huggingface.co/openai-community/gpt2/resolve/main/tokenizer.json); this needs
the ``tokenizers`` package.

Large texts are tokenized in chunks cut at line starts where GPT-2's pre-tokenization
regex would split anyway (see :func:`split_points`), so chunked tokenization of a
byte-level BPE equals tokenizing the whole text at once.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Iterator
from typing import Protocol

import numpy as np

__all__ = [
    "BytesTokenizer",
    "HuggingFaceTokenizer",
    "TextTokenizer",
    "iter_text_chunks",
    "load_text_tokenizer",
    "split_points",
    "token_dtype",
]

EOS_TOKEN = "<|endoftext|>"

# A safe cut sits right after a "\n" and either
#   before " x" (space, then non-space), or
#   before "x" when the "\n" follows a non-space,
# because the GPT-2 regex (`\s+(?!\S)|\s+` for whitespace runs) already ends a
# pre-token there, and the text before the cut pre-tokenizes the same on its own.
_SAFE_CUT = re.compile(r"(?<=\n)(?= \S)|(?<=\S\n)(?=\S)")


def split_points(text: str) -> list[int]:
    """Offsets in ``text`` where it can be cut without changing GPT-2 pre-tokenization."""
    return [match.start() for match in _SAFE_CUT.finditer(text)]


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids ``< vocab_size`` (int32 beyond 16 bits)."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


class TextTokenizer(Protocol):
    """What the language-modeling pipeline needs from a tokenizer."""

    vocab_size: int
    fingerprint: str

    def encode_text(self, pieces: Iterable[str]) -> Iterator[np.ndarray]:
        """Token ids of the text that ``pieces`` concatenate to, as consecutive 1-D arrays."""
        ...

    def document_separator(self) -> np.ndarray:
        """Ids placed between two documents."""
        ...


class BytesTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256). Documents are separated by a blank line."""

    vocab_size = 256
    fingerprint = "utf-8-bytes"

    def encode_text(self, pieces: Iterable[str]) -> Iterator[np.ndarray]:
        for piece in pieces:
            yield np.frombuffer(piece.encode("utf-8"), dtype=np.uint8)

    def document_separator(self) -> np.ndarray:
        return np.frombuffer(b"\n\n", dtype=np.uint8)


class HuggingFaceTokenizer:
    """A ``tokenizers`` ``tokenizer.json`` (e.g. GPT-2's byte-level BPE).

    Documents are separated by ``<|endoftext|>`` when the vocabulary has it (GPT-2 does),
    otherwise by the tokens of a blank line. No special tokens are added inside text.
    """

    def __init__(self, path: str, *, chunk_chars: int = 1 << 20, batch_chunks: int = 16):
        try:
            import tokenizers
        except ImportError as err:
            raise ImportError(
                f"dataset.tokenizer={path!r} is a HuggingFace tokenizer file, which needs the "
                "'tokenizers' package: pip install tokenizers (or use tokenizer='bytes')."
            ) from err
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"tokenizer file {path!r} does not exist. For GPT-2's BPE download "
                "https://huggingface.co/openai-community/gpt2/resolve/main/tokenizer.json and "
                "set dataset.tokenizer to its path, or use dataset.tokenizer='bytes'."
            )
        with open(path, "rb") as f:
            self.fingerprint = "hf-" + hashlib.sha256(f.read()).hexdigest()
        self._tokenizer = tokenizers.Tokenizer.from_file(path)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self._chunk_chars = chunk_chars
        self._batch_chunks = batch_chunks

    def encode_text(self, pieces: Iterable[str]) -> Iterator[np.ndarray]:
        pending: list[str] = []
        for chunk in iter_text_chunks(pieces, self._chunk_chars):
            pending.append(chunk)
            if len(pending) == self._batch_chunks:
                yield from self._encode(pending)
                pending = []
        if pending:
            yield from self._encode(pending)

    def _encode(self, texts: list[str]) -> Iterator[np.ndarray]:
        for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False):
            yield np.asarray(encoding.ids, dtype=np.int64)

    def document_separator(self) -> np.ndarray:
        eos = self._tokenizer.token_to_id(EOS_TOKEN)
        if eos is not None:
            return np.array([eos], dtype=np.int64)
        return np.asarray(
            self._tokenizer.encode("\n\n", add_special_tokens=False).ids, dtype=np.int64
        )


def load_text_tokenizer(spec: str) -> TextTokenizer:
    """``"bytes"`` or the path of a HuggingFace ``tokenizer.json``."""
    if spec == "bytes":
        return BytesTokenizer()
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"dataset.tokenizer must be 'bytes' or the path of a tokenizer.json, got {spec!r}."
        )
    return HuggingFaceTokenizer(os.path.expanduser(spec))


def iter_text_chunks(text_pieces: Iterable[str], chunk_chars: int = 1 << 20) -> Iterator[str]:
    """Re-cuts a stream of text pieces into chunks of about ``chunk_chars`` characters.

    Chunks end only at :func:`split_points` (or at the end of the stream), so tokenizing
    them one by one with a GPT-2-style byte-level BPE gives the tokens of the whole text.
    A stretch without any safe cut is kept in one chunk, however long.
    """
    buffer = ""
    for piece in text_pieces:
        buffer += piece
        while len(buffer) >= chunk_chars:
            cut = _cut_near(buffer, chunk_chars)
            if cut is None:
                break
            yield buffer[:cut]
            buffer = buffer[cut:]
    if buffer:
        yield buffer


def _cut_near(text: str, target: int) -> int | None:
    """The last safe cut in ``text[1 : target]``, else the first one after, else None.

    Matches are found with their look-ahead inside ``text``, so a cut stays valid whatever
    text is appended later.
    """
    last = None
    for match in _SAFE_CUT.finditer(text, 1, target):
        last = match.start()
    if last is None:
        match = _SAFE_CUT.search(text, target)
        last = match.start() if match else None
    return last


def iter_file_text(path: str, block_chars: int = 1 << 20) -> Iterator[str]:
    """The text of a UTF-8 file in blocks, line endings kept as they are."""
    with open(path, encoding="utf-8", newline="") as f:
        while block := f.read(block_chars):
            yield block
