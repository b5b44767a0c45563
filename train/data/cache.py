"""On-disk cache of preprocessed arrays (token streams, SQuAD features).

Each cache entry is a directory named by a fingerprint of everything that determines its
content (source files or dataset, tokenizer, preprocessing parameters, this module's
format version). Arrays are stored as ``.npy`` files and opened memory-mapped, so a
multi-gigabyte token stream costs no RAM until read. An entry is written into a temporary
directory and renamed into place, so concurrent writers (several processes on one host)
never expose a half-written entry.

The cache root is ``dataset.cache_dir`` if set, else ``$RESIREDUCE_DATA_CACHE``, else
``~/.cache/resireduce_jax/data``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FORMAT_VERSION", "cache_root", "cached_arrays", "fingerprint", "write_stream"]

FORMAT_VERSION = 1


def cache_root(cache_dir: str | None) -> Path:
    """Where cache entries live (see the module docstring)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("RESIREDUCE_DATA_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "resireduce_jax" / "data"


def fingerprint(parts: Any) -> str:
    """A short hex digest of the JSON form of ``parts`` (plus the cache format version)."""
    text = json.dumps([FORMAT_VERSION, parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def cached_arrays(
    root: Path,
    name: str,
    key: Any,
    build: Callable[[Path], None],
) -> dict[str, np.ndarray]:
    """Returns the arrays of cache entry ``name``/``key``, building it first if missing.

    Args:
      root: the cache root directory.
      name: a readable prefix of the entry directory (e.g. ``"squad-train"``).
      key: JSON-able description of everything the content depends on.
      build: writes the entry's ``.npy`` files into the directory it is given.

    Returns:
      ``{file stem: read-only memory-mapped array}`` for every ``.npy`` in the entry.
    """
    entry = root / f"{name}-{fingerprint(key)}"
    if not (entry / "COMPLETE").exists():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            build(staging)
            (staging / "key.json").write_text(json.dumps(key, indent=1, default=str))
            (staging / "COMPLETE").write_text("")
            try:
                os.rename(staging, entry)
            except OSError:
                # Another process finished the same entry first; theirs is identical.
                if not (entry / "COMPLETE").exists():
                    raise
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return {path.stem: np.load(path, mmap_mode="r") for path in sorted(entry.glob("*.npy"))}


def write_stream(path: Path, chunks: Iterable[np.ndarray], dtype: np.dtype) -> int:
    """Writes the concatenation of 1-D integer ``chunks`` to ``path`` as a ``.npy`` file.

    The chunks are streamed to disk, so the whole array is never held in memory: a
    placeholder header is written first and replaced by the real one (same length) once
    the element count is known.

    Returns:
      The number of elements written.
    """
    dtype = np.dtype(dtype)
    limit = np.iinfo(dtype).max

    def header(count: int) -> bytes:
        buffer = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            buffer,
            {
                "descr": np.lib.format.dtype_to_descr(dtype),
                "fortran_order": False,
                "shape": (count,),
            },
        )
        return buffer.getvalue()

    placeholder = header(10**15)
    count = 0
    with open(path, "wb") as out:
        out.write(placeholder)
        for chunk in chunks:
            chunk = np.asarray(chunk)
            if chunk.size and (chunk.min() < 0 or chunk.max() > limit):
                raise ValueError(f"token ids out of range for {dtype}.")
            out.write(chunk.astype(dtype, copy=False).tobytes())
            count += chunk.size
        final = header(count)
        if len(final) != len(placeholder):
            raise AssertionError("npy header length changed")  # cannot happen below 10**15
        out.seek(0)
        out.write(final)
    return count
