"""Hierarchical exchange against flat error feedback, for L devices per node in {1, 2, 4, 8}.

8 simulated CPU devices as ``8/L`` nodes × ``L`` (``config.local_devices = L``;
docs/design.md, "Hierarchical exchange"), beside the flat 1-D mesh of 8 workers:

* **bytes** (exact, from the compiled train step of the training program,
  ``train/compiled_step.py``): residual bytes per device, and the bytes each device puts
  into collectives per step, split by where their replica groups reach: across nodes
  (the ``data`` axis: compressed payloads, plus the small leaves that travel dense) or
  inside a node (the dense reduce-scatter and all-gather over ``local``);
* **step time**: the training program's step, compiled and warmed up, timed in
  interleaved repetitions against the flat step (median ratio). 8 simulated devices share
  2 CPU cores: this measures computation, not links;
* **accuracy**: the accuracy benchmark's tasks (``benchmarks/accuracy.py``) trained under
  each layout with ``ef`` and ``w+2d``.

Writes ``benchmarks/results/hierarchical.{json,md}``. Usage::

    python benchmarks/hierarchical.py
    python benchmarks/hierarchical.py --no-accuracy --repeats 3
    python benchmarks/hierarchical.py --tasks digits --seeds 2 --byte-gpt-steps 400
    python benchmarks/hierarchical.py --accuracy-only --tasks byte_gpt_deep --local 4 \
        --seeds 2 --flat-from benchmarks/results/accuracy.json
    python benchmarks/hierarchical.py --from-json      # re-render the markdown

``--accuracy-only`` trains only the named runs and merges them into the existing
``hierarchical.json`` (a task, variant, layout and seed trained again replaces its earlier
record; bytes and step times are kept), writing the results after every run.
``--flat-from`` takes the flat runs from an ``accuracy.json`` of the same task, variant,
seed and schedule instead of training them again: the flat layout is the accuracy
benchmark's configuration (``local_devices`` unset).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import NUM_WORKERS, RESULTS, add_output_arguments, environment, write_results
from step_time import CASES as STEP_CASES
from step_time import Runner

LOCAL = (1, 2, 4, 8)
SHARDED = tuple(n for n in LOCAL if n > 1)  # L=1 is the flat run bit for bit
VARIANTS = ("ef", "w+2d")
CASE = STEP_CASES["gpt2"]
FLAT = "flat"


def _layouts() -> list[tuple[str, int]]:
    return [(FLAT, 0)] + [(f"L={n}", n) for n in LOCAL]


def _config(local_devices: int):
    config = CASE.load()
    config.local_devices = local_devices
    return config


def collective_bytes(compiled, mesh) -> dict[str, int]:
    """Bytes one device puts into collectives per step: across nodes / inside a node."""
    import numpy as np

    import resireduce_jax as rr

    rows = [{int(d.id) for d in row} for row in np.atleast_2d(mesh.devices)]
    if len(mesh.axis_names) == 1:  # flat: every worker is its own node
        rows = [{int(d.id)} for d in mesh.devices.flat]
    out = {"across_nodes": 0, "inside_node": 0}
    for c in rr.hlo.collectives(compiled):
        groups = c.replica_groups or ()
        inside = bool(groups) and all(any(set(g) <= r for r in rows) for g in groups)
        out["inside_node" if inside else "across_nodes"] += c.bytes_per_worker
    return out


def measure_bytes(variant: str) -> list[dict[str, Any]]:
    from train import compiled_step

    rows = []
    for name, local in _layouts():
        config = _config(local)
        step = compiled_step.compile_step(
            config, variant=variant, batch_per_worker=CASE.batch_per_worker, seq_len=CASE.seq_len
        )
        state = compiled_step.state_bytes(step.params, step.tx, step.mesh)
        print(f"{variant} {name}: compiled in {step.compile_seconds:.1f} s", flush=True)
        rows.append(
            {
                "layout": name,
                "local_devices": local,
                "residual_bytes": state.residuals,
                **collective_bytes(step.compiled, step.mesh),
                "peak_bytes": step.peak.peak,
                "compile_s": step.compile_seconds,
            }
        )
    return rows


def measure_time(variant: str, *, repeats: int, steps: int) -> list[dict[str, Any]]:
    runners = {
        name: Runner.of_variant(CASE, variant, True, _config(local)) for name, local in _layouts()
    }
    for r in runners.values():
        r.run(2)  # compile and warm up
    times: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(repeats):  # interleaved, alternating order
        for name in runners if i % 2 == 0 else reversed(runners):
            times[name].append(runners[name].run(steps))
    flat = statistics.median(times[FLAT])
    return [
        {
            "layout": name,
            "median_s": statistics.median(t),
            "ratio_to_flat": statistics.median(t) / flat,
            "loss": runners[name].loss,
        }
        for name, t in times.items()
    ]


def _flat_records(path: str | None) -> dict[tuple[str, str, int, int], dict[str, Any]]:
    """Flat runs of an ``accuracy.json``, by (task, variant, seed, steps)."""
    if path is None:
        return {}
    runs = json.loads(Path(path).read_text())["runs"]
    return {(r["task"], r["variant"], r["seed"], r["steps"]): r for r in runs}


def measure_accuracy(
    tasks,
    seeds: int,
    byte_gpt_steps: int,
    local: tuple[int, ...] = LOCAL,
    flat_from: str | None = None,
    on_record: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Trains every (task, variant, layout, seed); flat runs may come from ``flat_from``.

    ``on_record`` is called with the runs so far after each one, to save them as they come.
    """
    import accuracy

    reusable = _flat_records(flat_from)
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for task in tasks:
            steps = byte_gpt_steps if task == "byte_gpt" else None
            config = accuracy.build_config(accuracy.TASKS[task], "ef", 0, steps, {})
            planned_steps = config.num_steps  # what a flat run to reuse must have trained
            for variant in VARIANTS:
                for name, n in _layouts():
                    if n == 1 or (n and n not in local):
                        continue  # L=1 is bit for bit the flat run (tests/test_hierarchical.py)
                    for seed in range(seeds):
                        earlier = reusable.get((task, variant, seed, planned_steps))
                        if name == FLAT and earlier is not None:
                            record = {**earlier, "from": flat_from}
                        else:
                            extra = {"local_devices": n}
                            record = accuracy.train_one(task, variant, seed, steps, extra, scratch)
                        record["layout"] = name
                        runs.append(record)
                        print(f"{task} {variant} {name} seed {seed}: {record['final']:.3f}")
                        if on_record is not None:
                            on_record(runs)
    return runs


def merge_accuracy(before: list[dict], now: list[dict]) -> list[dict]:
    """``before`` with every run of ``now`` added; a run trained again replaces its record."""

    def key(r: dict) -> tuple:
        return r["task"], r["variant"], r["layout"], r["seed"]

    replaced = {key(r) for r in now}
    return [r for r in before if key(r) not in replaced] + now


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def markdown(payload: dict[str, Any]) -> str:
    lines = [
        "# Hierarchical exchange against flat error feedback",
        "",
        f"{NUM_WORKERS} simulated CPU devices as 8/L nodes × L devices "
        "(`--config.local_devices=L`), Top-k 1 %, guarded step. Model for bytes and step "
        f"time: {CASE.description}. Bytes are what one device contributes to the step's "
        "collectives (`rr.hlo.Collective.bytes_per_worker`: its operand for all-reduce and "
        "reduce-scatter, its own part of an all-gather), split by whether the replica "
        "groups stay inside a node. Produced by `python benchmarks/hierarchical.py`.",
        "",
    ]
    for variant, rows in payload["bytes"].items():
        flat = rows[0]
        lines += [
            f"## Bytes per device and step, {variant}",
            "",
            "| layout | residual MiB / device | ÷ flat | across nodes MiB | ÷ flat | "
            "inside a node MiB | compiled peak MiB |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['layout']} | {_mib(r['residual_bytes'])} | "
                f"{r['residual_bytes'] / flat['residual_bytes']:.3f} | "
                f"{_mib(r['across_nodes'])} | "
                f"{r['across_nodes'] / max(flat['across_nodes'], 1):.3f} | "
                f"{_mib(r['inside_node'])} | {_mib(r['peak_bytes'])} |"
            )
        lines.append("")
    for variant, rows in payload.get("time", {}).items():
        lines += [
            f"## Step time, {variant} (median of interleaved repetitions)",
            "",
            "| layout | s / step | ÷ flat |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {r['layout']} | {r['median_s']:.4f} | {r['ratio_to_flat']:.3f} |" for r in rows
        ]
        lines.append("")
    runs = payload.get("accuracy", [])
    if runs:
        lines += [
            "## Accuracy",
            "",
            "Final eval metric (digits: accuracy %, byte-level GPTs: perplexity), mean ± "
            "standard deviation over seeds, after the steps shown (L=1 is the flat run bit "
            "for bit and is not trained again). Flat rows marked * are the accuracy "
            "benchmark's own runs of the same task and schedule (`--flat-from`).",
            "",
            "| task | steps | variant | layout | seeds | final | vs flat |",
            "|---|---:|---|---|---:|---:|---:|",
        ]
        keys = sorted({(r["task"], r["variant"]) for r in runs}, key=str)
        order = [name for name, _ in _layouts()]
        for task, variant in keys:
            mine = [r for r in runs if (r["task"], r["variant"]) == (task, variant)]
            by_layout: dict[str, list[float]] = {}
            for r in sorted(mine, key=lambda r: order.index(r["layout"])):
                by_layout.setdefault(r["layout"], []).append(r["final"])
            steps = "/".join(str(s) for s in sorted({r["steps"] for r in mine}))
            reused = any(r["layout"] == FLAT and "from" in r for r in mine)
            flat = statistics.mean(by_layout.get(FLAT, [float("nan")]))
            for layout, values in by_layout.items():
                mean = statistics.mean(values)
                std = statistics.stdev(values) if len(values) > 1 else 0.0
                mark = "*" if layout == FLAT and reused else ""
                lines.append(
                    f"| {task} | {steps} | {variant} | {layout}{mark} | {len(values)} | "
                    f"{mean:.2f} ± {std:.2f} | {mean - flat:+.2f} |"
                )
        lines.append("")
    lines += ["<!-- prose: about -->", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--no-accuracy", action="store_true")
    parser.add_argument("--tasks", nargs="+", default=["digits", "byte_gpt"])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--byte-gpt-steps", type=int, default=400)
    parser.add_argument(
        "--local",
        nargs="+",
        type=int,
        default=list(SHARDED),
        choices=SHARDED,
        help="devices per node for the accuracy runs (flat is always included)",
    )
    parser.add_argument(
        "--accuracy-only",
        action="store_true",
        help="train only the accuracy runs and merge them into the existing hierarchical.json",
    )
    parser.add_argument(
        "--flat-from",
        metavar="ACCURACY_JSON",
        help="take flat runs of the same task, variant, seed and steps from this file",
    )
    add_output_arguments(parser, from_json_help="re-render hierarchical.md from its JSON")
    args = parser.parse_args(argv)
    if args.from_json:
        payload = json.loads((RESULTS / "hierarchical.json").read_text())
        write_results("hierarchical", payload, markdown(payload), args.out)
        return

    from resireduce_jax import runtime

    runtime.configure_cpu(NUM_WORKERS)
    start = time.perf_counter()
    if args.accuracy_only:
        payload = json.loads((Path(args.out) / "hierarchical.json").read_text())
        before = payload.get("accuracy", [])
        seconds = payload.get("seconds", 0.0)

        def save(now: list[dict[str, Any]]) -> None:  # after every run: a long job keeps its part
            payload["accuracy"] = merge_accuracy(before, now)
            payload["seconds"] = seconds + time.perf_counter() - start
            write_results("hierarchical", payload, markdown(payload), args.out)

        measure_accuracy(
            args.tasks, args.seeds, args.byte_gpt_steps, tuple(args.local), args.flat_from, save
        )
        return
    payload: dict[str, Any] = {"bytes": {v: measure_bytes(v) for v in VARIANTS}}
    if not args.no_time:
        payload["time"] = {
            v: measure_time(v, repeats=args.repeats, steps=args.steps) for v in VARIANTS
        }
    if not args.no_accuracy:
        payload["accuracy"] = measure_accuracy(
            args.tasks, args.seeds, args.byte_gpt_steps, tuple(args.local), args.flat_from
        )
        payload["byte_gpt_steps"] = args.byte_gpt_steps
    payload = environment(seconds=time.perf_counter() - start, **payload)
    write_results("hierarchical", payload, markdown(payload), args.out)


if __name__ == "__main__":
    main()
