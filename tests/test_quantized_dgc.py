"""DGC's memory (Lin et al., ICLR 2018, §3) with ``u`` and ``v`` kept in a residual format:
float32 is today's DGC bit for bit, a block format rounds only what it keeps (checked step
by step against float32 steps from the same decoded state, with a NumPy decoder and bound),
masked zeros stay exact, bytes are the codes and scales, skips and checkpoints keep codes
and scales bit for bit."""

from __future__ import annotations

import json
import math

import chex
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import resireduce_jax as rr
from resireduce_jax import residual_formats
from tests import transform_harness as th

WORKERS = 4
MIN_SIZE = 1000
DENSITY = 0.05
SHAPES = {"a": (30, 50), "b": (60, 60), "bias": (40,), "small": (4, 5)}  # two compressed


def _params():
    return {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}


def _grads(steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            k: rng.standard_t(3, size=(WORKERS, *s)).astype(np.float32)
            * np.float32(10 ** rng.uniform(-1, 0.5))
            for k, s in SHAPES.items()
        }
        for _ in range(steps)
    ]


def _dgc(residual_format=None, **kwargs) -> optax.GradientTransformation:
    return rr.dgc_memory(
        rr.compressors.topk(DENSITY),
        0.9,
        clip_norm=40.0,
        min_size=MIN_SIZE,
        residual_format=residual_format,
        **kwargs,
    )


# --------------------------------------------------------------------------------------
# An independent NumPy decoder and the rounding bound of Dettmers et al.'s absmax blocks


def _np_decode(stored: residual_formats.Quantized, codes: str, shape) -> np.ndarray:
    """``code * scale`` per block, flattened, cut to the leaf (int4: low nibble first)."""
    c = np.asarray(stored.codes)
    if codes == "int4":
        low = (c & 0x0F).astype(np.int8)
        high = (c >> 4).astype(np.int8)
        c = np.stack([np.where(low > 7, low - 16, low), np.where(high > 7, high - 16, high)], -1)
        c = c.reshape(c.shape[0], -1)
    values = c.astype(np.float32) * np.asarray(stored.scales, np.float32)[:, None]
    return values.reshape(-1)[: math.prod(shape)].reshape(shape)


def _np_bound(x: np.ndarray, fmt: residual_formats.BlockFormat) -> np.ndarray:
    """Per element, the largest error of ``fmt``'s rounding of ``x``: ``scale / 2`` for
    nearest int codes, one ``scale`` for stochastic ones, 3 mantissa bits for float8."""
    size = fmt.block_size
    flat = np.zeros(-(-x.size // size) * size, np.float32)
    flat[: x.size] = x.reshape(-1)
    blocks = flat.reshape(-1, size)
    absmax = np.abs(blocks).max(axis=1, keepdims=True)
    if fmt.codes == "float8":
        step = np.maximum(np.abs(blocks) * 2.0**-3, absmax / 448 * 2.0**-9)
    else:
        step = np.broadcast_to(absmax / {"int8": 127, "int4": 7}[fmt.codes], blocks.shape)
    bound = step if fmt.stochastic else step / 2
    return bound.reshape(-1)[: x.size].reshape(x.shape) * (1 + 1e-5) + 1e-30


# --------------------------------------------------------------------------------------
# One step at a time from a given per-worker state


class _Stepper(th.ShardMapStep):
    """``tx``'s init and one update under shard_map, every state leaf per worker."""

    def __init__(self, tx: optax.GradientTransformation, params=None, workers: int = WORKERS):
        super().__init__(tx, _params() if params is None else params, workers)

    def __call__(self, state, grads):
        state = jax.device_put(
            state,
            jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs),
        )
        out, state = self.step(self.params, state, self.shard_grads(grads))
        return jax.device_get(out), jax.device_get(state)


def _decoded(state: rr.DGCState, fmt: residual_formats.BlockFormat) -> rr.DGCState:
    """``state`` with ``u`` and ``v`` decoded per worker by :func:`_np_decode`."""

    def leaf(stored, name):
        shape = SHAPES[name]
        return np.stack(
            [
                _np_decode(jax.tree.map(lambda x, w=w: x[w], stored), fmt.codes, shape)
                for w in range(WORKERS)
            ]
        )

    def buffers(tree):
        return {k: leaf(tree[k], k) if k in ("a", "b") else tree[k] for k in tree}

    return state._replace(momentum=buffers(state.momentum), velocity=buffers(state.velocity))


def test_float32_is_todays_dgc_bit_for_bit():
    grads = _grads(4)
    out, state = th.run_shard_map(_dgc(), _params(), grads, WORKERS)
    out32, state32 = th.run_shard_map(_dgc("float32"), _params(), grads, WORKERS)
    chex.assert_trees_all_equal(out32, out)
    chex.assert_trees_all_equal(state32, state)


@pytest.mark.parametrize("name", ["int8", "int4/64/stochastic", "float8"])
def test_block_formats_round_only_what_they_keep_step_by_step(name):
    """From the same decoded state a float32 step sends the same update, and the format's
    new ``u``, ``v`` are that step's within the format's rounding, zeros exact."""
    fmt = residual_formats.parse_format(name)
    quantized, reference = _Stepper(_dgc(fmt)), _Stepper(_dgc())
    state = quantized.init(quantized.params)
    assert isinstance(state.velocity["a"], residual_formats.Quantized)
    assert state.velocity["bias"] == optax.MaskedNode()
    rounded = 0.0
    for t, grads in enumerate(_grads(5, seed=1)):
        start = _decoded(jax.device_get(state), fmt)
        out_f, ref = reference(start, grads)
        out_q, state = quantized(state, grads)
        for k in SHAPES:  # the same payloads, so the same mean, bit for bit
            np.testing.assert_array_equal(out_q[k], out_f[k], err_msg=f"step {t} {k}")
        got = _decoded(state, fmt)
        for buffer in ("momentum", "velocity"):
            for k in ("a", "b"):
                x, y = getattr(ref, buffer)[k], getattr(got, buffer)[k]
                for w in range(WORKERS):
                    error = np.abs(y[w] - x[w])
                    assert (error <= _np_bound(x[w], fmt)).all(), (t, buffer, k, w)
                    rounded = max(rounded, float(error.max()))
                # Momentum factor masking's zeros (and only they, among sent) stay exact.
                assert (y[x == 0] == 0).all(), (t, buffer, k)
            np.testing.assert_array_equal(  # dense leaves keep float momentum
                ref.dense_momentum["bias"], state.dense_momentum["bias"]
            )
        assert (got.momentum["a"] == 0).sum() >= WORKERS * int(DENSITY * 1500)
    assert rounded > 0


def test_stochastic_rounding_is_reproducible_and_differs_between_workers():
    fmt = residual_formats.BlockFormat("int8", rounding="stochastic")
    grads = _grads(2, seed=2)
    _, a = th.run_shard_map(_dgc(fmt), _params(), grads, WORKERS)
    _, b = th.run_shard_map(_dgc(fmt), _params(), grads, WORKERS)
    chex.assert_trees_all_equal(a, b)
    _, other_seed = th.run_shard_map(_dgc(fmt, seed=1), _params(), grads, WORKERS)
    assert not np.array_equal(a.velocity["b"].codes, other_seed.velocity["b"].codes)
    # The same gradients on two workers round differently (the worker is folded in).
    same = [{k: np.broadcast_to(g[k][:1], g[k].shape).copy() for k in g} for g in grads]
    _, c = th.run_shard_map(_dgc(fmt), _params(), same, WORKERS)
    assert not np.array_equal(c.velocity["b"].codes[0], c.velocity["b"].codes[1])
    _, nearest = th.run_shard_map(_dgc("int8"), _params(), same, WORKERS)
    np.testing.assert_array_equal(nearest.velocity["b"].codes[0], nearest.velocity["b"].codes[1])


def test_skip_nonfinite_keeps_codes_and_scales_bit_for_bit():
    grads = _grads(4, seed=3)
    bad = {k: v.copy() for k, v in grads[2].items()}
    bad["b"][1, 3, 4] = np.nan

    def make():
        return rr.skip_nonfinite(optax.chain(_dgc("int4/64/stochastic"), rr.optimizers.sgd(0.1)))

    out_bad, s_bad = th.run_shard_map(make(), _params(), [*grads[:2], bad], WORKERS)
    _, s_two = th.run_shard_map(make(), _params(), grads[:2], WORKERS)
    assert int(s_bad.skipped[0]) == 1
    for leaf in jax.tree.leaves(out_bad[2]):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
    chex.assert_trees_all_equal(s_bad.inner[0], s_two.inner[0])
    # And the run goes on as if the step had never come.
    out_a, _ = th.run_shard_map(make(), _params(), [*grads[:2], bad, grads[3]], WORKERS)
    out_b, _ = th.run_shard_map(make(), _params(), [*grads[:2], grads[3]], WORKERS)
    chex.assert_trees_all_equal(out_a[3], out_b[2])


def test_model_state_bytes_count_codes_and_scales():
    """int4 blocks of 128 on a 1000 x 300 leaf: ceil(300000 / 128) = 2344 blocks (the last
    zero-padded from 96 elements), each 64 bytes of codes (two a byte) and one float32 scale:
    2344 * 64 + 2344 * 4 bytes, per buffer."""
    params = {"w": np.zeros((1000, 300), np.float32), "bias": np.zeros(300, np.float32)}
    buffer = 2344 * 64 + 2344 * 4
    assert buffer == 159_392
    tx = rr.deep_gradient_compression(rr.compressors.topk(0.01), 0.1, residual_format="int4")
    m = rr.memory.model_state_bytes(params, tx)
    assert m.residuals == buffer  # v: the unsent accumulation, DGC's residual
    # u, the bias's float32 momentum, and the int32 counts of DGC's memory and of the SGD.
    assert m.optimizer == buffer + 300 * 4 + 4 + 4
    plain = rr.memory.model_state_bytes(
        params, rr.deep_gradient_compression(rr.compressors.topk(0.01), 0.1)
    )
    assert plain.residuals == 300_000 * 4
    assert plain.optimizer == 300_000 * 4 + 300 * 4 + 4 + 4
    int8 = rr.memory.model_state_bytes(
        params, rr.deep_gradient_compression(rr.compressors.topk(0.01), 0.1, residual_format="int8")
    )
    assert int8.residuals == 1172 * 256 + 1172 * 4  # 1172 blocks of 256 one-byte codes
    bf16 = rr.memory.model_state_bytes(
        params,
        rr.deep_gradient_compression(rr.compressors.topk(0.01), 0.1, residual_format="bfloat16"),
    )
    assert bf16.residuals == 300_000 * 2


def test_bad_formats_are_refused():
    with pytest.raises(ValueError, match="Unknown residual format 'int2'"):
        _dgc("int2")


# --------------------------------------------------------------------------------------
# The training program: config, resume, checkpoints


def _digits(**changes):
    from tests.test_quantized_residuals import _digits as digits

    return digits(**{"compression.variant": "dgc", **changes})


def test_the_config_key_reaches_dgc_memory():
    from train import config_schema, factory

    config = _digits(**{"compression.residual_format": "int4/64/stochastic"})
    config_schema.validate(config)
    tx = factory.build_tx(config, 10.0, 10)
    params = {"w": np.zeros((200, 64), np.float32)}  # 12800 values: 200 blocks of 64
    state = jax.eval_shape(tx.init, params)
    (dgc,) = [s for s in state if isinstance(s, rr.DGCState)]
    codes, scales = dgc.velocity["w"]
    assert codes.shape == (200, 32) and codes.dtype == np.uint8
    assert scales.shape == (200,)
    bf16 = jax.eval_shape(
        factory.build_tx(_digits(**{"compression.residual_format": "bfloat16"}), 10.0, 10).init,
        params,
    )
    assert next(s for s in bf16 if isinstance(s, rr.DGCState)).momentum["w"].dtype == "bfloat16"


def _by_path(tree) -> dict[str, np.ndarray]:
    """Leaves by path of names (a NamedTuple's fields and a dict's keys alike)."""

    def name(key) -> str:
        for attr in ("name", "key", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    return {
        "/".join(name(k) for k in path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _restore(workdir: str, config, step: int):
    """Checkpoint ``step`` restored through the program's Checkpointer, on the host."""
    import os

    from train import checkpointing, train

    run = train.build_run(config)
    state = train.initial_state(run)
    ckpt = checkpointing.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        keep=3,
        num_workers=config.num_workers,
        on_worker_change="error",
    )
    like = {"params": state.params, "opt_state": state.opt_state, "model_state": state.model_state}
    try:
        restored = ckpt.restore(step, like, state.step_fn.state_specs, run.mesh)
    finally:
        ckpt.close()
    return jax.device_get(restored)


@pytest.mark.parametrize("name", ["int8", "int4/64/stochastic"])
def test_a_quantized_dgc_run_resumes_and_restores_bit_identically(tmp_path, name):
    from train import train

    config = _digits(**{"compression.residual_format": name})
    full = train.train_and_evaluate(config, str(tmp_path / "full"))
    # The memory report's residuals are v's codes and scales, by hand: hidden_0's 64 x 256
    # kernel and hidden_1..3's 256 x 256 are compressed (the rest is under min_size).
    block = residual_formats.parse_format(name).block_size
    code_bytes = block // 2 if name.startswith("int4") else block
    v_bytes = (16_384 // block + 3 * 65_536 // block) * (code_bytes + 4)
    assert v_bytes == {"int8": 216_320, "int4/64/stochastic": 119_808}[name]
    with open(tmp_path / "full" / train.SUMMARY_FILE) as f:
        written = json.load(f)["memory"]
    for memory in (full.memory, written):
        assert memory["reduced"]["residuals"] == memory["residual_bytes_per_device"] == v_bytes
        assert memory["reduced"]["optimizer"] >= v_bytes  # u, as many bytes
    first = train.train_and_evaluate(config, str(tmp_path / "split"), halt_after_step=5)
    assert first.preempted
    saved = train.final_state(str(tmp_path / "split"))
    restored = _restore(str(tmp_path / "split"), config, 5)
    is_dgc = lambda x: isinstance(x, rr.DGCState)
    (dgc,) = [s for s in jax.tree.leaves(restored["opt_state"], is_leaf=is_dgc) if is_dgc(s)]
    is_q = lambda x: isinstance(x, residual_formats.Quantized)
    quantized = [x for x in jax.tree.leaves(dgc.velocity, is_leaf=is_q) if is_q(x)]
    assert quantized and all(np.asarray(q.scales).max() > 0 for q in quantized)
    got, written = _by_path(restored["opt_state"]), _by_path(saved["opt_state"])
    assert any("velocity" in path and path.endswith("codes") for path in got)
    assert got.keys() == written.keys()
    for path, x in got.items():  # codes and scales as written, bit for bit
        np.testing.assert_array_equal(x, written[path], err_msg=path)
        assert x.dtype == written[path].dtype, path
    second = train.train_and_evaluate(config, str(tmp_path / "split"))
    assert second.step == full.step == 10
    chex.assert_trees_all_equal(
        train.final_state(str(tmp_path / "full")), train.final_state(str(tmp_path / "split"))
    )


# --------------------------------------------------------------------------------------
# A change of the worker count


def _worker_values(stored, w: int, fmt, shape) -> np.ndarray:
    """Worker ``w``'s buffer as float32 (block codes decoded by :func:`_np_decode`)."""
    if isinstance(fmt, residual_formats.BlockFormat):
        return _np_decode(jax.tree.map(lambda x: x[w], stored), fmt.codes, shape)
    return np.asarray(stored[w], np.float32)


@pytest.mark.parametrize("name", [None, "bfloat16", "int8", "int4/64/stochastic"])
def test_resize_workers_gives_every_new_worker_the_old_mean(name):
    _, state = th.run_shard_map(_dgc(name), _params(), _grads(3, seed=4), WORKERS)
    host = jax.tree.map(np.asarray, state)
    resized = rr.dgc.resize_workers(host, _params(), 2, residual_format=name)
    again = rr.dgc.resize_workers(host, _params(), 2, residual_format=name)
    chex.assert_trees_all_equal(resized, again)
    assert resized.count is host.count and resized.dense_momentum is host.dense_momentum
    fmt = residual_formats.parse_format(name or "float32")
    for buffer in ("momentum", "velocity"):
        for k in ("a", "b"):
            old, new = getattr(host, buffer)[k], getattr(resized, buffer)[k]
            assert jax.tree.leaves(new)[0].shape[0] == 2
            mean = np.mean(
                [_worker_values(old, w, fmt, SHAPES[k]) for w in range(WORKERS)],
                0,
                dtype=np.float64,
            )
            for w in range(2):
                got = _worker_values(new, w, fmt, SHAPES[k])
                if isinstance(fmt, residual_formats.BlockFormat):
                    bound = _np_bound(mean.astype(np.float32), fmt)
                else:
                    bound = np.abs(mean) * (2.0**-8 if name == "bfloat16" else 2.0**-23)
                assert (np.abs(got - mean) <= bound * (1 + 1e-3) + 1e-7).all(), (buffer, k, w)


def test_a_quantized_dgc_checkpoint_restores_and_trains_on_fewer_workers(tmp_path):
    from tests.test_train import restore_checkpoint
    from train import train

    workdir = str(tmp_path / "run")
    config = _digits(**{"compression.residual_format": "int8"})
    train.train_and_evaluate(config, workdir, halt_after_step=4)
    old = restore_checkpoint(workdir, config, 4)
    fewer = _digits(**{"compression.residual_format": "int8"})
    fewer.num_workers, fewer.batch_size_per_worker = 4, 2 * config.batch_size_per_worker
    new = restore_checkpoint(workdir, fewer, 4)
    is_dgc = lambda x: isinstance(x, rr.DGCState)
    (before,) = [x for x in jax.tree.leaves(old["opt_state"], is_leaf=is_dgc) if is_dgc(x)]
    (after,) = [x for x in jax.tree.leaves(new["opt_state"], is_leaf=is_dgc) if is_dgc(x)]
    path = "hidden_1"
    stored_old, stored_new = before.velocity[path]["kernel"], after.velocity[path]["kernel"]
    assert stored_old.codes.shape[0] == 8 and stored_new.codes.shape[0] == 4
    shape = (256, 256)
    mean = np.mean(
        [
            _np_decode(jax.tree.map(lambda x, w=w: x[w], stored_old), "int8", shape)
            for w in range(8)
        ],
        0,
        dtype=np.float64,
    )
    assert (mean != 0).any()
    for w in range(4):
        got = _np_decode(jax.tree.map(lambda x, w=w: x[w], stored_new), "int8", shape)
        half = np.repeat(np.asarray(stored_new.scales)[w], 256).reshape(shape) / 2
        assert (np.abs(got - mean) <= half * (1 + 1e-5) + 1e-12).all(), w
    fewer.on_worker_change = "average"
    assert train.train_and_evaluate(fewer, workdir, halt_after_step=6).step == 6
