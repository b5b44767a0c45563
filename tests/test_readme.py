"""The README's library example, and docs/exchange.md's hierarchical one after it, run as
written (in a fresh process: they configure jax)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXCHANGE_DOC = ROOT / "docs" / "exchange.md"


def _python_blocks(page: pathlib.Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)


def test_optax_chain_example_runs_and_reports_the_saving():
    block = next(b for b in _python_blocks() if "rr.resireduce(" in b)
    script = block + "\nprint('loss', float(metrics['loss']))\n"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Four layers, each a 256 x 256 kernel (K elements) and a 256 bias. Params, gradients and
    # momentum are 3 P with P = 4 K + 4 * 256. Biases are under min_size: they travel dense
    # and keep no residual, in the baseline too, whose error feedback keeps 4 K. The example
    # keeps one K for the three grouped kernels and dense_0's 128 x 128 block (K / 4) with
    # its 128 + 128 int32 indices. Saved: (4 K - 1.25 K - 256) of 3 P + 4 K (step counts,
    # a few bytes, do not move the rounded figure).
    saved = re.search(r"\(([\d.]+)% saved\)", done.stdout)
    assert saved is not None, done.stdout
    k, p = 256 * 256, 4 * 256 * 256 + 4 * 256
    assert float(saved.group(1)) == round(100 * (4 * k - 1.25 * k - 256) / (3 * p + 4 * k), 1)
    loss = float(done.stdout.split("loss")[-1])
    assert 0.0 < loss < 1.0


def test_hierarchical_example_runs_after_the_main_one():
    main = next(b for b in _python_blocks() if "rr.resireduce(" in b)
    hierarchical = next(b for b in _python_blocks(EXCHANGE_DOC) if "rr.resireduce(" in b)
    flat_bytes = "\nflat = exchange.plan(params).residual_bytes()\n"
    script = main + flat_bytes + hierarchical + "\nprint('flat', flat, 'loss', metrics['loss'])\n"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    per_device, rest = done.stdout.strip().splitlines()[-2:]
    _, flat, _, loss = rest.split()
    # Flat: the shared residual (256 x 256) + dense_0's 128 x 128 block + 256 indices; the
    # biases travel dense and keep no residual.
    assert int(flat) == (256 * 256 + 128 * 128) * 4 + (128 + 128) * 4
    # Per device: a quarter of the shared residual; dense_0 keeps its 128 global output
    # units x 128 / 4 of its own input rows, with all 128 + 32 indices.
    assert int(per_device) == (256 * 256 // 4 + 128 * 32) * 4 + (128 + 32) * 4
    assert 0.0 < float(loss) < 1.0
