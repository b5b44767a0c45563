"""What a density schedule costs at the compiled peak, and what each of its phases sends.

A density schedule (``compression.density_schedule``; ``resireduce_jax.compressors.schedule``)
compiles either way: as **one program** whose exchange switches between the phases
(``lax.switch`` on the step count, one static-size branch per phase: what an optax chain
gets by default), or as **one program per phase** (``density_phase``: what the training
program runs, each phase in its steps). This script compiles the training program's
guarded 8-worker train step (``train/compiled_step.py``, abstract shapes, nothing
allocated) with the constant density and with two schedules, both ways, and reports per
worker:

* the compiled peak of the switching program, of every phase's own program, and each
  over the constant density's;
* the bytes every phase's collectives move, read off the compiled HLO of the switching
  program (each branch of every conditional, with what it calls), beside the
  compressors' exact ``payload_bytes`` of that phase summed over the compressed leaves
  (dense leaves travel outside the branches and are left out of both).

Schedules: ``dense``: a dense warm-up, then the target density; ``dgc``: a dense warm-up,
then DGC's warm-up stages (25 %, 6.25 %, 1.5625 %), then the target; ``dense_bf16`` and
``dense_f16``: a dense warm-up all-reduced in bfloat16 or float16 (``dense_dtype``), then
the target. XLA:CPU all-reduces bfloat16 in float32, so on CPU that phase's collectives
move twice its payload; the page compares each phase with what its payload takes on the
platform it was compiled for.

    python benchmarks/density_schedule.py                 # all cases (long)
    python benchmarks/density_schedule.py --models gpt2_medium --variants ef
    python benchmarks/density_schedule.py --schedules dense_bf16 --merge  # add rows
    python benchmarks/density_schedule.py --from-json    # re-render the markdown
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `common`, also when imported

import common
from common import (
    NUM_WORKERS,
    MiB,
    add_output_arguments,
    environment,
    rerender,
    write_results,
)
from peak_memory import CASES

SCHEDULES = {
    "constant": {"dense_fraction": 0.0, "dgc_fraction": 0.0},
    "dense": {"dense_fraction": 0.05, "dgc_fraction": 0.0},
    "dgc": {"dense_fraction": 0.05, "dgc_fraction": 0.2},
    # configs/byte_gpt.py's warm-up: 12.5 % of the steps, all-reduced in bfloat16.
    "dense_bf16": {"dense_fraction": 0.125, "dgc_fraction": 0.0, "dense_dtype": "bfloat16"},
    # The same in float16, which XLA:CPU all-reduces natively.
    "dense_f16": {"dense_fraction": 0.125, "dgc_fraction": 0.0, "dense_dtype": "float16"},
}
TOTAL_STEPS = 1000


def wire_bytes(compressor: Any, payload_bytes: int, backend: str) -> int:
    """What a phase's payload takes in the compiled program on ``backend``: XLA:CPU runs a
    bfloat16 all-reduce in float32 (twice the bytes) and a float16 one in float16."""
    import resireduce_jax as rr

    bf16 = isinstance(compressor, rr.compressors.Cast) and compressor.dtype == "bfloat16"
    return 2 * payload_bytes if bf16 and backend == "cpu" else payload_bytes


def measure(model: str, variant: str, schedule: str) -> dict[str, Any]:
    """Compiles the case's guarded step with ``schedule`` (switching, and per phase)."""
    import jax
    import numpy as np

    import resireduce_jax as rr
    from train import compiled_step, factory

    case = CASES[model]
    config = case.load()
    config.compression.density_schedule.update(SCHEDULES[schedule])

    def compile_phase(density_phase):
        return compiled_step.compile_step(
            config,
            variant=variant,
            batch_per_worker=case.batch_per_worker,
            seq_len=case.seq_len,
            num_workers=NUM_WORKERS,
            total_steps=TOTAL_STEPS,
            density_phase=density_phase,
        )

    compressor = factory.build_compressor(config.compression, TOTAL_STEPS)
    phases = rr.compressors.schedule.phases(compressor)
    phase_peaks = [compile_phase(j).peak.peak for j in range(len(phases))]
    step = compile_phase(compiled_step.SWITCH_PHASES)  # one program for every phase
    exchange = factory.build_exchange(config.compression, variant=variant)
    plan = exchange.plan(step.params)
    dtypes = [x.dtype for x in jax.tree.leaves(step.params)]
    expected = [
        sum(
            p.compressor.payload_bytes(store.group.shape, np.dtype(dtypes[i]))
            for store in plan.stores
            for i in store.group.members
        )
        for p in phases
    ]
    backend = jax.default_backend()
    wire = [wire_bytes(p.compressor, e, backend) for p, e in zip(phases, expected, strict=True)]
    hlo_bytes: list[int | None] = [None]  # one phase: no branches to tell apart
    if len(phases) > 1:
        hlo_bytes = [0] * len(phases)
        for conditional in rr.hlo.branch_collectives(step.compiled):
            for j, branch in enumerate(conditional):
                hlo_bytes[j] += sum(c.bytes_per_worker for c in branch)
    return {
        "model": model,
        "variant": variant,
        "schedule": schedule,
        "phases": [
            {
                "start": p.start,
                "compressor": repr(p.compressor),
                "payload_bytes": e,
                "wire_bytes": w,
                "hlo_bytes": h,
            }
            for p, e, w, h in zip(phases, expected, wire, hlo_bytes, strict=True)
        ],
        **step.peak.as_dict(),
        "phase_peaks": phase_peaks,
        "compile_seconds": step.compile_seconds,
    }


def render(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    base = {(r["model"], r["variant"]): r for r in rows if r["schedule"] == "constant"}
    lines = [
        "# Density schedules: compiled peak and bytes per phase",
        "",
        "| model | variant | schedule | phases | one program: peak MiB | / constant "
        "| program per phase: peaks MiB | max / constant | phase bytes (HLO = payload) |",
        "|---|---|---|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        ref = base.get((r["model"], r["variant"]))
        ratio = f"{r['peak'] / ref['peak']:.3f}" if ref else "—"
        per_phase = ", ".join(f"{p / MiB:.1f}" for p in r["phase_peaks"])
        worst = f"{max(r['phase_peaks']) / ref['peak']:.3f}" if ref else "—"
        if r["phases"][0]["hlo_bytes"] is None:
            phase_bytes = f"{r['phases'][0]['payload_bytes']:,} (one phase, no branch)"
        else:
            # Pages written before wire_bytes had no 16-bit phase: wire = payload.
            wire = [p.get("wire_bytes", p["payload_bytes"]) for p in r["phases"]]
            same = [p["hlo_bytes"] for p in r["phases"]] == wire
            listed = ", ".join(f"{p['hlo_bytes']:,}" for p in r["phases"])
            phase_bytes = f"{listed} ({'equal' if same else 'DIFFER'})"
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['schedule']} | {len(r['phases'])} | "
            f"{r['peak'] / MiB:.1f} | {ratio} | {per_phase} | {worst} | {phase_bytes} |"
        )
    lines += [
        "",
        f"Per-worker figures of the training program's guarded train step, {NUM_WORKERS} "
        "simulated workers, compiled from abstract shapes. Schedules over "
        f"{payload['total_steps']} steps: "
        + "; ".join(f"`{k}` {v}" for k, v in SCHEDULES.items())
        + ". Phase bytes: one worker's collective bytes in each branch of the exchange's "
        "`lax.switch`, summed over the compressed leaves, read off the compiled HLO; "
        "`equal` when they match the compressors' `payload_bytes` of that phase exactly "
        "(a bfloat16 phase: twice them on CPU, whose all-reduce runs bfloat16 in float32).",
        "",
        "Produced by: `" + payload["command"] + "`.",
        "",
        "<!-- prose: notes -->",
    ]
    return "\n".join(lines)


def merge_rows(before: list[dict[str, Any]], now: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``before`` with the rows of the cases in ``now`` replaced (a case: model, variant,
    schedule)."""
    return common.merge_rows(before, now, ("model", "variant", "schedule"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2_medium", "resnet50"])
    parser.add_argument("--variants", nargs="+", default=["ef", "w+2d"])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    add_output_arguments(
        parser,
        from_json_help="re-render the markdown",
        merge_help="replace the rows compiled now in the earlier density_schedule.json, "
        "keep the others",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        rerender("density_schedule", render, args.out)
        return
    from resireduce_jax import runtime

    runtime.configure_cpu(NUM_WORKERS)
    rows = []
    for model in args.models:
        for variant in args.variants:
            for schedule in args.schedules:
                rows.append(measure(model, variant, schedule))
                print(rows[-1]["model"], variant, schedule, rows[-1]["peak"] / MiB, flush=True)
    given = sys.argv[1:] if argv is None else argv
    command = "python benchmarks/density_schedule.py " + " ".join(given)
    previous = Path(args.out) / "density_schedule.json"
    if args.merge and previous.exists():
        earlier = json.loads(previous.read_text())
        rows = merge_rows(earlier["rows"], rows)
        command = f"{earlier['command']}`; `{command}"
    payload = {
        "environment": environment(),
        "total_steps": TOTAL_STEPS,
        "command": command,
        "rows": rows,
    }
    write_results("density_schedule", payload, render(payload), args.out)


if __name__ == "__main__":
    main()
