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
import peak_memory

SIZES = {
    "transformer": dict(vocab=4096, width=256, depth=4, tokens=32, batch=4),
    "conv": dict(channels=(3, 32, 32, 64, 64), batch=8),
    "mlp": dict(width=512, depth=4, batch=8, features=128, classes=100),
}


def peak(model: str, variant: str, optimizer: str, guard: str) -> dict:
    return guard_cost.compile_peak(model, variant, optimizer, guard, **SIZES[model])


@pytest.mark.parametrize("model", list(SIZES))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw_r"])
def test_default_guard_costs_at_most_two_percent_of_the_unguarded_peak(model, optimizer):
    """Goal 1 for the default ("loss") mode: decided before the backward pass, so no
    gradient waits for it (at this size: -5.9 % to +0.1 %)."""
    for variant in ("ef", "w+2d"):
        plain = peak(model, variant, optimizer, "none")["peak"]
        assert peak(model, variant, optimizer, "loss")["peak"] <= 1.02 * plain


def test_strict_and_lean_modes_pay_for_their_late_decision():
    """Strict and lean decide from every gradient, after the backward pass. Where the peak
    is mid-backward (the transformer) that is free; where it is early in the backward pass
    (conv) or gradients dominate (MLP) they hold every gradient or exchanged mean until the
    decision: at this size strict +5.8 % / +13.4 %, lean +15.8 % / +13.6 % with SGD-m
    (docs/design.md, "The non-finite guard"). Pinned so that it cannot silently get worse,
    and so that the default mode's advantage stays measured."""
    bounds = {"transformer": (1.02, 1.02), "conv": (1.07, 1.20), "mlp": (1.15, 1.16)}
    for model, (strict_bound, lean_bound) in bounds.items():
        plain = peak(model, "ef", "sgd", "none")["peak"]
        loss = peak(model, "ef", "sgd", "loss")["peak"]
        strict = peak(model, "ef", "sgd", "strict")["peak"]
        assert strict <= strict_bound * plain
        assert peak(model, "ef", "sgd", "lean")["peak"] <= lean_bound * plain
        if model != "transformer":
            assert strict > 1.02 * loss


# Goal 2 (peak drop >= 0.9 x residual saving) holds on the conv stack in both modes. On
# the test-size transformer w+2d reaches 0.74 unguarded and strict (see guard_cost.md for the
# benchmark's size): its peak is the tied embedding's exchange, where the compensated
# embedding and the |G~| buffer Top-k reads (2 x 4 MiB) are alive beside the forward
# activations, while EF's peak is mid-backward (live-buffer dump: ``benchmarks/
# peak_memory.py --explain``). Pinned here so it cannot silently get worse.
DROP_BOUND = {"conv": 0.9, "transformer": 0.7}


@pytest.mark.parametrize("model", ["transformer", "conv"])
@pytest.mark.parametrize("guard", ["none", "loss", "strict"])
def test_resireduce_peak_drop_against_its_state_saving(model, guard):
    """w+2d's peak drop against EF over its residual saving; its temp may exceed EF's by
    at most 4 % of EF's peak. Test-size transformer: +2.3 MiB (3.3 %) unguarded, +2.4 MiB
    (3.4 %) strict: a shared group's running sum is one member-sized buffer alive while
    the old group residual is still read, and the compensated gradients of grouped and
    2-D-stored leaves live in temporaries where EF compensates in the donated residual."""
    ef, rr = peak(model, "ef", "sgd", guard), peak(model, "w+2d", "sgd", guard)
    saving = ef["residual_bytes"] - rr["residual_bytes"]
    assert saving > 0
    assert ef["peak"] - rr["peak"] >= DROP_BOUND[model] * saving
    assert rr["temp"] <= ef["temp"] + 0.04 * ef["peak"]


def large_copies(step: dict) -> list[tuple[str, str, str]]:
    """Copies in the step as large as the smallest compressed leaf (10,000 float32), apart
    from layout transposes and buffers filled from a constant (the zeros a scatter-add
    starts from)."""
    return [
        (c["shape"], c["origin"], c["source"])
        for c in peak_memory.copies(step["hlo"])
        if not (c["fused"] or c["transpose"] or c["origin"] == "constant")
        and c["bytes"] >= 4 * 10_000
    ]


@pytest.mark.parametrize("model", ["transformer", "conv"])
@pytest.mark.parametrize("variant", ["ef", "w+2d"])
def test_donated_step_copies_no_parameter_or_state_buffer(model, variant):
    """Goal 3. No moment or residual is ever copied. Strict, whose decision orders every
    update after the backward pass, copies no weight either; unguarded and in the default
    ("loss") mode XLA copies the weights (their in-place update is not ordered after the
    backward pass's reads), unless ``order_weight_update``. Before the barriers of
    ``parallel.unstack_per_worker`` / ``stack_per_worker``, every EF residual was copied."""
    size = SIZES[model]
    strict = guard_cost.compile_peak(model, variant, "sgd", "strict", keep_hlo=True, **size)
    assert not large_copies(strict)
    for guard in ("none", "loss"):
        step = guard_cost.compile_peak(model, variant, "sgd", guard, keep_hlo=True, **size)
        copied = large_copies(step)
        assert copied and {origin for _, origin, _ in copied} == {"argument: params"}
    ordered = guard_cost.compile_peak(
        model, variant, "sgd", "none", keep_hlo=True, order_weight_update=True, **size
    )
    assert not large_copies(ordered)
