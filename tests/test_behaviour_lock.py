"""Results a refactor of the exchange must keep bit for bit, recorded from the code before
the stores became objects: the byte GPT's parameters after 20 steps of the training
program and its step's compiled figures (EF, w+2d, the compressed-momentum recipe with
w+2d). A change here is a change of behaviour: it needs a reason, not a new digest.

The parameters' bits depend on the machine as well as the code (XLA's CPU code generation
follows the host's instruction set), so the digests are recorded per machine numerics: a
sha256 of the model's initial parameters and first gradient, which no exchange code
touches. A digest recorded for the test's program passes anywhere; another one fails where
the machine's numerics are recorded and skips where they are not (record them with
``python -m tests.test_behaviour_lock``). The compiled figures hold on every machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import sys
import tempfile

import jax
import numpy as np
import pytest

from train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import peak_memory  # noqa: E402  (benchmarks/peak_memory.py: GPT-2 medium width's sizes)

# name: (config changes, the first phase's compiled step: argument, output, alias and temp
# bytes per device)
RECORDED = {
    "ef_adamw": ({"variant": "ef", "optimizer": "adamw"}, (2720560, 2719617, 2718480, 13267168)),
    "w+2d_adamw": (
        {"variant": "w+2d", "optimizer": "adamw"},
        (2327344, 2326337, 2325264, 13267680),
    ),
    "w+2d_recipe": ({}, (2327344, 2326337, 2325264, 13261136)),
}
# Machine numerics (_numerics) -> {name: params sha256 after 20 steps}. The first machine's
# numerics were not recorded with its digests.
DIGESTS = {
    "unrecorded": {
        "ef_adamw": "7c4a2ef242478c1f066af8e4999ae71a72f1102c3e59347f6ab0207318f364c9",
        "w+2d_adamw": "34cc16747a85ad0ed1bf68390dd6fef255ce3e72d8a0b9c0abc770f0bfd5957f",
        "w+2d_recipe": "cbb92104a97923e3c085843ded8fb42ccda023e5e8d77655bcd0f3d3a2cb127d",
    },
    "b5b2402df805b16fbe8f37c22154cf8484eb0b86c9d8af787b57e5017275cfa1": {
        "ef_adamw": "742ff80eacb572c2624294ca894dfd1d7eb0b9877bac2f18c5749e0b9bc7ae85",
        "w+2d_adamw": "43819f18a96b3a97b8b3e9e766476de978e85fbfa394fb0a39b12567d678c2fe",
        "w+2d_recipe": "059e962fa98a0c514af610ac06d0f9c71291fa756f836f3f25f38d679595226d",
    },
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


def _numerics() -> str:
    """sha256 of the byte GPT's initial parameters and their gradient on the first batch,
    compiled under this session's flags: what the machine makes of the model's arithmetic."""
    run = train.build_run(_byte_gpt(RECORDED["ef_adamw"][0]))
    config = run.config
    batch = run.dataset.train_batch(0, run.global_batch, 0, 1)
    batch = {k: v[: config.batch_size_per_worker] for k, v in batch.items()}
    key = jax.random.PRNGKey(config.seed)
    variables = dict(jax.jit(run.task.init)(key, batch))
    params = variables.pop("params")
    loss = lambda p: run.task.loss(p, variables, batch, key)[0]
    grad = jax.jit(jax.grad(loss))(params)
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves((params, grad)):
        digest.update(np.asarray(leaf).tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def numerics() -> str:
    return _numerics()


def _train(name: str, workdir: str):
    summary = train.train_and_evaluate(_byte_gpt(RECORDED[name][0]), workdir)
    assert summary.step == 20
    return summary


@pytest.mark.parametrize("name", list(RECORDED))
def test_byte_gpt_twenty_steps_are_bit_identical_to_the_recorded_run(name, tmp_path, numerics):
    summary = _train(name, str(tmp_path))
    (row,) = summary.memory["compiled_peak"]["rows"]
    assert (row["argument"], row["output"], row["alias"], row["temp"]) == RECORDED[name][1]
    if summary.params_digest in {digests[name] for digests in DIGESTS.values()}:
        return
    if numerics not in DIGESTS:
        pytest.skip(f"this machine's numerics ({numerics}) are not recorded; the params differ")
    assert summary.params_digest == DIGESTS[numerics][name]


@pytest.mark.parametrize("variant", list(GPT2_MEDIUM))
def test_gpt2_medium_width_compiled_step_is_the_recorded_one(variant):
    step = peak_memory._compile(peak_memory.CASES["gpt2_medium"], variant, True)
    peak = step.peak
    assert (peak.argument, peak.output, peak.alias, peak.temp) == GPT2_MEDIUM[variant]


if __name__ == "__main__":  # prints this machine's numerics and digests, for DIGESTS
    import tests.conftest  # noqa: F401  (the test session's XLA flags and 8 CPU devices)

    print(f"{_numerics()!r}: {{")
    for name in RECORDED:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            digest = _train(name, tempfile.mkdtemp()).params_digest
        print(f"    {name!r}: {digest!r},")
    print("}")
