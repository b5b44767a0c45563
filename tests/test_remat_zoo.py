"""The zoo's models as layer chains compute what the monolithic modules compute."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resireduce_jax.models import get_config, get_model
from resireduce_jax.remat import RotorSequential
from resireduce_jax.remat.zoo import sequential_layers


def init_both(name, inputs, **overrides):
    model = get_model(name, **overrides)
    chain = RotorSequential(sequential_layers(name, **overrides))
    variables = jax.jit(lambda k: model.init(k, inputs))(jax.random.key(0))
    chain_vars = jax.jit(lambda k: chain.init(k, inputs))(jax.random.key(1))
    return model, chain, variables, chain_vars


def test_resnet_chain_equals_resnet():
    overrides = dict(stage_sizes=(1, 2), width=4, num_classes=5, image_size=8)
    images = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 8, 3)), jnp.float32)
    model, chain, variables, chain_vars = init_both("resnet50_cifar", images, **overrides)
    assert len(chain.layers) == 1 + 3 + 1
    names = ["stem", "layer1_0", "layer2_0", "layer2_1", "head"]
    mapped = {}
    for collection, tree in variables.items():
        mapped[collection] = {}
        for i, name in enumerate(names):
            if name == "stem":
                sub = {k: tree[k] for k in ("conv1", "bn1") if k in tree}
            elif name == "head":
                sub = {"fc": tree["fc"]} if "fc" in tree else {}
            else:
                sub = tree[name]
            if sub:
                mapped[collection][f"layers_{i}"] = sub
    # Same parameters, same structure: the chain's shapes agree with the model's.
    assert jax.tree.map(jnp.shape, mapped) == jax.tree.map(jnp.shape, chain_vars)
    train = dict(train=True, mutable=["batch_stats"])
    out, updates = jax.jit(lambda v: chain.apply(v, images, **train))(mapped)
    expected, expected_updates = jax.jit(lambda v: model.apply(v, images, **train))(variables)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        updates["batch_stats"]["layers_2"]["bn2"]["mean"],
        expected_updates["batch_stats"]["layer2_0"]["bn2"]["mean"],
        rtol=1e-5,
        atol=1e-6,
    )


def test_gpt2_chain_equals_gpt2_with_the_head_untied():
    overrides = dict(num_layers=2, width=16, num_heads=2, vocab_size=50, max_len=8)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 50, (2, 8)), jnp.int32)
    model, chain, variables, chain_vars = init_both("gpt2_small", tokens, **overrides)
    p = variables["params"]
    mapped = {
        "params": {
            "layers_0": {"wte": p["wte"], "wpe": p["wpe"]},
            "layers_1": p["h_0"],
            "layers_2": p["h_1"],
            "layers_3": {"ln_f": p["ln_f"], "lm_head": {"kernel": p["wte"]["embedding"].T}},
        }
    }
    assert jax.tree.map(jnp.shape, mapped) == jax.tree.map(jnp.shape, chain_vars)
    np.testing.assert_allclose(
        jax.jit(lambda v: chain.apply(v, tokens))(mapped),
        jax.jit(lambda v: model.apply(v, tokens))(variables),
        rtol=1e-5,
        atol=1e-5,
    )


def test_vit_chain_equals_vit():
    overrides = dict(image_size=8, patch_size=4, num_layers=2, width=16, num_heads=2, num_classes=3)
    images = jnp.asarray(np.random.default_rng(2).normal(size=(2, 8, 8, 3)), jnp.float32)
    model, chain, variables, chain_vars = init_both("vit_s16", images, **overrides)
    p = variables["params"]
    mapped = {
        "params": {
            "layers_0": {k: p[k] for k in ("patch_embed", "cls_token", "pos_embed")},
            "layers_1": p["blocks_0"],
            "layers_2": p["blocks_1"],
            "layers_3": {"norm": p["norm"], "head": p["head"]},
        }
    }
    assert jax.tree.map(jnp.shape, mapped) == jax.tree.map(jnp.shape, chain_vars)
    np.testing.assert_allclose(
        jax.jit(lambda v: chain.apply(v, images))(mapped),
        jax.jit(lambda v: model.apply(v, images))(variables),
        rtol=1e-5,
        atol=1e-5,
    )


def test_other_models_are_rejected():
    assert get_config("digits_mlp") is not None
    with pytest.raises(ValueError, match="no sequential form"):
        sequential_layers("digits_mlp")
