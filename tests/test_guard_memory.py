"""The non-finite guard and ResiReduce's saving at the compiled peak of the donated step.

Two small models of different kinds (a tied-embedding transformer stack and a conv stack,
the models of ``benchmarks/guard_cost.py`` at test size), 8 simulated workers, Top-k 1 %,
compiled from abstract shapes (nothing runs). The figures are exact byte counts of the
compiled programs; ``benchmarks/results/guard_cost.md`` has them at full size.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import guard_cost

SIZES = {
    "transformer": dict(vocab=4096, width=256, depth=4, tokens=32, batch=4),
    "conv": dict(channels=(3, 32, 32, 64, 64), batch=8),
}


def peak(model: str, variant: str, optimizer: str, guard: str) -> dict:
    return guard_cost.compile_peak(model, variant, optimizer, guard, **SIZES[model])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_r"])
def test_guard_costs_at_most_two_percent_of_the_transformer_peak(optimizer):
    """Goal: guard cost <= 2 % with the skip-aware optimizers, in both guard modes."""
    plain = peak("transformer", "ef", optimizer, "none")["peak"]
    for guard in ("lean", "strict"):
        guarded = peak("transformer", "ef", optimizer, guard)["peak"]
        assert guarded <= 1.02 * plain, (guard, guarded / plain)


def test_guard_cost_on_the_conv_stack_is_bounded():
    """The conv stack misses the 2 % goal (measured: strict +5.9 %, lean +19 %, because
    XLA:CPU's scheduler starts the head's exchange while the forward activations are all
    alive; docs/design.md, "The non-finite guard"). Pin what is reached so it cannot
    silently get worse."""
    plain = peak("conv", "ef", "sgd", "none")["peak"]
    assert peak("conv", "ef", "sgd", "strict")["peak"] <= 1.08 * plain
    assert peak("conv", "ef", "sgd", "lean")["peak"] <= 1.25 * plain


@pytest.mark.parametrize("model", ["transformer", "conv"])
def test_resireduce_peak_drop_is_at_least_0_9_of_its_state_saving_unguarded(model):
    """Goal 2 without the guard: w+2d's peak drop against EF >= 0.9 x its residual saving."""
    ef, rr = peak(model, "ef", "sgd", "none"), peak(model, "w+2d", "sgd", "none")
    saving = ef["residual_bytes"] - rr["residual_bytes"]
    assert saving > 0
    assert ef["peak"] - rr["peak"] >= 0.9 * saving
    assert rr["temp"] <= ef["temp"] + 0.02 * ef["peak"]
