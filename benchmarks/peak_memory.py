"""Residual variants vs plain EF at the compiled peak of the training program's train step.

Compiles (abstract shapes, nothing allocated) the donated 8-worker train step of
``train/compiled_step.py`` for each case and variant, with and without the
``skip_nonfinite`` guard, and reports per worker: peak and temp, the residual-state saving
against EF, the peak drop and their ratio, and every ``copy`` in the compiled step by
origin (layout transposes apart from real copies). ``--explain DIR`` also dumps each step
and lists what is alive at the peak. What the figures mean: ``results/peak_memory.md``.

    python benchmarks/peak_memory.py                       # all cases, both guards (long)
    python benchmarks/peak_memory.py --models resnet50 --guard plain --variants w+2d
    python benchmarks/peak_memory.py --models resnet50 --explain /tmp/rr_dump
    python benchmarks/peak_memory.py --models bert_base --guard guard \
        --optimizer compressed_momentum_adam --variants ef+f8 w+2d   # its compressed phase
    python benchmarks/peak_memory.py --models gpt2_medium --guard guard \
        --selection-scope global --variants w+2d   # whole-model Top-k, EF and w+2d
    python benchmarks/peak_memory.py --guard both --variants formats \
        --out benchmarks/results/peak_memory_formats   # EF's residual formats, w+2d+int4
    python benchmarks/peak_memory.py --models gpt2_medium bert_base --guard guard \
        --optimizer compressed_momentum_adam --variants ef ef+int4/128/nearest \
        --variant-set optimizer.one_buffer=on --variant-set optimizer.frozen_nu_format=int8 \
        --out benchmarks/results/peak_memory_one_buffer   # one buffer vs two-buffer EF
    python benchmarks/peak_memory.py --from-json           # re-render the markdown
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `common`, also when imported

from common import (
    NUM_WORKERS,
    RESULTS,
    ROOT,
    VGG19,
    Case,
    MiB,
    environment,
    guard_name,
    parse_assignment,
    rerender,
    set_dotted,
    write_results,
)

__all__ = [
    "CASES",
    "FORMAT_VARIANTS",
    "VARIANTS",
    "Case",
    "copies",
    "live_at_peak",
    "main",
    "measure",
]

CASES: dict[str, Case] = {
    "resnet50": Case(
        "resnet50_cifar100",
        {"width": 32},
        batch_per_worker=8,
        description="ResNet-50 (16 bottlenecks, CIFAR stem), width 32, 8 images/worker",
    ),
    "vgg19": VGG19,
    "gpt2_medium": Case(
        "gpt2_medium_wikitext",
        {"num_layers": 3},
        batch_per_worker=1,
        seq_len=128,
        description="GPT-2 medium width (1024, vocab 50257), 3 blocks, 1x128 tokens/worker",
    ),
    "bert_base": Case(
        "bert_base_squad",
        {"num_layers": 3, "seq_len": 128},
        batch_per_worker=2,
        seq_len=128,
        description="BERT-base width (768, vocab 30522), 3 layers (one residual group), "
        "2x128 tokens/worker",
    ),
}
# Compared against plain EF ("ef"); "+bf16": residuals stored in bfloat16, "+<format>" in a
# compression.residual_format ("+int8", "+float8", "+int4", "+int4/64/stochastic"; "+f8"
# is the legacy unscaled float8 cast): train/compiled_step.py's variant names.
CM_DENSE_FRACTION = 0.05  # a compressed-momentum optimizer's dense warm-up (byte_gpt's)
VARIANTS = ("a", "w", "2d", "w+2d", "w+2d+bf16")
FORMAT_VARIANTS = ("ef+bf16", "ef+int8", "ef+float8", "ef+int4", "w+2d+int4")
ORIGINS = (
    "argument: params",
    "argument: optimizer",
    "argument: residuals",
    "argument: other",
    "forward",
    "backward",
    "exchange/update",
    "constant",
)


# ------------------------------------------------------------------ reading optimized HLO

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s+(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w-]+)\((.*?)\)(.*)$"  # name = type op(operands)rest
)
_ARRAY = re.compile(r"(\w+)\[([0-9,]*)\](\{[^}]*\})?")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4}
_BYTES |= {"u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def parse_hlo(text: str) -> dict[str, dict[str, Any]]:
    """Every instruction of an HLO module's text: opcode, type, operands, op_name, where."""
    instructions, computation, entry, fused = {}, "", "", set()
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line.startswith(" "):
            computation = head.group(1)
            entry = computation if line.startswith("ENTRY") else entry
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, type_, opcode, operands, rest = m.groups()
        op_name = re.search(r'op_name="([^"]*)"', rest)
        fused.update(re.findall(r"calls=%?([\w.\-]+)", rest) if opcode == "fusion" else ())
        instructions[name] = {
            "opcode": opcode,
            "type": type_,
            "operands": [o.strip().lstrip("%") for o in operands.split(",") if o.strip()],
            "op_name": op_name.group(1).replace("\\'", "'") if op_name else "",
            "computation": computation,
        }
    for ins in instructions.values():
        ins["entry"] = ins["computation"] == entry
        ins["fused"] = ins["computation"] in fused
    return instructions


def origin(instructions: dict[str, dict[str, Any]], name: str) -> tuple[bool, str, str]:
    """``(copied, kind, source)`` of a value: followed through ``copy``/``bitcast`` to what
    made it; kind is an argument (params, optimizer, residuals, other), a forward or
    backward value, an exchange/update value (by the jax ``op_name`` metadata), or a
    constant (an array filled from scalar constants)."""
    copied, op_name = False, ""
    for _ in range(8):
        ins = instructions.get(name)
        if ins is None:
            break
        op_name = op_name or ins["op_name"]
        if ins["opcode"] in ("copy", "copy-start", "copy-done", "bitcast") and ins["operands"]:
            copied = copied or ins["opcode"] != "bitcast"
            name = ins["operands"][0]
            continue
        if ins["opcode"] == "parameter" and ins["entry"]:
            source = ins["op_name"]
            if source.startswith("opt_state"):
                kind = "residuals" if ".residuals" in source else "optimizer"
            else:
                kind = "params" if source.startswith("params") else "other"
            return copied, f"argument: {kind}", source
        op_name = ins["op_name"] or op_name
        if _is_constant_fill(instructions, ins):
            return copied, "constant", op_name
        break
    if "transpose(jvp" in op_name:
        return copied, "backward", op_name
    if "jvp(" in op_name:
        return copied, "forward", op_name
    return copied, "exchange/update", op_name


def _is_constant_fill(instructions: dict[str, dict[str, Any]], ins: dict[str, Any]) -> bool:
    """Whether ``ins`` is a constant, or fills an array from scalar constants only (a
    broadcast of ``0``, e.g. the buffer a scatter-add starts from): its copy materializes
    a fresh buffer, it duplicates no value."""
    if ins["opcode"] == "constant":
        return True
    if ins["opcode"] not in ("broadcast", "fusion") or not ins["operands"]:
        return False
    sources = [instructions.get(o) for o in ins["operands"]]
    return all(s and s["opcode"] == "constant" and "[]" in s["type"] for s in sources)


def _array(type_: str) -> tuple[int, str, str]:
    """``(bytes, "f32[8,4]", "{1,0}")`` of the first array in an HLO type."""
    m = _ARRAY.search(type_)
    if not m:
        return 0, "", ""
    dims = [int(d) for d in m.group(2).split(",") if d]
    size = _BYTES.get(m.group(1), 4)
    for d in dims:
        size *= d
    return size, f"{m.group(1)}[{m.group(2)}]", m.group(3) or ""


def copies(text: str) -> list[dict[str, Any]]:
    """Every ``copy`` / ``copy-start`` of an optimized HLO module, largest first.

    ``transpose``: the operand's layout differs from the result's (a layout change, not a
    second copy of the same bytes); ``fused``: inside a fusion (no buffer of its own).
    """
    instructions = parse_hlo(text)
    out = []
    for name, ins in instructions.items():
        if ins["opcode"] not in ("copy", "copy-start") or not ins["operands"]:
            continue
        size, shape, layout = _array(ins["type"])
        operand = instructions.get(ins["operands"][0], {})
        _, _, operand_layout = _array(operand.get("type", ""))
        _, kind, source = origin(instructions, ins["operands"][0])
        out.append(
            {
                "name": name,
                "shape": shape,
                "bytes": size,
                "origin": kind,
                "source": source if kind.startswith("argument") else ins["op_name"] or source,
                "transpose": bool(layout and operand_layout and layout != operand_layout),
                "fused": ins["fused"],
            }
        )
    return sorted(out, key=lambda c: -c["bytes"])


def copy_summary(text: str, largest: int = 5) -> dict[str, Any]:
    """Bytes and counts of the step's own (unfused) copies per origin, real vs transpose."""
    found = copies(text)
    by_origin: dict[str, dict[str, list[int]]] = {}
    for c in found:
        if not c["fused"]:
            cell = by_origin.setdefault(c["origin"], {"real": [0, 0], "transpose": [0, 0]})
            cell["transpose" if c["transpose"] else "real"][0] += c["bytes"]
            cell["transpose" if c["transpose"] else "real"][1] += 1
    return {
        "by_origin": by_origin,
        "fused": sum(c["bytes"] for c in found if c["fused"]),
        "largest": [c for c in found if not c["fused"]][:largest],
    }


def live_at_peak(dump_dir: str) -> dict[str, Any]:
    """Buffers alive at the peak of the largest module dumped in ``dump_dir``, by origin.

    Reads XLA's ``*-live-range.txt`` ("Live ranges at N (peak)") and the optimized HLO of
    the same module; copies XLA inserted count as "copy of <origin>".
    """
    live_ranges = sorted(
        glob.glob(os.path.join(dump_dir, "*cpu_after_optimizations-live-range.txt")),
        key=os.path.getsize,
    )
    if not live_ranges:
        raise FileNotFoundError(f"No XLA live-range dump in {dump_dir}.")
    with open(live_ranges[-1]) as f:
        section = f.read().split("(peak):", 1)[1].split("Stack trace", 1)[0]
    with open(live_ranges[-1].replace("-live-range.txt", ".txt")) as f:
        instructions = parse_hlo(f.read())
    totals: dict[str, int] = collections.Counter()
    largest = []
    for m in re.finditer(r"^\s+(\S+?)\{[^}]*\}: (\d+) bytes", section, re.M):
        copied, kind, source = origin(instructions, m.group(1))
        key = f"copy of {kind}" if copied else kind
        totals[key] += int(m.group(2))
        largest.append((int(m.group(2)), key, source))
    largest.sort(reverse=True)
    return {
        "total": sum(totals.values()),
        "by_kind": dict(sorted(totals.items(), key=lambda kv: -kv[1])),
        "largest": [{"bytes": s, "kind": k, "source": src} for s, k, src in largest[:12]],
    }


def temp_packing(dump_dir: str) -> dict[str, int]:
    """How XLA packed the step's temporaries: ``{"allocation": bytes, "most_alive": bytes}``.

    ``allocation`` is the preallocated temp buffer (``memory_analysis().temp_size_in_bytes``);
    ``most_alive`` the most bytes of it in use at one point of the schedule: every value
    XLA placed in it (``*-buffer-assignment.txt``: offset and size) is live over its range
    (``*-live-range.txt``), and values overlapping at one offset (aliases) count once. The
    difference is what XLA's placement of values at offsets adds: memory the step needs as
    compiled, but not bytes the schedule holds at once.
    """
    found = sorted(
        glob.glob(os.path.join(dump_dir, "*cpu_after_optimizations-buffer-assignment.txt")),
        key=os.path.getsize,
    )
    if not found:
        raise FileNotFoundError(f"No XLA buffer-assignment dump in {dump_dir}.")
    placed: dict[str, tuple[int, int]] = {}
    in_temp = False
    with open(found[-1]) as f:
        for line in f:
            header = re.match(r"allocation \d+: size \d+, (.*)", line)
            if header:
                in_temp = "preallocated-temp" in header.group(1)
                continue
            value = re.match(
                r"\s*value: <\d+ (\S+?)(\{[^}]*\})? @\d+> \(size=(\d+),offset=(\d+)\)", line
            )
            if value and in_temp:
                placed[value.group(1) + (value.group(2) or "{}")] = (
                    int(value.group(4)),
                    int(value.group(3)),
                )
    with open(found[-1].replace("-buffer-assignment.txt", "-live-range.txt")) as f:
        ranges_text = f.read().split("BufferLiveRange:", 1)[1].split("Live ranges at", 1)[0]
    events: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    last = 0
    for m in re.finditer(r"^\s+(\S+?\{[^}]*\}):(\d+)-(\d+)", ranges_text, re.M):
        if m.group(1) in placed:
            start, end = int(m.group(2)), int(m.group(3))
            for t in range(start, end + 1):
                events[t].append(placed[m.group(1)])
            last = max(last, end)
    most = 0
    for intervals in events.values():
        covered, high = 0, -1
        for offset, size in sorted(intervals):
            low = max(offset, high)
            if offset + size > low:
                covered += offset + size - low
                high = offset + size
        most = max(most, covered)
    allocation = max((o + s for o, s in placed.values()), default=0)
    return {"allocation": allocation, "most_alive": most}


def _explain_in_subprocess(
    model: str,
    variant: str,
    guard: bool | str,
    dump_root: str,
    optimizer: str | None = None,
    selection_scope: str = "leaf",
    overrides: dict[str, Any] | None = None,
) -> dict:
    """XLA dump flags are fixed at start-up: compile one step in a child process."""
    import subprocess

    name = re.sub(r"[+/]", "_", variant) + ("_set" if overrides else "")
    dump_dir = os.path.join(dump_root, f"{model}_{name}_{guard_name(guard)}")
    os.makedirs(dump_dir, exist_ok=True)
    flags = f" --xla_dump_to={dump_dir} --xla_dump_hlo_module_re=.*jit_train_step.*"
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + flags}
    cmd = [sys.executable, __file__, "--models", model, "--_one", variant]
    flag = guard if isinstance(guard, str) else str(int(guard))
    cmd += ["--_guard", flag, *(["--optimizer", optimizer] if optimizer else [])]
    cmd += ["--selection-scope", selection_scope]
    for key, value in (overrides or {}).items():
        cmd += ["--variant-set", f"{key}={value!r}"]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return {**live_at_peak(dump_dir), "temp_packing": temp_packing(dump_dir)}


# ------------------------------------------------------------------ the comparison


def _compile(
    case: Case,
    variant: str,
    guard: bool | str,
    optimizer: str | None = None,
    selection_scope: str = "leaf",
    overrides: dict[str, Any] | None = None,
):
    """``guard``: ``False``, ``True`` (the config's guard mode) or a guard mode name;
    ``optimizer``: the training program's optimizer name in place of the config's;
    ``selection_scope``: ``compression.selection_scope`` (``"global"``: whole-model Top-k);
    ``overrides``: dotted config keys set last (``{"optimizer.one_buffer": "on"}``).

    The last phase of the density schedule is compiled; a compressed-momentum optimizer
    gets the recipe's dense warm-up (:data:`CM_DENSE_FRACTION` of the steps; the Adam one
    requires a warm-up) where the config has none, so its row is the compressed phase's.
    """
    from train import compiled_step

    config = case.load()
    if isinstance(guard, str):
        config.compression.guard_mode = guard
    config.compression.selection_scope = selection_scope
    if optimizer:
        config.optimizer.name = optimizer
        schedule = config.compression.density_schedule
        if optimizer.startswith("compressed_momentum") and not schedule.dense_fraction:
            schedule.dense_fraction = CM_DENSE_FRACTION
        config.optimizer.one_buffer = "off"  # two buffers unless overrides say otherwise
    for key, value in (overrides or {}).items():
        set_dotted(config, key, value)
    return compiled_step.compile_step(
        config,
        variant=variant,
        guard=bool(guard),
        batch_per_worker=case.batch_per_worker,
        seq_len=case.seq_len,
        num_workers=NUM_WORKERS,
    )


def measure(
    name: str,
    case: Case,
    guard: bool | str,
    variants: tuple[str, ...] | None = None,
    optimizer: str | None = None,
    selection_scope: str = "leaf",
    variant_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Compiles EF and each of ``variants`` (default: the config's) and compares them
    (``optimizer``, ``selection_scope``: see :func:`_compile`). ``variant_overrides``:
    config keys set for the variants but not for the EF they are compared with.

    The state saving is of the optimizer and residual state together (the same optimizer
    state unless ``variant_overrides`` change it). The top-level ``variant``,
    ``state_saving``, ``peak_drop`` and ``ratio`` are those of the first variant.
    """
    from train import compiled_step

    variants = tuple(variants or (case.load().compression.variant,))
    # With variant_overrides a variant is labelled "<variant>*", beside EF without them.
    suffix = "*" if variant_overrides else ""
    jobs = {"ef": ("ef", None)}  # EF as a variant is the same step (without overrides)
    jobs.update({f"{v}{suffix}": (v, variant_overrides) for v in variants})
    steps: dict[str, dict[str, Any]] = {}
    for key, (variant, overrides) in jobs.items():
        step = _compile(case, variant, guard, optimizer, selection_scope, overrides)
        states = compiled_step.state_bytes(step.params, step.tx, step.mesh)  # per worker
        steps[key] = {
            **step.peak.as_dict(),
            "residual_bytes": states.residuals,
            "optimizer_bytes": states.optimizer,
            "compile_seconds": step.compile_seconds,
            "copies": copy_summary(step.compiled.as_text()),
        }
        del step
    variants = tuple(f"{v}{suffix}" for v in variants)
    ef = steps["ef"]
    for variant in variants:
        s = steps[variant]
        s["state_saving"] = (ef["residual_bytes"] + ef.get("optimizer_bytes", 0)) - (
            s["residual_bytes"] + s.get("optimizer_bytes", 0)
        )
        s["peak_drop"] = ef["peak"] - s["peak"]
        s["ratio"] = s["peak_drop"] / s["state_saving"] if s["state_saving"] else float("nan")
    first = steps[variants[0]]
    return {
        "model": name,
        "guard": guard,
        "description": case.description,
        "optimizer": optimizer,
        "selection_scope": selection_scope,
        "variant_overrides": variant_overrides,
        "steps": steps,
        "variant": variants[0],
        **{k: first[k] for k in ("state_saving", "peak_drop", "ratio")},
    }


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.1f}"


def markdown(results: list[dict[str, Any]]) -> str:
    # Variants with their own optimizer state (--variant-set) are compared over the
    # optimizer and residual state together, with an optimizer column.
    optimizer = any(r.get("variant_overrides") for r in results)
    state = "optimizer and residual bytes" if optimizer else "residual bytes"
    lines = [
        "# Residual variants vs plain EF at the compiled peak of the train step",
        "",
        "Per worker, MiB; peak = argument + output - alias + temp of the compiled step, "
        f"drop / saving = (EF's peak - the variant's) / (EF's {state} - the "
        "variant's). What is measured and where the goal holds: below the tables.",
        "",
    ]
    for model in dict.fromkeys(r["model"] for r in results):
        rows = [r for r in results if r["model"] == model]
        lines += [
            f"## {model}",
            "",
            *([rows[0]["description"] + ".", ""] if rows[0]["description"] else []),
            *(
                [f"Optimizer `{rows[0]['optimizer']}`, the density schedule's last phase.", ""]
                if rows[0].get("optimizer")
                else []
            ),
            *(
                ['Whole-model Top-k (`compression.selection_scope="global"`) in every step.', ""]
                if rows[0].get("selection_scope") == "global"
                else []
            ),
            *(
                [
                    "`*`: the variant with "
                    + ", ".join(f"`{k}={v!r}`" for k, v in rows[0]["variant_overrides"].items())
                    + "; `ef` without them.",
                    "",
                ]
                if rows[0].get("variant_overrides")
                else []
            ),
        ]
        column = " optimizer |" if optimizer else ""
        lines += [
            f"| guard | variant | peak | temp |{column} residuals | state saving | peak drop "
            "| drop / saving |",
            "|---|---|---:|---:|" + "---:|" * (5 if optimizer else 4),
        ]
        for r in rows:
            for variant, s in r["steps"].items():
                compared = (
                    f"{_mib(s['state_saving'])} | {_mib(s['peak_drop'])} | {s['ratio']:.2f}"
                    if variant != "ef"
                    else "– | – | –"
                )
                cell = f" {_mib(s['optimizer_bytes'])} |" if optimizer else ""
                lines.append(
                    f"| {guard_name(r['guard'])} | {variant} | {_mib(s['peak'])} "
                    f"| {_mib(s['temp'])} |{cell} {_mib(s['residual_bytes'])} | {compared} |"
                )
        lines.append("")
    lines += ["<!-- prose: about -->", ""]
    lines += _copies_section(results)
    lines += _explain_section(results)
    return "\n".join(lines)


def _copies_section(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Copies in the compiled step, by origin (MiB: real copies / layout transposes)",
        "",
        "<!-- prose: copies -->",
        "",
        "| model | guard | variant | " + " | ".join(ORIGINS) + " | in fusions |",
        "|---|---|---|" + "---:|" * (len(ORIGINS) + 1),
    ]
    largest = []
    for r in results:
        for variant, s in r["steps"].items():
            by_origin, cells = s["copies"]["by_origin"], []
            for kind in ORIGINS:
                cell = by_origin.get(kind)
                cells.append(
                    f"{_mib(cell['real'][0])} / {_mib(cell['transpose'][0])}" if cell else "–"
                )
            head = f"{r['model']} | {guard_name(r['guard'])} | {variant}"
            lines.append(f"| {head} | {' | '.join(cells)} | {_mib(s['copies']['fused'])} |")
            for c in s["copies"]["largest"][:3]:
                kind = "transpose" if c["transpose"] else "copy"
                largest.append(
                    f"* {head.replace(' | ', ' ')}: {c['shape']} {_mib(c['bytes'])} MiB, "
                    f"{kind} of {c['origin']} (`{c['source'] or c['name']}`)"
                )
    return [*lines, "", "Largest copies per step:", "", *largest, ""]


def _explain_section(results: list[dict[str, Any]]) -> list[str]:
    explained = [r for r in results if "explain" in r]
    if not explained:
        return []
    lines = ["## Alive at the peak (MiB)", "", "<!-- prose: explain -->", ""]
    for r in explained:
        for variant, live in r["explain"].items():
            parts = ", ".join(f"{k} {_mib(v)}" for k, v in live["by_kind"].items())
            packing = live["temp_packing"]
            lines.append(
                f"* {r['model']} {variant} ({guard_name(r['guard'])}): total "
                f"{_mib(live['total'])}: {parts}; temp {_mib(packing['allocation'])}, at most "
                f"{_mib(packing['most_alive'])} of it alive at once"
            )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        help="against EF; 'formats': FORMAT_VARIANTS",
    )
    parser.add_argument(
        "--guard",
        choices=("both", "plain", "guard", "strict", "all"),
        default="both",
        help="both: none and the default guard; strict: the strict guard; all: the three",
    )
    parser.add_argument(
        "--optimizer",
        default=None,
        help="the optimizer's name in place of each config's (e.g. compressed_momentum_adam)",
    )
    parser.add_argument(
        "--selection-scope",
        choices=("leaf", "global"),
        default="leaf",
        help="compression.selection_scope of every step (global: whole-model Top-k)",
    )
    parser.add_argument(
        "--variant-set",
        dest="variant_overrides",
        action="append",
        type=parse_assignment,
        default=[],
        metavar="KEY=VALUE",
        help="config key set for the variants but not for EF (labelled '<variant>*'), e.g. "
        "optimizer.one_buffer=on",
    )
    parser.add_argument("--out", default=None, help="directory for peak_memory.{json,md}")
    parser.add_argument(
        "--explain", metavar="DIR", help="dump the steps and show what is alive at the peak"
    )
    parser.add_argument(
        "--from-json", action="store_true", help="only re-render the markdown from its JSON"
    )
    parser.add_argument("--_one", help=argparse.SUPPRESS)
    parser.add_argument("--_guard", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variants == ["formats"]:
        args.variants = list(FORMAT_VARIANTS)
    if args.from_json:
        out = args.out or RESULTS
        rerender("peak_memory", markdown, out, key="results")
        return

    from resireduce_jax import runtime

    runtime.configure_cpu(NUM_WORKERS)
    if args._one:  # child process of --explain: compile one step with dump flags
        guard = {"0": False, "1": True}.get(args._guard, args._guard)
        overrides = dict(args.variant_overrides) or None
        _compile(
            CASES[args.models[0]], args._one, guard, args.optimizer, args.selection_scope, overrides
        )
        return

    guards = {
        "both": (False, True),
        "plain": (False,),
        "guard": (True,),
        "strict": ("strict",),
        "all": (False, True, "strict"),
    }[args.guard]
    results = []
    for name in args.models:
        for guard in guards:
            scope = args.selection_scope
            r = measure(
                name,
                CASES[name],
                guard,
                tuple(args.variants),
                args.optimizer,
                scope,
                dict(args.variant_overrides) or None,
            )
            if args.explain:
                overrides = dict(args.variant_overrides)
                r["explain"] = {
                    v: _explain_in_subprocess(
                        name,
                        v.removesuffix("*"),
                        guard,
                        args.explain,
                        args.optimizer,
                        scope,
                        overrides if v.endswith("*") else None,
                    )
                    for v in r["steps"]
                }
            results.append(r)
            for variant, s in r["steps"].items():
                if "state_saving" not in s:  # the EF compared with
                    continue
                print(
                    f"{name:12s} {guard_name(guard):14s} {variant:10s} peak {_mib(s['peak']):>8s} "
                    f"(EF {_mib(r['steps']['ef']['peak'])}) MiB  saving "
                    f"{_mib(s['state_saving'])}  drop {_mib(s['peak_drop'])}  "
                    f"ratio {s['ratio']:.2f}",
                    flush=True,
                )
    payload = environment(
        num_workers=NUM_WORKERS,
        scheduler="xla_cpu memory-optimizing (concurrency_optimized_scheduler=false)",
        variants=args.variants,
        results=results,
    )
    write_results("peak_memory", payload, markdown(results), args.out or RESULTS)


if __name__ == "__main__":
    main()
