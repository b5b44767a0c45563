"""Trains one data-parallel experiment with compressed gradients and ResiReduce residuals.

Usage:
  python -m train --config=CONFIG.py --workdir=DIR [--config.KEY=VALUE ...]

Example (the embedded digits job on 8 simulated CPU workers, seconds on a laptop CPU;
README.md's quick start):
  python -m train --config configs/default.py --workdir /tmp/rr_digits \\
      --config.compression.variant=w+2d --config.compression.density=0.001

--config.KEY=VALUE overrides one key of the config file (the keys are listed by --help,
their defaults are in train/config_schema.py, experiments in configs/*.py), e.g.
--config.num_steps=100 or --config.dataset.data_dir=/data/tfds. Re-running with the same
--workdir resumes from its newest checkpoint.

Multi-host: start one process per host with --coordinator_address=HOST:PORT (of process 0)
--num_processes=N --process_id=I, or set RR_COORDINATOR_ADDRESS, RR_NUM_PROCESSES and
RR_PROCESS_ID, or run under a SLURM allocation (train/distributed.py). On CPU the program
simulates config.num_workers devices, split over the processes. With
--config.local_devices=L (the hierarchical exchange: L devices per node) run one process
per node: the devices per process must be a multiple of L.

A mistake in the flags, the config, the workdir or the dataset prints one line,
"error: ...", naming the key and the fix, and exits with status 2.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import textwrap
import traceback

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from train import config_schema, distributed, supervisor
from train.config_schema import ConfigError

FLAGS = flags.FLAGS
DEFAULT_CONFIG = "configs/default.py"
_HELP_FLAGS = ("-h", "--help", "-help", "-?", "--helpshort", "-helpshort")
# Modules whose own `raise` statements report input mistakes (dataset files, fields,
# optimizer names, ...): a ValueError, OSError or ImportError raised there is shown as one
# line. Anything else (including a ValueError raised deeper, in JAX or numpy) is a bug
# and keeps its traceback.
_INPUT_CHECKING_MODULES = ("train.input_pipeline", "train.data.", "train.factory")


def _define_flags() -> None:
    """Defines the flags once (cli() may run several times in one process, e.g. tests).

    Defined here rather than at import so that a mistake in a ``--config.KEY`` override,
    which ml_collections parses while the flag is defined, is reported like any other.
    """
    if "workdir" in FLAGS:
        return
    config_flags.DEFINE_config_file(
        "config",
        DEFAULT_CONFIG,
        "Config file (configs/*.py with get_config()); --config.KEY=VALUE overrides a key.",
        # New keys are accepted here so that config_schema.validate reports a typo with the
        # valid keys, and the free-form sections (dataset, model.overrides,
        # optimizer.kwargs, compression.options) take fields the config file did not set.
        lock_config=False,
        accept_new_attributes=True,
    )
    flags.DEFINE_string(
        "workdir", None, "Directory for checkpoints, metrics and plots (created if missing)."
    )
    flags.DEFINE_string(
        "coordinator_address", None, "HOST:PORT of process 0 (multi-host runs; or $RR_*)."
    )
    flags.DEFINE_integer("num_processes", None, "Number of processes (multi-host runs).")
    flags.DEFINE_integer("process_id", None, "This process's index, 0..N-1 (multi-host runs).")
    flags.DEFINE_integer(
        "collective_timeout_s",
        60,
        "Seconds after which a lost peer stops the run: a CPU collective waiting this long "
        "aborts, and in multi-process runs a process that sent no heartbeat for this long is "
        "declared dead (jax.distributed), so the other processes exit instead of hanging.",
    )
    flags.DEFINE_integer(
        "initialization_timeout_s",
        120,
        "Multi-process runs: seconds to wait for every process to connect to the coordinator.",
    )
    flags.DEFINE_bool(
        "supervise",
        True,
        "Multi-process runs: train in a child process and report its fate (a lost peer: one "
        f"message, the last checkpoint, the resume command, exit status "
        f"{supervisor.EXIT_PEER_LOST}) instead of JAX's abort (train/supervisor.py).",
    )
    flags.DEFINE_bool(
        "plan_only",
        False,
        "With --config.memory.budget=SIZE: print the memory planner's table of compiled "
        "candidates, write memory_plan.json to the workdir and exit without training. "
        "Planning compiles the step of each candidate that a lower bound or a prediction "
        "from the steps already compiled does not rule out, for analysis (quick code "
        "generation, none of it run; threads: --config.memory.compile_threads); a budget "
        "below every candidate's arguments is answered from shapes, without compiling. "
        "Expect a few times a 1-step run (measured: benchmarks/results/planner_speed.md). "
        "A second --plan_only in the same workdir loads the compiled steps from "
        "WORKDIR/compilation_cache (--config.compilation_cache_dir; "
        "$JAX_COMPILATION_CACHE_DIR where set), which is faster.",
    )


# ------------------------------------------------------------------ help and user errors


def _config_keys() -> str:
    """The config keys by section, for --help (free-form sections end in ``.*``)."""
    free_form = {"dataset", "model.overrides", "optimizer.kwargs", "compression.options"}
    config = config_schema.base_config()
    top, sections = [], []
    for key, value in config.items():
        if key in free_form:
            top.append(f"{key}.*")
        elif hasattr(value, "items"):
            names = [f"{name}.*" if f"{key}.{name}" in free_form else name for name in value]
            sections.append(f"{key}.{{{', '.join(names)}}}")
        else:
            top.append(key)
    lines = [", ".join(top), *sections]
    return "\n".join(
        textwrap.fill(line, width=88, initial_indent="  ", subsequent_indent="      ")
        for line in lines
    )


def usage() -> str:
    """What ``python -m train --help`` prints."""
    return (
        f"{__doc__.strip()}\n\n"
        f"Flags of this program (--helpfull lists every flag):\n"
        f"{FLAGS.module_help(sys.modules[__name__]).strip().split(chr(10), 1)[-1]}\n\n"
        "Config keys (--config.KEY=VALUE; the dataset's fields are in docs/data.md):\n"
        f"{_config_keys()}\n"
    )


def _fail(message: object) -> None:
    """Prints ``error: <message>`` on one line to stderr and exits with status 2."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(2)


def _raised_in(error: BaseException, prefixes: tuple[str, ...]) -> bool:
    """Whether the innermost frame of ``error``'s traceback is in one of these modules."""
    frames = list(traceback.walk_tb(error.__traceback__))
    if not frames:
        return False
    module = frames[-1][0].f_globals.get("__name__", "")
    return any(module == p or module.startswith(p) for p in prefixes)


def _unknown_key_message(error: BaseException) -> str:
    """One sentence for ml_collections' KeyError on a ``--config.A.B`` whose ``A`` is unknown.

    Its message is ``'A'``, optionally followed by ``Did you mean "B" instead of "A"?``
    (an AttributeError wraps that KeyError).
    """
    while error.args and isinstance(error.args[0], BaseException):
        error = error.args[0]
    text = str(error.args[0] if error.args else error)
    match = re.fullmatch(r"""\s*'([^'\s]+)'\s*(?:Did you mean "([^"]+)".*)?""", text, re.DOTALL)
    if match is None:  # not a key name but ml_collections' explanation
        return f"--config: {text}"
    key, suggestion = match.groups()
    overrides = [a.split("=", 1)[0] for a in sys.argv if a.startswith("--config.")]
    named = [a for a in overrides if key in a.split(".")[1:]]
    where = named[0] if named else "a --config.KEY flag"
    hint = f"; did you mean '{suggestion}'?" if suggestion else ";"
    return f"Unknown config key '{key}' in {where}{hint} --help lists the config keys."


@contextlib.contextmanager
def _user_errors():
    """Turns mistakes of the user into one line and exit status 2; bugs keep tracebacks."""
    try:
        yield
    except ConfigError as error:
        _fail(error)
    except flags.Error as error:  # absl: unknown flag, unparsable value, flag order
        _fail(f"{error} (see --help).")
    except (KeyError, AttributeError) as error:
        if _raised_in(error, ("ml_collections.",)):  # --config.A.B=1 where A does not exist
            _fail(_unknown_key_message(error))
        raise
    except (ValueError, OSError, ImportError) as error:
        if _raised_in(error, _INPUT_CHECKING_MODULES):
            _fail(error)
        if _raised_in(error, ("ml_collections.",)):  # parsing a --config.KEY override
            _fail(f"--config: {error}")
        raise


def _parse_flags(argv: list[str]) -> list[str]:
    """app.run's flags parser: --help prints :func:`usage` (exit 0); mistakes one line."""
    flag_args = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
    if any(arg in _HELP_FLAGS for arg in flag_args):
        print(usage())
        sys.exit(0)
    with _user_errors():
        return FLAGS(argv)


def _load_config():
    config = FLAGS.config
    try:
        config.get("num_workers")  # ml_collections defers a config file's load error
    except OSError as error:
        cause = error.__cause__ or error
        reason = str(cause).strip().splitlines()[-1].strip()
        raise ConfigError(
            f"--config={FLAGS['config'].config_filename!r} cannot be loaded ({reason}); pass "
            f"the path of a config file, e.g. --config={DEFAULT_CONFIG} from the repository root."
        ) from None
    return config


def _check_workdir(workdir: str | None) -> str:
    """Checks that ``workdir`` is, or can be created as, a writable directory.

    It is not created here: the run creates it once the whole config has been checked
    (:func:`train.train.check_config`), so a mistake leaves nothing behind.
    """
    if not workdir:
        raise ConfigError("--workdir is required: pass --workdir=DIR for checkpoints and metrics.")
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(
            f"--workdir={workdir!r} is a file, not a directory; pass a directory (it is "
            "created if missing)."
        )
    existing = os.path.abspath(workdir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        reason = f"{existing} is a file"
    elif not os.access(existing, os.W_OK | os.X_OK):
        reason = f"{existing} is not writable"
    else:
        return workdir
    raise ConfigError(
        f"--workdir={workdir!r} cannot be created ({reason}); pass a directory you can write to."
    )


# ------------------------------------------------------------------ the program


def run(argv) -> None:
    if supervisor.in_child():
        supervisor.start_child()
    if len(argv) > 1:
        _fail(f"unexpected argument(s) {argv[1:]}; flags take the form --name=value (see --help).")
    with _user_errors():
        config = _load_config()
        config_schema.validate(config)  # names and ranges; model and dataset names later
        if FLAGS.plan_only and config.memory.budget is None:
            raise ConfigError(
                "--plan_only needs a budget: pass --config.memory.budget=SIZE (e.g. 12GiB)."
            )
        workdir = _check_workdir(FLAGS.workdir)
        setup = distributed.resolve(
            FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id
        )
        config_schema.check_processes(config, setup.num_processes)
    if setup.multi_process and FLAGS.supervise and not supervisor.in_child():
        job = supervisor.JobInfo(
            workdir=workdir,
            process_id=setup.process_id,
            num_processes=setup.num_processes,
            coordinator_address=setup.coordinator_address,
            collective_timeout_s=FLAGS.collective_timeout_s,
            initialization_timeout_s=FLAGS.initialization_timeout_s,
            command=sys.orig_argv,
        )
        sys.exit(supervisor.supervise(job, [sys.executable, *sys.orig_argv[1:]]))

    from resireduce_jax import runtime

    runtime.configure_cpu(
        num_devices=config.num_workers // setup.num_processes,
        # As one process driving every worker would: the same local rounding in every
        # process layout (docs/design.md, "Process layouts and bitwise results").
        intra_op_threads=runtime.default_intra_op_threads(config.num_workers),
        collective_timeout_s=FLAGS.collective_timeout_s,
        # --plan_only compiles steps to measure them and runs none: quick code generation
        # (the same memory and cost analyses; docs/design.md, "Compiling for analysis").
        analysis_only=FLAGS.plan_only,
    )
    # Our own messages are printed; keep library chatter (orbax logs every write,
    # jax.distributed its start-up) quiet.
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    distributed.start(
        setup,
        initialization_timeout_s=FLAGS.initialization_timeout_s,
        heartbeat_timeout_s=FLAGS.collective_timeout_s,
    )
    supervisor.notify("ready")

    from train import train  # imports jax lazily, after the XLA flags are set

    if FLAGS.plan_only:
        from train import memory_plan

        with _user_errors():  # a config mistake, or no budget fits: one line
            train.check_config(config)
            memory_plan.plan_only(config, workdir)
        sys.exit(0)
    if supervisor.in_child():
        train.STEP_CALLBACKS.append(supervisor.notify_step)
    with _user_errors(), supervisor.peer_failures():  # user mistakes; a lost peer
        summary = train.train_and_evaluate(config, workdir)
    sys.exit(0 if summary.step > 0 or summary.preempted else 1)


def cli() -> None:
    """Console-script entry point (``resireduce-train``) and ``python -m train``."""
    with _user_errors():
        _define_flags()
    app.run(run, flags_parser=_parse_flags)


if __name__ == "__main__":
    cli()
