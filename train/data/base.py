"""The interface every dataset of the training program implements."""

from __future__ import annotations

import abc
from collections.abc import Iterator

import numpy as np

from train.data import sampling

__all__ = ["Batch", "Dataset"]

Batch = dict[str, np.ndarray]


class Dataset(abc.ABC):
    """A training split sampled statelessly by step and an evaluation split read in order.

    Attributes:
      task: ``"classification"``, ``"language_modeling"`` or ``"span_qa"``.
      num_train_examples: examples in one training epoch (images, token windows or
        SQuAD features).
      num_eval_examples: examples in the evaluation split (for SQuAD: questions).
      seed: the seed that fixes the training order and augmentation.
    """

    task: str

    def __init__(self, *, seed: int, num_train_examples: int, num_eval_examples: int):
        self.seed = sampling.check_seed(seed)
        self.num_train_examples = int(num_train_examples)
        self.num_eval_examples = int(num_eval_examples)
        self._order = sampling.EpochOrder(self.num_train_examples, self.seed)

    def train_batch(
        self,
        step: int,
        global_batch_size: int,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Batch:
        """This process's rows of global training batch number ``step``.

        The global batch is a pure function of ``(seed, step, global_batch_size)``: row
        ``j`` holds the example at stream position ``step * global_batch_size + j`` (see
        :mod:`train.data.sampling`). The rows are split into ``process_count`` contiguous
        equal parts and part ``process_index`` is returned.

        Args:
          step: the global batch number, ``>= 0``.
          global_batch_size: rows of the global batch, a multiple of ``process_count``.
          process_index: this process, in ``[0, process_count)``.
          process_count: processes sharing the global batch.

        Returns:
          A dict of numpy arrays with ``global_batch_size // process_count`` rows.
        """
        step = sampling.check_step(step)
        rows = sampling.local_rows(global_batch_size, process_index, process_count)
        positions = step * global_batch_size + np.arange(rows.start, rows.stop, dtype=np.int64)
        epochs, indices = self._order.lookup(positions)
        return self._train_examples(
            epochs, indices, step=step, rows=rows, global_batch_size=global_batch_size
        )

    def eval_batches(
        self, global_batch_size: int, process_index: int = 0, process_count: int = 1
    ) -> Iterator[Batch]:
        """This process's rows of every evaluation batch, in a fixed order.

        Every evaluation example appears exactly once. The last global batch is padded to
        full size; each batch carries a float32 ``"mask"`` (1 real row, 0 padding) and the
        padding rows are zero. All processes get the same number of batches.
        """
        for indices, mask in sampling.eval_index_batches(
            self.num_eval_examples, global_batch_size, process_index, process_count
        ):
            batch = self._eval_examples(indices)
            padding = mask == 0
            if padding.any():
                for value in batch.values():
                    value[padding] = 0
            batch["mask"] = mask
            yield batch

    @abc.abstractmethod
    def _train_examples(
        self,
        epochs: np.ndarray,
        indices: np.ndarray,
        *,
        step: int,
        rows: slice,
        global_batch_size: int,
    ) -> Batch:
        """Builds training rows from example ``indices`` (their ``epochs`` alongside).

        ``rows`` are the global rows being built, for randomness derived per global row.
        """

    @abc.abstractmethod
    def _eval_examples(self, indices: np.ndarray) -> Batch:
        """Builds evaluation rows (fresh, writable arrays) from example ``indices``."""

    def __repr__(self) -> str:
        fields = {
            key: value
            for key, value in vars(self).items()
            if not key.startswith("_") and isinstance(value, (int, str, tuple, float))
        }
        details = ", ".join(f"{key}={value!r}" for key, value in fields.items())
        return f"{type(self).__name__}(task={self.task!r}, {details})"
