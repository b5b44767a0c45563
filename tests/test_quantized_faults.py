"""The kill/resume campaign (benchmarks/faults.py) over quantized residuals: its jobs keep
int4 (stochastic rounding) and int8 codes, and a killed run resumes bit for bit."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from train import config_schema
from train.local_job import ROOT, program_env


def _faults():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import faults

    return faults


def _default_config():
    spec = importlib.util.spec_from_file_location(
        "configs_default", os.path.join(ROOT, "configs", "default.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_the_campaign_has_quantized_jobs_that_validate():
    faults = _faults()
    formats = {
        name: faults.ALL_CONFIGS[name]["compression.residual_format"]
        for name in ("default_int4", "default_int8")
    }
    assert formats == {"default_int4": "int4/64/stochastic", "default_int8": "int8"}
    for name in formats:
        assert name not in faults.CONFIGS  # the default campaign draws as before
        assert faults.config_file(name) == "default"
        assert faults.QUICK_ALL[name]["num_steps"] == 8
        config = _default_config()
        for key, value in faults.ALL_CONFIGS[name].items():
            *parents, leaf = key.split(".")
            node = config
            for parent in parents:
                node = node[parent]
            node[leaf] = value
        config_schema.validate(config)
    key = faults.campaign_key(formats)
    assert key in faults.TITLES
    draws = [faults.draw(0, i, {n: faults.ALL_CONFIGS[n] for n in formats}) for i in range(30)]
    assert {d.config for d in draws} == set(formats)
    assert any(d.injections for d in draws)  # NaN / Inf steps too (digits images)


@pytest.mark.slow
def test_a_killed_int4_stochastic_run_resumes_bit_identically(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "faults.py",
            "--quick",
            "--configs",
            "default_int4",
            "--runs",
            "1",
            f"--workdir={tmp_path}",
        ],
        cwd=os.path.join(ROOT, "benchmarks"),
        env=program_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "reliability.json") as f:
        (campaign,) = json.load(f)["campaigns"].values()
    assert campaign["summary"]["identical"] == 1, campaign["runs"]
    (shapes,) = campaign["residuals_compared"].values()
    codes = [s for path, s in shapes.items() if "codes" in path]
    assert codes and all(s[0] == 4 for s in codes)  # every worker's int4 codes compared
