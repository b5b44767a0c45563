"""One-command GPU check: step time, measured against compiled peak memory, top-k times.

About 5 minutes on one GPU, run by hand (not in CI). GPT-2 small width (768, 12 heads,
vocab 50257), 6 blocks, ``configs/gpt2_medium_wikitext.py``'s recipe, every local GPU a
worker: (1) step time of dense, EF, w+2d and the config's variant, interleaved in one
process (``step_time.Runner``); (2) per variant, in a fresh process each, the device's
``memory_stats()["peak_bytes_in_use"]`` against the compiled step's peak; (3)
``compressors.topk``, ``fast_topk`` and ``lax.top_k`` on a ``wte``-sized leaf.
Writes ``benchmarks/results/gpu_check.{json,md}``. Usage::

    python benchmarks/gpu_check.py                           # on a GPU machine
    python benchmarks/gpu_check.py --allow-cpu --out /tmp/gc  # tiny sizes: the code path
    python benchmarks/gpu_check.py --from-json               # re-render the markdown
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `common`, also when imported

from common import (
    ROOT,
    Case,
    MiB,
    add_output_arguments,
    environment,
    guard_name,
    rerender,
    write_results,
)
from step_time import Runner
from tqdm import tqdm

__all__ = ["main", "memory_row", "sizes", "time_steps", "time_topk"]

NAME = "gpu_check"
CONFIG = "gpt2_medium_wikitext"  # its rules (groups, 2-D wte) and AdamW; w+2d
BASE_VARIANTS = ("dense", "ef", "w+2d")
REFUSAL = (
    "gpu_check: no GPU (JAX's backend is 'cpu'); run it on a GPU machine, or pass "
    "--allow-cpu for a tiny run that tests the code path."
)
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"


def sizes(on_cpu: bool, blocks: int | None = None) -> tuple[Case, tuple[int, int]]:
    """The model case and the top-k leaf's shape: GPT-2 small width on a GPU, tiny on CPU."""
    if on_cpu:
        blocks = blocks or 1
        overrides = {"width": 64, "num_heads": 2, "vocab_size": 512, "max_len": 32}
        batch, seq_len = 2, 32
    else:
        blocks = blocks or 6
        overrides = {"width": 768, "num_heads": 12, "vocab_size": 50257, "max_len": 1024}
        batch, seq_len = 4, 1024
    overrides["num_layers"] = blocks
    description = (
        f"GPT-2 ({CONFIG}'s rules: residual groups of 3 blocks, 2-D wte; AdamW), "
        f"{blocks} block(s) of width "
        f"{overrides['width']}, {overrides['num_heads']} heads, vocab {overrides['vocab_size']}, "
        f"{batch}x{seq_len} tokens/worker"
    )
    case = Case(CONFIG, overrides, batch_per_worker=batch, seq_len=seq_len, description=description)
    return case, (overrides["vocab_size"], overrides["width"])  # wte, GPT-2's largest leaf


def load(case: Case):
    """The case's config, its residual groups (three consecutive blocks each, the config's
    rule) over the case's blocks rather than GPT-2 medium's 24."""
    from train.config_lib import consecutive_layer_rules

    config = case.load()
    config.compression.rules = consecutive_layer_rules(case.overrides["num_layers"], "h", "h")
    return config


def variants_of(case: Case) -> tuple[str, ...]:
    """Dense, EF, w+2d and the config's variant, each once."""
    return tuple(dict.fromkeys((*BASE_VARIANTS, load(case).compression.variant)))


def _runner(case: Case, variant: str, guard: bool, workers: int) -> Runner:
    return Runner.of_variant(case, variant, guard, config=load(case), num_workers=workers)


def _step_args(runner: Runner) -> tuple[Any, ...]:
    import jax

    rng = jax.random.fold_in(runner.key, runner.count)
    return runner.params, runner.opt_state, runner.model_state, runner.batch, rng


# ------------------------------------------------------------------ memory


def memory_row(
    variant: str,
    compiled: dict[str, int],
    before: dict[str, int] | None,
    after: dict[str, int] | None,
) -> dict[str, Any]:
    """One variant's measured peak (``memory_stats()`` after the steps; ``None`` where the
    backend keeps none, e.g. CPU) against its compiled peak, and their ratio."""
    before, after = before or {}, after or {}
    measured = after.get("peak_bytes_in_use")
    return {
        "variant": variant,
        "compiled": compiled,
        "compiled_peak": compiled["peak"],
        "in_use_before_steps": before.get("bytes_in_use"),
        "peak_before_steps": before.get("peak_bytes_in_use"),
        "measured_peak": measured,
        "bytes_limit": after.get("bytes_limit"),
        "ratio": None if measured is None else measured / compiled["peak"],
        "note": None if measured is not None else "the backend keeps no memory_stats()",
    }


def _memory_probe(case: Case, variant: str, guard: bool, workers: int, steps: int) -> dict:
    """In a fresh process: the variant's step compiled (the program its calls then run),
    ``memory_stats()`` before and after ``steps`` steps."""
    import jax

    import resireduce_jax as rr

    runner = _runner(case, variant, guard, workers)
    compiled = runner.step.compile(*_step_args(runner))
    device = jax.local_devices()[0]
    jax.block_until_ready((runner.params, runner.opt_state))
    before = device.memory_stats()
    runner.run(steps)
    row = memory_row(variant, rr.hlo.peak_memory(compiled).as_dict(), before, device.memory_stats())
    return {**row, "final_loss": runner.loss}


def measure_memory(
    variants: tuple[str, ...], forwarded: list[str], env: dict[str, str]
) -> list[dict]:
    """Each variant's :func:`_memory_probe` in its own child process (a fresh
    ``peak_bytes_in_use``: JAX cannot reset it)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for variant in tqdm(variants, desc="memory (a process per variant)"):
            result = Path(tmp) / f"{variant.replace('+', '_')}.json"
            cmd = [sys.executable, __file__, *forwarded, "--_memory", variant]
            subprocess.run([*cmd, "--_result", str(result)], check=True, env=env, cwd=ROOT)
            rows.append(json.loads(result.read_text()))
    return rows


# ------------------------------------------------------------------ step time


def time_steps(
    case: Case, variants: tuple[str, ...], guard: bool, workers: int, repeats: int, steps: int
) -> list[dict]:
    """Seconds per step of every variant, built side by side, compiled, warmed up, then
    timed in repetitions that rotate the variants' order; medians."""
    import resireduce_jax as rr

    runners, peaks = {}, {}
    start = time.perf_counter()
    for variant in tqdm(variants, desc="step time: compile + warm-up"):
        runner = _runner(case, variant, guard, workers)
        peaks[variant] = rr.hlo.peak_memory(runner.step.compile(*_step_args(runner))).peak
        runner.run(1)
        runner.run(steps)
        runners[variant] = runner
    setup = time.perf_counter() - start
    times: dict[str, list[float]] = {v: [] for v in variants}
    for rep in tqdm(range(repeats), desc="step time: timed repetitions"):
        for variant in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
            times[variant].append(runners[variant].run(steps))
    medians = {v: statistics.median(t) for v, t in times.items()}
    rows = []
    for variant in variants:
        q = statistics.quantiles(times[variant], n=4) if repeats >= 2 else [medians[variant]] * 3
        rows.append(
            {
                "variant": variant,
                "seconds_per_step": times[variant],
                "median": medians[variant],
                "quartiles": [q[0], q[2]],
                "vs_ef": medians[variant] / medians["ef"] if "ef" in medians else None,
                "vs_dense": medians[variant] / medians["dense"] if "dense" in medians else None,
                "compiled_peak": peaks[variant],
                "final_loss": runners[variant].loss,
                "repeats": repeats,
                "steps_per_repeat": steps,
            }
        )
    return [{**r, "setup_seconds": setup} for r in rows]


# ------------------------------------------------------------------ top-k


def time_topk(shape: tuple[int, int], density: float, reps: int) -> list[dict]:
    """``compressors.topk``, ``fast_topk`` and a bare ``lax.top_k`` of ``|x|`` on one
    float32 leaf on one device (compressors.py's data: ``z1 * exp(0.75 z2)``); medians of
    rotated repetitions, recall against ``topk``'s indices."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from resireduce_jax import compressors as C

    exact, fast = C.topk(density), C.fast_topk(density)
    n = math.prod(shape)
    k = exact.k(n)
    fns = {
        "topk": jax.jit(lambda x: exact.compress(x, (), None)[0].indices),
        "fast_topk": jax.jit(lambda x: fast.compress(x, (), None)[0].indices),
        "lax.top_k": jax.jit(lambda x: jax.lax.top_k(jnp.abs(x.ravel()), k)[1]),
    }
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    leaf = jax.random.normal(k1, shape) * jnp.exp(0.75 * jax.random.normal(k2, shape))
    indices = {name: np.asarray(jax.block_until_ready(f(leaf))) for name, f in fns.items()}
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in tqdm(range(reps), desc="top-k"):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            start = time.perf_counter()
            jax.block_until_ready(fns[name](leaf))
            times[name].append(time.perf_counter() - start)
    chosen = np.zeros(n + 1, bool)  # the last slot: fast top-k's padding index n
    chosen[indices["topk"]] = True
    base = statistics.median(times["topk"])
    rows = []
    for name in names:
        idx = indices[name]
        rows.append(
            {
                "method": name,
                "shape": list(shape),
                "density": density,
                "k": k,
                "median": statistics.median(times[name]),
                "vs_topk": statistics.median(times[name]) / base,
                "recall": float(chosen[idx[idx < n]].sum() / k),
                "times": times[name],
            }
        )
    return rows


# ------------------------------------------------------------------ the page


def _mib(nbytes: float | None) -> str:
    return "–" if nbytes is None else f"{nbytes / MiB:.1f}"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def markdown(payload: dict[str, Any]) -> str:
    meta = payload["meta"]
    lines = [
        "# GPU check: step time, measured vs compiled peak, top-k",
        "",
        f"Device: {meta['num_devices']} x {meta['device_kind']} ({meta['backend']}), "
        f"{meta['workers']} worker(s); JAX {meta['jax']}; guard "
        f"{guard_name(meta['guard'])}. Model: {meta['model']}. "
        f"Command: `{meta['command']}`.",
        "",
        "## Step time",
        "",
        "All variants built in one process, compiled and warmed up, then timed in repetitions "
        "that rotate their order; medians, quartiles over the repetitions. This process "
        f"allocates on demand ({PREALLOCATE}={meta['preallocate']}) so that the memory "
        "section's processes have the whole device.",
        "",
        "| variant | s/step | IQR | × EF | × dense | repeats x steps |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in payload["step_time"]:
        lo, hi = r["quartiles"]
        lines.append(
            f"| {r['variant']} | {r['median']:.4f} | {lo:.4f}–{hi:.4f} | {_x(r['vs_ef'])} "
            f"| {_x(r['vs_dense'])} | {r['repeats']} x {r['steps_per_repeat']} |"
        )
    lines += [
        "",
        "## Memory: `memory_stats()` peak against the compiled peak (MiB, device 0)",
        "",
        "Each variant in a fresh process (JAX cannot reset `peak_bytes_in_use`): its step "
        "compiled (`resireduce_jax.hlo.peak_memory`: argument + output - alias + temp, the "
        "program its calls run), then `memory_stats()` read before and after "
        f"{meta['memory_steps']} steps. Measured: `peak_bytes_in_use` after the steps (the "
        "whole process: initialization too).",
        "",
        "| variant | compiled peak | measured peak | measured / compiled | in use before "
        "the steps | peak before the steps |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in payload["memory"]:
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(
            f"| {r['variant']} | {_mib(r['compiled_peak'])} | {_mib(r['measured_peak'])} "
            f"| {ratio} | {_mib(r['in_use_before_steps'])} | {_mib(r['peak_before_steps'])} |"
        )
    notes = sorted({r["note"] for r in payload["memory"] if r["note"]})
    if notes:
        lines += ["", *(f"Measured: {note}." for note in notes)]
    topk = payload["topk"]
    shape = " x ".join(str(d) for d in topk[0]["shape"])
    lines += [
        "",
        f"## Top-k on one {shape} float32 leaf, density {topk[0]['density']} "
        f"(k = {topk[0]['k']:,})",
        "",
        "One device; `topk` is `lax.top_k` of |x| and a gather of the values, `lax.top_k` "
        "the bare call; medians of rotated repetitions; recall against `topk`'s indices.",
        "",
        "| method | time (ms) | × topk | recall |",
        "|---|---:|---:|---:|",
    ]
    for r in topk:
        lines.append(
            f"| {r['method']} | {r['median'] * 1e3:.3f} | {r['vs_topk']:.3f} | {r['recall']:.4f} |"
        )
    lines += ["", "<!-- prose: about -->", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------ command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--allow-cpu", action="store_true", help="run on CPU at tiny sizes (tests the code path)"
    )
    parser.add_argument("--blocks", type=int, default=None, help="GPT-2 blocks (GPU 6, CPU 1)")
    parser.add_argument("--workers", type=int, default=None, help="default: every local GPU")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions (7, CPU 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per repetition (5, CPU 2)")
    parser.add_argument("--topk-reps", type=int, default=None, help="top-k repetitions (9, CPU 3)")
    parser.add_argument("--no-guard", action="store_true", help="leave out skip_nonfinite")
    add_output_arguments(parser, out_help="results folder (default benchmarks/results)")
    parser.add_argument("--_memory", help=argparse.SUPPRESS)  # child: one variant's memory
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = _parser()
    args = parser.parse_args(argv)
    if args.from_json:
        rerender(NAME, markdown, args.out)
        return
    preallocate = os.environ.get(PREALLOCATE)
    if args._memory is None:  # the children, not this process, get the whole GPU
        os.environ.setdefault(PREALLOCATE, "false")

    import jax
    from jax.experimental.compilation_cache import compilation_cache

    on_cpu = jax.default_backend() == "cpu"
    if on_cpu and not args.allow_cpu:
        parser.exit(2, REFUSAL + "\n")
    case, leaf = sizes(on_cpu, args.blocks)
    workers = args.workers or (1 if on_cpu else jax.local_device_count())
    guard = not args.no_guard
    repeats = args.repeats or (3 if on_cpu else 7)
    steps = args.steps or (2 if on_cpu else 5)
    if args._memory is not None:
        row = _memory_probe(case, args._memory, guard, workers, steps)
        Path(args._result).write_text(json.dumps(row))
        return

    forwarded = [*(["--allow-cpu"] if args.allow_cpu else []), "--workers", str(workers)]
    forwarded += [*(["--blocks", str(args.blocks)] if args.blocks else []), "--steps", str(steps)]
    forwarded += ["--no-guard"] if args.no_guard else []
    env = dict(os.environ)
    if preallocate is None:
        env.pop(PREALLOCATE, None)
    cache = None
    if not env.get("JAX_COMPILATION_CACHE_DIR"):  # the children's compilations, reused here
        cache = tempfile.TemporaryDirectory(prefix="gpu_check_cache_")
        env["JAX_COMPILATION_CACHE_DIR"] = cache.name
        jax.config.update("jax_compilation_cache_dir", cache.name)
        compilation_cache.reset_cache()  # the cache is bound to its first directory
    try:
        variants = variants_of(case)
        memory = measure_memory(variants, forwarded, env)
        step_time = time_steps(case, variants, guard, workers, repeats, steps)
        density = load(case).compression.density
        topk = time_topk(leaf, density, args.topk_reps or (3 if on_cpu else 9))
    finally:
        if cache is not None:
            cache.cleanup()
    device = jax.local_devices()[0]
    meta = environment(
        command=shlex.join(["python", "benchmarks/gpu_check.py", *argv]),
        backend=jax.default_backend(),
        device_kind=device.device_kind,
        num_devices=jax.local_device_count(),
        workers=workers,
        guard=guard,
        model=case.description,
        case={"config": case.config, "overrides": case.overrides},
        memory_steps=steps,
        preallocate=os.environ.get(PREALLOCATE),
    )
    payload = {"meta": meta, "step_time": step_time, "memory": memory, "topk": topk}
    write_results(NAME, payload, markdown(payload), args.out)


if __name__ == "__main__":
    main()
