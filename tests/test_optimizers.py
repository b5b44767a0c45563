"""AdamW-R, Adan-R and Lion-R: trajectories against references, compiled memory, bad input.

References: ``optax.adamw`` (bit-for-bit), a float64 NumPy transcription of the official
Adan code (sail-sg/Adan ``adan.py``, written here independently of the library), and
``optax.lion`` together with exact float64 arithmetic for Lion-R's reordering.
"""

from __future__ import annotations

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from resireduce_jax import hlo
from resireduce_jax import optimizers as opt
from resireduce_jax._src import in_place
from resireduce_jax.optimizers import _common

SHAPES = {"dense": {"kernel": (16, 32), "bias": (32,)}, "head": (32, 8), "temperature": ()}


def _params(dtype=jnp.float32, seed: int = 0):
    leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    rng = np.random.default_rng(seed)
    return treedef.unflatten([jnp.asarray(rng.standard_normal(s), dtype) for s in leaves])


def _noise(params, steps: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda p: jnp.asarray(rng.standard_normal((steps, *p.shape)), p.dtype), params
    )


def _trajectory(tx, params, noise, steps: int):
    """``steps`` steps on the loss 0.25·|p|² with additive gradient noise, in one jit."""

    def body(carry, t):
        p, s = carry
        g = jax.tree.map(lambda x, n: (0.5 * x + n[t]).astype(x.dtype), p, noise)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), None

    run = jax.jit(lambda p, s: jax.lax.scan(body, (p, s), jnp.arange(steps))[0])
    return run(params, tx.init(params))


def _assert_bitwise_equal(a, b):
    chex.assert_trees_all_equal_structs(a, b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


# --------------------------------------------------------------------------------------
# AdamW-R == optax.adamw, bit for bit


def _decay_matrices(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


ADAMW_CONFIGS = {
    "defaults": {},
    "schedules+mask+nesterov": dict(
        weight_decay=optax.linear_schedule(0.1, 0.0, 200),
        mask=_decay_matrices,
        nesterov=True,
    ),
    "mu_dtype+eps_root": dict(mu_dtype=jnp.bfloat16, eps_root=1e-8, weight_decay=0.05),
}


@pytest.mark.parametrize(
    ("dtype", "config"),
    [
        (jnp.float32, "defaults"),
        (jnp.float32, "schedules+mask+nesterov"),
        (jnp.float32, "mu_dtype+eps_root"),
        (jnp.bfloat16, "defaults"),
        (jnp.bfloat16, "schedules+mask+nesterov"),
    ],
    ids=lambda x: x if isinstance(x, str) else jnp.dtype(x).name,
)
def test_adamw_r_is_bit_identical_to_optax_adamw(dtype, config):
    kwargs = ADAMW_CONFIGS[config]
    lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 20, 200) if "schedules" in config else 1e-2
    params, steps = _params(dtype), 200
    noise = _noise(params, steps)
    p_ref, s_ref = _trajectory(optax.adamw(lr, **kwargs), params, noise, steps)
    p_r, s_r = _trajectory(opt.adamw_r(lr, **kwargs), params, noise, steps)
    _assert_bitwise_equal(p_r, p_ref)
    adam_state = s_ref[0]
    _assert_bitwise_equal(s_r.mu, adam_state.mu)
    _assert_bitwise_equal(s_r.nu, adam_state.nu)
    assert int(s_r.count) == int(adam_state.count) == steps
    # The run moved the parameters: equality is not the trivial one.
    assert not np.allclose(np.asarray(p_r["head"], np.float32), np.asarray(params["head"]))


def test_adamw_r_clipping_matches_optax_chain():
    """Folded-in clipping equals clip_by_global_norm + adamw up to float32 rounding (the
    norm is summed in a different order and applied as one factor)."""
    params, steps = _params(), 100
    noise = _noise(params, steps)
    p_ref, _ = _trajectory(
        optax.chain(optax.clip_by_global_norm(3.0), optax.adamw(1e-2)), params, noise, steps
    )
    p_r, _ = _trajectory(opt.adamw_r(1e-2, max_grad_norm=3.0), params, noise, steps)
    p_free, _ = _trajectory(opt.adamw_r(1e-2), params, noise, steps)
    chex.assert_trees_all_close(p_r, p_ref, rtol=1e-5, atol=1e-6)
    # Clipping was active (the gradient norm is about 24): without it the run differs.
    assert np.abs(np.asarray(p_free["head"]) - np.asarray(p_r["head"])).max() > 1e-3


# --------------------------------------------------------------------------------------
# Adan-R == official Adan (float64 NumPy transcription)


def _official_adan_numpy(
    params, noise, steps, *, lr, b1, b2, b3, eps, weight_decay, no_prox, max_grad_norm, decayed
):
    """sail-sg/Adan ``_single_tensor_adan`` step by step, in float64, on the same problem.

    Returns the final parameters and the final ``exp_avg_diff``.
    """
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    exp_avg = {k: np.zeros_like(v) for k, v in p.items()}
    exp_avg_diff = {k: np.zeros_like(v) for k, v in p.items()}
    exp_avg_sq = {k: np.zeros_like(v) for k, v in p.items()}
    neg_pre_grad = None
    for step in range(1, steps + 1):
        grads = {k: 0.5 * p[k] + np.asarray(noise[k][step - 1], np.float64) for k in p}
        if max_grad_norm:
            norm = np.sqrt(sum(float((g**2).sum()) for g in grads.values()))
            clip = min(max_grad_norm / (norm + eps), 1.0)
        else:
            clip = 1.0
        if neg_pre_grad is None:
            neg_pre_grad = {k: -clip * g for k, g in grads.items()}
        bc1, bc2, bc3 = 1 - b1**step, 1 - b2**step, 1 - b3**step
        lr_now = lr(step - 1) if callable(lr) else lr  # optax schedules see the 0-based count
        for k in p:
            grad = grads[k] * clip
            diff = neg_pre_grad[k] + grad
            exp_avg[k] = exp_avg[k] * b1 + (1 - b1) * grad
            exp_avg_diff[k] = exp_avg_diff[k] * b2 + (1 - b2) * diff
            nesterov = diff * b2 + grad
            exp_avg_sq[k] = exp_avg_sq[k] * b3 + (1 - b3) * nesterov * nesterov
            denom = np.sqrt(exp_avg_sq[k]) / np.sqrt(bc3) + eps
            wd = weight_decay if decayed.get(k, False) else 0.0
            step_m, step_v = lr_now / bc1, lr_now * b2 / bc2
            if no_prox:
                p[k] = p[k] * (1 - lr_now * wd)
                p[k] = p[k] - step_m * exp_avg[k] / denom - step_v * exp_avg_diff[k] / denom
            else:
                p[k] = p[k] - step_m * exp_avg[k] / denom - step_v * exp_avg_diff[k] / denom
                p[k] = p[k] / (1 + lr_now * wd)
            neg_pre_grad[k] = -grad
    return p, exp_avg_diff


def _flat_params():
    rng = np.random.default_rng(0)
    return {
        "kernel": jnp.asarray(rng.standard_normal((16, 32)), jnp.float32),
        "bias": jnp.asarray(rng.standard_normal((32,)), jnp.float32),
        "head": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
    }


@pytest.mark.parametrize("no_prox", [False, True], ids=["prox", "no_prox"])
@pytest.mark.parametrize("max_grad_norm", [None, 5.0], ids=["noclip", "clip"])
def test_adan_r_matches_official_adan(no_prox, max_grad_norm):
    params, steps = _flat_params(), 100
    noise = _noise(params, steps)
    hp = dict(lr=1e-2, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, weight_decay=0.05)
    mask = {"kernel": True, "bias": False, "head": True}
    ref, ref_diff_avg = _official_adan_numpy(
        params, noise, steps, no_prox=no_prox, max_grad_norm=max_grad_norm, decayed=mask, **hp
    )
    tx = opt.adan_r(
        hp["lr"],
        b1=hp["b1"],
        b2=hp["b2"],
        b3=hp["b3"],
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
        mask=mask,
        no_prox=no_prox,
        max_grad_norm=max_grad_norm,
    )
    p, state = _trajectory(tx, params, noise, steps)
    # Measured: |error| <= 2e-6 on parameters of size ~1 after 100 steps.
    for k in ref:
        np.testing.assert_allclose(np.asarray(p[k], np.float64), ref[k], rtol=1e-4, atol=1e-5)
    diff_avg = opt.official_diff_avg(state, b2=hp["b2"])
    for k in ref:
        np.testing.assert_allclose(
            np.asarray(diff_avg[k], np.float64), ref_diff_avg[k], rtol=1e-4, atol=1e-6
        )
    # The problem is not trivial: weight decay and (when on) clipping matter.
    assert np.abs(ref["kernel"] - np.asarray(params["kernel"])).max() > 0.1


@pytest.mark.parametrize(
    "betas", [(0.0, 0.0, 0.5), (0.9, 0.0, 0.999)], ids=["all-zero-ish", "b2=0"]
)
def test_adan_r_matches_official_adan_at_edge_betas(betas):
    """b2 = 0 takes the special path (v = plain gradient difference); b1 = 0 too."""
    params, steps = _flat_params(), 30
    noise = _noise(params, steps)
    b1, b2, b3 = betas
    hp = dict(lr=1e-2, b1=b1, b2=b2, b3=b3, eps=1e-8, weight_decay=0.0)
    ref, _ = _official_adan_numpy(
        params, noise, steps, no_prox=False, max_grad_norm=None, decayed={}, **hp
    )
    p, _ = _trajectory(opt.adan_r(1e-2, b1=b1, b2=b2, b3=b3), params, noise, steps)
    for k in ref:
        np.testing.assert_allclose(np.asarray(p[k], np.float64), ref[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["adan_r", "lion_r"])
def test_bfloat16_parameters_keep_their_dtype(name):
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _flat_params())
    steps = 20
    tx = {
        "adan_r": opt.adan_r(1e-2, weight_decay=0.02, max_grad_norm=5.0),
        "lion_r": opt.lion_r(1e-3),
    }[name]
    p, state = _trajectory(tx, params, _noise(params, steps), steps)
    for leaf in jax.tree.leaves((p, state)):
        if leaf.ndim:
            assert leaf.dtype == jnp.bfloat16
            assert np.isfinite(np.asarray(leaf, np.float32)).all()
    assert (
        np.abs(np.asarray(p["head"], np.float32) - np.asarray(params["head"], np.float32)).max() > 0
    )


def test_adan_r_non_finite_gradients_stay_elementwise_like_official_adan():
    """The write-order dependencies add exactly zero unless a value is NaN: an element
    whose squared term overflows keeps its parameter (official float32 Adan: m / inf = 0),
    inf and NaN gradients give NaN only at their own element, as in official Adan."""
    grads = {"a": jnp.asarray([1.0, 1e30, jnp.inf, jnp.nan], jnp.float32), "b": jnp.ones(3)}
    params = {"a": jnp.full(4, 2.0, jnp.float32), "b": jnp.full(3, 2.0, jnp.float32)}
    tx = opt.adan_r(1e-2)
    state = tx.init(params)
    for _ in range(2):
        updates, state = jax.jit(tx.update)(grads, state, params)
        params = optax.apply_updates(params, updates)
    a = np.asarray(params["a"])
    np.testing.assert_array_equal(np.isfinite(a), [True, True, False, False])
    assert a[0] < 2.0 and a[1] == 2.0
    assert np.isfinite(np.asarray(params["b"])).all()


def test_optax_adan_departs_from_official_adan_from_step_two():
    """Why adan_r does not wrap optax.adan: equal after one step, different after two."""
    params = _flat_params()
    noise = _noise(params, 2)
    hp = dict(lr=1e-2, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, weight_decay=0.0)
    for steps, should_match in [(1, True), (2, False)]:
        ref, _ = _official_adan_numpy(
            params,
            noise,
            steps,
            no_prox=True,
            max_grad_norm=None,
            decayed=dict.fromkeys(params, False),
            **hp,
        )
        ref = {k: ref[k] for k in params}
        p, _ = _trajectory(optax.adan(1e-2, eps_root=0.0), params, noise, steps)
        err = max(np.abs(np.asarray(p[k], np.float64) - ref[k]).max() for k in ref)
        assert (err < 1e-6) == should_match, (steps, err)


# --------------------------------------------------------------------------------------
# Lion-R vs optax.lion


def test_lion_r_step_direction_is_exact_up_to_rounding():
    """sign(c) of the reordered interpolation is wrong only where the exact c is within
    rounding of zero: |c| < 2·ε32·(|g| + |m|) (measured: 0.71·ε32)."""
    rng = np.random.default_rng(0)
    n, b1, b2 = 1 << 18, 0.9, 0.99
    g = rng.standard_normal(n).astype(np.float32)
    # Near ties: m close to the value that makes (1 - b1) g + b1 m vanish.
    tie = -(1 - b1) / b1 * g.astype(np.float64)
    m = np.concatenate(
        [
            (tie[: n // 2] * (1 + 1e-5 * rng.standard_normal(n // 2))).astype(np.float32),
            rng.standard_normal(n - n // 2).astype(np.float32),
        ]
    )
    tx = opt.lion_r(1.0, b1=b1, b2=b2, weight_decay=0.0)
    state = opt.LionRState(count=jnp.zeros([], jnp.int32), mu=jnp.asarray(m))
    updates, new_state = jax.jit(tx.update)(jnp.asarray(g), state, jnp.zeros(n))
    direction = -np.asarray(updates)
    exact = (1 - b1) * g.astype(np.float64) + b1 * m.astype(np.float64)
    wrong = np.sign(direction) != np.sign(exact)
    scale = np.abs(g) + np.abs(m)
    eps32 = float(np.finfo(np.float32).eps)
    assert wrong.any(), "the near-tie half should produce some rounding flips"
    assert np.all(np.abs(exact[wrong]) < 2 * eps32 * scale[wrong])
    assert not wrong[n // 2 :].any()  # away from ties: every sign exact
    # The momentum update is optax.lion's, bit for bit (both compiled).
    ref_tx = optax.lion(1.0, b1=b1, b2=b2, weight_decay=0.0)
    ref_state = ref_tx.init(jnp.zeros(n))
    ref_state = (ref_state[0]._replace(mu=jnp.asarray(m)), *ref_state[1:])
    _, ref_state = jax.jit(ref_tx.update)(jnp.asarray(g), ref_state, jnp.zeros(n))
    np.testing.assert_array_equal(np.asarray(new_state.mu), np.asarray(ref_state[0].mu))


@pytest.mark.parametrize("lr", [1e-3, 1e-2])
def test_lion_r_trajectory_matches_optax_lion(lr):
    """Over 200 steps the sign directions agree and the parameters differ by at most one
    sign flip (2·lr per element; measured on this problem: identical trajectories)."""
    params, steps = _params(), 200
    noise = _noise(params, steps)
    tx_ref = optax.chain(optax.clip_by_global_norm(10.0), optax.lion(lr, weight_decay=0.1))
    p_ref, s_ref = _trajectory(tx_ref, params, noise, steps)
    p_r, s_r = _trajectory(
        opt.lion_r(lr, weight_decay=0.1, max_grad_norm=10.0), params, noise, steps
    )
    for a, b in zip(jax.tree.leaves(p_r), jax.tree.leaves(p_ref), strict=True):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 2 * lr * (1 + 1e-3)
    chex.assert_trees_all_close(s_r.mu, s_ref[1][0].mu, atol=2 * lr)
    moved = np.abs(np.asarray(p_r["head"]) - np.asarray(params["head"])).max()
    assert moved > 20 * lr


# --------------------------------------------------------------------------------------
# Compiled memory of the donated optimizer-only step

MEMORY_SHAPES = {
    "w0": (512, 2048),
    "w1": (512, 2048),
    "w2": (2048, 512),
    "b0": (2048,),
    "temperature": (),
}
LEAF_BYTES = 512 * 2048 * 4


def _abstract_params():
    return {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in MEMORY_SHAPES.items()}


def _compile_step(tx, grads_first: bool | None = None):
    params = _abstract_params()
    state = jax.eval_shape(tx.init, params)
    with warnings.catch_warnings():
        # JAX warns that the left-over donated buffer (one per leaf) could not be used.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        step = opt.optimizer_step(tx, grads_first=grads_first)
        return step.lower(params, state, params).compile()


def _param_bytes() -> int:
    return sum(int(np.prod(s)) * 4 for s in MEMORY_SHAPES.values())


R_OPTIMIZERS = {
    "adamw_r": lambda: opt.adamw_r(1e-3),
    "lion_r": lambda: opt.lion_r(1e-4),
    "adan_r": lambda: opt.adan_r(1e-3, weight_decay=0.02),
    "adamw_r+clip": lambda: opt.adamw_r(1e-3, max_grad_norm=1.0),
    "lion_r+clip": lambda: opt.lion_r(1e-4, max_grad_norm=1.0),
    "adan_r+clip+no_prox": lambda: opt.adan_r(
        1e-3, weight_decay=0.02, no_prox=True, max_grad_norm=1.0
    ),
}


@pytest.mark.parametrize("name", list(R_OPTIMIZERS))
def test_donated_optimizer_step_has_no_copies_and_tiny_temp(name):
    compiled = _compile_step(R_OPTIMIZERS[name]())
    param_bytes = _param_bytes()
    big_copies = hlo.copies(compiled, min_bytes=param_bytes // 100)
    assert big_copies == [], big_copies
    memory = hlo.peak_memory(compiled)
    assert memory.temp < 0.01 * param_bytes, memory
    # Every output array reuses a donated buffer (the rest of the output size is XLA's
    # table of output pointers and scalars).
    assert memory.alias >= memory.output - 1024, memory


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("optax.lion", lambda: optax.lion(1e-4)),
        ("optax.adan", lambda: optax.adan(1e-3)),
        ("optax.clip+lion", lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-4))),
    ],
)
def test_optax_lion_and_adan_copy_state_buffers(name, make):
    """What the R variants avoid: optax.lion copies its momentum (the sign fusion reads
    the old m after the in-place update) and optax.adan copies the previous gradient, in
    either argument order."""
    for grads_first in (False, True):
        compiled = _compile_step(make(), grads_first=grads_first)
        big_copies = hlo.copies(compiled, min_bytes=LEAF_BYTES)
        assert len(big_copies) >= 1, (name, grads_first)
        assert hlo.peak_memory(compiled).temp >= LEAF_BYTES, (name, grads_first)


def test_argument_order_matters_for_lion_r_and_optimizer_step_picks_it():
    adan, lion = opt.adan_r(1e-3), opt.lion_r(1e-4)
    params = _abstract_params()
    assert opt.grads_before_state(jax.eval_shape(adan.init, params))
    assert not opt.grads_before_state(jax.eval_shape(lion.init, params))
    # Lion-R in the wrong order: XLA copies state buffers.
    assert hlo.copies(_compile_step(lion, grads_first=True), min_bytes=LEAF_BYTES)
    # Adan-R writes its new previous gradient after the n update has read the old one, so
    # either order is copy-free, at the same peak (the state-first order used to copy).
    peaks = set()
    for grads_first in (True, False):
        compiled = _compile_step(adan, grads_first=grads_first)
        assert not hlo.copies(compiled, min_bytes=LEAF_BYTES)
        peaks.add(hlo.peak_memory(compiled).peak)
    assert len(peaks) == 1


def test_chunked_global_norm_is_exact_and_costs_one_loop_per_large_leaf():
    """The clipping norm sums leaves above 2^14 elements in chunks on CPU (the last chunk
    shifted back and masked): its value is the float64 norm up to float32 rounding for
    sizes at, just above, between and at multiples of the chunk, in float32 and bfloat16.
    It compiles to exactly one while loop per large leaf (XLA:CPU gives each loop a 64-byte
    slot of temp: the cost the GSR benchmark reports for clipped train steps) and needs no
    squared copy of a leaf, only a chunk of scratch: also for a bfloat16 leaf, which
    XLA:CPU would widen to a float32 copy outside the loop (in_place.read_in_loop)."""
    chunk = in_place.SUM_CHUNK
    sizes = {"small": 1000, "at": chunk, "above": chunk + 1, "between": 3 * chunk + 5}
    sizes["multiple"] = 5 * chunk
    rng = np.random.default_rng(7)
    tree = {k: jnp.asarray(3 * rng.standard_normal(n) + 1, jnp.float32) for k, n in sizes.items()}
    half = {"half": jnp.asarray(rng.standard_normal((400, 300)), jnp.bfloat16)}
    norm = jax.jit(_common.global_norm)

    def exact(t):
        return np.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in t.values()))

    for t in (tree, half, {**tree, **half}):
        np.testing.assert_allclose(float(norm(t)), exact(t), rtol=2e-6)
    # Each element counts exactly once: doubling the tail of a leaf whose last chunk is
    # shifted back changes the norm by exactly the tail's share.
    bumped = dict(tree, between=tree["between"].at[-3:].multiply(2.0))
    tail = np.asarray(tree["between"][-3:], np.float64)
    expected = np.sqrt(exact(tree) ** 2 + 3 * float(np.sum(tail**2)))
    np.testing.assert_allclose(float(norm(bumped)), expected, rtol=2e-6)

    compiled = norm.lower(tree).compile()
    assert compiled.as_text().count(" while(") == 3  # above, between, multiple
    assert hlo.peak_memory(compiled).temp < 2 * chunk * 4
    compiled = norm.lower(half).compile()
    assert compiled.as_text().count(" while(") == 1
    assert hlo.peak_memory(compiled).temp < 2 * chunk * 4 < half["half"].nbytes


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize("name", ["adamw_r", "lion_r", "adan_r"])
def test_optimizer_step_and_donated_train_step_compute_the_update(name):
    """The donated optimizer-only step and a donated full train step give what an
    undonated ``tx.update`` + ``apply_updates`` gives."""
    make = {"adamw_r": opt.adamw_r, "lion_r": opt.lion_r, "adan_r": opt.adan_r}[name]
    tx = make(1e-2, max_grad_norm=2.0)
    params = _flat_params()
    batch = jnp.asarray(np.random.default_rng(5).standard_normal((8, 16)), jnp.float32)

    def loss_fn(p, x):
        hidden = jnp.tanh(x @ p["kernel"] + p["bias"])
        return jnp.mean((hidden[:, :8] @ p["head"]) ** 2)

    def reference(p, s, x, steps):
        for _ in range(steps):
            g = jax.grad(loss_fn)(p, x)
            u, s = tx.update(g, s, p)
            p = optax.apply_updates(p, u)
        return p

    expected = reference(params, tx.init(params), batch, 3)

    step = opt.optimizer_step(tx)
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    for _ in range(3):
        p, s = step(p, s, jax.grad(loss_fn)(p, batch))
    # Other programs than the reference's op-by-op ones (fused, donated): float32 rounding
    # may differ in the last bits (up to 2e-6 relative in a few elements after 3 steps).
    close = functools.partial(chex.assert_trees_all_close, rtol=1e-5, atol=1e-6)
    close(p, expected)

    @jax.jit
    def train_step(p, s, x):
        g = jax.grad(loss_fn)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    donated = jax.jit(train_step, donate_argnums=(0, 1))
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    for _ in range(3):
        p, s = donated(p, s, batch)
    close(p, expected)


# --------------------------------------------------------------------------------------
# Registry and bad input


def test_get_optimizer_by_name():
    params = _flat_params()
    assert isinstance(
        opt.get_optimizer("adamw_r", learning_rate=1e-3).init(params), opt.AdamWRState
    )
    assert isinstance(opt.get_optimizer("adan_r", learning_rate=1e-3).init(params), opt.AdanRState)
    assert isinstance(opt.get_optimizer("lion_r", learning_rate=1e-4).init(params), opt.LionRState)
    sgd = opt.get_optimizer("sgd", learning_rate=0.1)
    updates, _ = sgd.update(params, sgd.init(params))
    chex.assert_trees_all_close(updates, jax.tree.map(lambda x: -0.1 * x, params))
    with pytest.raises(ValueError, match=r"Unknown optimizer 'adamw-r'.*adamw_r"):
        opt.get_optimizer("adamw-r", learning_rate=1e-3)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: opt.adamw_r(1e-3, b1=1.0), r"b1 must lie in \[0, 1\), got 1.0"),
        (lambda: opt.adamw_r(1e-3, b2=-0.1), r"b2 must lie in \[0, 1\)"),
        (lambda: opt.adan_r(1e-3, b3=1.5), r"b3 must lie in \[0, 1\)"),
        (lambda: opt.adan_r(1e-3, b2=float("nan")), r"b2 must lie in \[0, 1\)"),
        (lambda: opt.lion_r(1e-4, b1=1.0), r"b1 must lie in \[0, 1\)"),
        (lambda: opt.lion_r(1e-4, b2=0.0), r"b2 must lie in \(0, 1\).*divides by b2"),
        (lambda: opt.adamw_r(-1e-3), r"learning_rate must be >= 0"),
        (lambda: opt.lion_r(-1e-4), r"learning_rate must be >= 0"),
        (lambda: opt.adan_r(1e-3, weight_decay=-0.02), r"weight_decay must be >= 0"),
        (lambda: opt.adamw_r(1e-3, weight_decay=-1e-4), r"weight_decay must be >= 0"),
        (lambda: opt.adamw_r(1e-3, eps=-1e-8), r"eps must be >= 0"),
        (lambda: opt.adan_r(1e-3, max_grad_norm=0.0), r"max_grad_norm must be > 0.*None"),
        (lambda: opt.lion_r(1e-4, max_grad_norm=-1.0), r"max_grad_norm must be > 0"),
        (lambda: opt.adamw_r(1e-3, b1="high"), r"b1 must be a real number"),
    ],
)
def test_bad_hyperparameters_raise_clear_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("make", [opt.adamw_r, opt.lion_r, opt.adan_r])
def test_update_needs_params_and_a_matching_mask(make):
    params = _flat_params()
    tx = make(1e-3)
    with pytest.raises(ValueError, match=r"tx.update\(grads, opt_state, params\)"):
        tx.update(params, tx.init(params))
    bad_mask = make(1e-3, weight_decay=0.1, mask={"kernel": True})
    with pytest.raises(ValueError, match="mask must have the structure of params"):
        bad_mask.update(params, bad_mask.init(params), params)
    # A prefix mask is fine: one bool for the whole tree.
    prefix = make(1e-3, weight_decay=0.1, mask=False)
    updates, _ = prefix.update(params, prefix.init(params), params)
    chex.assert_trees_all_equal_shapes(updates, params)


# --------------------------------------------------------------------------------------
# float64 parameters (jax_enable_x64): every scalar in the parameters' precision


def _float64_params():
    """float64 leaves; ``wide`` has more than ``in_place.SUM_CHUNK`` elements, so the
    clipping norm takes the chunked CPU path too. Call inside ``jax.enable_x64(True)``."""
    rng = np.random.default_rng(3)
    shapes = {"kernel": (16, 32), "bias": (32,), "head": (8, 4), "wide": (160, 128)}
    assert np.prod(shapes["wide"]) > in_place.SUM_CHUNK
    return {k: jnp.asarray(rng.standard_normal(s), jnp.float64) for k, s in shapes.items()}


def _assert_float64_close(params, ref, rtol=1e-12):
    """Every leaf float64 and within ``rtol`` of the reference, relative to its largest
    magnitude (so entries that pass near zero do not need a relative match of their own)."""
    for k, expected in ref.items():
        got = np.asarray(params[k])
        assert got.dtype == np.float64, (k, got.dtype)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * scale, err_msg=k)


def _cosine_numpy(init: float, steps: int):
    """``optax.cosine_decay_schedule(init, steps)`` written out in float64 (SGDR's cosine,
    Loshchilov & Hutter 2017, without restarts). optax's cosine schedule stays float64
    under x64; some others (``linear_schedule``) return float32 values."""
    return lambda count: init * 0.5 * (1 + np.cos(np.pi * min(count, steps) / steps))


@pytest.mark.parametrize(
    ("no_prox", "max_grad_norm", "scheduled"),
    [(False, 5.0, False), (True, None, True), (False, None, False)],
    ids=["prox+clip", "no_prox+schedule", "prox"],
)
def test_adan_r_float64_matches_official_adan_in_float64(no_prox, max_grad_norm, scheduled):
    """With float64 parameters the bias corrections, learning rate, weight decay and clip
    factor are float64 too: 100 steps agree with the float64 transcription of the
    official Adan to 1e-12 (measured: <= 1e-14; with the float32 scalars they had before,
    ~1e-5 relative per element)."""
    with jax.enable_x64(True):
        params, steps = _float64_params(), 100
        noise = _noise(params, steps)
        lr = optax.cosine_decay_schedule(1e-2, 150) if scheduled else 1e-2
        lr_ref = _cosine_numpy(1e-2, 150) if scheduled else 1e-2
        hp = dict(b1=0.98, b2=0.92, b3=0.99, eps=1e-8, weight_decay=0.05)
        mask = {"kernel": True, "bias": False, "head": True, "wide": True}
        ref, ref_diff_avg = _official_adan_numpy(
            params,
            noise,
            steps,
            lr=lr_ref,
            no_prox=no_prox,
            max_grad_norm=max_grad_norm,
            decayed=mask,
            **hp,
        )
        tx = opt.adan_r(lr, **hp, mask=mask, no_prox=no_prox, max_grad_norm=max_grad_norm)
        p, state = _trajectory(tx, params, noise, steps)
        _assert_float64_close(p, ref)
        _assert_float64_close(opt.official_diff_avg(state, b2=hp["b2"]), ref_diff_avg, 1e-10)
        if max_grad_norm is not None:
            assert state.prev_grad_scale.dtype == jnp.float64
            assert float(state.prev_grad_scale) < 0.1  # clipping was active
        assert np.abs(ref["kernel"] - np.asarray(params["kernel"])).max() > 0.1


def _adamw_numpy(params, noise, steps, *, lr, b1, b2, eps, weight_decay, max_grad_norm):
    """``clip_by_global_norm`` + AdamW (Loshchilov & Hutter, Algorithm 2; optax's
    conventions: bias-corrected moments, ε outside the root, decay ``λ·θ`` added to the
    update) step by step in float64 on the same problem."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t in range(1, steps + 1):
        grads = {k: 0.5 * p[k] + np.asarray(noise[k][t - 1], np.float64) for k in p}
        norm = np.sqrt(sum(float((g**2).sum()) for g in grads.values()))
        clip = 1.0 if norm < max_grad_norm else max_grad_norm / norm
        for k in p:
            g = grads[k] * clip
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            m_hat, v_hat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            p[k] = p[k] - lr * (m_hat / (np.sqrt(v_hat) + eps) + weight_decay * p[k])
    return p


def test_adamw_r_float64_with_clipping_matches_float64_adamw():
    """The folded-in clipping norm is summed in the leaves' precision (it was float32,
    which cost ~1e-6 relative; measured now: 3e-16)."""
    with jax.enable_x64(True):
        params, steps = _float64_params(), 100
        noise = _noise(params, steps)
        hp = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.05)
        ref = _adamw_numpy(params, noise, steps, max_grad_norm=3.0, **hp)
        lr = hp.pop("lr")
        p, state = _trajectory(opt.adamw_r(lr, **hp, max_grad_norm=3.0), params, noise, steps)
        _assert_float64_close(p, ref)
        assert state.mu["wide"].dtype == jnp.float64


def _lion_numpy(params, noise, steps, *, lr, b1, b2, weight_decay, max_grad_norm):
    """``clip_by_global_norm`` + Lion (Chen et al. 2023, Program 1) in float64:
    ``θ ← θ − η(sign(β1 m + (1−β1) g) + λθ)``, then ``m ← β2 m + (1−β2) g``."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    for t in range(steps):
        grads = {k: 0.5 * p[k] + np.asarray(noise[k][t], np.float64) for k in p}
        norm = np.sqrt(sum(float((g**2).sum()) for g in grads.values()))
        clip = 1.0 if norm < max_grad_norm else max_grad_norm / norm
        for k in p:
            g = grads[k] * clip
            direction = np.sign(b1 * m[k] + (1 - b1) * g)
            p[k] = p[k] - lr * (direction + weight_decay * p[k])
            m[k] = b2 * m[k] + (1 - b2) * g
    return p, m


def test_lion_r_float64_with_clipping_matches_float64_lion():
    with jax.enable_x64(True):
        params, steps = _float64_params(), 100
        noise = _noise(params, steps)
        hp = dict(lr=1e-3, b1=0.9, b2=0.99, weight_decay=0.1)
        ref, ref_mu = _lion_numpy(params, noise, steps, max_grad_norm=10.0, **hp)
        lr = hp.pop("lr")
        p, state = _trajectory(opt.lion_r(lr, **hp, max_grad_norm=10.0), params, noise, steps)
        _assert_float64_close(p, ref)
        _assert_float64_close(state.mu, ref_mu)


def test_float64_runs_leave_the_default_precision_alone():
    """The x64 tests switch it on in a context only: outside, arrays are float32 again."""
    assert not jax.config.jax_enable_x64
    assert jnp.asarray(1.0).dtype == jnp.float32
