"""Step time of ResiReduce w+2d vs plain error feedback, measured in the same process.

The training program's steps (``train/compiled_step.py``) over 8 simulated CPU workers,
compiled and warmed up, then timed in interleaved (ABBA) repetitions; reported: median
seconds per step, the ratio of the medians and its interquartile range. How to read the
figures: ``benchmarks/results/step_time.md``.

Writes ``benchmarks/results/step_time.{json,md}``. Usage::

    python benchmarks/step_time.py                     # three models, about 10 min on 2 cores
    python benchmarks/step_time.py --models resnet50 --repeats 5
    python benchmarks/step_time.py --weight-update-order   # the config's variant, the step's
                                                           # default order vs "unordered"
    python benchmarks/step_time.py --backward-order        # streamed vs "free"
    python benchmarks/step_time.py --selection-scope       # EF: whole-model vs per-leaf Top-k
    python benchmarks/step_time.py --from-json [--backward-order]   # re-render the markdown

``--weight-update-order`` writes ``step_time_order.{json,md}`` instead: the config's variant
with ``data_parallel_step``'s default ``weight_update_order="last_read"`` (each weight
updated in place after its last read) against ``"unordered"`` (XLA copies the weights).
``--backward-order`` writes ``step_time_backward.{json,md}``: the default
``backward_order="streamed"`` (the backward pass waits for each weight gradient whose
inputs outweigh it) against ``"free"`` (XLA's own order). ``--selection-scope`` writes
``step_time_scope.{json,md}``: error feedback with ``compression.selection_scope="global"``
(whole-model Top-k) against ``"leaf"``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, NamedTuple

from common import (
    NUM_WORKERS,
    VGG19,
    Case,
    add_output_arguments,
    environment,
    guard_name,
    rerender,
    write_results,
)

CASES: dict[str, Case] = {
    "resnet50": Case(
        "resnet50_cifar100",
        {"width": 16},
        batch_per_worker=8,
        description="ResNet-50 (16 bottlenecks), width 16, 8 images/worker",
    ),
    "vgg19": VGG19,
    "gpt2": Case(
        "gpt2_medium_wikitext",
        {"num_layers": 6, "width": 256, "num_heads": 4, "vocab_size": 8192, "max_len": 128},
        batch_per_worker=2,
        seq_len=128,
        description="GPT-2 (medium config's rules and AdamW), 6 blocks of width 256, "
        "vocab 8192, 2x128 tokens/worker",
    ),
}


class Comparison(NamedTuple):
    """Two values of one ``data_parallel_step`` argument (or ``compression`` config key),
    timed on the config's variant (or ``variant``)."""

    keyword: str  # the argument
    baseline: str  # timed first, the ratio's denominator
    default: str  # the step's default (the value compared with the baseline)
    output: str  # results file stem under benchmarks/results/
    title: str
    about: str  # what the two values do, for the table's heading
    setting: bool = False  # keyword is a key of config.compression, not a step argument
    variant: str | None = None  # the variant timed (None: the config's)


COMPARISONS: dict[str, Comparison] = {
    "weight_update_order": Comparison(
        "weight_update_order",
        "unordered",
        "last_read",
        "step_time_order",
        "the weight-update order",
        'the step\'s default ``weight_update_order="last_read"`` (each weight updated in '
        'place once the backward pass has read it) against ``"unordered"`` (XLA copies each '
        "weight instead)",
    ),
    "backward_order": Comparison(
        "backward_order",
        "free",
        "streamed",
        "step_time_backward",
        "the backward-pass order",
        'the step\'s default ``backward_order="streamed"`` (the backward pass waits for each '
        "weight gradient whose inputs outweigh it, through optimization barriers) against "
        '``"free"`` (XLA\'s scheduler orders the backward pass alone)',
    ),
    "selection_scope": Comparison(
        "selection_scope",
        "leaf",
        "global",
        "step_time_scope",
        "whole-model Top-k",
        'error feedback with ``compression.selection_scope="global"`` (one selection over '
        "every compressed leaf: a threshold searched for by counts over every leaf from a "
        "sampled bracket, then each leaf compacted) against "
        '``"leaf"`` (each leaf\'s own Top-k)',
        setting=True,
        variant="ef",
    ),
}


def _batch(model_config, rows: int, seq_len: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    if model_config.task == "classification":
        size = model_config.image_size
        return {
            "image": rng.standard_normal((rows, size, size, model_config.num_channels), np.float32),
            "label": rng.integers(0, model_config.num_classes, rows, dtype=np.int32),
        }
    if model_config.task == "causal_lm":
        return {"tokens": rng.integers(0, model_config.vocab_size, (rows, seq_len + 1), np.int32)}
    raise ValueError(f"no synthetic batch for task {model_config.task!r}")


class Runner:
    """The initialized state and jitted step of ``task`` trained with ``config`` on
    ``num_workers`` workers (default ``NUM_WORKERS`` CPU workers), on one synthetic batch;
    ``run(n)`` times ``n`` steps.

    ``guard``: the default non-finite guard, or none. ``options``: arguments of the step
    (``data_parallel_step``'s ``weight_update_order``, ``backward_order``).
    """

    def __init__(
        self,
        task,
        config,
        batch_per_worker: int,
        seq_len: int = 0,
        *,
        guard: bool = True,
        options: dict[str, str] | None = None,
        num_workers: int = NUM_WORKERS,
    ):
        import jax

        import resireduce_jax as rr
        from train import compiled_step

        mesh = compiled_step.build_mesh(config, num_workers)  # flat, or nodes x local
        tx = compiled_step.build_train_tx(config, 100.0, 10_000, guard=guard)
        self.step = compiled_step.build_step(task, tx, mesh, **(options or {}))
        batch = _batch(task.model_config, num_workers * batch_per_worker, seq_len, seed=0)
        per_worker = {k: v[:batch_per_worker] for k, v in batch.items()}
        variables = dict(jax.jit(task.init)(jax.random.PRNGKey(0), per_worker))
        params = variables.pop("params")
        self.model_state = rr.parallel.replicated(variables, mesh)
        self.params, self.opt_state = self.step.init(params)
        self.batch = rr.parallel.shard_batch(batch, mesh)  # over every mesh axis
        self.key = jax.random.PRNGKey(1)
        self.count = 0
        self.loss = float("nan")

    @classmethod
    def of_variant(
        cls,
        case: Case,
        variant: str,
        guard: bool,
        config=None,
        options: dict[str, str] | None = None,
        num_workers: int = NUM_WORKERS,
    ) -> Runner:
        """A case's model with residual ``variant`` (``config``: the case's config with
        other settings, default ``case.load()``) on ``num_workers`` workers."""
        from train import compiled_step

        config = compiled_step.with_variant(config or case.load(), variant)
        task = compiled_step.build_task(config)
        return cls(
            task,
            config,
            case.batch_per_worker,
            case.seq_len,
            guard=guard,
            options=options,
            num_workers=num_workers,
        )

    def run(self, steps: int) -> float:
        import jax

        start = time.perf_counter()
        for _ in range(steps):
            rng = jax.random.fold_in(self.key, self.count)
            self.params, self.opt_state, self.model_state, metrics = self.step(
                self.params, self.opt_state, self.model_state, self.batch, rng
            )
            self.count += 1
        jax.block_until_ready((self.params, self.opt_state, metrics))
        elapsed = time.perf_counter() - start
        self.loss = float(metrics["loss"])
        return elapsed / steps


def measure(
    name: str,
    case: Case,
    *,
    guard: bool,
    repeats: int,
    steps: int,
    compare: Comparison | None = None,
) -> dict[str, Any]:
    """EF against the config's variant, or with ``compare`` the config's variant under the
    comparison's baseline value (reported as "ef" / baseline) against its default."""
    variant = (compare and compare.variant) or case.load().compression.variant
    if compare is None:
        runs = {"ef": ("ef", {}, {}), variant: (variant, {}, {})}
    else:
        runs = {
            value: (
                variant,
                {} if compare.setting else {compare.keyword: value},
                {compare.keyword: value} if compare.setting else {},
            )
            for value in (compare.baseline, compare.default)
        }
    labels = tuple(runs)
    start = time.perf_counter()
    runners = {}
    for label, (v, options, settings) in runs.items():
        config = case.load()
        config.compression.update(settings)
        runners[label] = Runner.of_variant(case, v, guard, config=config, options=options)
    for runner in runners.values():  # compile, then warm up
        runner.run(1)
        runner.run(steps)
    setup = time.perf_counter() - start
    times: dict[str, list[float]] = {label: [] for label in labels}
    for rep in range(repeats):
        for label in labels if rep % 2 == 0 else labels[::-1]:  # ABBA
            times[label].append(runners[label].run(steps))
    base, other = times[labels[0]], times[labels[1]]
    ratios = sorted(r / e for r, e in zip(other, base, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {
        "model": name,
        "description": case.description,
        "variant": variant,
        "compared": None if compare is None else compare.keyword,
        "orders": None if compare is None else [compare.baseline, compare.default],
        "guard": guard,
        "repeats": repeats,
        "steps_per_repeat": steps,
        "seconds_per_step": times,
        "median_ef": statistics.median(base),
        "median_reduced": statistics.median(other),
        "ratio_of_medians": statistics.median(other) / statistics.median(base),
        "ratio_quartiles": [q[0], q[2]],
        "final_loss": {label: r.loss for label, r in runners.items()},
        "setup_seconds": setup,
    }


def markdown(results: list[dict[str, Any]], compare: Comparison | None = None) -> str:
    """The table: EF against the variant, or the two values of ``compare``."""
    if compare is not None:
        lines = [
            f"# Step time: {compare.title} (same process, interleaved)",
            "",
            f"The config's variant with {compare.about}. 8 simulated CPU workers sharing the "
            "machine's cores. Medians over the repetitions; the ratio's quartiles are over "
            "per-repetition ratios.",
            "",
            f"| model | variant | guard | {compare.baseline} s/step | {compare.default} s/step "
            "| ratio | ratio IQR | repeats x steps |",
            "|---|---|---|---:|---:|---:|---:|---:|",
        ]
    else:
        lines = [
            "# Step time: ResiReduce w+2d vs plain EF (same process, interleaved)",
            "",
            "8 simulated CPU workers on one machine (they share its cores: this measures "
            "computation, not communication). Medians over the repetitions; the ratio's "
            "quartiles are over per-repetition ratios. Goal: ratio <= 1.05 (the paper: "
            "<= 1.02 on GPUs).",
            "",
            "| model | guard | EF s/step | w+2d s/step | ratio | ratio IQR | repeats x steps |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
    for r in results:
        lo, hi = r["ratio_quartiles"]
        variant = f" {r['variant']} |" if compare else ""
        lines.append(
            f"| {r['model']} |{variant} {guard_name(r['guard'])} "
            f"| {r['median_ef']:.3f} | {r['median_reduced']:.3f} | {r['ratio_of_medians']:.3f} "
            f"| {lo:.3f}–{hi:.3f} | {r['repeats']} x {r['steps_per_repeat']} |"
        )
    lines += ["", "Models:", ""]
    lines += [f"* {r['model']}: {r['description']}" for r in results]
    if compare is None:
        lines += ["", "<!-- prose: about -->"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed repetition")
    parser.add_argument("--no-guard", action="store_true", help="leave out skip_nonfinite")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--weight-update-order",
        action="store_true",
        help='time the default weight-update order against "unordered" instead',
    )
    which.add_argument(
        "--backward-order",
        action="store_true",
        help='time the streamed backward pass against "free" instead',
    )
    which.add_argument(
        "--selection-scope",
        action="store_true",
        help="time error feedback with whole-model Top-k against per-leaf Top-k instead",
    )
    add_output_arguments(parser)
    args = parser.parse_args(argv)

    compare = None
    if args.weight_update_order:
        compare = COMPARISONS["weight_update_order"]
    elif args.backward_order:
        compare = COMPARISONS["backward_order"]
    elif args.selection_scope:
        compare = COMPARISONS["selection_scope"]
    name = compare.output if compare else "step_time"
    if args.from_json:
        rerender(name, lambda results: markdown(results, compare), args.out, key="results")
        return

    from resireduce_jax import runtime

    runtime.configure_cpu(NUM_WORKERS)
    results = []
    for model in args.models:
        r = measure(
            model,
            CASES[model],
            guard=not args.no_guard,
            repeats=args.repeats,
            steps=args.steps,
            compare=compare,
        )
        results.append(r)
        first, second = (compare.baseline, compare.default) if compare else ("EF", r["variant"])
        print(
            f"{model:10s} {first} {r['median_ef']:.3f} s  {second} {r['median_reduced']:.3f} s  "
            f"ratio {r['ratio_of_medians']:.3f}",
            flush=True,
        )
    payload = environment(num_workers=NUM_WORKERS, results=results)
    write_results(name, payload, markdown(results, compare), args.out)


if __name__ == "__main__":
    main()
