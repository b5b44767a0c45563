"""Compressor benchmark: wire bytes, exchange time vs a dense all-reduce, fast top-k.

For one large float32 leaf per worker (default 25M entries = 100 MB, on 8 simulated CPU
devices) this measures, for every compressor of :mod:`resireduce_jax.compressors`:

* payload bytes per worker, from ``payload_bytes`` and from the compiled HLO's collectives
  (they must agree), against the dense leaf;
* the time of one ``reduce`` (compress + exchange + decompress into the worker mean) under
  ``jax.shard_map``, relative to the dense ``psum`` baseline (``none``) measured side by
  side: repetitions are interleaved across methods and medians reported;
* the compiled peak memory per device;

and, on one worker's leaf on one device, the selection time and recall of
:class:`~resireduce_jax.compressors.FastTopK` and :class:`~resireduce_jax.compressors.DGC`
against exact ``lax.top_k``, on two layouts (i.i.d. entries and large entries clustered in
a few rows). Goal: fast top-k <= 0.35x exact top-k time at recall >= 0.95.

Writes ``benchmarks/results/compressors.{json,md}``. Usage::

    python benchmarks/compressors.py                 # full run (about 10 min on 2 cores)
    python benchmarks/compressors.py --size 1000000 --reps 2 --out /tmp/cx   # smoke test

Data: a Gaussian scale mixture ``z1 * exp(0.75 z2)`` (heavy-tailed like gradients), drawn
on device per worker. Timings on simulated CPU devices share the host's cores between all
workers: they compare methods with each other on this machine, not with a real network.
"""

from __future__ import annotations

from resireduce_jax import runtime

runtime.configure_cpu(num_devices=8, collective_timeout_s=120)

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import (  # noqa: E402
    add_output_arguments,
    rerender,
    write_results,
)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

from resireduce_jax import compressors as C  # noqa: E402
from resireduce_jax.exchange import leaf_key  # noqa: E402
from resireduce_jax.hlo import collectives, peak_memory  # noqa: E402

AXIS = "data"

METHODS = {
    "none": lambda d: C.none(),
    "bf16": lambda d: C.bf16(),
    "topk": lambda d: C.topk(d),
    "fast_topk": lambda d: C.fast_topk(d),
    "dgc": lambda d: C.dgc(d),
    "threshold": lambda d: C.threshold(2.5, max_density=d),
    "randomk": lambda d: C.randomk(d),
    "qsgd": lambda d: C.qsgd(127, "l2", 512),
    "terngrad": lambda d: C.terngrad(),
    "natural": lambda d: C.natural(),
    "signsgd": lambda d: C.signsgd(),
    "efsignsgd": lambda d: C.efsignsgd(),
    "onebit": lambda d: C.onebit(),
    "signum": lambda d: C.signum(),
    "powersgd": lambda d: C.powersgd(4),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=25_000_000, help="entries per leaf")
    parser.add_argument("--rows", type=int, default=5000, help="rows of the leaf matrix")
    parser.add_argument("--density", type=float, default=0.01, help="sparsifiers' density")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per method")
    parser.add_argument("--topk-reps", type=int, default=7, help="repetitions of selections")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    add_output_arguments(parser, out_help="output directory")
    return parser.parse_args()


def make_leaves(mesh, shape, layout: str, seed: int = 0) -> jax.Array:
    """Per-worker leaves ``[W, *shape]`` sharded over the workers, drawn on device."""

    def draw():
        key = jax.random.fold_in(jax.random.PRNGKey(seed), jax.lax.axis_index(AXIS))
        k1, k2 = jax.random.split(key)
        x = jax.random.normal(k1, shape) * jnp.exp(0.75 * jax.random.normal(k2, shape))
        if layout == "clustered_rows":  # every 97th row 100x larger
            rows = jnp.arange(shape[0]) % 97 == 0
            x = x * jnp.where(rows, 100.0, 1.0)[:, None]
        return x[None]

    return jax.jit(jax.shard_map(draw, mesh=mesh, in_specs=(), out_specs=P(AXIS)))()


def build_exchange(comp: C.Compressor, mesh, shape):
    """Jitted shard_map of one ``reduce`` returning the (replicated) worker mean."""
    like = jax.ShapeDtypeStruct(shape, jnp.float32)
    workers = mesh.shape[AXIS]
    state = jax.tree.map(
        lambda s: jnp.broadcast_to(s, (workers, *s.shape)), comp.init(like)
    )  # the same initial state on every worker, with a leading worker axis
    state = jax.device_put(state, NamedSharding(mesh, P(AXIS)))

    def body(x, s):
        x, s = x[0], jax.tree.map(lambda a: a[0], s)
        key = leaf_key(0, jnp.int32(0), 0, comp, AXIS)
        return comp.reduce(x, s, key, AXIS).mean

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P()))
    return fn, state


def time_call(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def bench_exchanges(args, mesh, shape, xs) -> list[dict]:
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    unknown = sorted(set(names) - set(METHODS))
    if unknown:
        raise ValueError(f"Unknown methods {unknown}; choose from {sorted(METHODS)}.")
    if "none" not in names:
        names.insert(0, "none")  # the baseline every time is relative to
    n = math.prod(shape)
    dense_bytes = n * 4
    runs = {}
    for name in tqdm(names, desc="compile + warm-up"):
        comp = METHODS[name](args.density)
        fn, state = build_exchange(comp, mesh, shape)
        compiled = fn.lower(xs, state).compile()
        found = collectives(compiled)
        jax.block_until_ready(fn(xs, state))  # warm-up
        runs[name] = {
            "comp": comp,
            "fn": fn,
            "state": state,
            "times": [],
            "hlo_bytes": sum(c.bytes_per_worker for c in found),
            "collectives": sorted({c.op for c in found}),
            "peak": peak_memory(compiled).peak,
        }
    with tqdm(total=args.reps * len(names), desc="timed exchanges") as bar:
        for rep in range(args.reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]  # rotate
            for name in order:
                run = runs[name]
                run["times"].append(time_call(run["fn"], xs, run["state"]))
                bar.update()
    base = statistics.median(runs["none"]["times"])
    rows = []
    for name in names:
        run, comp = runs[name], runs[name]["comp"]
        med = statistics.median(run["times"])
        wire = comp.payload_bytes(shape, jnp.float32)
        rows.append(
            {
                "method": name,
                "config": repr(comp),
                "biased": bool(comp.biased),
                "payload_bytes_per_worker": wire,
                "hlo_collective_bytes_per_worker": run["hlo_bytes"],
                "collectives": run["collectives"],
                "dense_bytes": dense_bytes,
                "compression_ratio": dense_bytes / wire,
                "time_median_s": med,
                "time_vs_dense_psum": med / base,
                "times_s": run["times"],
                "compiled_peak_bytes_per_device": run["peak"],
            }
        )
    return rows


def bench_selection(args, mesh, shape) -> list[dict]:
    """Fast top-k and DGC vs exact top-k on one worker's leaf on one device."""
    d = args.density
    exact = C.topk(d)
    fast = C.fast_topk(d)
    dgc = C.dgc(d)
    k = exact.k(math.prod(shape))
    fns = {
        "exact": jax.jit(lambda x: exact.compress(x, (), None)[0].indices),
        "fast_topk": jax.jit(lambda x: fast.compress(x, (), None)[0].indices),
        "dgc": jax.jit(lambda x, key: dgc.compress(x, (), key)[0].indices),
    }
    results = []
    for layout in ("iid", "clustered_rows"):
        leaf = make_leaves(mesh, shape, layout, seed=1).addressable_shards[0].data[0]
        key = jax.random.PRNGKey(7)
        call = {
            "exact": lambda leaf=leaf: fns["exact"](leaf),
            "fast_topk": lambda leaf=leaf: fns["fast_topk"](leaf),
            "dgc": lambda leaf=leaf, key=key: fns["dgc"](leaf, key),
        }
        indices = {name: np.asarray(jax.block_until_ready(f())) for name, f in call.items()}
        times = {name: [] for name in call}
        for rep in tqdm(range(args.topk_reps), desc=f"selection ({layout})"):
            order = list(call)[rep % 3 :] + list(call)[: rep % 3]
            for name in order:
                start = time.perf_counter()
                jax.block_until_ready(call[name]())
                times[name].append(time.perf_counter() - start)
        chosen = np.zeros(math.prod(shape) + 1, bool)
        chosen[indices["exact"]] = True
        exact_s = statistics.median(times["exact"])
        for name in ("fast_topk", "dgc"):
            idx = indices[name]
            results.append(
                {
                    "layout": layout,
                    "method": name,
                    "k": k,
                    "recall": float(chosen[idx[idx < chosen.size - 1]].sum() / k),
                    "padding_slots": int((idx >= chosen.size - 1).sum()),
                    "time_median_s": statistics.median(times[name]),
                    "exact_topk_time_median_s": exact_s,
                    "time_vs_exact": statistics.median(times[name]) / exact_s,
                    "times_s": times[name],
                    "exact_times_s": times["exact"],
                }
            )
    return results


def markdown(meta, rows, selection) -> str:
    mb = 1 << 20
    lines = [
        "# Compressor benchmark",
        "",
        f"Leaf: {meta['shape'][0]} x {meta['shape'][1]} float32 "
        f"({meta['size']:,} entries, {meta['size'] * 4 / mb:.1f} MiB) per worker, "
        f"{meta['workers']} simulated CPU devices on {meta['cpu_count']} cores "
        f"({meta['platform']}, jax {meta['jax']}); density {meta['density']}; "
        f"{meta['reps']} interleaved repetitions, medians. Command: `{meta['command']}`.",
        "",
        "## Exchange: compress + exchange + decompress (worker mean)",
        "",
        "| method | biased | bytes/worker | HLO bytes/worker | ratio | time (s) | vs dense psum "
        "| peak/device (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {'yes' if r['biased'] else 'no'} "
            f"| {r['payload_bytes_per_worker']:,} | {r['hlo_collective_bytes_per_worker']:,} "
            f"| {r['compression_ratio']:.1f}x | {r['time_median_s']:.3f} "
            f"| {r['time_vs_dense_psum']:.2f}x | {r['compiled_peak_bytes_per_device'] / mb:.0f} |"
        )
    lines += [
        "",
        "HLO bytes: read from the compiled program's collectives; on XLA:CPU a bfloat16 "
        "all-reduce runs in float32, hence bf16's doubled HLO figure.",
        "",
        "## Selection on one device: fast top-k and DGC vs exact `lax.top_k`",
        "",
        "| layout | method | recall | time (s) | exact top-k (s) | time vs exact |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for s in selection:
        lines.append(
            f"| {s['layout']} | {s['method']} | {s['recall']:.4f} | {s['time_median_s']:.3f} "
            f"| {s['exact_topk_time_median_s']:.3f} | {s['time_vs_exact']:.2f}x |"
        )
    fast = [s for s in selection if s["method"] == "fast_topk"]
    met = all(s["time_vs_exact"] <= 0.35 and s["recall"] >= 0.95 for s in fast)
    lines += [
        "",
        f"Goal (fast top-k <= 0.35x exact time at recall >= 0.95): "
        f"{'met' if met else 'NOT met'} on "
        + ", ".join(f"{s['layout']} ({s['time_vs_exact']:.2f}x, {s['recall']:.3f})" for s in fast)
        + ".",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.from_json:
        rerender(
            "compressors", lambda r: markdown(r["meta"], r["exchange"], r["selection"]), args.out
        )
        return
    if args.size % args.rows:
        raise ValueError(f"--size {args.size} must be a multiple of --rows {args.rows}.")
    shape = (args.rows, args.size // args.rows)
    mesh = jax.make_mesh((8,), (AXIS,))
    meta = {
        "size": args.size,
        "shape": list(shape),
        "workers": 8,
        "density": args.density,
        "reps": args.reps,
        "topk_reps": args.topk_reps,
        "cpu_count": os.cpu_count(),
        "platform": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "data": "Gaussian scale mixture z1 * exp(0.75 z2), per worker",
        "command": "python benchmarks/compressors.py"
        + (f" --size {args.size}" if args.size != 25_000_000 else "")
        + (f" --reps {args.reps}" if args.reps != 5 else ""),
    }
    selection = bench_selection(args, mesh, shape)
    xs = make_leaves(mesh, shape, "iid")
    rows = bench_exchanges(args, mesh, shape, xs)
    result = {"meta": meta, "exchange": rows, "selection": selection}
    write_results("compressors", result, markdown(meta, rows, selection), args.out)


if __name__ == "__main__":
    main()
