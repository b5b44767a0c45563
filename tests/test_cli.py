"""``python -m train`` as a user meets it: --help, and one-line errors for bad input.

Every mistake must be reported before training starts, as one ``error: ...`` line that
names the key, with exit status 2 and no traceback; each run takes a few seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from train.local_job import ROOT, program_env


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "train", *args],
        cwd=ROOT,
        env=program_env(JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_the_flags_and_an_example():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for flag in (
        "--config",
        "--workdir",
        "--coordinator_address",
        "--num_processes",
        "--process_id",
        "--collective_timeout_s",
        "--config.KEY=VALUE",
    ):
        assert flag in out, flag
    assert "python -m train --config configs/default.py --workdir /tmp/rr_digits" in out
    assert "compression.{" in out and "density" in out  # the config keys
    assert "Traceback" not in out + result.stderr


def test_help_gives_no_timing_figure_for_the_example():
    """The quick start's time is the README's (measured); --help says only its order."""
    out = run_cli("--help").stdout
    example = out.split("Example (", 1)[1].split("python -m train", 1)[0]
    assert "seconds on a laptop CPU" in example and "README.md" in example, example
    assert "minute" not in example, example
    assert not re.search(r"\d\s*(s|sec|seconds|min)\b", example), example


def test_a_typo_in_a_section_name_names_the_key_once_and_the_closest_one(tmp_path):
    result = run_cli("--workdir", str(tmp_path / "run"), "--config.compresion.variant=ef")
    assert_user_error(result, "compresion")
    assert result.stderr.strip() == (
        "error: Unknown config key 'compresion' in --config.compresion.variant; did you mean "
        "'compression'? --help lists the config keys."
    )


def test_a_typo_in_a_key_suggests_the_closest_one(tmp_path):
    result = run_cli("--workdir", str(tmp_path / "run"), "--config.compression.densty=0.1")
    assert_user_error(result, "'compression.densty'; did you mean 'compression.density'?")


@pytest.mark.parametrize(
    "arg, key",
    [
        ("--config.memory.budget=abc", "memory.budget='abc'"),
        ("--config.compression.variant=foo", "compression.variant='foo'"),
    ],
)
def test_config_errors_come_before_jax_is_imported(tmp_path, arg, key):
    """The program in a fresh process reports the mistake without importing jax."""
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('jax imported:', 'jax' in sys.modules))\n"
        f"sys.argv = ['train', '--workdir', {str(tmp_path / 'run')!r}, {arg!r}]\n"
        "from train.main import cli\n"
        "cli()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=program_env(JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_user_error(result, key)
    assert "e.g. '12GiB'" in result.stderr or "memory" not in key  # the accepted forms
    assert result.stdout.strip() == "jax imported: False"


def test_helpfull_shows_the_usage_too():
    result = run_cli("--helpfull")
    assert "Usage:" in result.stdout and "--workdir" in result.stdout


@pytest.mark.parametrize(
    "args, key",
    [
        (["--config.compression.variant=foo"], "compression.variant"),
        (["--config.compression.density=1.5"], "compression.density"),
        (["--config.no_such_key=1"], "no_such_key"),
        (["--config.compression.densty=0.1"], "compression.densty"),
        (["--config.nosection.x=1"], "nosection"),
        (["--config.compression.density=abc"], "compression.density"),
        (["--config=configs/no_such_config.py"], "--config"),
        (["--no_such_flag=1"], "no_such_flag"),
        (["--num_processes=2"], "--coordinator_address"),
        (
            [
                "--config.dataset.name=text_files",
                "--config.dataset.train_files=/no/such/dir/*.txt",
                "--config.dataset.eval_files=/no/such/dir/*.txt",
            ],
            "dataset.train_files",
        ),
        (["--config.model.name=no_such_model"], "model.name"),
        (["--config.memory.budget=abc"], "memory.budget"),
        (["--config.memory.prefer=fast"], "memory.prefer='fast'"),
        (["--config.memory.exchanges=('ef', 'ef+int5')"], "'int5' is not a residual format"),
        (["--config.memory.exchanges=('dense',)"], "'dense' keeps no residuals"),
        (["--plan_only"], "--plan_only"),
        (["--config.optimizer.name=no_such_optimizer"], "optimizer.name"),
        (["--config.optimizer.kwargs.no_such_argument=1"], "no_such_argument"),
        (["--config.compression.compressor=no_such_compressor"], "compression.compressor"),
    ],
)
def test_bad_values_print_one_line_and_exit_2(tmp_path, args, key):
    """Each mistake is found before the workdir is created: nothing is left behind."""
    result = run_cli("--workdir", str(tmp_path / "run"), *args)
    assert_user_error(result, key)
    assert not os.path.exists(tmp_path / "run")


def test_workdir_that_is_a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("")
    assert_user_error(run_cli("--workdir", str(path)), "--workdir")


def test_workdir_under_a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("")
    assert_user_error(run_cli("--workdir", str(path / "run")), "cannot be created")


def test_missing_workdir():
    assert_user_error(run_cli(), "--workdir")


def assert_user_error(result: subprocess.CompletedProcess, key: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and key in lines[0], lines[0]
