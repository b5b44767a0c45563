"""Final quality of every gradient-exchange variant, trained side by side with the training program.

The memory side of the project ("less memory") is measured by ``memory_figures.py`` and
``peak_memory.py``; this script measures the other half ("without losing accuracy"). Each
task is trained with :func:`train.train.train_and_evaluate` from its config in ``configs/``
under every exchange variant and several seeds, with nothing else changed:

* ``dense``: no compression (exact worker mean), the quality ceiling;
* ``none``: top-k without error feedback (what EF exists to fix);
* ``ef``: top-k with plain error feedback, one residual per compressed leaf (the baseline);
* ``a``, ``w``, ``2d``, ``w+2d``: ResiReduce's reduced residuals (shared average / weighted
  residual per group of same-shape leaves, 2-D intra-layer residual, both);
* ``ef+bf16``, ``w+2d+bf16``: ``ef`` / ``w+2d`` with their residuals cast to bfloat16;
  ``ef+f8``, ``w+2d+f8``: cast to float8 (e4m3), compressed-momentum Adam only;
* ``<store>+<format>`` for each store of ``STORES`` and format of ``FORMATS`` (e.g.
  ``ef+int4/128/nearest``, ``w+2d+int8``): the residuals in a
  ``compression.residual_format``, codes with a scale per block (beyond the papers).
  ``frontier.png`` plots them: residual bytes against EF's, and the final metric against
  dense's, one point per store and format.

Seeds change the parameter initialization, the data order and the per-step PRNG keys;
seed ``s`` is the same for every variant, so differences between variants are paired.
Reported per task and variant: the final eval metric (mean ± std over seeds), its
difference from ``ef``, and the residual bytes one worker keeps (from the run's own memory
report, :func:`resireduce_jax.memory.model_state_bytes`).

Tasks (8 simulated CPU workers, top-k at 1 % density):

* ``digits``: ``configs/default.py`` (MLP on scikit-learn's digits, SGD-momentum), with
  ``compression.min_size=1000`` so that every hidden matrix is compressed;
* ``byte_gpt``: ``configs/byte_gpt.py`` (3-layer width-64 byte-level GPT on CPython's
  pydoc text, AdamW with gradient clipping), 1200 steps, with the byte embedding as the
  2-D reduced layer (the paper reduces GPT-2's word embedding this way);
* ``byte_gpt_deep``: the same at 12 layers, so that a group of 3 is a quarter of the
  stack as in the paper (3 of GPT-2's 24 blocks), 3 seeds;
* ``byte_gpt_sgdm``: ``byte_gpt`` under SGD-momentum, to tell whether "top-k without EF
  beats EF" comes from AdamW;
* ``byte_gpt_deep_sgdm``: ``byte_gpt_deep`` under SGD-momentum, the same question at
  paper depth (and whether w+2d's gap to EF there is AdamW's).

* ``byte_gpt_finetune``: the paper's regime (Table 4 fine-tunes pre-trained GPT-2 / BERT):
  the 3-layer byte GPT pre-trained densely on pydoc text (1200 steps, seed 0, cached
  under ``~/.cache/resireduce_jax/pretrained`` or ``$RR_PRETRAINED_DIR``), then fine-tuned
  on Python source (``stdlib_source``) with each exchange; seeds change the fine-tuning's
  data order and keys, not the pre-trained model. Each run records the pre-trained
  parameters' digest: another machine's XLA numerics pre-train another model, so
  ``--merge`` refuses runs fine-tuned from a different one, as it refuses runs of another
  step count (``--supersede`` drops them).

**Recipes** (``--recipes``) are remedies applied on top of a task's config, one row per
recipe and variant: ``base`` (the config as it is), ``lr_warmup`` (a linear learning-rate
warm-up over the first 5 % of the steps), ``dense_warmup`` (the first 5 % of the steps
uncompressed), ``dgc_warmup`` (DGC's warm-up: density 25 %, 6.25 %, 1.5625 % over the first
20 % of the steps), ``cm`` (compressed momentum: ``compressed_momentum_adam`` for AdamW tasks,
``compressed_momentum_sgd`` for SGD tasks, after a 5 % dense warm-up), ``cm16`` (``cm``
after 12.5 % of the steps dense in bfloat16, the same bytes as 6.25 % in float32; the
default of ``configs/byte_gpt.py``), ``cm_global`` (``cm`` with whole-model Top-k,
``compression.selection_scope="global"``; ``cm16_global`` the same after ``cm16``'s
warm-up), ``cm_dgc`` (``cm``
with DGC's warm-up over the 10 % of the steps after the dense ones). DGC's own memory is
the variant ``dgc`` (SGD tasks; its momentum factor masking refuses a dense phase, so not
with ``dense_warmup`` or the ``cm`` recipes). Every run reports the bytes one worker sent
over the run against a dense exchange's (``summary.json``), so a remedy is judged by
quality and bytes together.

Tasks can be added to an earlier result with ``--merge`` (the README's figures were
produced that way: ``--tasks byte_gpt_deep --merge`` after the first two tasks).

Writes ``benchmarks/results/accuracy.{json,md,png}`` and ``frontier.png``. Usage::

    python benchmarks/accuracy.py                                  # the README's run
    python benchmarks/accuracy.py --tasks digits --variants none ef w+2d --seeds 1
    python benchmarks/accuracy.py --tasks byte_gpt --steps 1200 --set optimizer.max_grad_norm=None
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, NamedTuple

from common import (
    NUM_WORKERS,
    RESULTS,
    environment,
    load_config,
    parse_assignment,
    set_dotted,
    write_results,
)

# Exchange variants (train/compiled_step.py vocabulary: "+bf16" / "+f8" = residuals cast to
# bfloat16 / float8; "+<format>" = a compression.residual_format; "dgc": DGC's own memory,
# SGD tasks only).
STORES = ("ef", "w", "2d", "w+2d")
# The memory-accuracy frontier's formats: codes with a float32 scale per block ("float8" is
# e4m3 codes so scaled, unlike the "+f8" cast), int4 and int3 under both roundings.
FORMATS = (
    "bfloat16",
    "int8",
    "float8",
    "int4/128/stochastic",
    "int4/128/nearest",
    "int3/128/stochastic",
    "int3/128/nearest",
)
VARIANTS = (
    "dense",
    "none",
    "ef",
    "ef+bf16",
    "ef+f8",
    "dgc",
    "a",
    "w",
    "2d",
    "w+2d",
    "w+2d+bf16",
    "w+2d+f8",
    *(f"{store}+{fmt}" for store in STORES for fmt in FORMATS),
)


class Metric(NamedTuple):
    """A task's eval metric and how it is reported."""

    key: str  # key of the eval metrics
    higher_is_better: bool
    scale: float  # reported value = scale * metric
    unit: str


ACCURACY = Metric("accuracy", higher_is_better=True, scale=100.0, unit="accuracy %")
PERPLEXITY = Metric("perplexity", higher_is_better=False, scale=1.0, unit="perplexity")


@dataclasses.dataclass(frozen=True)
class Task:
    config: str  # configs/<config>.py
    overrides: dict[str, Any]  # dotted config keys
    metric: Metric
    default_seeds: int
    description: str
    pretrain: dict[str, Any] | None = None  # config overrides of a cached dense pre-training

    @property
    def sgd(self) -> bool:
        return self.overrides.get("optimizer.name", load_config(self.config).optimizer.name) == (
            "sgd"
        )


def _byte_gpt_task(overrides: dict[str, Any], *, default_seeds: int, description: str) -> Task:
    """A task on ``configs/byte_gpt.py``: 1200 steps, eval perplexity, ``overrides`` on top."""
    return Task(
        config="byte_gpt",
        overrides={
            "num_steps": 1200,
            # The remedies are rows (RECIPES): the task itself is AdamW with plain EF, even
            # where the config's default is a recipe.
            "optimizer.name": "adamw",
            "optimizer.one_buffer": "off",  # compressed momentum's options (RECIPES)
            "optimizer.frozen_nu_format": "float32",
            "compression.density_schedule.dense_fraction": 0.0,
            "compression.density_schedule.dense_dtype": "",  # recipes send float32
            # The config's intra_layers="auto" picks singletons holding >= 10 % of the
            # compressed elements; at width 64 the byte embedding holds 9.8 % (16,384 of
            # 167,936), so "2d" would change nothing. Name it, as configs/gpt2_*_wikitext.py
            # do for GPT-2.
            "compression.intra_layers": r"^wte/embedding$",
            "eval_every": 200,
            "log_every": 50,
            **overrides,
        },
        metric=PERPLEXITY,
        default_seeds=default_seeds,
        description=description,
    )


_TWELVE_LAYERS = {"model.overrides": {"num_layers": 12, "width": 64, "num_heads": 4, "max_len": 64}}
# Learning rate from a 400-step dense sweep of byte_gpt over {0.1, 0.3, 1.0}: 0.3 was best.
_SGD_MOMENTUM = {
    "optimizer.name": "sgd",
    "optimizer.kwargs": {"momentum": 0.9},
    "optimizer.learning_rate": 0.3,
    "optimizer.weight_decay": 0.0,
}

_FINETUNE_PRETRAIN = {"num_steps": 1200, "eval_every": 1200, "log_every": 100}

TASKS: dict[str, Task] = {
    "digits": Task(
        config="default",
        overrides={
            "num_steps": 300,
            "compression.min_size": 1000,
            "eval_every": 20,
            "log_every": 10,
        },
        metric=ACCURACY,
        default_seeds=3,
        description="MLP on scikit-learn digits (configs/default.py), SGD-momentum 0.1, "
        "cosine schedule",
    ),
    "byte_gpt": _byte_gpt_task(
        {"eval_every": 100, "log_every": 10},
        default_seeds=2,
        description="3-layer width-64 byte-level GPT on pydoc text (configs/byte_gpt.py), "
        "AdamW 3e-3, clip 1.0, cosine schedule",
    ),
    # The paper groups 3 of GPT-2's 24 blocks; at 3 layers a group is the whole model. At
    # 12 layers a group of 3 is a quarter of the stack, the depth at which the paper's
    # grouping is meant to work.
    "byte_gpt_deep": _byte_gpt_task(
        _TWELVE_LAYERS,
        default_seeds=3,
        description="12-layer width-64 byte-level GPT on pydoc text (configs/byte_gpt.py with "
        "num_layers=12), AdamW 3e-3, clip 1.0, cosine schedule",
    ),
    # Does top-k without EF beat EF because of AdamW (whose per-coordinate normalization
    # rescales a residual's delayed mass)? The same 3-layer task under SGD-momentum answers
    # it.
    "byte_gpt_sgdm": _byte_gpt_task(
        _SGD_MOMENTUM,
        default_seeds=2,
        description="the byte_gpt task under SGD-momentum 0.9, learning rate 0.3, clip 1.0, "
        "cosine schedule",
    ),
    # The same question at paper depth: is w+2d's gap to EF on byte_gpt_deep AdamW's? The
    # 3-layer task's learning rate, not swept again at 12 layers (gradients are clipped).
    "byte_gpt_deep_sgdm": _byte_gpt_task(
        {**_TWELVE_LAYERS, **_SGD_MOMENTUM},
        default_seeds=2,
        description="the byte_gpt_deep task under SGD-momentum 0.9, learning rate 0.3 (the "
        "3-layer sweep's), clip 1.0, cosine schedule",
    ),
    # The paper's Table 4 fine-tunes pre-trained models: pre-train densely on English
    # (pydoc), fine-tune with compression on Python source.
    "byte_gpt_finetune": dataclasses.replace(
        _byte_gpt_task(
            {
                "num_steps": 600,
                "dataset": {"name": "stdlib_source", "context_length": 64},
                "optimizer.learning_rate": 1e-3,
                "eval_every": 100,
                "log_every": 20,
            },
            default_seeds=3,
            description="the byte_gpt model pre-trained densely on pydoc text (1200 steps), "
            "fine-tuned on standard-library Python source, AdamW 1e-3, clip 1.0, cosine",
        ),
        pretrain=_FINETUNE_PRETRAIN,
    ),
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    description: str
    adamw: dict[str, Any]  # config overrides on AdamW tasks
    sgd: dict[str, Any]  # ... and on SGD-momentum tasks

    def overrides(self, task: Task) -> dict[str, Any]:
        return self.sgd if task.sgd else self.adamw


def _both(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return overrides, overrides


_DENSE_FRACTION = "compression.density_schedule.dense_fraction"
_DENSE_5 = {_DENSE_FRACTION: 0.05}
_DGC_10 = {"compression.density_schedule.dgc_fraction": 0.1}
# 12.5 % of the steps dense, in bfloat16: the bytes of 6.25 % in float32.
_DENSE_16 = {_DENSE_FRACTION: 0.125, "compression.density_schedule.dense_dtype": "bfloat16"}
_GLOBAL = "compression.selection_scope"
_ONE_BUFFER = {"optimizer.one_buffer": "on"}
RECIPES: dict[str, Recipe] = {
    "base": Recipe("the task's config", *_both({})),
    # schedule.warmup_epochs is set from the dataset's epoch length (build_config).
    "lr_warmup": Recipe("linear LR warm-up over 5 % of the steps", *_both({})),
    "dense_warmup": Recipe("first 5 % of the steps uncompressed", *_both(_DENSE_5)),
    "dgc_warmup": Recipe(
        "DGC warm-up: density 25 %, 6.25 %, 1.5625 % over the first 20 % of the steps",
        *_both({"compression.density_schedule.dgc_fraction": 0.2}),
    ),
    "cm": Recipe(
        "compressed momentum after 5 % dense steps",
        {**_DENSE_5, "optimizer.name": "compressed_momentum_adam"},
        {**_DENSE_5, "optimizer.name": "compressed_momentum_sgd"},
    ),
    "cm16": Recipe(
        "compressed momentum after 12.5 % of the steps dense in bfloat16 (the byte GPT "
        "config's recipe)",
        {**_DENSE_16, "optimizer.name": "compressed_momentum_adam"},
        {**_DENSE_16, "optimizer.name": "compressed_momentum_sgd"},
    ),
    "cm16_1b": Recipe(
        "cm16 with one buffer per worker (optimizer.one_buffer='on': the momentum kept in "
        "each worker's residual store, b1 m + e_i) and Adam's frozen second moment in int8 "
        "codes (optimizer.frozen_nu_format='int8')",
        {
            **_DENSE_16,
            **_ONE_BUFFER,
            "optimizer.name": "compressed_momentum_adam",
            "optimizer.frozen_nu_format": "int8",
        },
        {**_DENSE_16, **_ONE_BUFFER, "optimizer.name": "compressed_momentum_sgd"},
    ),
    "cm_global": Recipe(
        "compressed momentum after 5 % dense steps, Top-k over the whole model "
        "(compression.selection_scope='global')",
        {**_DENSE_5, _GLOBAL: "global", "optimizer.name": "compressed_momentum_adam"},
        {**_DENSE_5, _GLOBAL: "global", "optimizer.name": "compressed_momentum_sgd"},
    ),
    "cm16_global": Recipe(
        "cm16 with Top-k over the whole model (compression.selection_scope='global')",
        {**_DENSE_16, _GLOBAL: "global", "optimizer.name": "compressed_momentum_adam"},
        {**_DENSE_16, _GLOBAL: "global", "optimizer.name": "compressed_momentum_sgd"},
    ),
    "cm_dgc": Recipe(
        "compressed momentum after 5 % dense steps, then DGC's warm-up (density 25 %, "
        "6.25 %, 1.5625 %) over the next 10 %",
        {**_DENSE_5, **_DGC_10, "optimizer.name": "compressed_momentum_adam"},
        {**_DENSE_5, **_DGC_10, "optimizer.name": "compressed_momentum_sgd"},
    ),
}
LR_WARMUP_FRACTION = 0.05


def build_config(
    task: Task,
    variant: str,
    seed: int,
    steps: int | None,
    extra: dict[str, Any],
    recipe: str = "base",
):
    config = load_config(task.config)
    overrides = {**task.overrides, **RECIPES[recipe].overrides(task), **extra}
    for key, value in overrides.items():
        set_dotted(config, key, value)
    if steps is not None:
        config.num_steps = steps
    if recipe == "lr_warmup":
        from train import input_pipeline

        examples = input_pipeline.get_dataset(config.dataset, seed=seed).num_train_examples
        steps_per_epoch = examples / (NUM_WORKERS * config.batch_size_per_worker)
        config.schedule.warmup_epochs = LR_WARMUP_FRACTION * config.num_steps / steps_per_epoch
    from train.compiled_step import with_variant

    config = with_variant(config, variant)
    config.seed = seed
    config.num_workers = NUM_WORKERS
    config.checkpoint_every = config.num_steps  # one checkpoint at the end, nothing mid-run
    config.keep_checkpoints = 1
    return config


def _has_dense_phase(task: Task, recipe: str) -> bool:
    """Whether ``recipe`` on ``task`` starts with uncompressed steps (compressed momentum
    always does: its dense warm-up estimates Adam's second moment)."""
    overrides = {**task.overrides, **RECIPES[recipe].overrides(task)}
    default = load_config(task.config).compression.density_schedule.dense_fraction
    return overrides.get(_DENSE_FRACTION, default) > 0


def applicable(task: Task, recipe: str, variant: str) -> bool:
    """Whether a (recipe, variant) row makes sense on ``task``: dense only as the base, DGC's
    memory only on SGD tasks and never after a dense phase (the config refuses it: momentum
    factor masking would clear the whole momentum every dense step), float8 residuals only
    under compressed-momentum Adam (the config refuses them elsewhere), whole-model Top-k
    with any variant but DGC's."""
    overrides = RECIPES[recipe].overrides(task)
    if overrides.get(_GLOBAL) == "global" and variant == "dgc":
        return False  # DGC's memory is its own exchange
    if variant.endswith("+f8"):
        return overrides.get("optimizer.name") == "compressed_momentum_adam"
    if variant == "dense":
        return recipe == "base"
    if variant == "dgc":
        return task.sgd and not _has_dense_phase(task, recipe)
    return True


def pretrained(task: Task) -> str:
    """The workdir of ``task``'s dense pre-training (seed 0; trained once, then cached):
    every seed of the fine-tuning starts from the same pre-trained model, as fine-tuning a
    published checkpoint does."""
    import hashlib

    from train.train import train_and_evaluate

    config = load_config(task.config)
    for key, value in {**_byte_gpt_task({}, default_seeds=1, description="").overrides,
                       **task.pretrain}.items():  # fmt: skip
        set_dotted(config, key, value)
    from train.compiled_step import with_variant

    config = with_variant(config, "dense")
    config.seed = 0
    config.num_workers = NUM_WORKERS
    config.checkpoint_every = config.num_steps
    config.keep_checkpoints = 1
    key = hashlib.sha256(config.to_json(sort_keys=True).encode()).hexdigest()[:16]
    root = os.environ.get("RR_PRETRAINED_DIR", os.path.expanduser("~/.cache/resireduce_jax"))
    workdir = os.path.join(root, "pretrained", f"{task.config}_{key}")
    done = os.path.join(workdir, "summary.json")
    if not os.path.exists(done):
        with contextlib.redirect_stdout(sys.stderr):
            train_and_evaluate(config, workdir)
    return workdir


def pretrained_digest(workdir: str) -> str:
    """The first 16 hex digits of a sha256 over the pre-trained parameters in ``workdir``
    (paths, dtypes, shapes and bytes): runs fine-tuned from models of different digests
    start from different weights and do not compare."""
    import hashlib

    import jax
    import numpy as np

    from train.train import final_state

    leaves = jax.tree_util.tree_flatten_with_path(final_state(workdir)["params"])[0]
    digest = hashlib.sha256()
    for path, leaf in sorted((jax.tree_util.keystr(p), np.asarray(x)) for p, x in leaves):
        digest.update(f"{path}:{leaf.dtype}:{leaf.shape}".encode())
        digest.update(leaf.tobytes())
    return digest.hexdigest()[:16]


def incomparable_runs(
    before: dict[str, Any], steps: dict[str, int], digests: dict[str, str]
) -> dict[str, list[dict[str, Any]]]:
    """Per task of ``steps``, ``before``'s runs of that task that do not compare with a run
    of this command: trained for another step count than ``steps[task]``, or fine-tuned
    from another pre-trained model than ``digests[task]`` (or an unrecorded one)."""
    stale: dict[str, list[dict[str, Any]]] = {}
    for run in before["runs"]:
        task = run["task"]
        if task in steps and (
            run.get("steps") != steps[task]
            or (task in digests and run.get("pretrained_digest") != digests[task])
        ):
            stale.setdefault(task, []).append(run)
    return stale


def curves(records: list[dict[str, Any]], metric: str, scale: float) -> dict[str, list]:
    eval_records = [r for r in records if r["split"] == "eval"]
    train_records = [r for r in records if r["split"] == "train"]
    return {
        "eval_step": [r["step"] for r in eval_records],
        "eval_metric": [scale * r[metric] for r in eval_records],
        "train_step": [r["step"] for r in train_records],
        "train_loss": [r["loss"] for r in train_records],
    }


def train_one(
    task_name: str,
    variant: str,
    seed: int,
    steps: int | None,
    extra,
    scratch: str,
    recipe: str = "base",
):
    """Trains one (task, recipe, variant, seed) in a fresh workdir; returns its record."""
    from train import metrics as metrics_lib
    from train.train import train_and_evaluate

    task = TASKS[task_name]
    config = build_config(task, variant, seed, steps, extra, recipe)
    digest = None
    if task.pretrain is not None:
        config.init_from = pretrained(task)
        digest = pretrained_digest(config.init_from)
    name = f"{task_name}_{recipe}_{variant.replace('/', '-')}_seed{seed}"  # a path part
    workdir = tempfile.mkdtemp(prefix=name + "_", dir=scratch)
    log_path = os.path.join(scratch, f"{name}.log")
    start = time.perf_counter()
    try:
        with (
            open(log_path, "w") as log,
            contextlib.redirect_stdout(log),
            contextlib.redirect_stderr(log),
        ):
            summary = train_and_evaluate(config, workdir)
        if summary.preempted:
            raise KeyboardInterrupt(f"SIGTERM stopped {task_name} {variant} seed {seed}")
        records = metrics_lib.read_metrics(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.perf_counter() - start
    return {
        "task": task_name,
        "recipe": recipe,
        "variant": variant,
        "seed": seed,
        "steps": summary.step,
        "bytes_sent": summary.communication["bytes_sent_per_worker"],
        "dense_bytes": summary.communication["dense_bytes_per_worker"],
        "final": task.metric.scale * summary.eval[task.metric.key],
        "final_eval": summary.eval,
        "final_train": summary.train,
        "skipped_steps": summary.skipped_steps,
        "residual_bytes": summary.memory["reduced"]["residuals"],
        "ef_residual_bytes": summary.memory["baseline"]["residuals"],
        "model_state_bytes": summary.memory["reduced"]["total"],
        # compressed momentum's optimizer and residual state per parameter per worker
        "bytes_per_parameter": summary.memory.get("bytes_per_parameter"),
        "seconds": seconds,
        "curves": curves(records, task.metric.key, task.metric.scale),
        **({"pretrained_digest": digest} if digest is not None else {}),
    }


def setting(task_name: str, config) -> dict[str, Any]:
    c = config.compression
    return {
        "description": TASKS[task_name].description,
        "steps": int(config.num_steps),
        "workers": int(config.num_workers),
        "batch_per_worker": int(config.batch_size_per_worker),
        "compressor": c.compressor,
        "density": float(c.density),
        "min_size": int(c.min_size),
        "grouping": c.grouping,
        "max_group_size": int(c.max_group_size),
        "intra_layers": c.intra_layers,
        "optimizer": config.optimizer.name,
        "learning_rate": float(config.optimizer.learning_rate),
        "max_grad_norm": config.optimizer.max_grad_norm,
    }


def _recipe(run: dict[str, Any]) -> str:
    return run.get("recipe", "base")


def summarize(
    runs: list[dict[str, Any]],
    tasks: list[str],
    variants: list[str],
    recipes: list[str] | None = None,
) -> list[dict]:
    """One row per (task, recipe, variant) with runs: mean, spread, the ratio to the task's
    dense runs (base recipe), the paired difference to ``ef`` under the same recipe, and
    the bytes sent against a dense exchange."""
    recipes = recipes or list(RECIPES)
    rows = []
    for task_name in tasks:
        mine_task = [r for r in runs if r["task"] == task_name]
        steps = sorted({r.get("steps") for r in mine_task}, key=str)
        if len(steps) > 1:
            raise ValueError(
                f"the {task_name} runs trained for different step counts ({steps}): their "
                "finals do not compare. Keep one step count per task (see --supersede)."
            )
        dense = [r["final"] for r in mine_task if r["variant"] == "dense" and _recipe(r) == "base"]
        for recipe in recipes:
            by_variant = {
                v: sorted(
                    (r for r in mine_task if r["variant"] == v and _recipe(r) == recipe),
                    key=lambda r: r["seed"],
                )
                for v in variants
            }
            ef_by_seed = {r["seed"]: r["final"] for r in by_variant.get("ef", [])}
            for variant in variants:
                mine = by_variant[variant]
                if not mine:
                    continue
                finals = [r["final"] for r in mine]
                paired = [
                    r["final"] - ef_by_seed[r["seed"]] for r in mine if r["seed"] in ef_by_seed
                ]
                sent = [r["bytes_sent"] / r["dense_bytes"] for r in mine if r.get("dense_bytes")]
                mean = statistics.fmean(finals)
                rows.append(
                    {
                        "task": task_name,
                        "recipe": recipe,
                        "variant": variant,
                        "seeds": [r["seed"] for r in mine],
                        "finals": finals,
                        "mean": mean,
                        "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                        "over_dense": mean / statistics.fmean(dense) if dense else None,
                        "delta_vs_ef": (
                            statistics.fmean(paired) if paired and variant != "ef" else None
                        ),
                        "delta_vs_ef_std": statistics.stdev(paired) if len(paired) > 1 else None,
                        "sent_over_dense": statistics.fmean(sent) if sent else None,
                        "residual_bytes": mine[0]["residual_bytes"],
                        "ef_residual_bytes": mine[0]["ef_residual_bytes"],
                        "bytes_per_parameter": mine[0].get("bytes_per_parameter"),
                        "skipped_steps": sum(r["skipped_steps"] for r in mine),
                        "seconds": sum(r["seconds"] for r in mine),
                    }
                )
    return rows


def _bytes(n: int) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 2**20 else f"{n / 2**20:,.2f} MiB"


def _per_parameter(buffers: dict[str, float] | None) -> str:
    """``"2.14 (m 0.06, v 1.55, residuals 0.52)"`` from the run's per-parameter buffers."""
    if not buffers:
        return ""
    parts = ", ".join(f"{k} {v:.2f}" for k, v in buffers.items() if k != "total")
    return f"{buffers['total']:.2f} ({parts})"


def markdown(payload: dict[str, Any]) -> str:
    """The table first (final eval metric per task and variant), then how it was produced."""
    lines = [
        "# Accuracy: gradient-exchange variants trained side by side",
        "",
        "Final eval metric per task, recipe and variant, mean ± standard deviation over "
        "seeds; × dense is the mean over the task's dense mean; Δ vs ef is the mean of the "
        "per-seed differences to ef under the same recipe, ± their standard deviation; sent "
        "/ dense is the bytes one worker sent over the run against a dense exchange's. "
        "Tasks, recipes and commands: below the table.",
        "",
    ]
    if not payload.get("complete", True):
        lines += [
            "**Incomplete run**: stopped early; only the finished runs are shown.",
            "",
        ]
    per_parameter = any(row.get("bytes_per_parameter") for row in payload["summary"])
    lines += [
        "| task | recipe | variant | final metric (mean ± std) | seeds | × dense | Δ vs ef "
        "| sent / dense | residual bytes / worker | vs ef residuals |"
        + (" optimizer + residual B / parameter |" if per_parameter else ""),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if per_parameter else ""),
    ]
    for row in payload["summary"]:
        task = TASKS[row["task"]]
        digits = 2
        value = f"{row['mean']:.{digits}f} ± {row['std']:.{digits}f}"
        ratio = (
            f"{row['residual_bytes'] / row['ef_residual_bytes']:.1%}"
            if row["ef_residual_bytes"]
            else ""
        )
        if row["delta_vs_ef"] is None:
            delta = "—"
        else:
            delta = f"{row['delta_vs_ef']:+.{digits}f}"
            if row["delta_vs_ef_std"] is not None:
                delta += f" ± {row['delta_vs_ef_std']:.{digits}f}"
        over = "" if row.get("over_dense") is None else f"{row['over_dense']:.3f}"
        sent = "" if row.get("sent_over_dense") is None else f"{row['sent_over_dense']:.2%}"
        lines.append(
            f"| {row['task']} | {row.get('recipe', 'base')} | {row['variant']} | {value} "
            f"{task.metric.unit} | {len(row['seeds'])} | {over} | {delta} | {sent} "
            f"| {_bytes(row['residual_bytes'])} | {ratio} |"
            + (f" {_per_parameter(row.get('bytes_per_parameter'))} |" if per_parameter else "")
        )
    if payload.get("notes"):  # written by hand into the JSON, rendered as they are
        lines += ["", *(f"* {note}" for note in payload["notes"])]
    recipes = payload.get("recipes") or ["base"]
    lines += [
        "",
        "Recipes: " + "; ".join(f"`{r}`: {RECIPES[r].description}" for r in recipes) + ".",
        "",
        f"Each run is `train.train.train_and_evaluate` on {NUM_WORKERS} simulated CPU workers; "
        "only `compression.variant` (and, for a +suffix, `compression.residual_dtype` or "
        "`compression.residual_format`) differs "
        "between rows of a task. Same seed = same init, data order and PRNG keys. Residual "
        "bytes are what one worker keeps between steps (from the run's memory report).",
        "",
    ]
    if payload.get("overrides"):
        applied = ", ".join(f"`{k}={v}`" for k, v in payload["overrides"].items())
        lines += [f"**Config overrides on every run**: {applied}.", ""]
    for task_name, s in payload["settings"].items():
        task = TASKS[task_name]
        better = "higher" if task.metric.higher_is_better else "lower"
        lines.append(
            f"* **{task_name}**: {s['description']}; {s['steps']} steps, {s['workers']} workers "
            f"x {s['batch_per_worker']} examples, {s['compressor']} density {s['density']:g}, "
            f"leaves under min_size={s['min_size']} elements travel dense, groups of <= "
            f"{s['max_group_size']} same-shape leaves, 2-D layers `{s['intra_layers']}`; "
            f"metric: eval {task.metric.unit} ({better} is better)"
            + (
                f"; every run fine-tuned from the pre-trained model `{s['pretrained_digest']}`."
                if s.get("pretrained_digest")
                else "."
            )
        )
    skipped = sum(row["skipped_steps"] for row in payload["summary"])
    commands = payload.get("commands") or [payload["command"]]
    lines += [
        "",
        f"Non-finite steps skipped over all runs: {skipped}. Total run time "
        f"{payload['seconds'] / 60:.1f} min on {payload['cpu_count']} CPU cores.",
        "",
        "Produced by: " + "; ".join(f"`{c}`" for c in commands) + ".",
    ]
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = list(payload["settings"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.6), squeeze=False)
    for ax, task_name in zip(axes[0], tasks, strict=True):
        task = TASKS[task_name]
        task_runs = [r for r in payload["runs"] if r["task"] == task_name]
        lines = [
            (recipe, variant)
            for recipe in payload.get("recipes") or ["base"]
            for variant in payload["variants"]
        ]
        for i, (recipe, variant) in enumerate(lines):
            runs = [r for r in task_runs if r["variant"] == variant and _recipe(r) == recipe]
            if not runs or len({len(r["curves"]["eval_step"]) for r in runs}) != 1:
                continue
            steps = runs[0]["curves"]["eval_step"]
            values = np.array([r["curves"]["eval_metric"] for r in runs])
            style = "--" if variant in ("dense", "none") else "-"
            ax.plot(
                steps,
                values.mean(0),
                style,
                marker=".",
                ms=4,
                lw=1.6,
                color=plt.get_cmap("tab20")(i % 20),
                label=variant if recipe == "base" else f"{variant} ({recipe})",
            )
            if len(runs) > 1:
                color = plt.get_cmap("tab20")(i % 20)
                ax.fill_between(steps, values.min(0), values.max(0), color=color, alpha=0.12)
        seeds = len({r["seed"] for r in task_runs})
        band = ", band = min–max over seeds" if seeds > 1 else ""
        unit = task.metric.unit
        ax.set_title(f"{task_name}: eval {unit}, mean of {seeds} seed(s){band}", fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel(f"eval {unit}")
        finals = [r["final"] for r in task_runs]
        if finals:  # zoom on the end of training, where the variants differ
            lo, hi = min(finals), max(finals)
            if task.metric.higher_is_better:
                pad = max(hi - lo, 0.02 * abs(hi))
                ax.set_ylim(max(lo - 2 * pad, 0.0), min(hi + pad, task.metric.scale + 0.5))
            else:
                ax.set_yscale("log")
                pad = max(hi - lo, 0.05 * abs(hi))
                ax.set_ylim(max(lo - pad, 1.0), hi + 3 * pad)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def frontier_points(payload: dict[str, Any]) -> dict[tuple[str, str], list[tuple]]:
    """Per (task, recipe): ``(variant, residual bytes / EF's, mean final / dense's mean)``
    for each summary row that keeps residuals, from the payload's summary."""
    points: dict[tuple[str, str], list[tuple]] = {}
    for row in payload["summary"]:
        if row["over_dense"] is None or not row["ef_residual_bytes"] or not row["residual_bytes"]:
            continue
        if row["variant"] in ("dense", "none"):
            continue
        ratio = row["residual_bytes"] / row["ef_residual_bytes"]
        key = (row["task"], row.get("recipe", "base"))
        points.setdefault(key, []).append((row["variant"], ratio, row["over_dense"]))
    return points


def plot_frontier(payload: dict[str, Any], path: str) -> bool:
    """The memory-accuracy frontier: one panel per (task, recipe), residual bytes against
    float32 EF's on a log axis, final metric over dense's; one point per store and format.
    Returns whether there was anything to plot."""
    points = frontier_points(payload)
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(points))
    rows_of_panels = -(-len(points) // cols)
    fig, axes = plt.subplots(
        rows_of_panels, cols, figsize=(5.5 * cols, 4.4 * rows_of_panels), squeeze=False
    )
    for ax in axes.flat[len(points) :]:
        ax.set_visible(False)
    markers = dict(zip(STORES, "os^D", strict=True))
    for ax, ((task_name, recipe), rows) in zip(axes.flat, points.items(), strict=False):
        for variant, ratio, over in rows:
            store = next(
                (s for s in sorted(STORES, key=len, reverse=True) if variant.startswith(s)),
                variant,
            )
            ax.scatter(ratio, over, marker=markers.get(store, "x"), s=36)
            ax.annotate(variant, (ratio, over), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("residual bytes / float32 EF's (log)")
        unit = TASKS[task_name].metric.unit
        ax.set_ylabel(f"final {unit} / dense's")
        ax.set_title(f"{task_name} ({recipe})", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def merge_payloads(before: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """``now``'s runs added to ``before``'s; a (task, variant, seed) run again replaces the old.

    Lets a long benchmark grow one task at a time without retraining the others: settings,
    variants and commands are united, the summary is recomputed from every kept run.
    ``complete`` is ``now``'s: every kept run finished, and the runs an earlier interrupted
    command did not reach are rows with fewer seeds (or none), as the table shows.
    """

    def key(r):
        return (r["task"], _recipe(r), r["variant"], r["seed"])

    fresh = {key(r) for r in now["runs"]}
    runs = [r for r in before["runs"] if key(r) not in fresh]
    runs += now["runs"]
    settings = {**before["settings"], **now["settings"]}
    tasks = [t for t in TASKS if t in settings]
    variants = [v for v in VARIANTS if v in set(before["variants"]) | set(now["variants"])]
    both = set(before.get("recipes") or ["base"]) | set(now.get("recipes") or ["base"])
    recipes = [r for r in RECIPES if r in both]
    commands = [*before.get("commands", [before["command"]]), now["command"]]
    return {
        **now,
        "command": commands[-1],
        "commands": commands,
        "overrides": {**before.get("overrides", {}), **now["overrides"]},
        "notes": [*before.get("notes", []), *now.get("notes", [])],
        "variants": variants,
        "recipes": recipes,
        "complete": now["complete"],
        "settings": {t: settings[t] for t in tasks},
        "seconds": before["seconds"] + now["seconds"],
        "summary": summarize(runs, tasks, variants, recipes),
        "runs": runs,
    }


def write_outputs(payload: dict[str, Any], out: str) -> None:
    """Writes ``accuracy.{json,md,png}`` under ``out`` and prints the table."""
    write_results("accuracy", payload, markdown(payload), out, indent=1)
    plot(payload, os.path.join(out, "accuracy.png"))
    plot_frontier(payload, os.path.join(out, "frontier.png"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=["base"],
        choices=list(RECIPES),
        help="remedies applied on top of each task's config (module docstring)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds per variant (default: 3 for digits, 2 for byte_gpt)",
    )
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="run seeds first_seed, first_seed + 1, ... (to add seeds with --merge)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps (default: per task, see TASKS)"
    )
    parser.add_argument(
        "--set",
        dest="extra",
        action="append",
        type=parse_assignment,
        default=[],
        metavar="KEY=VALUE",
        help="config override applied to every run of every task, e.g. compression.density=0.05",
    )
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--from-json",
        metavar="PATH",
        help="rewrite the table and figure from an earlier accuracy.json, without training",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="add to the accuracy.json under --out instead of replacing it (a task, variant "
        "and seed run again replaces its earlier run)",
    )
    parser.add_argument(
        "--supersede",
        action="store_true",
        help="with --merge: drop the earlier runs of a task that do not compare with this "
        "command's (another step count, or fine-tuned from another pre-trained model than "
        "this machine's) instead of refusing to merge",
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep each run's log (printed at the end)"
    )
    args = parser.parse_args(argv)
    if args.seeds is not None and args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    extra = dict(args.extra)
    if args.from_json:
        with open(args.from_json) as f:
            payload = json.load(f)
        payload["summary"] = summarize(
            payload["runs"],
            list(payload["settings"]),
            payload["variants"],
            payload.get("recipes") or ["base"],
        )
        write_outputs(payload, args.out)
        return

    from resireduce_jax import runtime

    runtime.configure_cpu(NUM_WORKERS)
    from tqdm.auto import tqdm

    settings = {}
    for task_name in args.tasks:  # validate every config before the first run trains
        from train import config_schema

        for recipe in args.recipes:
            for variant in args.variants:
                if applicable(TASKS[task_name], recipe, variant):
                    config = build_config(TASKS[task_name], variant, 0, args.steps, extra, recipe)
                    config_schema.validate(config)
        config = build_config(TASKS[task_name], "ef", 0, args.steps, extra)
        settings[task_name] = setting(task_name, config)

    jobs = [
        (task_name, recipe, variant, seed)
        for task_name in args.tasks
        for seed in range(
            args.first_seed, args.first_seed + (args.seeds or TASKS[task_name].default_seeds)
        )
        for recipe in args.recipes
        for variant in args.variants
        if applicable(TASKS[task_name], recipe, variant)
    ]
    digests = {}
    for task_name in args.tasks:  # pre-trains (once per machine) before the first run
        if TASKS[task_name].pretrain is not None:
            digests[task_name] = pretrained_digest(pretrained(TASKS[task_name]))
            settings[task_name]["pretrained_digest"] = digests[task_name]
    previous = os.path.join(args.out, "accuracy.json")
    before = None
    if args.merge and os.path.exists(previous):
        with open(previous) as f:
            before = json.load(f)
        steps = {t: settings[t]["steps"] for t in args.tasks}
        for task_name, stale in incomparable_runs(before, steps, digests).items():
            fine_tuned = task_name in digests
            groups = collections.Counter(
                (r.get("steps"), r.get("pretrained_digest", "unrecorded") if fine_tuned else "")
                for r in stale
            )
            was = ", ".join(
                f"{n} at {s} steps" + (f" from pre-trained model {d}" if d else "")
                for (s, d), n in sorted(groups.items(), key=str)
            )
            now = f"{steps[task_name]} steps" + (
                f" from pre-trained model {digests[task_name]}" if fine_tuned else ""
            )
            message = (
                f"{previous} holds {len(stale)} {task_name} runs that do not compare with "
                f"this command's ({now}): {was}"
                + ("; another machine's XLA numerics pre-train another model" if fine_tuned else "")
            )
            if not args.supersede:
                parser.error(
                    message + ". Rerun every row of the task with --supersede (drops them), "
                    "match their --steps, or write to another --out."
                )
            print(message + ": dropped (--supersede).", file=sys.stderr, flush=True)
            before["runs"] = [r for r in before["runs"] if r not in stale]
    command = "python benchmarks/accuracy.py " + " ".join(argv or sys.argv[1:])
    overrides = {k: v if isinstance(v, int | float | str) else repr(v) for k, v in extra.items()}
    runs: list[dict[str, Any]] = []
    start = time.perf_counter()

    def results(complete: bool) -> dict[str, Any]:
        payload = {
            **environment(),
            "command": command,
            "overrides": overrides,
            "variants": args.variants,
            "recipes": args.recipes,
            "complete": complete,
            "settings": settings,
            "seconds": time.perf_counter() - start,
            "summary": summarize(runs, args.tasks, args.variants, args.recipes),
            "runs": runs,
        }
        return merge_payloads(before, payload) if before is not None else payload

    scratch = tempfile.mkdtemp(prefix="rr_accuracy_")
    bar = tqdm(jobs, desc="runs", unit="run", file=sys.stderr, dynamic_ncols=True)
    finished = False
    interrupted = ""
    try:
        for task_name, recipe, variant, seed in bar:
            bar.set_postfix_str(f"{task_name} {recipe} {variant} seed {seed}")
            record = train_one(task_name, variant, seed, args.steps, extra, scratch, recipe)
            runs.append(record)
            bar.write(
                f"{task_name:9s} {recipe:12s} {variant:10s} seed {seed}: "
                f"{TASKS[task_name].metric.unit} {record['final']:.3f}  "
                f"({record['seconds']:.0f} s, "
                f"{record['skipped_steps']} skipped, sent "
                f"{record['bytes_sent'] / record['dense_bytes']:.2%} of dense)"
            )
            if args.merge:  # a long merged run keeps what it has finished
                partial = results(False)
                write_results(
                    "accuracy", partial, markdown(partial), args.out, indent=1, echo=False
                )
        finished = True
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM seen by the training program
        interrupted = str(stop) or "interrupted"
    finally:
        bar.close()
        if args.keep_logs or not finished:
            print(f"Run logs kept in {scratch}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    if interrupted:
        print(
            f"Stopped early ({interrupted}): writing the {len(runs)} finished runs.",
            file=sys.stderr,
        )
    write_outputs(results(finished), args.out)
    if interrupted:
        sys.exit(130)
    if any(not math.isfinite(r["final"]) for r in runs):
        print("Warning: some runs ended with a non-finite metric.", file=sys.stderr)


if __name__ == "__main__":
    main()
