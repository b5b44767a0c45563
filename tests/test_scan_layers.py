"""Models scanned over their layers (``scan_layers``) in the zoo and the training program.

* The scanned GPT-2 and BERT compute what the written-out models compute with the same
  weights stacked (``models.scan.stack_layers``), and declare their layer stacks.
* The paper configs' group rules see slices as layers: the scanned model's residual
  stores are the written-out model's, slice ``h/i/...`` for layer ``h_i/...``.
* A scanned run starts from the written-out model's weights, stays with the written-out
  run to float32 rounding, resumes bit for bit and survives a change of worker count.
* Rotor does not plan inside a scan: a clear error for ``remat.budget``, and the memory
  planner leaves rotor out with a note.
"""

from __future__ import annotations

import os
import re

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import resireduce_jax as rr
from resireduce_jax import models
from resireduce_jax.models import scan
from train import config_lib, factory, memory_plan, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "byte_gpt": {"num_layers": 3, "width": 32, "num_heads": 2, "max_len": 16},
    "bert_base": {
        "num_layers": 3,
        "width": 32,
        "num_heads": 2,
        "vocab_size": 64,
        "max_len": 16,
        "seq_len": 8,
    },
}


def load_config(name: str) -> ml_collections.ConfigDict:
    """``configs/<name>.py``'s config (loaded by path, as a config next to another)."""
    return config_lib.sibling_config(os.path.join(ROOT, "configs", "default.py"), name).get_config()


# ------------------------------------------------------------------ models


@pytest.mark.parametrize("name", list(TINY))
def test_scanned_model_computes_the_written_out_model(name):
    written_out = models.get_config(name, **TINY[name])
    scanned = models.get_config(name, scan_layers=True, **TINY[name])
    batch = written_out.example_batch(2)
    rng = np.random.default_rng(0)
    inputs = [
        jnp.asarray(rng.integers(0, 2 if n == "token_type_ids" else 30, batch[n].shape), jnp.int32)
        for n in written_out.input_names
    ]
    variables = written_out.build().init(jax.random.PRNGKey(0), *inputs)
    stacked = scan.stack_layers(variables["params"], scanned.layer_scope, scanned.num_layers)
    # The stacked tree is the scanned model's own, leaf for leaf.
    own = jax.eval_shape(scanned.build().init, jax.random.PRNGKey(0), *inputs)["params"]
    chex.assert_trees_all_equal_shapes_and_dtypes(stacked, own)
    want = written_out.build().apply(variables, *inputs)
    got = scanned.build().apply({"params": stacked}, *inputs)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    unstacked = scan.unstack_layers(stacked, scanned.layer_scope)
    chex.assert_trees_all_equal(unstacked, variables["params"])
    assert scanned.layer_stacks == {scanned.layer_scope: 0} and written_out.layer_stacks is None


def test_models_without_repeated_layers_refuse_scan_layers():
    with pytest.raises(ValueError, match="has no repeated layers to scan"):
        models.get_config("digits_mlp", scan_layers=True)
    with pytest.raises(ValueError, match="rotor does not plan checkpoints inside a scan"):
        models.get_config("byte_gpt", scan_layers=True).chain_stages()


# ------------------------------------------------------------------ the configs' groups


@pytest.mark.parametrize(
    "name, scope",
    [("gpt2_medium_wikitext", "h"), ("bert_base_squad", "encoder/layer")],
)
def test_config_rules_group_slices_as_the_written_out_layers(name, scope):
    """At full size (abstract shapes): every store of the scanned model is the written-out
    model's, with slice ``{scope}/{i}/x`` for layer ``{scope}_{i}/x``."""

    def stores(scan_layers):
        config = load_config(name)
        config.model.scan_layers = scan_layers
        model_config = models.get_config(config.model.name, scan_layers=scan_layers)
        params = models.abstract_variables(config.model.name, scan_layers=scan_layers)["params"]
        plans = factory.build_store_plans(
            config.compression, params, layer_stacks=factory.layer_stacks(config)
        )
        assert factory.layer_stacks(config) == model_config.layer_stacks
        return {(p.kind, p.group.label, p.group.paths, p.keep_rows, p.keep_cols) for p in plans}

    as_slices = re.compile(rf"^{re.escape(scope)}_(\d+)/")
    written_out = {
        (kind, label, tuple(as_slices.sub(rf"{scope}/\1/", p) for p in paths), rows, cols)
        for kind, label, paths, rows, cols in stores(False)
    }
    assert stores(True) == written_out
    assert sum(kind == "weighted" for kind, *_ in written_out) >= 4


# ------------------------------------------------------------------ the training program


def tiny_byte_gpt(scan_layers: bool, steps: int = 6, **changes) -> ml_collections.ConfigDict:
    c = load_config("byte_gpt")
    c.model.overrides = dict(TINY["byte_gpt"])
    c.model.scan_layers = scan_layers
    # AdamW with EF: compressed-momentum Adam (the config's default) divides by the frozen
    # second moment, which magnifies float32 rounding between the two layouts.
    c.optimizer.name = "adamw"
    c.optimizer.one_buffer, c.optimizer.frozen_nu_format = "off", "float32"  # cm's options
    c.compression.variant, c.compression.residual_format = "w+2d", ""  # float32 w+2d
    c.compression.density_schedule.dense_fraction = 0.0
    c.dataset.context_length = 16
    c.batch_size_per_worker = 2
    c.num_steps = steps
    c.log_every = c.eval_every = steps
    c.checkpoint_every = 3
    for key, value in changes.items():
        c[key] = value
    return c


def test_scanned_run_follows_the_written_out_run(tmp_path):
    """Same seed: the scanned run starts from the written-out weights and stays with them."""
    summaries, params = [], []
    for scan_layers in (False, True):
        workdir = str(tmp_path / f"scan{int(scan_layers)}")
        summaries.append(train.train_and_evaluate(tiny_byte_gpt(scan_layers), workdir))
        params.append(train.final_state(workdir)["params"])
    chex.assert_trees_all_close(
        scan.unstack_layers(params[1], "h"), params[0], rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(
        summaries[1].eval["perplexity"], summaries[0].eval["perplexity"], rtol=1e-4
    )
    # The memory report counts slices: w+2d keeps one residual per group of 3 layers.
    reduced = summaries[1].memory["reduced"]["residuals"]
    assert reduced == summaries[0].memory["reduced"]["residuals"]
    assert reduced < summaries[1].memory["baseline"]["residuals"] / 2


def test_scanned_run_resumes_bit_for_bit_and_changes_worker_count(tmp_path):
    config = tiny_byte_gpt(True)
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    train.train_and_evaluate(config, full)
    first = train.train_and_evaluate(config, split, halt_after_step=3)
    assert first.preempted and first.step == 3
    train.train_and_evaluate(config, split)
    chex.assert_trees_all_equal(train.final_state(full), train.final_state(split))

    fewer = tiny_byte_gpt(True, steps=9, num_workers=4, on_worker_change="average")
    fewer.batch_size_per_worker = 4
    summary = train.train_and_evaluate(fewer, full)
    assert summary.step == 9
    saved = jax.tree_util.tree_flatten_with_path(train.final_state(full)["opt_state"])[0]
    # One array per stack's groups (3 layers, one group), now on 4 workers.
    (shape,) = [
        x.shape
        for path, x in saved
        if rr.tree_paths.path_to_str(path).endswith("residuals/h/mlp/c_fc/kernel[0:3]")
    ]
    assert shape == (4, 1, 32, 128)


def test_rotor_is_not_planned_inside_a_scan(tmp_path):
    config = tiny_byte_gpt(True, **{})
    config.remat.budget = "0.6"
    with pytest.raises(ValueError, match="rotor does not plan checkpoints inside a scan"):
        train.build_run(config)
    config = tiny_byte_gpt(True)
    compiler = memory_plan.StepCompiler(config, seq_len=16)
    assert not compiler.chain_model and "inside a scan" in compiler.remat_note
    assert {c.remat for c in compiler.candidates()} == {"none"}
