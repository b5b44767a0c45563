"""A lost peer ends the other processes of a job cleanly (train/supervisor.py).

The real program runs as 2 processes on 127.0.0.1 (``train.local_job.LocalJob``); one is
SIGKILLed mid-run, or never started. The survivor must stop within the timeout with exit
status ``supervisor.EXIT_PEER_LOST`` (not an abort), print one message naming the lost
process, the step, the last complete checkpoint and the command that resumes, keep JAX's
C++ report and thread dump out of the console (they go to the crash log), and leave
metrics.jsonl and TensorBoard flushed. The same holds when the job runs the hierarchical
exchange with one process per node (``local_devices``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import signal
import struct
import subprocess
import sys
import time

import pytest

from tests.test_multiprocess import JOB
from train import supervisor
from train.local_job import ROOT, LocalJob, committed_steps, program_env

TIMEOUT_S = 5  # --collective_timeout_s: the survivor stops this long after the loss
# Long enough that the kill lands mid-run; checkpoints every 6 steps.
ENDLESS = {**JOB, "num_steps": 100_000}
LOST = re.compile(r"^error: lost process (\d+) of 2.* at step (\d+)[:;]", re.M)
CHECKPOINT = re.compile(r"Last complete checkpoint: step (\d+) in (\S+)\.")
NOISE = ("Fatal Python error", "Thread 0x", "Check failure stack trace", "Traceback", "F1")


def tensorboard_steps(workdir: str) -> list[int]:
    """Steps of the scalar events in ``<workdir>/tensorboard`` (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    steps = []
    for path in glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*")):
        with open(path, "rb") as f:
            data = f.read()
        i = 0
        while i + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + length])
            i += 12 + length + 4
            if event.summary.value:
                steps.append(event.step)
    return steps


def _last_metrics_line(workdir: str) -> dict:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        text = f.read()
    assert text.endswith("\n"), text[-200:]
    return json.loads(text.splitlines()[-1])


def _wait_for_a_committed_checkpoint(workdir: str, timeout: float = 120) -> None:
    """Until a checkpoint is committed (on a loaded machine, step 6's write can outlast
    step 8: a kill then rightly reports "No complete checkpoint yet")."""
    deadline = time.monotonic() + timeout
    while not committed_steps(workdir):
        assert time.monotonic() < deadline, f"no committed checkpoint in {timeout} s"
        time.sleep(0.05)


def _crash_log(workdir: str, process: int) -> str:
    """The tail of a process's crash log (what JAX and the collectives printed)."""
    path = os.path.join(workdir, f"crash.p{process}.log")
    if not os.path.exists(path):
        return "\n(no crash log)"
    with open(path, errors="replace") as f:
        return "\n--- " + path + " ---\n" + f.read()[-3000:]


def _check_console(out: str) -> str:
    """The survivor's console: one clean error block; returns it."""
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1, out[-3000:]
    for noise in NOISE:
        assert noise not in out, (noise, out[-3000:])
    return out[out.index("error:") :]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("victim", "layout"),
    [(1, {}), (0, {}), (1, {"local_devices": 2})],
    ids=["worker_lost", "coordinator_lost", "node_lost_hierarchical"],
)
def test_killed_peer_ends_the_survivor_with_one_clear_message(tmp_path, victim, layout):
    """``layout``: the hierarchical exchange, 2 nodes x 2 devices, each process one node."""
    workdir = str(tmp_path / "run")
    survivor = 1 - victim
    job_config = {**ENDLESS, **layout}
    with LocalJob(workdir, 2, job_config, [f"--collective_timeout_s={TIMEOUT_S}"]) as job:
        seen = job.wait_for_step(8)  # past the first checkpoint (step 6) ...
        _wait_for_a_committed_checkpoint(workdir)  # ... whose async write may still run
        job.send(signal.SIGKILL, processes=[victim])
        killed = time.monotonic()
        (code,) = job.wait(timeout=TIMEOUT_S + 60, processes=[survivor])
        elapsed = time.monotonic() - killed
        out = job.output(survivor)
    print(f"process {survivor} stopped {elapsed:.1f} s after process {victim} was killed")
    # not 134 (abort), not a signal; on failure the child's own crash report says why
    assert code == supervisor.EXIT_PEER_LOST, out[-3000:] + _crash_log(workdir, survivor)
    assert elapsed < TIMEOUT_S + 30

    message = _check_console(out)
    lost, step = map(int, LOST.search(message).groups())
    assert lost == victim
    assert step >= seen
    if victim == 1:
        assert f"no heartbeat for {TIMEOUT_S} s" in message
    latest, directory = CHECKPOINT.search(message).groups()
    assert int(latest) == committed_steps(workdir)[-1] >= 6
    assert directory == os.path.join(workdir, "checkpoints")
    command = message.splitlines()[2].strip()
    assert f"--process_id={survivor}" in command and f"--workdir={workdir}" in command
    for key, value in layout.items():  # the resume keeps the layout
        assert f"--config.{key}={value}" in command
        assert "4 workers as 2 nodes x 2 devices, hierarchical exchange" in out

    crash_log = os.path.join(workdir, f"crash.p{survivor}.log")
    assert f"JAX's own report: {crash_log}" in message
    with open(crash_log) as f:
        assert "Terminating process because the JAX distributed service" in f.read()

    last = _last_metrics_line(workdir)  # flushed: the last line is whole
    assert last["split"] == "train" and last["step"] >= seen
    if victim == 1:  # process 0 writes the metrics and survived until the report
        assert max(tensorboard_steps(workdir)) == last["step"]


@pytest.mark.slow
def test_the_printed_command_resumes_from_the_printed_checkpoint(tmp_path):
    """Resume with the command of the report (the other process: its own process_id)."""
    workdir = str(tmp_path / "run")
    job_config = {**JOB, "num_steps": 30}
    with LocalJob(workdir, 2, job_config, [f"--collective_timeout_s={TIMEOUT_S}"]) as job:
        job.wait_for_step(14)
        job.send(signal.SIGKILL, processes=[1])
        (code,) = job.wait(timeout=TIMEOUT_S + 60, processes=[0])
        message = _check_console(job.output(0))
    assert code == supervisor.EXIT_PEER_LOST
    latest = int(CHECKPOINT.search(message).group(1))
    command = shlex.split(message.splitlines()[2])
    env = program_env()
    commands = [command, [a.replace("--process_id=0", "--process_id=1") for a in command]]
    procs = [
        subprocess.Popen(
            [sys.executable, *argv[1:]],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for argv in commands
    ]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:]
    assert f"Resumed from checkpoint at step {latest}" in outs[0]
    assert committed_steps(workdir)[-1] == job_config["num_steps"]


@pytest.mark.slow
def test_a_peer_that_never_starts_ends_the_other_cleanly(tmp_path):
    workdir = str(tmp_path / "run")
    init_timeout_s = 5
    start = time.monotonic()
    with LocalJob(workdir, 2, JOB, [f"--initialization_timeout_s={init_timeout_s}"]) as job:
        job.send(signal.SIGKILL, processes=[1])  # process 1 dies before it connects
        (code,) = job.wait(timeout=120, processes=[0])
        out = job.output(0)
    elapsed = time.monotonic() - start
    assert code == supervisor.EXIT_PEER_LOST, out[-3000:]
    assert elapsed < 60
    message = _check_console(out)
    assert re.search(
        rf"process 1 of 2 never connected to the coordinator at \S+ within {init_timeout_s} s",
        message,
    ), message
    assert "No complete checkpoint yet" in message and "--process_id=0" in message


# ------------------------------------------------------------------ diagnosis, no processes

HEARTBEAT = (
    "E1124 09:29:44.129604 31107 coordination_service.cc:1549] Use error polling to "
    "propagate the following error to all tasks: UNAVAILABLE: The following tasks are "
    "unhealthy (stopped sending heartbeats):\n2\n3\nThe tasks have crashed.\n"
    "F1124 09:29:44.130076 31118 client.h:80] Terminating process because ..."
)
COORDINATOR_GONE = (
    "F1124 09:33:11.767767 567 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors.\nAdditional GRPC error information from remote target "
    "coordination_service while calling /xla.coordination.CoordinationService/PollForError:"
    '\n:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}'
)
NEVER = (
    "absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\n\n"
    "RPC: /xla.coordination.CoordinationService/RegisterTask"
)
GLOO = (
    "jax.errors.JaxRuntimeError: UNKNOWN: Gloo AllGather failed: Read error: "
    "Connection reset by peer"
)
# A collective of this process failed first; the fatal error is then the shutdown barrier's,
# which can end the process before the service's "unhealthy" line is written.
BARRIER = GLOO + (
    "\nF1125 20:52:42.632321 5810 client.h:80] Terminating process because the JAX "
    "distributed service detected fatal errors. absl::Status: INTERNAL: Shutdown barrier has "
    "failed.\nBarrier result: 'INTERNAL: Barrier failed because: task is set to ERROR: "
    "UNAVAILABLE: Task 1 heartbeat timeout. This indicates that the remote task has failed'"
)


@pytest.mark.parametrize(
    ("text", "connected", "process_id", "expected"),
    [
        (HEARTBEAT, True, 0, supervisor.Diagnosis("peer_lost", (2, 3), "heartbeat")),
        (BARRIER, True, 0, supervisor.Diagnosis("peer_lost", (1,), "heartbeat")),
        (COORDINATOR_GONE, True, 1, supervisor.Diagnosis("peer_lost", (0,), "connection")),
        (NEVER, False, 0, supervisor.Diagnosis("never_connected", (1, 2, 3))),
        (NEVER, False, 2, supervisor.Diagnosis("never_connected", (0,))),
        (GLOO, True, 1, supervisor.Diagnosis("peer_lost", (), "collective")),
        ("Segmentation fault", True, 0, supervisor.Diagnosis("crash")),
    ],
    ids=["heartbeat", "barrier", "coordinator", "never_0", "never_2", "gloo", "crash"],
)
def test_diagnosis_reads_the_childs_last_words(text, connected, process_id, expected):
    got = supervisor.diagnose(text, connected=connected, process_id=process_id, num_processes=4)
    assert got == expected


def test_report_names_process_step_checkpoint_and_command(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for step, committed in ((6, True), (12, True), (18, False)):
        (checkpoints / str(step)).mkdir(parents=True)
        if committed:
            (checkpoints / str(step) / "commit_success.txt").write_text("ok")
    job = supervisor.JobInfo(
        workdir=str(tmp_path),
        process_id=0,
        num_processes=2,
        coordinator_address="127.0.0.1:1234",
        collective_timeout_s=20,
        initialization_timeout_s=120,
        command=["python", "-m", "train", "--workdir=/a b", "--process_id=0"],
    )
    diagnosis = supervisor.Diagnosis("peer_lost", (1,), "heartbeat")
    message, code = supervisor.report(
        job, diagnosis, step=17, child_status=-6, crash_log="/x/crash.p0.log"
    )
    assert code == supervisor.EXIT_PEER_LOST
    assert message.startswith(
        "error: lost process 1 of 2 at step 17: it sent no heartbeat for 20 s"
    )
    assert f"Last complete checkpoint: step 12 in {checkpoints}." in message
    assert "  python -m train '--workdir=/a b' --process_id=0" in message.splitlines()
    _, code = supervisor.report(
        job, supervisor.Diagnosis("crash"), step=3, child_status=-11, crash_log=None
    )
    assert code == 1


# ------------------------------------------------------------------ the parent, no JAX child

FAKE_CHILD = """
import os, sys, time
fd = int(os.environ["RR_SUPERVISOR_FD"])
os.write(fd, b"ready\\nstep 6\\nstep 7\\n")
sys.stderr.write("train: 50%|#####     | 7/14 [00:01<00:01]")
sys.stderr.flush()
if sys.argv[1] == "abort":
    sys.stderr.write(sys.argv[2])
    sys.stderr.flush()
    os.abort()
open(os.path.join(os.environ["FAKE_CHILD_DIR"], "started"), "w").close()
time.sleep(60)
"""
SUPERVISE = """
import sys
from train import supervisor
job = supervisor.JobInfo(sys.argv[1], 0, 4, "127.0.0.1:1", 7, 9, ["train", "--process_id=0"])
sys.exit(supervisor.supervise(job, [sys.executable, "-c", sys.argv[2], *sys.argv[3:]]))
"""


def _supervised(tmp_path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SUPERVISE, str(tmp_path), FAKE_CHILD, *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, FAKE_CHILD_DIR=str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_parent_moves_the_abort_to_the_crash_log_and_reports(tmp_path):
    proc = _supervised(tmp_path, "abort", HEARTBEAT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == supervisor.EXIT_PEER_LOST, err
    assert err.startswith("train: 50%|#####     | 7/14 [00:01<00:01]\nerror: lost process")
    assert "processes 2 and 3 of 4 at step 7: it sent no heartbeat for 7 s" in err
    assert "F1124" not in err and "coordination_service" not in err
    with open(tmp_path / "crash.p0.log") as f:
        crash = f.read()
    assert HEARTBEAT in crash


def test_parent_forwards_sigterm_and_ends_like_its_child(tmp_path):
    proc = _supervised(tmp_path, "sleep")
    deadline = time.monotonic() + 60
    while not os.path.exists(tmp_path / "started") and time.monotonic() < deadline:
        time.sleep(0.05)  # until the child runs: the parent forwards from then on
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err
    assert "error:" not in err
    assert not os.path.exists(tmp_path / "crash.p0.log")
