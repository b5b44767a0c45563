"""Model states per parameter per worker of the byte GPT: this library's layouts against
1-bit Adam's and 8-bit Adam's.

Every layout trains the byte GPT of ``configs/byte_gpt.py`` with Adam in float32 on 8
workers. The library's rows are the training program's own states (the optax chain each
config builds, its ``init`` traced per worker: exact bytes, nothing allocated). The two
reference rows are arithmetic over the same parameter leaves:

* **1-bit Adam** (Tang et al., ICML 2021, §4; DeepSpeed's ``OnebitAdam``): ``exp_avg``
  and ``exp_avg_sq`` in float32, a float32 ``worker_error`` of each parameter's size and a
  ``server_error`` of ``1/N`` of it (the worker's chunk of the compressed all-reduce);
  the padding of each tensor to a multiple of ``N`` is left out.
* **8-bit Adam** (Dettmers et al., ICLR 2022, §2; bitsandbytes): both moments as one-byte
  codes with a float32 absmax per 256 values, tensors under 4,096 values in float32; its
  gradients travel in a dense all-reduce.

    python benchmarks/model_states.py               # benchmarks/results/model_states.md
    python benchmarks/model_states.py --from-json   # re-render the markdown
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (
    NUM_WORKERS,
    add_output_arguments,
    environment,
    load_config,
    rerender,
    set_dotted,
    write_results,
)

__all__ = ["LAYOUTS", "eight_bit_adam", "main", "measure", "one_bit_adam"]

_TWO_BUFFERS = {
    "optimizer.one_buffer": "off",
    "optimizer.frozen_nu_format": "float32",
    "compression.residual_format": "",
}
# name: (description, config keys over configs/byte_gpt.py)
LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw": (
        "AdamW, dense all-reduce",
        {"optimizer.name": "adamw", "compression.variant": "dense", **_TWO_BUFFERS},
    ),
    "adamw_ef": (
        "AdamW with error feedback (float32 residual)",
        {"optimizer.name": "adamw", "compression.variant": "ef", **_TWO_BUFFERS},
    ),
    "cm_ef": (
        "compressed-momentum Adam, error feedback, two buffers in float32",
        {"compression.variant": "ef", **_TWO_BUFFERS},
    ),
    "cm_w2d": (
        "compressed-momentum Adam, ResiReduce w+2d, two buffers in float32",
        {"compression.variant": "w+2d", **_TWO_BUFFERS},
    ),
    "shipped": ("configs/byte_gpt.py as shipped", {}),
}
BNB_BLOCK = 256  # bitsandbytes' block of values per absmax
BNB_MIN_SIZE = 4096  # bitsandbytes keeps smaller tensors in 32 bits


def one_bit_adam(sizes: list[int], num_workers: int) -> dict[str, float]:
    """DeepSpeed's 1-bit Adam state bytes over leaves of ``sizes`` values (float32)."""
    n = sum(sizes)
    return {
        "params": 4 * n,
        "grads": 4 * n,
        "optimizer": 8 * n,  # exp_avg, exp_avg_sq
        "residuals": 4 * n + 4 * n / num_workers,  # worker_error, server_error
    }


def eight_bit_adam(sizes: list[int]) -> dict[str, float]:
    """bitsandbytes' 8-bit Adam state bytes over leaves of ``sizes`` values."""

    def moments(size: int) -> float:
        if size < BNB_MIN_SIZE:
            return 8 * size
        return 2 * (size + 4 * math.ceil(size / BNB_BLOCK))

    n = sum(sizes)
    return {"params": 4 * n, "grads": 4 * n, "optimizer": sum(map(moments, sizes)), "residuals": 0}


def measure() -> dict[str, Any]:
    """Every layout's bytes per worker and per parameter."""
    import jax

    from train import compiled_step, train

    rows = []
    abstract = None  # the parameters: the same model in every layout
    for name, (description, changes) in LAYOUTS.items():
        config = load_config("byte_gpt")
        for key, value in changes.items():
            set_dotted(config, key, value)
        run = train.build_run(config)
        if abstract is None:
            batch = run.dataset.train_batch(0, run.global_batch, 0, 1)
            batch = {k: v[: config.batch_size_per_worker] for k, v in batch.items()}
            abstract = jax.eval_shape(run.task.init, jax.random.PRNGKey(0), batch)["params"]
        states = compiled_step.state_bytes(abstract, run.tx, run.mesh)
        rows.append({"layout": name, "description": description, **_row(states.as_dict())})
    sizes = [math.prod(x.shape) for x in jax.tree.leaves(abstract)]
    rows.append(
        {
            "layout": "one_bit_adam",
            "description": f"1-bit Adam (DeepSpeed's OnebitAdam), {NUM_WORKERS} workers",
            **_row(one_bit_adam(sizes, NUM_WORKERS)),
        }
    )
    rows.append(
        {
            "layout": "eight_bit_adam",
            "description": "8-bit Adam (bitsandbytes), dense all-reduce",
            **_row(eight_bit_adam(sizes)),
        }
    )
    n = sum(sizes)
    for row in rows:
        row["per_parameter"] = {k: v / n for k, v in row["bytes"].items()}
    return {"parameters": n, "rows": rows}


def _row(found: dict[str, float]) -> dict[str, Any]:
    kinds = ("params", "grads", "optimizer", "residuals")
    parts = {k: float(found.get(k, 0)) for k in kinds}
    return {"bytes": {**parts, "total": sum(parts.values())}}


def markdown(payload: dict[str, Any]) -> str:
    lines = [
        "# Model states per parameter per worker, byte GPT",
        "",
        f"Bytes per parameter of one worker ({payload['parameters']:,} parameters, "
        f"{NUM_WORKERS} workers, float32): the library's layouts as the training program "
        "builds them, 1-bit Adam's and 8-bit Adam's by arithmetic over the same leaves "
        "(`benchmarks/model_states.py`'s docstring).",
        "",
        "| layout | params | grads | optimizer | residuals | optimizer + residuals | total |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in payload["rows"]:
        p = row["per_parameter"]
        lines.append(
            f"| {row['description']} | {p['params']:.2f} | {p['grads']:.2f} "
            f"| {p['optimizer']:.2f} | {p['residuals']:.2f} "
            f"| {p['optimizer'] + p['residuals']:.2f} | {p['total']:.2f} |"
        )
    lines += ["", "<!-- prose: notes -->", ""]
    lines.append(f"Produced by: `{payload['command']}`.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.from_json:
        rerender("model_states", markdown, args.out)
        return

    from resireduce_jax import runtime

    runtime.configure_cpu(NUM_WORKERS)
    command = " ".join(["python benchmarks/model_states.py", *(argv or sys.argv[1:])])
    payload = {**environment(), "command": command, **measure()}
    write_results("model_states", payload, markdown(payload), args.out)


if __name__ == "__main__":
    main()
