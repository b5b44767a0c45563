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
}


def peak(model: str, variant: str, optimizer: str, guard: str) -> dict:
    return guard_cost.compile_peak(model, variant, optimizer, guard, **SIZES[model])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_r"])
def test_guard_costs_at_most_two_percent_of_the_transformer_peak(optimizer):
    """Goal 1 for the default (strict) guard: <= 2 % with the skip-aware optimizers.

    Lean mode is pinned at what it reaches (+3.2 % SGD-m, +2.6 % AdamW-R at this size):
    its exchange streams, so the exchanged means wait for the late decision of the
    skip-aware optimizers; docs/design.md, "The non-finite guard"."""
    plain = peak("transformer", "ef", optimizer, "none")["peak"]
    assert peak("transformer", "ef", optimizer, "strict")["peak"] <= 1.02 * plain
    assert peak("transformer", "ef", optimizer, "lean")["peak"] <= 1.04 * plain


def test_guard_cost_on_the_conv_stack():
    """The conv stack misses the 2 % goal: at this size strict +5.9 %, lean +15.7 % (at the
    benchmark's size +2.8 % / +5.1 %, ``benchmarks/results/guard_cost.md``). The peak is
    early in the backward pass; strict keeps every gradient for the decision where the
    unguarded step streams them into the exchange, and lean's exchange starts while the
    forward activations are alive (docs/design.md, "The non-finite guard"). Pinned at what
    is reached so it cannot silently get worse."""
    plain = peak("conv", "ef", "sgd", "none")["peak"]
    assert peak("conv", "ef", "sgd", "strict")["peak"] <= 1.07 * plain
    assert peak("conv", "ef", "sgd", "lean")["peak"] <= 1.20 * plain


# Goal 2 (peak drop >= 0.9 x residual saving) holds on the conv stack in both modes. On
# the test-size transformer w+2d reaches 0.74 unguarded and strict (see guard_cost.md for the
# benchmark's size): its peak is the tied embedding's exchange, where the compensated
# embedding and the |G~| buffer Top-k reads (2 x 4 MiB) are alive beside the forward
# activations, while EF's peak is mid-backward (live-buffer dump: ``benchmarks/
# peak_memory.py --explain``). Pinned here so it cannot silently get worse.
DROP_BOUND = {"conv": 0.9, "transformer": 0.7}


@pytest.mark.parametrize("model", ["transformer", "conv"])
@pytest.mark.parametrize("guard", ["none", "strict"])
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
    """Goal 3. Guarded (the default), the step copies no weight, moment or residual;
    unguarded, only the weights are copied (their in-place update is not ordered after
    the backward pass's reads), unless ``order_weight_update``. Before the barriers of
    ``parallel.unstack_per_worker`` / ``stack_per_worker``, every EF residual was copied."""
    size = SIZES[model]
    strict = guard_cost.compile_peak(model, variant, "sgd", "strict", keep_hlo=True, **size)
    assert not large_copies(strict)
    plain = guard_cost.compile_peak(model, variant, "sgd", "none", keep_hlo=True, **size)
    copied = large_copies(plain)
    assert copied and {origin for _, origin, _ in copied} == {"argument: params"}
    ordered = guard_cost.compile_peak(
        model, variant, "sgd", "none", keep_hlo=True, order_weight_update=True, **size
    )
    assert not large_copies(ordered)
