"""The non-finite guard and ResiReduce's saving at the compiled peak of the donated step.

Two small models of different kinds (a tied-embedding transformer stack and a conv stack,
the models of ``benchmarks/guard_cost.py`` at test size), 8 simulated workers, Top-k 1 %,
compiled from abstract shapes (nothing runs). The figures are exact byte counts of the
compiled programs; ``benchmarks/results/guard_cost.md`` has them at full size.
"""

from __future__ import annotations

import functools
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


# The cases below overlap (e.g. EF with SGD unguarded is asked for by four tests): each is
# compiled once per worker, and this module's tests share a worker.
pytestmark = pytest.mark.xdist_group("guard_memory")


@functools.cache
def compiled_step(
    model: str, variant: str, optimizer: str, guard: str, weight_update_order: str | None = None
) -> dict:
    """``guard_cost.compile_peak`` of one case at ``SIZES[model]``, with its optimized HLO."""
    return guard_cost.compile_peak(
        model,
        variant,
        optimizer,
        guard,
        keep_hlo=True,
        weight_update_order=weight_update_order,
        **SIZES[model],
    )


def peak(model: str, variant: str, optimizer: str, guard: str) -> dict:
    return compiled_step(model, variant, optimizer, guard)


@pytest.mark.parametrize("model", list(SIZES))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw_r", "adan_r"])
def test_default_guard_costs_at_most_two_percent_of_the_unguarded_peak(model, optimizer):
    """Goal 1 for the default ("loss") mode: decided before the backward pass, so no
    gradient waits for it (at this size: -5.9 % to +0.1 %). Adan-R hands a skipped step's
    previous gradient over before its update (up to +16 % here when it selected it
    after)."""
    for variant in ("ef", "w+2d"):
        plain = peak(model, variant, optimizer, "none")["peak"]
        assert peak(model, variant, optimizer, "loss")["peak"] <= 1.02 * plain


def test_strict_and_lean_modes_pay_for_their_late_decision():
    """Strict and lean decide from every gradient, after the backward pass. Where the peak
    is mid-backward (the transformer) that is free; where gradients dominate (MLP) they
    hold every gradient or exchanged mean until the decision: at this size strict +22.2 %,
    lean +20.5 % with SGD-m (docs/design.md, "The non-finite guard"). On the conv stack,
    whose peak is early in the backward pass, strict costs +1.9 % and lean +12.6 % since
    the backward pass streams (``rr.backward_order``; +5.8 % / +15.6 % before). Pinned so
    that it cannot silently get worse, and so that the default mode's advantage stays
    measured."""
    bounds = {"transformer": (1.02, 1.02), "conv": (1.04, 1.15), "mlp": (1.23, 1.21)}
    for model, (strict_bound, lean_bound) in bounds.items():
        plain = peak(model, "ef", "sgd", "none")["peak"]
        loss = peak(model, "ef", "sgd", "loss")["peak"]
        strict = peak(model, "ef", "sgd", "strict")["peak"]
        assert strict <= strict_bound * plain
        assert peak(model, "ef", "sgd", "lean")["peak"] <= lean_bound * plain
        if model == "mlp":
            assert strict > 1.1 * loss


# Goal 2 (peak drop >= 0.9 x residual saving). Measured: conv stack 0.95 unguarded and
# default, 1.00 strict; test-size transformer 0.99 unguarded and default, 0.93 strict
# (0.84 before the shared group's compensation and running sum were written in place). The
# transformer's peak used to be its tied embedding's exchange (0.78), where the
# compensated embedding, the |G~| buffer Top-k read and |r| for the 2-D store's norms were
# alive at once: maps over temporaries are now written over their operand
# (``resireduce_jax._src.in_place``; docs/design.md, "Residuals at the compiled peak").
DROP_BOUND = {"none": 0.9, "loss": 0.9, "strict": 0.9}
TEMP_MARGIN = {"none": 0.01, "loss": 0.01, "strict": 0.03}


@pytest.mark.parametrize("model", ["transformer", "conv"])
@pytest.mark.parametrize("guard", ["none", "loss", "strict"])
def test_resireduce_peak_drop_against_its_state_saving(model, guard):
    """w+2d's peak drop against EF over its residual saving; its temp exceeds EF's by at
    most 1 % of EF's peak (3 % strict). Measured: +0.1 MiB (0.2 %) unguarded and default on
    both models; strict +0.6 MiB (0.9 %) on the transformer (+1.5 MiB while a shared
    group's running sum had a buffer of its own beside the held gradients)."""
    ef, rr = peak(model, "ef", "sgd", guard), peak(model, "w+2d", "sgd", guard)
    saving = ef["residual_bytes"] - rr["residual_bytes"]
    assert saving > 0
    assert ef["peak"] - rr["peak"] >= DROP_BOUND[guard] * saving
    assert rr["temp"] <= ef["temp"] + TEMP_MARGIN[guard] * ef["peak"]


def large_copies(step: dict) -> list[tuple[str, str, str]]:
    """Copies in the step as large as the smallest compressed leaf (10,000 float32), apart
    from layout transposes. Zero fills are not copied either: each exchange's accumulator
    has its own (``compressors.base.zeros_for``), where the leaves of one shape used to
    start from copies of one shared fill."""
    return [
        (c["shape"], c["origin"], c["source"])
        for c in peak_memory.copies(step["hlo"])
        if not (c["fused"] or c["transpose"]) and c["bytes"] >= 4 * 10_000
    ]


@pytest.mark.parametrize("model", ["transformer", "conv"])
@pytest.mark.parametrize("variant", ["ef", "w+2d"])
def test_donated_step_copies_no_parameter_or_state_buffer(model, variant):
    """Goal 3, in every guard mode: no weight, moment or residual is copied. The weights
    are updated in place because each update waits for a gradient that the backward
    pass's last read of the old weight precedes (``rr.read_order``); without that order
    (``weight_update_order="unordered"``) XLA copies the weights and only them; the
    barriers of ``parallel.unstack_per_worker`` / ``stack_per_worker`` keep the EF residuals
    from being copied."""
    for guard in ("none", "loss", "strict"):
        assert not large_copies(compiled_step(model, variant, "sgd", guard)), guard
    unordered = compiled_step(model, variant, "sgd", "none", weight_update_order="unordered")
    copied = large_copies(unordered)
    assert copied and {origin for _, origin, _ in copied} == {"argument: params"}


@pytest.mark.parametrize("model", ["transformer", "mlp"])
def test_adan_r_train_step_copies_no_previous_gradient(model):
    """Adan-R's hand-over of the previous gradient in a donated train step: the new one is
    written into the old one's buffer after the ``n`` update, its other reader, and the
    later states read it from there, so XLA neither copies the old one away nor the new one
    into place, with or without the guard."""
    for guard in ("none", "loss", "strict"):
        assert not large_copies(compiled_step(model, "ef", "adan_r", guard)), guard
