"""RotorSequential: Flax linen layers as a checkpointed chain (BatchNorm, dropout, budgets)."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resireduce_jax.remat import Plan, RotorSequential, baselines


class ConvBlock(nn.Module):
    features: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, *, train: bool = False):
        y = nn.relu(
            nn.BatchNorm(use_running_average=not train, momentum=0.9)(
                nn.Conv(self.features, (3, 3))(x)
            )
        )
        if self.dropout:  # XLA:CPU compiles PRNG bit generation slowly: one dropout layer
            y = nn.Dropout(self.dropout, deterministic=not train)(y)
        return y if y.shape != x.shape else x + y


class Head(nn.Module):
    classes: int

    @nn.compact
    def __call__(self, x):  # takes no `train`: RotorSequential passes only what it accepts
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


def layers():
    return [ConvBlock(8), ConvBlock(8), ConvBlock(16, 0.2), ConvBlock(16), ConvBlock(16), Head(10)]


@pytest.fixture(scope="module")
def setup():
    model = RotorSequential(layers())
    images = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8, 8, 3)), jnp.float32)
    variables = jax.jit(lambda key: model.init(key, images, train=False))(jax.random.key(0))
    return model, variables, images


def test_init_and_apply_match_the_layers_run_in_turn(setup):
    model, variables, images = setup
    assert set(variables) == {"params", "batch_stats"}
    assert sorted(variables["params"]) == [f"layers_{i}" for i in range(6)]
    assert "layers_5" not in variables["batch_stats"]
    h = images
    for i, layer in enumerate(model.layers):
        layer_vars = {
            c: tree[f"layers_{i}"] for c, tree in variables.items() if f"layers_{i}" in tree
        }
        h = layer.apply(layer_vars, h)
    np.testing.assert_allclose(model.apply(variables, images), h, rtol=1e-6)


def test_training_step_matches_without_checkpointing(setup):
    model, variables, images = setup
    labels = jnp.arange(8) % 10
    key = jax.random.key(3)

    def loss_fn(params, model):
        logits, updates = model.apply(
            {**variables, "params": params},
            images,
            train=True,
            mutable=["batch_stats"],
            rngs={"dropout": key},
        )
        loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))
        return loss, updates

    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=1)
    (loss0, updates0), grads0 = step(variables["params"], model)
    for plan in (
        baselines.every_stage(6),
        Plan.from_json([[[0, 1], 2], 3, [4], 5], 6),
    ):
        planned = RotorSequential(model.layers, plan=plan)
        (loss, updates), grads = step(variables["params"], planned)
        np.testing.assert_allclose(loss, loss0, rtol=1e-6)
        chex.assert_trees_all_close(grads, grads0, rtol=1e-5, atol=1e-6)
        # Batch statistics are updated once, by the forward pass, not by recomputations.
        chex.assert_trees_all_close(updates, updates0, rtol=1e-6, atol=1e-7)
    assert set(updates0["batch_stats"]) == {f"layers_{i}" for i in range(5)}


def test_with_budget_fits_the_compiled_training_gradient():
    model = RotorSequential([ConvBlock(8), ConvBlock(8, 0.2), ConvBlock(8), Head(10)])
    images = jax.ShapeDtypeStruct((8, 8, 8, 3), jnp.float32)
    # Abstract parameters: planning compiles but allocates nothing of the model.
    variables = jax.eval_shape(
        lambda key: model.init(key, jnp.zeros(images.shape), train=False), jax.random.key(0)
    )
    planned, choice = model.with_budget(
        variables,
        images,
        0.85,
        train=True,
        mutable=["batch_stats"],
        rngs={"dropout": jax.random.key(1)},
        loss=lambda logits: jnp.sum(jax.nn.logsumexp(logits, axis=-1)),
    )
    assert planned.plan == choice.plan
    assert choice.plan.num_checkpoints > 0
    assert choice.compiled.peak <= 0.85 * choice.no_remat.peak
    assert choice.compiled.flops > choice.no_remat.flops


def test_rejects_bad_layers_and_plans():
    with pytest.raises(ValueError, match="at least one layer"):
        RotorSequential([])
    with pytest.raises(ValueError, match=r"not a flax\.linen Module"):
        RotorSequential([lambda x: x])
    with pytest.raises(ValueError, match="plan is for 3 stages"):
        RotorSequential(layers(), plan=Plan.unwrapped(3))
