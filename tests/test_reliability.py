"""The training program under faults, in one process: half-written checkpoints, SIGTERM,
and a change of the number of workers. (Several processes: tests/test_multiprocess.py.)
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import chex
import jax
import numpy as np
import pytest

from tests.test_train import small_digits
from train import checkpointing, train
from train import metrics as metrics_lib

CONFIG = {"checkpoint_every": 4, "keep_checkpoints": 10, "log_every": 1}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """small_digits (12 steps, 8 workers), uninterrupted."""
    workdir = str(tmp_path_factory.mktemp("reliability") / "reference")
    summary = train.train_and_evaluate(small_digits(**CONFIG), workdir)
    assert summary.step == 12 and not summary.preempted
    return workdir


def _copy_step(src_workdir: str, step: int, dst_dir: str, *, committed: bool = True) -> None:
    src = os.path.join(src_workdir, "checkpoints", str(step))
    shutil.copytree(src, dst_dir)
    if not committed:
        os.remove(os.path.join(dst_dir, checkpointing.COMMIT_MARKER))


@pytest.mark.slow
def test_half_written_checkpoints_are_never_resumed_from(reference, tmp_path):
    """Only step 4 is complete; a temporary dir and a step dir without marker are not.

    Both fakes hold step 4's state under later step numbers: resuming from either would
    replay steps 7..12 (or 9..12) on the wrong state, and the end state would differ.
    """
    workdir = str(tmp_path / "run")
    ckpt = os.path.join(workdir, "checkpoints")
    os.makedirs(ckpt)
    _copy_step(reference, 4, os.path.join(ckpt, "4"))
    # What SIGKILL during orbax's write leaves behind (the marker is written before the
    # rename, so a temporary dir may already hold one).
    _copy_step(reference, 4, os.path.join(ckpt, "8.orbax-checkpoint-tmp-1717171717171717"))
    # A step dir without commit marker (e.g. a copy of a workdir that was cut short).
    _copy_step(reference, 4, os.path.join(ckpt, "6"), committed=False)

    manager = checkpointing.Checkpointer(ckpt, keep=10, num_workers=8, on_worker_change="error")
    assert manager.latest_step() == 4
    manager.close()
    assert os.path.isdir(os.path.join(ckpt, "6.uncommitted"))
    assert not os.path.exists(os.path.join(ckpt, "6"))

    summary = train.train_and_evaluate(small_digits(**CONFIG), workdir)
    assert summary.step == 12
    chex.assert_trees_all_equal(train.final_state(workdir), train.final_state(reference))
    steps = [r["step"] for r in metrics_lib.read_metrics(workdir) if r["split"] == "train"]
    assert steps == list(range(5, 13))  # resumed after step 4


def test_final_state_skips_uncommitted_steps(reference, tmp_path):
    workdir = str(tmp_path / "run")
    ckpt = os.path.join(workdir, "checkpoints")
    _copy_step(reference, 4, os.path.join(ckpt, "4"))
    _copy_step(reference, 8, os.path.join(ckpt, "8"), committed=False)
    chex.assert_trees_all_equal(train.final_state(workdir), train.final_state(reference, 4))
    os.remove(os.path.join(ckpt, "4", checkpointing.COMMIT_MARKER))
    with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
        train.final_state(workdir)


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_and_resume_is_bit_identical(reference, tmp_path):
    workdir = str(tmp_path / "run")
    seen: list[int] = []

    def preempt_after_step_5():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            path = os.path.join(workdir, "metrics.jsonl")
            if os.path.exists(path) and any(
                r["step"] >= 5 for r in metrics_lib.read_metrics(workdir)
            ):
                seen.append(max(r["step"] for r in metrics_lib.read_metrics(workdir)))
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.005)

    # If the signal came after the run, pytest must not die of it.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    sender = threading.Thread(target=preempt_after_step_5, daemon=True)
    try:
        sender.start()
        first = train.train_and_evaluate(small_digits(**CONFIG), workdir)
    finally:
        sender.join(timeout=300)
        signal.signal(signal.SIGTERM, previous)
    assert seen and first.preempted
    assert seen[0] <= first.step < 12
    latest = checkpointing.latest_complete_step(
        os.path.join(workdir, "checkpoints"), range(first.step + 1)
    )
    assert latest == first.step  # saved where it stopped, regular checkpoint or not

    second = train.train_and_evaluate(small_digits(**CONFIG), workdir)
    assert second.step == 12 and not second.preempted
    chex.assert_trees_all_equal(train.final_state(workdir), train.final_state(reference))


@pytest.mark.slow
def test_worker_count_change_mid_run_keeps_training(tmp_path):
    """8 workers for 60 steps, then 4 workers (policy "average") to step 120.

    The global batch stays 128 (32 per worker), so the data stream is unchanged; the
    residuals of the 8 old workers are averaged into the 4 new ones. Uninterrupted, the
    8-worker run reaches 95 % eval accuracy at step 120 (measured).
    """
    workdir = str(tmp_path / "run")
    common = {"num_steps": 120, "eval_every": 30, "log_every": 10, "checkpoint_every": 30}
    first = train.train_and_evaluate(small_digits(**common), workdir, halt_after_step=60)
    assert first.step == 60
    fewer = small_digits(
        num_workers=4, batch_size_per_worker=32, on_worker_change="average", **common
    )
    second = train.train_and_evaluate(fewer, workdir)
    assert second.step == 120
    evals = {r["step"]: r for r in metrics_lib.read_metrics(workdir) if r["split"] == "eval"}
    assert evals[90]["loss"] < evals[60]["loss"] and evals[120]["loss"] < evals[60]["loss"]
    assert second.eval["accuracy"] >= 0.9, second.eval
    state = train.final_state(workdir)
    residuals = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim >= 3]
    assert residuals and all(r.shape[0] == 4 for r in residuals)
    assert all(np.isfinite(r).all() for r in residuals if np.issubdtype(r.dtype, np.floating))
