"""How well one residual could stand for a group: ``residual_analysis.sharing_report``.

Expected values are derived by hand from ResiReduce-w's weighted mean (§4.2): member
weights ``phi ||r||_1 / n + (1 - phi) ||r||_2 / sqrt(n)`` scale with a member's size, so
parallel residuals get weights in the ratio of their norms.
"""

from __future__ import annotations

import numpy as np
import pytest

import resireduce_jax as rr
from train import residual_analysis

BY_BLOCK = rr.grouping.regex([(r"block_\d/(\w+)", r"\1")])


def residuals(*values) -> dict[str, np.ndarray]:
    return {
        f"block_{i}/kernel": np.asarray(v, np.float32).reshape(2, 2) for i, v in enumerate(values)
    }


def only_group(report):
    (row,) = report.values()
    return row


def test_identical_residuals_lose_nothing():
    row = only_group(residual_analysis.sharing_report(residuals(*[[1, -2, 3, 0.5]] * 3), BY_BLOCK))
    assert row["members"] == ["block_0/kernel", "block_1/kernel", "block_2/kernel"]
    assert row["cosine_min"] == pytest.approx(1.0) and row["mean_error"] == pytest.approx(0.0)


def test_opposite_residuals_lose_everything():
    row = only_group(
        residual_analysis.sharing_report(residuals([1, 2, 3, 4], [-1, -2, -3, -4]), BY_BLOCK)
    )
    assert row["cosine_mean"] == pytest.approx(-1.0)
    assert row["mean_error"] == pytest.approx(1.0)  # equal weights: the shared mean is zero


def test_orthogonal_residuals_keep_half_of_each():
    row = only_group(
        residual_analysis.sharing_report(residuals([2, 0, 0, 0], [0, 2, 0, 0]), BY_BLOCK)
    )
    assert row["cosine_max"] == pytest.approx(0.0)
    # Shared (r1 + r2) / 2: ||r1 - shared|| / ||r1|| = ||(r1 - r2) / 2|| / ||r1|| = sqrt(2) / 2.
    assert row["mean_error"] == pytest.approx(np.sqrt(2) / 2)


def test_parallel_residuals_of_different_sizes_are_weighted_by_size():
    x = np.array([1.0, -1.0, 2.0, 0.0])
    row = only_group(residual_analysis.sharing_report(residuals(x, 3 * x), BY_BLOCK))
    # Weights 1 : 3, shared (x + 9x) / 4 = 2.5x; errors 1.5 and 0.5 / 3.
    assert row["cosine_mean"] == pytest.approx(1.0)
    assert row["mean_error"] == pytest.approx((1.5 + 0.5 / 3) / 2)


def test_singletons_and_unmatched_leaves_are_not_reported():
    found = residuals([1, 0, 0, 0], [0, 1, 0, 0])
    found["head/kernel"] = np.ones((2, 2), np.float32)
    rules = rr.grouping.regex([(r"block_0/(\w+)", "first"), (r"block_1/(\w+)", "second")])
    assert residual_analysis.sharing_report(found, rules) == {}
    assert set(residual_analysis.sharing_report(found, BY_BLOCK)) == {"kernel"}


def test_the_table_has_a_row_per_group():
    report = residual_analysis.sharing_report(residuals([2, 0, 0, 0], [0, 2, 0, 0]), BY_BLOCK)
    lines = residual_analysis.format_sharing(report).splitlines()
    assert len(lines) == 2 and lines[1].split()[:2] == ["kernel", "2"]
    assert lines[1].split()[-1] == "0.71"


def test_rules_for_leaves_left_out_of_the_analysis_are_not_errors():
    """The analysed leaves are part of the tree the rules were written for: a rule for
    other layers matches none of them (grouping.regex alone raises for that)."""
    rules = rr.grouping.regex([(r"block_[01]/", "low"), (r"block_[23]/", "high")])
    found = residuals([1, 0, 0, 0], [1, 0, 0, 0])
    with pytest.raises(ValueError, match="'block_\\[23\\]/' matches no leaf"):
        rules(found)
    assert set(residual_analysis.sharing_report(found, rules)) == {"low"}
