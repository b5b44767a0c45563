"""Grouping rules: auto (adjacent same-role, same-shape), regex, explicit labels, report."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import resireduce_jax as rr


def _transformer(num_layers=12, width=64):
    """GPT-2-like paths; dict keys sort h_0, h_1, h_10, h_11, h_2, ... in jax.tree order."""
    layers = {
        f"h_{i}": {
            "attn": {"c_attn": {"kernel": jax.ShapeDtypeStruct((width, 3 * width), np.float32)}},
            "mlp": {"c_fc": {"kernel": jax.ShapeDtypeStruct((width, 4 * width), np.float32)}},
            "ln_1": {"scale": jax.ShapeDtypeStruct((width,), np.float32)},
        }
        for i in range(num_layers)
    }
    return {**layers, "wte": {"embedding": jax.ShapeDtypeStruct((500, width), np.float32)}}


def _groups(params, grouping, min_size=1000):
    return {g.label: list(g.paths) for g in rr.grouping.resolve(params, grouping, min_size)}


def test_auto_groups_adjacent_layers_in_numeric_order():
    groups = _groups(_transformer(), rr.grouping.auto(max_group_size=3))
    attn = [paths for label, paths in groups.items() if "c_attn" in label]
    assert attn == [[f"h_{i}/attn/c_attn/kernel" for i in range(j, j + 3)] for j in (0, 3, 6, 9)]
    assert groups["wte/embedding"] == ["wte/embedding"]  # unique role: singleton
    assert not any("ln_1" in p for paths in groups.values() for p in paths)  # 1-D: dense


def test_auto_leftover_and_unbounded_groups():
    params = _transformer(num_layers=7)
    by_three = _groups(params, rr.grouping.auto(3))
    mlp = sorted((paths for label, paths in by_three.items() if "c_fc" in label), key=len)
    assert [len(p) for p in mlp] == [1, 3, 3]
    assert mlp[0] == ["h_6/mlp/c_fc/kernel"]
    unbounded = _groups(params, rr.grouping.auto(None))
    assert max(len(p) for p in unbounded.values()) == 7


def test_auto_never_mixes_shapes():
    params = {
        "layer_0": {"kernel": jax.ShapeDtypeStruct((64, 64), np.float32)},
        "layer_1": {"kernel": jax.ShapeDtypeStruct((64, 32), np.float32)},
        "layer_2": {"kernel": jax.ShapeDtypeStruct((64, 64), np.float32)},
    }
    groups = _groups(params, rr.grouping.auto(3), min_size=100)
    assert sorted(map(len, groups.values())) == [1, 2]


def test_regex_rules_are_ordered_and_templated():
    rules = [
        (r"h_([0-5])/(attn|mlp)/(\w+)/kernel", r"first/\2/\3"),
        (r"h_(\d+)/(attn|mlp)/(\w+)/kernel", r"rest/\2/\3"),
    ]
    groups = _groups(_transformer(), rr.grouping.regex(rules))
    assert groups["first/attn/c_attn"] == [f"h_{i}/attn/c_attn/kernel" for i in range(6)]
    assert groups["rest/mlp/c_fc"] == [f"h_{i}/mlp/c_fc/kernel" for i in range(6, 12)]
    assert groups["wte/embedding"] == ["wte/embedding"]


def test_explicit_label_tree_and_structure_mismatch():
    params = _transformer(num_layers=2)
    labels = rr.grouping.each_leaf()(params)
    labels["h_0"]["mlp"]["c_fc"]["kernel"] = "fc"
    labels["h_1"]["mlp"]["c_fc"]["kernel"] = "fc"
    groups = _groups(params, labels)
    assert groups["fc"] == ["h_0/mlp/c_fc/kernel", "h_1/mlp/c_fc/kernel"]
    with pytest.raises(ValueError, match="same tree structure"):
        rr.grouping.resolve(params, {"h_0": "x"}, 1000)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_auto_rejects_bad_group_size(bad):
    with pytest.raises(ValueError, match="max_group_size"):
        rr.grouping.auto(bad)


def test_regex_rejects_bad_rules():
    with pytest.raises(ValueError, match="Invalid grouping pattern"):
        rr.grouping.regex({"(unclosed": "x"})
    with pytest.raises(ValueError, match="pair"):
        rr.grouping.regex([("only-pattern",)])


def test_report_counts_bytes_by_hand():
    params = _transformer(num_layers=6, width=32)
    report = rr.grouping.report(params, rr.grouping.auto(3), min_size=1000)
    attn, fc, wte = 32 * 96 * 4, 32 * 128 * 4, 500 * 32 * 4
    assert report.residual_bytes_per_leaf == 6 * attn + 6 * fc + wte
    assert report.residual_bytes_grouped == 2 * attn + 2 * fc + wte
    assert report.dense_leaves == 6 and report.dense_bytes == 6 * 32 * 4
    text = str(report)
    assert "h_0/attn/c_attn/kernel" in text and "5 groups (4 shared)" in text


# ------------------------------------------------------------------ path-rule convention


def _sds(*shape):
    return jax.ShapeDtypeStruct(shape, np.float32)


def test_regex_searches_paths_so_nnx_value_paths_match():
    """Flax NNX paths end in /value; a rule is re.search-ed, so it needs no '.*' or '$'."""
    params = {"layers": {str(i): {"kernel": {"value": _sds(64, 64)}} for i in range(6)}}
    groups = _groups(params, rr.grouping.regex([(r"layers/[0-3]/kernel", "low")]))
    assert groups["low"] == [f"layers/{i}/kernel/value" for i in range(4)]
    assert groups["layers/4/kernel/value"] == ["layers/4/kernel/value"]


def test_regex_label_expands_the_search_match():
    params = _transformer(num_layers=2)
    labels = rr.grouping.regex([(r"h_\d+/(attn|mlp)", r"\1/\g<0>")])(params)
    assert labels["h_1"]["mlp"]["c_fc"]["kernel"] == "mlp/h_1/mlp"
    assert labels["wte"]["embedding"] == "wte/embedding"  # no rule: its path


@pytest.mark.parametrize("pattern", [r"layers/[0-3]/kernel$", r"^dense_9/"])
def test_regex_rule_that_matches_no_leaf_raises(pattern):
    params = {"layers": {str(i): {"kernel": {"value": _sds(64, 64)}} for i in range(2)}}
    grouping = rr.grouping.regex([(r"layers/0/", "a"), (pattern, "b")])
    with pytest.raises(ValueError, match=r"rule '.*' matches no leaf") as info:
        grouping(params)
    message = str(info.value)
    assert repr(pattern) in message and "layers/1/kernel/value" in message  # closest paths
    assert "re.search" in message and "/value" in message  # the fix
    with pytest.warns(UserWarning, match="matches no leaf"):
        rr.grouping.regex([(pattern, "b")], unmatched="warn")(params)
    labels = rr.grouping.regex([(pattern, "b")], unmatched="ignore")(params)
    assert jax.tree.leaves(labels) == ["layers/0/kernel/value", "layers/1/kernel/value"]


def test_regex_rule_on_layers_with_biases_groups_the_kernels():
    """Biases travel dense with no residual, so a rule that also labels them groups only
    the kernels instead of failing for mixing shapes."""
    params = {f"dense_{i}": {"kernel": _sds(64, 64), "bias": _sds(64)} for i in range(4)}
    groups = _groups(params, rr.grouping.regex([(r"dense_[123]/", "hidden")]))
    assert groups == {
        "hidden": ["dense_1/kernel", "dense_2/kernel", "dense_3/kernel"],
        "dense_0/kernel": ["dense_0/kernel"],
    }
    plans = rr.residual_reduction.plan_stores(
        params,
        grouping=rr.grouping.regex([(r"dense_[123]/", "hidden")]),
        min_size=1000,
        intra="none",
    )
    assert [(p.kind, p.group.label) for p in plans] == [
        ("leaf", "dense_0/kernel"),
        ("weighted", "hidden"),
    ]
