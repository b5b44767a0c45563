"""Results a refactor of the exchange must keep bit for bit: the byte GPT's parameters after
20 steps of the training program, and its step's compiled peak, recorded from the code
before the stores became objects. A change here is a change of behaviour: it needs a
reason, not a new digest."""

from __future__ import annotations

import importlib.util
import os

import pytest

from train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
    "recipe": (
        {},
        "cbb92104a97923e3c085843ded8fb42ccda023e5e8d77655bcd0f3d3a2cb127d",
        (2327344, 2326337, 2325264, 13261136),
    ),
    "recipe_ef": (
        {"variant": "ef"},
        "480730c5a02f12864b7c93eb3e67d7020dc1a1f9f9961ae584457703fabc4df8",
        (2720560, 2719617, 2718480, 13261904),
    ),
}


def _byte_gpt(changes: dict):
    path = os.path.join(ROOT, "configs", "byte_gpt.py")
    spec = importlib.util.spec_from_file_location("configs_byte_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.num_steps = config.eval_every = config.checkpoint_every = config.log_every = 20
    if "variant" in changes:
        config.compression.variant = changes["variant"]
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
