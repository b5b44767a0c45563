"""Model zoo: registry, parameter counts and names (abstract, full size), tiny forward passes.

Full-size models are only traced (``jax.eval_shape``); their parameter counts are checked
against sums of shapes written out here from the papers' hyperparameters and against the
published figures. Forward passes run at tiny sizes against numpy re-implementations.
"""

from __future__ import annotations

import collections
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from resireduce_jax import models, tree_paths

# ---------------------------------------------------------------------------------------
# Helpers


def _count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def _params(name: str, **overrides):
    return _abstract(name, **overrides)["params"]


@functools.cache
def _abstract(name: str, **overrides):
    """``models.abstract_variables``, traced once per model and overrides."""
    return models.abstract_variables(name, **overrides)


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    return {
        tree_paths.path_to_str(p): tuple(x.shape)
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _block_shapes(
    prefix: str, d: int, norms: tuple[str, ...], dense: list[tuple[str, int, int]]
) -> dict[str, tuple[int, ...]]:
    """Expected parameters of one transformer block under ``prefix``: a scale and a bias of
    width ``d`` per LayerNorm in ``norms``; a kernel ``[in, out]`` and a bias per
    ``(name, in, out)`` in ``dense``."""
    shapes = {}
    for ln in norms:
        shapes[f"{prefix}/{ln}/scale"] = shapes[f"{prefix}/{ln}/bias"] = (d,)
    for sub, fan_in, fan_out in dense:
        shapes[f"{prefix}/{sub}/kernel"] = (fan_in, fan_out)
        shapes[f"{prefix}/{sub}/bias"] = (fan_out,)
    return shapes


def _fused_qkv_dense(d: int, qkv: str, proj: str, up: str, down: str) -> list[tuple[str, int, int]]:
    """The dense layers of a GPT-2 / ViT block of width ``d`` as :func:`_block_shapes`
    takes them: fused query-key-value ``d -> 3d``, attention output ``d -> d``, MLP
    ``d -> 4d -> d``."""
    return [(qkv, d, 3 * d), (proj, d, d), (up, d, 4 * d), (down, 4 * d, d)]


def _random_batch(config: models.ModelConfig, batch_size: int, seed: int = 0):
    """A concrete batch with values in each key's valid range."""
    rng = np.random.default_rng(seed)
    batch = {}
    for key, spec in config.example_batch(batch_size).items():
        if jnp.issubdtype(spec.dtype, jnp.floating):
            batch[key] = rng.standard_normal(spec.shape).astype(spec.dtype)
            continue
        high = {
            "tokens": getattr(config, "vocab_size", None),
            "targets": getattr(config, "vocab_size", None),
            "input_ids": getattr(config, "vocab_size", None),
            "token_type_ids": getattr(config, "type_vocab_size", None),
            "label": getattr(config, "num_classes", None),
            "attention_mask": 2,
            "start_positions": getattr(config, "seq_len", None),
            "end_positions": getattr(config, "seq_len", None),
        }[key]
        batch[key] = rng.integers(0, high, spec.shape).astype(spec.dtype)
    return batch


def _inputs(config, batch):
    return {k: jnp.asarray(batch[k]) for k in config.input_names}


def _random_variables(abstract, seed: int):
    """Random values for every variable, so that no bias is zero and no scale is one.

    Compiling ``init`` costs seconds per model; filling the abstract variables from numpy
    costs nothing, and random biases, scales and statistics make the numpy comparisons
    sensitive to every term. ``test_initializers`` covers ``init`` itself.
    """
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name, shape = tree_paths.path_to_str(path).rsplit("/", 1)[-1], leaf.shape
        if name == "kernel":
            value = rng.standard_normal(shape) / np.sqrt(math.prod(shape[:-1]))
        elif name == "scale":
            value = 1 + 0.2 * rng.standard_normal(shape)
        elif name == "var":
            value = rng.uniform(0.5, 1.5, shape)
        elif name in ("bias", "mean"):
            value = 0.2 * rng.standard_normal(shape)
        else:  # embeddings, cls token, position embeddings
            value = 0.5 * rng.standard_normal(shape)
        return jnp.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, abstract)


@functools.cache
def _tiny_cached(name: str, batch_size: int, seed: int, overrides: tuple):
    config = models.get_config(name, **dict(overrides))
    batch = _random_batch(config, batch_size, seed)
    variables = _random_variables(models.abstract_variables(name, **dict(overrides)), seed)
    return config, config.build(), variables, batch


def _tiny(name: str, batch_size: int = 2, seed: int = 0, **overrides):
    """A reduced-size model with random variables and a random batch (cached)."""
    return _tiny_cached(name, batch_size, seed, tuple(sorted(overrides.items())))


@functools.cache
def _apply(model, **static):
    """``model.apply`` compiled (eager op-by-op dispatch is slow), with static keywords."""
    return jax.jit(functools.partial(model.apply, **static))


def _equations(fn, *args):
    """Every equation of ``fn``'s jaxpr, nested jaxprs (jit, custom_vjp ...) included."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from walk(inner)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def _primitive_counts(fn, *args) -> collections.Counter:
    return collections.Counter(eqn.primitive.name for eqn in _equations(fn, *args))


def _matmul_dtypes(fn, *args) -> set:
    """Result dtypes of every matrix multiplication and convolution in ``fn``."""
    kinds = ("dot_general", "conv_general_dilated")
    return {e.outvars[0].aval.dtype for e in _equations(fn, *args) if e.primitive.name in kinds}


def _np(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _np_layer_norm(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def _np_dense(x, p):
    return x @ p["kernel"] + p["bias"]


def _np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _np_gelu_erf(x):
    return 0.5 * x * (1 + special.erf(x / np.sqrt(2)))


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_attention(q, k, v, heads, allowed=None):
    """Per-head attention with numpy loops over heads; ``allowed[b, i, j]`` masks keys."""
    width = q.shape[-1]
    dh = width // heads
    out = np.zeros_like(q)
    for h in range(heads):
        cols = slice(h * dh, (h + 1) * dh)
        scores = q[..., cols] @ np.swapaxes(k[..., cols], 1, 2) / np.sqrt(dh)
        if allowed is not None:
            scores = np.where(allowed, scores, -np.inf)
        out[..., cols] = _np_softmax(scores) @ v[..., cols]
    return out


def _np_fused_attention(x, p_qkv, p_proj, heads, allowed=None):
    q, k, v = np.split(_np_dense(x, p_qkv), 3, axis=-1)
    return _np_dense(_np_attention(q, k, v, heads, allowed), p_proj)


# ---------------------------------------------------------------------------------------
# Registry


ALL_NAMES = {
    "bert_base",
    "bert_large",
    "digits_mlp",
    "resnet50_cifar",
    "vgg19_bn",
    "gpt2_small",
    "gpt2_medium",
    "gpt2_large",
    "byte_gpt",
    "vit_s16",
    "vit_b16",
    "vit_l16",
}


def test_registry_names():
    assert set(models.MODELS) == ALL_NAMES


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown model 'gpt3'.*'gpt2_small'"):
        models.get_model("gpt3")


def test_unknown_override_lists_fields():
    with pytest.raises(ValueError, match=r"no field\(s\) \['depth'\].*'num_layers'"):
        models.get_model("gpt2_small", depth=3)


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("gpt2_small", {"width": 100, "num_heads": 12}, "not divisible"),
        ("gpt2_small", {"num_layers": 0}, "positive integer"),
        ("gpt2_small", {"dropout_rate": 1.0}, r"\[0, 1\)"),
        ("gpt2_small", {"seq_len": 2048}, "exceeds max_len"),
        ("gpt2_small", {"dtype": "int32"}, "floating-point"),
        ("gpt2_small", {"param_dtype": "not_a_dtype"}, "not a dtype"),
        ("vit_b16", {"image_size": 100}, "multiple of patch_size"),
    ],
)
def test_invalid_overrides_raise(name, overrides, message):
    with pytest.raises(ValueError, match=message):
        models.get_config(name, **overrides)


def test_example_batch_and_overrides():
    batch = models.example_batch("byte_gpt", 4, seq_len=32)
    assert batch == {
        "tokens": jax.ShapeDtypeStruct((4, 32), jnp.int32),
        "targets": jax.ShapeDtypeStruct((4, 32), jnp.int32),
    }
    assert models.example_batch("vit_s16", 3)["image"].shape == (3, 224, 224, 3)
    with pytest.raises(ValueError, match="batch_size"):
        models.example_batch("vit_s16", 0)
    config = models.get_config("byte_gpt", num_layers=2, dtype="bfloat16")
    assert config.num_layers == 2 and config.dtype == jnp.bfloat16
    assert models.MODELS["byte_gpt"].num_layers == 4  # the registry is not modified


# ---------------------------------------------------------------------------------------
# Full-size parameter counts and names (abstract only)


def _gpt2_count(layers, width, vocab=50257, positions=1024):
    d = width
    block = (
        2 * d  # ln_1
        + (d * 3 * d + 3 * d)  # attn.c_attn
        + (d * d + d)  # attn.c_proj
        + 2 * d  # ln_2
        + (d * 4 * d + 4 * d)  # mlp.c_fc
        + (4 * d * d + d)  # mlp.c_proj
    )
    return vocab * d + positions * d + layers * block + 2 * d  # wte, wpe, blocks, ln_f


@pytest.mark.parametrize(
    "name, layers, width, published_millions",
    [
        ("gpt2_small", 12, 768, 124.4),
        ("gpt2_medium", 24, 1024, 354.8),
        ("gpt2_large", 36, 1280, 774.0),
    ],
)
def test_gpt2_parameter_count(name, layers, width, published_millions):
    count = _count(_params(name))
    assert count == _gpt2_count(layers, width)
    assert round(count / 1e6, 1) == published_millions


def _vit_count(layers, width, mlp, classes=1000, patch=16, image=224):
    d, tokens = width, (image // patch) ** 2 + 1
    block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * mlp + mlp) + (mlp * d + d)
    stem = patch * patch * 3 * d + d + d + tokens * d  # patch_embed, cls_token, pos_embed
    return stem + layers * block + 2 * d + d * classes + classes


@pytest.mark.parametrize(
    "name, layers, width, mlp, published_millions",
    [
        ("vit_s16", 12, 384, 1536, 22.05),
        ("vit_b16", 12, 768, 3072, 86.57),
        ("vit_l16", 24, 1024, 4096, 304.33),
    ],
)
def test_vit_parameter_count(name, layers, width, mlp, published_millions):
    count = _count(_params(name))
    assert count == _vit_count(layers, width, mlp)
    assert round(count / 1e6, 2) == published_millions


def test_gpt2_parameter_names_and_layouts():
    shapes = _shapes(_params("gpt2_medium"))
    d = 1024
    expected = {"wte/embedding": (50257, d), "wpe/embedding": (1024, d)}
    expected |= {"ln_f/scale": (d,), "ln_f/bias": (d,)}
    dense = _fused_qkv_dense(d, "attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj")
    for i in range(24):
        expected |= _block_shapes(f"h_{i}", d, ("ln_1", "ln_2"), dense)
    assert shapes == expected


def test_vit_parameter_names_and_layouts():
    shapes = _shapes(_params("vit_s16"))
    d = 384
    expected = {
        "patch_embed/kernel": (16, 16, 3, d),  # HWIO
        "patch_embed/bias": (d,),
        "cls_token": (1, 1, d),
        "pos_embed": (1, 197, d),
        "norm/scale": (d,),
        "norm/bias": (d,),
        "head/kernel": (d, 1000),
        "head/bias": (1000,),
    }
    dense = _fused_qkv_dense(d, "attn/qkv", "attn/proj", "mlp/fc1", "mlp/fc2")
    for i in range(12):
        expected |= _block_shapes(f"blocks_{i}", d, ("norm1", "norm2"), dense)
    assert shapes == expected


@pytest.mark.parametrize(
    "name, output_shape",
    [
        ("gpt2_large", (2, 1024, 50257)),
        ("vit_l16", (2, 1000)),
        ("resnet50_cifar", (2, 100)),
        ("vgg19_bn", (2, 1000)),
        ("bert_large", ((2, 384), (2, 384))),
        ("digits_mlp", (2, 10)),
    ],
)
def test_full_size_apply_shapes(name, output_shape):
    config = models.get_config(name)
    model = config.build()
    batch = config.example_batch(2)
    inputs = {k: batch[k] for k in config.input_names}
    variables = _abstract(name)
    out = jax.eval_shape(lambda v, x: model.apply(v, **x), variables, inputs)
    assert jax.tree.map(lambda o: o.shape, out) == output_shape
    assert {o.dtype for o in jax.tree.leaves(out)} == {jnp.dtype(jnp.float32)}


# ---------------------------------------------------------------------------------------
# Tiny forward passes against numpy


_TINY_GPT = dict(vocab_size=61, max_len=16, num_layers=2, width=32, num_heads=4, seq_len=12)


def _np_gpt2(p, tokens, config):
    length = tokens.shape[1]
    x = p["wte"]["embedding"][tokens] + p["wpe"]["embedding"][np.arange(length)]
    causal = np.tril(np.ones((length, length), bool))[None]
    eps = config.layer_norm_epsilon
    for i in range(config.num_layers):
        b = p[f"h_{i}"]
        h = _np_layer_norm(x, b["ln_1"], eps)
        x = x + _np_fused_attention(
            h, b["attn"]["c_attn"], b["attn"]["c_proj"], config.num_heads, causal
        )
        h = _np_layer_norm(x, b["ln_2"], eps)
        x = x + _np_dense(_np_gelu_tanh(_np_dense(h, b["mlp"]["c_fc"])), b["mlp"]["c_proj"])
    x = _np_layer_norm(x, p["ln_f"], eps)
    return x @ p["wte"]["embedding"].T  # tied LM head


def test_gpt2_matches_numpy_reference():
    config, model, variables, batch = _tiny("gpt2_small", **_TINY_GPT)
    logits = _apply(model)(variables, **_inputs(config, batch))
    expected = _np_gpt2(_np(variables["params"]), batch["tokens"], config)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 12, 61)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_gpt2_is_causal():
    config, model, variables, batch = _tiny("gpt2_small", **_TINY_GPT)
    tokens = batch["tokens"]
    changed = tokens.copy()
    t = 5
    changed[:, t] = (changed[:, t] + 1) % config.vocab_size
    apply = _apply(model)
    before = apply(variables, jnp.asarray(tokens))
    after = apply(variables, jnp.asarray(changed))
    np.testing.assert_allclose(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    assert np.all(np.abs(after[:, t:] - before[:, t:]).max(axis=-1) > 1e-3)


def test_gpt2_rejects_too_long_or_float_input():
    _, model, variables, _ = _tiny("gpt2_small", **_TINY_GPT)
    with pytest.raises(ValueError, match="exceeds the 16 learned positions"):
        model.apply(variables, jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(ValueError, match="integer token ids"):
        model.apply(variables, jnp.zeros((1, 4), jnp.float32))


_TINY_VIT = dict(image_size=16, patch_size=4, num_classes=7, num_layers=2, width=32, num_heads=4)


def _np_vit(p, image, config):
    batch, _, _, channels = image.shape
    ps, n = config.patch_size, config.image_size // config.patch_size
    # Patches in row-major order, each flattened as (row, col, channel) like an HWIO kernel.
    patches = image.reshape(batch, n, ps, n, ps, channels).transpose(0, 1, 3, 2, 4, 5)
    patches = patches.reshape(batch, n * n, ps * ps * channels)
    kernel = p["patch_embed"]["kernel"].reshape(ps * ps * channels, config.width)
    x = patches @ kernel + p["patch_embed"]["bias"]
    cls = np.broadcast_to(p["cls_token"], (batch, 1, config.width))
    x = np.concatenate([cls, x], axis=1) + p["pos_embed"]
    eps = config.layer_norm_epsilon
    for i in range(config.num_layers):
        b = p[f"blocks_{i}"]
        h = _np_layer_norm(x, b["norm1"], eps)
        x = x + _np_fused_attention(h, b["attn"]["qkv"], b["attn"]["proj"], config.num_heads)
        h = _np_layer_norm(x, b["norm2"], eps)
        x = x + _np_dense(_np_gelu_erf(_np_dense(h, b["mlp"]["fc1"])), b["mlp"]["fc2"])
    x = _np_layer_norm(x, p["norm"], eps)
    return _np_dense(x[:, 0], p["head"])


def test_vit_matches_numpy_reference():
    config, model, variables, batch = _tiny("vit_b16", **_TINY_VIT)
    logits = _apply(model)(variables, **_inputs(config, batch))
    assert logits.dtype == jnp.float32 and logits.shape == (2, 7)
    expected = _np_vit(_np(variables["params"]), batch["image"], config)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_vit_rejects_wrong_image_size():
    _, model, variables, _ = _tiny("vit_b16", **_TINY_VIT)
    with pytest.raises(ValueError, match="set image_size"):
        model.apply(variables, jnp.zeros((1, 32, 32, 3)))


# ---------------------------------------------------------------------------------------
# Convolutional networks: ResNet-50 and VGG-19-bn


def _resnet50_shapes(num_classes=100, stem=3):
    """torchvision-style ResNet-50 parameter shapes (HWIO convs, [in, out] fc)."""
    shapes = {"conv1/kernel": (stem, stem, 3, 64), "bn1/scale": (64,), "bn1/bias": (64,)}
    channels = 64
    for stage, blocks in enumerate((3, 4, 6, 3)):
        planes = 64 * 2**stage
        for b in range(blocks):
            prefix = f"layer{stage + 1}_{b}"
            convs = {
                "conv1": (1, 1, channels, planes),
                "conv2": (3, 3, planes, planes),
                "conv3": (1, 1, planes, 4 * planes),
            }
            if b == 0:  # stride 2 (stages 2-4) or 64 -> 256 channels (stage 1)
                convs["downsample_conv"] = (1, 1, channels, 4 * planes)
            for conv, shape in convs.items():
                bn = "downsample_bn" if conv == "downsample_conv" else "bn" + conv[-1]
                shapes[f"{prefix}/{conv}/kernel"] = shape
                shapes[f"{prefix}/{bn}/scale"] = shapes[f"{prefix}/{bn}/bias"] = shape[-1:]
            channels = 4 * planes
    shapes |= {"fc/kernel": (2048, num_classes), "fc/bias": (num_classes,)}
    return shapes


def test_resnet50_parameter_names_shapes_and_count():
    expected = _resnet50_shapes()
    variables = _abstract("resnet50_cifar")
    assert _shapes(variables["params"]) == expected
    count = sum(math.prod(s) for s in expected.values())
    assert _count(variables["params"]) == count
    assert round(count / 1e6, 1) == 23.7
    bn = {p.rsplit("/", 1)[0] for p in expected if "bn" in p}
    assert set(_shapes(variables["batch_stats"])) == {
        f"{b}/{s}" for b in bn for s in ("mean", "var")
    }
    # The ImageNet stem and 1000 classes give torchvision's resnet50: 25,557,032 parameters.
    imagenet = _params("resnet50_cifar", stem="imagenet", num_classes=1000, image_size=224)
    assert _shapes(imagenet) == _resnet50_shapes(1000, stem=7)
    assert _count(imagenet) == 25_557_032


# torchvision vgg19_bn: indices of the convs in `features` (each BN at the next index).
_VGG19_CONV_INDICES = (0, 3, 7, 10, 14, 17, 20, 23, 27, 30, 33, 36, 40, 43, 46, 49)
_VGG19_CHANNELS = (64, 64, 128, 128, 256, 256, 256, 256) + (512,) * 8


def test_vgg19_bn_parameter_names_shapes_and_count():
    expected, channels = {}, 3
    for index, out in zip(_VGG19_CONV_INDICES, _VGG19_CHANNELS, strict=True):
        expected[f"features_{index}/kernel"] = (3, 3, channels, out)
        expected[f"features_{index}/bias"] = (out,)
        expected[f"features_{index + 1}/scale"] = expected[f"features_{index + 1}/bias"] = (out,)
        channels = out
    for index, fan_in, fan_out in [(0, 512 * 7 * 7, 4096), (3, 4096, 4096), (6, 4096, 1000)]:
        expected[f"classifier_{index}/kernel"] = (fan_in, fan_out)
        expected[f"classifier_{index}/bias"] = (fan_out,)
    params = _params("vgg19_bn")
    assert _shapes(params) == expected
    count = sum(math.prod(s) for s in expected.values())
    assert _count(params) == count == 143_678_248  # torchvision's published figure
    assert round(count / 1e6, 2) == 143.68
    assert models.example_batch("vgg19_bn", 1)["image"].shape == (1, 32, 32, 3)  # CIFAR
    assert _count(_params("vgg19_bn", image_size=224)) == count  # ImageNet input too


def _np_conv(x, kernel, stride=1, padding=0, bias=None):
    """NHWC x HWIO convolution with symmetric zero padding, by summing shifted slices."""
    kh, kw, _, cout = kernel.shape
    x = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    oh, ow = (x.shape[1] - kh) // stride + 1, (x.shape[2] - kw) // stride + 1
    out = np.zeros((x.shape[0], oh, ow, cout))
    for i in range(kh):
        for j in range(kw):
            rows = slice(i, i + stride * (oh - 1) + 1, stride)
            cols = slice(j, j + stride * (ow - 1) + 1, stride)
            out += x[:, rows, cols, :] @ kernel[i, j]
    return out if bias is None else out + bias


class _NumpyBatchNorm:
    """BatchNorm over N, H, W with running statistics ``m * old + (1 - m) * batch``."""

    def __init__(self, variables, config, train):
        self.params, self.stats = variables["params"], variables["batch_stats"]
        self.config, self.train, self.new_stats = config, train, {}

    def __call__(self, x, *path):
        p, s = self.params, self.stats
        for key in path:
            p, s = p[key], s[key]
        if self.train:
            mean, var = x.mean((0, 1, 2)), x.var((0, 1, 2))  # biased variance
            m = self.config.bn_momentum
            node = self.new_stats
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = {
                "mean": m * s["mean"] + (1 - m) * mean,
                "var": m * s["var"] + (1 - m) * var,
            }
        else:
            mean, var = s["mean"], s["var"]
        return (x - mean) / np.sqrt(var + self.config.bn_epsilon) * p["scale"] + p["bias"]


def _np_relu(x):
    return np.maximum(x, 0)


def _np_resnet(variables, image, config, train):
    p, bn = variables["params"], _NumpyBatchNorm(variables, config, train)
    x = _np_relu(bn(_np_conv(image, p["conv1"]["kernel"], 1, 1), "bn1"))
    channels = config.width
    for stage, blocks in enumerate(config.stage_sizes):
        planes = config.width * 2**stage
        for b in range(blocks):
            name, stride = f"layer{stage + 1}_{b}", (2 if stage > 0 and b == 0 else 1)
            q = p[name]
            y = _np_relu(bn(_np_conv(x, q["conv1"]["kernel"]), name, "bn1"))
            y = _np_relu(bn(_np_conv(y, q["conv2"]["kernel"], stride, 1), name, "bn2"))
            y = bn(_np_conv(y, q["conv3"]["kernel"]), name, "bn3")
            if stride != 1 or channels != 4 * planes:
                shortcut = _np_conv(x, q["downsample_conv"]["kernel"], stride)
                shortcut = bn(shortcut, name, "downsample_bn")
            else:
                shortcut = x
            x, channels = _np_relu(y + shortcut), 4 * planes
    return _np_dense(x.mean((1, 2)), p["fc"]), bn.new_stats


# Two stages: a projection without stride, an identity block, a strided projection.
_TINY_RESNET = dict(stage_sizes=(2, 1), width=4, num_classes=5, image_size=8)


def test_resnet_matches_numpy_in_train_and_eval_mode():
    config, model, variables, batch = _tiny("resnet50_cifar", batch_size=4, **_TINY_RESNET)
    image, reference = batch["image"], _np(variables)
    evaluate = _apply(model)
    logits = evaluate(variables, image)
    np.testing.assert_allclose(logits, _np_resnet(reference, image, config, False)[0], atol=1e-4)

    train = _apply(model, train=True, mutable=("batch_stats",))
    logits, updates = train(variables, image)
    expected, new_stats = _np_resnet(reference, image, config, True)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
    chex.assert_trees_all_close(_np(updates["batch_stats"]), new_stats, rtol=1e-4, atol=1e-5)

    # Evaluation treats samples independently; training normalizes with the batch's statistics.
    other = image.copy()
    other[1:] = 3.0 * other[1:] + 1.0
    np.testing.assert_allclose(evaluate(variables, other)[0], evaluate(variables, image)[0])
    assert not np.allclose(train(variables, other)[0][0], train(variables, image)[0][0])


def test_resnet_rejects_wrong_channels():
    _, model, variables, _ = _tiny("resnet50_cifar", batch_size=4, **_TINY_RESNET)
    with pytest.raises(ValueError, match="3 channels"):
        model.apply(variables, jnp.zeros((1, 8, 8, 1)))


def _np_adaptive_pool(x, size):
    """torch.nn.AdaptiveAvgPool2d: cell i averages [floor(i*n/size), ceil((i+1)*n/size))."""
    out = np.zeros((x.shape[0], size, size, x.shape[3]))
    for i in range(size):
        r0, r1 = math.floor(i * x.shape[1] / size), math.ceil((i + 1) * x.shape[1] / size)
        for j in range(size):
            c0, c1 = math.floor(j * x.shape[2] / size), math.ceil((j + 1) * x.shape[2] / size)
            out[:, i, j] = x[:, r0:r1, c0:c1].mean((1, 2))
    return out


def test_adaptive_avg_pool():
    from resireduce_jax.models.vgg import adaptive_avg_pool

    rng = np.random.default_rng(0)
    one = rng.standard_normal((2, 1, 1, 3))  # VGG on 32x32: the 1x1 map is replicated
    np.testing.assert_allclose(adaptive_avg_pool(one, 7), np.broadcast_to(one, (2, 7, 7, 3)))
    seven = rng.standard_normal((2, 7, 7, 3))  # VGG on 224x224: identity
    np.testing.assert_allclose(adaptive_avg_pool(seven, 7), seven, rtol=1e-6)
    fourteen = rng.standard_normal((2, 14, 14, 3))
    np.testing.assert_allclose(
        adaptive_avg_pool(fourteen, 7),
        fourteen.reshape(2, 7, 2, 7, 2, 3).mean((2, 4)),
        rtol=1e-5,
        atol=1e-6,
    )
    # 5 -> 7: torch's windows [0,1) [0,2) [1,3) [2,3) [2,4) [3,5) [4,5) overlap.
    five = rng.standard_normal((1, 5, 1, 1))
    windows = [(0, 1), (0, 2), (1, 3), (2, 3), (2, 4), (3, 5), (4, 5)]
    expected = np.array([five[0, a:b, 0, 0].mean() for a, b in windows])
    np.testing.assert_allclose(adaptive_avg_pool(five, 7)[0, :, 0, 0], expected, rtol=1e-5)
    odd = rng.standard_normal((2, 10, 6, 3))
    np.testing.assert_allclose(
        adaptive_avg_pool(odd, 3), _np_adaptive_pool(odd, 3), rtol=1e-5, atol=1e-6
    )


def _np_vgg(variables, image, config):
    """VGG-BN in evaluation mode (dropout off, running statistics)."""
    p, bn = variables["params"], _NumpyBatchNorm(variables, config, train=False)
    x, index = image, 0
    for stage, depth in enumerate(config.stage_depths):
        for _ in range(depth):
            conv = p[f"features_{index}"]
            x = _np_relu(
                bn(_np_conv(x, conv["kernel"], 1, 1, conv["bias"]), f"features_{index + 1}")
            )
            index += 3
        b, h, w, c = x.shape
        x = x.reshape(b, h // 2, 2, w // 2, 2, c).max((2, 4))
        index += 1
        assert x.shape[-1] == config.width * min(2**stage, 8)
    x = _np_adaptive_pool(x, config.pool_size).reshape(x.shape[0], -1)  # (h, w, c) order
    x = _np_relu(_np_dense(x, p["classifier_0"]))
    x = _np_relu(_np_dense(x, p["classifier_3"]))
    return _np_dense(x, p["classifier_6"])


# 8x8 input, two stages -> 2x2 features -> adaptive pool to 3x3 (overlapping windows).
_TINY_VGG = dict(
    stage_depths=(1, 2), width=4, classifier_width=16, pool_size=3, num_classes=5, image_size=8
)


def test_vgg_matches_numpy_in_eval_mode():
    config, model, variables, batch = _tiny("vgg19_bn", batch_size=4, **_TINY_VGG)
    logits = _apply(model)(variables, batch["image"])
    assert logits.shape == (4, 5) and logits.dtype == jnp.float32
    expected = _np_vgg(_np(variables), batch["image"], config)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_vgg_rejects_too_small_images():
    with pytest.raises(ValueError, match="at least 32"):
        models.get_config("vgg19_bn", image_size=16)
    _, model, variables, _ = _tiny("vgg19_bn", batch_size=4, **_TINY_VGG)
    with pytest.raises(ValueError, match="sides of at least 4"):
        model.apply(variables, jnp.zeros((1, 2, 2, 3)))


# ---------------------------------------------------------------------------------------
# BERT with a SQuAD head, and the small CPU models


def _bert_shapes(layers, width, vocab=30522, positions=512, types=2):
    d, shapes = width, {}
    for table, rows in [("word", vocab), ("position", positions), ("token_type", types)]:
        shapes[f"embeddings/{table}_embeddings/embedding"] = (rows, d)
    shapes["embeddings/LayerNorm/scale"] = shapes["embeddings/LayerNorm/bias"] = (d,)
    dense = [
        ("attention/self/query", d, d),
        ("attention/self/key", d, d),
        ("attention/self/value", d, d),
        ("attention/output/dense", d, d),
        ("intermediate/dense", d, 4 * d),
        ("output/dense", 4 * d, d),
    ]
    norms = ("attention/output/LayerNorm", "output/LayerNorm")
    for i in range(layers):
        shapes |= _block_shapes(f"encoder/layer_{i}", d, norms, dense)
    shapes |= {"qa_outputs/kernel": (d, 2), "qa_outputs/bias": (2,)}
    return shapes


@pytest.mark.parametrize(
    "name, layers, width, published_millions",
    [("bert_base", 12, 768, 108.9), ("bert_large", 24, 1024, 334.1)],
)
def test_bert_parameter_names_shapes_and_count(name, layers, width, published_millions):
    expected = _bert_shapes(layers, width)
    params = _params(name)
    assert _shapes(params) == expected
    head = 2 * width + 2
    count = _count(params)
    assert count == sum(math.prod(s) for s in expected.values())
    assert round((count - head) / 1e6, 1) == published_millions  # encoder without the head
    assert models.example_batch(name, 1)["input_ids"].shape == (1, 384)  # SQuAD length


def _np_bert(p, input_ids, token_type_ids, attention_mask, config):
    e, eps = p["embeddings"], config.layer_norm_epsilon
    length = input_ids.shape[1]
    x = (
        e["word_embeddings"]["embedding"][input_ids]
        + e["position_embeddings"]["embedding"][np.arange(length)]
        + e["token_type_embeddings"]["embedding"][token_type_ids]
    )
    x = _np_layer_norm(x, e["LayerNorm"], eps)
    allowed = np.broadcast_to(attention_mask[:, None, :] > 0, (len(x), length, length))
    for i in range(config.num_layers):
        layer = p["encoder"][f"layer_{i}"]
        a = layer["attention"]
        q, k, v = (_np_dense(x, a["self"][n]) for n in ("query", "key", "value"))
        context = _np_attention(q, k, v, config.num_heads, allowed)
        x = _np_layer_norm(
            x + _np_dense(context, a["output"]["dense"]), a["output"]["LayerNorm"], eps
        )
        h = _np_gelu_erf(_np_dense(x, layer["intermediate"]["dense"]))
        x = _np_layer_norm(
            x + _np_dense(h, layer["output"]["dense"]), layer["output"]["LayerNorm"], eps
        )
    logits = _np_dense(x, p["qa_outputs"])
    return logits[..., 0], logits[..., 1]


_TINY_BERT = dict(
    vocab_size=50, max_len=16, type_vocab_size=2, num_layers=2, width=32, num_heads=4, seq_len=10
)


def _bert_batch_with_padding():
    config, model, variables, batch = _tiny("bert_base", **_TINY_BERT)
    batch = dict(batch)
    mask = np.ones((2, 10), np.int32)
    mask[1, 6:] = 0  # the second sequence has 4 padding tokens
    batch["attention_mask"] = mask
    batch["token_type_ids"] = (np.arange(10) >= 4).astype(np.int32)[None].repeat(2, 0)
    return config, model, variables, batch


def test_bert_matches_numpy_reference_with_padding():
    config, model, variables, batch = _bert_batch_with_padding()
    start, end = _apply(model)(variables, **_inputs(config, batch))
    assert start.shape == end.shape == (2, 10) and start.dtype == jnp.float32
    expected = _np_bert(
        _np(variables["params"]),
        batch["input_ids"],
        batch["token_type_ids"],
        batch["attention_mask"],
        config,
    )
    chex.assert_trees_all_close((start, end), expected, rtol=1e-4, atol=1e-4)

    # Padding is never attended to: changing padded tokens leaves real tokens' logits alone.
    changed = dict(batch, input_ids=batch["input_ids"].copy())
    changed["input_ids"][1, 6:] = (changed["input_ids"][1, 6:] + 7) % config.vocab_size
    start2, end2 = _apply(model)(variables, **_inputs(config, changed))
    np.testing.assert_allclose(start2[1, :6], start[1, :6], atol=1e-5)
    np.testing.assert_allclose(end2[:, :6], end[:, :6], atol=1e-5)
    assert not np.allclose(start2[1, 6:], start[1, 6:])


def test_bert_optional_inputs_and_errors():
    _config, model, variables, batch = _tiny("bert_base", **_TINY_BERT)
    ids = jnp.asarray(batch["input_ids"])
    defaults = _apply(model)(variables, ids)
    explicit = _apply(model)(variables, ids, jnp.zeros_like(ids), jnp.ones_like(ids))
    chex.assert_trees_all_close(defaults, explicit, atol=1e-6)
    with pytest.raises(ValueError, match="must match"):
        model.apply(variables, ids, jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="exceeds the 16 learned positions"):
        model.apply(variables, jnp.zeros((1, 17), jnp.int32))


_TINY_MLP = dict(num_layers=3, width=16, num_classes=4)


def test_digits_mlp_layout_and_numpy_reference():
    params = _params("digits_mlp")
    expected = {"hidden_0/kernel": (64, 256), "head/kernel": (256, 10), "head/bias": (10,)}
    expected |= {f"hidden_{i}/kernel": (256, 256) for i in (1, 2, 3)}
    expected |= {f"hidden_{i}/bias": (256,) for i in range(4)}
    assert _shapes(params) == expected
    # Adjacent same-shape hidden kernels, each large enough to be compressed.
    hidden = [s for p, s in expected.items() if p.startswith("hidden") and p.endswith("kernel")]
    assert len(hidden) == 4 and all(math.prod(s) >= 10_000 for s in hidden)

    _config, model, variables, batch = _tiny("digits_mlp", **_TINY_MLP)
    p, x = _np(variables["params"]), batch["image"].reshape(2, -1)
    for i in range(3):
        x = _np_relu(_np_dense(x, p[f"hidden_{i}"]))
    logits = _apply(model)(variables, batch["image"])
    np.testing.assert_allclose(logits, _np_dense(x, p["head"]), rtol=1e-5, atol=1e-5)
    flat = _apply(model)(variables, batch["image"].reshape(2, 64))  # sklearn's flat rows
    np.testing.assert_allclose(flat, logits, rtol=1e-6)


def test_byte_gpt_defaults():
    config = models.get_config("byte_gpt")
    assert (config.vocab_size, config.num_layers, config.width, config.num_heads) == (
        256,
        4,
        128,
        4,
    )
    assert config.max_len == 128 and config.sequence_length == 128
    assert models.example_batch("byte_gpt", 2)["tokens"].shape == (2, 128)
    assert _count(_params("byte_gpt")) == _gpt2_count(4, 128, vocab=256, positions=128)


# ---------------------------------------------------------------------------------------
# Behaviour common to all models: gradients, dropout, dtypes

# Reduced sizes of each architecture (the same as the numpy comparisons: compiling and
# initializing are the cost, so tests share them).
TINY = {
    "gpt2_small": _TINY_GPT,
    "byte_gpt": dict(num_layers=1, seq_len=8),
    "vit_b16": _TINY_VIT,
    "resnet50_cifar": _TINY_RESNET,
    "vgg19_bn": _TINY_VGG,
    "bert_base": _TINY_BERT,
    "digits_mlp": _TINY_MLP,
}
# byte_gpt is GPT-2 at another size: its gradients are covered by gpt2_small's.
GRADIENT_MODELS = sorted(set(TINY) - {"byte_gpt"})
# Number of dropout sites in train mode, from the architectures' definitions.
DROPOUT_SITES = {
    "gpt2_small": lambda c: 1 + 3 * c.num_layers,  # embeddings; attn probs, attn out, mlp out
    # pos; attn probs (off by default), proj, fc1 activation, fc2
    "vit_b16": lambda c: 1 + (3 + (c.attention_dropout_rate > 0)) * c.num_layers,
    "vgg19_bn": lambda c: 2,  # after classifier_0 and classifier_3
    "bert_base": lambda c: 1 + 3 * c.num_layers,  # embeddings; attn probs, attn out, output
}


def _loss(config, model, variables, batch, params, train):
    key = jax.random.key(7, impl="unsafe_rbg")
    rngs = {name: key for name in config.rng_names} if train else None
    mutable = list(config.mutable_collections) if train else False
    out = model.apply(
        {**variables, "params": params},
        **_inputs(config, batch),
        train=train,
        rngs=rngs,
        mutable=mutable,
    )
    if mutable:
        out, _ = out
    leaves = jax.tree.leaves(out)
    return sum(jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape))) for o in leaves)


@pytest.mark.parametrize("name", GRADIENT_MODELS)
def test_gradients_reach_every_parameter(name):
    config, model, variables, batch = _tiny(name, **TINY[name])
    # Training mode where it changes the graph beyond dropout (BatchNorm's batch statistics);
    # dropout masks would only add compile time.
    train = bool(config.mutable_collections)
    grads = jax.jit(jax.grad(lambda p: _loss(config, model, variables, batch, p, train)))(
        variables["params"]
    )
    leaves = jax.tree.leaves(grads)
    norms = dict(zip(tree_paths.leaf_paths(grads), map(jnp.linalg.norm, leaves), strict=True))
    assert all(np.isfinite(n) for n in norms.values())
    assert [path for path, n in norms.items() if n == 0.0] == []


def test_dropout_only_in_training():
    config, model, variables, batch = _tiny("gpt2_small", **TINY["gpt2_small"])
    assert config.rng_names == ("dropout",)
    inputs = _inputs(config, batch)
    evaluate, train = _apply(model, train=False), _apply(model, train=True)
    evals = [evaluate(variables, **inputs) for _ in range(2)]
    chex.assert_trees_all_equal(*evals)
    # unsafe_rbg keys compile much faster than threefry ones on CPU.
    keys = [jax.random.key(k, impl="unsafe_rbg") for k in (0, 1)]
    trains = [train(variables, **inputs, rngs={"dropout": key}) for key in keys]
    assert not np.allclose(trains[0], trains[1])
    assert not np.allclose(trains[0], evals[0])


@pytest.mark.parametrize("name", sorted(DROPOUT_SITES))
def test_dropout_sites(name):
    overrides = TINY[name]
    config = models.get_config(name, **overrides)
    model = config.build()
    inputs = {k: config.example_batch(2)[k] for k in config.input_names}
    variables = jax.eval_shape(lambda x: model.init(jax.random.key(0), **x), inputs)

    def bits(train, **rates):
        m = models.get_model(name, **overrides, **rates)
        rngs = {"dropout": jax.random.key(0)}
        mutable = list(config.mutable_collections) if train else False
        fn = lambda v, x: m.apply(v, **x, train=train, rngs=rngs, mutable=mutable)
        return _primitive_counts(fn, variables, inputs)["random_bits"]

    assert bits(True) == DROPOUT_SITES[name](config)
    assert bits(False) == 0
    rates = ("dropout_rate", "attention_dropout_rate")
    assert bits(True, **{rate: 0.0 for rate in rates if hasattr(config, rate)}) == 0


@pytest.mark.parametrize("name", sorted(TINY))
def test_computation_and_parameter_dtypes(name):
    config = models.get_config(name, **TINY[name], dtype="bfloat16")
    model = config.build()
    inputs = {k: config.example_batch(2)[k] for k in config.input_names}
    variables = jax.eval_shape(lambda x: model.init(jax.random.key(0), **x), inputs)
    assert {x.dtype for x in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}
    fn = lambda v, x: model.apply(v, **x)
    assert _matmul_dtypes(fn, variables, inputs) == {jnp.dtype(jnp.bfloat16)}
    out = jax.tree.leaves(jax.eval_shape(fn, variables, inputs))
    assert {o.dtype for o in out} == {jnp.dtype(jnp.float32)}  # logits in float32
    half = models.abstract_variables(name, **TINY[name], param_dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(half["params"])} == {jnp.dtype(jnp.bfloat16)}
    # Flax keeps BatchNorm's running statistics in float32 whatever param_dtype is.
    assert {x.dtype for x in jax.tree.leaves(half.get("batch_stats", {}))} <= {jnp.dtype("float32")}


def test_blocks_are_standalone_stages():
    from resireduce_jax.models import bert, gpt2, resnet, vit

    tokens = jax.ShapeDtypeStruct((2, 5, 32), jnp.float32)
    for block, config, children in [
        (gpt2.Block, models.get_config("gpt2_small", **_TINY_GPT), {"ln_1", "attn", "ln_2", "mlp"}),
        (vit.Block, models.get_config("vit_b16", **_TINY_VIT), {"norm1", "attn", "norm2", "mlp"}),
        (
            bert.Layer,
            models.get_config("bert_base", **_TINY_BERT),
            {"attention", "output", "intermediate"},
        ),
    ]:
        stage = block(config)
        variables = jax.eval_shape(lambda x, s=stage: s.init(jax.random.key(1), x), tokens)
        assert set(variables["params"]) == children
        assert jax.eval_shape(stage.apply, variables, tokens) == tokens

    image = jax.ShapeDtypeStruct((2, 8, 8, 16), jnp.float32)
    stage = resnet.Bottleneck(features=8, strides=2)
    variables = jax.eval_shape(lambda x: stage.init(jax.random.key(1), x), image)
    assert "downsample_conv" in variables["params"]
    out = jax.eval_shape(
        lambda v, x: stage.apply(v, x, train=True, mutable=["batch_stats"]), variables, image
    )
    assert out[0].shape == (2, 4, 4, 32)
    identity = resnet.Bottleneck(features=4)  # 16 -> 16 channels, stride 1: no projection
    assert (
        "downsample_conv"
        not in jax.eval_shape(lambda x: identity.init(jax.random.key(1), x), image)["params"]
    )


def test_initializers():
    """GPT-2's residual projections start smaller (Radford et al. 2019, §2.3)."""
    config = models.get_config("gpt2_small", vocab_size=300, num_layers=2, width=64, num_heads=4)
    batch = config.example_batch(1)
    # unsafe_rbg keys compile much faster than threefry ones; the statistics are the same.
    key = jax.random.key(0, impl="unsafe_rbg")
    params = jax.jit(config.build().init)(key, jnp.zeros(batch["tokens"].shape, jnp.int32))[
        "params"
    ]
    block = params["h_1"]
    residual_std = 0.02 / math.sqrt(2 * 2)
    for kernel, std in [
        (params["wte"]["embedding"], 0.02),
        (params["wpe"]["embedding"], 0.02),
        (block["attn"]["c_attn"]["kernel"], 0.02),
        (block["mlp"]["c_fc"]["kernel"], 0.02),
        (block["attn"]["c_proj"]["kernel"], residual_std),
        (block["mlp"]["c_proj"]["kernel"], residual_std),
    ]:
        assert abs(float(jnp.std(kernel)) / std - 1) < 0.05
    np.testing.assert_array_equal(block["ln_1"]["scale"], 1.0)
    np.testing.assert_array_equal(block["mlp"]["c_fc"]["bias"], 0.0)
