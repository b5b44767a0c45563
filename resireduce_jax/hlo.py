"""Reading facts off compiled XLA programs: collectives, copies and peak memory.

These readers work on ``jax.jit(f).lower(...).compile()`` objects (or their HLO text) and
are what tests and benchmarks use to check claims that can only be seen after XLA's
passes: that no dense all-reduce of a compressed gradient survived, how many bytes the
collectives move, which buffers XLA copied, and the compiled peak memory.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

__all__ = [
    "Collective",
    "PeakMemory",
    "branch_collectives",
    "collectives",
    "copies",
    "loop_collectives",
    "peak_memory",
]

# "f32[8,163]{1,0}" or "bf16[]" -- one array shape in HLO text.
_SHAPE = re.compile(
    r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64|c64|c128)"
    r"\[([0-9,]*)\]"
)
_BITS = {
    "pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32,
    "s64": 64, "u64": 64, "f8e4m3fn": 8, "f8e5m2": 8, "bf16": 16, "f16": 16, "f32": 32,
    "f64": 64, "c64": 64, "c128": 128,
}  # fmt: skip
_COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# "%name = <result type> op(" with an optional "-start" suffix (async collectives on GPU).
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<op>" + "|".join(_COLLECTIVE_OPS) + r"|copy)(?P<start>-start)?\("
)
_GROUPS = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_ALL_GROUPS = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)+)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")


def _shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(type_text)
    ]


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * _BITS[dtype] // 8


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
      op: ``"all-reduce"``, ``"all-gather"``, ...
      name: the HLO instruction name.
      shapes: result array shapes as ``(dtype, dims)``; several for combined (tuple) ops.
      group_size: number of participants per replica group.
      replica_groups: the groups of device ids, when the HLO lists them explicitly
        (``replica_groups={{0,4},{1,5}}``); ``None`` for the iota form.
      result_bytes: bytes of the result (for an all-gather: all workers' data).
      bytes_per_worker: bytes one participant contributes: the result for all-reduce,
        result / group size for all-gather, result × group size (its whole operand) for
        reduce-scatter.
    """

    op: str
    name: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    group_size: int
    replica_groups: tuple[tuple[int, ...], ...] | None = None

    @property
    def result_bytes(self) -> int:
        return sum(_nbytes(dt, s) for dt, s in self.shapes)

    @property
    def bytes_per_worker(self) -> int:
        if self.op == "all-gather":
            return self.result_bytes // self.group_size
        if self.op == "reduce-scatter":
            return self.result_bytes * self.group_size
        return self.result_bytes

    @property
    def element_counts(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for _, s in self.shapes)


def _text(compiled_or_text: Any) -> str:
    return compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()


def _group_size(line: str) -> int:
    m = _GROUPS.search(line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = _GROUPS_IOTA.search(line)
    if m:
        return int(m.group(2))
    return 1


def _replica_groups(line: str) -> tuple[tuple[int, ...], ...] | None:
    m = _ALL_GROUPS.search(line)
    if not m:
        return None
    groups = re.findall(r"\{([0-9,]*)\}", m.group(1))
    return tuple(tuple(int(x) for x in g.split(",") if x) for g in groups)


def collectives(compiled_or_text: Any) -> list[Collective]:
    """All collective instructions of a compiled program (or of its HLO text).

    ``*-start`` / ``*-done`` pairs of asynchronous collectives are counted once, at the
    start (an ``all-gather-start`` returns ``(operands, results)``; only results count).
    """
    found = []
    for line in _text(compiled_or_text).splitlines():
        m = _INSTR.match(line)
        if not m or m.group("op") == "copy":
            continue
        shapes = _shapes(m.group("type"))
        if m.group("start") and m.group("op") == "all-gather" and len(shapes) > 1:
            shapes = shapes[len(shapes) // 2 :]
        found.append(
            Collective(
                m.group("op"),
                m.group("name"),
                tuple(shapes),
                _group_size(line),
                _replica_groups(line),
            )
        )
    return found


# "%name (params) -> type {" opens a computation; "ENTRY %main ..." the entry one.
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_CALLED_LIST = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_CONDITIONAL = re.compile(r"\sconditional\(")
_WHILE = re.compile(r"\swhile\(")
_BODY = re.compile(r"body=%?([\w.\-]+)")


def _computations(text: str) -> dict[str, list[str]]:
    """``{computation name: its instruction lines}`` of an HLO module's text."""
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and "=" not in line.split("{", 1)[0].split("->", 1)[0].split("(", 1)[0]:
                current = m.group("name")
                found[current] = []
        elif line.strip() == "}":
            current = None
        else:
            found[current].append(line)
    return found


def _called(line: str) -> list[str]:
    names = _CALLED.findall(line)
    for group in _CALLED_LIST.findall(line):
        names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
    return names


def _reachable_collectives(comps: dict[str, list[str]]):
    own = {name: collectives("\n".join(lines)) for name, lines in comps.items()}

    def reachable(name: str, seen: set[str]) -> list[Collective]:
        if name in seen or name not in comps:
            return []
        seen.add(name)
        out = list(own[name])
        for line in comps[name]:
            for callee in _called(line):
                out += reachable(callee, seen)
        return out

    return lambda name: reachable(name, set())


def loop_collectives(compiled_or_text: Any) -> list[list[Collective]]:
    """The collectives of every ``while`` loop's body of a compiled program: one list per
    loop (in program text order), including those of the computations the body calls.
    A collective listed here runs once per iteration."""
    comps = _computations(_text(compiled_or_text))
    reachable = _reachable_collectives(comps)
    return [
        reachable(m.group(1))
        for lines in comps.values()
        for line in lines
        if _WHILE.search(line) and (m := _BODY.search(line))
    ]


def branch_collectives(compiled_or_text: Any) -> list[list[list[Collective]]]:
    """The collectives of every ``conditional`` of a compiled program, branch by branch.

    One entry per conditional instruction (in program text order), holding one list per
    branch (``lax.switch`` order) of the collectives that branch runs, including those
    of the computations it calls (loops, fusions, nested calls). A density schedule's
    phases are such branches (:mod:`resireduce_jax.compressors.schedule`).
    """
    comps = _computations(_text(compiled_or_text))
    reachable = _reachable_collectives(comps)
    result = []
    for lines in comps.values():
        for line in lines:
            if _CONDITIONAL.search(line):
                branches = [
                    n.strip().lstrip("%") for g in _CALLED_LIST.findall(line) for n in g.split(",")
                ]
                result.append([reachable(b) for b in branches if b])
    return result


def copies(compiled_or_text: Any, min_bytes: int = 0) -> list[tuple[str, int]]:
    """``(instruction name, bytes)`` of every ``copy`` instruction of at least ``min_bytes``.

    Copies inside fusions are included: a full-size copy of a state buffer is how XLA
    resolves a read-after-in-place-write conflict (see :mod:`resireduce_jax.optimizers`).
    """
    out = []
    for line in _text(compiled_or_text).splitlines():
        m = _INSTR.match(line)
        if m and m.group("op") == "copy":
            nbytes = sum(_nbytes(dt, s) for dt, s in _shapes(m.group("type")))
            if nbytes >= min_bytes:
                out.append((m.group("name"), nbytes))
    return out


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    """Memory figures of one compiled program, per device, in bytes.

    ``peak = argument + output - alias + temp``: live inputs, outputs that do not reuse a
    donated input buffer, and XLA's scratch. (``memory_analysis().peak_memory_in_bytes``
    leaves temp out on CPU, so it is not used.)
    """

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "peak": self.peak}


def peak_memory(compiled: Any) -> PeakMemory:
    """Reads :class:`PeakMemory` from ``compiled.memory_analysis()``."""
    ma = compiled.memory_analysis()
    if ma is None:
        raise ValueError("This backend does not report memory_analysis() for compiled programs.")
    return PeakMemory(
        argument=int(ma.argument_size_in_bytes),
        output=int(ma.output_size_in_bytes),
        alias=int(ma.alias_size_in_bytes),
        temp=int(ma.temp_size_in_bytes),
        generated_code=int(getattr(ma, "generated_code_size_in_bytes", 0)),
    )
