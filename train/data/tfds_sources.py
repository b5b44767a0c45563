"""Opening TensorFlow Datasets splits for random access, with errors that say what to do.

``tfds.data_source`` reads datasets that were prepared in the ``array_record`` file
format; it works without TensorFlow but cannot download or prepare anything. Preparing
needs TensorFlow and internet access, once, on any machine:

    pip install tensorflow tensorflow-datasets
    tfds build cifar100 --data_dir=DIR --file_format=array_record

after which ``DIR`` (or the dataset's folder inside it) is copied to where training runs
and passed as ``dataset.data_dir``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["build_command", "open_split", "resolved_data_dir", "text_of"]


def resolved_data_dir(data_dir: str | None) -> str:
    """The directory tfds reads: ``data_dir``, ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``."""
    if data_dir:
        return os.path.abspath(os.path.expanduser(data_dir))
    return os.environ.get(
        "TFDS_DATA_DIR", os.path.join(os.path.expanduser("~"), "tensorflow_datasets")
    )


def build_command(name: str, data_dir: str | None) -> str:
    """The shell commands that prepare ``name`` for ``tfds.data_source``."""
    return (
        "pip install tensorflow tensorflow-datasets && "
        f"tfds build {name} --data_dir={resolved_data_dir(data_dir)} "
        "--file_format=array_record"
    )


def open_split(name: str, split: str, data_dir: str | None) -> Sequence[Any]:
    """Random-access view of one split of a prepared tfds dataset.

    Args:
      name: tfds name, optionally with config and version (``"squad/v1.1"``).
      split: split name (``"train"``, ``"test"``, ``"validation"``, or a slice such as
        ``"train[:10%]"``).
      data_dir: tfds data directory, or ``None`` for tfds's default.

    Returns:
      The ``tfds.data_source`` for the split: ``len()`` and ``source[i]`` (a dict of numpy
      values, text as ``str`` or ``bytes``).

    Raises:
      ImportError: tensorflow-datasets is not installed.
      FileNotFoundError: the dataset is not prepared in ``array_record`` format under the
        data directory; the message gives the command that prepares it.
    """
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise ImportError(
            f"dataset {name!r} is read with tensorflow-datasets, which is not installed: "
            "pip install 'resireduce_jax[tfds]' (or pip install tensorflow-datasets)."
        ) from err
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except Exception as err:  # tfds raises many unrelated types for "not prepared here".
        summary = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileNotFoundError(
            f"Cannot open split {split!r} of tfds dataset {name!r} under "
            f"{resolved_data_dir(data_dir)}. tfds.data_source only reads datasets prepared "
            "in the array_record file format and cannot download them. Prepare it once on "
            "a machine with internet access (building needs TensorFlow):\n"
            f"    {build_command(name, data_dir)}\n"
            "then copy the data directory here and set dataset.data_dir to it "
            f"(or $TFDS_DATA_DIR). tfds said: {type(err).__name__}: {summary}"
        ) from err


def text_of(value: Any) -> str:
    """A tfds text value (``str``, ``bytes`` or a 0-d numpy array of either) as ``str``."""
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        value = value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, str):
        return value
    raise TypeError(f"expected a text value (str or bytes), got {type(value).__name__}.")
