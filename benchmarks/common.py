"""What the benchmarks share: configs, model cases, result files and their static prose.

Benchmarks run as scripts (``python benchmarks/<name>.py``), so they ``import common``
from this directory. Results go to ``benchmarks/results/<name>.{json,md}``.

Long explanations belong in the results markdown, not in the scripts: a generated
markdown marks a place for hand-written text with a line ``<!-- prose: KEY -->``, and
:func:`write_results` fills it with the block of that key from the page it replaces
(between ``<!-- prose: KEY -->`` and ``<!-- /prose -->``; a new page in another folder
takes the committed ``benchmarks/results/<name>.md``'s), so regenerating the figures keeps
the text around them. A page leads with its table; its
prose follows it.

Every benchmark re-renders its markdown from its committed JSON without measuring again
(``--from-json``): :func:`read_results` loads the figures, :func:`write_markdown` writes
the page, :func:`rerender` does both; :func:`add_output_arguments` adds that flag and
``--out`` (and where wanted ``--merge``) to a command line.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import json
import os
import platform
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NUM_WORKERS = 8
MiB = 2**20

_PROSE_BLOCK = re.compile(r"^<!-- prose: ([\w-]+) -->\n(.*?)^<!-- /prose -->\n?", re.M | re.S)
_PROSE_MARK = re.compile(r"^<!-- prose: ([\w-]+) -->$", re.M)


def load_config(name: str):
    """``get_config()`` of ``configs/<name>.py``."""
    path = ROOT / "configs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"configs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@dataclasses.dataclass(frozen=True)
class Case:
    """One model at a CPU-friendly size, trained with a paper config's recipe."""

    config: str  # file name in configs/ without .py
    overrides: dict[str, Any]  # model overrides (config.model.overrides)
    batch_per_worker: int
    seq_len: int = 0  # language models: tokens per sequence
    description: str = ""

    def load(self):
        """The case's config: ``configs/<config>.py`` with the model overrides."""
        config = load_config(self.config)
        config.model.overrides = dict(self.overrides)
        return config


# The CPU-sized VGG-19 that peak_memory.py and step_time.py both measure.
VGG19 = Case(
    "vgg19_cifar100",
    {"width": 16, "classifier_width": 1024},
    batch_per_worker=8,
    description="VGG-19-bn (16 convs), width 16, classifier 6272x1024x1024x1000, 8 images/worker",
)


def environment(**extra: Any) -> dict[str, Any]:
    """Versions and machine, for the head of a results JSON."""
    import jax

    return {
        "jax": jax.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        **extra,
    }


def guard_name(guard: bool | str) -> str:
    """``False``: no guard; ``True``: the program's default guard; a mode name: that mode."""
    if isinstance(guard, str):
        return f"skip_nonfinite_{guard}"
    return "skip_nonfinite" if guard else "none"


def fill_prose(text: str, name: str, source: Path | None = None) -> str:
    """Fills every ``<!-- prose: KEY -->`` line of ``text`` with that block of ``source``.

    ``source`` defaults to the committed ``benchmarks/results/<name>.md``; a key it does not
    have gets an empty block, to be written by hand.
    """
    source = source or RESULTS / f"{name}.md"
    blocks = dict(_PROSE_BLOCK.findall(source.read_text())) if source.exists() else {}
    return _PROSE_MARK.sub(
        lambda m: f"<!-- prose: {m[1]} -->\n{blocks.get(m[1], '')}<!-- /prose -->", text
    )


def add_output_arguments(
    parser: argparse.ArgumentParser,
    *,
    from_json_help: str = "only re-render the markdown from its JSON",
    out_help: str | None = None,
    merge_help: str | None = None,
) -> None:
    """Adds ``--out`` (the results folder, default ``benchmarks/results``), where
    ``merge_help`` is given ``--merge`` (a flag: keep results of an earlier run, as that
    help says) and ``--from-json`` (re-render the markdown from the JSON of an earlier
    run, without measuring), in that order, with these help texts."""
    parser.add_argument("--out", default=str(RESULTS), help=out_help)
    if merge_help is not None:
        parser.add_argument("--merge", action="store_true", help=merge_help)
    parser.add_argument("--from-json", action="store_true", help=from_json_help)


def merge_rows(
    before: list[dict[str, Any]], now: list[dict[str, Any]], case: Sequence[str]
) -> list[dict[str, Any]]:
    """``--merge``: ``before`` with every row of the same case (the values of the fields
    ``case``) replaced by its row in ``now``, in ``before``'s order; new cases come last."""

    def key(row: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(row[field] for field in case)

    fresh = {key(r): r for r in now}
    merged = [fresh.pop(key(r), r) for r in before]
    return merged + [r for r in now if key(r) in fresh]


def read_results(name: str, out: str | Path = RESULTS) -> Any:
    """The payload of ``<out>/<name>.json``, to re-render its markdown without measuring."""
    path = Path(out) / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"error: --from-json: {path} does not exist; run the benchmark first.")
    return json.loads(path.read_text())


def write_markdown(name: str, markdown: str, out: str | Path = RESULTS, *, echo: bool = True):
    """Writes ``<out>/<name>.md``, its prose filled in from the page it replaces (from the
    committed ``benchmarks/results/<name>.md`` where ``out`` has none); prints it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    page = out / f"{name}.md"
    text = fill_prose(markdown, name, page if page.exists() else None)
    text = text if text.endswith("\n") else text + "\n"
    (out / f"{name}.md").write_text(text)
    if echo:
        print(text)
    return out


def rerender(
    name: str,
    render: Callable[[Any], str],
    out: str | Path = RESULTS,
    *,
    key: str | None = None,
    echo: bool = True,
) -> Any:
    """``--from-json``: rewrites ``<out>/<name>.md`` from ``<out>/<name>.json``, measuring
    nothing. ``render`` makes the markdown of the payload, or of its entry ``key`` where
    given; returns what ``render`` was given (e.g. to redraw a figure from it)."""
    figures = read_results(name, out)
    if key is not None:
        figures = figures[key]
    write_markdown(name, render(figures), out, echo=echo)
    return figures


def write_results(
    name: str,
    payload: Any,
    markdown: str,
    out: str | Path = RESULTS,
    *,
    indent: int = 2,
    echo: bool = True,
) -> Path:
    """Writes ``<out>/<name>.json`` and ``<out>/<name>.md`` (prose filled in); prints the md."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=indent, default=repr) + "\n")
    return write_markdown(name, markdown, out, echo=echo)


def parse_assignment(text: str) -> tuple[str, Any]:
    """``"optimizer.max_grad_norm=None"`` -> ``("optimizer.max_grad_norm", None)``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set takes KEY=VALUE, got {text!r}.")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value  # a bare string such as w+2d
    return key.strip(), parsed


def set_dotted(config, key: str, value: Any) -> None:
    """``config[key] = value`` for a dotted ``key``; an unknown key is refused."""
    *sections, leaf = key.split(".")
    node = config
    for section in sections:
        node = node[section]
    if leaf not in node:
        raise ValueError(f"Unknown config key {key!r} (see train/config_schema.py).")
    with node.ignore_type():
        node[leaf] = value
