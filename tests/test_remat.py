"""Rotor checkpointing in JAX: costs, gradients, recomputation counts and compiled budgets."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resireduce_jax import remat
from resireduce_jax.remat import Plan, baselines

F32 = 4


def dense_tanh(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def gelu_mlp(p, x):
    return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]


def linear(p, x):
    return x @ p["w"]


def normal(rng, *shape, scale=0.1):
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)


def heterogeneous_chain(batch=64, seed=0):
    """Stages of different widths and kinds (dense+tanh, GELU MLP blocks, linear)."""
    rng = np.random.default_rng(seed)
    widths = [32, 64, 64, 128, 128, 32, 32, 64, 16]
    stages, params = [], []
    for i, (d, e) in enumerate(itertools.pairwise(widths)):
        if d == e:
            stages.append(gelu_mlp)
            params.append({"w1": normal(rng, d, 4 * d), "w2": normal(rng, 4 * d, d)})
        elif i % 2:
            stages.append(linear)
            params.append({"w": normal(rng, d, e)})
        else:
            stages.append(dense_tanh)
            params.append({"w": normal(rng, d, e), "b": normal(rng, e)})
    return stages, params, normal(rng, batch, widths[0], scale=1.0)


def plain_chain(stages, params, x):
    for stage, p in zip(stages, params, strict=True):
        x = stage(p, x)
    return x


# ----------------------------------------------------------------------------- costs


def test_costs_of_hand_chain():
    rng = np.random.default_rng(0)
    batch, d = 16, 8
    stages = [dense_tanh, gelu_mlp, linear]
    params = [
        {"w": normal(rng, d, d), "b": normal(rng, d)},
        {"w1": normal(rng, d, 4 * d), "w2": normal(rng, 4 * d, d)},
        {"w": normal(rng, d, 2)},
    ]
    x = jax.ShapeDtypeStruct((batch, d), jnp.float32)  # abstract input: nothing allocated
    costs = remat.measure_chain(stages, params, x)
    act = batch * d * F32
    np.testing.assert_array_equal(costs.activation_bytes, [act, act, act, batch * 2 * F32])
    # tanh: only the output is kept (1 - y² is fused into the backward pass).
    # GELU MLP: the output, the pre-activation z = x @ w1, tanh(...) of the GELU and the
    # GELU output (the operand of dW2): three [batch, 4d] buffers.
    # linear: the input is held anyway and the output is all that counts.
    np.testing.assert_array_equal(costs.saved_bytes, [act, act + 3 * 4 * act, batch * 2 * F32])
    np.testing.assert_array_equal(
        costs.param_bytes, [(d * d + d) * F32, 8 * d * d * F32, 2 * d * F32]
    )
    np.testing.assert_array_equal(costs.grad_bytes, costs.param_bytes)
    # FLOPs: 2·B·in·out per matmul in the forward; the backward of stage 0 skips dx
    # (its input is data), the others compute both dW and dx.
    np.testing.assert_allclose(
        costs.forward_time[[0, 2]], [2 * batch * d * d, 2 * batch * d * 2], rtol=0.1
    )
    np.testing.assert_allclose(costs.backward_time[2], 2 * 2 * batch * d * 2, rtol=0.1)
    assert costs.backward_time[0] < 1.5 * costs.forward_time[0]
    assert costs.backward_time[1] > 1.8 * costs.forward_time[1]
    assert costs.time_unit == "flops"
    assert "stage" in costs.table()


def test_identical_stages_are_measured_once(monkeypatch):
    calls = []
    original = remat.costs._measure_stage

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(remat.costs, "_measure_stage", counting)
    rng = np.random.default_rng(1)
    params = [{"w1": normal(rng, 8, 32), "w2": normal(rng, 32, 8)} for _ in range(5)]
    costs = remat.measure_chain([gelu_mlp] * 5, params, jnp.ones((4, 8)))
    # The first stage differs (its input is not differentiated); the other four are one.
    assert len(calls) == 2
    assert len(set(costs.saved_bytes[1:])) == 1


def test_measured_time_needs_concrete_inputs():
    with pytest.raises(ValueError, match="concrete"):
        remat.measure_chain(
            [linear],
            [{"w": jnp.ones((4, 4))}],
            jax.ShapeDtypeStruct((2, 4), jnp.float32),
            time="measured",
        )
    costs = remat.measure_chain(
        [linear, dense_tanh],
        [{"w": jnp.ones((4, 4))}, {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}],
        jnp.ones((2, 4)),
        time="measured",
        repeats=2,
    )
    assert costs.time_unit == "seconds"
    assert np.all(costs.forward_time > 0)


def test_chain_errors_are_clear():
    with pytest.raises(ValueError, match="one params pytree per stage"):
        remat.measure_chain([linear, linear], [{"w": jnp.ones((2, 2))}], jnp.ones((1, 2)))
    with pytest.raises(ValueError, match="Stage 1 failed"):
        remat.chain_shapes(
            [linear, linear], [{"w": jnp.ones((2, 3))}, {"w": jnp.ones((2, 3))}], jnp.ones((1, 2))
        )
    with pytest.raises(ValueError, match="at least one stage"):
        remat.measure_chain([], [], jnp.ones(2))


def test_tied_weight_is_one_argument_and_one_gradient():
    """An embedding table that the first and last stages both hold (GPT-2's ``wte``)."""
    rng = np.random.default_rng(4)
    vocab, d = 96, 16
    table = normal(rng, vocab, d)

    def embed(p, tokens):
        return p["wte"][tokens]

    def head(p, h):
        return h @ p["wte"].T

    stages = [embed, dense_tanh, head]
    block = {"w": normal(rng, d, d), "b": normal(rng, d)}
    tokens = jnp.asarray(rng.integers(0, vocab, (8, 12)), jnp.int32)
    tied = [{"wte": table}, block, {"wte": table}]
    untied = [{"wte": table}, block, {"wte": jnp.array(table)}]  # a copy: another leaf
    table_bytes = vocab * d * F32

    costs = remat.measure_chain(stages, tied, tokens)
    # Held once (at the embedding); its gradient is first written by the head's backward.
    np.testing.assert_array_equal(costs.param_bytes, [table_bytes, (d * d + d) * F32, 0])
    np.testing.assert_array_equal(costs.grad_bytes, [0, (d * d + d) * F32, table_bytes])
    untied_costs = remat.measure_chain(stages, untied, tokens)
    assert untied_costs.param_bytes.sum() - costs.param_bytes.sum() == table_bytes

    for plan in (Plan.unwrapped(3), baselines.every_stage(3)):
        one = remat.compile_gradient(stages, plan, tied, tokens)
        two = remat.compile_gradient(stages, plan, untied, tokens)
        assert two.memory.argument - one.memory.argument == table_bytes
        # One gradient fewer (and one 8-byte entry fewer in the output tuple's table).
        assert 0 <= two.memory.output - one.memory.output - table_bytes <= 8


# --------------------------------------------------------------- gradients and counts


def dropout_stage(p, carry):
    """Dropout with a key carried along the chain, and a BatchNorm-style running mean."""
    h, key, running_mean = carry
    key, sub = jax.random.split(key)
    keep = jax.random.bernoulli(sub, 0.75, h.shape)
    h = jnp.where(keep, h / 0.75, 0.0) * p["scale"]
    mean = jnp.mean(h, axis=0)
    h = (h - mean) / jnp.sqrt(jnp.var(h, axis=0) + 1e-5)
    return h, key, 0.9 * running_mean + 0.1 * mean


def lift(stage):
    def lifted(p, carry):
        h, key, running_mean = carry
        return stage(p, h), key, running_mean

    return lifted


def stochastic_chain():
    rng = np.random.default_rng(2)
    d = 24
    stages = [
        lift(dense_tanh),
        dropout_stage,
        lift(gelu_mlp),
        dropout_stage,
        lift(linear),
        lift(gelu_mlp),
        dropout_stage,
        lift(dense_tanh),
    ]
    params = [
        {"w": normal(rng, d, d), "b": normal(rng, d)},
        {"scale": 1.0 + normal(rng, d)},
        {"w1": normal(rng, d, 3 * d), "w2": normal(rng, 3 * d, d)},
        {"scale": 1.0 + normal(rng, d)},
        {"w": normal(rng, d, d)},
        {"w1": normal(rng, d, 2 * d), "w2": normal(rng, 2 * d, d)},
        {"scale": 1.0 + normal(rng, d)},
        {"w": normal(rng, d, 4), "b": normal(rng, 4)},
    ]
    x = (normal(rng, 32, d, scale=1.0), jax.random.key(7), jnp.zeros(d))
    return stages, params, x


def loss_of(output):
    h, _, running_mean = output
    return jnp.sum(h**2) + 0.0 * jnp.sum(running_mean)


@pytest.mark.parametrize("sequence_backward", [True, False])
def test_gradients_equal_plain_grad_with_dropout_and_state(sequence_backward):
    stages, params, x = stochastic_chain()
    n = len(stages)

    @jax.jit
    def reference(params, x):
        return jax.value_and_grad(lambda p: loss_of(plain_chain(stages, p, x)))(params)

    value0, grads0 = reference(params, x)
    out0 = plain_chain(stages, params, x)
    plans = [
        baselines.every_stage(n),
        baselines.recursive_halving(n),
        Plan.from_json([[[0, 1], 2], [3], 4, [[5], 6, 7]], n),
    ]
    for plan in plans:
        fn = remat.apply_plan(stages, plan, sequence_backward=sequence_backward)
        value, grads = jax.jit(
            lambda p, x, fn=fn: jax.value_and_grad(lambda p: loss_of(fn(p, x)))(p)
        )(params, x)
        out = fn(params, x)
        np.testing.assert_allclose(value, value0, rtol=1e-6, err_msg=plan.compact())
        # Recomputing reorders float32 sums: an entry near zero may differ by ~1e-6 of the
        # gradients' O(1) scale (seen on AMD EPYC hosts), hence atol 1e-5.
        chex.assert_trees_all_close(grads, grads0, rtol=1e-5, atol=1e-5)
        # The carried state (running mean, PRNG key) comes out as without checkpointing.
        np.testing.assert_array_equal(out[2], out0[2])
        np.testing.assert_array_equal(jax.random.key_data(out[1]), jax.random.key_data(out0[1]))


def count_dots(jaxpr) -> int:
    """dot_general equations in a jaxpr, sub-jaxprs (checkpoint, custom_vjp, pjit) included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            for item in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    count += count_dots(inner)
    return count


def redone_dots(plan: Plan, residual_dots) -> int:
    """Matmuls the recomputations of ``plan`` redo, one per stage forward.

    A recomputed segment's last item is pruned to what the backward pass reads: a
    ``dense_tanh`` stage keeps its tanh output (its matmul is redone), a ``linear`` stage
    keeps only its input (nothing is redone); a last nested checkpoint is not swept.
    """

    def redo(items):
        total = 0
        for k, item in enumerate(items):
            last = k == len(items) - 1
            if isinstance(item, remat.RunStage):
                total += residual_dots[item.index] if last else 1
            else:
                total += 0 if last else item.end - item.start
                total += redo(item.body)
        return total

    return sum(redo(i.body) for i in plan.items if isinstance(i, remat.Checkpoint))


def test_recomputations_in_jaxpr_and_compiled_program_match_the_plan():
    """Each stage does one matmul forward: every recomputation is one more dot."""
    rng = np.random.default_rng(5)
    widths = [32, 64, 16, 128, 32, 32, 96, 8]
    stages, params = [], []
    for i, (d, e) in enumerate(itertools.pairwise(widths)):
        stages.append(linear if i % 3 == 2 else dense_tanh)
        params.append({"w": normal(rng, d, e)} | ({} if i % 3 == 2 else {"b": normal(rng, e)}))
    x = normal(rng, 64, widths[0], scale=1.0)
    n = len(stages)
    residual_dots = [0 if s is linear else 1 for s in stages]
    planner = remat.ChainPlanner(stages, params, x, slots=200)
    plans = [planner.candidates[len(planner.candidates) // 2].plan, planner.candidates[-1].plan]
    plans += [
        baselines.every_stage(n),
        baselines.recursive_halving(n),
        Plan.from_json([[[0, 1], 2], 3, [[4], [5], 6]], n),
    ]
    unwrapped = Plan.unwrapped(n)

    def jaxpr_dots(plan, sequence_backward):
        fn = remat.apply_plan(stages, plan, sequence_backward=sequence_backward)
        grad = jax.grad(lambda p: remat.sum_of_outputs(fn(p, x)))
        return count_dots(jax.make_jaxpr(grad)(params).jaxpr)

    base_jaxpr = {s: jaxpr_dots(unwrapped, s) for s in (True, False)}
    base_compiled = planner.no_remat
    base_time = planner.predict(unwrapped)[0]
    for plan in plans:
        redone = redone_dots(plan, residual_dots)
        assert redone > 0
        for sequence_backward in (True, False):
            assert jaxpr_dots(plan, sequence_backward) == base_jaxpr[sequence_backward] + redone
        compiled = planner.compile(plan)
        # XLA kept every recomputation: CSE did not merge it with the forward pass.
        assert compiled.dots == base_compiled.dots + redone, plan.compact()
        assert compiled.barriers >= plan.num_checkpoints
        # And the FLOPs added are those the plan's predicted time adds.
        np.testing.assert_allclose(
            compiled.flops - base_compiled.flops,
            planner.predict(plan)[0] - base_time,
            rtol=0.02,
        )


# ---------------------------------------------------------------------- budgets


@pytest.fixture(scope="module")
def planner():
    stages, params, x = heterogeneous_chain(batch=512)
    return remat.ChainPlanner(stages, params, x)


@pytest.mark.parametrize("search", ["scan", "bisect"])
def test_compiled_peak_fits_and_never_grows_as_budget_shrinks(planner, search):
    top = planner.no_remat.peak
    floor = min(planner.compile(c.plan).peak for c in planner.candidates)
    assert floor < 0.8 * top
    previous_peak, previous_time = None, None
    for budget in np.linspace(top * 1.01, floor, 9).astype(int):
        choice = planner.select(int(budget), search=search)
        assert choice.compiled.peak <= budget
        assert choice.budget_bytes == budget
        if previous_peak is not None:
            assert choice.compiled.peak <= previous_peak
            assert choice.predicted.time >= previous_time
        previous_peak, previous_time = choice.compiled.peak, choice.predicted.time
    assert previous_peak == floor
    assert planner.select(int(top * 1.01)).plan == Plan.unwrapped(planner.costs.num_stages)


def test_budget_below_minimum_names_it(planner):
    floor = min(planner.compile(c.plan).peak for c in planner.candidates)
    with pytest.raises(ValueError, match="smallest compiled peak") as info:
        planner.select(floor - 1, search="scan")
    assert f"{floor} bytes" in str(info.value)
    with pytest.raises(ValueError, match="smallest compiled peak"):
        planner.select(floor // 2)


def test_fraction_budgets(planner):
    choice = planner.select(0.85)
    assert choice.budget_bytes == int(0.85 * planner.no_remat.peak)
    assert choice.compiled.peak <= choice.budget_bytes
    assert choice.flops_overhead > 0
    assert planner.select("85%").plan == choice.plan
    assert "compiled peak" in choice.summary()


def test_checkpoint_chain_end_to_end():
    stages, params, x = heterogeneous_chain(batch=256, seed=3)
    no_remat = remat.compile_gradient(stages, Plan.unwrapped(len(stages)), params, x)
    budget = int(0.9 * no_remat.peak)
    fn, plan = remat.checkpoint_chain(stages, params, x, budget)
    assert plan.num_checkpoints > 0
    np.testing.assert_allclose(fn(params, x), plain_chain(stages, params, x), rtol=1e-6)
    assert remat.compile_gradient(stages, plan, params, x).peak <= budget
    grads = jax.grad(lambda p: jnp.sum(fn(p, x)))(params)
    expected = jax.grad(lambda p: jnp.sum(plain_chain(stages, p, x)))(params)
    chex.assert_trees_all_close(grads, expected, rtol=1e-5, atol=1e-6)


def test_recomputation_is_merged_away_without_the_cpu_flag():
    """A fresh process without --xla_disable_hlo_passes=cse_barrier_expander fails loudly."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from resireduce_jax import remat
        stages = [lambda p, x: jnp.tanh(x @ p)] * 3
        params = [jnp.ones((8, 8))] * 3
        plan = remat.baselines.every_stage(3)
        try:
            remat.compile_gradient(stages, plan, params, jnp.ones((4, 8)))
        except RuntimeError as err:
            print("RAISED", "cse_barrier_expander" in str(err))
        """
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert "RAISED True" in result.stdout, result.stderr[-2000:]
