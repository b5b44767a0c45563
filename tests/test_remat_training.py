"""``remat.budget`` in the training program: a rotor plan that fits and changes nothing else."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_train import load_config
from train import train


def tiny_byte_gpt(budget: str):
    c = load_config("byte_gpt")
    c.num_steps = 4
    c.log_every = 2
    c.eval_every = 4
    c.checkpoint_every = 4
    c.num_workers = 4
    c.batch_size_per_worker = 2
    c.remat.budget = budget
    return c


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for budget in ("1.0", "60%"):
        workdir = tmp_path_factory.mktemp(f"remat_{budget.replace('%', 'pct')}")
        out[budget] = train.train_and_evaluate(tiny_byte_gpt(budget), str(workdir))
    return out


def test_the_plan_fits_the_budget_and_recomputes(runs):
    full, lean = runs["1.0"].memory["remat"], runs["60%"].memory["remat"]
    assert full["checkpoints"] == 0 and full["flops_overhead"] == pytest.approx(0.0, abs=1e-6)
    assert full["no_remat_peak_bytes"] == lean["no_remat_peak_bytes"]
    assert lean["budget_bytes"] == pytest.approx(0.6 * lean["no_remat_peak_bytes"], abs=1)
    assert lean["compiled_peak_bytes"] <= lean["budget_bytes"]
    assert lean["checkpoints"] >= 1 and lean["flops_overhead"] > 0


def test_checkpointing_does_not_change_training(runs):
    full, lean = runs["1.0"], runs["60%"]
    np.testing.assert_allclose(lean.train["loss"], full.train["loss"], rtol=1e-5)
    np.testing.assert_allclose(lean.eval["loss"], full.eval["loss"], rtol=1e-5)


def test_budget_errors_are_clear():
    with pytest.raises(ValueError, match=r"remat\.budget='lots'"):
        train.build_run(tiny_byte_gpt("lots"))
    with pytest.raises(ValueError, match="below the smallest compiled peak"):
        train.build_run(tiny_byte_gpt("1%"))
    digits = load_config("default")
    digits.remat.budget = "0.5"
    with pytest.raises(ValueError, match="no sequential form"):
        train.build_run(digits)
