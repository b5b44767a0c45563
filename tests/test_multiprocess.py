"""Multi-process training on one machine: agreement, kill and resume, SIGTERM, NaN.

Every test launches the real program (``python -m train``) as several processes on
127.0.0.1 (jax.distributed with gloo CPU collectives; docs/design.md, "Multi-process runs
on one machine"), each simulating ``num_workers / num_processes`` devices and feeding its
own rows of every global batch.
Ports are picked free, every wait is bounded, and children are killed in ``finally``.

Jobs are started by :class:`train.local_job.LocalJob`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import chex
import jax
import numpy as np
import pytest

from train import metrics as metrics_lib
from train import train
from train.local_job import (
    DIGEST,
    RESUMED,
    ROOT,
    STARTUP_TIMEOUT_S,
    STOPPED,
    LocalJob,
    committed_steps,
    free_port,
)

# The job every test runs (a short version of configs/default.py on 4 workers).
JOB = {
    "num_workers": 4,
    "batch_size_per_worker": 32,
    "num_steps": 24,
    "log_every": 1,  # progress is detected from metrics.jsonl
    "eval_every": 1000,
    "checkpoint_every": 6,  # not a multiple of train.STOP_SYNC_EVERY (where SIGTERM stops)
    "keep_checkpoints": 10,
}

# Runs the training program with NaN written into one image of global batch `step`, in
# global row `row` (so only the worker and the process holding that row see it).
NAN_INJECTING_MAIN = """
import sys
import numpy as np
from train.data import images

bad_step, bad_row = int(sys.argv[1]), int(sys.argv[2])
original = images.DigitsDataset._train_examples

def poisoned(self, epochs, indices, *, step, rows, global_batch_size):
    batch = original(self, epochs, indices, step=step, rows=rows,
                     global_batch_size=global_batch_size)
    if step == bad_step and rows.start <= bad_row < rows.stop:
        batch["image"] = batch["image"].copy()
        batch["image"][bad_row - rows.start] = np.nan
    return batch

images.DigitsDataset._train_examples = poisoned
from train import main
sys.argv = ["train", *sys.argv[3:]]
main.cli()
"""


def run_to_completion(workdir, num_processes, overrides=JOB, flags=()) -> LocalJob:
    """Runs a job to its end; asserts that every process exits 0 with the same digest."""
    with LocalJob(workdir, num_processes, overrides, flags) as job:
        codes = job.wait()
    assert codes == [0] * num_processes, [job.output(i)[-3000:] for i in range(num_processes)]
    digests = job.digests()
    assert sorted(digests) == list(range(num_processes)), digests
    assert len(set(digests.values())) == 1, digests
    return job


def config_for(overrides: dict[str, Any]):
    from tests.test_train import load_config

    c = load_config("default")
    for key, value in overrides.items():
        c[key] = value
    return c


def flat_params(state) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(state["params"])])


def assert_close_to_one_process(multi_dir: str, config, single_dir: str) -> None:
    """Trains ``config`` in this process (all its workers here) into ``single_dir`` and
    checks the multi-process run in ``multi_dir`` against it: the same train losses
    (rtol 1e-4) and params within 5 % of the distance travelled from the initial ones."""
    summary = train.train_and_evaluate(config, single_dir)
    assert summary.step == config.num_steps
    run = train.build_run(config)
    init = jax.device_get(train.initial_state(run).params)
    start = np.concatenate([np.ravel(x) for x in jax.tree.leaves(init)])

    multi, single = train.final_state(multi_dir), train.final_state(single_dir)
    moved = np.linalg.norm(flat_params(single) - start)
    drift = np.linalg.norm(flat_params(multi) - flat_params(single))
    assert moved > 0 and drift / moved < 0.05, (drift, moved)
    chex.assert_trees_all_equal_shapes_and_dtypes(multi, single)
    loss = lambda w: [r["loss"] for r in metrics_lib.read_metrics(w) if r["split"] == "train"]
    np.testing.assert_allclose(loss(multi_dir), loss(single_dir), rtol=1e-4)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-process x 2-device run of JOB."""
    workdir = str(tmp_path_factory.mktemp("multiprocess") / "reference")
    run_to_completion(workdir, 2)
    return workdir


# ------------------------------------------------------------------ agreement


@pytest.mark.slow
def test_two_processes_match_one_process_with_the_same_devices_per_process(tmp_path):
    """2 processes x 1 device == 1 process x 2 devices, bit for bit.

    With the same number of devices per process every worker computes its local gradient
    with the same code and threads, and a 2-worker sum does not depend on the order: the
    only difference left is the transport (gloo between processes), and it changes nothing.
    """
    two = {**JOB, "num_workers": 2, "batch_size_per_worker": 64, "num_steps": 12}
    multi = run_to_completion(str(tmp_path / "multi"), 2, two)
    single = run_to_completion(str(tmp_path / "single"), 1, two)
    assert multi.digests()[0] == single.digests()[0]
    chex.assert_trees_all_equal(
        train.final_state(str(tmp_path / "multi")), train.final_state(str(tmp_path / "single"))
    )


@pytest.mark.xdist_group("multiprocess_reference")  # one worker runs `reference` once
@pytest.mark.slow
def test_two_by_two_processes_are_close_to_one_process_with_four_workers(reference, tmp_path):
    """2 processes x 2 devices vs 1 process x 4 workers: same losses, params within 5 %.

    Not bit-identical: the dense all-reduce adds in another order over gloo (below), and
    this process, which trains the reference, runs its 8 simulated devices with another
    intra-op thread pool than the program's (``runtime.configure_cpu``), so its local
    gradients round differently too. Error feedback with Top-k turns such 1-ulp
    differences into a few different selections, so the trajectories drift apart slowly.
    A wrong data shard or a broken exchange moves the params by the order of the
    distance travelled itself.
    """
    assert_close_to_one_process(reference, config_for(JOB), str(tmp_path / "single"))


# The dense all-reduce of 8 float32 vectors (row d of <out>.in.npy on device d of the
# program's mesh) in `processes` processes of 8 / processes devices; argv: processes, this
# process's index, coordinator port, <out> (the result goes to <out>.npy).
ALL_REDUCE_PROBE = """
import sys
processes, index, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
from resireduce_jax import runtime
runtime.configure_cpu(8 // processes)
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from resireduce_jax import parallel
from train import distributed

setup = distributed.ProcessSetup(f"127.0.0.1:{port}", processes, index)
distributed.start(setup, initialization_timeout_s=60)
x = np.load(out + ".in.npy")
mesh = parallel.make_mesh(8)
rows = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("data")), lambda i: x[i])
total = jax.jit(
    jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
)(rows)
if index == 0:
    np.save(out + ".npy", np.asarray(total.addressable_shards[0].data)[0])
"""


def _all_reduce(x: np.ndarray, processes: int, out: str) -> np.ndarray:
    np.save(out + ".in.npy", x)
    port, env = free_port(), {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ALL_REDUCE_PROBE, str(processes), str(i), str(port), out],
            cwd=ROOT,
            env={**env, "PYTHONPATH": ROOT},
        )
        for i in range(processes)
    ]
    try:
        assert [p.wait(timeout=STARTUP_TIMEOUT_S) for p in procs] == [0] * processes
    finally:
        for p in procs:
            p.kill()
    return np.load(out + ".npy")


def _sum_in_order(x: np.ndarray, order) -> np.ndarray:
    total = x[order[0]].copy()
    for d in order[1:]:
        total += x[d]  # float32, one addition at a time
    return total


@pytest.mark.slow
def test_the_all_reduce_adds_in_device_order_in_one_process_and_ring_order_across(tmp_path):
    """Why 1 x 8 and 2 x 4 differ in the last bits: the dense all-reduce's summation order.

    In one process XLA:CPU adds the 8 devices' values in device order. Across processes
    gloo runs a ring all-reduce with every device as one rank: the buffer is cut into 8
    chunks and chunk ``c`` is summed around the ring starting at rank ``c - 1``, downward.
    Float addition is not associative, so the two layouts round differently.
    """
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 1024)) * 10.0 ** rng.integers(-4, 4, (8, 1024))).astype(np.float32)
    one, two = _all_reduce(x, 1, str(tmp_path / "1x8")), _all_reduce(x, 2, str(tmp_path / "2x4"))
    np.testing.assert_array_equal(one, _sum_in_order(x, range(8)))
    chunks = np.split(np.arange(x.shape[1]), 8)
    ring = np.concatenate(
        [_sum_in_order(x[:, c], [(i - 1 - k) % 8 for k in range(8)]) for i, c in enumerate(chunks)]
    )
    np.testing.assert_array_equal(two, ring)
    assert np.any(one != two)
    bound = 7 * np.finfo(np.float32).eps * np.abs(x).sum(0)  # of any summation order
    assert np.all(np.abs(one - two) <= bound)


# 8 workers in 1 process x 8 devices or 2 processes x 4 devices; a checkpoint every step.
# 64 examples per worker: XLA:CPU's default intra-op pools (8 and 4 threads on a machine of
# fewer cores) round these local gradients differently (runtime.configure_cpu).
EIGHT = {**JOB, "num_workers": 8, "batch_size_per_worker": 64, "num_steps": 3}
EIGHT["checkpoint_every"] = 1


def _leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _relative(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    difference = np.concatenate([np.ravel(a[k] - b[k]) for k in a])
    return float(
        np.linalg.norm(difference)
        / np.linalg.norm(np.concatenate([np.ravel(x) for x in a.values()]))
    )


@pytest.mark.slow
def test_one_by_eight_and_two_by_four_differ_only_by_the_dense_all_reduce(tmp_path):
    """Same config and seed, 1 process x 8 devices vs 2 processes x 4 devices.

    Data order, keys, init and every worker's local gradient are the same (the program
    sizes the intra-op thread pool from the job, not from the process's devices): after
    step 1 every worker's residuals and the compressed leaves (all-gathered, summed worker
    after worker in one order, ``compressors.base.sparse_mean``) are equal bit for bit;
    only the leaves reduced densely (fewer than ``compression.min_size`` elements:
    ``psum``) differ, in the last bits (the order above). Later steps carry that rounding
    on: after 3 steps the params still agree to 1e-6 relative (measured: about 1e-10).
    """
    single, multi = str(tmp_path / "1x8"), str(tmp_path / "2x4")
    run_to_completion(single, 1, EIGHT)
    run_to_completion(multi, 2, EIGHT)
    min_size = config_for(EIGHT).compression.min_size
    a, b = train.final_state(single, 1), train.final_state(multi, 1)
    residuals = lambda state: {
        k: x for k, x in _leaves(state["opt_state"]).items() if "residuals" in k
    }
    assert residuals(a) and all(x.shape[0] == 8 for x in residuals(a).values())
    chex.assert_trees_all_equal(residuals(a), residuals(b))
    params_a, params_b = _leaves(a["params"]), _leaves(b["params"])
    dense = {k for k, x in params_a.items() if x.size < min_size}
    assert dense and dense != set(params_a)
    for key in set(params_a) - dense:
        np.testing.assert_array_equal(params_a[key], params_b[key], err_msg=key)
    assert any(np.any(params_a[k] != params_b[k]) for k in dense)
    assert _relative(params_a, params_b) < 1e-6

    a, b = train.final_state(single), train.final_state(multi)
    assert _relative(_leaves(a["params"]), _leaves(b["params"])) < 1e-6
    assert _relative(residuals(a), residuals(b)) < 1e-6


# ------------------------------------------------------------------ preemption and crashes


@pytest.mark.xdist_group("multiprocess_reference")  # one worker runs `reference` once
@pytest.mark.slow
def test_sigterm_then_sigkill_then_resume_is_bit_identical(reference, tmp_path):
    """A preempted job (SIGTERM), resumed, then killed (SIGKILL), then resumed to the end.

    1. SIGTERM reaches process 1 only. The processes agree on stopping every
       ``train.STOP_SYNC_EVERY`` steps, so both save that step (not a regular checkpoint
       step) and exit 0. (Before that agreement the signalled process stopped alone and
       the other one waited in the next step's collectives forever.)
    2. The resumed job is SIGKILLed at a step drawn from a seeded RNG (possibly while
       orbax writes a checkpoint in the background); nothing half-written is resumed from.
    3. The final state (params, optimizer state, every worker's residuals) equals the
       uninterrupted run's bit for bit.
    """
    workdir = str(tmp_path / "preempted")
    with LocalJob(workdir, 2, JOB) as job:
        job.wait_for_step(2)
        job.send(signal.SIGTERM, processes=[1])
        codes = job.wait(timeout=120)
        out = job.output(0)
    assert codes == [0, 0], out[-3000:]
    (stopped,) = (int(s) for s in STOPPED.findall(out))
    assert stopped % train.STOP_SYNC_EVERY == 0 and stopped < JOB["num_steps"], out[-2000:]
    assert stopped % JOB["checkpoint_every"] != 0
    assert committed_steps(workdir)[-1] == stopped
    assert len(set(job.digests().values())) == 1

    kill_at = int(np.random.default_rng(20240605).integers(stopped + 1, JOB["num_steps"] - 1))
    with LocalJob(workdir, 2, JOB) as job:
        job.wait_for_step(kill_at)
        job.send(signal.SIGKILL)
        codes = job.wait(timeout=60)
        assert int(RESUMED.search(job.output(0)).group(1)) == stopped
    assert codes == [-signal.SIGKILL] * 2
    survived = committed_steps(workdir)

    resumed = run_to_completion(workdir, 2)
    assert int(RESUMED.search(resumed.output(0)).group(1)) == survived[-1]
    chex.assert_trees_all_equal(train.final_state(workdir), train.final_state(reference))
    with open(f"{reference}.run0.p0.log") as f:
        assert resumed.digests()[0] == DIGEST.search(f.read()).group(2)


# ------------------------------------------------------------------ lost peer
# A killed or never-started peer: tests/test_lost_peer.py.


# ------------------------------------------------------------------ non-finite gradients


@pytest.mark.slow
def test_nan_on_one_process_is_skipped_by_all_and_never_stored(tmp_path):
    """NaN in one image of process 1's rows at step 5: every process skips that step."""
    workdir = str(tmp_path / "nan")
    job_config = {**JOB, "num_steps": 8, "checkpoint_every": 1}
    bad_step, bad_row = 5, 100  # rows 64..127 belong to process 1 (worker 3)
    program = ("-c", NAN_INJECTING_MAIN, str(bad_step), str(bad_row))
    with LocalJob(workdir, 2, job_config, program=program) as job:
        codes = job.wait()
    assert codes == [0, 0], job.output(0)[-3000:]
    assert len(set(job.digests().values())) == 1

    records = [r for r in metrics_lib.read_metrics(workdir) if r["split"] == "train"]
    assert [r["skipped_steps"] for r in records] == [0] * bad_step + [1] * (8 - bad_step)
    states = {s: train.final_state(workdir, s) for s in committed_steps(workdir)}
    assert sorted(states) == list(range(1, 9))
    for state in states.values():
        for leaf in jax.tree.leaves(state):
            if np.issubdtype(leaf.dtype, np.floating):
                assert np.isfinite(leaf).all()
    # Batch `bad_step` was skipped: params, residuals and momentum did not move.
    before, after = states[bad_step], states[bad_step + 1]
    chex.assert_trees_all_equal(before["params"], after["params"])
    chex.assert_trees_all_equal(before["opt_state"]["inner"], after["opt_state"]["inner"])
    assert not np.array_equal(
        flat_params(states[bad_step + 2]), flat_params(after)
    )  # and training went on
