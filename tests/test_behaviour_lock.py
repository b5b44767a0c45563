"""Results a refactor of the exchange must keep bit for bit, recorded from the code before
the stores became objects: the byte GPT's parameters after 20 steps of the training
program and its step's compiled figures (EF, w+2d, the compressed-momentum recipe with
w+2d). A change here is a change
of behaviour: it needs a reason, not a new digest."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import peak_memory  # noqa: E402  (benchmarks/peak_memory.py: GPT-2 medium width's sizes)

# name: (config changes, params sha256 after 20 steps, the first phase's compiled step:
# argument, output, alias and temp bytes per device)
RECORDED = {
    "ef_adamw": (
        {"variant": "ef", "optimizer": "adamw"},
        "7c4a2ef242478c1f066af8e4999ae71a72f1102c3e59347f6ab0207318f364c9",
        (2720560, 2719617, 2718480, 13267168),
    ),
    "w+2d_adamw": (
        {"variant": "w+2d", "optimizer": "adamw"},
        "34cc16747a85ad0ed1bf68390dd6fef255ce3e72d8a0b9c0abc770f0bfd5957f",
        (2327344, 2326337, 2325264, 13267680),
    ),
    "w+2d_recipe": (
        {},
        "cbb92104a97923e3c085843ded8fb42ccda023e5e8d77655bcd0f3d3a2cb127d",
        (2327344, 2326337, 2325264, 13261136),
    ),
}


# GPT-2 medium width (peak_memory.py's case: 3 blocks, 1x128 tokens per worker, 8
# workers), guarded step: argument, output, alias and temp bytes per device.
GPT2_MEDIUM = {
    "ef": (1444672028, 1444672641, 1444671504, 309821088),
    "w+2d": (1189720764, 1189721329, 1189720240, 273735264),
}


def _byte_gpt(changes: dict):
    path = os.path.join(ROOT, "configs", "byte_gpt.py")
    spec = importlib.util.spec_from_file_location("configs_byte_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.num_steps = config.eval_every = config.checkpoint_every = config.log_every = 20
    # The recorded programs, whatever the config's defaults: float32 residuals, the momentum
    # in its own buffer, the recipe's store w+2d.
    config.compression.variant = changes.get("variant", "w+2d")
    config.compression.residual_format = ""
    config.optimizer.one_buffer = "off"
    config.optimizer.frozen_nu_format = "float32"
    if "optimizer" in changes:  # error feedback on the optimizer itself, no warm-up
        config.optimizer.name = changes["optimizer"]
        config.compression.density_schedule.dense_fraction = 0.0
    return config


@pytest.mark.parametrize("name", list(RECORDED))
def test_byte_gpt_twenty_steps_are_bit_identical_to_the_recorded_run(name, tmp_path):
    changes, digest, figures = RECORDED[name]
    summary = train.train_and_evaluate(_byte_gpt(changes), str(tmp_path))
    assert summary.step == 20
    assert summary.params_digest == digest
    (row,) = summary.memory["compiled_peak"]["rows"]
    assert (row["argument"], row["output"], row["alias"], row["temp"]) == figures


@pytest.mark.parametrize("variant", list(GPT2_MEDIUM))
def test_gpt2_medium_width_compiled_step_is_the_recorded_one(variant):
    step = peak_memory._compile(peak_memory.CASES["gpt2_medium"], variant, True)
    peak = step.peak
    assert (peak.argument, peak.output, peak.alias, peak.temp) == GPT2_MEDIUM[variant]
