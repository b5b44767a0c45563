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
    # Two blocks of width 32 (the config's own model has 3 of width 64): a chain to plan.
    c.model.overrides = {"num_layers": 2, "width": 32, "num_heads": 2, "max_len": 64}
    # One program a run: error feedback on AdamW, no dense warm-up (remat.budget plans the
    # model alone, whatever the exchange and its density phases).
    c.optimizer.name = "adamw"
    c.optimizer.one_buffer, c.optimizer.frozen_nu_format = "off", "float32"  # cm's options
    c.compression.density_schedule.dense_fraction = 0.0
    return c


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for budget in ("1.0", "60%"):
        workdir = tmp_path_factory.mktemp(f"remat_{budget.replace('%', 'pct')}")
        out[budget] = train.train_and_evaluate(tiny_byte_gpt(budget), str(workdir))
    return out


@pytest.mark.xdist_group("remat_training_runs")  # one worker runs `runs` once
def test_the_plan_fits_the_budget_and_recomputes(runs):
    full, lean = runs["1.0"].memory["remat"], runs["60%"].memory["remat"]
    assert full["checkpoints"] == 0 and full["flops_overhead"] == pytest.approx(0.0, abs=1e-6)
    assert full["no_remat_peak_bytes"] == lean["no_remat_peak_bytes"]
    assert lean["budget_bytes"] == pytest.approx(0.6 * lean["no_remat_peak_bytes"], abs=1)
    assert lean["compiled_peak_bytes"] <= lean["budget_bytes"]
    assert lean["checkpoints"] >= 1 and lean["flops_overhead"] > 0


@pytest.mark.xdist_group("remat_training_runs")  # one worker runs `runs` once
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


def test_the_chain_has_the_models_variables_and_outputs():
    import jax
    import jax.numpy as jnp

    from resireduce_jax import models
    from train import remat_model

    overrides = dict(stage_sizes=(1, 1), width=4, num_classes=5, image_size=16)
    config = models.get_config("resnet50_cifar", **overrides)
    images = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16, 16, 3)), jnp.float32)
    chain, choice = remat_model.plan_sequential_model(
        "resnet50_cifar", config, overrides, "96%", {"image": images}
    )
    assert choice.plan.num_checkpoints >= 1
    model = config.build()
    key = jax.random.key(3)
    variables = model.init(key, images)
    # init is the model's: same names, same values.
    jax.tree.map(np.testing.assert_array_equal, chain.init(key, image=images), variables)

    def loss(apply, params):
        logits, updates = apply(
            {**variables, "params": params}, images, train=True, mutable=["batch_stats"]
        )
        return jnp.sum(logits**2), updates

    def chain_apply(v, x, **kw):
        return chain.apply(v, image=x, **kw)

    expected = jax.jit(jax.grad(lambda p: loss(model.apply, p), has_aux=True))(variables["params"])
    got = jax.jit(jax.grad(lambda p: loss(chain_apply, p), has_aux=True))(variables["params"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), got, expected)
