"""ResiReduce at the compiled peak: does the smaller residual state lower the train step's peak?

The residual state of ResiReduce w+2d is smaller than plain error feedback's, but what a
run needs is the peak of the compiled step (DESIGN.md §4): if XLA keeps every group
member's transient residual alive, or copies buffers it cannot update in place, the
saving can vanish at the peak. This benchmark compiles (nothing runs, nothing full-size
is allocated: parameters and optimizer state are ``jax.ShapeDtypeStruct``s) the jitted,
donated data-parallel train step of :func:`resireduce_jax.parallel.data_parallel_step`
for 8 simulated CPU workers, with the paper configs' grouping rules, optimizer and loss
(``train.tasks``: BatchNorm statistics, dropout), at sizes that compile in reasonable
time on CPU:

* ResNet-50 (CIFAR stem, all 16 bottlenecks) at width 32 instead of 64;
* VGG-19-bn (all 16 convolutions) at width 16, classifier width 1024;
* GPT-2 medium at full width (1024, vocabulary 50257, ``wte`` 2-D reduced) with 3 blocks.

For each model it compiles plain EF and w+2d, each without and with
:func:`resireduce_jax.skip_nonfinite` (the guard the training program wraps every chain
in), and reports per worker::

    peak        = argument + output - alias + temp     (resireduce_jax.hlo.peak_memory)
    state saving = residual bytes of EF - residual bytes of w+2d   (memory.model_state_bytes)
    peak drop    = peak(EF) - peak(w+2d);   ratio = peak drop / state saving

The requirement is ratio >= 0.8. XLA:CPU runs with the memory-optimizing scheduler
(:func:`resireduce_jax.runtime.configure_cpu`); GPU schedulers differ. ``--explain DIR``
dumps each compiled step into ``DIR`` and prints what is alive at the peak, by kind
(arguments, forward activations, backward values, exchange/update values, copies).

Writes ``benchmarks/results/peak_memory.{json,md}``. Usage::

    python benchmarks/peak_memory.py                      # all three (about 10 min, 2 cores)
    python benchmarks/peak_memory.py --models resnet50 --explain /tmp/rr_dump
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import importlib.util
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
AXIS = "data"
NUM_WORKERS = 8
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Case:
    """One model at a CPU-compilable size, trained with a paper config's recipe."""

    config: str  # file name in configs/ without .py
    overrides: dict[str, Any]
    batch_per_worker: int
    seq_len: int = 0  # language models: tokens per sequence
    description: str = ""


CASES: dict[str, Case] = {
    "resnet50": Case(
        "resnet50_cifar100",
        {"width": 32},
        batch_per_worker=8,
        description="ResNet-50 (16 bottlenecks, CIFAR stem), width 32, 8 images/worker",
    ),
    "vgg19": Case(
        "vgg19_cifar100",
        {"width": 16, "classifier_width": 1024},
        batch_per_worker=8,
        description="VGG-19-bn (16 convs), width 16, classifier 6272x1024x1024x1000, "
        "8 images/worker",
    ),
    "gpt2_medium": Case(
        "gpt2_medium_wikitext",
        {"num_layers": 3},
        batch_per_worker=1,
        seq_len=128,
        description="GPT-2 medium width (1024, vocab 50257), 3 blocks, 1x128 tokens/worker",
    ),
}


def load_config(name: str):
    """``get_config()`` of ``configs/<name>.py``."""
    path = ROOT / "configs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"configs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _batch_kind(task_kind: str) -> str:
    return {
        "classification": "classification",
        "causal_lm": "language_modeling",
        "span_qa": "span_qa",
    }[task_kind]


def abstract_batch(model_config, kind: str, rows: int, seq_len: int):
    """The global batch of a dataset of ``kind`` as ``ShapeDtypeStruct``s (no data)."""
    import jax
    import jax.numpy as jnp

    if kind == "classification":
        size = model_config.image_size
        return {
            "image": jax.ShapeDtypeStruct(
                (rows, size, size, model_config.num_channels), jnp.float32
            ),
            "label": jax.ShapeDtypeStruct((rows,), jnp.int32),
        }
    if kind == "language_modeling":
        return {"tokens": jax.ShapeDtypeStruct((rows, seq_len + 1), jnp.int32)}
    tokens = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32)
    return {
        "input_ids": tokens,
        "token_type_ids": tokens,
        "attention_mask": tokens,
        "start_positions": jax.ShapeDtypeStruct((rows,), jnp.int32),
        "end_positions": jax.ShapeDtypeStruct((rows,), jnp.int32),
    }


def _dataset_kind(model_config) -> str:
    return {"classification": "classification", "causal_lm": "language_modeling"}.get(
        model_config.task, "span_qa"
    )


@dataclasses.dataclass
class CompiledStep:
    """A compiled train step and the abstract params it was built for."""

    compiled: Any
    params: Any
    tx: Any
    compile_seconds: float


def compile_step(
    config,
    *,
    variant: str,
    guard: bool,
    batch_per_worker: int,
    seq_len: int = 0,
    num_workers: int = NUM_WORKERS,
) -> CompiledStep:
    """Compiles the donated data-parallel train step of ``config`` with residual ``variant``.

    Everything is abstract: parameters, optimizer state, model state and batch are
    ``jax.ShapeDtypeStruct``s with the shardings the training program uses.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import resireduce_jax as rr
    from resireduce_jax import models
    from train import config_schema, factory, tasks

    model_config = models.get_config(
        config.model.name, **config_schema.free_form(config.model.overrides)
    )
    kind = _dataset_kind(model_config)
    task = tasks.make_task(model_config.build(), model_config, kind)
    mesh = rr.parallel.make_mesh(num_workers, AXIS)
    replicated = NamedSharding(mesh, P())
    rows = num_workers * batch_per_worker
    batch = abstract_batch(model_config, kind, rows, seq_len)
    per_worker = {
        k: jax.ShapeDtypeStruct((batch_per_worker, *v.shape[1:]), v.dtype) for k, v in batch.items()
    }
    variables = dict(jax.eval_shape(task.init, jax.random.PRNGKey(0), per_worker))
    params = variables.pop("params")

    tx = factory.build_tx(config, steps_per_epoch=100.0, total_steps=1000, variant=variant)
    if guard:
        tx = rr.skip_nonfinite(tx, AXIS)
    step = rr.parallel.data_parallel_step(
        task.loss, tx, mesh, axis_name=AXIS, has_aux=True, with_model_state=True, with_rng=True
    )
    step.state_specs = rr.parallel.state_partition_specs(tx, params, mesh, AXIS)
    specs = step.state_specs

    def on(sharding, tree):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
        )

    sharded_params = on(replicated, params)
    init = jax.shard_map(
        lambda p: rr.parallel.stack_per_worker(tx.init(p), specs),
        mesh=mesh,
        in_specs=P(),
        out_specs=specs,
    )
    opt_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        jax.eval_shape(init, sharded_params),
        specs,
    )
    model_state = on(replicated, variables)
    global_batch = on(NamedSharding(mesh, P(AXIS)), batch)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
    start = time.perf_counter()
    compiled = step.lower(sharded_params, opt_state, model_state, global_batch, rng).compile()
    return CompiledStep(compiled, params, tx, time.perf_counter() - start)


# ------------------------------------------------------------------ what is alive at the peak


_INSTRUCTION = re.compile(r"\s+(?:ROOT )?%(\S+) = \S+? (?:\{[^}]*\} )?([\w-]+)\((.*?)\)(.*)$")


def live_at_peak(dump_dir: str) -> dict[str, Any]:
    """Summarizes the buffers alive at the peak of the largest module dumped in ``dump_dir``.

    Reads XLA's ``*-live-range.txt`` ("Live ranges at N (peak)") and the optimized HLO of
    the same module, and sorts every live buffer into: arguments (params, optimizer state
    incl. residuals, other), forward activations, backward values, exchange/update values,
    and copies of each (a ``copy`` XLA inserted, followed through bitcasts).
    """
    live_ranges = sorted(
        glob.glob(os.path.join(dump_dir, "*cpu_after_optimizations-live-range.txt")),
        key=os.path.getsize,
    )
    if not live_ranges:
        raise FileNotFoundError(f"No XLA live-range dump in {dump_dir}.")
    live_range = live_ranges[-1]
    hlo_file = live_range.replace("-live-range.txt", ".txt")
    with open(live_range) as f:
        text = f.read()
    section = text.split("(peak):", 1)[1].split("Stack trace", 1)[0]
    live = [
        (m.group(1), int(m.group(2)))
        for m in re.finditer(r"^\s+(\S+?)\{[^}]*\}: (\d+) bytes", section, re.M)
    ]
    instructions = {}
    with open(hlo_file) as f:
        for line in f:
            m = _INSTRUCTION.match(line)
            if m:
                name, opcode, operands, rest = m.groups()
                op_name = re.search(r'op_name="([^"]*)"', rest)
                instructions[name] = (opcode, operands, op_name.group(1) if op_name else "")

    def origin(name: str, depth: int = 0) -> tuple[bool, str, str]:
        opcode, operands, op_name = instructions.get(name, ("?", "", ""))
        if opcode in ("copy", "bitcast") and depth < 6:
            copied, kind, source = origin(operands.split(",")[0].strip().lstrip("%"), depth + 1)
            return copied or opcode == "copy", kind, source
        if opcode == "parameter":
            if op_name.startswith("opt_state"):
                kind = "argument: residuals" if ".residuals" in op_name else "argument: optimizer"
            elif op_name.startswith("params"):
                kind = "argument: params"
            else:
                kind = "argument: other"
            return False, kind, op_name
        if "transpose(jvp" in op_name:
            return False, "backward", op_name
        if "jvp(" in op_name:
            return False, "forward", op_name
        return False, "exchange/update", op_name

    totals: dict[str, int] = collections.Counter()
    largest = []
    for name, size in live:
        copied, kind, source = origin(name)
        key = f"copy of {kind}" if copied else kind
        totals[key] += size
        largest.append((size, key, source))
    largest.sort(reverse=True)
    return {
        "total": sum(size for _, size in live),
        "by_kind": dict(sorted(totals.items(), key=lambda kv: -kv[1])),
        "largest": [{"bytes": s, "kind": k, "source": src} for s, k, src in largest[:12]],
    }


def _explain_in_subprocess(model: str, variant: str, guard: bool, dump_root: str) -> dict:
    """XLA dump flags are fixed at start-up: compile one step in a child process."""
    import subprocess
    import sys

    dump_dir = os.path.join(
        dump_root, f"{model}_{variant.replace('+', '_')}_{'guard' if guard else 'plain'}"
    )
    os.makedirs(dump_dir, exist_ok=True)
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "")
        + f" --xla_dump_to={dump_dir}"
        + " --xla_dump_hlo_module_re=.*jit_body.*"
    )
    cmd = [
        sys.executable,
        __file__,
        "--models",
        model,
        "--_one",
        variant,
        "--_guard",
        str(int(guard)),
    ]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return live_at_peak(dump_dir)


# ------------------------------------------------------------------ the comparison


def measure(name: str, case: Case, guard: bool) -> dict[str, Any]:
    import resireduce_jax as rr

    config = load_config(case.config)
    config.model.overrides = dict(case.overrides)
    out: dict[str, Any] = {"model": name, "guard": guard, "description": case.description}
    steps = {}
    for variant in ("ef", config.compression.variant):
        steps[variant] = compile_step(
            config,
            variant=variant,
            guard=guard,
            batch_per_worker=case.batch_per_worker,
            seq_len=case.seq_len,
        )
    ef, reduced = steps["ef"], steps[config.compression.variant]
    ef_peak = rr.hlo.peak_memory(ef.compiled)
    rr_peak = rr.hlo.peak_memory(reduced.compiled)
    ef_state = rr.memory.model_state_bytes(ef.params, ef.tx)
    rr_state = rr.memory.model_state_bytes(reduced.params, reduced.tx)
    saving = ef_state.residuals - rr_state.residuals
    drop = ef_peak.peak - rr_peak.peak
    out.update(
        variant=config.compression.variant,
        ef=ef_peak.as_dict(),
        reduced=rr_peak.as_dict(),
        ef_residual_bytes=ef_state.residuals,
        reduced_residual_bytes=rr_state.residuals,
        state_saving=saving,
        peak_drop=drop,
        ratio=drop / saving if saving else float("nan"),
        compile_seconds={"ef": ef.compile_seconds, "reduced": reduced.compile_seconds},
    )
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "# ResiReduce w+2d vs plain EF at the compiled peak of the train step",
        "",
        "Per worker, 8 simulated CPU workers, jitted donated step "
        "(`rr.parallel.data_parallel_step`), XLA:CPU memory scheduler. "
        "peak = argument + output - alias + temp; MiB = 2^20 bytes. "
        "Requirement: peak drop >= 80 % of the residual-state saving.",
        "",
        "| model | guard | EF peak | w+2d peak | EF temp | w+2d temp | state saving "
        "| peak drop | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} | {'skip_nonfinite' if r['guard'] else 'none'} "
            f"| {r['ef']['peak'] / MiB:.1f} | {r['reduced']['peak'] / MiB:.1f} "
            f"| {r['ef']['temp'] / MiB:.1f} | {r['reduced']['temp'] / MiB:.1f} "
            f"| {r['state_saving'] / MiB:.1f} | {r['peak_drop'] / MiB:.1f} | {r['ratio']:.2f} |"
        )
    lines += ["", "Models:", ""]
    seen = set()
    for r in results:
        if r["model"] not in seen:
            seen.add(r["model"])
            lines.append(f"* {r['model']}: {r['description']}")
    explained = [r for r in results if "explain" in r]
    if explained:
        lines += [
            "",
            "## Alive at the peak (MiB)",
            "",
            "From XLA's live-range dump (`--explain`): the values alive at the heap "
            "simulator's peak, by origin. Its total can differ from the peak above, which "
            "also counts fragmentation of the packed temp buffer.",
            "",
        ]
        for r in explained:
            for variant, live in r["explain"].items():
                parts = ", ".join(f"{k} {v / MiB:.1f}" for k, v in live["by_kind"].items())
                guard = "guard" if r["guard"] else "plain"
                lines.append(
                    f"* {r['model']} {variant} ({guard}): total {live['total'] / MiB:.1f}: {parts}"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--guard", choices=("both", "plain", "guard"), default="both")
    parser.add_argument("--out", default=str(RESULTS), help="directory for peak_memory.{json,md}")
    parser.add_argument(
        "--explain", metavar="DIR", help="dump the steps and show what is alive at the peak"
    )
    parser.add_argument("--_one", help=argparse.SUPPRESS)
    parser.add_argument("--_guard", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from resireduce_jax import runtime

    runtime.configure_cpu(NUM_WORKERS)

    if args._one:  # child process of --explain: compile one step with dump flags
        case = CASES[args.models[0]]
        config = load_config(case.config)
        config.model.overrides = dict(case.overrides)
        compile_step(
            config,
            variant=args._one,
            guard=bool(int(args._guard)),
            batch_per_worker=case.batch_per_worker,
            seq_len=case.seq_len,
        )
        return

    guards = {"both": (False, True), "plain": (False,), "guard": (True,)}[args.guard]
    results = []
    for name in args.models:
        for guard in guards:
            r = measure(name, CASES[name], guard)
            if args.explain:
                r["explain"] = {
                    v: _explain_in_subprocess(name, v, guard, args.explain)
                    for v in ("ef", r["variant"])
                }
            results.append(r)
            print(
                f"{name:12s} guard={guard!s:5s} EF {r['ef']['peak'] / MiB:8.1f} MiB  "
                f"{r['variant']} {r['reduced']['peak'] / MiB:8.1f} MiB  saving "
                f"{r['state_saving'] / MiB:6.1f}  drop {r['peak_drop'] / MiB:6.1f}  "
                f"ratio {r['ratio']:.2f}",
                flush=True,
            )
    os.makedirs(args.out, exist_ok=True)
    import jax

    payload = {
        "jax": jax.__version__,
        "platform": platform.platform(),
        "num_workers": NUM_WORKERS,
        "scheduler": "xla_cpu memory-optimizing (concurrency_optimized_scheduler=false)",
        "results": results,
    }
    with open(os.path.join(args.out, "peak_memory.json"), "w") as f:
        json.dump(payload, f, indent=2)
    with open(os.path.join(args.out, "peak_memory.md"), "w") as f:
        f.write(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
