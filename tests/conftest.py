"""Test-wide setup: 8 simulated CPU devices, fail-fast collectives, one compilation cache.

Why these flags: docs/design.md, "JAX/XLA facts the code relies on".

The flags must be in ``XLA_FLAGS`` before JAX initializes its CPU backend, so this runs
at import time of the test session, before any test module touches ``jax.numpy``.

Many tests compile the same programs: a run and its resumed run, the training program's
processes the tests start, the same config in several tests. JAX's persistent compilation
cache in one directory of the session (``JAX_COMPILATION_CACHE_DIR``, which the
pytest-xdist workers and every program the tests start inherit, and which the training
program uses where its config names no cache) compiles each of them once. A loaded
executable is the compiled program (same memory figures and results); only the time to
compile it is saved.
"""

import atexit
import os
import shutil
import tempfile


def _share_compiled_programs() -> None:
    """Points ``JAX_COMPILATION_CACHE_DIR`` at a new directory of this test session.

    Runs before JAX is imported (JAX reads the variable then). A directory the caller set
    is used as it is and kept; the session's own is removed by the process that made it.
    """
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    path = tempfile.mkdtemp(prefix="resireduce_jax_tests_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)


_share_compiled_programs()

from resireduce_jax import runtime  # noqa: E402

runtime.configure_cpu(num_devices=8, collective_timeout_s=10)

import jax  # noqa: E402
import pytest  # noqa: E402

NUM_DEVICES = 8


@pytest.fixture(scope="session", autouse=True)
def _check_simulated_devices():
    devices = jax.devices()
    assert len(devices) == NUM_DEVICES, (
        f"expected {NUM_DEVICES} simulated CPU devices, got {len(devices)}; was JAX "
        "initialized before tests/conftest.py could set XLA_FLAGS?"
    )
    yield
