"""Command line of the training program.

    python -m train --config configs/default.py --workdir /tmp/rr_digits \\
        --config.compression.variant=w+2d --config.compression.density=0.001

Multi-host: ``--coordinator_address=HOST:PORT --num_processes=N --process_id=I`` (or the
``RR_*`` environment variables, or a SLURM allocation); see ``train/distributed.py``.
On CPU the program simulates ``config.num_workers`` devices (split over the processes).
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from train import distributed

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", "configs/default.py", "Path to a config file (configs/*.py with get_config())."
)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0 (multi-host runs).")
flags.DEFINE_integer("num_processes", None, "Number of processes (multi-host runs).")
flags.DEFINE_integer("process_id", None, "This process's index (multi-host runs).")
flags.DEFINE_integer(
    "collective_timeout_s",
    60,
    "Seconds after which a lost peer stops the run: a CPU collective waiting this long "
    "aborts, and in multi-process runs a process that sent no heartbeat for this long is "
    "declared dead (jax.distributed), so the other processes exit instead of hanging.",
)


def run(argv) -> None:
    del argv
    config = FLAGS.config
    if FLAGS.workdir is None:
        raise app.UsageError("--workdir is required (checkpoints and metrics go there).")
    setup = distributed.resolve(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    if config.num_workers % setup.num_processes:
        raise app.UsageError(
            f"num_workers={config.num_workers} does not split over {setup.num_processes} processes."
        )
    from resireduce_jax import runtime

    runtime.configure_cpu(
        num_devices=config.num_workers // setup.num_processes,
        collective_timeout_s=FLAGS.collective_timeout_s,
    )
    distributed.start(setup, heartbeat_timeout_s=FLAGS.collective_timeout_s)
    # Our own messages are printed; keep library chatter (orbax logs every write) quiet.
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)

    from train import train  # imports jax lazily, after the XLA flags are set

    summary = train.train_and_evaluate(config, FLAGS.workdir)
    sys.exit(0 if summary.step > 0 or summary.preempted else 1)


def cli() -> None:
    """Console-script entry point (``resireduce-train``)."""
    flags.mark_flags_as_required([])
    app.run(run)


if __name__ == "__main__":
    cli()
