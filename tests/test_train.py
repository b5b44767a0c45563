"""The training program: config errors, bit-identical resume, worker-count policy, NaN policy."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import resireduce_jax as rr
from train import checkpointing, config_schema, train
from train import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str) -> ml_collections.ConfigDict:
    path = os.path.join(ROOT, "configs", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def small_digits(**changes) -> ml_collections.ConfigDict:
    c = load_config("default")
    c.num_steps = 12
    c.log_every = 2
    c.eval_every = 6
    c.checkpoint_every = 4
    for key, value in changes.items():
        target = c
        *parents, leaf = key.split(".")
        for p in parents:
            target = target[p]
        target[leaf] = value
    return c


# ------------------------------------------------------------------ config errors


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.compression.__setitem__("variant", "w+3d"), "compression.variant='w\\+3d'"),
        (lambda c: c.__setitem__("num_epochs", 2.0), "exactly one of num_steps and num_epochs"),
        (lambda c: c.model.__setitem__("name", "resnet9000"), "model.name='resnet9000'"),
        (lambda c: c.dataset.__setitem__("name", "imagenet"), "dataset.name='imagenet'"),
        (lambda c: c.optimizer.__setitem__("name", "adamq"), "optimizer.name='adamq'"),
        (lambda c: c.compression.__setitem__("compressor", "zip"), "compressor='zip'"),
        (lambda c: c.schedule.__setitem__("name", "linear"), "schedule.name='linear'"),
        (lambda c: c.compression.__setitem__("nonfinite", "ignore"), "nonfinite='ignore'"),
        (lambda c: c.compression.__setitem__("guard_mode", "late"), "guard_mode='late'.*'strict'"),
        (
            lambda c: c.__setitem__("weight_update_order", "late"),
            "weight_update_order='late'.*'unordered'",
        ),
        (lambda c: c.compression.__setitem__("density", 0.0), "density must be in"),
        (
            lambda c: c.compression.__setitem__("typo_key", 1),
            "Unknown config key 'compression.typo_key'",
        ),
        (lambda c: c.dataset.__setitem__("context_length", 64), "no config field"),
        (
            lambda c: c.compression.update(
                variant="none", residual_dtype="bfloat16", residual_format=""
            ),
            "residual_dtype='bfloat16' with compression.variant='none'.*keeps no residuals",
        ),
        (
            lambda c: c.compression.update(
                variant="dgc", residual_dtype="bfloat16", residual_format=""
            ),
            "variant='dgc': DGC keeps its own",
        ),
        (
            lambda c: c.compression.update(residual_dtype="float8_e4m3fn", residual_format=""),
            "residual_dtype='float8_e4m3fn' with optimizer.name='sgd'.*compressed_momentum_adam",
        ),
        (lambda c: c.model.overrides.__setitem__("depth", 3), "no field"),
        (
            lambda c: c.compression.update(selection_scope="global", compressor="randomk"),
            "selection_scope='global'.*any variant but 'dgc'; got 'randomk' with 'w\\+2d'",
        ),
        (
            lambda c: (c.compression.update(selection_scope="global"), c.update(local_devices=4)),
            "selection_scope='global' ranks whole leaves on a flat exchange",
        ),
        (
            lambda c: c.compression.update(selection_scope="model"),
            "selection_scope must be 'leaf' or 'global', got 'model'",
        ),
    ],
)
def test_invalid_config_fails_before_compiling(change, message):
    c = small_digits()
    change(c)
    with pytest.raises(ValueError, match=message):
        run = train.build_run(c)
        train.factory.build_tx(c, run.steps_per_epoch, run.total_steps)  # builds compressor


def test_every_variant_builds():
    """Every variant builds from the default config; the two that keep no residuals refuse
    its residual format, naming the flag that unsets it."""
    for variant in config_schema.VARIANTS:
        c = small_digits(**{"compression.variant": variant})
        if variant in ("dense", "none"):
            with pytest.raises(ValueError, match=r"--config.compression.residual_format=''"):
                train.build_run(c)
            c.compression.residual_format = ""
        train.build_run(c)


@pytest.mark.parametrize("variant", ["none", "ef", "w+2d"])
def test_selection_scope_reaches_every_exchange(variant):
    """compression.selection_scope='global' sends floor(density * N) entries of all N
    compressed elements in one payload (8 bytes each: value and index), where per-leaf
    Top-k sends the sum of each leaf's floor: 451 against 151 + 3 * 99 = 448 here."""
    from train import factory

    c = small_digits(**{"compression.variant": variant, "compression.min_size": 1000})
    c.compression.intra_layers = "^in$"
    params = {"in": np.zeros((150, 101), np.float32)}
    params |= {f"h{i}": np.zeros((99, 101), np.float32) for i in range(3)}
    sent = {}
    for scope in ("leaf", "global"):
        c.compression.selection_scope = scope
        sent[scope] = factory.build_exchange(c.compression).bytes_sent(params, 1)
    assert sent == {"leaf": 8 * (151 + 3 * 99), "global": 8 * 451}


def test_the_docs_list_every_variant_the_config_accepts():
    """docs/training.md's ``compression.variant`` ∈ list is the schema's, and each builds."""
    from train import factory

    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        (listed,) = re.findall(r"`compression\.variant` ∈ `([^`]+)`", f.read())
    assert listed.split() == list(config_schema.VARIANTS)
    for variant in listed.split():
        assert factory.build_exchange(small_digits().compression, variant=variant) is not None


def test_the_docs_say_what_the_memory_report_compares_by_default():
    """The baselines' compiled peaks are off by default, and the page names the key."""
    assert config_schema.base_config().memory.compare_baselines is False
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        (paragraph,) = re.findall(r"\nAt start-up the program prints .*?\n\n", f.read(), re.DOTALL)
    paragraph = " ".join(paragraph.split())
    assert "`--config.memory.compare_baselines=true` adds plain error feedback's" in paragraph
    assert "off by default" in paragraph, paragraph


def test_variant_vocabulary_and_optimizer_registry():
    from resireduce_jax import models
    from train import factory, tasks

    assert factory.resireduce_arguments("w+2d") == {"inter": "weighted", "intra": "2d"}
    assert factory.resireduce_arguments("d") == {"inter": "none", "intra": "rows"}
    assert [v for v in config_schema.VARIANTS if factory.resireduce_arguments(v) is None] == [
        "dense",
        "none",
        "ef",
        "dgc",
    ]
    c = small_digits(**{"optimizer.name": "adamw_r", "optimizer.max_grad_norm": 1.0})
    c.optimizer.kwargs = {}
    params = {"w": jax.numpy.ones(3)}
    # Ours clip inside their own pass: no clip_by_global_norm in front.
    state = factory.build_optimizer(c, 0.1).init(params)
    assert isinstance(state, rr.optimizers.AdamWRState)
    c = small_digits(**{"optimizer.name": "adabelief", "optimizer.max_grad_norm": 1.0})
    c.optimizer.kwargs = {}
    state = factory.build_optimizer(c, 0.1).init(params)
    assert isinstance(state, tuple) and len(state) == 2  # clip_by_global_norm, optax.adabelief
    c = small_digits(**{"optimizer.name": "nonesuch"})
    with pytest.raises(ValueError, match=r"optimizer.name='nonesuch'.*adamw_r") as error:
        factory.build_optimizer(c, 0.1)
    # The names only the training program takes are listed too.
    assert all(name in str(error.value) for name in factory.COMPRESSED_MOMENTUM)
    assert "Did you mean" not in str(error.value)
    # A misspelling is answered with the closest name, in the namespace it was asked in.
    for typo, meant in [
        ("compressed_momentum_adma", "compressed_momentum_adam"),
        ("adamw-r", "adamw_r"),
        ("optax.adamx", "optax.adamax"),
    ]:
        c = small_digits(**{"optimizer.name": typo})
        with pytest.raises(ValueError, match=f"Did you mean '{meant}'\\?$"):
            factory.build_optimizer(c, 0.1)
    model_config = models.get_config("byte_gpt")
    task = tasks.make_task(model_config.build(), model_config, "language_modeling")
    assert isinstance(task, tasks.CausalLM) and task.kind == "causal_lm"
    with pytest.raises(ValueError, match="predicts 'causal_lm'"):
        tasks.make_task(model_config.build(), model_config, "classification")
    metrics = tasks.Task.summarize("classification", {"correct": 3, "loss_sum": 2.0, "count": 4})
    assert metrics == {"accuracy": 0.75, "loss": 0.5}


# ------------------------------------------------------------------ resume


COMPRESSED_MOMENTUM = {
    "optimizer.name": "compressed_momentum_adam",
    "optimizer.learning_rate": 3e-3,
    "optimizer.kwargs": {},
    "compression.density_schedule.dense_fraction": 0.25,  # 3 dense steps
    "compression.density_schedule.dgc_fraction": 0.25,  # then 25 %, 6.25 %, 1.5625 %
    "compression.residual_format": "float8",  # e4m3 codes and scales, bit for bit as well
}
# Each format's codes (int3 and int4 packed in bytes); every block's scale is a float32.
CODE_DTYPES = {"int3": np.uint8, "int4": np.uint8, "float8": jnp.float8_e4m3fn}


@pytest.mark.parametrize("changes", [{}, COMPRESSED_MOMENTUM], ids=["sgd", "cm_adam_schedule"])
def test_resume_is_bit_identical(tmp_path, changes):
    """Halted after step 5 (with the schedule: in DGC's second stage) and resumed."""
    config = small_digits(**changes)
    full = tmp_path / "full"
    summary = train.train_and_evaluate(config, str(full))
    assert summary.step == 12 and not summary.preempted

    split = tmp_path / "split"
    first = train.train_and_evaluate(config, str(split), halt_after_step=5)
    assert first.preempted and first.step == 5
    second = train.train_and_evaluate(config, str(split))
    assert second.step == 12

    a, b = train.final_state(str(full)), train.final_state(str(split))
    chex.assert_trees_all_equal(a, b)  # params, optimizer, per-worker residuals, BN state
    stored = {
        jax.tree_util.keystr(path): x
        for path, x in jax.tree_util.tree_flatten_with_path(a["opt_state"])[0]
        if "residuals" in jax.tree_util.keystr(path)
    }
    codes = {x.dtype for key, x in stored.items() if key.endswith("['codes']")}
    scales = {x.dtype for key, x in stored.items() if key.endswith("['scales']")}
    assert codes == {np.dtype(CODE_DTYPES[config.compression.residual_format])}
    assert scales == {np.dtype(np.float32)}
    assert all(x.shape[0] == 8 for x in stored.values())  # one store per worker
    train_a = [r for r in metrics_lib.read_metrics(str(full)) if r["split"] == "train"]
    train_b = [r for r in metrics_lib.read_metrics(str(split)) if r["split"] == "train"]
    assert [r["loss"] for r in train_a] == [r["loss"] for r in train_b]
    assert summary.eval == second.eval
    with open(full / "summary.json") as f:
        written = json.load(f)
    assert written["communication"] == summary.communication == second.communication
    # Bytes one worker sent, counted by hand: leaves of >= min_size elements (and ndim >= 2)
    # are compressed, the rest all-reduced in float32 every step.
    sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(a["params"])]
    big = [n for n, x in zip(sizes, jax.tree.leaves(a["params"]), strict=True)
           if n >= config.compression.min_size and x.ndim >= 2]  # fmt: skip
    small = sum(sizes) - sum(big)
    if changes:  # 3 dense steps, one step at each DGC stage, then 6 steps at 1 %
        per_leaf = [3 * 4 * n + sum(8 * int(d * n) for d in (0.25, 0.0625, 0.015625, *[0.01] * 6))
                    for n in big]  # fmt: skip
    else:
        per_leaf = [12 * 8 * int(0.01 * n) for n in big]
    assert summary.communication["bytes_sent_per_worker"] == sum(per_leaf) + 12 * 4 * small
    assert summary.communication["dense_bytes_per_worker"] == 12 * 4 * sum(sizes)
    # What the network carries among 8 workers (ring collectives): each Top-k payload
    # reaches the 7 others (all-gather); dense steps and small leaves are all-reduced, at
    # 2 * 7 / 8 of their bytes, as is every gradient in the dense baseline.
    c = summary.communication
    warmup = 3 * 4 * sum(big) if changes else 0  # the dense steps of the compressed leaves
    gathered, reduced, dense = sum(per_leaf) - warmup, warmup + 12 * 4 * small, 12 * 4 * sum(sizes)
    assert c["num_workers"] == 8 and "crossover_workers_hierarchical" not in c
    assert c["wire_bytes_per_worker"] == pytest.approx(7 * gathered + 7 / 4 * reduced)
    assert c["dense_wire_bytes_per_worker"] == pytest.approx(7 / 4 * dense)
    assert c["wire_bytes_per_worker"] > c["bytes_sent_per_worker"]
    # More than dense from N workers on: (N - 1) G > 2 (N - 1) / N (D - R) <=> N > 2 (D - R) / G.
    assert c["crossover_workers"] == 2 * (dense - reduced) // gathered + 1


def test_worker_count_change_policy(tmp_path):
    workdir = str(tmp_path / "run")
    config = small_digits()
    train.train_and_evaluate(config, workdir, halt_after_step=4)
    old = train.final_state(workdir)

    fewer = small_digits(num_workers=4, batch_size_per_worker=32)
    with pytest.raises(checkpointing.WorkerCountMismatch, match="written by 8 workers"):
        train.train_and_evaluate(fewer, workdir)

    fewer.on_worker_change = "average"
    summary = train.train_and_evaluate(fewer, workdir, halt_after_step=6)
    assert summary.step == 6
    new = train.final_state(workdir)
    per_worker_old = [x.shape for x in jax.tree.leaves(old["opt_state"]) if x.ndim >= 3]
    per_worker_new = [x.shape for x in jax.tree.leaves(new["opt_state"]) if x.ndim >= 3]
    assert per_worker_old and [(8, *s[1:]) for s in per_worker_new] == per_worker_old
    assert all(s[0] == 4 for s in per_worker_new)


def restore_checkpoint(workdir: str, config, step: int, on_worker_change: str = "average"):
    """Checkpoint ``step`` of ``workdir`` restored (to host) into ``config``'s layout with
    the run's redistribution, under ``on_worker_change``, without training."""
    run = train.build_run(config)
    state = train.initial_state(run)
    ckpt = checkpointing.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        keep=3,
        num_workers=config.num_workers,
        on_worker_change=on_worker_change,
        local_devices=run.local_devices,
    )
    like = {"params": state.params, "opt_state": state.opt_state, "model_state": state.model_state}
    redistribute = train.worker_redistribution(run, state.abstract_params)
    try:
        restored = ckpt.restore(step, like, state.step_fn.state_specs, run.mesh, redistribute)
    finally:
        ckpt.close()
    return jax.device_get(restored)


def test_mean_redistribution_keeps_the_pending_update(tmp_path):
    """Each new worker gets the old workers' mean residual, so mean_w R_w is unchanged.

    In float32, where the mean is exact; a block format re-encodes it (within one code
    step: tests/test_quantized_resize.py)."""
    workdir = str(tmp_path / "run")
    float32 = {"compression.residual_format": "float32"}
    train.train_and_evaluate(small_digits(**float32), workdir, halt_after_step=4)
    old = restore_checkpoint(workdir, small_digits(**float32), 4)
    fewer = small_digits(num_workers=2, batch_size_per_worker=64, **float32)
    restored = restore_checkpoint(workdir, fewer, 4)
    # The shared group residual (dense) is averaged exactly.
    (state_old,) = [x for x in _nodes(old) if isinstance(x, rr.ExchangeState)]
    (state_new,) = [x for x in _nodes(restored) if isinstance(x, rr.ExchangeState)]
    shared = "hidden_*/kernel[256x256]#0"
    for w in range(2):
        np.testing.assert_allclose(
            state_new.residuals[shared][w],
            state_old.residuals[shared].mean(0),
            rtol=1e-6,
            atol=1e-7,
        )
    # The 2-D store of hidden_0 is re-selected from the mean of the old dense residuals.
    block_old, block_new = (
        state_old.residuals["hidden_0/kernel"],
        state_new.residuals["hidden_0/kernel"],
    )
    dense_mean = np.zeros((64, 256))
    for w in range(8):
        rows, cols = block_old.rows[w], block_old.cols[w]  # rows: output units (axis 1)
        dense_mean[np.ix_(cols, rows)] += block_old.values[w] / 8
    top_rows = np.sort(np.argsort(-np.abs(dense_mean).sum(0), kind="stable")[:128])
    top_cols = np.sort(np.argsort(-np.abs(dense_mean).sum(1), kind="stable")[:32])
    for w in range(2):
        np.testing.assert_array_equal(block_new.rows[w], top_rows)
        np.testing.assert_array_equal(block_new.cols[w], top_cols)
        np.testing.assert_allclose(
            block_new.values[w], dense_mean[np.ix_(top_cols, top_rows)], rtol=1e-5, atol=1e-7
        )
    # Replicated state (momentum, step counters) is restored as written.
    np.testing.assert_array_equal(state_new.count, state_old.count)


def _nodes(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, rr.ExchangeState))


def test_corrupt_checkpoint_is_reported(tmp_path):
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(small_digits(), workdir, halt_after_step=4)
    state_dir = os.path.join(workdir, "checkpoints", "4", "state")
    for name in os.listdir(state_dir):
        path = os.path.join(state_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    with pytest.raises(ValueError, match=r"Checkpoint 4 .*(unreadable|does not match)"):
        train.train_and_evaluate(small_digits(), workdir)


# ------------------------------------------------------------------ non-finite policy


def test_nonfinite_raise_names_step_and_cause(tmp_path):
    """The default guard decides from the loss (the exploding weights make it inf)."""
    config = small_digits(**{"compression.nonfinite": "raise", "optimizer.learning_rate": 1e30})
    with pytest.raises(train.NonFiniteGradients, match=r"step \d+ in the loss \(on at least"):
        train.train_and_evaluate(config, str(tmp_path / "run"))


def test_config_guard_modes_are_the_library_modes():
    assert config_schema.GUARD_MODES == rr.nonfinite.MODES
    assert config_schema.WEIGHT_UPDATE_ORDERS == rr.parallel.WEIGHT_UPDATE_ORDERS


@pytest.mark.parametrize(
    "budget",
    [
        *("12GiB", "8 GB", "1.5gib", "12884901888", " 512MiB ", 1024, 2048.0, "1e3kb"),
        *("abc", "60%", "12G", "0", "-1GiB", 0.5, float("nan"), True, None, "1 kb/s"),
    ],
)
def test_config_memory_budget_is_read_as_the_planner_reads_it(budget):
    """config_schema's jax-free copy: the same bytes, or the same error."""
    from resireduce_jax import planner

    def read(parse):
        try:
            return parse(budget)
        except ValueError as error:
            return str(error)

    assert read(config_schema.parse_memory_budget) == read(planner.parse_budget)


def test_strict_guard_mode_names_the_gradient(tmp_path):
    """compression.guard_mode='strict' decides from the gradients, and says which one."""
    config = small_digits(
        **{
            "compression.nonfinite": "raise",
            "compression.guard_mode": "strict",
            "optimizer.learning_rate": 1e30,
        }
    )
    with pytest.raises(train.NonFiniteGradients, match=r"in the gradient of '[\w/]+'"):
        train.train_and_evaluate(config, str(tmp_path / "run"))


def test_nonfinite_skip_keeps_training_finite(tmp_path):
    config = small_digits(**{"optimizer.learning_rate": 1e30})
    summary = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert summary.skipped_steps > 0
    state = train.final_state(str(tmp_path / "run"))
    for leaf in jax.tree.leaves(state):
        if np.issubdtype(leaf.dtype, np.floating):
            assert np.isfinite(leaf).all()
    records = metrics_lib.read_metrics(str(tmp_path / "run"))
    assert max(r.get("skipped_steps", 0) for r in records) == summary.skipped_steps


# ------------------------------------------------------------------ outputs


def test_outputs_metrics_memory_report_and_residual_pdfs(tmp_path, capsys):
    config = small_digits(
        **{"compression.variant": "ef", "residual_analysis.layers": "hidden_[123]"}
    )
    workdir = str(tmp_path / "run")
    summary = train.train_and_evaluate(config, workdir)
    out = capsys.readouterr().out
    assert "Model states per worker" in out and "Final eval: accuracy=" in out
    records = metrics_lib.read_metrics(workdir)
    assert {r["split"] for r in records} == {"train", "eval"}
    assert os.listdir(os.path.join(workdir, "tensorboard"))
    assert os.path.exists(os.path.join(workdir, "residual_pdfs_step12.png"))
    pdfs = np.load(os.path.join(workdir, "residual_pdfs.npz"))
    assert {k.split("/")[1] for k in pdfs.files} == {"hidden_1", "hidden_2", "hidden_3"}
    for key in pdfs.files:
        if key.endswith("density"):
            edges = pdfs[key.replace("density", "edges")]
            np.testing.assert_allclose(np.sum(pdfs[key] * np.diff(edges)), 1.0, rtol=1e-3)
    # EF in int3 (the default config's format) against float32 EF: codes and scales, 3 / 8
    # + 4 / 128 bytes a value instead of 4 (every compressed leaf is a multiple of 128).
    ef = summary.memory["baseline"]["residuals"]
    assert summary.memory["reduced"]["residuals"] * 4 == ef * (3 / 8 + 4 / 128) > 0
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["compression"]["variant"] == "ef"
    # The three hidden layers (one shape) are the group ResiReduce-w would form.
    with open(os.path.join(workdir, "residual_sharing.json")) as f:
        (group,) = json.load(f)["12"].values()
    assert group["members"] == [f"hidden_{i}/kernel" for i in (1, 2, 3)]
    assert -1 <= group["cosine_min"] <= group["cosine_mean"] <= group["cosine_max"] <= 1
    assert group["mean_error"] > 0
    assert "Residual sharing at step 12" in out


def test_a_finished_run_started_again_prints_its_final_eval(tmp_path, capsys):
    """Re-running the command of a finished run trains nothing and reports its figures."""
    config, workdir = small_digits(num_steps=2), str(tmp_path / "run")
    first = train.train_and_evaluate(config, workdir)
    capsys.readouterr()
    again = train.train_and_evaluate(config, workdir)
    out = capsys.readouterr().out
    assert again.step == 2 and "already complete at step 2" in out
    (line,) = [x for x in out.splitlines() if x.startswith("Final eval:")]
    assert line == "Final eval: " + ", ".join(f"{k}={v:.4f}" for k, v in first.eval.items())
    assert first.eval and again.eval == first.eval and again.train == first.train
    with open(os.path.join(workdir, train.SUMMARY_FILE)) as f:
        assert json.load(f)["eval"] == first.eval


def test_a_run_compiles_the_density_phases_it_reaches(tmp_path, capsys):
    """With a dense warm-up (4 of 8 steps), the report is of the phase the run starts in;
    a run that stops in the warm-up compiles its step once, and the resumed run (in the
    warm-up still) compiles that phase and then the top-k phase, printing that program's
    peak at its first step."""
    compiles = []

    def listen(event, duration, **fields):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(fields.get("fun_name"))

    config = small_digits(num_steps=8, **{"compression.density_schedule.dense_fraction": 0.5})
    workdir = str(tmp_path / "run")
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first = train.train_and_evaluate(config, workdir, halt_after_step=2)
        out = capsys.readouterr().out
        assert first.step == 2 and compiles.count("jit(train_step)") == 1
        assert first.memory["compiled_peak"]["density_phase"] == 0
        assert "the peaks above are of the phase this run starts in, 0 dense" in out
        assert "Density phase" not in out
        compiles.clear()
        resumed = train.train_and_evaluate(config, workdir)
        out = capsys.readouterr().out
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert resumed.step == 8 and compiles.count("jit(train_step)") == 2  # phase 0, then 1
    (line,) = [x for x in out.splitlines() if x.startswith("Density phase 1 topk")]
    assert "its program compiled, peak" in line


def test_memory_report_prints_the_compiled_peak_of_the_step_beside_ef_and_dense(tmp_path, capsys):
    config = small_digits(**{"compression.variant": "w+2d", "memory.compare_baselines": True})
    summary = train.train_and_evaluate(config, str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert "Compiled train step per worker" in out and "skip_nonfinite on" in out
    rows = {r["variant"]: r for r in summary.memory["compiled_peak"]["rows"]}
    assert set(rows) == {"w+2d+int3", "ef", "dense"}
    for r in rows.values():  # the peak is what the compiled program holds at once
        assert r["peak"] == r["argument"] + r["output"] - r["alias"] + r["temp"] > 0
    assert rows["dense"]["residuals"] == 0
    assert 0 < rows["w+2d+int3"]["residuals"] < rows["ef"]["residuals"]
    # The residual saving reaches the peak of the step the program runs.
    assert rows["w+2d+int3"]["peak"] < rows["ef"]["peak"]


def test_the_compilation_cache_is_the_configs_then_the_environments_then_the_workdirs(
    tmp_path, monkeypatch
):
    from train import compiled_step

    session = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    workdir, named, shared = (str(tmp_path / d) for d in ("run", "named", "shared"))
    config = ml_collections.ConfigDict({"compilation_cache_dir": None})
    try:
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", shared)
        assert compiled_step.use_compilation_cache(config, workdir) == shared
        assert jax.config.jax_compilation_cache_dir == shared
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
        expected = os.path.join(workdir, "compilation_cache")
        assert compiled_step.use_compilation_cache(config, workdir) == expected
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", shared)
        config.compilation_cache_dir = named
        assert compiled_step.use_compilation_cache(config, workdir) == named
        config.compilation_cache_dir = ""
        assert compiled_step.use_compilation_cache(config, workdir) is None
        assert jax.config.jax_compilation_cache_dir is None
    finally:  # the session's cache again, for the tests after this one
        config.compilation_cache_dir = session or ""
        compiled_step.use_compilation_cache(config, workdir)


def test_a_run_compiles_its_step_once_and_a_resumed_run_loads_it(tmp_path, capsys, monkeypatch):
    """The memory report reads the executable the loop runs; JAX's persistent cache under
    the workdir gives a resumed run the compiled step without compiling it."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")  # the test session's shared cache
    compiles, hits = [], []

    def listen(event, duration, **fields):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(fields.get("fun_name"))
        if event == "/jax/compilation_cache/compile_time_saved_sec":
            hits.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    workdir = str(tmp_path / "run")
    try:
        first = train.train_and_evaluate(small_digits(num_steps=1), workdir)
        assert compiles.count("jit(train_step)") == 1
        (row,) = first.memory["compiled_peak"]["rows"]  # the trained step alone
        assert row["variant"] == "w+2d+int3" and row["peak"] > row["argument"] > 0
        assert os.listdir(os.path.join(workdir, "compilation_cache"))
        compiles.clear()
        resumed = train.train_and_evaluate(small_digits(num_steps=2), workdir)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert resumed.step == 2 and "Resumed from checkpoint at step 1" in capsys.readouterr().out
    assert compiles.count("jit(train_step)") == 1 and hits  # loaded, not compiled
    (again,) = resumed.memory["compiled_peak"]["rows"]
    same = lambda r: {k: v for k, v in r.items() if k != "compile_seconds"}
    assert same(again) == same(row)
