"""The training program as one job of several processes on this machine.

:class:`LocalJob` starts ``python -m train`` as ``num_processes`` processes that form one
``jax.distributed`` job on 127.0.0.1 (gloo CPU collectives; ``docs/design.md``,
"Multi-process runs on one machine"), each simulating ``num_workers / num_processes``
devices and feeding its own rows of every global batch, and reads what they report: their
output, the steps in ``metrics.jsonl``, the params digests, the committed checkpoints.
The multi-process tests and ``benchmarks/faults.py`` run their jobs with it.

Only the standard library is imported here (JAX is not), so that a launcher stays light.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "DIGEST",
    "RESUMED",
    "ROOT",
    "STOPPED",
    "LocalJob",
    "committed_steps",
    "free_port",
    "program_env",
]

#: The repository root: the processes run there, so ``config`` paths are relative to it.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT_S = 180  # import, distributed start-up and compilation, on a loaded machine
RUN_TIMEOUT_S = 300

# What the program prints (train/train.py): each process's params digest at the end, the
# step a SIGTERM stopped at, the step a relaunch resumed from.
DIGEST = re.compile(r"Process (\d+): params sha256 ([0-9a-f]{64})")
STOPPED = re.compile(r"Stopping: checkpointed step (\d+)\.")
RESUMED = re.compile(r"Resumed from checkpoint at step (\d+)")


# The flags of resireduce_jax.runtime.cpu_flags that the training program derives from its
# own config and command line (devices per process from num_workers / processes,
# --collective_timeout_s): a caller's must not win over them (runtime.configure_cpu keeps
# flags already set). Named here, not imported: importing the package would import JAX.
_PROGRAM_XLA_FLAGS = ("--xla_force_host_platform_device_count=", "--xla_cpu_collective_call_")


def program_env(**extra: str) -> dict[str, str]:
    """This process's environment for a started training program: ``PYTHONPATH`` at this
    checkout, output unbuffered, and ``XLA_FLAGS`` without the flags the program sets for
    itself (:data:`_PROGRAM_XLA_FLAGS`); the caller's other XLA flags (a compile option,
    a dump directory) pass through. ``extra`` is added last."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    kept = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(_PROGRAM_XLA_FLAGS)]
    if kept:
        env["XLA_FLAGS"] = " ".join(kept)
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def committed_steps(workdir: str) -> list[int]:
    """The steps of ``workdir``'s checkpoints that orbax finished writing, ascending."""
    from train import checkpointing  # JAX only when asked

    return checkpointing.committed_steps(os.path.join(workdir, "checkpoints"))


class LocalJob:
    """``num_processes`` processes of the training program on 127.0.0.1, as one job.

    Use as a context manager: leaving the block kills every process still running.
    Output of process ``i`` goes to ``<workdir>.run<n>.p<i>.log`` (``n``: the how-manyth
    job in this workdir). ``config`` is relative to the repository root; ``overrides``
    become ``--config.KEY=VALUE`` flags and ``flags`` are passed as they are. ``program``
    replaces ``-m train`` (e.g. ``-c SOURCE ARGS...`` to wrap the program).
    """

    def __init__(
        self,
        workdir: str,
        num_processes: int,
        overrides: dict[str, Any],
        flags: Sequence[str] = (),
        *,
        program: Sequence[str] = ("-m", "train"),
        config: str = "configs/default.py",
    ):
        self.workdir = str(workdir)
        self.num_processes = num_processes
        self.procs: list[subprocess.Popen] = []
        launch = 0  # jobs resumed in the same workdir get their own logs
        while os.path.exists(f"{self.workdir}.run{launch}.p0.log"):
            launch += 1
        self.log_paths = [f"{self.workdir}.run{launch}.p{i}.log" for i in range(num_processes)]
        os.makedirs(os.path.dirname(os.path.abspath(self.workdir)), exist_ok=True)
        port = free_port()
        env = program_env()
        args = [f"--config={config}", f"--workdir={self.workdir}"]
        args += [f"--config.{k}={v}" for k, v in overrides.items()]
        args += list(flags)
        try:
            for i in range(num_processes):
                multi = []
                if num_processes > 1:
                    multi = [
                        f"--coordinator_address=127.0.0.1:{port}",
                        f"--num_processes={num_processes}",
                        f"--process_id={i}",
                    ]
                with open(self.log_paths[i], "wb") as log:
                    self.procs.append(
                        subprocess.Popen(
                            [sys.executable, *program, *args, *multi],
                            cwd=ROOT,
                            env=env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        )
                    )
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def kill(self) -> None:
        """SIGKILLs every process of this job that is still running, and reaps it."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=30)  # SIGKILL cannot be ignored

    def send(self, sig: int, processes: Sequence[int] | None = None) -> None:
        """Sends ``sig`` to the given processes (all by default) that are still running."""
        for i, p in enumerate(self.procs):
            if (processes is None or i in processes) and p.poll() is None:
                p.send_signal(sig)

    def last_step(self) -> int:
        """The newest training step process 0 has logged (0 if none)."""
        path = os.path.join(self.workdir, "metrics.jsonl")
        if not os.path.exists(path):
            return 0
        step = 0
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line being written
                    continue
                if record.get("split") == "train":
                    step = max(step, int(record["step"]))
        return step

    def wait_for_step(self, step: int, timeout: float = STARTUP_TIMEOUT_S) -> int:
        """Blocks until metrics show ``step`` (returns the step seen); fails on exit/timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = self.last_step()
            if seen >= step:
                return seen
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError(
                    f"A process exited before step {step}:\n{self.output(0)[-3000:]}"
                )
            time.sleep(0.02)
        raise AssertionError(f"No step {step} after {timeout} s:\n{self.output(0)[-3000:]}")

    def wait(self, timeout: float = RUN_TIMEOUT_S, processes: Sequence[int] | None = None):
        """Exit codes of the given processes (all by default); fails if one outlives ``timeout``."""
        deadline = time.monotonic() + timeout
        codes = []
        for i, p in enumerate(self.procs):
            if processes is not None and i not in processes:
                continue
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"Process {i} still running after {timeout} s (hang):\n{self.output(i)[-3000:]}"
                ) from None
        return codes

    def output(self, i: int) -> str:
        """Everything process ``i`` printed so far (stdout and stderr)."""
        with open(self.log_paths[i], errors="replace") as f:
            return f.read()

    def digests(self) -> dict[int, str]:
        """The params digest each process printed at its end, by process index."""
        found = {}
        for i in range(self.num_processes):
            for pid, digest in DIGEST.findall(self.output(i)):
                found[int(pid)] = digest
        return found
