"""benchmarks/fit.py: merging invocations, the results table and the plot (no compiles)."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import fit  # noqa: E402

GiB = 2**30


def _search(batch: int, peak: int = 0, label: str = "ef / original / none") -> dict:
    at = {"label": label, "peak_bytes": peak, "flops_overhead": 0.1}
    return {"label": label, "largest_batch": batch, "at_largest": at}


def _row(budget: float, ef: int, best: int, peak_gib: float) -> dict:
    choice = _search(best, int(peak_gib * GiB), "w+2d+bf16 / r / rotor")
    return {
        "budget": budget,
        "budget_bytes": int(budget * GiB),
        "seconds": 12.0,
        "searches": {"plain EF": _search(ef), "all": choice},
        "planner_choice": choice,
    }


def _result(rows: list[dict], fit_call=None, seconds: float = 10.0) -> dict:
    compiles = [{"peak_bytes": 1, "compile_seconds": seconds}]
    return {
        "model": "gpt2_medium",
        "description": "GPT-2 medium",
        "fit": fit_call,
        "budgets": rows,
        "compiles": compiles,
        "compile_seconds": seconds,
    }


def test_a_later_invocation_keeps_the_rows_and_planner_call_it_did_not_redo():
    call = {"budget_bytes": 16 * GiB, "seconds": 700.0, "error": "none fits"}
    before = _result([_row(8, 0, 3, 7.7), _row(16, 1, 5, 15.0)], call, seconds=10.0)
    now = _result([_row(16, 1, 6, 15.5), _row(40, 4, 12, 39.0)], None, seconds=5.0)
    merged = fit.merge_runs(before, now)
    assert [b["budget"] for b in merged["budgets"]] == [8, 16, 40]
    assert merged["budgets"][1]["planner_choice"]["largest_batch"] == 6  # the new search
    assert merged["fit"] is call
    assert len(merged["compiles"]) == 2 and merged["compile_seconds"] == 15.0
    assert merged["invocations"] == 2
    assert fit.merge_runs(None, now) is now


def test_the_table_states_the_ratio_and_whether_each_choice_fits():
    text = fit.markdown([_result([_row(8, 0, 3, 7.7), _row(16, 2, 5, 16.5)])], [], False, "fit")
    lines = [line for line in text.splitlines() if line.startswith("| 8 GiB")]
    assert "∞ (EF: none)" in lines[0] and "| yes |" in lines[0]
    row16 = next(line for line in text.splitlines() if line.startswith("| 16 GiB"))
    assert "| 2.50 |" in row16 and "**no**" in row16  # 16.5 GiB > 16 GiB is reported
    assert "1 of 2 compiled peaks ≤ budget" in text


def test_from_json_renders_the_markdown_and_plot(tmp_path):
    payload = {"quick": False, "results": [_result([_row(8, 0, 3, 7.7), _row(16, 2, 5, 15)])]}
    (tmp_path / "fit.json").write_text(json.dumps(payload))
    fit.main(["--from-json", "--out", str(tmp_path)])
    assert (tmp_path / "fit.png").stat().st_size > 0
    assert json.loads((tmp_path / "fit.json").read_text()) == payload
    assert "| 16 GiB | 2 | 5 |" in (tmp_path / "fit.md").read_text()
