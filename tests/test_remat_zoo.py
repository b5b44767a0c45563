"""The zoo's models as layer chains compute what the monolithic modules compute."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resireduce_jax.models import get_config, get_model
from resireduce_jax.remat import RotorSequential, baselines
from resireduce_jax.remat.zoo import model_chain, sequential_layers


def shapes(tree):
    return jax.tree.map(jnp.shape, tree)


def check_chain(name, inputs, *, blocks, mutable=False, **overrides):
    """Chain == model: names, init shapes, outputs, updates and gradients."""
    model = get_model(name, **overrides)
    chain = model_chain(name, **overrides)
    rotor = RotorSequential(chain.layers)
    assert len(rotor.layers) == blocks + 2
    variables = jax.jit(lambda k: model.init(k, inputs))(jax.random.key(0))
    # The chain's own init has the model's variables, under the model's names.
    chain_init = jax.jit(lambda k: rotor.init(k, inputs))(jax.random.key(1))
    assert shapes(chain.model_variables(chain_init)) == shapes(variables)
    # And the model's variables go through the chain and back unchanged.
    assert jax.tree.all(
        jax.tree.map(
            lambda a, b: a is b, chain.model_variables(chain.chain_variables(variables)), variables
        )
    )
    kw = dict(train=True, mutable=mutable) if mutable else {}
    # A plan that checkpoints every stage: recomputation must not change anything either.
    planned = RotorSequential(chain.layers, plan=baselines.every_stage(len(chain.layers)))

    def model_loss(params, others):
        out = model.apply({"params": params, **others}, inputs, **kw)
        logits, updates = out if mutable else (out, {})
        return jnp.sum(logits**2), (logits, updates)

    def chain_loss(params, others, rotor=rotor):
        v = chain.chain_variables({"params": params, **others})
        out = rotor.apply(v, inputs, **kw)
        logits, updates = out if mutable else (out, {})
        return jnp.sum(logits**2), (logits, chain.model_variables(updates))

    params = variables["params"]
    others = {c: v for c, v in variables.items() if c != "params"}
    grad = jax.jit(jax.grad(model_loss, has_aux=True))
    expected_grads, (expected, expected_updates) = grad(params, others)
    for r in (rotor, planned):
        chain_grad = jax.jit(jax.grad(lambda p, o, r=r: chain_loss(p, o, r), has_aux=True))
        grads, (out, updates) = chain_grad(params, others)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
        assert shapes(grads) == shapes(expected_grads)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
            grads,
            expected_grads,
        )
        assert shapes(updates) == shapes(expected_updates)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
            updates,
            expected_updates,
        )
    return variables


def test_resnet_chain_equals_resnet():
    overrides = dict(stage_sizes=(1, 2), width=4, num_classes=5, image_size=8)
    images = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 8, 3)), jnp.float32)
    variables = check_chain(
        "resnet50_cifar", images, blocks=3, mutable=["batch_stats"], **overrides
    )
    assert sorted(variables["params"]) == ["bn1", "conv1", "fc", "layer1_0", "layer2_0", "layer2_1"]


def test_resnet_imagenet_stem_chain_equals_resnet():
    overrides = dict(stage_sizes=(1,), width=4, num_classes=5, stem="imagenet")
    images = jnp.asarray(np.random.default_rng(3).normal(size=(2, 16, 16, 3)), jnp.float32)
    check_chain("resnet50_cifar", images, blocks=1, mutable=["batch_stats"], **overrides)


def test_gpt2_chain_equals_gpt2_with_the_head_tied():
    overrides = dict(num_layers=2, width=16, num_heads=2, vocab_size=50, max_len=8)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 50, (2, 8)), jnp.int32)
    variables = check_chain("gpt2_small", tokens, blocks=2, **overrides)
    # One token embedding, used by the first and the last stage (the gradient check above
    # adds both uses).
    assert sorted(variables["params"]) == ["h_0", "h_1", "ln_f", "wpe", "wte"]
    chain = model_chain("gpt2_small", **overrides)
    layers = chain.chain_variables(variables)["params"]
    assert layers["layers_0"]["wte"] is layers["layers_3"]["wte"] is variables["params"]["wte"]


def test_vit_chain_equals_vit():
    overrides = dict(image_size=8, patch_size=4, num_layers=2, width=16, num_heads=2, num_classes=3)
    images = jnp.asarray(np.random.default_rng(2).normal(size=(2, 8, 8, 3)), jnp.float32)
    check_chain("vit_s16", images, blocks=2, **overrides)


def test_sequential_layers_are_the_chain_modules():
    layers = sequential_layers("vit_s16", num_layers=3)
    assert [type(layer).__name__ for layer in layers] == ["Embedding", *["Block"] * 3, "Head"]


@pytest.mark.parametrize("name", ["digits_mlp", "bert_base", "vgg19_bn"])
def test_other_models_are_rejected(name):
    assert get_config(name) is not None
    with pytest.raises(ValueError, match="no sequential form"):
        model_chain(name)
