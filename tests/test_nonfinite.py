"""Non-finite gradients on one worker: every worker skips the step, nothing non-finite is
stored, and the state follows each mode's documented semantics."""

from __future__ import annotations

import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import resireduce_jax as rr
from tests import transform_harness as th

W = 8
MIN_SIZE = 1000
SHAPES = {
    "block_0": {"kernel": (30, 50)},
    "block_1": {"kernel": (30, 50)},
    "block_2": {"kernel": (30, 50)},
    "big": {"kernel": (60, 60)},
    "head": {"bias": (40,)},
}


def _params():
    return th.zero_params(SHAPES)


def _grads(steps, seed=0):
    return th.random_grad_trees(np.random.default_rng(seed), _params(), W, steps)


EXCHANGES = {
    "ef": lambda: rr.error_feedback(rr.compressors.topk(0.05), min_size=MIN_SIZE),
    "w+2d": lambda: rr.resireduce(rr.compressors.topk(0.05), intra_layers="big", min_size=MIN_SIZE),
    "w+2d-softmax": lambda: rr.resireduce(
        rr.compressors.topk(0.05),
        intra_layers="big",
        selection="softmax_sample",
        min_size=MIN_SIZE,
    ),
    "powersgd-ef": lambda: rr.error_feedback(rr.compressors.powersgd(rank=2), min_size=MIN_SIZE),
    "randomk-none": lambda: rr.compressed_mean(rr.compressors.randomk(0.05), min_size=MIN_SIZE),
}
OPTIMIZERS = {
    "optax-sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "sgd": lambda: rr.optimizers.sgd(0.1, momentum=0.9),
    "adamw_r": lambda: rr.adamw_r(1e-2, weight_decay=0.1),
}


def _tx(exchange, optimizer="sgd", **kwargs):
    chain = optax.chain(EXCHANGES[exchange](), OPTIMIZERS[optimizer]())
    return rr.skip_nonfinite(chain, **kwargs)


def _poisoned(clean, bad_value, where=("block_1", 5, (3, 7))):
    poisoned = jax.tree.map(np.copy, clean)
    layer, worker, index = where
    poisoned[layer]["kernel"][(worker, *index)] = bad_value
    return poisoned


def _assert_skipped(state, out_skipped, bad_path="block_1/kernel"):
    for leaf in jax.tree.leaves(out_skipped):  # the skipped step moves nothing, anywhere
        np.testing.assert_array_equal(leaf, 0.0)
    np.testing.assert_array_equal(state.skipped, 1)
    np.testing.assert_array_equal(
        state.bad_leaf, rr.tree_paths.leaf_paths(_params()).index(bad_path)
    )
    for leaf in jax.tree.leaves(state):
        if np.issubdtype(np.asarray(leaf).dtype, np.floating):
            assert np.isfinite(leaf).all()


@pytest.mark.parametrize("exchange", list(EXCHANGES))
@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
@pytest.mark.parametrize("mode", ["strict", "loss"])  # "loss" without loss_ok: as strict
def test_strict_mode_skips_as_if_the_step_never_happened(exchange, bad_value, mode):
    clean = _grads(3)
    with_bad = [clean[0], _poisoned(clean[1], bad_value), clean[2]]
    out_bad, state_bad = th.run_shard_map(_tx(exchange, mode=mode), _params(), with_bad)
    out_ref, state_ref = th.run_shard_map(_tx(exchange, mode=mode), _params(), [clean[0], clean[2]])
    _assert_skipped(state_bad, out_bad[1])
    chex.assert_trees_all_equal(out_bad[2], out_ref[1])
    # Residuals, momentum and counters continue bit for bit as if step 1 never happened.
    chex.assert_trees_all_equal(state_bad.inner, state_ref.inner)
    assert not np.asarray(state_bad.last_skipped).any()


@pytest.mark.parametrize("exchange", list(EXCHANGES))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("bad_value", [np.nan, -np.inf])
def test_lean_mode_keeps_moments_and_defers_the_gradient_into_own_residuals(
    exchange, optimizer, bad_value
):
    clean = _grads(2)
    poisoned = _poisoned(clean[1], bad_value)
    tx = _tx(exchange, optimizer, mode="lean")
    _, before = th.run_shard_map(tx, _params(), [clean[0]])
    out, after = th.run_shard_map(tx, _params(), [clean[0], poisoned])
    _assert_skipped(after, out[1])
    exchange_before, optimizer_before = before.inner
    exchange_after, optimizer_after = after.inner
    # Nothing is applied: moments and every counter are unchanged bit for bit.
    chex.assert_trees_all_equal(optimizer_after, optimizer_before)
    np.testing.assert_array_equal(exchange_after.count, exchange_before.count)
    chex.assert_trees_all_equal(exchange_after.compressor_state, exchange_before.compressor_state)
    # Residuals: a leaf's own residual takes the sanitized local gradient (nothing was sent,
    # nothing taken out); shared and intra-layer stores are unchanged.
    plan = EXCHANGES[exchange]().plan(_params())
    flat = dict(zip(plan.paths, jax.tree.leaves(poisoned), strict=True))
    for store in plan.kept:
        label = store.group.label
        if store.kind == "leaf":
            g = flat[store.group.paths[0]]
            expected = np.where(np.isfinite(g), g, np.float32(0)) + exchange_before.residuals[label]
            np.testing.assert_array_equal(exchange_after.residuals[label], expected)
        else:
            chex.assert_trees_all_equal(
                exchange_after.residuals[label], exchange_before.residuals[label]
            )


def test_guard_optimizer_state_false_lets_momentum_see_a_zero_gradient():
    clean = _grads(2)
    poisoned = _poisoned(clean[1], np.nan, where=("big", 0, (0, 0)))
    tx = _tx("ef", "optax-sgd", mode="strict", guard_optimizer_state=False)
    _, state_bad = th.run_shard_map(tx, _params(), [clean[0], poisoned])
    _, state_ref = th.run_shard_map(tx, _params(), clean[:1])
    chex.assert_trees_all_equal(state_bad.inner[0], state_ref.inner[0])
    momentum = state_bad.inner[1][0].trace["big"]["kernel"]
    np.testing.assert_allclose(momentum, 0.9 * state_ref.inner[1][0].trace["big"]["kernel"])


@pytest.mark.parametrize("mode", ["loss", "strict", "lean"])
def test_all_finite_steps_are_unchanged_by_the_wrapper(mode):
    grads = _grads(3)
    plain = optax.chain(EXCHANGES["w+2d"](), optax.sgd(0.1, momentum=0.9))
    out_plain, state_plain = th.run_shard_map(plain, _params(), grads)
    out_guarded, state_guarded = th.run_shard_map(
        _tx("w+2d", "optax-sgd", mode=mode), _params(), grads
    )
    # The exchange is bit-identical. The optimizer's multiply-adds sit in other fusions once
    # the selection is added, and XLA:CPU may contract them differently: 1 ulp at most.
    chex.assert_trees_all_equal(state_plain[0], state_guarded.inner[0])
    chex.assert_trees_all_close(out_plain, out_guarded, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(state_plain[1], state_guarded.inner[1], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(state_guarded.skipped, 0)


SKIP_AWARE = {
    "sgd": (lambda: rr.optimizers.sgd(0.05, momentum=0.9), lambda: optax.sgd(0.05, momentum=0.9)),
    "sgd-nesterov": (
        lambda: rr.optimizers.sgd(0.05, momentum=0.9, nesterov=True),
        lambda: optax.sgd(0.05, momentum=0.9, nesterov=True),
    ),
    "adamw_r": (
        lambda: rr.adamw_r(1e-2, weight_decay=0.1),
        lambda: optax.adamw(1e-2, weight_decay=0.1),
    ),
    "lion_r": (lambda: rr.lion_r(1e-3), None),
    "adan_r": (lambda: rr.adan_r(1e-2), None),
}


@pytest.mark.parametrize("name", list(SKIP_AWARE))
def test_skip_aware_optimizers_skip_exactly_in_place(name):
    ours, reference = SKIP_AWARE[name]
    params = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)}
    rng = np.random.default_rng(1)
    grads = [{"w": rng.standard_normal((3, 4)).astype(np.float32)} for _ in range(4)]
    tx = ours()
    update = jax.jit(lambda g, s, p, skip: tx.update(g, s, p, skip=skip))

    def run(steps, skipped=()):
        state, p, outs = tx.init(params), params, []
        for k, g in enumerate(steps):
            u, state = update(g, state, p, np.bool_(k in skipped))
            p = optax.apply_updates(p, u)
            outs.append(u)
        return outs, state, p

    outs, state, p = run(grads, skipped=(2,))
    _, state_ref, p_ref = run([g for k, g in enumerate(grads) if k != 2])
    np.testing.assert_array_equal(outs[2]["w"], 0.0)
    chex.assert_trees_all_equal(state, state_ref)
    chex.assert_trees_all_equal(p, p_ref)
    # Without a skip, exactly optax's optimizer, or (lion_r, adan_r) the same optimizer
    # called without the skip argument, bit for bit.
    ref = (reference or ours)()
    ref_state, ref_p = ref.init(params), params
    for g in grads:
        u, ref_state = jax.jit(ref.update)(g, ref_state, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    _, state_all, p_all = run(grads)
    chex.assert_trees_all_equal(p_all, ref_p)
    if reference is None:
        chex.assert_trees_all_equal(state_all, ref_state)


# ------------------------------------------------- "loss" mode in the data-parallel step


def _dp_params():
    rng = np.random.default_rng(0)
    return {
        "hidden": {"kernel": rng.normal(0, 0.2, (32, 64)).astype(np.float32)},
        "out": {"kernel": rng.normal(0, 0.2, (64, 40)).astype(np.float32)},
    }


@jax.custom_vjp
def _poison_cotangent(kernel, flag):
    """Identity; its backward pass writes ``nan`` into element [0, 0] where ``flag > 0``:
    a non-finite gradient under a finite loss (an overflow in the backward pass)."""
    return kernel


def _poison_fwd(kernel, flag):
    return kernel, flag


def _poison_bwd(flag, g):
    return g.at[0, 0].set(jnp.where(flag > 0, POISON, g[0, 0])), jnp.zeros_like(flag)


_poison_cotangent.defvjp(_poison_fwd, _poison_bwd)
POISON = np.float32(np.nan)


def _dp_loss(params, batch):
    kernel = _poison_cotangent(params["hidden"]["kernel"], jnp.max(batch["poison"]))
    h = jnp.tanh(batch["x"] @ kernel)
    return jnp.mean((h @ params["out"]["kernel"] - batch["y"]) ** 2)


def _dp_batch(step, *, nan_loss_on=None, poison_on=None, per_worker=4):
    rng = np.random.default_rng(100 + step)
    n = W * per_worker
    batch = {
        "x": rng.normal(size=(n, 32)).astype(np.float32),
        "y": rng.normal(size=(n, 40)).astype(np.float32),
        "poison": np.zeros(n, np.float32),
    }
    if nan_loss_on is not None:
        batch["x"][nan_loss_on * per_worker] = np.nan
    if poison_on is not None:
        batch["poison"][poison_on * per_worker : (poison_on + 1) * per_worker] = 1.0
    return batch


def _dp_tx(guarded: bool):
    tx = optax.chain(
        rr.error_feedback(rr.compressors.topk(0.05), min_size=MIN_SIZE),
        rr.optimizers.sgd(0.1, momentum=0.9),
    )
    return rr.skip_nonfinite(tx) if guarded else tx


def _run(tx, batches):
    mesh = rr.parallel.make_mesh(W)
    step = rr.parallel.data_parallel_step(_dp_loss, tx, mesh)
    params, opt_state = step.init(_dp_params())
    snapshots = []
    for batch in batches:
        params, opt_state, _ = step(params, opt_state, rr.parallel.shard_batch(batch, mesh))
        snapshots.append(jax.device_get((params, opt_state)))
    return snapshots


def test_loss_mode_skips_a_step_whose_loss_is_nonfinite_on_one_worker():
    """Decided before the backward pass; the skipped step leaves every state bit-identical
    and the run continues as if it never happened."""
    bad = _dp_batch(1, nan_loss_on=3)
    snapshots = _run(_dp_tx(True), [_dp_batch(0), bad, _dp_batch(2)])
    reference = _run(_dp_tx(True), [_dp_batch(0), _dp_batch(2)])
    (params_0, state_0), (params_1, state_1) = snapshots[0], snapshots[1]
    chex.assert_trees_all_equal(params_1, params_0)
    chex.assert_trees_all_equal(state_1.inner, state_0.inner)
    np.testing.assert_array_equal(state_1.skipped, 1)
    assert bool(state_1.last_skipped)
    np.testing.assert_array_equal(state_1.bad_leaf, rr.nonfinite.LOSS)
    chex.assert_trees_all_equal(snapshots[2][0], reference[1][0])
    chex.assert_trees_all_equal(snapshots[2][1].inner, reference[1][1].inner)


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_loss_mode_zeroes_nonfinite_gradient_elements_under_a_finite_loss(poison, monkeypatch):
    """The step goes on with the element zeroed on the worker where it was non-finite: the
    same run as an unguarded one whose backward pass wrote a zero there (to 1 ulp: XLA:CPU
    may contract the optimizer's multiply-adds differently in the two programs), and
    nothing non-finite is stored."""
    batches = [_dp_batch(0), _dp_batch(1, poison_on=5), _dp_batch(2)]
    monkeypatch.setattr(sys.modules[__name__], "POISON", np.float32(poison))
    guarded = _run(_dp_tx(True), batches)
    monkeypatch.setattr(sys.modules[__name__], "POISON", np.float32(0.0))
    zeroed = _run(_dp_tx(False), batches)
    for (params, state), (params_ref, state_ref) in zip(guarded, zeroed, strict=True):
        chex.assert_trees_all_close(params, params_ref, rtol=1e-6, atol=1e-7)
        chex.assert_trees_all_close(state.inner, state_ref, rtol=1e-6, atol=1e-7)
        for leaf in jax.tree.leaves((params, state)):
            if np.issubdtype(np.asarray(leaf).dtype, np.floating):
                assert np.isfinite(leaf).all()
    np.testing.assert_array_equal(guarded[-1][1].skipped, 0)


def test_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'loss', 'strict', 'lean'"):
        rr.skip_nonfinite(optax.sgd(0.1), mode="fast")


def test_extra_arguments_other_than_loss_ok_reach_the_inner_chain():
    def update(updates, state, params=None, *, scale, **extra_args):
        return jax.tree.map(lambda u: u * scale, updates), state

    inner = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
    tx = rr.skip_nonfinite(inner, "data")
    grads = {"w": jnp.arange(6.0).reshape(2, 3)}  # 2 workers under vmap

    def step(g):
        return tx.update(g, tx.init(g), loss_ok=jnp.asarray(True), scale=3.0)[0]

    out = jax.vmap(step, axis_name="data")(grads)
    np.testing.assert_array_equal(out["w"], 3.0 * np.arange(6.0).reshape(2, 3))
