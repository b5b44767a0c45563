"""Input pipeline of the training program: ``get_dataset(config.dataset, seed=...)``.

Training batches are stateless: global batch step is a pure function of (seed, step).
So resuming is bit-identical, and each process loads only its own rows of that batch.
Evaluation runs over the whole split in a fixed order, padded, with a float32 "mask".
Datasets: digits, pydoc_text, stdlib_source, cifar100, text_files, tfds_text, squad.
The datasets and how to get their data: docs/data.md; their config fields: docs/design.md,
"Datasets and their fields (train/input_pipeline.py)".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from train.data import images, language_modeling, squad
from train.data.base import Batch, Dataset
from train.data.language_modeling import LanguageModelingDataset
from train.data.squad import SquadDataset

__all__ = [
    "DATASETS",
    "Batch",
    "Dataset",
    "LanguageModelingDataset",
    "SquadDataset",
    "get_dataset",
]

# name -> (builder, allowed fields, required fields). Builders take keyword arguments.
DATASETS: dict[str, tuple[Callable[..., Dataset], frozenset[str], frozenset[str]]] = {
    "digits": (images.DigitsDataset, frozenset(), frozenset()),
    "pydoc_text": (language_modeling.pydoc_text, frozenset({"context_length"}), frozenset()),
    "stdlib_source": (
        language_modeling.stdlib_source,
        frozenset({"context_length"}),
        frozenset(),
    ),
    "cifar100": (images.Cifar100Dataset, frozenset({"augment"}), frozenset()),
    "text_files": (
        language_modeling.text_files,
        frozenset({"train_files", "eval_files", "tokenizer", "context_length", "cache_dir"}),
        frozenset({"train_files", "eval_files"}),
    ),
    "tfds_text": (
        language_modeling.tfds_text,
        frozenset(
            {
                "tfds_name",
                "text_key",
                "train_split",
                "eval_split",
                "tokenizer",
                "context_length",
                "cache_dir",
            }
        ),
        frozenset({"tfds_name"}),
    ),
    "squad": (
        squad.SquadDataset,
        frozenset(
            {
                "vocab_file",
                "context_length",
                "doc_stride",
                "max_query_length",
                "max_answer_length",
                "lowercase",
                "cache_dir",
            }
        ),
        frozenset({"vocab_file"}),
    ),
}

_USES_TFDS = frozenset({"cifar100", "tfds_text", "squad"})


def _fields(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "items"):  # ml_collections ConfigDict / FrozenConfigDict
        return dict(config.items())
    raise TypeError(
        f"get_dataset expects the dataset ConfigDict (config.dataset), got {type(config)}."
    )


def get_dataset(config: Any, *, seed: int) -> Dataset:
    """Builds the dataset that ``config`` (the ``dataset`` sub-config) describes.

    Args:
      config: ``ml_collections.ConfigDict`` (or mapping) with ``name``, optional
        ``data_dir`` and the dataset's fields (docs/design.md, "Datasets and their fields").
      seed: non-negative int; fixes the training order and augmentation.

    Returns:
      A :class:`~train.data.base.Dataset`.

    Raises:
      ValueError: unknown dataset name, unknown or missing fields, bad values.
      FileNotFoundError: the data is not where the config says; the message says how to
        get it.
    """
    fields = _fields(config)
    name = fields.pop("name", None)
    if name not in DATASETS:
        raise ValueError(
            f"unknown dataset name {name!r}; valid names: {', '.join(sorted(DATASETS))}."
        )
    builder, allowed, required = DATASETS[name]
    data_dir = fields.pop("data_dir", None)
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise ValueError(
            f"dataset {name!r} has no config field(s) {unknown}; its fields are "
            f"{sorted(allowed | {'name', 'data_dir'})}."
        )
    missing = sorted(field for field in required if fields.get(field) is None)
    if missing:
        raise ValueError(f"dataset {name!r} needs config field(s) {missing}; see docs/data.md.")
    kwargs = {key: value for key, value in fields.items() if value is not None}
    if name in _USES_TFDS:
        kwargs["data_dir"] = data_dir
    return builder(seed=seed, **kwargs)
