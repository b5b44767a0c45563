"""What bounding the queued steps costs on simulated CPU devices.

A plain training loop that feeds a new ``shard_batch`` every step and never blocks queues
steps as fast as Python dispatches them; on XLA:CPU a wide enough model then aborts in a
collective's rendezvous (docs/design.md, "CPU collectives and queued steps"), so
``DataParallelStep`` keeps at most ``max_steps_in_flight`` of its calls queued on the CPU
backend (default ``parallel.CPU_STEPS_IN_FLIGHT``). This script times that loop against
loops that block themselves, in one process, repetitions interleaved (ABBA):

* ``unblocked``: the loop never blocks; the step's own bound (the default) applies;
* ``blocked``: the loop blocks on every step's metrics;
* ``every_8``: the loop blocks every 8 steps, the step's bound lifted (what a careful user
  writes without the bound; it is safe on this model only because it blocks).

Model: 3 dense tanh layers of width 256 (error feedback, top-k 1 %, AdamW), 8 workers x 8
examples. Writes ``benchmarks/results/steps_in_flight.{json,md}``::

    python benchmarks/steps_in_flight.py [--steps 120] [--repeats 5] [--width 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

from resireduce_jax import runtime

runtime.configure_cpu(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import NUM_WORKERS, environment, write_results  # noqa: E402

import resireduce_jax as rr  # noqa: E402
from resireduce_jax import compressors  # noqa: E402

LOOPS = ("unblocked", "blocked", "every_8")
UNBOUNDED = 1 << 30


def mlp_loss(params, batch):
    h = batch["x"]
    for i in range(len(params)):
        h = jnp.tanh(h @ params[f"dense_{i}"]["kernel"])
    return jnp.mean((h - batch["y"]) ** 2)


def build(width: int, depth: int, max_steps_in_flight: int | None):
    keys = jax.random.split(jax.random.key(0), depth)
    params = {
        # Host arrays: every repeat's init places a copy (the step donates its params).
        f"dense_{i}": {
            "kernel": np.asarray(jax.random.normal(keys[i], (width, width)) / np.sqrt(width))
        }
        for i in range(depth)
    }
    tx = optax.chain(rr.error_feedback(compressors.topk(0.01)), optax.adamw(1e-3))
    mesh = rr.parallel.make_mesh(NUM_WORKERS)
    step = rr.parallel.data_parallel_step(
        mlp_loss, tx, mesh, max_steps_in_flight=max_steps_in_flight
    )
    return step, mesh, params


def run_loop(loop: str, step, mesh, params, steps: int, width: int) -> tuple[float, float]:
    """Seconds per step of ``steps`` steps (after one warm step), and the final loss."""
    params, opt_state = step.init(params)
    rng = np.random.default_rng(0)

    def batch():
        x = rng.standard_normal((NUM_WORKERS * 8, width), dtype=np.float32)
        return rr.parallel.shard_batch({"x": x, "y": np.zeros_like(x)}, mesh)

    params, opt_state, metrics = step(params, opt_state, batch())
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for i in range(steps):
        params, opt_state, metrics = step(params, opt_state, batch())
        if loop == "blocked" or (loop == "every_8" and i % 8 == 7):
            jax.block_until_ready(metrics)
    jax.block_until_ready((params, opt_state, metrics))
    return (time.perf_counter() - start) / steps, float(metrics["loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3)
    args = parser.parse_args()

    bound = {"unblocked": None, "blocked": None, "every_8": UNBOUNDED}
    built = {loop: build(args.width, args.depth, bound[loop]) for loop in LOOPS}
    times: dict[str, list[float]] = {loop: [] for loop in LOOPS}
    losses: dict[str, float] = {}
    for r in range(args.repeats):
        order = LOOPS if r % 2 == 0 else LOOPS[::-1]
        for loop in order:
            seconds, loss = run_loop(loop, *built[loop], args.steps, args.width)
            times[loop].append(seconds)
            losses[loop] = loss
    median = {loop: statistics.median(times[loop]) for loop in LOOPS}
    ratio = {loop: median["unblocked"] / median[loop] for loop in LOOPS}
    payload = {
        "environment": environment(),
        "steps": args.steps,
        "repeats": args.repeats,
        "width": args.width,
        "depth": args.depth,
        "default_bound": rr.parallel.CPU_STEPS_IN_FLIGHT,
        "seconds_per_step": times,
        "median_seconds_per_step": median,
        "unblocked_over": ratio,
        "final_loss": losses,
    }
    rows = "\n".join(
        f"| {loop} | {median[loop] * 1e3:.2f} | {min(times[loop]) * 1e3:.2f}–"
        f"{max(times[loop]) * 1e3:.2f} | {ratio[loop]:.3f} | {losses[loop]:.6f} |"
        for loop in LOOPS
    )
    markdown = f"""# Steps in flight: the cost of the CPU step's queue bound

| user loop | ms / step (median) | range over repeats | unblocked / this | final loss |
|---|---:|---:|---:|---:|
{rows}

{args.depth} dense tanh layers of width {args.width}, error feedback with top-k 1 % and
AdamW, {NUM_WORKERS} simulated CPU workers x 8 examples, a new `shard_batch` every step;
{args.steps} timed steps after one warm step, {args.repeats} repeats interleaved (ABBA) in
one process. `unblocked` never blocks and relies on the step's default bound
(`max_steps_in_flight=None`: {rr.parallel.CPU_STEPS_IN_FLIGHT} on the CPU backend);
`blocked` blocks on every step's metrics; `every_8` blocks every 8 steps with the bound
lifted. Equal final losses: the bound changes no value.

Produced by: `python benchmarks/steps_in_flight.py --steps {args.steps} --repeats
{args.repeats} --width {args.width}`.

<!-- prose: notes -->
"""
    write_results("steps_in_flight", payload, markdown)


if __name__ == "__main__":
    main()
