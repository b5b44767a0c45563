"""A change of the worker count with residuals in a block format: every new worker keeps the
old workers' mean residual re-encoded (within one code step of stochastic rounding, the
same bits every time), through ``resize_workers`` and through a checkpoint the training
program restores on fewer workers."""

from __future__ import annotations

import os

import jax
import numpy as np
import optax

import resireduce_jax as rr
from resireduce_jax import residual_formats
from tests.test_quantized_dgc import _np_decode
from tests.test_quantized_residuals import W, _batch, _digits, _loss, _params


def _run_ef(fmt, steps: int = 2):
    tx = rr.error_feedback(rr.compressors.topk(0.05), min_size=1000, residual_format=fmt)
    mesh = rr.parallel.make_mesh(W)
    step = rr.parallel.data_parallel_step(_loss, optax.chain(tx, rr.optimizers.sgd(0.1)), mesh)
    params, state = step.init(_params())
    for t in range(steps):
        params, state, _ = step(params, state, rr.parallel.shard_batch(_batch(t), mesh))
    (ex,) = rr.exchange.exchange_states(state)
    (specs,) = rr.exchange.exchange_states(step.state_specs)
    return tx, jax.tree.map(np.asarray, ex), specs


def test_resize_workers_re_encodes_the_mean_within_one_stochastic_step():
    fmt = residual_formats.parse_format("int4/64/stochastic")
    tx, ex, specs = _run_ef(fmt)
    plan = tx.plan(_params())
    resized = rr.exchange.resize_workers(ex, specs, plan, 4)
    again = rr.exchange.resize_workers(ex, specs, plan, 4)
    for path in (f"d{i}/kernel" for i in range(4)):
        old, new = ex.residuals[path], resized.residuals[path]
        assert isinstance(new, residual_formats.Quantized) and new.codes.shape[0] == 4
        np.testing.assert_array_equal(new.codes, again.residuals[path].codes)  # reproducible
        mean = np.mean(
            [
                _np_decode(jax.tree.map(lambda x, w=w: x[w], old), "int4", (64, 64))
                for w in range(W)
            ],
            axis=0,
            dtype=np.float64,
        )
        for w in range(4):
            stored = jax.tree.map(lambda x, w=w: x[w], new)
            got = _np_decode(stored, "int4", (64, 64))
            step = np.repeat(stored.scales, 64).reshape(64, 64)  # one code step a value
            assert (np.abs(got - mean) <= step * (1 + 1e-5) + 1e-12).all(), (path, w)
            np.testing.assert_array_equal(stored.codes, new.codes[0])  # every worker alike
        assert (mean != 0).any()


def test_a_quantized_checkpoint_restores_on_fewer_workers(tmp_path):
    """8 workers write int8 codes of w+2d's stores; 4 restore them (on_worker_change=
    "average"): each gets the old mean of the shared residual, within half a code step."""
    from tests.test_train import restore_checkpoint
    from train import train

    workdir = str(tmp_path / "run")
    config = _digits(**{"compression.residual_format": "int8"})
    train.train_and_evaluate(config, workdir, halt_after_step=4)
    old = restore_checkpoint(workdir, config, 4)
    fewer = _digits(**{"compression.residual_format": "int8"})
    fewer.num_workers, fewer.batch_size_per_worker = 4, 2 * config.batch_size_per_worker
    new = restore_checkpoint(workdir, fewer, 4)

    def exchange(state):
        is_ex = lambda x: isinstance(x, rr.ExchangeState)
        (ex,) = [x for x in jax.tree.leaves(state["opt_state"], is_leaf=is_ex) if is_ex(x)]
        return ex

    shared = "hidden_*/kernel[256x256]#0"
    before, after = exchange(old).residuals[shared], exchange(new).residuals[shared]
    assert before.codes.shape[0] == 8 and after.codes.shape[0] == 4
    assert before.codes.dtype == after.codes.dtype == np.int8
    mean = np.mean(
        [
            _np_decode(jax.tree.map(lambda x, w=w: x[w], before), "int8", (256, 256))
            for w in range(8)
        ],
        axis=0,
        dtype=np.float64,
    )
    for w in range(4):
        stored = jax.tree.map(lambda x, w=w: x[w], after)
        got = _np_decode(stored, "int8", (256, 256))
        half = np.repeat(stored.scales, 256).reshape(256, 256) / 2
        assert (np.abs(got - mean) <= half * (1 + 1e-5) + 1e-12).all(), w
    assert os.path.isdir(os.path.join(workdir, "checkpoints"))
