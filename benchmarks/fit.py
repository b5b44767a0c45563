"""Fit a model into a memory budget: the largest batch per worker, technique by technique.

For each model (the paper configs at full size: ResNet-50 on CIFAR images, GPT-2 medium
on 1024 tokens, BERT-base on 384 tokens) and per-worker budget, the largest batch per
worker whose compiled train step fits (:func:`resireduce_jax.planner.largest_batch` over
the training program's step, ``train/memory_plan.py``; abstract shapes, nothing
allocated, 8 workers) for plain error feedback, each single technique (ResiReduce w+2d,
the memory-reduced optimizer, rotor checkpointing) and all of them together; the
planner's choice is the one with the largest batch. Also: the time of one planner call
(:func:`resireduce_jax.planner.fit` over every candidate at the paper's batch), the time
of every compilation, and the price of the planner's choice measured on a reduced-size
model (compiled FLOPs overhead; step time at equal batch and time per sample, 8 CPU
workers). What the figures mean: ``results/fit.md``.

    python benchmarks/fit.py                        # full size: 3 models x 4 budgets (long)
    python benchmarks/fit.py --models gpt2_medium --budgets 16 24
    python benchmarks/fit.py --quick                # reduced sizes, budgets in MiB (smoke)
    python benchmarks/fit.py --from-json            # re-render fit.md / fit.png

Each invocation keeps the other models' results in ``fit.json`` (run models separately).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `common`, also when imported

from common import NUM_WORKERS, RESULTS, Case, environment, write_results
from step_time import Runner

__all__ = [
    "CASES",
    "QUICK",
    "TECHNIQUES",
    "FitCase",
    "main",
    "markdown",
    "measure_price",
    "merge_runs",
    "plan_model",
]

GiB, MiB = 2**30, 2**20
QUICK_OUT = "/tmp/rr_fit_quick"  # --quick is a smoke run: its figures are not the results


@dataclasses.dataclass(frozen=True)
class FitCase:
    """A model, the batches searched, the budgets, and its reduced size for the price."""

    case: Case
    max_batch: int
    budgets: tuple[float, ...]  # per-worker budgets, in units of `unit` bytes
    unit: int = GiB
    fit_budget: float = 16  # the planner call that is timed, at the case's batch
    price: Case | None = None  # reduced size whose steps are timed


CASES: dict[str, FitCase] = {
    "resnet50": FitCase(
        Case(
            "resnet50_cifar100",
            {},
            batch_per_worker=32,
            description="ResNet-50 (CIFAR-100 config, 32x32 images), full size",
        ),
        max_batch=16384,
        budgets=(8, 16, 24, 40),
        fit_budget=1,
        price=Case(
            "resnet50_cifar100",
            {"width": 16},
            batch_per_worker=8,
            description="ResNet-50 width 16",
        ),
    ),
    "gpt2_medium": FitCase(
        Case(
            "gpt2_medium_wikitext",
            {},
            batch_per_worker=2,
            seq_len=1024,
            description="GPT-2 medium (24 blocks, width 1024, vocab 50257), 1024 tokens",
        ),
        max_batch=512,
        budgets=(8, 16, 24, 40),
        fit_budget=16,
        price=Case(
            "gpt2_medium_wikitext",
            {"num_layers": 6, "width": 256, "num_heads": 4, "vocab_size": 8192, "max_len": 128},
            batch_per_worker=2,
            seq_len=128,
            description="GPT-2 6 blocks of width 256, vocab 8192, 128 tokens",
        ),
    ),
    "bert_base": FitCase(
        Case(
            "bert_base_squad",
            {"seq_len": 384},
            batch_per_worker=4,
            seq_len=384,
            description="BERT-base (12 layers, width 768), 384 tokens",
        ),
        max_batch=2048,
        budgets=(8, 16, 24, 40),
        fit_budget=4,
        price=Case(
            "bert_base_squad",
            {"num_layers": 4, "width": 256, "num_heads": 4, "seq_len": 128, "vocab_size": 8192},
            batch_per_worker=4,
            seq_len=128,
            description="BERT 4 layers of width 256, vocab 8192, 128 tokens",
        ),
    ),
}


def _quick(case: Case, *, priced: bool = True) -> FitCase:
    """A ``--quick`` case: batches up to 256, budgets of 24 and 48 MiB (the planner call
    timed at 24), and where ``priced`` the price timed on the same reduced model."""
    return FitCase(
        case,
        max_batch=256,
        budgets=(24, 48),
        unit=MiB,
        fit_budget=24,
        price=case if priced else None,
    )


# --quick: reduced sizes and MiB budgets, minutes on 2 cores (CI smoke).
QUICK: dict[str, FitCase] = {
    "resnet50": _quick(Case("resnet50_cifar100", {"width": 8}, 4, description="ResNet-50 width 8")),
    "gpt2_medium": _quick(
        Case(
            "gpt2_medium_wikitext",
            {"num_layers": 3, "width": 128, "num_heads": 4, "vocab_size": 4096, "max_len": 64},
            2,
            seq_len=64,
            description="GPT-2 3 blocks of width 128, vocab 4096, 64 tokens",
        )
    ),
    "bert_base": _quick(
        Case(
            "bert_base_squad",
            {"num_layers": 3, "width": 128, "num_heads": 4, "seq_len": 64, "vocab_size": 4096},
            2,
            seq_len=64,
            description="BERT 3 layers of width 128, vocab 4096, 64 tokens",
        ),
        priced=False,
    ),
}


def techniques(chain_model: bool):
    """Plain EF, each technique alone, and all together (the planner's choice is the best)."""
    from resireduce_jax.planner import Candidate

    out = {
        "plain EF": Candidate("ef", "original", "none"),
        "w+2d": Candidate("w+2d", "original", "none"),
        "optimizer R": Candidate("ef", "r", "none"),
    }
    if chain_model:
        out["rotor"] = Candidate("ef", "original", "rotor")
    out["all"] = Candidate("w+2d+bf16", "r", "rotor" if chain_model else "none")
    return out


TECHNIQUES = ("plain EF", "w+2d", "optimizer R", "rotor", "all")


def _progress():
    import functools

    import tqdm

    return functools.partial(tqdm.tqdm, leave=False), tqdm.tqdm.write


def plan_model(
    name: str,
    fc: FitCase,
    budgets: list[float],
    *,
    timed_fit: bool,
    save=None,
    prune: bool = True,
    threads: int = 0,
) -> dict[str, Any]:
    """The timed planner call, then the largest batch per technique and budget.

    ``save(result)`` is called with the partial result after each step (long runs).
    ``prune=False``: the exhaustive search (no bounds, no predictions); ``threads``:
    candidates compiled at once (0: the idle cores).
    """
    from resireduce_jax import planner
    from train import memory_plan

    progress, log = _progress()
    config = fc.case.load()
    compiler = memory_plan.StepCompiler(config, seq_len=fc.case.seq_len, log=log, prune=prune)
    threads = planner.compile_threads(threads)
    out: dict[str, Any] = {
        "model": name,
        "description": fc.case.description,
        "search": "pruned" if prune else "exhaustive",
        "threads": threads,
    }

    out["fit"] = None
    if timed_fit:  # one planner call at the paper's batch: every candidate, cold cache
        fit_budget = int(fc.fit_budget * fc.unit)
        start = time.perf_counter()
        try:
            result = planner.fit(
                compiler.candidates(),
                compiler,
                fit_budget,
                batch_per_worker=fc.case.batch_per_worker,
                progress=progress,
                threads=threads,
            )
            out["fit"] = result.as_dict()
            log(result.table())
        except planner.BudgetError as error:
            out["fit"] = {"budget_bytes": fit_budget, "error": str(error)}
        out["fit"]["seconds"] = time.perf_counter() - start
        out["fit"]["compilations"] = compiler.compilations

    named = techniques(compiler.chain_model)
    cached = planner.CachedCompiler(compiler)
    out["budgets"] = []
    for value in budgets:
        budget = int(value * fc.unit)
        start = time.perf_counter()
        compiled_before = compiler.compilations
        found = planner.largest_batch(
            list(named.values()),
            cached,
            budget,
            max_batch=fc.max_batch,
            start=fc.case.batch_per_worker,
            progress=progress,
            threads=threads,
        )
        best = found.best
        row = {
            "budget": value,
            "budget_bytes": budget,
            "seconds": time.perf_counter() - start,
            "compilations": compiler.compilations - compiled_before,
            "searches": {label: found.search(c).as_dict() for label, c in named.items()},
            "planner_choice": None if best is None else best.as_dict(),
        }
        out["budgets"].append(row)
        ef = row["searches"]["plain EF"]["largest_batch"]
        log(
            f"{name} {value:g}: EF {ef}, "
            + ", ".join(f"{k} {v['largest_batch']}" for k, v in row["searches"].items())
            + f" ({row['seconds']:.0f} s)"
        )
        out["compiles"] = compiler.records()
        out["compile_seconds"] = compiler.compile_seconds
        if save is not None:
            save(out)
    out["compiles"] = compiler.records()
    out["compile_seconds"] = compiler.compile_seconds
    return out


# ------------------------------------------------------------------ the price, measured


def _runner(compiler, candidate, batch: int, task, seq_len: int) -> Runner:
    """A candidate's initialized state and jitted step on 8 CPU workers; times steps."""
    config = compiler.config_for(candidate)
    options = {"weight_update_order": config.weight_update_order}
    return Runner(task, config, batch, seq_len, options=options)


def measure_price(name: str, case: Case, *, repeats: int, steps: int) -> dict[str, Any]:
    """All techniques against plain EF on a reduced model, in plain EF's memory.

    The budget is plain EF's compiled peak at the case's batch; all techniques together
    (the planner's choice in every full-size row) run a larger batch in it. Timed, interleaved:
    EF and the choice at the choice's batch (step-time ratio at equal batch), and EF at
    its own batch (time per sample).
    """
    from resireduce_jax import planner
    from train import memory_plan

    progress, log = _progress()
    compiler = memory_plan.StepCompiler(case.load(), seq_len=case.seq_len, log=log)
    named = techniques(compiler.chain_model)
    ef = named["plain EF"]
    budget = compiler.leanest(ef, case.batch_per_worker).peak_bytes
    found = planner.largest_batch(
        [ef, named["all"]],  # every technique: the largest batch in every full-size row
        compiler,
        budget,
        max_batch=64 * case.batch_per_worker,
        progress=progress,
    )
    best = found.best
    ef_batch = found.search(ef).batch
    task = compiler.task_for(best.row)
    runners = {
        "ef_at_choice_batch": _runner(compiler, ef, best.batch, compiler.task, case.seq_len),
        "choice": _runner(compiler, best.candidate, best.batch, task, case.seq_len),
        "ef_at_ef_batch": _runner(compiler, ef, ef_batch, compiler.task, case.seq_len),
    }
    for runner in runners.values():  # compile, warm up
        runner.run(1)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for rep in range(repeats):
        order = list(runners) if rep % 2 == 0 else list(runners)[::-1]
        for key in order:
            times[key].append(runners[key].run(steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": name,
        "description": case.description,
        "budget_bytes": budget,
        "ef_batch": ef_batch,
        "choice": best.as_dict(),
        "choice_batch": best.batch,
        "flops_overhead": best.row.compiled.flops_overhead,
        "seconds_per_step": times,
        "median_seconds": med,
        "step_ratio_equal_batch": med["choice"] / med["ef_at_choice_batch"],
        "time_per_sample_ratio": (med["choice"] / best.batch) / (med["ef_at_ef_batch"] / ef_batch),
        "repeats": repeats,
        "steps_per_repeat": steps,
    }


# ------------------------------------------------------------------ output


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def markdown(
    results: list[dict[str, Any]], prices: list[dict[str, Any]], quick: bool, name: str
) -> str:
    unit = "MiB" if quick else "GiB"
    scale = MiB if quick else GiB
    lines = [
        "# Fit a model into a memory budget: largest batch per worker",
        "",
        "Compiled per-worker peaks of the training program's guarded train step (8 workers, "
        "XLA:CPU, abstract shapes: nothing allocated), searched by "
        "`resireduce_jax.planner.largest_batch`. A batch counts when the technique's leanest "
        "form fits (rotor: its leanest plan); the figures at the largest batch are the "
        "fastest form that fits (rotor: the fastest plan found). "
        + ("**Quick run: reduced sizes, MiB budgets.**" if quick else ""),
        "",
    ]
    chosen = within = 0
    for r in results:
        labels = list(r["budgets"][0]["searches"]) if r["budgets"] else []
        lines += [f"## {r['model']}: {r['description']}", ""]
        header = (
            "| budget | "
            + " | ".join(labels)
            + " | planner's choice | × EF | peak | ≤ budget | FLOPs + | search |"
        )
        lines += [header, "|" + "---:|" * (len(labels) + 7)]
        for b in r["budgets"]:
            cells = [str(b["searches"][k]["largest_batch"]) for k in labels]
            choice = b["planner_choice"]
            ef = b["searches"]["plain EF"]["largest_batch"]
            if choice is None:
                tail = "— | — | — | — | —"
            else:
                at = choice["at_largest"]
                ratio = f"{choice['largest_batch'] / ef:.2f}" if ef else "∞ (EF: none)"
                overhead = at["flops_overhead"]
                chosen += 1
                within += at["peak_bytes"] <= b["budget_bytes"]
                tail = (
                    f"{choice['largest_batch']} ({choice['label']}) | {ratio} | "
                    f"{at['peak_bytes'] / scale:.2f} | "
                    + ("yes" if at["peak_bytes"] <= b["budget_bytes"] else "**no**")
                    + " | "
                    + ("?" if overhead is None else f"{100 * overhead:.1f}%")
                )
            tail += f" | {b['seconds']:.0f} s"
            if "compilations" in b:
                tail += f", {b['compilations']} compiles"
            lines.append(f"| {b['budget']:g} {unit} | " + " | ".join(cells) + f" | {tail} |")
        fit = r["fit"]
        lines += [""]
        if fit is None:
            pass
        elif "chosen" in fit:
            c = fit["chosen"]
            lines.append(
                f"Planner call (`fit`, all {len(fit['candidates'])} candidates at batch "
                f"{fit['batch_per_worker']}, budget {fit['budget_bytes'] / scale:g} "
                f"{unit}): {fit['seconds']:.0f} s, {fit['compilations']} compilations; chose "
                f"{c['label']}, peak {c['peak_bytes'] / scale:.2f} {unit}."
            )
        else:
            lines.append(f"Planner call: {fit.get('error')} ({fit['seconds']:.0f} s).")
        secs = [c["compile_seconds"] for c in r["compiles"]]
        if secs:
            runs = r.get("invocations", 1)
            lines.append(
                f"Compilations: {len(secs)} train steps, median {statistics.median(secs):.1f} s, "
                f"max {max(secs):.1f} s; {r['compile_seconds'] / 60:.1f} min in all (with "
                "the rotor chain measurements"
                + (f"; {runs} invocations, each from a cold cache" if runs > 1 else "")
                + ")."
            )
        lines.append("")
    if chosen:
        lines += [
            f"Every planner's choice within its budget: {within} of {chosen} compiled peaks "
            "≤ budget.",
            "",
        ]
    if prices:
        lines += [
            "## The price, measured on reduced models",
            "",
            "Budget = plain EF's compiled peak at the case's batch; all techniques together "
            "(w+2d+bf16, the reduced optimizer, the fastest rotor plan that fits) run their "
            "largest batch in it. Step times are medians of interleaved repetitions; 8 "
            "simulated CPU workers share 2 cores: computation, not communication.",
            "",
            "| model | EF batch | choice | choice batch | FLOPs + | step ratio (equal batch) | "
            "time/sample ratio |",
            "|---|---:|---|---:|---:|---:|---:|",
        ]
        for p in prices:
            overhead = p["flops_overhead"]
            lines.append(
                f"| {p['model']} ({p['description']}) | {p['ef_batch']} | {p['choice']['label']} "
                f"| {p['choice_batch']} | "
                + ("?" if overhead is None else f"{100 * overhead:.1f}%")
                + f" | {p['step_ratio_equal_batch']:.3f} | {p['time_per_sample_ratio']:.3f} |"
            )
        lines.append("")
    lines += [f"![largest batch per worker vs budget]({name}.png)", ""]
    lines += ["<!-- prose: about -->", ""]
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str, quick: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        budgets = [b["budget"] for b in r["budgets"]]
        labels = list(r["budgets"][0]["searches"]) if r["budgets"] else []
        markers = "osD^v"
        for i, label in enumerate(labels):
            ax.plot(
                budgets,
                [b["searches"][label]["largest_batch"] for b in r["budgets"]],
                marker=markers[i % len(markers)],
                markersize=9 - 1.2 * i,  # equal batches stay visible
                alpha=0.85,
                label=label,
            )
        ax.plot(
            budgets,
            [(b["planner_choice"] or {}).get("largest_batch", 0) for b in r["budgets"]],
            "k--",
            label="planner's choice",
        )
        ax.set_title(r["model"])
        ax.set_xlabel(f"budget per worker ({'MiB' if quick else 'GiB'})")
        ax.set_ylabel("largest batch per worker")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge_runs(before: dict[str, Any] | None, now: dict[str, Any]) -> dict[str, Any]:
    """A model's result of this invocation, with what an earlier one found and this did not.

    Budget rows not searched now, and the timed planner call when it was skipped now
    (``--no-fit``), are kept; the compilations of both invocations are listed (each
    invocation compiles from a cold cache).
    """
    if before is None:
        return now
    merged = dict(now)
    searched = {b["budget"] for b in now["budgets"]}
    kept = [b for b in before.get("budgets", []) if b["budget"] not in searched]
    merged["budgets"] = sorted(kept + now["budgets"], key=lambda b: b["budget"])
    if now.get("fit") is None:
        merged["fit"] = before.get("fit")
    merged["compiles"] = before.get("compiles", []) + now.get("compiles", [])
    merged["compile_seconds"] = before.get("compile_seconds", 0.0) + now.get("compile_seconds", 0.0)
    merged["invocations"] = before.get("invocations", 1) + 1
    return merged


def _load(path: str, quick: bool) -> dict[str, Any]:
    """The results of an earlier run (same size), to keep the models not run now."""
    try:
        with open(path) as f:
            payload = json.load(f)
    except (OSError, ValueError):
        return {}
    return payload if payload.get("quick") == quick else {}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--budgets", nargs="+", type=float, help="override the budgets")
    parser.add_argument("--quick", action="store_true", help="reduced sizes, MiB budgets")
    parser.add_argument("--no-fit", action="store_true", help="skip the timed planner call")
    parser.add_argument("--no-price", action="store_true", help="skip the timed price runs")
    parser.add_argument("--price-only", action="store_true", help="only the timed price runs")
    parser.add_argument(
        "--from-json", action="store_true", help="re-render fit.md and fit.png from fit.json"
    )
    parser.add_argument(
        "--exhaustive", action="store_true", help="no bounds or predictions: compile every probe"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="candidates compiled at once (0: the idle cores)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--out", default=None, help=f"results folder (default {RESULTS}; --quick: {QUICK_OUT})"
    )
    args = parser.parse_args(argv)

    if not args.from_json:
        from resireduce_jax import runtime

        # Without the timed price runs nothing is run: compile for analysis only (the same
        # memory and cost analyses, sooner; docs/design.md, "Compiling for analysis").
        runtime.configure_cpu(NUM_WORKERS, analysis_only=args.no_price)
    cases = QUICK if args.quick else CASES
    out = args.out or (QUICK_OUT if args.quick else str(RESULTS))
    path = os.path.join(out, "fit.json")
    # Models run before (e.g. in another invocation) are kept; the ones run now replace theirs.
    previous = _load(path, args.quick)
    earlier = {r["model"]: r for r in previous.get("results", [])}
    results: dict[str, Any] = {}
    prices: dict[str, Any] = {}
    start = time.perf_counter()

    def write(final: bool = False) -> None:
        # Re-read: another invocation (another model) may have written since this one began.
        current = previous if args.from_json else _load(path, args.quick)
        merged = {r["model"]: r for r in current.get("results", [])} | results
        priced_now = {p["model"]: p for p in current.get("prices", [])} | prices
        ordered = [merged[m] for m in CASES if m in merged]
        priced = [priced_now[m] for m in CASES if m in priced_now]
        payload = (
            previous
            if args.from_json
            else environment(
                num_workers=NUM_WORKERS,
                quick=args.quick,
                seconds_this_run=time.perf_counter() - start,
                results=ordered,
                prices=priced,
            )
        )
        text = markdown(ordered, priced, args.quick, "fit")
        folder = write_results("fit", payload, text, out, echo=final)
        if final:
            plot(ordered, os.path.join(folder, "fit.png"), args.quick)

    def save(result: dict[str, Any]) -> None:
        results[result["model"]] = merge_runs(earlier.get(result["model"]), result)
        write()

    if args.from_json:
        write(final=True)
        return
    for name in [] if args.price_only else args.models:
        fc = cases[name]
        budgets = list(args.budgets or fc.budgets)
        save(
            plan_model(
                name,
                fc,
                budgets,
                timed_fit=not args.no_fit,
                save=save,
                prune=not args.exhaustive,
                threads=args.threads,
            )
        )
    if not args.no_price:
        for name in args.models:
            if cases[name].price is not None:
                prices[name] = measure_price(
                    name, cases[name].price, repeats=args.repeats, steps=args.steps
                )
                write()
    write(final=True)


if __name__ == "__main__":
    main()
