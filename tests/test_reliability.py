"""The training program under faults, in one process: half-written checkpoints, SIGTERM,
and a change of the number of workers. (Several processes: tests/test_multiprocess.py.)
"""

from __future__ import annotations

import dataclasses
import logging
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
from train.local_job import ROOT, program_env

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


@pytest.mark.xdist_group("reliability_reference")  # one worker runs `reference` once
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


@pytest.mark.xdist_group("reliability_reference")  # one worker runs `reference` once
def test_final_state_skips_uncommitted_steps(reference, tmp_path):
    workdir = str(tmp_path / "run")
    ckpt = os.path.join(workdir, "checkpoints")
    _copy_step(reference, 4, os.path.join(ckpt, "4"))
    _copy_step(reference, 8, os.path.join(ckpt, "8"), committed=False)
    chex.assert_trees_all_equal(train.final_state(workdir), train.final_state(reference, 4))
    os.remove(os.path.join(ckpt, "4", checkpointing.COMMIT_MARKER))
    with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
        train.final_state(workdir)


@pytest.mark.xdist_group("reliability_reference")  # one worker runs `reference` once
def test_final_state_reads_a_checkpoint_without_warnings(reference, caplog):
    """Every item of a checkpoint (the state and its JSON meta) has its handler, so reading
    one, as fine-tuning's ``init_from`` does, logs no orbax warning about the meta item."""
    with caplog.at_level(logging.WARNING):
        state = train.final_state(reference)
    assert set(state) == {"params", "opt_state", "model_state"}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.xdist_group("reliability_reference")  # one worker runs `reference` once
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


# ------------------------------------------------------------------ benchmarks/faults.py
# The campaign itself runs for about 20 minutes; a smoke run of its --quick mode (2 runs,
# 1 process, 8 steps: 38 s on 2 idle cores) and checks of its seeded draws and bitwise check.


@pytest.mark.slow
def test_fault_campaign_quick_mode_resumes_bit_identically(tmp_path):
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "faults.py", "--quick", f"--workdir={tmp_path}"],
        cwd=os.path.join(ROOT, "benchmarks"),
        env=program_env(),  # this checkout's train package, whatever is installed
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "reliability.json") as f:
        results = json.load(f)
    (campaign,) = results["campaigns"].values()
    summary = campaign["summary"]
    assert summary["tried"] == summary["resumed"] == summary["identical"] == 2, summary
    assert [r["index"] for r in campaign["runs"]] == [0, 1]
    assert "| kills tried |" in (tmp_path / "reliability.md").read_text()


def _faults_module():
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import faults

    return faults


def test_fault_draws_are_seeded_and_cover_every_kind():
    faults = _faults_module()
    draws = [faults.draw(0, i, faults.CONFIGS) for i in range(60)]
    assert draws == [faults.draw(0, i, faults.CONFIGS) for i in range(60)]  # replayable
    assert draws != [faults.draw(1, i, faults.CONFIGS) for i in range(60)]
    assert {d.config for d in draws} == set(faults.CONFIGS)
    assert {d.processes for d in draws} == {1, 2}
    assert {d.signal for d in draws} == {"SIGKILL", "SIGTERM"}
    assert {d.moment for d in draws} == {"time", "checkpoint"}
    assert any(d.target is not None for d in draws) and any(d.target is None for d in draws)
    checkpoint_steps = {4, 8, 12, 16}
    for d in draws:
        assert d.target is None or (d.processes == 2 and d.target in (0, 1))
        assert 0 <= d.at < 0.95 if d.moment == "time" else d.at in checkpoint_steps
        assert not d.injections or d.config == "default"  # images only
        for step, row, value in d.injections:
            assert 0 <= step < 16 and 0 <= row < 32 and value in ("nan", "inf", "-inf")
    assert any(d.injections for d in draws)
    assert all(d.processes == 1 for d in (faults.draw(0, i, faults.QUICK, (1,)) for i in range(9)))


def test_first_difference_compares_bits_and_names_the_leaf():
    faults = _faults_module()
    state = {"params": {"w": np.zeros(3, np.float32)}, "opt_state": [np.ones((2, 3))]}
    same = jax.tree.map(np.copy, state)
    assert faults.first_difference(state, same) is None
    signed = jax.tree.map(np.copy, state)
    signed["params"]["w"][1] = -0.0  # equal as numbers, not as bits
    assert faults.first_difference(state, signed) == "['params']['w']"
    residual = jax.tree.map(np.copy, state)
    residual["opt_state"][0] = residual["opt_state"][0].astype(np.float32)
    assert faults.first_difference(state, residual) == "['opt_state'][0]"


def test_a_campaign_over_other_configs_keeps_the_default_draws_and_its_own_section(tmp_path):
    """--configs default_hier: CONFIGS' runs draw as before; results stored side by side."""
    import json

    faults = _faults_module()
    chosen = {name: faults.ALL_CONFIGS[name] for name in ("default", "byte_gpt")}
    assert [faults.draw(0, i, chosen) for i in range(30)] == [
        faults.draw(0, i, faults.CONFIGS) for i in range(30)
    ]
    hier = {"default_hier": faults.ALL_CONFIGS["default_hier"]}
    draws = [faults.draw(1, i, hier) for i in range(30)]
    assert {d.processes for d in draws} == {1, 2} and any(d.injections for d in draws)
    assert hier["default_hier"]["local_devices"] == 2
    assert faults.config_file("default_hier") == "default"

    def payload(config: str) -> dict:
        fault = faults.draw(0, 0, {config: faults.ALL_CONFIGS[config]})
        record = {**dataclasses.asdict(fault), "describe": fault.describe()}
        return {
            "args": {"runs": 1, "seed": 0},
            "date": "2026-11-24",
            "cpu_count": 2,
            "wall_s": 60.0,
            "configs": faults.ALL_CONFIGS,
            "summary": faults.summarize([record]),
            "runs": [record],
        }

    # A file of one campaign (as before --configs) is read as the campaign over CONFIGS.
    (tmp_path / "reliability.json").write_text(json.dumps(payload("default")))
    merged = faults.merge(tmp_path, "default_hier", payload("default_hier"))
    assert list(merged["campaigns"]) == [faults.DEFAULT_CAMPAIGN, "default_hier"]
    text = faults.markdown(merged)
    assert text.count("| kills tried |") == 2
    assert "## Fault campaign (`benchmarks/faults.py`)" in text
    assert "--configs default_hier --runs 1 --seed 0" in text
    assert "<!-- prose: campaign -->" in text and "<!-- prose: campaign-default_hier -->" in text


@pytest.mark.parametrize(
    "argv",
    [["--quick", "--seed", "3"], ["--seed", "2"], ["--configs", "default_hier", "--seed", "1"]],
)
def test_the_printed_replay_command_draws_the_run_it_reports(argv):
    """Each run's replay command (the report's) runs that very fault on that very job."""
    faults = _faults_module()
    campaign = faults.setup(faults.parse_args(argv))
    key = faults.campaign_key(campaign.configs)
    recorded = {"runs": campaign.runs, "seed": int(argv[-1]), "quick": "--quick" in argv}
    recorded["configs"] = sorted(campaign.configs)
    assert faults.setup(faults.parse_args(faults.command(key, recorded).split()[2:])) == campaign
    for index in campaign.indices:
        fault = campaign.fault(recorded["seed"], index)
        replay_argv = faults.command(key, recorded, index).split()[2:]
        replay = faults.setup(faults.parse_args(replay_argv))
        assert replay.indices == [index]
        assert replay.fault(recorded["seed"], index) == fault
        assert replay.configs[fault.config] == campaign.configs[fault.config]  # same job
