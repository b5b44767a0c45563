"""A model scanned over its layers against the same model written out: compile time,
compiled peak, and accuracy.

``model.scan_layers=True`` applies GPT-2's blocks with ``nn.scan`` (one leaf per weight,
with a layer axis) and the exchange sees every slice as a layer
(:mod:`resireduce_jax.layer_stacks`). Two measurements:

* ``compile``: the training program's guarded, donated 8-worker train step
  (``train/compiled_step.py``, compiled from abstract shapes) of GPT-2 medium width
  (1024, vocab 50257) with 24 blocks, scanned and written out, with plain error feedback
  and w+2d (the paper config's groups of three blocks, 2-D store on ``wte``): compile time
  (wall and process CPU time of tracing, lowering and compiling), compiled peak per
  worker, residual bytes, and w+2d's peak drop over EF against its residual saving.
* ``accuracy``: ``configs/byte_gpt.py`` (3 layers, w+2d) trained with the training program,
  scanned and written out, at the same seed (the scanned run starts from the written-out
  model's initialization, stacked: ``train.tasks.Task.init``): final eval perplexity and
  the largest difference between the final parameters; beside them the written-out model
  at the next seed, for the spread one seed makes.

Writes ``benchmarks/results/layer_stacks.{json,md}``::

    python benchmarks/layer_stacks.py                       # both parts
    python benchmarks/layer_stacks.py --parts compile --layers 6
    python benchmarks/layer_stacks.py --parts accuracy --merge   # keep the compile part
    python benchmarks/layer_stacks.py --from-json                # re-render the markdown
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `common`, also when imported

from common import (
    NUM_WORKERS,
    MiB,
    add_output_arguments,
    environment,
    load_config,
    rerender,
    write_results,
)

VARIANTS = ("ef", "w+2d")


def compile_case(scan: bool, variant: str, layers: int, seq_len: int) -> dict[str, Any]:
    """Compiles GPT-2 medium width's guarded train step; its times, peak and residuals."""
    from train import compiled_step

    config = load_config("gpt2_medium_wikitext")
    config.model.overrides = {"num_layers": layers}
    config.model.scan_layers = scan
    wall, cpu = time.perf_counter(), time.process_time()
    step = compiled_step.compile_step(
        config, variant=variant, guard=True, batch_per_worker=1, seq_len=seq_len
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = step.peak
    return {
        "scan_layers": scan,
        "variant": variant,
        "compile_wall_seconds": wall,
        "compile_cpu_seconds": cpu,
        "peak": peak.peak,
        "temp": peak.temp,
        "residuals": compiled_step.state_bytes(step.params, step.tx, step.mesh).residuals,
    }


def compile_part(layers: int, seq_len: int) -> dict[str, Any]:
    rows = [
        compile_case(scan, variant, layers, seq_len)
        for scan in (False, True)
        for variant in VARIANTS
    ]

    def row(scan, variant):
        return next(r for r in rows if r["scan_layers"] == scan and r["variant"] == variant)

    summary = {}
    for scan in (False, True):
        ef, reduced = row(scan, "ef"), row(scan, "w+2d")
        saving = ef["residuals"] - reduced["residuals"]
        drop = ef["peak"] - reduced["peak"]
        summary["scanned" if scan else "written_out"] = {
            "residual_saving": saving,
            "peak_drop": drop,
            "drop_over_saving": drop / saving if saving else float("nan"),
        }
    for key in ("compile_wall_seconds", "compile_cpu_seconds"):
        summary[f"{key}_ratio"] = {
            variant: row(True, variant)[key] / row(False, variant)[key] for variant in VARIANTS
        }
    return {"layers": layers, "seq_len": seq_len, "rows": rows, "summary": summary}


def train_case(scan: bool, steps: int, seed: int, scratch: str) -> dict[str, Any]:
    """Trains ``configs/byte_gpt.py`` (scanned or written out); final metrics and params."""
    import jax
    import numpy as np

    from resireduce_jax.models import scan as scan_lib
    from train import train

    config = load_config("byte_gpt")
    # The page's program: w+2d, its residuals in float32, the momentum in its own buffer.
    config.compression.variant, config.compression.residual_format = "w+2d", ""
    config.optimizer.one_buffer, config.optimizer.frozen_nu_format = "off", "float32"
    config.num_steps = steps
    config.seed = seed
    config.eval_every = steps
    config.checkpoint_every = steps
    config.model.scan_layers = scan
    workdir = tempfile.mkdtemp(prefix=f"layer_stacks_{int(scan)}_", dir=scratch)
    wall = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        summary = train.train_and_evaluate(config, workdir)
    wall = time.perf_counter() - wall
    params = train.final_state(workdir)["params"]
    if scan:
        params = scan_lib.unstack_layers(params, "h")
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    return {
        "scan_layers": scan,
        "steps": summary.step,
        "eval": summary.eval,
        "train": summary.train,
        "wall_seconds": wall,
        "params": flat,
    }


def accuracy_part(steps: int, seed: int) -> dict[str, Any]:
    import numpy as np

    with tempfile.TemporaryDirectory() as scratch:
        written_out, scanned = (train_case(scan, steps, seed, scratch) for scan in (False, True))
        other_seed = train_case(False, steps, seed + 1, scratch)
    other_seed.pop("params")
    a, b = written_out.pop("params"), scanned.pop("params")
    diffs = {k: float(np.max(np.abs(a[k] - b[k]))) for k in a}
    scale = max(float(np.max(np.abs(v))) for v in a.values())
    perplexity = [r["eval"]["perplexity"] for r in (written_out, scanned, other_seed)]
    return {
        "steps": steps,
        "seed": seed,
        "rows": [written_out, scanned],
        "next_seed": other_seed,
        "next_seed_perplexity_relative_difference": perplexity[2] / perplexity[0] - 1.0,
        "max_param_difference": max(diffs.values()),
        "max_param_magnitude": scale,
        "largest_differences": dict(sorted(diffs.items(), key=lambda kv: -kv[1])[:3]),
        "perplexity_relative_difference": perplexity[1] / perplexity[0] - 1.0,
    }


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def _run_cells(r: dict[str, Any]) -> str:
    """A training run's cells of the accuracy table: eval perplexity, eval and train loss,
    wall seconds."""
    return (
        f"{r['eval']['perplexity']:.4f} | {r['eval'].get('loss', float('nan')):.5f} | "
        f"{r['train'].get('loss', float('nan')):.5f} | {r['wall_seconds']:.0f} |"
    )


def markdown(payload: dict[str, Any]) -> str:
    lines = ["# Scanned layers against layers written out", ""]
    part = payload.get("compile")
    if part:
        lines += [
            f"## Compile time and compiled peak: GPT-2 medium width, {part['layers']} blocks",
            "",
            f"Guarded train step (`skip_nonfinite`, default mode), {NUM_WORKERS} workers, "
            f"1x{part['seq_len']} tokens per worker. MiB per worker.",
            "",
            "| layers | variant | compile wall s | compile CPU s | peak | temp | residuals |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in part["rows"]:
            lines.append(
                f"| {'scanned' if r['scan_layers'] else 'written out'} | {r['variant']} | "
                f"{r['compile_wall_seconds']:.1f} | {r['compile_cpu_seconds']:.1f} | "
                f"{_mib(r['peak'])} | {_mib(r['temp'])} | {_mib(r['residuals'])} |"
            )
        s = part["summary"]
        lines += ["", "| layers | w+2d residual saving | w+2d peak drop | drop / saving |"]
        lines += ["|---|---:|---:|---:|"]
        for key, name in (("written_out", "written out"), ("scanned", "scanned")):
            lines.append(
                f"| {name} | {_mib(s[key]['residual_saving'])} | {_mib(s[key]['peak_drop'])} | "
                f"{s[key]['drop_over_saving']:.2f} |"
            )
        ratios = ", ".join(
            f"{v}: wall {s['compile_wall_seconds_ratio'][v]:.3f}, "
            f"CPU {s['compile_cpu_seconds_ratio'][v]:.3f}"
            for v in VARIANTS
        )
        lines += ["", f"Compile time scanned / written out: {ratios}.", ""]
    part = payload.get("accuracy")
    if part:
        lines += [
            f"## Accuracy: byte GPT (configs/byte_gpt.py), {part['steps']} steps, seed "
            f"{part['seed']}",
            "",
            "| layers | eval perplexity | eval loss | train loss | wall s |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in part["rows"]:
            name = "scanned" if r["scan_layers"] else "written out"
            lines.append(f"| {name} | {_run_cells(r)}")
        lines.append(f"| written out, seed {part['seed'] + 1} | {_run_cells(part['next_seed'])}")
        lines += [
            "",
            f"Perplexity scanned / written out - 1: {part['perplexity_relative_difference']:+.2e} "
            f"(the next seed's: {part['next_seed_perplexity_relative_difference']:+.2e}); "
            f"largest parameter difference {part['max_param_difference']:.2e} (largest "
            f"parameter magnitude {part['max_param_magnitude']:.2f}).",
            "",
        ]
    lines += ["<!-- prose: about -->"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["compile", "accuracy"])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    add_output_arguments(
        parser,
        out_help="results directory (default: results/)",
        merge_help="keep the other parts' results",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.from_json:
        rerender("layer_stacks", markdown, out)
        return

    from resireduce_jax import runtime

    runtime.configure_cpu(num_devices=NUM_WORKERS)
    previous = out / "layer_stacks.json"
    payload: dict[str, Any] = {}
    if args.merge and previous.exists():
        payload = json.loads(previous.read_text())
    payload["environment"] = environment()
    if "compile" in args.parts:
        payload["compile"] = compile_part(args.layers, args.seq_len)
    if "accuracy" in args.parts:
        payload["accuracy"] = accuracy_part(args.steps, args.seed)
    write_results("layer_stacks", payload, markdown(payload), out)


if __name__ == "__main__":
    main()
