"""A user's own model and loop: own shard_map steps, one state layout, gradient accumulation,
Flax NNX and linen TrainState (docs/exchange.md, "Your own model and loop")."""

from __future__ import annotations

import functools
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from resireduce_jax import hlo

W = 8
ROOT = pathlib.Path(__file__).resolve().parents[1]
EXCHANGE_DOC = ROOT / "docs" / "exchange.md"


def _params(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        "hidden": {
            "kernel": rng.normal(0, 0.1, (32, 64)).astype(np.float32),
            "bias": rng.normal(0, 0.1, 64).astype(np.float32),
        },
        "out": {
            "kernel": rng.normal(0, 0.1, (64, 24)).astype(np.float32),
            "bias": np.zeros(24, np.float32),
        },
    }


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["hidden"]["kernel"] + params["hidden"]["bias"])
    return jnp.mean((h @ params["out"]["kernel"] + params["out"]["bias"] - batch["y"]) ** 2)


def _batch(seed: int, rows: int):
    rng = np.random.default_rng(100 + seed)
    return {
        "x": rng.normal(size=(rows, 32)).astype(np.float32),
        "y": rng.normal(size=(rows, 24)).astype(np.float32),
    }


def _ef():
    return rr.error_feedback(rr.compressors.topk(0.05), min_size=1000)


def _tx():
    return optax.chain(_ef(), optax.sgd(0.1, momentum=0.9))


def _own_step(tx, mesh, specs, *, local: bool):
    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)
    )
    def step(params, opt_state, batch):
        opt_state = rr.parallel.unstack_per_worker(opt_state, specs)
        wrt = lax.pcast(params, "data", to="varying") if local else params
        grads = jax.grad(_loss)(wrt, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, rr.parallel.stack_per_worker(opt_state, specs)

    return step


# ------------------------------------------------------------------ your own shard_map step


def test_gradients_summed_by_jax_grad_are_refused_with_the_fix():
    mesh = rr.parallel.make_mesh(W)
    tx = _tx()
    specs, opt_state = rr.parallel.init_state(tx, _params(), mesh)
    step = _own_step(tx, mesh, specs, local=False)
    params = rr.parallel.replicated(_params(), mesh)
    batch = rr.parallel.shard_batch(_batch(0, W * 4), mesh)
    with pytest.raises(rr.compressors.base.SummedGradientsError, match=r"lax\.pcast\(params"):
        step(params, opt_state, batch)
    with pytest.raises(ValueError, match="'hidden/bias', 'hidden/kernel', 'out/bias'"):
        step(params, opt_state, batch)


def test_own_step_equals_the_library_step_in_the_documented_layout():
    mesh = rr.parallel.make_mesh(W)
    tx = _tx()
    specs, own_state = rr.parallel.init_state(tx, _params(), mesh)
    own = _own_step(tx, mesh, specs, local=True)
    library = rr.parallel.data_parallel_step(_loss, tx, mesh)
    lib_params, lib_state = library.init(_params())
    own_params = rr.parallel.replicated(_params(), mesh)
    for t in range(3):
        batch = rr.parallel.shard_batch(_batch(t, W * 4), mesh)
        own_params, own_state = own(own_params, own_state, batch)
        lib_params, lib_state, _ = library(lib_params, lib_state, batch)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), own_params, lib_params
    )
    plan = _ef().plan(_params())
    (own_ef,) = rr.exchange.exchange_states(own_state)
    (lib_ef,) = rr.exchange.exchange_states(lib_state)
    own_r = jax.tree.map(np.asarray, rr.exchange.leaf_residuals(own_ef, plan))
    lib_r = jax.tree.map(np.asarray, rr.exchange.leaf_residuals(lib_ef, plan))
    assert set(own_r) == {"hidden/kernel", "out/kernel"}
    for path, value in own_r.items():
        assert value.shape == (W, *_params()[path.split("/")[0]]["kernel"].shape)
        np.testing.assert_allclose(value, lib_r[path], rtol=1e-5, atol=1e-7)
    # Residuals differ between workers (each keeps what its own payload missed).
    assert not np.allclose(own_r["hidden/kernel"][0], own_r["hidden/kernel"][1])


def test_a_state_laid_out_end_to_end_is_refused_by_leaf_residuals():
    mesh = rr.parallel.make_mesh(W)
    tx = _tx()
    specs = rr.parallel.state_partition_specs(tx, _params(), mesh)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(
        rr.parallel.replicated(_params(), mesh)
    )
    (ef,) = rr.exchange.exchange_states(state)
    assert ef.residuals["hidden/kernel"].shape == (W * 32, 64)  # the workers end to end
    with pytest.raises(ValueError, match=r"init_state\(tx, params, mesh\)"):
        rr.exchange.leaf_residuals(ef, _ef().plan(_params()))


def test_init_copies_the_callers_params_so_a_donating_step_leaves_them_valid():
    mesh = rr.parallel.make_mesh(W)
    step = rr.parallel.data_parallel_step(_loss, _tx(), mesh)
    params0 = jax.device_put(_params())  # jax arrays on the first device
    params, opt_state = step.init(params0)
    params, opt_state, _ = step(params, opt_state, rr.parallel.shard_batch(_batch(0, W * 4), mesh))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), params0, _params())
    assert not np.allclose(params["hidden"]["kernel"], params0["hidden"]["kernel"])


# ------------------------------------------------------------------- gradient accumulation


def test_accumulation_exchanges_once_per_call_and_equals_the_whole_batch_step():
    mesh = rr.parallel.make_mesh(W)
    k, rows = 4, W * 12
    batch0 = rr.parallel.shard_batch(_batch(0, rows), mesh)
    results, programs = {}, {}
    for steps in (1, k):
        step = rr.parallel.data_parallel_step(_loss, _tx(), mesh, accumulation_steps=steps)
        params, opt_state = step.init(_params())
        programs[steps] = step.compile(params, opt_state, batch0)
        for t in range(2):
            params, opt_state, metrics = step(
                params, opt_state, rr.parallel.shard_batch(_batch(t, rows), mesh)
            )
        results[steps] = (params, float(metrics["loss"]))
        (ef,) = rr.exchange.exchange_states(opt_state)
        assert int(ef.count) == 2  # two exchanges for 2 calls of k micro-batches
    # No collective inside the micro-batch loop: the exchange runs once per call.
    loops = hlo.loop_collectives(programs[k])
    assert loops and all(body == [] for body in loops)
    ops = lambda c: sorted(x.op for x in hlo.collectives(c))
    assert ops(programs[k]) == ops(programs[1])
    # The mean of k equal micro-batches' mean-loss gradients is the whole batch's gradient.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        results[k][0],
        results[1][0],
    )
    np.testing.assert_allclose(results[k][1], results[1][1], rtol=1e-5)


def test_accumulation_skips_the_whole_step_when_one_micro_batch_is_non_finite():
    mesh = rr.parallel.make_mesh(W)
    tx = rr.skip_nonfinite(optax.chain(_ef(), rr.optimizers.sgd(0.1, momentum=0.9)))
    step = rr.parallel.data_parallel_step(_loss, tx, mesh, accumulation_steps=3)
    params, opt_state = step.init(_params())
    bad = _batch(0, W * 6)
    bad["x"][5 * 6 + 2 * 2, 0] = np.nan  # worker 5, third micro-batch (rows 4-5 of 6)
    params, opt_state, _ = step(params, opt_state, rr.parallel.shard_batch(bad, mesh))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), params, _params())
    assert int(opt_state.skipped) == 1
    params, opt_state, _ = step(params, opt_state, rr.parallel.shard_batch(_batch(1, W * 6), mesh))
    assert not np.allclose(params["out"]["kernel"], _params()["out"]["kernel"])
    assert int(opt_state.skipped) == 1


def test_optax_multisteps_runs_and_matches_accumulation_over_the_same_micro_batches():
    mesh = rr.parallel.make_mesh(W)
    k, m = 3, 4
    whole = _batch(0, W * k * m)  # worker w's rows: its k micro-batches of m, in order
    multi = rr.parallel.data_parallel_step(_loss, optax.MultiSteps(_tx(), k), mesh)
    params, opt_state = multi.init(_params())
    acc_specs = multi.state_specs.acc_grads
    assert jax.tree.leaves(acc_specs) == [P("data")] * 4  # accumulated local gradients
    for i in range(k):
        micro = {key: v.reshape(W, k, m, -1)[:, i].reshape(W * m, -1) for key, v in whole.items()}
        params, opt_state, _ = multi(params, opt_state, rr.parallel.shard_batch(micro, mesh))
    accumulated = rr.parallel.data_parallel_step(_loss, _tx(), mesh, accumulation_steps=k)
    ref, ref_state = accumulated.init(_params())
    ref, _, _ = accumulated(ref, ref_state, rr.parallel.shard_batch(whole, mesh))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, ref)


def test_accumulation_refuses_bad_steps_and_uneven_batches():
    mesh = rr.parallel.make_mesh(W)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="accumulation_steps"):
            rr.parallel.data_parallel_step(_loss, _tx(), mesh, accumulation_steps=bad)
    step = rr.parallel.data_parallel_step(_loss, _tx(), mesh, accumulation_steps=3)
    params, opt_state = step.init(_params())
    with pytest.raises(ValueError, match="multiple of 3 rows"):
        step(params, opt_state, rr.parallel.shard_batch(_batch(0, W * 4), mesh))


# --------------------------------------------------------- the docs' examples, as written


def _doc_block(heading: str) -> list[str]:
    text = EXCHANGE_DOC.read_text()
    section = text.split(f"### {heading}\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def _run(script: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_docs_own_shard_map_step_runs_and_trains():
    (block,) = _doc_block("Your own shard_map step")
    out = _run(
        block
        + "\nfirst = float(loss_fn({'hidden': {'kernel': jax.random.normal(k1, (64, 128)) / 8,"
        " 'bias': jnp.zeros(128)}, 'out': {'kernel': jax.random.normal(k2, (128, 16)) / 11,"
        " 'bias': jnp.zeros(16)}}, batch))\n"
        "print(first, float(loss))\n"
    )
    first, last = map(float, out.split())
    assert last < 0.8 * first


def test_docs_nnx_example_trains_the_model_in_place():
    (block,) = _doc_block("Flax NNX and linen TrainState")[:1]
    out = _run(
        block + "\nprint(float(jnp.mean((model(jnp.ones((4, 64))) - 0.0) ** 2)), "
        "float(metrics['loss']), rr.tree_paths.leaf_paths(params)[0])\n"
    )
    model_loss, step_loss, path = out.split()
    assert path.endswith("/value")
    # nnx.update put the trained params into the model: its loss is the last step's (or
    # below it, after one more update).
    assert float(model_loss) <= float(step_loss) * 1.01


def test_docs_train_state_example_trains():
    block = _doc_block("Flax NNX and linen TrainState")[1]
    out = _run(block + "\nprint(int(state.step), float(loss))\n")
    steps, loss = out.split()
    assert int(steps) == 10
    assert float(loss) < 0.5


def test_nnx_optimizer_stops_with_a_pointer_to_the_docs():
    nnx = pytest.importorskip("flax.nnx")

    class Linear(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(64, 64, rngs=rngs)

        def __call__(self, x):
            return self.dense(x)

    model = Linear(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.chain(_ef(), optax.sgd(0.1)), wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.mean(m(jnp.ones((2, 64))) ** 2))(model)
    with pytest.raises(ValueError, match="Flax NNX and linen TrainState"):
        optimizer.update(model, grads)


def test_mass_is_conserved_in_the_documented_layout_of_an_own_step():
    """EF sends what it takes out of ``G + R``: per worker, ``sent = G + R_old - R_new``,
    and the update is minus the workers' mean of it (SGD, lr 1). The residuals are read
    with ``leaf_residuals`` in the ``[workers, *shape]`` layout of ``init_state``."""
    chex = pytest.importorskip("chex")
    mesh = rr.parallel.make_mesh(W)
    tx = optax.chain(_ef(), optax.sgd(1.0))
    specs, state = rr.parallel.init_state(tx, _params(), mesh)
    step = _own_step(tx, mesh, specs, local=True)
    params = rr.parallel.replicated(_params(), mesh)
    plan = _ef().plan(_params())
    for t in range(3):
        batch = _batch(t, W * 4)
        (old,) = rr.exchange.exchange_states(state)
        old_r = jax.tree.map(np.asarray, rr.exchange.leaf_residuals(old, plan))
        before = jax.tree.map(np.asarray, params)
        params, state = step(params, state, rr.parallel.shard_batch(batch, mesh))
        (new,) = rr.exchange.exchange_states(state)
        new_r = jax.tree.map(np.asarray, rr.exchange.leaf_residuals(new, plan))
        shards = [{k: v[w * 4 : (w + 1) * 4] for k, v in batch.items()} for w in range(W)]
        grads = [jax.grad(_loss)(_params_like(before), s) for s in shards]
        for path in old_r:
            layer = path.split("/")[0]
            sent = [
                np.asarray(grads[w][layer]["kernel"]) + old_r[path][w] - new_r[path][w]
                for w in range(W)
            ]
            chex.assert_trees_all_close(
                before[layer]["kernel"] - np.asarray(params[layer]["kernel"]),
                np.mean(sent, axis=0),
                rtol=1e-5,
                atol=1e-6,
            )


def _params_like(tree):
    return jax.tree.map(jnp.asarray, tree)


def test_nnx_state_through_an_own_shard_map_step():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(32, 64, rngs=rngs)
            self.out = nnx.Linear(64, 24, rngs=rngs)

        def __call__(self, x):
            return self.out(jnp.tanh(self.hidden(x)))

    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.chain(
        rr.resireduce(  # a path rule as written for linen paths finds NNX's ".../value"
            rr.compressors.topk(0.05), min_size=1000, inter="none", intra_layers=r"hidden/kernel"
        ),
        optax.sgd(0.1),
    )
    mesh = rr.parallel.make_mesh(W)
    specs, opt_state = rr.parallel.init_state(tx, params, mesh)

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs, P())
    )
    def step(params, opt_state, batch):
        opt_state = rr.parallel.unstack_per_worker(opt_state, specs)

        def loss(p):
            return jnp.mean((nnx.merge(graphdef, p)(batch["x"]) - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(lax.pcast(params, "data", to="varying"))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, rr.parallel.stack_per_worker(opt_state, specs), lax.pmean(value, "data")

    params = rr.parallel.replicated(params, mesh)
    losses = []
    for t in range(10):
        batch = rr.parallel.shard_batch(_batch(t % 2, W * 4), mesh)
        params, opt_state, value = step(params, opt_state, batch)
        losses.append(float(value))
    assert losses[-1] < losses[0]
    (ef,) = rr.exchange.exchange_states(opt_state)
    assert set(ef.residuals) == {"hidden/kernel/value", "out/kernel/value"}  # NNX paths
    hidden = ef.residuals["hidden/kernel/value"]
    assert isinstance(hidden, rr.residual_stores.BlockResidual)  # 2-D: 32 rows x 16 cols
    assert hidden.values.shape == (W, 16, 32)
    assert ef.residuals["out/kernel/value"].shape == (W, 64, 24)
