"""The CPU flags of ``resireduce_jax.runtime``: what they keep working."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from resireduce_jax import runtime


def test_one_flag_disables_both_passes_that_drop_or_break_barriers():
    """XLA keeps only the last ``--xla_disable_hlo_passes``, so both passes are in one."""
    flags = [f for f in runtime.cpu_flags() if f.startswith("--xla_disable_hlo_passes=")]
    assert len(flags) == 1
    passes = set(flags[0].split("=", 1)[1].split(","))
    assert passes == {"cse_barrier_expander", "small-while-loop-hoisting"}
    assert not any("disable_hlo_passes" in f for f in runtime.cpu_flags(keep_remat_barriers=False))


def test_a_checkpoint_inside_a_small_loop_compiles_and_differentiates():
    """With the barriers kept, XLA:CPU's small-loop kernels aborted the process on a
    ``jax.checkpoint`` inside a small ``fori_loop`` (jaxlib 0.10.2). It compiles, keeps
    its barrier, and gives the gradient of the same loop without checkpointing."""
    w = jnp.asarray(np.random.default_rng(0).standard_normal((4, 4)) * 0.3, jnp.float32)
    x = jnp.ones((2, 4), jnp.float32)

    def loss(w, x, remat):
        def layer(c):
            return jnp.tanh(c @ w)

        step = jax.checkpoint(layer) if remat else layer
        return jax.lax.fori_loop(0, 3, lambda i, c: step(c), x).sum()

    grad = jax.jit(jax.grad(loss), static_argnums=2)
    text = grad.lower(w, x, True).compile().as_text()
    assert "opt-barrier(" in text  # the case that used to abort: a barrier in a small loop
    np.testing.assert_allclose(grad(w, x, True), grad(w, x, False), rtol=1e-6)


def test_analysis_flags_only_where_asked_and_a_users_flags_win(monkeypatch):
    """``analysis_only`` adds LLVM's level 0 and the code-generation passes off, as one
    ``--xla_backend_extra_options`` (XLA keeps only its last); a flag the user set stays."""
    assert not any("xla_backend" in f for f in runtime.cpu_flags())
    added = [f for f in runtime.cpu_flags(analysis_only=True) if "xla_backend" in f]
    assert added == [
        "--xla_backend_optimization_level=0",
        "--xla_backend_extra_options=" + ",".join(runtime.ANALYSIS_CODEGEN),
    ]
    assert all(name.startswith("xla_cpu_disable_") for name in runtime.ANALYSIS_CODEGEN)
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2")
    flags = runtime.configure_cpu(8, analysis_only=True).split()
    assert "--xla_backend_optimization_level=2" in flags
    assert "--xla_backend_optimization_level=0" not in flags
    assert "--xla_backend_extra_options=" + ",".join(runtime.ANALYSIS_CODEGEN) in flags
