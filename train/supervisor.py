"""The parent process of a multi-process run: runs the training as a child, reports its fate.

When a peer dies, JAX aborts every other process from a C++ thread, beyond Python's reach.
So the process a user starts stays a thin parent that does not import JAX.
It re-runs its command line as a child, relays its output and reports how it ended.
A lost peer or one that never connected exits with EXIT_PEER_LOST, with a resume command.
JAX's own report goes to <workdir>/crash.p<process>.log, not the terminal.
Why, and how the child reports: docs/design.md, "A lost peer" and "The supervisor
(train/supervisor.py)".
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import BinaryIO

__all__ = [
    "CHILD_ENV",
    "EXIT_PEER_LOST",
    "Diagnosis",
    "JobInfo",
    "diagnose",
    "in_child",
    "notify",
    "notify_step",
    "peer_failures",
    "report",
    "start_child",
    "supervise",
]

#: Exit status of a process whose peer was lost or never connected: EX_TEMPFAIL of
#: sysexits.h ("temporary failure, the user is invited to retry"): resume the job.
EXIT_PEER_LOST = 75
#: Environment variable that gives the child the file descriptor of its progress pipe.
CHILD_ENV = "RR_SUPERVISOR_FD"
_PARENT_ENV = "RR_SUPERVISOR_PID"

# What the child prints before the traceback of a collective that lost its peer.
_PEER_FAILURE_MARK = "A collective failed because a peer process is gone"
# Where JAX's fatal path starts in the child's stderr: an absl FATAL record, an ERROR
# record of the coordination service (every one of them is followed by the fatal one in
# this program: errors are propagated to all tasks and end them), or the other ways a
# process reports its own crash.
_CRASH_START = re.compile(
    rb"F\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]"
    rb"|E\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ coordination_service\S*:\d+\]"
    rb"|Fatal Python error:|terminate called after throwing|\*\*\* Check failure stack trace"
    rb"|" + _PEER_FAILURE_MARK.encode()
)
# The coordination service's list of dead tasks: "... unhealthy (stopped sending
# heartbeats):\n1\n2\nThe tasks have crashed ..." (task names or bare indices).
_UNHEALTHY = re.compile(
    r"unhealthy \(stopped sending heartbeats\):\s*(.*?)(?:The tasks have crashed|\[type\.|$)",
    re.S,
)
_TASK_INDEX = re.compile(r"(?:task:)?\b(\d+)\b")
# The same loss as the coordination service words it inside another error (a failed
# shutdown barrier, after a collective of this process failed): "Task 1 heartbeat timeout".
# That error can be the fatal one, and its thread can abort the process before the
# service's own "unhealthy" line is written.
_HEARTBEAT_TIMEOUT = re.compile(r"\bTask (?:\S*task:)?(\d+) heartbeat timeout")
# The coordinator's service is gone: the long-polling error RPC or a heartbeat RPC fails.
_COORDINATOR_GONE = re.compile(
    r"(?:PollForError|Heartbeat)[\s\S]*?(?:Socket closed|Connection refused|Connection reset"
    r"|failed to connect|UNAVAILABLE)"
    r"|(?:Socket closed|Connection refused|UNAVAILABLE)[\s\S]*?(?:PollForError|Heartbeat)"
)
_REGISTRATION_FAILED = re.compile(r"RegisterTask|Barrier timed out|connect to the coordinator")
# A collective that failed in Python (gloo) because the other side went away.
_PEER_CONNECTION = re.compile(r"Connection (?:reset|closed) by peer|Gloo.*(?:closed|reset)")
_MAX_KEPT = 256 * 1024  # bytes of the child's stderr kept for the diagnosis


@dataclasses.dataclass(frozen=True)
class JobInfo:
    """What the report needs to know about this process's place in the job."""

    workdir: str
    process_id: int
    num_processes: int
    coordinator_address: str | None
    collective_timeout_s: int
    initialization_timeout_s: int
    command: Sequence[str]  # how the user started this process (shown as the resume command)


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What ended the child, read from its last words.

    ``kind``: ``"peer_lost"`` (a peer died after the job had connected),
    ``"never_connected"`` (the job did not form within the initialization timeout) or
    ``"crash"`` (anything else). ``lost``: the indices of the lost processes, when known.
    ``how``: how the loss showed: ``"heartbeat"`` (the coordination service missed its
    heartbeats), ``"connection"`` (the coordinator's connection closed) or
    ``"collective"`` (a collective's connection was closed by the peer).
    """

    kind: str
    lost: tuple[int, ...] = ()
    how: str = ""


def diagnose(text: str, *, connected: bool, process_id: int, num_processes: int) -> Diagnosis:
    """Reads the fate of a child from its stderr (``text``): see :class:`Diagnosis`."""
    if not connected and _REGISTRATION_FAILED.search(text):
        missing = tuple(i for i in range(num_processes) if i != process_id)
        return Diagnosis("never_connected", missing if process_id == 0 else (0,))
    lost = set()
    for found in _UNHEALTHY.finditer(text):
        lost.update(int(i) for i in _TASK_INDEX.findall(found.group(1)))
    lost.update(int(i) for i in _HEARTBEAT_TIMEOUT.findall(text))
    lost.discard(process_id)
    if lost:
        return Diagnosis("peer_lost", tuple(sorted(lost)), "heartbeat")
    if process_id != 0 and _COORDINATOR_GONE.search(text):
        return Diagnosis("peer_lost", (0,), "connection")
    if connected and _PEER_CONNECTION.search(text):
        return Diagnosis("peer_lost", (), "collective")
    return Diagnosis("crash")


# ------------------------------------------------------------------ the child's side


def in_child() -> bool:
    """Whether this process is the training child of a supervising parent."""
    return CHILD_ENV in os.environ


def notify(event: str) -> None:
    """Tells the supervising parent ``event`` (``"ready"`` or ``"step N"``); no-op unsupervised.

    Never blocks: the pipe is non-blocking and the parent reads it continuously; an event
    that does not fit, or a parent that is gone, is ignored.
    """
    fd = os.environ.get(CHILD_ENV)
    if fd is None:
        return
    # A full pipe (parent slow) or a closed one (parent gone): progress is advisory.
    with contextlib.suppress(OSError):
        os.write(int(fd), f"{event}\n".encode())


def notify_step(step: int) -> None:
    """:func:`notify` of a finished training step (the loop's step callback)."""
    notify(f"step {step}")


@contextlib.contextmanager
def peer_failures() -> Iterator[None]:
    """In the child: an error of a collective whose peer is gone goes to the crash log.

    A gloo collective may fail at once with "Connection reset by peer" when a peer
    dies, before the coordination service declares the peer dead. That is not a bug to
    show as a traceback: this marks the start of the crash report on stderr (the parent
    diverts what follows to the crash log) and lets the error propagate; the process then
    ends in JAX's shutdown, whose report names the lost process.
    """
    try:
        yield
    except Exception as error:
        if in_child() and _PEER_CONNECTION.search(str(error)):
            print(f"{_PEER_FAILURE_MARK}: {type(error).__name__}", file=sys.stderr, flush=True)
        raise


def start_child() -> None:
    """First thing in the child: make the progress pipe non-blocking and, on Linux, have
    the kernel SIGKILL this process when its parent dies (so that killing the process the
    user started never leaves a training child behind)."""
    os.set_blocking(int(os.environ[CHILD_ENV]), False)
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != int(os.environ[_PARENT_ENV]):  # the parent is already gone
        os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------ the parent's side


class _StderrRelay(threading.Thread):
    """Copies the child's stderr to ours until JAX's fatal path starts, then to a file."""

    def __init__(self, source: BinaryIO, crash_log: str):
        super().__init__(name="stderr-relay", daemon=True)
        self._source = source
        self._crash_log = crash_log
        self._kept: collections.deque[bytes] = collections.deque()
        self._kept_bytes = 0
        self.crash_started = False
        self.crash_log_written = False
        self.mid_line = False  # the last byte relayed did not end a line (e.g. a progress bar)

    def _keep(self, data: bytes) -> None:
        self._kept.append(data)
        self._kept_bytes += len(data)
        while self._kept_bytes > _MAX_KEPT and len(self._kept) > 1:
            self._kept_bytes -= len(self._kept.popleft())

    def text(self) -> str:
        """The last bytes of the child's stderr (crash report included), decoded."""
        return b"".join(self._kept).decode(errors="replace")

    def _to_crash_log(self, data: bytes, log) -> object:
        if log is None:
            os.makedirs(os.path.dirname(self._crash_log) or ".", exist_ok=True)
            log = open(self._crash_log, "ab")  # noqa: SIM115 (closed in run)
            stamp = datetime.datetime.now().isoformat(timespec="seconds")
            log.write(f"==== {stamp}: the training process's report ====\n".encode())
            self.crash_log_written = True
        log.write(data)
        log.flush()
        return log

    def run(self) -> None:
        out = sys.stderr.buffer
        log = None
        try:
            fd = self._source.fileno()
            while data := os.read(fd, 65536):
                self._keep(data)
                if not self.crash_started:
                    start = _CRASH_START.search(data)
                    relayed = data if start is None else data[: start.start()]
                    if relayed:
                        out.write(relayed)
                        out.flush()
                        self.mid_line = not relayed.endswith(b"\n")
                    if start is None:
                        continue
                    data = data[start.start() :]
                    self.crash_started = True
                log = self._to_crash_log(data, log)
        finally:
            if log is not None:
                log.close()


class _ProgressReader(threading.Thread):
    """Reads the child's events: whether it connected, and the last step it finished."""

    def __init__(self, fd: int):
        super().__init__(name="progress-reader", daemon=True)
        self._fd = fd
        self.connected = False
        self.step: int | None = None

    def run(self) -> None:
        pending = b""
        with os.fdopen(self._fd, "rb", buffering=0) as pipe:
            while data := pipe.read(65536):
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if line == b"ready":
                        self.connected = True
                    elif line.startswith(b"step "):
                        self.step = int(line[5:])


def _last_complete_checkpoint(workdir: str) -> int | None:
    from train import checkpointing  # JAX is imported only now, to report a failure

    steps = checkpointing.committed_steps(os.path.join(workdir, "checkpoints"))
    return steps[-1] if steps else None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def report(
    job: JobInfo,
    diagnosis: Diagnosis,
    *,
    step: int | None,
    child_status: int,
    crash_log: str | None,
) -> tuple[str, int]:
    """The message printed for a failed child, and the exit status of this process."""
    me, n = job.process_id, job.num_processes
    after = f"at step {step}" if step is not None else "before its first step"
    coordinator = f"the coordinator at {job.coordinator_address}"
    if diagnosis.kind == "never_connected":
        timeout = f"within {job.initialization_timeout_s} s (--initialization_timeout_s)"
        if me == 0 and diagnosis.lost:
            names = ", ".join(str(i) for i in diagnosis.lost)
            what = (
                f"process {names} of {n} never connected to {coordinator} {timeout}; "
                f"this process ({me}) waited for it and stopped"
                if len(diagnosis.lost) == 1
                else f"not all of processes {names} of {n} connected to {coordinator} "
                f"{timeout}; this process ({me}) stopped"
            )
        else:
            what = (
                f"process {me} of {n} could not join the job at {job.coordinator_address} "
                f"{timeout}: the coordinator (process 0) or another process did not start"
            )
        head, status = f"{what}. Nothing was trained.", EXIT_PEER_LOST
    elif diagnosis.kind == "peer_lost":
        if diagnosis.lost:
            names = " and ".join(str(i) for i in diagnosis.lost)
            plural = "es" if len(diagnosis.lost) > 1 else ""
            lost = f"process{plural} {names} of {n}"
            if diagnosis.lost == (0,):
                lost += f" ({coordinator})"
        else:
            lost = f"a peer process of the {n}"
        how = {
            "heartbeat": f": it sent no heartbeat for {job.collective_timeout_s} s "
            "(--collective_timeout_s)",
            "connection": ": its connection closed",
            "collective": ": a collective's connection was closed by the peer",
        }.get(diagnosis.how, "")
        head = f"lost {lost} {after}{how}; this process ({me}) stopped too."
        status = EXIT_PEER_LOST
    else:
        ended = (
            f"was killed by {_signal_name(child_status)}"
            if child_status < 0
            else f"exited with status {child_status}"
        )
        head, status = f"the training of process {me} {ended} {after}.", 1
    latest = _last_complete_checkpoint(job.workdir)
    checkpoints = os.path.join(os.path.abspath(job.workdir), "checkpoints")
    saved = (
        f"Last complete checkpoint: step {latest} in {checkpoints}."
        if latest is not None
        else "No complete checkpoint yet: a restart begins at step 0."
    )
    every = f"all {n} processes" if n > 1 else "the run"
    lines = [
        f"error: {head}",
        f"{saved} To resume, start {every} again with the same flags; this one:",
        f"  {shlex.join(job.command)}",
    ]
    if crash_log:
        lines.append(f"JAX's own report: {crash_log}")
    return "\n".join(lines), status


def supervise(job: JobInfo, child_command: Sequence[str]) -> int:
    """Runs ``child_command`` as the training child of this process; returns our exit status.

    The child's exit status 0 (done, or stopped by SIGTERM), 1 (a Python error, its
    traceback already printed) and 2 (a user error, already printed) are passed on as they
    are; a child that died of a lost peer or crashed is reported by :func:`report`.
    """
    crash_log = os.path.join(job.workdir, f"crash.p{job.process_id}.log")
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, **{CHILD_ENV: str(write_fd), _PARENT_ENV: str(os.getpid())})
    try:
        child = subprocess.Popen(
            list(child_command), stderr=subprocess.PIPE, env=env, pass_fds=(write_fd,)
        )
    finally:
        os.close(write_fd)
    relay = _StderrRelay(child.stderr, crash_log)
    progress = _ProgressReader(read_fd)
    relay.start()
    progress.start()
    # SIGTERM (preemption) goes to the child, which checkpoints and exits 0. Ctrl-C
    # reaches the child from the terminal (same process group); we wait for its end.
    forwarded: set[int] = set()

    def forward(signum: int, frame: object) -> None:
        del frame
        if child.poll() is None:
            forwarded.add(signum)
            child.send_signal(signum)

    handlers = {signal.SIGTERM: forward, signal.SIGINT: lambda signum, frame: None}
    previous = {s: signal.signal(s, handler) for s, handler in handlers.items()}
    try:
        status = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    relay.join(timeout=10)
    progress.join(timeout=10)
    if status in (0, 2):  # done, preempted, or a user error (already printed)
        return status
    if -status in forwarded:  # our SIGTERM ended the child before it could checkpoint:
        signal.signal(-status, signal.SIG_DFL)  # end the same way, as if unsupervised
        os.kill(os.getpid(), -status)
    if status == 1 and not relay.crash_started and not _PEER_CONNECTION.search(relay.text()):
        return status  # a Python error: its traceback is already printed
    diagnosis = diagnose(
        relay.text(),
        connected=progress.connected,
        process_id=job.process_id,
        num_processes=job.num_processes,
    )
    message, code = report(
        job,
        diagnosis,
        step=progress.step,
        child_status=status,
        crash_log=crash_log if relay.crash_log_written else None,
    )
    print(("\n" if relay.mid_line else "") + message, file=sys.stderr, flush=True)
    return code
