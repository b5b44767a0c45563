"""Randomized fault campaign: kill the training program at random moments, resume, compare.

Every run ``i`` draws its fault from ``numpy.random.default_rng([seed, i])``, so any run
can be replayed alone (``--replay i``):

* the job: the embedded ``default`` (digits MLP) or ``byte_gpt`` config, cut down to a
  tiny size (:data:`CONFIGS`), on 1 process or 2 processes (``jax.distributed`` on
  127.0.0.1, each process simulating 2 of the 4 workers); ``--configs default_hier``
  instead runs the digits job with the hierarchical exchange (``local_devices=2``: 2 nodes
  x 2 devices, every residual sharded over its node's 2 devices; with 2 processes, each
  process is one node); ``--configs default_int4,default_int8`` runs it with the residuals
  kept as int4 codes (stochastic rounding, blocks of 64) or int8 codes, a scale per block;
* the signal, SIGKILL or SIGTERM, sent to every process or to one of them;
* the moment: uniformly random over the wall time of an uninterrupted run (start-up,
  compilation, steps, evaluation, checkpoint writes alike), or the middle of a
  checkpoint write (as soon as orbax's temporary directory for a random checkpoint step
  appears, plus a random delay of up to 20 ms);
* on the digits configs, one run in three also writes NaN, +Inf or -Inf into one input
  row of one or two random steps (one worker's gradient becomes non-finite).

The run starts the job, delivers the signal, waits for every process to end, resumes
the job in the same workdir and lets it finish. It then checks that the final params,
optimizer state and every worker's residuals equal those of an uninterrupted run of the
same job (same injections) bit for bit (a hierarchical job's residuals: every device's
shard, as the checkpoint holds them), and, where NaN/Inf was injected, that no
checkpoint ever held a non-finite value and the steps were counted as skipped.

Reported: kills tried, runs that resumed, runs bit-identical to the uninterrupted run,
runs lost (not resumable or not identical), the steps recomputed after the resume, the
time to resume (relaunch to the first new step) and how long a survivor took to stop
after losing its peer.

Usage::

    python benchmarks/faults.py                     # 30 runs (about 25 min on 2 busy cores)
    python benchmarks/faults.py --runs 60 --seed 1
    python benchmarks/faults.py --quick             # 2 small runs, results in the workdir
    python benchmarks/faults.py --replay 17         # run 17 of --seed again, logs kept
    python benchmarks/faults.py --quick --replay 1  # run 1 of a --quick campaign
    python benchmarks/faults.py --configs default_hier --runs 12 --seed 1  # hierarchical
    python benchmarks/faults.py --configs default_int4,default_int8 --runs 12  # quantized
    python benchmarks/faults.py --from-json      # re-render reliability.md

A run depends on ``--seed``, ``--quick`` and ``--configs``: a replay needs the same three
(the report prints each run's replay command). A campaign over other ``--configs`` is
stored beside the others: ``reliability.json`` holds every campaign under its key (the
sorted config names joined by commas) and ``reliability.md`` renders each in its own
section.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import RESULTS, environment, rerender, write_results

from train.local_job import RESUMED, STOPPED, LocalJob, committed_steps

# The embedded configs, cut down so that one launch takes seconds: 4 workers, 16 steps,
# a checkpoint every 4 steps (all kept), metrics every step, evaluation only at the end.
COMMON = {
    "num_workers": 4,
    "batch_size_per_worker": 8,
    "num_steps": 16,
    "checkpoint_every": 4,
    "keep_checkpoints": 100,
    "log_every": 1,
    "eval_every": 1000,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "default": dict(COMMON),
    "byte_gpt": {
        **COMMON,
        "batch_size_per_worker": 16,  # fewer evaluation batches (1,457 windows of 32 bytes)
        "model.overrides.num_layers": 1,
        "model.overrides.width": 32,
        "model.overrides.max_len": 32,
        "dataset.context_length": 32,
    },
}
# More jobs, run only when named with --configs (CONFIGS' draws stay as they were).
EXTRA_CONFIGS: dict[str, dict[str, Any]] = {
    # The hierarchical exchange: 2 nodes x 2 devices, residuals sharded over a node's
    # devices; with 2 processes each process is one node.
    "default_hier": {**COMMON, "local_devices": 2},
    # Residuals kept as codes with per-block scales: int4 with stochastic rounding (its
    # keys from the step, so a resumed run must draw the same bits) and int8.
    "default_int4": {**COMMON, "compression.residual_format": "int4/64/stochastic"},
    "default_int8": {**COMMON, "compression.residual_format": "int8"},
}
ALL_CONFIGS = {**CONFIGS, **EXTRA_CONFIGS}
# configs/<file>.py of a job (default: its name)
CONFIG_FILES = {"default_hier": "default", "default_int4": "default", "default_int8": "default"}
_QUICK = {"num_steps": 8, "checkpoint_every": 2}
QUICK = {"default": {**COMMON, **_QUICK}}  # one process only
QUICK_ALL = {**QUICK, **{name: {**ALL_CONFIGS[name], **_QUICK} for name in EXTRA_CONFIGS}}
DEFAULT_CAMPAIGN = ",".join(sorted(CONFIGS))  # the key of a campaign over CONFIGS
# Headings of the campaigns' sections in reliability.md (others: their key).
TITLES = {
    "default_hier": "hierarchical exchange, sharded residuals",
    "default_int4,default_int8": "quantized residuals (int4 stochastic, int8)",
}
COLLECTIVE_TIMEOUT_S = 10  # a survivor of a SIGKILLed peer stops after about this long
INITIALIZATION_TIMEOUT_S = 30  # ... or this long, when the peer died before connecting
RUN_TIMEOUT_S = 600
# The survivor's report (train/supervisor.py): a lost process after the job formed, or,
# when the peer died before it connected, a process that never connected or a coordinator
# that could not be joined.
REPORT = re.compile(r"^error: .*(?:\n  .*|\n[A-Z].*)*", re.M)
NAMED = re.compile(r"^error: (?:lost process (\d+) of|process (\d+) of \d+ never connected)")
COULD_NOT_JOIN = "could not join the job"

# The training program with NaN/Inf written into one image of chosen global batches:
# argv[1] is a JSON list of [step, global row, "nan" | "inf" | "-inf"].
INJECTING_MAIN = """
import json, sys
from train.data import images

injections = {int(s): (int(r), float(v)) for s, r, v in json.loads(sys.argv[1])}
original = images.DigitsDataset._train_examples

def poisoned(self, epochs, indices, *, step, rows, global_batch_size):
    batch = original(self, epochs, indices, step=step, rows=rows,
                     global_batch_size=global_batch_size)
    if step in injections and rows.start <= injections[step][0] < rows.stop:
        row, value = injections[step]
        batch["image"] = batch["image"].copy()
        batch["image"][row - rows.start] = value
    return batch

images.DigitsDataset._train_examples = poisoned
from train import main
sys.argv = ["train", *sys.argv[2:]]
main.cli()
"""


@dataclasses.dataclass(frozen=True)
class Fault:
    """What run ``index`` does (drawn by :func:`draw`)."""

    index: int
    config: str
    processes: int
    signal: str  # "SIGKILL" | "SIGTERM"
    target: int | None  # the process signalled, or None for all of them
    moment: str  # "time" | "checkpoint"
    at: float  # fraction of the uninterrupted job's wall time, or the checkpoint step
    delay_s: float  # extra delay after the checkpoint write was seen
    injections: tuple[tuple[int, int, str], ...]  # (step, global row, value)

    def describe(self) -> str:
        whom = "all" if self.target is None else f"p{self.target}"
        when = f"{self.at:.0%} of run" if self.moment == "time" else f"ckpt {int(self.at)} write"
        nan = f", {len(self.injections)} inj" if self.injections else ""
        return f"{self.config} x{self.processes} {self.signal} {whom} @ {when}{nan}"


def draw(
    seed: int, index: int, configs: dict[str, dict[str, Any]], layouts: tuple[int, ...] = (1, 2)
) -> Fault:
    """The fault of run ``index``: a pure function of ``(seed, index)``, configs and layouts.

    A "time" moment is a fraction of the uninterrupted job's wall time, measured in the
    same campaign (so a replay signals at the same point of the run, not the same second).
    """
    rng = np.random.default_rng([seed, index])
    config = str(rng.choice(sorted(configs)))
    processes = int(rng.choice(layouts))
    sig = str(rng.choice(["SIGKILL", "SIGTERM"]))
    target = None if processes == 1 or rng.random() < 0.5 else int(rng.integers(processes))
    moment = str(rng.choice(["time", "checkpoint"]))
    c = configs[config]
    checkpoints = list(range(c["checkpoint_every"], c["num_steps"] + 1, c["checkpoint_every"]))
    at = float(rng.uniform(0.0, 0.95)) if moment == "time" else float(rng.choice(checkpoints))
    delay_s = float(rng.uniform(0.0, 0.02))
    injections: tuple[tuple[int, int, str], ...] = ()
    if config_file(config) == "default" and rng.random() < 1 / 3:
        rows = c["num_workers"] * c["batch_size_per_worker"]
        steps = rng.choice(c["num_steps"], size=int(rng.integers(1, 3)), replace=False)
        injections = tuple(
            (int(s), int(rng.integers(rows)), str(rng.choice(["nan", "inf", "-inf"])))
            for s in sorted(steps)
        )
    return Fault(index, config, processes, sig, target, moment, at, delay_s, injections)


def config_file(config: str) -> str:
    """The embedded config a job of the campaign runs (``configs/<this>.py``)."""
    return CONFIG_FILES.get(config, config)


# ------------------------------------------------------------------ jobs


def _job(workdir: str, config: str, overrides: dict, processes: int, injections) -> LocalJob:
    flags = [
        f"--collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
        f"--initialization_timeout_s={INITIALIZATION_TIMEOUT_S}",
    ]
    program: tuple[str, ...] = ("-m", "train")
    if injections:
        program = ("-c", INJECTING_MAIN, json.dumps([list(i) for i in injections]))
    return LocalJob(
        workdir,
        processes,
        overrides,
        flags,
        program=program,
        config=f"configs/{config_file(config)}.py",
    )


def _metrics_size(workdir: str) -> int:
    path = os.path.join(workdir, "metrics.jsonl")
    return os.path.getsize(path) if os.path.exists(path) else 0


def _first_new_step_time(workdir: str, offset: int, job: LocalJob) -> float | None:
    """Waits until metrics.jsonl has a record past byte ``offset``; returns when (monotonic)."""
    path = os.path.join(workdir, "metrics.jsonl")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        if _metrics_size(workdir) > offset:
            with open(path) as f:
                f.seek(offset)
                if "\n" in f.read():
                    return time.monotonic()
        if all(p.poll() is not None for p in job.procs):
            return None
        time.sleep(0.01)
    return None


def _checkpoint_dirs(workdir: str) -> list[str]:
    directory = os.path.join(workdir, "checkpoints")
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def _writing(workdir: str, step: int | None = None) -> bool:
    """Whether orbax is writing a checkpoint (of ``step``) right now (its temporary dir)."""
    prefix = "" if step is None else f"{step}."
    return any(
        ".orbax-checkpoint-tmp" in n and n.startswith(prefix) for n in _checkpoint_dirs(workdir)
    )


def run_to_end(workdir, config, overrides, processes, injections) -> tuple[LocalJob, list[int]]:
    with _job(workdir, config, overrides, processes, injections) as job:
        codes = job.wait(timeout=RUN_TIMEOUT_S)
    return job, codes


# ------------------------------------------------------------------ checks


def load_state(workdir: str, step: int | None = None) -> dict:
    from train import train

    return train.final_state(workdir, step)


def first_difference(a: Any, b: Any) -> str | None:
    """The first leaf path where two states differ in bits (``None``: identical)."""
    import jax

    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
    flat_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
    if tree_a != tree_b:
        return "tree structure"
    for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return jax.tree_util.keystr(path)
    return None


def residual_shapes(state: dict) -> dict[str, list[int]]:
    """Path and shape of every residual array in a state (leading axis: one per device)."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]
    return {
        jax.tree_util.keystr(path): list(np.shape(x))
        for path, x in leaves
        if "residuals" in jax.tree_util.keystr(path)
    }


def nonfinite_leaves(workdir: str) -> list[str]:
    """``step:path`` of every non-finite floating leaf in every committed checkpoint."""
    import jax

    bad = []
    for step in committed_steps(workdir):
        for path, x in jax.tree_util.tree_flatten_with_path(load_state(workdir, step))[0]:
            x = np.asarray(x)
            if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
                bad.append(f"{step}:{jax.tree_util.keystr(path)}")
    return bad


def _skipped(workdir: str) -> int | None:
    from train import metrics

    train_records = [r for r in metrics.read_metrics(workdir) if r["split"] == "train"]
    return int(train_records[-1]["skipped_steps"]) if train_records else None


# ------------------------------------------------------------------ one run


class Campaign:
    """References (uninterrupted runs) and the runs, in one scratch directory."""

    def __init__(self, workdir: str, configs: dict[str, dict[str, Any]], keep: bool):
        self.workdir = workdir
        self.configs = configs
        self.keep = keep
        self._references: dict[tuple, dict[str, Any]] = {}
        self._runs: list[dict[str, Any]] = []  # every uninterrupted run, in order

    def durations(self) -> dict[str, float]:
        """Wall seconds of every uninterrupted run so far (the first of a job: cold cache)."""
        return {run["name"]: run["duration_s"] for run in self._runs}

    def residuals(self) -> dict[str, dict[str, list[int]]]:
        """Every job's residual arrays (path: shape) as compared in each of its runs."""
        return {run["name"].split("_", 1)[1]: run["residuals"] for run in self._runs}

    def _uninterrupted(self, config: str, processes: int, injections) -> dict[str, Any]:
        name = f"ref{len(self._runs)}_{config}_x{processes}"
        workdir = os.path.join(self.workdir, name)
        start = time.monotonic()
        job, codes = run_to_end(workdir, config, self.configs[config], processes, injections)
        if codes != [0] * processes:
            raise RuntimeError(f"uninterrupted {name} failed {codes}:\n{job.output(0)[-3000:]}")
        state = load_state(workdir)
        residuals = residual_shapes(state)
        workers = self.configs[config]["num_workers"]
        if not residuals or any(shape[0] != workers for shape in residuals.values()):
            # first_difference compares whole arrays: each must hold every device's part
            raise RuntimeError(f"{name}: residuals not one per device ({workers}): {residuals}")
        run = {
            "name": name,
            "duration_s": time.monotonic() - start,
            "state": state,
            "residuals": residuals,
            "skipped": _skipped(workdir),
            "nonfinite": nonfinite_leaves(workdir) if injections else [],
        }
        self._runs.append(run)
        return run

    def reference(self, config: str, processes: int, injections=()) -> dict[str, Any]:
        """The uninterrupted job: its final state, duration and skipped steps (cached).

        Without injections it runs twice: the first run fills the compilation cache, the
        second gives the wall time that "time" moments are fractions of (a warm start,
        like the faulted runs) and must reproduce the first bit for bit.
        """
        key = (config, processes, tuple(injections))
        if key not in self._references:
            run = self._uninterrupted(config, processes, injections)
            if not injections:
                again = self._uninterrupted(config, processes, injections)
                difference = first_difference(run["state"], again["state"])
                if difference is not None:
                    raise RuntimeError(f"two uninterrupted {key} runs differ at {difference}")
                run = {**again, "cold_duration_s": run["duration_s"]}
            self._references[key] = run
        return self._references[key]

    def run(self, fault: Fault) -> dict[str, Any]:
        """Runs one fault: start, signal, wait, resume, compare. Returns its record."""
        record: dict[str, Any] = {**dataclasses.asdict(fault), "describe": fault.describe()}
        workdir = os.path.join(self.workdir, f"run{fault.index:03d}")
        shutil.rmtree(workdir, ignore_errors=True)
        overrides = self.configs[fault.config]
        started = time.monotonic()
        try:
            reference = self.reference(fault.config, fault.processes, fault.injections)
            # "time" moments are fractions of the job's own uninterrupted wall time
            duration = self.reference(fault.config, fault.processes)["duration_s"]
            record["at_s"] = fault.at * duration if fault.moment == "time" else None
            started = time.monotonic()
            record.update(self._fault_then_resume(fault, workdir, overrides, record["at_s"]))
            state = load_state(workdir)
            record["difference"] = first_difference(state, reference["state"])
            record["identical"] = record["difference"] is None
            if fault.injections:
                record["nonfinite"] = nonfinite_leaves(workdir)
                record["skipped"] = _skipped(workdir)
                record["reference_skipped"] = reference["skipped"]
                record["nonfinite_ok"] = not record["nonfinite"] and record["skipped"] == reference[
                    "skipped"
                ] == len(fault.injections)
        except Exception as error:  # a failed run is a result, not the end of the campaign
            record["error"] = f"{type(error).__name__}: {error}"[:2000]
            record.setdefault("identical", False)
        record["run_seconds"] = time.monotonic() - started
        if not self.keep and not record.get("error") and record["identical"]:
            shutil.rmtree(workdir, ignore_errors=True)
            for log in Path(self.workdir).glob(f"run{fault.index:03d}.run*.log"):
                log.unlink()
        return record

    def _fault_then_resume(
        self, fault: Fault, workdir: str, overrides, at_s: float | None
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        sig = signal.Signals[fault.signal]
        victims = None if fault.target is None else [fault.target]
        with _job(workdir, fault.config, overrides, fault.processes, fault.injections) as job:
            launched = time.monotonic()
            self._wait_for_moment(fault, job, workdir, launched, at_s)
            out["killed_at_s"] = time.monotonic() - launched
            out["killed_at_step"] = job.last_step()
            out["mid_write"] = _writing(workdir)
            running = [p.poll() is None for p in job.procs]
            # whether a signalled process was still running (else the job had ended)
            out["landed"] = any(running[i] for i in (victims or range(fault.processes)))
            job.send(sig, processes=victims)
            signalled = time.monotonic()
            codes = job.wait(timeout=COLLECTIVE_TIMEOUT_S + 120)
            out["stop_s"] = time.monotonic() - signalled
            out["fault_exit_codes"] = codes
            outputs = [job.output(i) for i in range(fault.processes)]
        if fault.signal == "SIGKILL" and fault.target is not None and fault.processes > 1:
            survivor = 1 - fault.target
            report = REPORT.search(outputs[survivor])
            message = report.group(0) if report else ""
            named = NAMED.match(message)
            out["survivor_exit"] = codes[survivor]
            out["survivor_message"] = message
            out["survivor_reported"] = bool(
                (named and int(named.group(1) or named.group(2)) == fault.target)
                or (fault.target == 0 and COULD_NOT_JOIN in message)
            )
        stopped = [int(s) for o in outputs for s in STOPPED.findall(o)]
        out["sigterm_stopped_at"] = max(stopped) if stopped else None
        committed = committed_steps(workdir)
        out["committed_before_resume"] = committed[-1] if committed else 0
        out["uncommitted_dirs"] = [n for n in _checkpoint_dirs(workdir) if not n.isdigit()]

        offset = _metrics_size(workdir)
        with _job(workdir, fault.config, overrides, fault.processes, fault.injections) as job:
            relaunched = time.monotonic()
            first = _first_new_step_time(workdir, offset, job)
            codes = job.wait(timeout=RUN_TIMEOUT_S)
            output = job.output(0)
        out["resume_exit_codes"] = codes
        out["resumed"] = codes == [0] * fault.processes
        resumed = RESUMED.search(output)
        out["resumed_from"] = int(resumed.group(1)) if resumed else 0
        out["time_to_resume_s"] = None if first is None else first - relaunched
        out["steps_lost"] = max(0, out["killed_at_step"] - out["resumed_from"])
        if not out["resumed"]:
            raise RuntimeError(f"resume exited {codes}:\n{output[-3000:]}")
        return out

    def _wait_for_moment(
        self, fault: Fault, job: LocalJob, workdir: str, launched: float, at_s: float | None
    ) -> None:
        deadline = launched + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in job.procs):
                return  # the job ended (or failed) before the moment: signal what is left
            if at_s is not None:
                if time.monotonic() - launched >= at_s:
                    return
            elif _writing(workdir, int(fault.at)) or int(fault.at) in committed_steps(workdir):
                time.sleep(fault.delay_s)  # a committed step means the write was missed
                return
            time.sleep(0.002)
        raise RuntimeError(f"no moment to signal within {RUN_TIMEOUT_S} s")


# ------------------------------------------------------------------ summary and markdown


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "max": None}
    return {"median": float(np.median(values)), "max": float(np.max(values))}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    tried = len(records)
    resumed = [r for r in records if r.get("resumed")]
    identical = [r for r in resumed if r.get("identical")]
    peer = [r for r in records if "survivor_exit" in r and r.get("landed")]
    nan = [r for r in records if r["injections"]]
    return {
        "tried": tried,
        "resumed": len(resumed),
        "identical": len(identical),
        "lost": tried - len(identical),
        "landed": sum(bool(r.get("landed")) for r in records),
        "mid_write": sum(bool(r.get("mid_write") and r.get("landed")) for r in records),
        "uncommitted_left": sum(bool(r.get("uncommitted_dirs")) for r in records),
        "steps_lost": _stats([r["steps_lost"] for r in resumed]),
        "time_to_resume_s": _stats(
            [r["time_to_resume_s"] for r in resumed if r.get("time_to_resume_s") is not None]
        ),
        "lost_peer_runs": len(peer),
        "lost_peer_reported": sum(
            r["survivor_reported"] and r["survivor_exit"] == 75 for r in peer
        ),
        "survivor_stop_s": _stats([r["stop_s"] for r in peer]),
        "nonfinite_runs": len(nan),
        "nonfinite_ok": sum(bool(r.get("nonfinite_ok")) for r in nan),
        "injections": sum(len(r["injections"]) for r in nan),
    }


def _fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def campaign_key(configs) -> str:
    """A campaign's key in reliability.json: its config names, sorted, joined by commas."""
    return ",".join(sorted(configs))


def merge(out: str | Path, key: str, payload: dict[str, Any]) -> dict[str, Any]:
    """``<out>/reliability.json``'s campaigns with ``payload`` as campaign ``key``.

    A file of one campaign (its payload at the top, as before there were several) is read
    as the campaign over :data:`CONFIGS`. The campaign over CONFIGS comes first.
    """
    path = Path(out) / "reliability.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    campaigns = stored.get("campaigns", {DEFAULT_CAMPAIGN: stored} if "runs" in stored else {})
    campaigns = {**campaigns, key: payload}
    order = sorted(campaigns, key=lambda k: (k != DEFAULT_CAMPAIGN, k))
    return {"campaigns": {k: campaigns[k] for k in order}}


def markdown(results: dict[str, Any]) -> str:
    """reliability.md: a section per campaign, then the fault tests of the test suite."""
    lines = ["# Reliability: faults injected, what was checked, and what was lost", ""]
    for key, payload in results["campaigns"].items():
        lines += section(key, payload)
    lines += ["<!-- prose: test-suite -->", ""]
    return "\n".join(lines)


def _residual_lines(payload: dict[str, Any]) -> list[str]:
    """What the bitwise check covered of each job's residuals (campaigns that recorded it)."""
    jobs: dict[tuple, list[str]] = {}  # (config, residual shapes) -> its layouts
    for job, shapes in payload.get("residuals_compared", {}).items():
        name, processes = job.rsplit("_x", 1)
        jobs.setdefault((name, json.dumps(shapes)), []).append(processes)
    lines = []
    for (name, shapes), layouts in jobs.items():
        config, shapes = payload["configs"][name], json.loads(shapes)
        local = config.get("local_devices")
        arrays = ", ".join("x".join(map(str, shape)) for shape in shapes.values())
        whose = f"the {config['num_workers']} devices" + (
            f", each holding a 1/{local} shard of its node's residual" if local else ""
        )
        lines += [
            f"Residuals compared bit for bit in every run of {name} "
            f"({' and '.join(layouts)} processes): {len(shapes)} arrays "
            f"({arrays}; leading axis: {whose}).",
            "",
        ]
    return lines


def section(key: str, payload: dict[str, Any]) -> list[str]:
    """The lines of one campaign's section."""
    s, records = payload["summary"], payload["runs"]
    args = payload["args"]
    groups: dict[tuple, list] = {}
    for r in records:
        groups.setdefault((r["config"], r["processes"], r["signal"]), []).append(r)
    default = key == DEFAULT_CAMPAIGN
    lines = [
        "## Fault campaign (`benchmarks/faults.py`)"
        if default
        else f"## Fault campaign: {TITLES.get(key, key)} (`--configs {key}`)",
        "",
        f"`{command(key, args, args.get('replay'))}` "
        f"({payload['date']}, {payload['cpu_count']} CPU cores shared with other jobs; "
        f"{payload['wall_s'] / 60:.1f} min). Replay run *i* alone with "
        f"`{command(key, args, 'i')}`.",
        "",
        "| kills tried | landed | resumed | bit-identical | lost | signalled mid-write "
        "| write left uncommitted | steps recomputed (median / max) "
        "| time to resume, s (median / max) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {s['tried']} | {s['landed']} | {s['resumed']} | {s['identical']} | {s['lost']} "
        f"| {s['mid_write']} | {s['uncommitted_left']} "
        f"| {_fmt(s['steps_lost']['median'], 0)} / {_fmt(s['steps_lost']['max'], 0)} "
        f"| {_fmt(s['time_to_resume_s']['median'])} / {_fmt(s['time_to_resume_s']['max'])} |",
        "",
        f"One process of two SIGKILLed while running: {s['lost_peer_runs']} runs; the survivor "
        "printed one report naming the killed process (a lost peer, or one that never "
        f"connected when the kill came first) and exited with status 75 in "
        f"{s['lost_peer_reported']}, {_fmt(s['survivor_stop_s']['median'])} s (median; max "
        f"{_fmt(s['survivor_stop_s']['max'])} s) after the kill "
        f"(`--collective_timeout_s={COLLECTIVE_TIMEOUT_S}`). NaN/±Inf: {s['injections']} "
        f"injections in {s['nonfinite_runs']} runs; no non-finite value in any checkpoint and "
        f"the steps counted as skipped in {s['nonfinite_ok']} of them.",
        "",
    ]
    lines += _residual_lines(payload)
    lines += [
        "| config | processes | signal | runs | resumed | identical | mid-write "
        "| steps recomputed (max) | time to resume, s (median) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (config, n, sig), rs in sorted(groups.items()):
        ok = [r for r in rs if r.get("resumed")]
        resume = _stats([r["time_to_resume_s"] for r in ok if r.get("time_to_resume_s")])
        lines.append(
            f"| {config} | {n} | {sig} | {len(rs)} | {len(ok)} "
            f"| {sum(bool(r.get('identical')) for r in rs)} "
            f"| {sum(bool(r.get('mid_write') and r.get('landed')) for r in rs)} "
            f"| {max([r['steps_lost'] for r in ok], default=0)} | {_fmt(resume['median'])} |"
        )
    lines += [
        "",
        f"<!-- prose: {'campaign' if default else 'campaign-' + key.replace(',', '-')} -->",
        "",
        "Every run (`killed at`: seconds after launch / last logged step, *ended* when the "
        "job had finished before the moment; `from`: the step the resumed job restored; "
        "`exit`: the signalled job's exit statuses; `lost`: steps recomputed):",
        "",
        "| run | fault | killed at | mid-write | exit | from | lost | resume s | identical |",
        "|---:|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in records:
        why = r.get("error") or r.get("difference")
        identical = "yes" if r.get("identical") else f"**no** ({why})"
        lines.append(
            f"| {r['index']} | {r['describe']} "
            f"| {_fmt(r.get('killed_at_s'))} s / {r.get('killed_at_step', '–')}"
            f"{'' if r.get('landed', True) else ' (ended)'} "
            f"| {'yes' if r.get('mid_write') else ''} "
            f"| {' '.join(str(c) for c in r.get('fault_exit_codes', []))} "
            f"| {r.get('resumed_from', '–')} | {r.get('steps_lost', '–')} "
            f"| {_fmt(r.get('time_to_resume_s'))} | {identical} |"
        )
    lines += [""]
    return lines


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--runs", type=int, default=None, help="number of runs (default 30; 2 with --quick)"
    )
    parser.add_argument("--seed", type=int, default=0, help="campaign seed (default 0)")
    parser.add_argument("--replay", type=int, default=None, help="run only this run index")
    parser.add_argument(
        "--quick", action="store_true", help="2 runs (unless --runs) of an 8-step digits job"
    )
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep every run's workdir and logs")
    parser.add_argument(
        "--out",
        default=None,
        help=f"results directory (default: {RESULTS} for a full campaign; the workdir for "
        "--quick and --replay)",
    )
    parser.add_argument(
        "--configs",
        default=None,
        help="comma-separated jobs to draw from (default: "
        f"{','.join(CONFIGS)}; with --quick: {','.join(QUICK)}); more: "
        f"{', '.join(EXTRA_CONFIGS)}",
    )
    parser.add_argument(
        "--from-json",
        action="store_true",
        help="only re-render reliability.md from reliability.json (under --out)",
    )
    args = parser.parse_args(argv)
    available, names = _jobs(args)
    unknown = [n for n in names if n not in available]
    if unknown or len(set(names)) != len(names):
        parser.error(f"--configs {args.configs}: choose from {', '.join(available)}")
    return args


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a command line runs: the jobs drawn from, the layouts, the run indices."""

    configs: dict[str, dict[str, Any]]
    layouts: tuple[int, ...]
    runs: int
    indices: list[int]

    def fault(self, seed: int, index: int) -> Fault:
        return draw(seed, index, self.configs, self.layouts)


def _jobs(args: argparse.Namespace) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The jobs ``--configs`` may name under ``args``, and the names it chose."""
    available = QUICK_ALL if args.quick else ALL_CONFIGS
    names = args.configs.split(",") if args.configs else list(QUICK if args.quick else CONFIGS)
    return available, names


def setup(args: argparse.Namespace) -> Setup:
    """The campaign (or the one run of ``--replay``) that ``args`` (parsed) asks for."""
    available, names = _jobs(args)
    runs = args.runs if args.runs is not None else (2 if args.quick else 30)
    return Setup(
        configs={n: available[n] for n in names},  # draw() sorts the names: order is moot
        layouts=(1,) if args.quick else (1, 2),
        runs=runs,
        indices=[args.replay] if args.replay is not None else list(range(runs)),
    )


def command(key: str, args: dict[str, Any], replay: int | str | None = None) -> str:
    """The command line of a recorded campaign (``payload["args"]``, campaign ``key``), or
    of its run ``replay`` alone: every flag that changes what runs (``--quick``,
    ``--configs`` unless the default jobs, ``--runs``, ``--seed``)."""
    quick = bool(args.get("quick"))
    flags = ["--quick"] if quick else []
    if key != campaign_key(QUICK if quick else CONFIGS):
        flags.append(f"--configs {key}")
    if replay is None:
        flags.append(f"--runs {args['runs']}")
    flags.append(f"--seed {args['seed']}")
    if replay is not None:
        flags.append(f"--replay {replay}")
    return " ".join(["python benchmarks/faults.py", *flags])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        out = args.out or str(RESULTS)
        rerender("reliability", markdown, out, echo=False)
        return 0
    plan = setup(args)
    configs = plan.configs
    key = campaign_key(configs)
    workdir = args.workdir or tempfile.mkdtemp(prefix="rr_faults_")
    os.makedirs(workdir, exist_ok=True)
    partial = args.quick or args.replay is not None
    out = args.out or (workdir if partial else str(RESULTS))
    campaign = Campaign(workdir, configs, keep=args.keep or args.replay is not None)
    # Every launch (the jobs inherit this environment) shares JAX's persistent compilation
    # cache: the first uninterrupted run of a job compiles, the others load.
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=os.path.join(workdir, "jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax: "meta" not restored, per load

    from tqdm import tqdm

    recorded = {
        "runs": plan.runs,
        "seed": args.seed,
        "quick": args.quick,
        "replay": args.replay,
        "configs": sorted(configs),
    }
    start = time.monotonic()
    print(f"workdir: {workdir}", flush=True)
    records = []
    bar = tqdm(plan.indices, desc="fault runs", unit="run", dynamic_ncols=True)
    for index in bar:
        fault = plan.fault(args.seed, index)
        bar.set_postfix_str(fault.describe())
        record = campaign.run(fault)
        records.append(record)
        with open(os.path.join(workdir, "runs.jsonl"), "a") as f:  # progress, for a look
            f.write(json.dumps(record, default=repr) + "\n")
        if not record.get("identical"):
            tqdm.write(
                f"run {index} ({fault.describe()}): {record.get('error') or record}\n"
                f"replay it with: {command(key, recorded, index)}"
            )
    payload = environment(
        date=time.strftime("%Y-%m-%d"),
        args=recorded,
        configs=configs,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        reference_durations_s=campaign.durations(),
        residuals_compared=campaign.residuals(),
        wall_s=time.monotonic() - start,
        summary=summarize(records),
        runs=records,
    )
    results = merge(out, key, payload)
    write_results("reliability", results, markdown(results), out, echo=False)
    summary = payload["summary"]
    print(json.dumps(summary, indent=2))
    print(f"results: {out}/reliability.md; replay run i alone with: {command(key, recorded, 'i')}")
    return 0 if summary["identical"] == summary["tried"] else 1


if __name__ == "__main__":
    sys.exit(main())
