"""The training program with the hierarchical exchange (issue 13): ``config.local_devices``.

8 simulated devices as 2 nodes x 4 devices: the embedded digits job trains, each device
keeps 1/4 of every residual, ``local_devices=1`` is the flat run bit for bit, checkpoints
keep the sharded residuals (and a change of the layout follows ``on_worker_change``), and
a 2-process x 4-device ``jax.distributed`` run (one process per node) matches one process
driving all 8 devices.
"""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest

import resireduce_jax as rr
from tests.test_cli import assert_user_error, run_cli
from tests.test_multiprocess import assert_close_to_one_process, run_to_completion
from tests.test_quantized_dgc import _np_decode
from tests.test_train import restore_checkpoint, small_digits
from train import checkpointing, config_schema, residual_analysis, train
from train import metrics as metrics_lib

L = 4
SHARED = "hidden_*/kernel[256x256]#0"  # hidden_1..3 share one weighted residual (256 x 256)
# Residuals as int4 codes (two a byte), a float32 scale per 128 values.
FORMAT, BLOCK = "int4", 128


def short(**changes):
    """The default embedded job with int4 residuals, 4 steps (no eval before the end)."""
    return small_digits(
        **{
            "num_steps": 4,
            "eval_every": 100,
            "checkpoint_every": 4,
            "compression.residual_format": FORMAT,
            **changes,
        }
    )


def _residual_leaves(state) -> list[np.ndarray]:
    """The per-device residual arrays of a checkpoint (leading axis: the 8 devices)."""
    leaves = jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]
    return [x for path, x in leaves if "residuals" in jax.tree_util.keystr(path)]


def _exchange_state(tree) -> rr.ExchangeState:
    (state,) = [
        x
        for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, rr.ExchangeState))
        if isinstance(x, rr.ExchangeState)
    ]
    return state


def _decoded_shards(stored: rr.residual_formats.Quantized, rows: int) -> np.ndarray:
    """Every device's shard of a 256-column store in int4, decoded: ``[devices, rows, 256]``."""
    at = lambda d: jax.tree.map(lambda x: np.asarray(x)[d], stored)
    return np.stack([_np_decode(at(d), "int4", (rows, 256)) for d in range(8)])


def _code_steps(stored: rr.residual_formats.Quantized, rows: int) -> np.ndarray:
    """One int4 code step (the block's scale) per value of every device's shard."""
    steps = np.repeat(np.asarray(stored.scales), BLOCK, axis=1)
    return steps[:, : rows * 256].reshape(8, rows, 256)


def _node_residuals(shards: np.ndarray, local: int, rows: int) -> np.ndarray:
    """Every node's residual of a 2-D store from its devices' shards: ``[nodes, rows, B]``."""
    nodes = shards.shape[0] // local
    whole = shards.reshape(nodes, local * shards.shape[1], shards.shape[2])
    return whole[:, :rows]


# ------------------------------------------------------------------ config


def test_local_devices_must_divide_the_workers_and_fit_a_process():
    with pytest.raises(config_schema.ConfigError, match="local_devices=3 must be >= 1 and divide"):
        config_schema.validate(short(local_devices=3))
    with pytest.raises(config_schema.ConfigError, match="local_devices=-2"):
        config_schema.validate(short(local_devices=-2))
    for unset in (None, 0):  # the flat exchange
        config = short(local_devices=unset)
        config_schema.validate(config)
        assert config_schema.local_devices(config) is None
    # One process per node: 8 workers over 2 processes hold 4 devices each.
    config_schema.check_processes(short(local_devices=4), 2)
    config_schema.check_processes(short(local_devices=2), 2)
    with pytest.raises(config_schema.ConfigError, match="does not fit 2 devices per process"):
        config_schema.check_processes(short(local_devices=4), 4)
    with pytest.raises(config_schema.ConfigError, match="does not split over 3 processes"):
        config_schema.check_processes(short(), 3)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--config.local_devices=3"], "local_devices=3 must be >= 1 and divide num_workers=8"),
        (
            [
                "--config.local_devices=4",
                "--coordinator_address=127.0.0.1:1",
                "--num_processes=4",
                "--process_id=0",
            ],
            "local_devices=4 does not fit 2 devices per process",
        ),
    ],
)
def test_the_program_reports_a_bad_local_devices_in_one_line(tmp_path, args, words):
    result = run_cli("--workdir", str(tmp_path / "run"), *args)
    assert_user_error(result, words)


# ------------------------------------------------------------------ training


def test_hierarchical_run_trains_with_a_quarter_of_the_residual_per_device(tmp_path, capsys):
    workdir = str(tmp_path / "run")
    summary = train.train_and_evaluate(short(local_devices=L), workdir)
    out = capsys.readouterr().out
    assert summary.step == 4 and np.isfinite(summary.train["loss"])
    assert np.isfinite(summary.eval["loss"])
    assert "Model states per device (2 nodes x 4 devices" in out
    assert "8 workers as 2 nodes x 4 devices, hierarchical exchange" in out
    c = summary.communication
    assert c["local_devices"] == L and c["num_workers"] == 8
    # Across 2 nodes each device's shard payload reaches the one other node (1 x) and the
    # small leaves' all-reduce crosses with 1/L of their bytes: less than bytes_sent. The
    # hierarchical crossover, in whole nodes, comes after the flat exchange's.
    assert c["wire_bytes_across_nodes_per_worker"] < c["bytes_sent_per_worker"]
    assert c["wire_bytes_per_worker"] > c["wire_bytes_across_nodes_per_worker"]
    assert c["dense_wire_bytes_across_nodes_per_worker"] == pytest.approx(
        c["dense_bytes_per_worker"] / L  # 2 (M - 1) / M = 1 for M = 2 nodes
    )
    assert c["crossover_workers_hierarchical"] % L == 0
    assert c["crossover_workers_hierarchical"] > c["crossover_workers"]
    assert "On the wire across nodes per worker (8 workers): " in out

    memory = summary.memory
    per_device, flat = memory["residual_bytes_per_device"], memory["flat_residual_bytes_per_device"]
    assert memory["local_devices"] == L and memory["reduced"]["residuals"] == per_device
    # Flat / L, plus the 2-D store's 128 kept output-unit indices (int32), which every
    # shard of hidden_0/kernel keeps whole; the blocks divide the shards evenly.
    assert flat / L <= per_device <= flat / L + 128 * 4, (per_device, flat)
    compiled = {r["variant"]: r for r in memory["compiled_peak"]["rows"]}
    assert compiled["w+2d+int4"]["residuals"] == per_device

    # The sharded state as checkpointed: 8 devices' arrays, together 8 x the report.
    residuals = _residual_leaves(train.final_state(workdir))
    assert residuals and all(x.shape[0] == 8 for x in residuals)
    assert sum(x.nbytes for x in residuals) == 8 * per_device
    # The shared group's residual: a quarter of the rows per device, as codes and scales.
    leaves = jax.tree_util.tree_flatten_with_path(train.final_state(workdir)["opt_state"])[0]
    shared = {jax.tree_util.keystr(p): x.shape for p, x in leaves if SHARED in str(p)}
    blocks = 256 // L * 256 // BLOCK
    assert sorted(shared.values()) == [(8, blocks), (8, blocks, BLOCK // 2)]


def test_one_local_device_is_the_flat_run_bit_for_bit(tmp_path):
    flat = train.train_and_evaluate(short(), str(tmp_path / "flat"))
    one = train.train_and_evaluate(short(local_devices=1), str(tmp_path / "one"))
    assert one.params_digest == flat.params_digest
    a, b = train.final_state(str(tmp_path / "flat")), train.final_state(str(tmp_path / "one"))
    chex.assert_trees_all_equal(a, b)  # params, optimizer state, every worker's residuals
    assert one.train == flat.train and one.eval == flat.eval
    assert one.memory["residual_bytes_per_device"] == flat.memory["flat_residual_bytes_per_device"]


def test_residual_analysis_puts_a_node_residual_together_from_its_shards():
    run = train.build_run(short(local_devices=L, **{"compression.variant": "ef"}))
    state = train.initial_state(run)
    plan = train.exchange_plan(run, state.abstract_params)
    (store,) = [p for p in plan.kept if p.group.paths[0] == "hidden_1/kernel"]
    assert store.shard is not None and store.group.shape == (256 // L, 256)
    exchange = _exchange_state(state.opt_state)
    stored = exchange.residuals[store.group.label]
    rng = np.random.default_rng(0)  # 8 devices' shards: every code, distinct scales
    codes = rng.integers(0, 256, stored.codes.shape, dtype=np.uint8)
    scales = rng.uniform(0.5, 2.0, stored.scales.shape).astype(np.float32)
    values = stored._replace(
        codes=jax.device_put(codes, stored.codes.sharding),
        scales=jax.device_put(scales, stored.scales.sharding),
    )
    filled = exchange._replace(residuals={**exchange.residuals, store.group.label: values})
    shards = _decoded_shards(values, 256 // L)
    for worker, node in ((0, 0), (5, 1)):
        found = residual_analysis.per_leaf_residuals([filled], plan, worker=worker)
        np.testing.assert_array_equal(
            found["hidden_1/kernel"], shards[node * L : (node + 1) * L].reshape(256, 256)
        )


# ------------------------------------------------------------------ checkpoints


def test_checkpoints_keep_the_shards_and_a_new_layout_follows_the_policy(tmp_path):
    config = short(local_devices=L, num_steps=6, checkpoint_every=3)
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    train.train_and_evaluate(config, full)
    first = train.train_and_evaluate(config, split, halt_after_step=3)
    assert first.preempted and first.step == 3
    resumed = train.train_and_evaluate(config, split)
    assert resumed.step == 6
    chex.assert_trees_all_equal(train.final_state(full), train.final_state(split))
    loss = lambda w: [r["loss"] for r in metrics_lib.read_metrics(w) if r["split"] == "train"]
    assert loss(full) == loss(split)

    # Another number of devices per node: refused by default, naming both layouts.
    two = short(local_devices=2, num_steps=8)
    with pytest.raises(
        checkpointing.WorkerCountMismatch,
        match=r"written by 8 workers as 2 nodes x 4 devices \(local_devices=4\); this run has "
        r"8 workers as 4 nodes x 2 devices \(local_devices=2\)\..*--config.local_devices=4",
    ):
        train.train_and_evaluate(two, split)
    with pytest.raises(checkpointing.WorkerCountMismatch, match=r"this run has 8 workers\. "):
        restore_checkpoint(split, short(), 6, on_worker_change="error")  # flat

    # Redistributed: every node of the new layout owes the old nodes' mean residual.
    old = _exchange_state(restore_checkpoint(split, config, 6))
    new = _exchange_state(restore_checkpoint(split, short(local_devices=2), 6))
    # (Re-encoded: within one code step of stochastic rounding.)
    before, after = old.residuals[SHARED], new.residuals[SHARED]
    assert before.codes.shape == (8, 256 // L * 256 // BLOCK, BLOCK // 2)
    assert after.codes.shape == (8, 256 // 2 * 256 // BLOCK, BLOCK // 2)
    owed = _node_residuals(_decoded_shards(before, 256 // L), L, 256).astype(np.float64).mean(0)
    got = _node_residuals(_decoded_shards(after, 256 // 2), 2, 256)
    steps = _node_residuals(_code_steps(after, 256 // 2), 2, 256)
    assert (owed != 0).any()
    for node, step in zip(got, steps, strict=True):
        assert (np.abs(node - owed) <= step * (1 + 1e-5) + 1e-12).all()
    np.testing.assert_array_equal(new.count, old.count)

    # ... and training goes on from there.
    two.on_worker_change = "average"
    summary = train.train_and_evaluate(two, split)
    assert summary.step == 8 and np.isfinite(summary.train["loss"])
    residuals = _residual_leaves(train.final_state(split))
    assert any(x.shape == (8, 256 // 2 * 256 // BLOCK, BLOCK // 2) for x in residuals)


# ------------------------------------------------------------------ multi-process


@pytest.mark.slow
def test_two_processes_of_one_node_each_match_one_process_with_both_nodes(tmp_path):
    """2 processes x 4 devices (one process per node) vs 1 process x 8 devices, L = 4.

    Close, not bit-identical: an all-reduce across processes (gloo's ring) adds in another
    order than one inside a process (docs/design.md, "Process layouts and bitwise
    results").
    """
    job = {
        "num_workers": 8,
        "local_devices": L,
        "batch_size_per_worker": 16,
        "num_steps": 8,
        "log_every": 1,
        "eval_every": 1000,
        "checkpoint_every": 8,
        "compression.residual_format": FORMAT,  # the single-process run's (short)
    }
    multi_dir = str(tmp_path / "multi")
    run_to_completion(multi_dir, 2, job)
    assert_close_to_one_process(multi_dir, short(**job), str(tmp_path / "single"))
