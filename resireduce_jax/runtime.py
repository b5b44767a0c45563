"""XLA settings for simulated multi-device CPU runs, and the reasons behind each one.

Code is developed and tested here on one CPU that XLA splits into simulated devices.
configure_cpu sets the flags: the device count, fail-fast stuck collectives, no YNNPACK
fusion, barriers kept for remat, and the memory-optimizing scheduler.
analysis_only compiles with code generation optimizations off, for programs never run.
intra_op_threads sizes the Eigen pool, so every process layout rounds alike.
GPU and TPU ignore the CPU flags; the barrier pass is harmless there.
Each flag and why: docs/design.md, "XLA flags for CPU runs (runtime.py)" and "JAX/XLA
facts the code relies on".
"""

from __future__ import annotations

import os

__all__ = [
    "ANALYSIS_CODEGEN",
    "ANALYSIS_OPTIONS",
    "analysis_flags",
    "configure_cpu",
    "cpu_flags",
    "default_intra_op_threads",
]

#: XLA:CPU code-generation passes a process that never runs its programs turns off
#: (``--xla_backend_extra_options``): loop unrolling, LLVM's SLP vectorizer and the tiled
#: fusion emitter.
ANALYSIS_CODEGEN = (
    "xla_cpu_disable_loop_unrolling",
    "xla_cpu_disable_slp_vectorizer",
    "xla_cpu_disable_tiled_emitter",
)


#: Compile options of one program compiled to be measured, never run (``Lowered.compile``'s
#: ``compiler_options``): no LLVM optimization of the generated code.
ANALYSIS_OPTIONS = {"xla_backend_optimization_level": 0}


def analysis_flags() -> list[str]:
    """XLA flags of a process whose programs are compiled to be measured, never run:
    :data:`ANALYSIS_OPTIONS` for every compilation and :data:`ANALYSIS_CODEGEN` off (which
    only ``--xla_backend_extra_options`` sets). The compiled programs' memory and cost
    analyses are the optimized programs'; their code is slow."""
    return [
        *(f"--{name}={value}" for name, value in ANALYSIS_OPTIONS.items()),
        f"--xla_backend_extra_options={','.join(ANALYSIS_CODEGEN)}",
    ]


def cpu_flags(
    num_devices: int | None = 8,
    *,
    collective_timeout_s: int | None = 10,
    memory_scheduler: bool = True,
    keep_remat_barriers: bool = True,
    analysis_only: bool = False,
) -> list[str]:
    """Returns the XLA flags this library recommends for (simulated) CPU runs.

    Args:
      num_devices: number of simulated CPU devices, or ``None`` to leave it to XLA.
      collective_timeout_s: seconds after which a stuck CPU collective aborts the
        process (a warning is printed after half of it); ``None`` keeps XLA's default.
      memory_scheduler: schedule HLO for low memory instead of concurrency (an
        ``xla_cpu_*`` flag: no effect on other backends).
      keep_remat_barriers: keep optimization barriers, ``jax.checkpoint``'s among them
        (needed for remat on CPU; harmless elsewhere, docs/design.md, "XLA flags for CPU runs
        (runtime.py)").
      analysis_only: the process compiles programs only to measure them
        (:func:`analysis_flags`); never set it for a process that trains.

    Returns:
      A list of ``--flag=value`` strings.
    """
    flags = ["--xla_cpu_experimental_ynn_fusion_type="]
    if num_devices is not None:
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}.")
        flags.append(f"--xla_force_host_platform_device_count={num_devices}")
    if collective_timeout_s is not None:
        warn = max(1, collective_timeout_s // 2)
        flags += [
            f"--xla_cpu_collective_call_warn_stuck_timeout_seconds={warn}",
            f"--xla_cpu_collective_call_terminate_timeout_seconds={collective_timeout_s}",
        ]
    if keep_remat_barriers:
        flags.append("--xla_disable_hlo_passes=cse_barrier_expander,small-while-loop-hoisting")
    if memory_scheduler:
        flags.append("--xla_cpu_enable_concurrency_optimized_scheduler=false")
    if analysis_only:
        flags += analysis_flags()
    return flags


def default_intra_op_threads(num_devices: int) -> int:
    """The intra-op thread pool XLA:CPU gives one process that drives ``num_devices``
    devices: ``max(schedulable cores, num_devices)``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(cores or 1, num_devices)


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def configure_cpu(
    num_devices: int | None = 8, *, intra_op_threads: int | None = None, **kwargs
) -> str:
    """Merges :func:`cpu_flags` into ``XLA_FLAGS`` before JAX starts its backends.

    Flags the user already set in ``XLA_FLAGS`` (and a ``PJRT_NPROC`` already set) win over
    ours. Must be called before the first JAX computation (importing JAX is fine).

    Args:
      num_devices: number of simulated CPU devices (``None``: leave as is).
      intra_op_threads: threads of XLA:CPU's intra-op pool (``PJRT_NPROC``; ``None``:
        XLA's choice, ``max(cores, num_devices)``). The processes of one job pass the
        same value, e.g. ``default_intra_op_threads(devices of the whole job)``, for local
        results that do not depend on the process layout.
      **kwargs: forwarded to :func:`cpu_flags`.

    Returns:
      The resulting ``XLA_FLAGS`` string.

    Raises:
      RuntimeError: if JAX backends are already initialized, so the flags would be ignored.
    """
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "configure_cpu() was called after JAX initialized its backends, so XLA would "
            "ignore the flags. Call it at program start, before any jax.numpy operation "
            "or jax.devices() call."
        )
    existing = os.environ.get("XLA_FLAGS", "").split()
    have = {_flag_name(f) for f in existing}
    merged = existing + [f for f in cpu_flags(num_devices, **kwargs) if _flag_name(f) not in have]
    os.environ["XLA_FLAGS"] = " ".join(merged)
    if intra_op_threads is not None:
        os.environ.setdefault("PJRT_NPROC", str(intra_op_threads))
    return os.environ["XLA_FLAGS"]
