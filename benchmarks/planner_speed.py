"""What planning and starting a run cost: this checkout against an earlier revision.

Times the training program as a user runs it, in fresh workdirs, on the byte-level GPT
(``configs/byte_gpt.py``, 8 simulated workers):

* ``1-step run``: ``--config.num_steps=1`` (start-up, the memory report, one step, eval,
  checkpoint);
* ``plan 10MiB``: ``--config.memory.budget=10MiB --plan_only`` (the planner's table);
* ``plan 1MiB``: a budget no candidate fits (one ``error:`` line, exit status 2);
* ``plan 10MiB again`` (this checkout only): the same ``--plan_only`` in the workdir of
  an earlier one, whose compiled steps JAX's persistent cache keeps (both configs).

These with ``--config.optimizer.name=adamw`` (AdamW and AdamW-R are both candidates);
``1-step run, recipe`` and ``plan 10MiB, recipe``: the config as it is (its recipe,
compressed-momentum Adam: one optimizer, half the candidates). Ratios to a 1-step run are
to the same config's.

The earlier revision is extracted with ``git archive`` and run from its own directory as
a subprocess. Old and new runs alternate (old, new, new, old per round: ABBA), so that a
machine whose load drifts treats both alike; wall time, the CPU time of the process
(user + system) and XLA's seconds (JAX's ``/jax/core/compile/backend_compile_duration``
events, which span ``compile_or_get_cached``: compiling every program, the planner's
steps, the rotor chain's stages and the small ones, or loading it from the persistent
cache) are recorded, and ratios are of medians.

    python benchmarks/planner_speed.py                    # against 8b65191, 1 round
    python benchmarks/planner_speed.py --rounds 2 --old-rev main
    python benchmarks/planner_speed.py --from-json        # re-render the page
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import ROOT, add_output_arguments, environment, rerender, write_results

CONFIG = "configs/byte_gpt.py"
# AdamW with EF: the planner weighs AdamW against AdamW-R (twice the candidates of
# byte_gpt's own recipe, compressed-momentum Adam, which has one optimizer).
ADAMW = [
    "--config.optimizer.name=adamw",
    "--config.optimizer.one_buffer=off",  # compressed momentum's options
    "--config.optimizer.frozen_nu_format=float32",
]
COMMANDS = {
    "1-step run": [*ADAMW, "--config.num_steps=1"],
    "plan 10MiB": [*ADAMW, "--config.memory.budget=10MiB", "--plan_only"],
    "plan 1MiB": [*ADAMW, "--config.memory.budget=1MiB", "--plan_only"],
    "1-step run, recipe": ["--config.num_steps=1"],
    "plan 10MiB, recipe": ["--config.memory.budget=10MiB", "--plan_only"],
}
EXPECTED_STATUS = {name: 2 if "1MiB" in name else 0 for name in COMMANDS}
# The plans run a second time in their own workdir (this checkout only).
AGAIN = {
    name: name.replace("plan 10MiB", "plan 10MiB again")
    for name in COMMANDS
    if name.startswith("plan 10MiB")
}


XLA_EVENT = "/jax/core/compile/backend_compile_duration"
# ``python -m train ARGS`` in this process, with JAX's compile events summed into OUT
# (JSON: event -> [seconds, count]); run as ``python -c LAUNCH OUT ARGS`` from the
# checkout's root, so that ``train`` is that checkout's.
LAUNCH = """
import collections, json, runpy, sys
from jax import monitoring
seconds, counts = collections.Counter(), collections.Counter()
def record(event, duration, **_):
    seconds[event] += duration
    counts[event] += 1
monitoring.register_event_duration_secs_listener(record)
out, sys.argv = sys.argv[1], ["train", *sys.argv[2:]]
try:
    runpy.run_module("train", run_name="__main__", alter_sys=True)
finally:
    with open(out, "w") as f:
        json.dump({e: [seconds[e], counts[e]] for e in seconds}, f)
"""


def one_step_of(name: str) -> str:
    """The 1-step run of the same config as command ``name``."""
    return "1-step run, recipe" if name.endswith(", recipe") else "1-step run"


def extract(rev: str, directory: str) -> str:
    """The tree of ``rev`` under ``directory`` (``git archive``); returns the commit."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", directory], input=archive.stdout, check=True)
    return commit


def timed(checkout: str, args: list[str], workdir: str) -> dict[str, Any]:
    """Runs ``python -m train`` from ``checkout``: wall and CPU seconds, XLA's compile
    seconds and programs, exit status, ``error:`` lines."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    events = f"{workdir}.compile_events.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            LAUNCH,
            events,
            f"--config={CONFIG}",
            f"--workdir={workdir}",
            *args,
        ],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    stderr = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    with open(events) as f:
        xla_s, programs = json.load(f).get(XLA_EVENT, [0.0, 0])
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "xla_s": xla_s,
        "xla_programs": programs,
        "status": done.returncode,
        "errors": stderr,
    }


def measure(old: str, new: str, rounds: int, scratch: str) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {"old": [], "new": []} for name in COMMANDS
    }
    runs.update({again: {"new": []} for again in AGAIN.values()})
    for r in range(rounds):
        for name, args in COMMANDS.items():
            for side in ("old", "new", "new", "old"):
                workdir = os.path.join(scratch, f"{name.replace(' ', '_')}_{side}_{r}")
                shutil.rmtree(workdir, ignore_errors=True)
                result = timed(old if side == "old" else new, args, workdir)
                if result["status"] != EXPECTED_STATUS[name]:
                    raise RuntimeError(f"{side} {name}: exit status {result}")
                runs[name][side].append(result)
                print(
                    f"{name:<18s} {side}: {result['wall_s']:7.1f} s wall, "
                    f"{result['cpu_s']:7.1f} s CPU, {result['xla_s']:6.1f} s XLA",
                    flush=True,
                )
                if name in AGAIN and side == "new":
                    again = timed(new, args, workdir)  # the persistent cache's compiles
                    runs[AGAIN[name]]["new"].append(again)
                    print(
                        f"{AGAIN[name]:<18s} new: {again['wall_s']:7.1f} s wall, "
                        f"{again['cpu_s']:7.1f} s CPU, {again['xla_s']:6.1f} s XLA",
                        flush=True,
                    )
    return runs


FIGURES = ("wall_s", "cpu_s", "xla_s", "xla_programs")


def summary(runs: dict[str, Any]) -> dict[str, Any]:
    med = {
        name: {
            side: {k: statistics.median(r[k] for r in results) for k in FIGURES}
            for side, results in sides.items()
        }
        for name, sides in runs.items()
    }
    out: dict[str, Any] = {"medians": med}
    # XLA's compile seconds against the whole 1-step run of the same config: what the
    # compilations alone cost, before any tracing, start-up or search.
    out["xla_vs_1_step_wall"] = {
        side: {
            name: med[name][side]["xla_s"] / med[one_step_of(name)][side]["wall_s"]
            for name in med
            if side in med[name]
        }
        for side in ("old", "new")
    }
    for side in ("old", "new"):
        out[f"{side}_vs_1_step"] = {
            name: {
                k: med[name][side][k] / med[one_step_of(name)][side][k] for k in ("wall_s", "cpu_s")
            }
            for name in med
            if side in med[name]
        }
    out["new_vs_old"] = {
        name: {k: med[name]["new"][k] / med[name]["old"][k] for k in ("wall_s", "cpu_s")}
        for name in COMMANDS
    }
    return out


def markdown(payload: dict[str, Any]) -> str:
    s = payload["summary"]
    med = s["medians"]
    lines = [
        "# What planning and starting a run cost",
        "",
        f"`python -m train --config {CONFIG}` (byte-level GPT, 3 blocks of width 64, "
        f"with `{' '.join(ADAMW)}` (AdamW with error feedback) except the rows `, recipe` "
        "(the config's own compressed-momentum Adam), 8 "
        f"simulated workers, 8 sequences of 64 bytes per worker) in fresh workdirs: "
        f"revision {payload['old_commit']} (old) against this checkout (new), alternated "
        f"ABBA, {payload['rounds']} round(s); medians. `python benchmarks/planner_speed.py`.",
        "",
        "<!-- prose: about -->",
        "",
        "| command | old wall | new wall | new / old | old CPU | new CPU | new / old (CPU) "
        "| old / 1-step | new / 1-step | old / 1-step (CPU) | new / 1-step (CPU) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in med:
        m = med[name]
        old = m.get("old")
        new = m["new"]
        ratio = s["new_vs_old"].get(name)
        old_rel = s["old_vs_1_step"].get(name)
        new_rel = s["new_vs_1_step"][name]
        cells = [
            name,
            f"{old['wall_s']:.1f} s" if old else "",
            f"{new['wall_s']:.1f} s",
            f"{ratio['wall_s']:.2f}" if ratio else "",
            f"{old['cpu_s']:.1f} s" if old else "",
            f"{new['cpu_s']:.1f} s",
            f"{ratio['cpu_s']:.2f}" if ratio else "",
            f"{old_rel['wall_s']:.2f}×" if old_rel else "",
            f"{new_rel['wall_s']:.2f}×",
            f"{old_rel['cpu_s']:.2f}×" if old_rel else "",
            f"{new_rel['cpu_s']:.2f}×",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Where the time goes",
        "",
        "XLA's seconds (compiling every program of the command, or loading it from the "
        "persistent cache) against the command's wall time and against the wall time of "
        "the same config's whole 1-step run; medians.",
        "",
        "<!-- prose: compile -->",
        "",
        "| command | new wall | new XLA | programs | XLA / wall | new XLA / 1-step wall "
        "| old XLA / 1-step wall |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    xla = s["xla_vs_1_step_wall"]
    for name in med:
        new = med[name]["new"]
        old = xla["old"].get(name)
        cells = [
            name,
            f"{new['wall_s']:.1f} s",
            f"{new['xla_s']:.1f} s",
            f"{new['xla_programs']:.0f}",
            f"{new['xla_s'] / new['wall_s']:.2f}",
            f"{xla['new'][name]:.2f}×",
            f"{old:.2f}×" if old is not None else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-rev", default="8b65191", help="the revision to compare with")
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds per command")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.from_json:
        rerender("planner_speed", markdown, args.out)
        return
    with tempfile.TemporaryDirectory(prefix="planner_speed_") as scratch:
        old = os.path.join(scratch, "old")
        os.makedirs(old)
        commit = extract(args.old_rev, old)
        runs = measure(old, str(ROOT), args.rounds, scratch)
    payload = {
        **environment(load_average=os.getloadavg()),
        "old_commit": commit,
        "rounds": args.rounds,
        "runs": runs,
    }
    payload["summary"] = summary(runs)
    write_results("planner_speed", payload, markdown(payload), args.out)


if __name__ == "__main__":
    main()
