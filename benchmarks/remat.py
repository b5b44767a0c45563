"""Memory-vs-compute frontier of rotor checkpointing against the classic schedules.

For ResNet-50 (CIFAR), GPT-2 small and ViT-S/16, as the chains the models give
(:func:`resireduce_jax.remat.zoo.model_chain`, GPT-2's head tied to its embedding), on the
models' own variables, this compiles the training gradient
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

``--accounting`` checks the solver's memory accounting against XLA on small chains whose
activations alternate between narrow and wide (so that cotangents differ in size): for
sampled plans, the compiled peak beside the model peak with ``δ_t`` freed after the
backward that reads it (rotor's accounting, the solver's) and with ``δ_t`` held through
the whole segment (the solver's accounting before), about 2 minutes.

Writes ``benchmarks/results/remat.json``, ``remat.md`` and ``remat.png``.

    python benchmarks/remat.py                      # all three models (about 36 min)
    python benchmarks/remat.py --models gpt2_small --update   # redo one model in place
    python benchmarks/remat.py --accounting        # redo the accounting check only
    python benchmarks/remat.py --from-json          # re-render remat.md / remat.png only
"""

from __future__ import annotations

import argparse
import itertools
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
from common import RESULTS, fill_prose  # noqa: E402
from tqdm import tqdm  # noqa: E402

from resireduce_jax.models import get_config  # noqa: E402
from resireduce_jax.remat import (  # noqa: E402
    ChainCosts,
    RotorSequential,
    RotorTable,
    baselines,
    compile_gradient,
    measure_chain,
    predict,
)
from resireduce_jax.remat.solver import (  # noqa: E402
    Checkpoint,
    Plan,
    PlanItem,
    RunStage,
    all_plans,
)
from resireduce_jax.remat.zoo import model_chain  # noqa: E402

MIB = 2.0**20
OVERHEAD_TOLERANCE = 5e-4  # FLOPs overheads closer than 0.05 points count as equal

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
    """The planner of the model's chain, on the model's own (abstract) variables.

    Variables come from the monolithic model's ``init`` mapped to the chain
    (:meth:`ModelChain.chain_variables`), so tied weights (GPT-2's ``wte``, embedding and
    head) are one leaf that both stages hold: one argument and one gradient.
    """
    config = get_config(name, **overrides)
    example = config.example_batch(batch)
    inputs = example[config.input_names[0]]
    labels = jnp.zeros(example[config.target_names[0]].shape, jnp.int32)
    chain = model_chain(name, **overrides)
    model = RotorSequential(chain.layers)
    monolithic = config.build()
    variables = chain.chain_variables(
        jax.eval_shape(
            lambda key: monolithic.init(key, jnp.zeros(inputs.shape, inputs.dtype), train=False),
            jax.random.key(0),
        )
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


def compare(baseline: dict, rotor: dict | None) -> dict:
    """Rotor's choice at ``baseline``'s compiled peak against ``baseline``.

    The goal holds when rotor's compiled peak is at most the baseline's and its FLOPs
    overhead is lower (by more than 0.05 points), or both overheads are zero.
    """
    entry = {
        "baseline": baseline["label"],
        "budget_bytes": baseline["peak_bytes"],
        "budget_mib": baseline["peak_mib"],
        "baseline_overhead": baseline["overhead"],
        "rotor_peak_bytes": None,
        "rotor_peak_mib": None,
        "rotor_overhead": None,
        "rotor_plan": None,
        "rotor_lower": False,
        "rotor_equal": False,
        "goal_met": False,
    }
    if rotor is None:
        return entry
    lower = rotor["overhead"] < baseline["overhead"] - OVERHEAD_TOLERANCE
    equal = abs(rotor["overhead"] - baseline["overhead"]) <= OVERHEAD_TOLERANCE
    both_free = equal and abs(baseline["overhead"]) <= OVERHEAD_TOLERANCE
    entry.update(
        rotor_peak_bytes=rotor["peak_bytes"],
        rotor_peak_mib=rotor["peak_mib"],
        rotor_overhead=rotor["overhead"],
        rotor_plan=rotor["plan"],
        rotor_lower=lower,
        rotor_equal=equal,
        goal_met=rotor["peak_bytes"] <= baseline["peak_bytes"] and (lower or both_free),
    )
    return entry


def one_recomputation_fewer(plan: Plan, costs: ChainCosts) -> list[Plan]:
    """``plan`` with one stage that it checkpoints on its own run unwrapped instead.

    Where rotor only ties a baseline, these show what cutting the baseline's FLOPs costs:
    the stage whose recomputation is dropped keeps its whole history. Probed are the first
    and the last such stage among those with the costliest recomputation (``residual_time``
    at least half the largest); a stage of a homogeneous chain stands for all of them.
    """
    singles = [
        i
        for i, item in enumerate(plan.items)
        if isinstance(item, Checkpoint) and item.body == (RunStage(item.start),)
    ]
    if not singles:
        return []
    redo = costs.residual_time
    heavy = [i for i in singles if redo[plan.items[i].start] >= 0.5 * redo.max()]
    variants = []
    for i in sorted({heavy[0], heavy[-1]}) if heavy else []:
        items = list(plan.items)
        items[i] = RunStage(plan.items[i].start)
        variants.append(Plan(tuple(items), plan.num_stages))
    return variants


def run_model(name: str, rotor_plans: int, slots: int) -> dict:
    setting = SETTINGS[name]
    started = time.perf_counter()
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
    plans = {}
    for label, plan in tqdm(baseline_plans(n).items(), desc=f"{name} baselines"):
        plans[label] = plan
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
        plans[f"{label} (plain jax.checkpoint)"] = plan
        points.append(point("plain", f"{label} (plain jax.checkpoint)", plan, compiled, base.flops))

    # Rotor's calibrated choice at each baseline's compiled peak.
    comparisons = []
    for entry in [p for p in points if p["kind"] != "rotor" and p["label"] != "no remat"]:
        try:
            choice = planner.select(entry["peak_bytes"])
        except ValueError:  # below the leanest rotor candidate
            comparisons.append(compare(entry, None))
            continue
        rotor = point("rotor-choice", "rotor at budget", choice.plan, choice.compiled, base.flops)
        points.append(rotor)
        comparisons.append(compare(entry, rotor))
        if not comparisons[-1]["goal_met"]:
            comparisons[-1]["probe"] = [
                point("probe", "one recomputation fewer", plan, planner.compile(plan), base.flops)
                for plan in one_recomputation_fewer(plans[entry["label"]], costs)
            ]
    return {
        "model": name,
        "delta_accounting": "freed",
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
        "seconds": time.perf_counter() - started,
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


# ------------------------------------------------------------ memory accounting check


def held_delta_peak(plan: Plan, costs: ChainCosts) -> float:
    """Model peak of ``plan`` if ``δ_t`` stayed alive through the whole segment ``[s, t)``.

    The solver's accounting before it followed rotor's (Beaumont et al., §4): the caller
    of a segment holds its output cotangent until the segment is done, so the
    recomputation of a checkpointed ``[s, j)`` runs beside ``δ_j`` *and* ``δ_t``, and the
    chain's ``δ_L`` is held from start to end. Other terms are the solver's.
    """
    a, xbar = costs.activation_bytes, costs.saved_bytes
    o_f, o_b = costs.forward_temp_bytes, costs.backward_temp_bytes
    grads = np.concatenate([np.cumsum(costs.grad_bytes[::-1])[::-1], [0]])

    def sweep(s: int, j: int) -> float:
        return max((a[k] if k > s else 0) + a[k + 1] + o_f[k] for k in range(s, j))

    def need(items: tuple[PlanItem, ...], t: int) -> float:
        """Beyond ``x_s`` and ``δ_t``, both held by the caller."""
        first, rest = items[0], items[1:]
        if isinstance(first, RunStage):
            s = first.index
            backward = xbar[s] + a[s] + grads[s] + o_b[s]
            if not rest:
                return max(grads[t] + xbar[s] + o_f[s], backward)
            return max(grads[t] + xbar[s] + o_f[s], backward + a[s + 1], xbar[s] + need(rest, t))
        s, j = first.start, first.end
        if not rest:
            return max(grads[t] + sweep(s, j), need(first.body, j))
        return max(grads[t] + sweep(s, j), a[j] + need(rest, t), a[j] + need(first.body, j))

    n = plan.num_stages
    return float(costs.param_bytes.sum() + a[0] + a[n] + need(plan.items, n))


def _tanh_layer(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def _linear_layer(p, x):
    return x @ p["w"]


def _gelu_block(p, x):
    return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]


# Six stages each (394 plans); batch 256. A width of 1024 makes x_i and δ_i 1 MiB, 64 makes
# them 64 KiB: which cotangent a model holds decides its peak.
ACCOUNTING_CHAINS = {
    "tanh, narrow-wide": ([64, 1024, 64, 1024, 64, 1024, 64], "tttttt"),
    "tanh, wide-narrow": ([1024, 64, 1024, 64, 1024, 64, 1024], "tttttt"),
    "linear/tanh, narrow-wide": ([64, 1024, 64, 1024, 64, 1024, 64], "ltltlt"),
    "tanh/GELU block": ([64, 256, 256, 512, 512, 64, 64], "tgtgtg"),
}


def _accounting_chain(widths: list[int], kinds: str, batch: int = 256):
    f32 = jnp.float32
    stages, params = [], []
    for (d, e), kind in zip(itertools.pairwise(widths), kinds, strict=True):
        if kind == "g":
            stages.append(_gelu_block)
            params.append(
                {
                    "w1": jax.ShapeDtypeStruct((d, 4 * d), f32),
                    "w2": jax.ShapeDtypeStruct((4 * d, d), f32),
                }
            )
        elif kind == "l":
            stages.append(_linear_layer)
            params.append({"w": jax.ShapeDtypeStruct((d, e), f32)})
        else:
            stages.append(_tanh_layer)
            params.append(
                {"w": jax.ShapeDtypeStruct((d, e), f32), "b": jax.ShapeDtypeStruct((e,), f32)}
            )
    return stages, params, jax.ShapeDtypeStruct((batch, widths[0]), f32)


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (for Spearman's correlation)."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values))
    for value in np.unique(values):
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.corrcoef(_ranks(x), _ranks(y))[0, 1])


def accounting_check(plans_per_chain: int = 40, seed: int = 0) -> list[dict]:
    """Compiled peaks of sampled plans against both accountings of ``δ``, per chain.

    Per chain: Spearman's rank correlation of the compiled peak with each model peak,
    their mean absolute error, and the least-squares slope of ``compiled − freed`` on
    ``held − freed`` (the bytes of ``δ`` the held accounting adds at its peak): 1 if XLA
    kept those cotangents alive, 0 if it freed them.
    """
    rng = np.random.default_rng(seed)
    out = []
    for name, (widths, kinds) in ACCOUNTING_CHAINS.items():
        stages, params, x = _accounting_chain(widths, kinds)
        n = len(stages)
        costs = measure_chain(stages, params, x)
        every = [Plan(items, n) for items in all_plans(0, n)]
        picked = rng.choice(len(every), size=min(plans_per_chain, len(every)), replace=False)
        plans = [every[i] for i in sorted(picked)]
        plans += [baselines.no_remat(n), baselines.every_stage(n), baselines.recursive_halving(n)]
        rows = []
        for plan in tqdm(list(dict.fromkeys(plans)), desc=f"accounting: {name}"):
            compiled = compile_gradient(stages, plan, params, x)
            rows.append(
                {
                    "plan": plan.compact(),
                    "compiled_bytes": compiled.peak,
                    "freed_bytes": predict(plan, costs)[1],
                    "held_bytes": held_delta_peak(plan, costs),
                }
            )
        compiled = np.array([r["compiled_bytes"] for r in rows], dtype=np.float64)
        freed = np.array([r["freed_bytes"] for r in rows], dtype=np.float64)
        held = np.array([r["held_bytes"] for r in rows], dtype=np.float64)
        extra = held - freed
        design = np.stack([extra, np.ones_like(extra)], axis=1)
        slope = np.linalg.lstsq(design, compiled - freed, rcond=None)[0][0]
        out.append(
            {
                "chain": name,
                "widths": widths,
                "kinds": kinds,
                "plans": len(rows),
                "held_extra_mean_mib": float(extra.mean() / MIB),
                "held_extra_max_mib": float(extra.max() / MIB),
                "spearman_freed": _spearman(compiled, freed),
                "spearman_held": _spearman(compiled, held),
                "mae_freed_mib": float(np.abs(compiled - freed).mean() / MIB),
                "mae_held_mib": float(np.abs(compiled - held).mean() / MIB),
                "slope": float(slope),
                "rows": rows,
            }
        )
    return out


def accounting_markdown(check: list[dict]) -> list[str]:
    lines = [
        "",
        "## Memory accounting: is δ freed after the backward that reads it?",
        "",
        "Sampled plans of six-stage chains (batch 256), each compiled; model peaks with "
        "δ_t freed by the backward of stage t − 1 (rotor's accounting, the solver's) and "
        "held through the whole segment (the held accounting). *held − freed*: the δ bytes "
        "the held accounting adds at its peak. *slope*: least squares of compiled − freed "
        "on held − freed (1 if XLA kept those cotangents, 0 if it freed them).",
        "",
        "| chain | plans | held − freed MiB (mean / max) | Spearman: freed / held "
        "| mean abs error MiB: freed / held | slope |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for c in check:
        lines.append(
            f"| {c['chain']} | {c['plans']} | {c['held_extra_mean_mib']:.2f} / "
            f"{c['held_extra_max_mib']:.2f} | {c['spearman_freed']:.2f} / "
            f"{c['spearman_held']:.2f} | {c['mae_freed_mib']:.2f} / {c['mae_held_mib']:.2f} "
            f"| {c['slope']:+.2f} |"
        )
    lines += ["", "<!-- prose: accounting -->"]
    return lines


def goal_summary(model: dict) -> str:
    """One line: where rotor's choice beats the baselines at their own peak."""
    comparisons = model["comparisons"]
    missed = [c["baseline"] for c in comparisons if not c["goal_met"]]
    # The baselines the goal names (every-stage and √n), sequenced and plain jax.checkpoint alike.
    issue = [
        c for c in comparisons if c["baseline"].startswith("every stage") or "√n" in c["baseline"]
    ]
    issue_met = sum(c["goal_met"] for c in issue)
    text = (
        f"every-stage and √n: met at {issue_met} of {len(issue)} points; all baselines: met at "
        f"{len(comparisons) - len(missed)} of {len(comparisons)}"
    )
    return text + (f" (missed: {', '.join(missed)})" if missed else "")


def markdown(results: dict) -> str:
    solver = results["solver"]
    lines = [
        "# Rotor checkpointing: compiled peak vs FLOPs overhead",
        "",
        f"CPU ({platform.processor() or platform.machine()}), jax {jax.__version__}, XLA flags "
        "from `runtime.configure_cpu` (memory scheduler, checkpoint barriers kept). Peak = "
        "argument + output − alias + temp bytes of the compiled training gradient (parameters "
        "and gradients included); overhead = compiled FLOPs / FLOPs without remat − 1. "
        "Nothing is executed: every figure is from a compiled program.",
        "",
        f"Solver: L = {solver['stages']} stages, {solver['slots']} slots in "
        f"{solver['seconds']:.2f} s ({solver['candidates']} distinct plans)."
        + (
            f" Run time: {sum(m['seconds'] for m in results['models']) / 60:.0f} min"
            " (2 shared CPU cores)."
            if all("seconds" in m for m in results["models"])
            else ""
        ),
        "",
        "**Goal**: at equal or lower compiled peak, rotor's FLOPs overhead is lower "
        "than every-stage and √n remat. Checked per baseline point: rotor's calibrated choice "
        "(`ChainPlanner.select`) with the baseline's compiled peak as the budget must compile "
        "to a peak ≤ the baseline's and an overhead lower by more than "
        f"{100 * OVERHEAD_TOLERANCE:.2f} points (or both zero).",
        "",
    ]
    for model in results["models"]:
        lines.append(f"* {model['model']}: {goal_summary(model)}.")
    for model in results["models"]:
        seconds = model.get("seconds")
        lines += [
            "",
            f"## {model['model']} (batch {model['batch']}"
            + (f", {model['overrides']}" if model["overrides"] else "")
            + f"; {model['stages']} stages; params {model['params_mib']:.0f} MiB; "
            f"no-remat peak {model['no_remat_peak_mib']:.0f} MiB, "
            f"{model['no_remat_gflops']:.0f} GFLOP)",
            "",
            f"Measurement + DP: {model['measure_and_solve_s']:.0f} s; {model['candidates']} "
            f"candidate plans; {model['compilations']} programs compiled"
            + ("" if seconds is None else f"; {seconds / 60:.1f} min in all")
            + ". Baselines run through the same executor (stage backward sequenced); "
            "*plain* ones are bare `jax.checkpoint`."
            + (
                ""
                if model.get("delta_accounting") == "freed"
                else " **Stale**: rotor's candidates, choices and the model-peak column come "
                "from the solver before it freed δ_t after its backward (see *Memory "
                "accounting* below); compiled figures of the baselines do not depend on it. "
                f"Refresh with `--models {model['model']} --update`."
            ),
            "",
            "| schedule | peak MiB | FLOPs overhead | model peak MiB | plan |",
            "|---|---:|---:|---:|---|",
        ]
        shown = [p for p in model["points"] if p["kind"] != "rotor-choice"]
        for p in sorted(shown, key=lambda p: -p["peak_bytes"]):
            model_peak = "" if p["model_peak_mib"] is None else f"{p['model_peak_mib']:.0f}"
            lines.append(
                f"| {p['label']} | {p['peak_mib']:.0f} | {100 * p['overhead']:+.1f}% "
                f"| {model_peak} | `{short(p['plan'])}` |"
            )
        lines += [
            "",
            f"Rotor's choice with each baseline's peak as the budget — {goal_summary(model)}:",
            "",
            "| baseline | its peak MiB | its overhead | rotor plan chosen | rotor peak MiB "
            "| rotor overhead | goal met |",
            "|---|---:|---:|---|---:|---:|---|",
        ]
        for c in model["comparisons"]:
            head = (
                f"| {c['baseline']} | {c['budget_mib']:.1f} | {100 * c['baseline_overhead']:+.1f}%"
            )
            if c["rotor_peak_mib"] is None:
                lines.append(head + " | below rotor's leanest plan | | | no |")
                continue
            lines.append(
                head + f" | `{c['rotor_plan']}` | {c['rotor_peak_mib']:.1f} "
                f"| {100 * c['rotor_overhead']:+.1f}% | {'yes' if c['goal_met'] else '**no**'} |"
            )
        for c in model["comparisons"]:
            if not c.get("probe") or not c["rotor_equal"]:
                continue
            above = all(p["peak_bytes"] > c["budget_bytes"] for p in c["probe"])
            probes = ", ".join(
                f"`{p['plan']}` {p['peak_mib']:.1f} MiB ({100 * p['overhead']:+.2f}%)"
                for p in c["probe"]
            )
            lines += [
                "",
                f"Missed at *{c['baseline']}*: rotor's choice has the same FLOPs overhead "
                f"({100 * c['rotor_overhead']:+.3f}% vs {100 * c['baseline_overhead']:+.3f}%) at "
                f"{c['rotor_peak_mib']:.1f} ≤ {c['budget_mib']:.1f} MiB, not a lower one. Fewer "
                "FLOPs than this baseline means some stage's forward is not recomputed, so that "
                "stage keeps its whole history; doing so for one stage of the baseline compiles "
                f"to {probes}"
                + (
                    ": above the budget (making room by nesting costs one more "
                    "recomputation per stage input freed). Rotor matches the baseline here; "
                    "it does not beat it."
                    if above
                    else ": one of them fits the budget, so a faster plan exists that "
                    "rotor's candidates miss."
                ),
            ]
    if results.get("accounting"):
        lines += accounting_markdown(results["accounting"])
    return "\n".join(lines) + "\n"


def short(plan: str, width: int = 60) -> str:
    return plan if len(plan) <= width else plan[: width - 3] + "..."


def pareto(points: list[dict]) -> list[dict]:
    """Points no other point beats in both peak and overhead, by increasing peak."""
    front, best = [], math.inf
    for p in sorted(points, key=lambda p: (p["peak_bytes"], p["overhead"])):
        if p["overhead"] < best:
            front.append(p)
            best = p["overhead"]
    return front


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rotor = [p for p in model["points"] if p["kind"] in ("rotor", "rotor-choice")]
        front = pareto(rotor)
        ax.step(
            [p["peak_mib"] for p in front],
            [100 * p["overhead"] for p in front],
            where="post",
            color="C0",
            alpha=0.6,
            label="rotor frontier (compiled)",
        )
        for kind, style in (
            ("rotor", dict(marker="o", color="C0", s=18, label="rotor candidates")),
            (
                "rotor-choice",
                dict(marker="*", color="C3", s=110, label="rotor at a baseline's peak"),
            ),
        ):
            pts = [p for p in rotor if p["kind"] == kind]
            ax.scatter([p["peak_mib"] for p in pts], [100 * p["overhead"] for p in pts], **style)
        for p in model["points"]:
            if p["kind"] not in ("baseline", "plain") or p["label"].startswith("no remat"):
                continue
            plain = p["kind"] == "plain"
            if p["label"].startswith("every stage"):
                color, marker = "C1", "s"
            elif "√n" in p["label"]:
                color, marker = "C2", "D"
            else:
                color, marker = "0.55", "^"
            ax.scatter(
                p["peak_mib"],
                100 * p["overhead"],
                marker=marker,
                s=60 if color != "0.55" else 30,
                facecolors="none" if plain else color,
                edgecolors=color,
                label=p["label"] if color != "0.55" else None,
            )
        ax.scatter([], [], marker="^", color="0.55", s=30, label="other segmentings / halving")
        ax.axvline(model["no_remat_peak_mib"], color="0.3", ls=":", lw=1, label="no remat peak")
        ax.set_title(f"{model['model']} (batch {model['batch']})")
        ax.set_xlabel("compiled peak (MiB)")
        ax.set_ylabel("FLOPs overhead (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper right")
    fig.suptitle(
        "Compiled gradient peak vs FLOPs overhead (hollow: plain jax.checkpoint)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--rotor-plans", type=int, default=12, help="DP candidates to compile")
    parser.add_argument("--slots", type=int, default=500)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument(
        "--update",
        action="store_true",
        help="replace only the models given in an existing remat.json, keep the others "
        "and the accounting check",
    )
    parser.add_argument(
        "--accounting",
        action="store_true",
        help="run only the memory accounting check (about 2 min); keep the models of an "
        "existing remat.json",
    )
    parser.add_argument(
        "--from-json",
        action="store_true",
        help="only re-render remat.md and remat.png from an existing remat.json",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "remat.json"
    if args.from_json:
        results = json.loads(path.read_text())
    else:
        existing = json.loads(path.read_text()) if path.exists() else {}
        results = {"solver": solver_speed(), "models": [], "accounting": None}
        if args.update or args.accounting:
            results["models"] = existing.get("models", [])
            results["accounting"] = existing.get("accounting")
        if args.accounting:
            results["accounting"] = accounting_check()
            path.write_text(json.dumps(results, indent=1))
        else:
            for name in args.models:
                entry = run_model(name, args.rotor_plans, args.slots)
                names = [m["model"] for m in results["models"]]
                if name in names:
                    results["models"][names.index(name)] = entry
                else:
                    results["models"].append(entry)
                path.write_text(json.dumps(results, indent=1))
            if not args.update:
                results["accounting"] = accounting_check()
                path.write_text(json.dumps(results, indent=1))
    text = fill_prose(markdown(results), "remat")
    (args.out / "remat.md").write_text(text)
    if results["models"]:
        plot(results, args.out / "remat.png")
    print(text)


if __name__ == "__main__":
    main()
