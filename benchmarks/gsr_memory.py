"""Gradient-space reutilization: compiled peak memory of optax's AdamW / Lion / Adan vs ours.

For ViT-S/16, ViT-B/16, ViT-L/16 (224x224 images, 1000 classes) and GPT-2 small / medium
(1024-token sequences) from :mod:`resireduce_jax.models`, this compiles (nothing is run,
nothing full-size is allocated: parameters and optimizer state come from
``jax.eval_shape``) two programs per optimizer:

* the **train step** ``(params, opt_state, batch) -> (params, opt_state, loss)``: forward,
  backward, ``tx.update`` and ``optax.apply_updates`` under one ``jax.jit`` with params
  and optimizer state donated;
* the **optimizer-only step** ``(params, opt_state, grads) -> (params, opt_state)`` with
  all three donated. For optax's optimizers both argument orders (state before or after
  the gradients) are compiled and the better one is reported; ours use
  :func:`resireduce_jax.optimizers.optimizer_step`, which picks the order.

Pairs: ``optax.adamw`` vs ``adamw_r``, ``optax.lion`` vs ``lion_r``, ``optax.adan`` vs
``adan_r`` (optax's Adan is the Adan a JAX user would otherwise take; its update rule
differs from the official one that ``adan_r`` implements, its buffers are the same:
moments m, v, n and the previous gradient). With ``--clip`` each pair is also compiled
with gradient clipping by global norm (optax: ``chain(clip_by_global_norm, ...)``; ours:
``max_grad_norm``).

Peak memory per program, from ``compiled.memory_analysis()``::

    peak = argument_size_in_bytes + output_size_in_bytes - alias_size_in_bytes
           + temp_size_in_bytes

(live inputs, outputs that do not reuse a donated input, and XLA's scratch; on CPU
``peak_memory_in_bytes`` leaves the scratch out, so it is not used). MB are 2**20 bytes.
XLA:CPU runs with the memory-optimizing scheduler
(``--xla_cpu_enable_concurrency_optimized_scheduler=false``, see
:func:`resireduce_jax.runtime.configure_cpu`); GPU schedulers differ.

Writes ``benchmarks/results/gsr_memory.{json,md}``. Usage::

    python benchmarks/gsr_memory.py                  # all five models (about 25 min on 2 cores)
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
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

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


def _compile_train_step(model, config, tx, params, batch) -> Any:
    loss = _loss_fn(model, config)

    def train_step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch, jax.random.key(0))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = jax.eval_shape(tx.init, params)
    jitted = jax.jit(train_step, donate_argnums=(0, 1))
    return jitted.lower(params, opt_state, batch).compile()


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
                    compiled = _compile_train_step(model, config, tx, params, batch)
                    figures["train_step"] = {
                        **hlo.peak_memory(compiled).as_dict(),
                        "compile_s": round(time.perf_counter() - t0, 1),
                    }
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


def _table(
    report_models: list[dict[str, Any]], key: str, step: str, with_copies: bool
) -> list[str]:
    pair = key.split("+")[0]
    orig_title, r_title, _, _ = PAIRS[pair]
    header = (
        f"| Model | # Params | {orig_title} (MB) | {r_title} (MB) | Savings (%) | Savings (MB) |"
    )
    rule = "|---|---|---|---|---|---|"
    if with_copies:
        header += " Savings / param bytes | Param-sized copies (orig / R) |"
        rule += "---|---|"
    lines = [header, rule]
    for m in report_models:
        r = m["results"][key]
        o, ours = r["original"][step], r["R"][step]
        row = (
            f"| {MODEL_TITLES[m['model']]} | {_params_text(m['params'])} | "
            f"{o['peak'] / MB:.0f} | {ours['peak'] / MB:.0f} | "
            f"{_saving(o['peak'], ours['peak']):.2f} | {(o['peak'] - ours['peak']) / MB:.1f} |"
        )
        if with_copies:
            row += (
                f" {(o['peak'] - ours['peak']) / m['param_bytes']:.2f} | "
                f"{o['param_sized_copies']} / {ours['param_sized_copies']} |"
            )
        lines.append(row)
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
        f"{report['optax_version']}; nothing is trained or allocated. **Peak** = "
        "`argument_size_in_bytes + output_size_in_bytes - alias_size_in_bytes + "
        "temp_size_in_bytes` of `compiled.memory_analysis()`; MB = 2^20 bytes. Params and "
        "optimizer state are donated; the optimizer-only step also donates the gradients "
        "(optax: the better of the two argument orders; ours: "
        "`resireduce_jax.optimizers.optimizer_step`). Original optimizers: `optax.adamw`, "
        "`optax.lion`, `optax.adan` (clipped: `optax.chain(optax.clip_by_global_norm(1.0), "
        "...)`); ours: `adamw_r`, `lion_r`, `adan_r` (clipped: `max_grad_norm=1.0`). "
        "Param-sized copies: HLO `copy` instructions at least as large as the smallest "
        f"parameter matrix. Batches: {batches}.",
        "",
    ]
    lines += _summary(report)
    lines += _section(
        "Optimizer-only step (gradients passed in; memory-optimizing scheduler)",
        models_,
        "optimizer_step",
    )
    if "train_step" in next(iter(models_[0]["results"].values()))["original"]:
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


def _summary(report: dict[str, Any]) -> list[str]:
    """One line per (section, pair): range of savings, in % of the peak and in parameter
    bytes, and every negative entry."""
    sections = [("optimizer-only step", report["models"], "optimizer_step")]
    if "train_step" in next(iter(report["models"][0]["results"].values()))["original"]:
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
            pair = key.split("+")[0]
            rows = []
            for m in report_models:
                r = m["results"][key]
                o, ours = r["original"][step]["peak"], r["R"][step]["peak"]
                rows.append(
                    (MODEL_TITLES[m["model"]], o - ours, _saving(o, ours), m["param_bytes"])
                )
            pct = [r[2] for r in rows]
            per_p = [r[1] / r[3] for r in rows]
            negative = [f"{name} {d / MB:+.3f} MB" for name, d, _, _ in rows if d < 0]
            clip = " + clipping" if key.endswith("+clip") else ""
            lines.append(
                f"- {title}, {PAIRS[pair][1]}{clip}: saves {min(pct):.2f} to {max(pct):.2f} % "
                f"of the peak ({min(per_p):.2f} to {max(per_p):.2f} x the parameter bytes)"
                + (f"; negative: {', '.join(negative)}" if negative else "")
            )
    lines.append("")
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
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--render", type=Path, help="only rewrite the markdown next to this gsr_memory.json"
    )
    args = parser.parse_args(argv)
    if args.render:
        report = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(report) + "\n")
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
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gsr_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "gsr_memory.md").write_text(markdown(report) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
