"""Memory-vs-compute frontier of rotor checkpointing against the classic schedules.

For ResNet-50 (CIFAR), GPT-2 small and ViT-S/16, built as chains of the model zoo's blocks
(:func:`resireduce_jax.remat.zoo.sequential_layers`), this compiles the training gradient
(``jax.value_and_grad`` of a cross-entropy loss w.r.t. the parameters, BatchNorm statistics
updated, dropout on) under

* rotor plans: candidates of the dynamic program spread over its whole memory range, and
  the calibrated choice (:meth:`ChainPlanner.select`) at each baseline's compiled peak;
* baselines, run through the same executor: no remat, every stage checkpointed,
  ``checkpoint_sequential`` with ``k`` segments (``k = round(√L)`` is "√n"), recursive
  halving; and every-stage / √n as plain ``jax.checkpoint`` without the sequenced backward
  (``*-plain``), as a user would write them.

Every point is a compiled program: peak = argument + output − alias + temp bytes of
``memory_analysis()`` (parameters and gradients included), FLOPs from ``cost_analysis()``,
overhead = FLOPs / FLOPs without checkpointing − 1. Nothing is executed, so the sizes are
the real models at reduced batch; compilation on a 2-core CPU dominates the run time.

Writes ``benchmarks/results/remat.json``, ``remat.md`` and ``remat.png``.

    python benchmarks/remat.py                      # all three models (about 40 min)
    python benchmarks/remat.py --models gpt2_small --rotor-plans 8
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import time

from resireduce_jax import runtime

runtime.configure_cpu(num_devices=1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from resireduce_jax.models import get_config  # noqa: E402
from resireduce_jax.remat import ChainCosts, RotorSequential, RotorTable, baselines  # noqa: E402
from resireduce_jax.remat.zoo import sequential_layers  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
MIB = 2.0**20

# Reduced batch (and GPT-2 sequence length) keep the compiled programs' activations next to
# the parameters; depth, widths and resolutions are the published ones.
SETTINGS = {
    "resnet50_cifar": dict(batch=32, overrides={}),
    "gpt2_small": dict(batch=4, overrides={"seq_len": 256}),
    "vit_s16": dict(batch=16, overrides={"num_classes": 100}),
}


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def build_planner(name: str, batch: int, overrides: dict, slots: int):
    config = get_config(name, **overrides)
    example = config.example_batch(batch)
    inputs = example[config.input_names[0]]
    labels = jnp.zeros(example[config.target_names[0]].shape, jnp.int32)
    model = RotorSequential(sequential_layers(name, **overrides))
    variables = jax.eval_shape(
        lambda key: model.init(key, jnp.zeros(inputs.shape, inputs.dtype)), jax.random.key(0)
    )
    mutable = ["batch_stats"] if "batch_stats" in variables else False
    start = time.perf_counter()
    planner = model.planner(
        variables,
        inputs,
        loss=lambda logits: cross_entropy(logits, labels),
        train=True,
        mutable=mutable,
        rngs={"dropout": jax.random.key(1)},
        slots=slots,
    )
    return planner, time.perf_counter() - start, len(model.layers)


def baseline_plans(n: int) -> dict:
    plans = {"no remat": baselines.no_remat(n), "every stage": baselines.every_stage(n)}
    sqrt_k = max(1, round(math.sqrt(n)))
    for k in sorted({2, 3, sqrt_k, 6, n // 2}):
        if 2 <= k <= n:
            label = f"segments k={k}" + (" (√n)" if k == sqrt_k else "")
            plans[label] = baselines.sequential_segments(n, k)
    for leaf in (1, 2, 4):
        plans[f"halving leaf={leaf}"] = baselines.recursive_halving(n, leaf)
    return plans


def point(kind, label, plan, compiled, base_flops, predicted=None):
    return {
        "kind": kind,
        "label": label,
        "plan": plan.compact(),
        "checkpoints": plan.num_checkpoints,
        "peak_bytes": compiled.peak,
        "peak_mib": compiled.peak / MIB,
        "flops": compiled.flops,
        "overhead": compiled.flops / base_flops - 1.0,
        "model_peak_mib": None if predicted is None else predicted[1] / MIB,
        "model_overhead": None if predicted is None else predicted[0],
    }


def run_model(name: str, rotor_plans: int, slots: int) -> dict:
    setting = SETTINGS[name]
    planner, measure_s, n = build_planner(name, setting["batch"], setting["overrides"], slots)
    costs = planner.costs
    base = planner.no_remat
    unwrapped_time = planner.predict(baselines.no_remat(n))[0]

    def predicted(plan):
        time_, memory = planner.predict(plan)
        return time_ / unwrapped_time - 1.0, memory

    points = []
    frontier = planner.frontier(rotor_plans, progress=lambda xs: tqdm(xs, desc=f"{name} rotor"))
    for solution, compiled in frontier:
        points.append(
            point(
                "rotor",
                "rotor candidate",
                solution.plan,
                compiled,
                base.flops,
                predicted(solution.plan),
            )
        )
    for label, plan in tqdm(baseline_plans(n).items(), desc=f"{name} baselines"):
        points.append(
            point("baseline", label, plan, planner.compile(plan), base.flops, predicted(plan))
        )
    # As users write them: plain jax.checkpoint, XLA free to order the backward pass.
    planner_plain = type(planner)(
        planner.stages,
        planner.params,
        planner.x,
        loss=planner.loss,
        costs=costs,
        slots=slots,
        sequence_backward=False,
    )
    for label, plan in tqdm(
        {
            "no remat": baselines.no_remat(n),
            "every stage": baselines.every_stage(n),
            "segments √n": baselines.sequential_segments(n),
        }.items(),
        desc=f"{name} plain",
    ):
        compiled = planner_plain.compile(plan)
        points.append(point("plain", f"{label} (plain jax.checkpoint)", plan, compiled, base.flops))

    # Rotor's calibrated choice at each baseline's compiled peak.
    comparisons = []
    for entry in [p for p in points if p["kind"] != "rotor" and p["label"] != "no remat"]:
        try:
            choice = planner.select(entry["peak_bytes"])
        except ValueError:  # below the leanest rotor candidate
            comparisons.append(
                {
                    "baseline": entry["label"],
                    "budget_mib": entry["peak_mib"],
                    "baseline_overhead": entry["overhead"],
                    "rotor_peak_mib": None,
                    "rotor_overhead": None,
                    "rotor_plan": None,
                    "rotor_lower": False,
                    "rotor_equal": False,
                }
            )
            continue
        rotor = point("rotor-choice", "rotor at budget", choice.plan, choice.compiled, base.flops)
        points.append(rotor)
        comparisons.append(
            {
                "baseline": entry["label"],
                "budget_mib": entry["peak_mib"],
                "baseline_overhead": entry["overhead"],
                "rotor_peak_mib": rotor["peak_mib"],
                "rotor_overhead": rotor["overhead"],
                "rotor_plan": rotor["plan"],
                "rotor_lower": rotor["overhead"] < entry["overhead"] - 5e-4,
                "rotor_equal": abs(rotor["overhead"] - entry["overhead"]) <= 5e-4,
            }
        )
    return {
        "model": name,
        "batch": setting["batch"],
        "overrides": setting["overrides"],
        "stages": n,
        "stage_names": list(costs.stage_names),
        "measure_and_solve_s": measure_s,
        "candidates": len(planner.candidates),
        "compilations": planner.compilations,
        "no_remat_peak_mib": base.peak / MIB,
        "no_remat_gflops": base.flops / 1e9,
        "params_mib": float(costs.param_bytes.sum()) / MIB,
        "costs": costs.as_dict(),
        "points": points,
        "comparisons": comparisons,
    }


def solver_speed(stages: int = 100, slots: int = 500) -> dict:
    rng = np.random.default_rng(0)
    a = rng.integers(1, 100, stages + 1) * 2**20
    fw = rng.uniform(1, 10, stages) * 1e9
    costs = ChainCosts(
        activation_bytes=a,
        saved_bytes=a[1:] * rng.integers(1, 6, stages),
        forward_temp_bytes=rng.integers(0, 50, stages) * 2**20,
        backward_temp_bytes=rng.integers(0, 50, stages) * 2**20,
        param_bytes=rng.integers(1, 20, stages) * 2**20,
        grad_bytes=rng.integers(1, 20, stages) * 2**20,
        forward_time=fw,
        backward_time=2 * fw,
        residual_time=fw,
        time_unit="flops",
        stage_names=tuple(str(i) for i in range(stages)),
    )
    RotorTable(costs, slots=slots)  # warm-up (page faults)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        table = RotorTable(costs, slots=slots)
        times.append(time.perf_counter() - start)
    return {
        "stages": stages,
        "slots": slots,
        "seconds": min(times),
        "candidates": len(table.candidates()),
    }


def markdown(results: dict) -> str:
    lines = [
        "# Rotor checkpointing: compiled peak vs FLOPs overhead",
        "",
        f"CPU ({platform.processor() or platform.machine()}), jax {jax.__version__}, XLA flags "
        "from `runtime.configure_cpu` (memory scheduler, checkpoint barriers kept). Peak = "
        "argument + output − alias + temp bytes of the compiled training gradient (parameters "
        "and gradients included); overhead = compiled FLOPs / FLOPs without remat − 1.",
        "",
        f"Solver: L = {results['solver']['stages']} stages, {results['solver']['slots']} "
        f"slots in {results['solver']['seconds']:.2f} s "
        f"({results['solver']['candidates']} distinct plans).",
    ]
    for model in results["models"]:
        lines += [
            "",
            f"## {model['model']} (batch {model['batch']}"
            + (f", {model['overrides']}" if model["overrides"] else "")
            + f"; {model['stages']} stages; params {model['params_mib']:.0f} MiB; "
            f"no-remat peak {model['no_remat_peak_mib']:.0f} MiB, "
            f"{model['no_remat_gflops']:.0f} GFLOP)",
            "",
            f"Measurement + DP: {model['measure_and_solve_s']:.0f} s; {model['candidates']} "
            f"candidate plans; {model['compilations']} programs compiled.",
            "",
            "| schedule | peak MiB | FLOPs overhead | model peak MiB | plan |",
            "|---|---:|---:|---:|---|",
        ]
        shown = [p for p in model["points"] if p["kind"] != "rotor-choice"]
        for p in sorted(shown, key=lambda p: -p["peak_bytes"]):
            model_peak = "" if p["model_peak_mib"] is None else f"{p['model_peak_mib']:.0f}"
            plan = p["plan"] if len(p["plan"]) <= 60 else p["plan"][:57] + "..."
            lines.append(
                f"| {p['label']} | {p['peak_mib']:.0f} | {100 * p['overhead']:+.1f}% "
                f"| {model_peak} | `{plan}` |"
            )
        lines += [
            "",
            "Rotor's calibrated choice with each baseline's peak as the budget:",
            "",
            "| baseline | budget MiB | its overhead | rotor peak MiB | rotor overhead | rotor is |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for c in model["comparisons"]:
            if c["rotor_peak_mib"] is None:
                lines.append(
                    f"| {c['baseline']} | {c['budget_mib']:.0f} | "
                    f"{100 * c['baseline_overhead']:+.1f}% | below rotor's leanest plan | | - |"
                )
                continue
            lines.append(
                f"| {c['baseline']} | {c['budget_mib']:.0f} | {100 * c['baseline_overhead']:+.1f}% "
                f"| {c['rotor_peak_mib']:.0f} | {100 * c['rotor_overhead']:+.1f}% "
                f"| {'lower' if c['rotor_lower'] else 'equal' if c['rotor_equal'] else 'higher'} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    styles = {
        "rotor": dict(marker="o", color="C0", label="rotor candidates"),
        "rotor-choice": dict(marker="*", color="C3", s=120, label="rotor at a baseline's peak"),
    }
    for ax, model in zip(axes[0], models, strict=True):
        for kind in ("rotor", "rotor-choice"):
            pts = [p for p in model["points"] if p["kind"] == kind]
            ax.scatter(
                [p["peak_mib"] for p in pts], [100 * p["overhead"] for p in pts], **styles[kind]
            )
        others = [p for p in model["points"] if p["kind"] in ("baseline", "plain")]
        for i, p in enumerate(others):
            marker = "s" if p["kind"] == "baseline" else "x"
            color = plt.cm.tab20(i % 20)
            ax.scatter(
                p["peak_mib"], 100 * p["overhead"], marker=marker, color=color, label=p["label"]
            )
        ax.set_title(f"{model['model']} (batch {model['batch']})")
        ax.set_xlabel("compiled peak (MiB)")
        ax.set_ylabel("FLOPs overhead (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--rotor-plans", type=int, default=12, help="DP candidates to compile")
    parser.add_argument("--slots", type=int, default=500)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"solver": solver_speed(), "models": []}
    for name in args.models:
        results["models"].append(run_model(name, args.rotor_plans, args.slots))
        (args.out / "remat.json").write_text(json.dumps(results, indent=1))
    (args.out / "remat.md").write_text(markdown(results))
    plot(results, args.out / "remat.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
