"""Test-wide setup: 8 simulated CPU devices and fail-fast collectives.

Why these flags: docs/design.md, "JAX/XLA facts the code relies on".

The flags must be in ``XLA_FLAGS`` before JAX initializes its CPU backend, so this runs
at import time of the test session, before any test module touches ``jax.numpy``.
"""

from resireduce_jax import runtime

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
