"""Gradient-space reutilization: compiled peak memory of optax's AdamW / Lion / Adan vs ours.

For ViT-S/16, ViT-B/16, ViT-L/16 and GPT-2 small / medium this compiles (from
``jax.eval_shape``; nothing runs) the donated train step and the optimizer-only step of each
optimizer pair (``PAIRS``, optionally with clipping) and reports the peaks
(:func:`resireduce_jax.hlo.peak_memory`) with diagnostics: live peak, ``while`` loops,
parameter-sized copies. Definitions and the explanation of the figures:
``benchmarks/results/gsr_memory.md``.

Writes ``benchmarks/results/gsr_memory.{json,md}``. Usage::

    python benchmarks/gsr_memory.py                  # all five models (about 30 min on 2 cores)
    python benchmarks/gsr_memory.py --models vit_s16 --out /tmp/gsr   # one model
"""

from __future__ import annotations

import sys

from resireduce_jax import runtime

# The scheduler is an XLA flag, fixed when JAX starts: a second process measures the
# optimizer-only step with XLA:CPU's default scheduler (see main()).
CONCURRENCY_FLAG = "--concurrency-scheduler"
SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
runtime.configure_cpu(num_devices=1, memory_scheduler=CONCURRENCY_FLAG not in sys.argv)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from common import RESULTS, write_markdown, write_results  # noqa: E402

from resireduce_jax import hlo, models  # noqa: E402
from resireduce_jax import optimizers as gsr  # noqa: E402

MODELS = ("vit_s16", "vit_b16", "vit_l16", "gpt2_small", "gpt2_medium")
MODEL_TITLES = {
    "vit_s16": "ViT-S/16",
    "vit_b16": "ViT-B/16",
    "vit_l16": "ViT-L/16",
    "gpt2_small": "GPT-2 small",
    "gpt2_medium": "GPT-2 medium",
}

# (title of the original, title of ours, original factory, our factory); factories take
# max_grad_norm (None: no clipping). Hyper-parameters are the usual ones for the models.
PAIRS: dict[str, tuple[str, str, Callable[..., Any], Callable[..., Any]]] = {
    "adamw": (
        "AdamW",
        "AdamW-R",
        lambda clip: _clipped(optax.adamw(1e-3, weight_decay=0.05), clip),
        lambda clip: gsr.adamw_r(1e-3, weight_decay=0.05, max_grad_norm=clip),
    ),
    "lion": (
        "Lion",
        "Lion-R",
        lambda clip: _clipped(optax.lion(1e-4, weight_decay=0.5), clip),
        lambda clip: gsr.lion_r(1e-4, weight_decay=0.5, max_grad_norm=clip),
    ),
    "adan": (
        "Adan",
        "Adan-R",
        lambda clip: _clipped(optax.adan(1e-3, weight_decay=0.02), clip),
        lambda clip: gsr.adan_r(1e-3, weight_decay=0.02, max_grad_norm=clip),
    ),
}
CLIP_NORM = 1.0
MB = 2**20
# XLA:CPU's temp allocation gives the tuple of every while loop (its loop state's index
# table) a slot of its own, 64-byte aligned, that no other buffer shares (measured).
WHILE_SLOT_BYTES = 64
_WHILE = re.compile(r"\swhile\(")
_LIVE_PEAK = re.compile(r"peak usage: ([\d ]+) bytes")


def _clipped(tx: optax.GradientTransformation, clip: float | None):
    return tx if clip is None else optax.chain(optax.clip_by_global_norm(clip), tx)


def _loss_fn(model, config) -> Callable[..., jax.Array]:
    """Mean cross-entropy of the model's predictions, with dropout on (a training step)."""

    def loss(params, batch, key):
        inputs = {name: batch[name] for name in config.input_names}
        logits = model.apply({"params": params}, **inputs, train=True, rngs={"dropout": key})
        (target_name,) = config.target_names
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[target_name]).mean()

    return loss


def _compile_train_step(model, config, tx, params, batch) -> tuple[Any, int | None]:
    """The compiled donated train step and its live peak in bytes (``None`` if XLA wrote
    no live-range report)."""
    loss = _loss_fn(model, config)

    def train_step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch, jax.random.key(0))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = jax.eval_shape(tx.init, params)
    jitted = jax.jit(train_step, donate_argnums=(0, 1))
    return _compile_with_live_peak(jitted.lower(params, opt_state, batch))


def _compile_with_live_peak(lowered: jax.stages.Lowered) -> tuple[Any, int | None]:
    """Compiles with an XLA dump into a temporary directory and reads the live peak from
    its ``HloLiveRange`` report ("Stack trace breakdown for peak usage: N bytes"): all
    buffers live at the worst point of the schedule (arguments, outputs, temporaries and
    constants), before they are packed into allocations."""
    with tempfile.TemporaryDirectory() as tmp:
        compiled = lowered.compile(
            compiler_options={"xla_dump_to": tmp, "xla_dump_hlo_as_text": True}
        )
        reports = sorted(Path(tmp).glob("*after_optimizations-live-range.txt"))
        found = _LIVE_PEAK.search(reports[-1].read_text()) if reports else None
    return compiled, (int(found.group(1).replace(" ", "")) if found else None)


def _while_loops(compiled) -> int:
    return len(_WHILE.findall(compiled.as_text()))


def _compile_optimizer_step(tx, params, grads_first: bool | None) -> Any:
    opt_state = jax.eval_shape(tx.init, params)
    step = gsr.optimizer_step(tx, grads_first=grads_first)
    return step.lower(params, opt_state, params).compile()


def _figures(compiled, param_leaf_bytes: int) -> dict[str, Any]:
    memory = hlo.peak_memory(compiled)
    big_copies = hlo.copies(compiled, min_bytes=param_leaf_bytes)
    return {
        **memory.as_dict(),
        "param_sized_copies": len(big_copies),
        "param_sized_copy_bytes": sum(b for _, b in big_copies),
    }


def measure_model(
    name: str, batch_size: int, pairs: list[str], clips: list[float | None], train: bool = True
):
    """All figures of one model: ``results[pair or pair+clip][variant][step] = figures``."""
    config = models.get_config(name)
    model = config.build()
    params = models.abstract_variables(name)["params"]
    batch = config.example_batch(batch_size)
    leaves = jax.tree.leaves(params)
    param_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
    smallest_matrix = min(
        math.prod(x.shape) * x.dtype.itemsize for x in leaves if len(x.shape) >= 2
    )
    out: dict[str, Any] = {
        "model": name,
        "params": sum(math.prod(x.shape) for x in leaves),
        "param_bytes": param_bytes,
        "largest_leaf_bytes": max(math.prod(x.shape) * x.dtype.itemsize for x in leaves),
        "batch": {k: [list(v.shape), str(v.dtype)] for k, v in batch.items()},
        "results": {},
    }
    for pair in pairs:
        _, _, make_original, make_ours = PAIRS[pair]
        for clip in clips:
            key = f"{pair}" if clip is None else f"{pair}+clip"
            entry: dict[str, Any] = {}
            for variant, make in (("original", make_original), ("R", make_ours)):
                tx = make(clip)
                figures: dict[str, Any] = {}
                if train:
                    t0 = time.perf_counter()
                    compiled, live_peak = _compile_train_step(model, config, tx, params, batch)
                    figures["train_step"] = {
                        **_figures(compiled, smallest_matrix),
                        "live_peak": live_peak,
                        "while_loops": _while_loops(compiled),
                        "compile_s": round(time.perf_counter() - t0, 1),
                    }
                    del compiled
                if variant == "original":
                    orders = {
                        order: _figures(
                            _compile_optimizer_step(tx, params, order == "grads_first"),
                            smallest_matrix,
                        )
                        for order in ("state_first", "grads_first")
                    }
                    best = min(orders, key=lambda o: orders[o]["peak"])
                    opt_only = {**orders[best], "order": best, "other_order": orders}
                else:
                    opt_only = _figures(_compile_optimizer_step(tx, params, None), smallest_matrix)
                    order = (
                        "grads_first"
                        if gsr.grads_before_state(jax.eval_shape(tx.init, params))
                        else "state_first"
                    )
                    opt_only["order"] = order
                figures["optimizer_step"] = opt_only
                entry[variant] = figures
                train_text = (
                    f"train peak {figures['train_step']['peak'] / MB:9.1f} MB (temp "
                    f"{figures['train_step']['temp'] / MB:8.1f}, "
                    f"{figures['train_step']['compile_s']:5.1f} s) | "
                    if train
                    else ""
                )
                print(
                    f"  {name:12s} {key:11s} {variant:8s} {train_text}opt-only peak "
                    f"{opt_only['peak'] / MB:9.1f} MB (temp {opt_only['temp'] / MB:7.1f}, "
                    f"copies {opt_only['param_sized_copies']})",
                    flush=True,
                )
            out["results"][key] = entry
    return out


def _saving(original: int, ours: int) -> float:
    return 100.0 * (original - ours) / original


def _params_text(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _has_train(report_models: list[dict[str, Any]]) -> bool:
    return "train_step" in next(iter(report_models[0]["results"].values()))["original"]


def _pair_title(key: str) -> str:
    """``"lion+clip"`` -> ``"Lion-R + clipping"``."""
    clip = " + clipping" if key.endswith("+clip") else ""
    return f"{PAIRS[key.split('+')[0]][1]}{clip}"


def _rows(report_models: list[dict[str, Any]], key: str, step: str) -> list[dict[str, Any]]:
    """Per model: the two figure dicts and the saving in bytes, in P and in largest leaves."""
    rows = []
    for m in report_models:
        o, ours = m["results"][key]["original"][step], m["results"][key]["R"][step]
        saving = o["peak"] - ours["peak"]
        rows.append(
            {
                "name": MODEL_TITLES[m["model"]],
                "model": m,
                "o": o,
                "r": ours,
                "saving": saving,
                "per_p": saving / m["param_bytes"],
                "per_leaf": saving / m["largest_leaf_bytes"],
            }
        )
    return rows


def _table(
    report_models: list[dict[str, Any]], key: str, step: str, with_copies: bool
) -> list[str]:
    pair = key.split("+")[0]
    orig_title, r_title, _, _ = PAIRS[pair]
    header = (
        f"| Model | # Params | {orig_title} (MB) | {r_title} (MB) | Savings (%) | Savings (MB) |"
    )
    rule = "|---|---|---|---|---|---|"
    train_diagnostics = step == "train_step" and "while_loops" in report_models[0]["results"][key][
        "original"
    ].get(step, {})
    if with_copies:
        header += (
            " Savings / param bytes | Savings / largest leaf | Param-sized copies (orig / R) |"
        )
        rule += "---|---|---|"
    if train_diagnostics:
        header += (
            " Savings (B) | Live-peak saving (B) | while loops (orig / R) |"
            " Param-sized copies (orig / R) |"
        )
        rule += "---|---|---|---|"
    lines = [header, rule]
    for row in _rows(report_models, key, step):
        o, ours, m = row["o"], row["r"], row["model"]
        line = (
            f"| {row['name']} | {_params_text(m['params'])} | "
            f"{o['peak'] / MB:.0f} | {ours['peak'] / MB:.0f} | "
            f"{_saving(o['peak'], ours['peak']):.2f} | {row['saving'] / MB:.1f} |"
        )
        if with_copies:
            line += (
                f" {row['per_p']:.3f} | {row['per_leaf']:.2f} | "
                f"{o['param_sized_copies']} / {ours['param_sized_copies']} |"
            )
        if train_diagnostics:
            live = (
                "n/a"
                if o.get("live_peak") is None or ours.get("live_peak") is None
                else f"{o['live_peak'] - ours['live_peak']:+d}"
            )
            line += (
                f" {row['saving']:+d} | {live} | {o['while_loops']} / {ours['while_loops']} | "
                f"{o['param_sized_copies']} / {ours['param_sized_copies']} |"
            )
        lines.append(line)
    return lines


def markdown(report: dict[str, Any]) -> str:
    models_ = report["models"]
    batches = "; ".join(
        f"{MODEL_TITLES[m['model']]} "
        + ", ".join(
            f"{k} {'x'.join(map(str, shape))} {dt}" for k, (shape, dt) in m["batch"].items()
        )
        for m in models_
    )
    lines = [
        "# Gradient-space reutilization: compiled peak memory",
        "",
        "Generated by `python benchmarks/gsr_memory.py` (figures in `gsr_memory.json`). "
        f"Compile only, XLA:CPU, one device, jax {report['jax_version']}, optax "
        f"{report['optax_version']}; nothing is trained or allocated. Batches: {batches}.",
        "",
    ]
    lines += _goal(report)
    lines += _summary(report)
    lines += ["## How the figures are taken", "", "<!-- prose: about -->", ""]
    lines += _why(report)
    lines += _section(
        "Optimizer-only step (gradients passed in; memory-optimizing scheduler)",
        models_,
        "optimizer_step",
    )
    if _has_train(models_):
        lines += _section(
            "Train step (forward + backward + update; memory-optimizing scheduler)",
            models_,
            "train_step",
        )
    if report.get("concurrency_scheduler"):
        lines += _section(
            "Optimizer-only step with XLA:CPU's default (concurrency-optimized) scheduler",
            report["concurrency_scheduler"],
            "optimizer_step",
            intro="What a program compiled without "
            "`--xla_cpu_enable_concurrency_optimized_scheduler=false` gets: the default "
            "scheduler runs independent fusions, and the copies they need, side by side.",
        )
    return "\n".join(lines)


def _range(values: list[float], digits: int) -> str:
    low, high = min(values), max(values)
    return (
        f"{low:.{digits}f}"
        if f"{low:.{digits}f}" == f"{high:.{digits}f}"
        else (f"{low:.{digits}f}-{high:.{digits}f}")
    )


def _goal(report: dict[str, Any]) -> list[str]:
    """Which configuration saves >= one parameter-sized buffer, from the figures (the goal)."""
    configs = [("memory-optimizing scheduler", report["models"])]
    if report.get("concurrency_scheduler"):
        configs.insert(0, ("XLA:CPU's default scheduler", report["concurrency_scheduler"]))
    keys = [k for k in report["models"][0]["results"] if k.split("+")[0] in ("lion", "adan")]

    def one_p(report_models: list[dict[str, Any]]) -> str:
        parts, verdict = [], "met"
        for key in keys:
            rows = _rows(report_models, key, "optimizer_step")
            part = f"{_pair_title(key)} {_range([r['per_p'] for r in rows], 3)} P"
            shortfalls = [r["model"]["param_bytes"] - r["saving"] for r in rows]
            if max(shortfalls) > 0:
                part += f" (P - {max(shortfalls):,} B at worst)"
            parts.append(part)
            for r, shortfall in zip(rows, shortfalls, strict=True):
                if shortfall > r["r"]["temp"]:
                    verdict = "not met"
                elif shortfall > 0 and verdict == "met":
                    verdict = "met up to our own scratch"
        return f"**{verdict}**: " + ", ".join(parts)

    def one_leaf(report_models: list[dict[str, Any]]) -> str:
        parts, verdict = [], "met"
        for key in keys:
            rows = _rows(report_models, key, "optimizer_step")
            parts.append(f"{_pair_title(key)} {_range([r['per_leaf'] for r in rows], 2)}")
            for r in rows:
                shortfall = r["model"]["largest_leaf_bytes"] - r["saving"]
                if shortfall > r["r"]["temp"]:
                    verdict = "not met"
                elif shortfall > 0 and verdict == "met":
                    verdict = "met up to our own scratch"
        return f"**{verdict}**: " + ", ".join(parts) + " x the largest leaf"

    def non_negative(report_models: list[dict[str, Any]], step: str) -> str:
        negative = [
            r
            for key in report_models[0]["results"]
            for r in _rows(report_models, key, step)
            if r["saving"] < 0
        ]
        if not negative:
            return "**met**"
        worst = min(r["saving"] for r in negative)
        entries = len(report_models) * len(report_models[0]["results"])
        return (
            f"**missed** by {len(negative)} of {entries} entries, by {-worst:,} B at most "
            "(see Summary and Why)"
        )

    header = "| Goal | " + " | ".join(c for c, _ in configs) + " |"
    lines = [
        "## Goal",
        "",
        header,
        "|---|" + "---|" * len(configs),
        "| Optimizer-only step, Lion-R / Adan-R save >= 1 P | "
        + " | ".join(one_p(m) for _, m in configs)
        + " |",
        "| Optimizer-only step, Lion-R / Adan-R save >= the largest leaf | "
        + " | ".join(one_leaf(m) for _, m in configs)
        + " |",
        "| Every saving >= 0, optimizer-only step | "
        + " | ".join(non_negative(m, "optimizer_step") for _, m in configs)
        + " |",
    ]
    if _has_train(report["models"]):
        cells = [
            non_negative(m, "train_step") if c.startswith("memory") else "not measured"
            for c, m in configs
        ]
        lines.append("| Every saving >= 0, train step | " + " | ".join(cells) + " |")
    lines += ["", "<!-- prose: goal -->", ""]
    return lines


def _negative_cause(row: dict[str, Any]) -> str:
    """What makes a train-step saving negative, from the diagnostics."""
    o, ours = row["o"], row["r"]
    if "while_loops" not in o:
        return ""
    temp = ours["temp"] - o["temp"]
    io = (ours["argument"] + ours["output"] - ours["alias"]) - (
        o["argument"] + o["output"] - o["alias"]
    )
    loops = ours["while_loops"] - o["while_loops"]
    parts = []
    if temp and loops and temp == loops * WHILE_SLOT_BYTES:
        parts.append(f"temp {temp:+,} B = {loops} more while loops x {WHILE_SLOT_BYTES} B")
    elif temp:
        parts.append(f"temp {temp:+,} B")
    if io:
        parts.append(f"inputs/outputs {io:+,} B")
    if o.get("live_peak") is not None and ours.get("live_peak") is not None:
        live = ours["live_peak"] - o["live_peak"]
        parts.append("live peak equal" if live == 0 else f"live peak {live:+,} B")
    return "; ".join(parts)


def _summary(report: dict[str, Any]) -> list[str]:
    """One line per (section, pair): range of savings, in % of the peak and in parameter
    bytes, and every negative entry with its cause."""
    sections = [("optimizer-only step", report["models"], "optimizer_step")]
    if _has_train(report["models"]):
        sections.append(("train step", report["models"], "train_step"))
    if report.get("concurrency_scheduler"):
        sections.append(
            (
                "optimizer-only step, default scheduler",
                report["concurrency_scheduler"],
                "optimizer_step",
            )
        )
    lines = ["## Summary", ""]
    for title, report_models, step in sections:
        for key in report_models[0]["results"]:
            rows = _rows(report_models, key, step)
            pct = [_saving(r["o"]["peak"], r["r"]["peak"]) for r in rows]
            per_p = [r["per_p"] for r in rows]
            negative = []
            for r in rows:
                if r["saving"] < 0:
                    cause = _negative_cause(r) if step == "train_step" else ""
                    negative.append(
                        f"{r['name']} {r['saving']:+,} B" + (f" ({cause})" if cause else "")
                    )
            lines.append(
                f"- {title}, {_pair_title(key)}: saves {min(pct):.2f} to {max(pct):.2f} % "
                f"of the peak ({min(per_p):.2f} to {max(per_p):.2f} x the parameter bytes)"
                + (f"; negative: {', '.join(negative)}" if negative else "")
            )
    lines.append("")
    return lines


def _why(report: dict[str, Any]) -> list[str]:
    """The mechanisms behind savings below 1 P and slightly negative ones."""

    def our_temp(report_models: list[dict[str, Any]], clipped: bool) -> str:
        temps = [
            r["r"]["temp"]
            for key in report_models[0]["results"]
            if key.endswith("+clip") == clipped
            for r in _rows(report_models, key, "optimizer_step")
        ]
        copies = sum(
            r["r"]["param_sized_copies"]
            for key in report_models[0]["results"]
            for r in _rows(report_models, key, "optimizer_step")
        )
        return f"{min(temps):,}-{max(temps):,} B" + ("" if copies == 0 else f" ({copies} copies!)")

    memory = report["models"]
    default = report.get("concurrency_scheduler") or memory
    lines = [
        "## Why some savings are below one P, or a few bytes negative",
        "",
        "Temp of ours in the optimizer-only step (no parameter-sized copy; with clipping, "
        f"64 KiB norm chunks): {our_temp(memory, False)} without clipping and "
        f"{our_temp(memory, True)} with it under the memory-optimizing scheduler, "
        f"{our_temp(default, False)} and {our_temp(default, True)} under the default one.",
        "",
        "<!-- prose: why -->",
        "",
    ]
    return lines


def _section(title: str, report_models: list[dict[str, Any]], step: str, intro: str = ""):
    lines = [f"## {title}", ""] + ([intro, ""] if intro else [])
    for key in report_models[0]["results"]:
        pair = key.split("+")[0]
        suffix = " (clipping by global norm)" if key.endswith("+clip") else ""
        lines += [f"### {PAIRS[pair][0]} vs {PAIRS[pair][1]}{suffix}", ""]
        lines += _table(report_models, key, step, with_copies=step == "optimizer_step")
        lines.append("")
    return lines


def _concurrency_run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The optimizer-only figures from a second process using XLA's default scheduler."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            __file__,
            CONCURRENCY_FLAG,
            "--optimizer-step-only",
            "--no-concurrency-run",
            "--out",
            tmp,
            "--models",
            *args.models,
            "--pairs",
            *args.pairs,
        ]
        if args.no_clip:
            command.append("--no-clip")
        # This process exported the memory-scheduler flag; the child must not inherit it.
        inherited = os.environ.get("XLA_FLAGS", "").split()
        flags = [f for f in inherited if not f.startswith(SCHEDULER_FLAG)]
        subprocess.run(command, check=True, env={**os.environ, "XLA_FLAGS": " ".join(flags)})
        return json.loads((Path(tmp) / "gsr_memory.json").read_text())["models"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(models.MODELS))
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--vit-batch", type=int, default=8, help="images per ViT batch")
    parser.add_argument(
        "--gpt2-batch", type=int, default=1, help="1024-token sequences per GPT-2 batch"
    )
    parser.add_argument("--no-clip", action="store_true", help="skip the clipped variants")
    parser.add_argument(
        "--optimizer-step-only", action="store_true", help="skip the (slow) train steps"
    )
    parser.add_argument(
        CONCURRENCY_FLAG,
        action="store_true",
        help="compile with XLA:CPU's default scheduler instead of the memory-optimizing one",
    )
    parser.add_argument(
        "--no-concurrency-run",
        action="store_true",
        help="skip the second process that measures the default scheduler",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--render", type=Path, help="only rewrite the markdown next to this gsr_memory.json"
    )
    args = parser.parse_args(argv)
    if args.render:
        report = json.loads(args.render.read_text())
        write_markdown("gsr_memory", markdown(report), args.render.parent, echo=False)
        return

    clips: list[float | None] = [None] if args.no_clip else [None, CLIP_NORM]
    report: dict[str, Any] = {
        "jax_version": jax.__version__,
        "optax_version": optax.__version__,
        "platform": platform.platform(),
        "device": str(jax.devices()[0]),
        "scheduler": "concurrency (XLA default)" if args.concurrency_scheduler else "memory",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "peak_formula": "argument + output - alias + temp (compiled.memory_analysis())",
        "clip_norm": CLIP_NORM,
        "models": [],
    }
    with warnings.catch_warnings():
        # The one donated buffer per leaf that no output can take is reported by JAX.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        for name in args.models:
            batch = args.gpt2_batch if name.startswith("gpt2") else args.vit_batch
            print(f"{name} (batch {batch}, {report['scheduler']} scheduler)", flush=True)
            report["models"].append(
                measure_model(name, batch, args.pairs, clips, train=not args.optimizer_step_only)
            )
            jax.clear_caches()
    if not (args.no_concurrency_run or args.concurrency_scheduler):
        report["concurrency_scheduler"] = _concurrency_run(args)
    write_results("gsr_memory", report, markdown(report), args.out)


if __name__ == "__main__":
    main()
