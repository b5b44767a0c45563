"""Test-wide setup: 8 simulated CPU devices, fail-fast collectives, quick compiles, one
compilation cache.

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

The test session's own programs are compiled with LLVM's optimization of the generated
code off (``--xla_backend_optimization_level=0``; XLA's default is 3): 28 % less CPU time
on a part of the suite measured both ways. XLA:CPU's loop unrolling, SLP vectorization
and tiled fusion emitter are off too (``runtime.ANALYSIS_CODEGEN``, the flags of
``runtime.analysis_flags``, which ``--plan_only`` uses): 8 % less wall time on
``test_resireduce.py`` and ``test_compressors.py`` (two runs each way, alternated), and the
optimized HLO of the byte GPT's step is the same text with and without them. XLA's HLO
passes, scheduling and buffer assignment are unchanged (memory figures and collectives are
those of the default compile: ``tests/test_planner.py`` compares both; docs/design.md,
"Compiling for analysis"), and every result is checked against a reference or a second run
compiled the same way. The training programs the tests start (``python -m train``, through
``train.local_job.program_env``) set their own device count and collective timeouts and
keep the session's other flags, so they compile at level 0 too, as do the scripts started
with the session's environment (the README's examples); the user-like CPU loop of
``tests/test_parallel.py`` drops the session's ``XLA_FLAGS`` and compiles at XLA's default.
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
    # Every program, however quickly it compiles (JAX's default keeps those over 1 s).
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    path = tempfile.mkdtemp(prefix="resireduce_jax_tests_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)


def _compile_quickly() -> None:
    """Adds :func:`resireduce_jax.runtime.analysis_flags` (LLVM's optimization level 0 and
    :data:`~resireduce_jax.runtime.ANALYSIS_CODEGEN` off) to ``XLA_FLAGS``, each unless it
    is set. The session runs its programs too: only their code is slower."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    for flag in runtime.analysis_flags():
        name = flag.split("=", 1)[0]
        if not any(f.startswith(name) for f in flags):
            flags.append(flag)
    os.environ["XLA_FLAGS"] = " ".join(flags)


_share_compiled_programs()

# Importing the library imports JAX (which reads the cache directory above); XLA_FLAGS it
# reads only when it starts a backend.
from resireduce_jax import runtime  # noqa: E402

_compile_quickly()
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
