"""Image classification: scikit-learn's digits (offline) and CIFAR-100 (tfds)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from train.data import sampling, tfds_sources
from train.data.base import Batch, Dataset

__all__ = [
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "Cifar100Dataset",
    "DigitsDataset",
    "random_crop_and_flip",
]

# Per-channel mean and standard deviation of the CIFAR-100 training images, pixels in
# [0, 1]; the values commonly used for CIFAR-100 (e.g. in the ResNet training recipes).
CIFAR100_MEAN = np.array([0.5071, 0.4865, 0.4409], dtype=np.float32)
CIFAR100_STD = np.array([0.2673, 0.2564, 0.2762], dtype=np.float32)

DIGITS_NUM_EVAL = 300
# The digits train/test split is fixed by this seed, independent of the training seed.
DIGITS_SPLIT_SEED = 20240601


class DigitsDataset(Dataset):
    """scikit-learn's ``load_digits``: 1797 8x8 grayscale digits, shipped with sklearn.

    A fixed permutation (``DIGITS_SPLIT_SEED``) puts 1497 images in the training split
    and 300 in the evaluation split. Pixels (0..16) are divided by 16 and standardized
    with the mean and standard deviation of all training pixels. No augmentation.
    """

    task = "classification"

    def __init__(self, *, seed: int):
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:
            raise ImportError(
                "the 'digits' dataset comes from scikit-learn, which is not installed: "
                "pip install 'resireduce_jax[train]' (or pip install scikit-learn)."
            ) from err
        digits = load_digits()
        images = (digits.images / 16.0).astype(np.float32)[..., None]
        labels = digits.target.astype(np.int32)
        order = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(labels))
        train, test = order[DIGITS_NUM_EVAL:], order[:DIGITS_NUM_EVAL]
        mean = images[train].mean(dtype=np.float64)
        std = images[train].std(dtype=np.float64)
        images = ((images - mean) / std).astype(np.float32)
        self._train_images, self._train_labels = images[train], labels[train]
        self._eval_images, self._eval_labels = images[test], labels[test]
        self.num_classes = 10
        self.input_shape = (8, 8, 1)
        super().__init__(seed=seed, num_train_examples=len(train), num_eval_examples=len(test))

    def _train_examples(self, epochs, indices, *, step, rows, global_batch_size) -> Batch:
        return {"image": self._train_images[indices], "label": self._train_labels[indices]}

    def _eval_examples(self, indices: np.ndarray) -> Batch:
        return {"image": self._eval_images[indices], "label": self._eval_labels[indices]}


def random_crop_and_flip(
    images: np.ndarray, offsets: np.ndarray, flips: np.ndarray, padding: int
) -> np.ndarray:
    """Zero-pads ``images`` by ``padding`` pixels, crops back to size at ``offsets``, flips.

    Args:
      images: ``[B, H, W, C]``.
      offsets: ``[B, 2]`` integer (row, column) of each crop's top-left corner in the
        padded image, in ``[0, 2 * padding]``.
      flips: ``[B]`` bool, mirror the crop left-right.
      padding: pixels of zero padding on every side.

    Returns:
      ``[B, H, W, C]`` augmented images, same dtype.
    """
    batch, height, width, _ = images.shape
    padded = np.pad(images, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    row_index = offsets[:, 0, None] + np.arange(height)  # [B, H]
    col_index = offsets[:, 1, None] + np.arange(width)  # [B, W]
    col_index = np.where(flips[:, None], col_index[:, ::-1], col_index)
    return padded[np.arange(batch)[:, None, None], row_index[:, :, None], col_index[:, None, :]]


class Cifar100Dataset(Dataset):
    """CIFAR-100 from ``tfds.data_source("cifar100")``: 50 000 train / 10 000 test images.

    Training images get a random 32x32 crop of the 4-pixel zero-padded image and a random
    horizontal flip; both are drawn per global row from
    ``default_rng([seed, AUGMENTATION_STREAM, step])``, so they do not depend on the
    process count. All images are normalized per channel with ``CIFAR100_MEAN`` and
    ``CIFAR100_STD``. Images are read from the data source per batch, never all at once.
    """

    task = "classification"
    crop_padding = 4

    def __init__(
        self,
        *,
        seed: int,
        data_dir: str | None = None,
        augment: bool = True,
        tfds_name: str = "cifar100",
        train_split: str = "train",
        eval_split: str = "test",
    ):
        self._train_source = tfds_sources.open_split(tfds_name, train_split, data_dir)
        self._eval_source = tfds_sources.open_split(tfds_name, eval_split, data_dir)
        self.augment = bool(augment)
        self.num_classes = 100
        self.input_shape = (32, 32, 3)
        super().__init__(
            seed=seed,
            num_train_examples=len(self._train_source),
            num_eval_examples=len(self._eval_source),
        )

    @staticmethod
    def _read(source: Sequence[Any], indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        records = [source[int(i)] for i in indices]
        images = np.stack([np.asarray(r["image"], dtype=np.uint8) for r in records])
        labels = np.array([int(r["label"]) for r in records], dtype=np.int32)
        return images, labels

    @staticmethod
    def _normalize(images: np.ndarray) -> np.ndarray:
        return ((images.astype(np.float32) / 255.0 - CIFAR100_MEAN) / CIFAR100_STD).astype(
            np.float32
        )

    def _train_examples(self, epochs, indices, *, step, rows, global_batch_size) -> Batch:
        images, labels = self._read(self._train_source, indices)
        if self.augment:
            rng = sampling.stream_rng(self.seed, sampling.AUGMENTATION_STREAM, step)
            offsets = rng.integers(0, 2 * self.crop_padding + 1, size=(global_batch_size, 2))
            flips = rng.random(global_batch_size) < 0.5
            images = random_crop_and_flip(
                images, offsets[rows], flips[rows], padding=self.crop_padding
            )
        return {"image": self._normalize(images), "label": labels}

    def _eval_examples(self, indices: np.ndarray) -> Batch:
        images, labels = self._read(self._eval_source, indices)
        return {"image": self._normalize(images), "label": labels}
