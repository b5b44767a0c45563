"""Starting ``jax.distributed`` from flags, environment variables or SLURM.

Order of precedence: explicit arguments (the ``--coordinator_address``,
``--num_processes``, ``--process_id`` flags), then ``RR_COORDINATOR_ADDRESS``,
``RR_NUM_PROCESSES``, ``RR_PROCESS_ID``, then a SLURM job with more than one task (JAX
detects SLURM itself). With none of these the run is single-process.

Each process feeds its own contiguous slice of every global batch
(:func:`resireduce_jax.parallel.shard_batch`).
"""

from __future__ import annotations

import dataclasses
import os

from train.config_schema import ConfigError

__all__ = ["ProcessSetup", "resolve", "start"]


@dataclasses.dataclass(frozen=True)
class ProcessSetup:
    coordinator_address: str | None
    num_processes: int
    process_id: int
    from_slurm: bool = False

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: dict[str, str] | None = None,
) -> ProcessSetup:
    """Works out the process layout without starting anything (testable).

    Raises:
      ConfigError: an incomplete or inconsistent multi-process setup (names the flags).
    """
    env = os.environ if environ is None else environ
    address = coordinator_address or env.get("RR_COORDINATOR_ADDRESS")
    n = num_processes if num_processes is not None else env.get("RR_NUM_PROCESSES")
    pid = process_id if process_id is not None else env.get("RR_PROCESS_ID")
    if address or n is not None or pid is not None:
        if not (address and n is not None and pid is not None):
            raise ConfigError(
                "Multi-process runs need all three of --coordinator_address, --num_processes "
                "and --process_id (or RR_COORDINATOR_ADDRESS, RR_NUM_PROCESSES, RR_PROCESS_ID); "
                f"got coordinator_address={address!r}, num_processes={n!r}, process_id={pid!r}."
            )
        try:
            n, pid = int(n), int(pid)
        except ValueError:
            raise ConfigError(
                f"--num_processes and --process_id must be integers, got num_processes={n!r}, "
                f"process_id={pid!r}."
            ) from None
        if ":" not in address.rsplit("]", 1)[-1] or address.endswith(":"):
            raise ConfigError(
                f"--coordinator_address={address!r} needs a port: pass HOST:PORT of process 0, "
                "e.g. 127.0.0.1:12345."
            )
        if n < 1:
            raise ConfigError(f"--num_processes must be >= 1, got {n}.")
        if not 0 <= pid < n:
            raise ConfigError(f"--process_id must be in [0, {n}) for {n} processes, got {pid}.")
        return ProcessSetup(address, n, pid)
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return ProcessSetup(None, int(env["SLURM_NTASKS"]), int(env.get("SLURM_PROCID", "0")), True)
    return ProcessSetup(None, 1, 0)


_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def start(
    setup: ProcessSetup,
    *,
    initialization_timeout_s: int = 120,
    heartbeat_timeout_s: int = 100,
) -> None:
    """Calls ``jax.distributed.initialize`` for a multi-process setup (no-op otherwise).

    Args:
      setup: from :func:`resolve`.
      initialization_timeout_s: how long to wait for all processes to connect.
      heartbeat_timeout_s: a process that sent no heartbeat for this long is declared
        dead and every other process aborts with a message saying so. This bounds the time
        a run hangs after losing a peer: cross-process CPU (gloo) collectives do not time
        out on their own.
    """
    if not setup.multi_process:
        return
    import jax

    # CPU backends need a cross-process collectives implementation (GPUs use NCCL).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = dict(
        initialization_timeout=initialization_timeout_s,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
    if setup.from_slurm:
        jax.distributed.initialize(**timeouts)
        return
    host = setup.coordinator_address.rsplit(":", 1)[0]
    jax.distributed.initialize(
        coordinator_address=setup.coordinator_address,
        num_processes=setup.num_processes,
        process_id=setup.process_id,
        # A coordinator on the loopback interface is not exposed to the network
        # (JAX binds to all interfaces by default).
        coordinator_bind_address=setup.coordinator_address if host in _LOOPBACK_HOSTS else None,
        **timeouts,
    )
