"""Stateless example order: which example fills each row of each batch.

Every training batch is a pure function of (seed, step), via per-epoch permutations.
So a resumed run, or one with other processes, sees bit-identical global batches.
Random streams (permutations, augmentation, offsets) are tagged in the seed sequence.
The arithmetic: docs/design.md, "Stateless sampling (train/data/sampling.py)".
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import numpy as np

__all__ = [
    "AUGMENTATION_STREAM",
    "PERMUTATION_STREAM",
    "WINDOW_OFFSET_STREAM",
    "EpochOrder",
    "check_seed",
    "check_step",
    "eval_index_batches",
    "local_rows",
    "stream_rng",
]

PERMUTATION_STREAM = 0
AUGMENTATION_STREAM = 1
WINDOW_OFFSET_STREAM = 2


def check_seed(seed: int) -> int:
    """Returns ``seed`` as a Python int, or raises ValueError if it is not a non-negative int."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")
    return int(seed)


def check_step(step: int) -> int:
    """Returns ``step`` as a Python int, or raises ValueError if it is not a non-negative int."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}.")
    return int(step)


def stream_rng(seed: int, stream: int, counter: int) -> np.random.Generator:
    """The generator of random stream ``stream`` at ``counter`` (an epoch or a step)."""
    return np.random.default_rng([seed, stream, counter])


def local_rows(global_batch_size: int, process_index: int, process_count: int) -> slice:
    """The rows of a global batch that belong to one process.

    The ``global_batch_size`` rows are split into ``process_count`` contiguous parts of
    equal size; process ``process_index`` gets part number ``process_index``.

    Args:
      global_batch_size: rows in the global batch.
      process_index: this process, in ``[0, process_count)``.
      process_count: number of processes sharing the global batch.

    Returns:
      The slice of global rows that this process loads.
    """
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("process_count", process_count),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if (
        isinstance(process_index, bool)
        or not isinstance(process_index, (int, np.integer))
        or not 0 <= process_index < process_count
    ):
        raise ValueError(
            f"process_index must be an integer in [0, process_count={process_count}), "
            f"got {process_index!r}."
        )
    if global_batch_size % process_count:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by "
            f"process_count={process_count}; every process must load the same number of "
            "rows. Choose a global batch size that is a multiple of the process count."
        )
    per_process = global_batch_size // process_count
    return slice(process_index * per_process, (process_index + 1) * per_process)


class EpochOrder:
    """Maps positions of the training stream to ``(epoch, example index)``.

    Epoch ``e`` visits every example exactly once, in the order
    ``default_rng([seed, PERMUTATION_STREAM, e]).permutation(num_examples)``. The few most
    recently used permutations are cached (a batch can straddle two epochs).
    """

    def __init__(self, num_examples: int, seed: int, *, cached_epochs: int = 3):
        if num_examples < 1:
            raise ValueError(f"a dataset needs at least one example, got {num_examples}.")
        self.num_examples = int(num_examples)
        self.seed = check_seed(seed)
        self._cached_epochs = cached_epochs
        self._cache: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def permutation(self, epoch: int) -> np.ndarray:
        """The example order of ``epoch`` (read-only int64 array of length ``num_examples``)."""
        epoch = int(epoch)
        perm = self._cache.get(epoch)
        if perm is None:
            perm = stream_rng(self.seed, PERMUTATION_STREAM, epoch).permutation(self.num_examples)
            perm.setflags(write=False)
            self._cache[epoch] = perm
            while len(self._cache) > self._cached_epochs:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(epoch)
        return perm

    def lookup(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Returns ``(epochs, example_indices)`` for stream ``positions`` (int64 arrays)."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs = positions // self.num_examples
        offsets = positions % self.num_examples
        indices = np.empty_like(positions)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            indices[in_epoch] = self.permutation(int(epoch))[offsets[in_epoch]]
        return epochs, indices


def eval_index_batches(
    num_examples: int, global_batch_size: int, process_index: int, process_count: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Fixed-order evaluation batches over ``num_examples`` examples, padded to full size.

    Global batch ``b`` holds examples ``b * B, ..., b * B + B - 1``; positions past the
    last example are padding. Every process gets the same number of batches.

    Yields:
      ``(indices, mask)`` for this process's rows: int64 example indices (0 on padding
      rows) and a float32 mask (1 for a real example, 0 for padding).
    """
    rows = local_rows(global_batch_size, process_index, process_count)
    num_batches = -(-num_examples // global_batch_size)
    local = np.arange(rows.start, rows.stop, dtype=np.int64)
    for batch in range(num_batches):
        positions = batch * global_batch_size + local
        real = positions < num_examples
        yield np.where(real, positions, 0), real.astype(np.float32)
