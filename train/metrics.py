"""Metrics of a run: a JSONL file, TensorBoard event files and a progress bar.

Only process 0 writes. Every record is one JSON object per line in
``<workdir>/metrics.jsonl`` (``{"step": ..., "split": "train"|"eval", ...}``), and the same
scalars go to TensorBoard under ``<workdir>/tensorboard`` (``tensorboard --logdir``).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import numpy as np

__all__ = ["MetricWriter", "Progress", "read_metrics"]


def _scalar(value: Any) -> float | int:
    value = np.asarray(value)
    return value.item() if value.size == 1 else float(value.mean())


class MetricWriter:
    """Appends metric records to ``metrics.jsonl`` and TensorBoard (process 0 only)."""

    def __init__(self, workdir: str, *, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if enabled:
            os.makedirs(workdir, exist_ok=True)
            from tensorboardX import SummaryWriter

            # tensorboardX writes events from a queue in its own thread, so the flush in
            # write() misses the record just queued; flush_secs=1 puts it on disk within a
            # second, before a process that lost a peer is ended (train/supervisor.py).
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), flush_secs=1)

    def write(self, step: int, split: str, metrics: dict[str, Any]) -> dict[str, Any]:
        record = {"step": int(step), "split": split}
        record.update({k: _scalar(v) for k, v in metrics.items()})
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            for key, value in record.items():
                if (
                    key not in ("step", "split")
                    and isinstance(value, int | float)
                    and math.isfinite(value)
                ):
                    self._tb.add_scalar(f"{split}/{key}", value, step)
            self._tb.flush()
        return record

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """All records of ``<workdir>/metrics.jsonl``."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


class Progress:
    """A tqdm bar over training steps with loss and steps/s (process 0 only)."""

    def __init__(self, start: int, total: int, *, enabled: bool = True, desc: str = "train"):
        self._bar = None
        self._last = (start, time.perf_counter())
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True)

    def update(self, step: int, **postfix: Any) -> None:
        if self._bar is None:
            return
        last_step, last_time = self._last
        now = time.perf_counter()
        rate = (step - last_step) / max(now - last_time, 1e-9)
        self._last = (step, now)
        self._bar.set_postfix({"steps/s": f"{rate:.2f}", **postfix}, refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
