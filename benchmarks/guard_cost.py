"""What the non-finite guard costs at the compiled peak, per optimizer and guard mode.

Three models that no paper config uses (so no config was tuned to them): a 6-block
transformer-like stack with a tied 8192x512 embedding (4 x 64 tokens per worker), a
6-layer convolutional stack (32x32x3 images, 16 per worker) and a wide MLP (eight
2048x2048 layers, 32 examples per worker), where gradients, not activations, fill the
step's memory. For each, 8 simulated CPU workers, Top-k 1 %, the jitted donated
``rr.parallel.data_parallel_step``, EF and w+2d, compiled (abstract shapes, nothing
allocated) without the guard, without it but with
``weight_update_order="all_gradients"`` (every weight update ordered after the last
gradient: what any step-wide decision imposes), and
with ``rr.skip_nonfinite`` in its three modes (loss, the default; strict; lean). Reports
``peak = argument + output - alias + temp`` per worker, each variant's cost relative to
the unguarded peak, and ResiReduce's peak drop against its residual-state saving.

Usage::

    python benchmarks/guard_cost.py            # about 15 minutes on 2 cores
    python benchmarks/guard_cost.py --optimizers adan_r --merge   # re-run some rows only
    python benchmarks/guard_cost.py --from-json   # re-render the markdown
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import common
from common import MiB, add_output_arguments, environment, rerender, write_results

OPTIMIZERS = ("optax.sgd", "sgd", "optax.adamw", "adamw_r", "optax.lion", "lion_r", "adan_r")
GUARDS = ("none", "ordered", "loss", "strict", "lean")


def transformer_model(vocab=8192, width=512, depth=6, tokens=64, batch=4):
    """Tied-embedding transformer-like stack: (param shapes, loss, batch shapes)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    shapes = {"embed": {"embedding": (vocab, width)}}
    for i in range(depth):
        shapes[f"block_{i}"] = {
            "qkv": {"kernel": (width, 3 * width)},
            "proj": {"kernel": (width, width)},
            "fc1": {"kernel": (width, 4 * width)},
            "fc2": {"kernel": (4 * width, width)},
            "ln": {"scale": (width,)},
        }

    def loss(params, batch_):
        x = params["embed"]["embedding"][batch_["tokens"]]
        for i in range(depth):
            b = params[f"block_{i}"]
            h = x * b["ln"]["scale"]
            q, k, v = jnp.split(h @ b["qkv"]["kernel"], 3, axis=-1)
            att = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / np.sqrt(width), axis=-1)
            x = x + (att @ v) @ b["proj"]["kernel"]
            x = x + jax.nn.gelu(x @ b["fc1"]["kernel"]) @ b["fc2"]["kernel"]
        logits = x @ params["embed"]["embedding"].T
        picked = jnp.take_along_axis(logits, batch_["tokens"][..., None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)

    batch_shape = {"tokens": ((batch, tokens), jnp.int32)}
    return shapes, loss, batch_shape


def conv_model(channels=(3, 64, 64, 128, 128, 256, 256), batch=16, remat=False):
    """Conv stack on 32x32x3 images, max-pool every second layer: (shapes, loss, batch).

    ``remat``: every layer under ``jax.checkpoint`` (as ``nn.remat`` would put it)."""
    import jax
    import jax.numpy as jnp

    shapes = {
        f"conv_{i}": {"kernel": (3, 3, channels[i], channels[i + 1]), "bias": (channels[i + 1],)}
        for i in range(len(channels) - 1)
    }
    side = 32 // 2 ** ((len(channels) - 1) // 2)
    shapes["head"] = {"kernel": (channels[-1] * side * side, 100)}

    def layer(p, x, pool):
        x = jax.lax.conv_general_dilated(
            x, p["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        x = jax.nn.relu(x + p["bias"])
        if pool:
            x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return x

    if remat:
        layer = jax.checkpoint(layer, static_argnums=(2,))

    def loss(params, batch_):
        x = batch_["image"]
        for i in range(len(channels) - 1):
            x = layer(params[f"conv_{i}"], x, i % 2 == 1)
        logits = x.reshape(x.shape[0], -1) @ params["head"]["kernel"]
        labels = batch_["label"]
        picked = jnp.take_along_axis(logits, labels[:, None], -1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)

    batch_shape = {"image": ((batch, 32, 32, 3), jnp.float32), "label": ((batch,), jnp.int32)}
    return shapes, loss, batch_shape


def mlp_model(width=2048, depth=8, batch=32, features=784, classes=1000):
    """Wide ReLU MLP on flat inputs, little activation memory: (shapes, loss, batch)."""
    import jax
    import jax.numpy as jnp

    shapes = {"input": {"kernel": (features, width)}, "head": {"kernel": (width, classes)}}
    for i in range(depth):
        shapes[f"dense_{i}"] = {"kernel": (width, width), "bias": (width,)}

    def loss(params, batch_):
        x = jax.nn.relu(batch_["x"] @ params["input"]["kernel"])
        for i in range(depth):
            p = params[f"dense_{i}"]
            x = jax.nn.relu(x @ p["kernel"] + p["bias"])
        logits = x @ params["head"]["kernel"]
        picked = jnp.take_along_axis(logits, batch_["label"][:, None], -1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)

    batch_shape = {"x": ((batch, features), jnp.float32), "label": ((batch,), jnp.int32)}
    return shapes, loss, batch_shape


MODELS = {"transformer": transformer_model, "conv": conv_model, "mlp": mlp_model}


def optimizer(name: str):
    import optax

    import resireduce_jax as rr

    return {
        "optax.sgd": lambda: optax.sgd(0.1, momentum=0.9),
        "sgd": lambda: rr.optimizers.sgd(0.1, momentum=0.9),
        "optax.adamw": lambda: optax.adamw(1e-3),
        "adamw_r": lambda: rr.adamw_r(1e-3),
        "optax.lion": lambda: optax.lion(1e-4),
        "lion_r": lambda: rr.lion_r(1e-4),
        "adan_r": lambda: rr.adan_r(1e-3),
    }[name]()


def compile_peak(
    model: str,
    variant: str,
    opt: str,
    guard: str,
    *,
    keep_hlo: bool = False,
    weight_update_order: str | None = None,
    backward_order: str = "streamed",
    **sizes: Any,
) -> dict[str, Any]:
    """Compiles one case (``sizes`` override the model's defaults); its per-worker peak.

    ``guard``: ``"none"``, ``"ordered"`` (no guard, ``weight_update_order="all_gradients"``),
    or a ``skip_nonfinite`` mode. ``keep_hlo``: also return the optimized HLO text under
    ``"hlo"``. ``weight_update_order``: passed to ``rr.parallel.data_parallel_step``
    (default: the step's own, or ``"all_gradients"`` for ``"ordered"``).
    """
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import resireduce_jax as rr

    shapes, loss, batch_shape = MODELS[model](**sizes)
    params = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, "float32"),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    topk = rr.compressors.topk(0.01)
    exchange = rr.error_feedback(topk) if variant == "ef" else rr.resireduce(topk)
    tx = optax.chain(exchange, optimizer(opt))
    if guard in rr.nonfinite.MODES:
        tx = rr.skip_nonfinite(tx, mode=guard)
    mesh = rr.parallel.make_mesh(8)
    if weight_update_order is None:
        weight_update_order = "all_gradients" if guard == "ordered" else "last_read"
    step = rr.parallel.data_parallel_step(
        loss, tx, mesh, weight_update_order=weight_update_order, backward_order=backward_order
    )
    step.state_specs, state = rr.parallel.abstract_state(tx, params, mesh)
    sharded = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), params
    )
    batch = {
        k: jax.ShapeDtypeStruct((8 * s[0], *s[1:]), d, sharding=NamedSharding(mesh, P("data")))
        for k, (s, d) in batch_shape.items()
    }
    start = time.perf_counter()
    compiled = step.lower(sharded, state, batch).compile()
    peak = rr.hlo.peak_memory(compiled)
    return {
        "model": model,
        "variant": variant,
        "optimizer": opt,
        "guard": guard,
        **peak.as_dict(),
        "residual_bytes": rr.memory.model_state_bytes(params, tx).residuals,
        "compile_seconds": time.perf_counter() - start,
        **({"hlo": compiled.as_text()} if keep_hlo else {}),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    by = {(r["model"], r["variant"], r["optimizer"], r["guard"]): r for r in rows}
    lines = [
        "# The non-finite guard at the compiled peak",
        "",
        "Peak per worker in MiB (cost of each guard mode relative to the unguarded peak); "
        "the models, the columns and the command are described below the tables.",
        "",
        "| model | variant | optimizer | no guard | no guard, all_gradients | loss (default) "
        "| strict | lean |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for model in MODELS:
        for variant in ("ef", "w+2d"):
            for opt in OPTIMIZERS:
                base = by.get((model, variant, opt, "none"))
                if base is None:
                    continue
                cells = [f"{base['peak'] / MiB:.1f}"]
                for guard in GUARDS[1:]:
                    r = by[(model, variant, opt, guard)]
                    cells.append(f"{r['peak'] / MiB:.1f} ({r['peak'] / base['peak'] - 1:+.1%})")
                lines.append(f"| {model} | {variant} | {opt} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "ResiReduce w+2d against EF: peak drop / residual-state saving.",
        "",
        "| model | optimizer | guard | state saving | peak drop | ratio |",
        "|---|---|---|---:|---:|---:|",
    ]
    for model in MODELS:
        for opt in OPTIMIZERS:
            for guard in GUARDS:
                ef, rr_ = by.get((model, "ef", opt, guard)), by.get((model, "w+2d", opt, guard))
                if ef is None or rr_ is None:
                    continue
                saving = ef["residual_bytes"] - rr_["residual_bytes"]
                drop = ef["peak"] - rr_["peak"]
                lines.append(
                    f"| {model} | {opt} | {guard} | {saving / MiB:.1f} | {drop / MiB:.1f} "
                    f"| {drop / saving:.2f} |"
                )
    lines += ["", "<!-- prose: about -->"]
    return "\n".join(lines) + "\n"


def merge_rows(before: list[dict[str, Any]], now: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``before`` with the rows of the cases in ``now`` replaced (a case: model, variant,
    optimizer, guard)."""
    return common.merge_rows(before, now, ("model", "variant", "optimizer", "guard"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    add_output_arguments(
        parser,
        merge_help="replace the rows compiled now in the earlier guard_cost.json, keep the others",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        rerender("guard_cost", markdown, args.out, key="rows")
        return

    from resireduce_jax import runtime

    runtime.configure_cpu(8)
    from tqdm import tqdm

    cases = [
        (m, v, o, g)
        for m in args.models
        for v in ("ef", "w+2d")
        for o in args.optimizers
        for g in GUARDS
    ]
    rows = [compile_peak(*case) for case in tqdm(cases, desc="compiling")]
    previous = Path(args.out) / "guard_cost.json"
    if args.merge and previous.exists():
        rows = merge_rows(json.loads(previous.read_text())["rows"], rows)
    payload = environment(
        num_workers=8,
        scheduler="xla_cpu memory-optimizing (concurrency_optimized_scheduler=false)",
        rows=rows,
    )
    write_results("guard_cost", payload, markdown(rows), args.out)


if __name__ == "__main__":
    main()
