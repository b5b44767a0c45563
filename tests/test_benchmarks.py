"""Benchmark helpers: the shared config loader, the copy classifier, the compiled step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import common  # noqa: E402
import peak_memory  # noqa: E402

from train import compiled_step  # noqa: E402

# A tiny optimized module: one parameter, a transpose copy (layout {0,1} of a {1,0}
# operand), a real copy of the same layout, and a copy inside a fusion.
HLO = """\
HloModule jit_body, is_scheduled=true

%fused_computation (param_0.1: f32[4,8]) -> f32[4,8] {
  %param_0.1 = f32[4,8]{1,0} parameter(0)
  ROOT %copy.9 = f32[4,8]{1,0} copy(%param_0.1)
}

ENTRY %main.1 (param.1: f32[4,8], param.2: f32[16]) -> (f32[4,8], f32[4,8], f32[16]) {
  %param.1 = f32[4,8]{1,0} parameter(0), metadata={op_name="params[\\'dense\\'][\\'kernel\\']"}
  %param.2 = f32[16]{0} parameter(1), metadata={op_name="opt_state[0].residuals[\\'w\\']"}
  %copy.1 = f32[4,8]{0,1} copy(%param.1)
  %add.3 = f32[16]{0} add(%param.2, %param.2), metadata={op_name="transpose(jvp(d))/add"}
  %copy.2 = f32[16]{0} copy(%add.3)
  %fusion.4 = f32[4,8]{1,0} fusion(%param.1), kind=kLoop, calls=%fused_computation
  ROOT %tuple.5 = (f32[4,8]{0,1}, f32[4,8]{1,0}, f32[16]{0}) tuple(%copy.1, %fusion.4, %copy.2)
}
"""


# Imports every benchmark module, then every module any benchmark imports anywhere (at the
# top or inside a function), with the packages of the test extras blocked.
_IMPORT_WITHOUT_TEST_TOOLS = """
import ast, importlib, pathlib, sys
for name in ("pytest", "hypothesis", "tests", "tensorflow_datasets"):
    sys.modules[name] = None  # `import name` now raises ImportError
benchmarks = pathlib.Path("benchmarks")
sys.path.insert(0, str(benchmarks))
imported = set()
for path in sorted(benchmarks.glob("*.py")):
    importlib.import_module(path.stem)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module)
for name in sorted(imported):
    importlib.import_module(name)
print(len(imported), "modules")
"""


def test_benchmarks_need_no_test_tools():
    """pyproject: the benchmarks run with the ``[train]`` extra alone (no pytest, hypothesis,
    tests/ or the ``[tfds]`` extra)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_WITHOUT_TEST_TOOLS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "modules" in done.stdout


def test_copies_tell_layout_transposes_from_real_copies():
    found = {c["name"]: c for c in peak_memory.copies(HLO)}
    assert set(found) == {"copy.1", "copy.2", "copy.9"}
    transpose, real, fused = found["copy.1"], found["copy.2"], found["copy.9"]
    assert transpose["transpose"] and not transpose["fused"]
    assert transpose["bytes"] == 4 * 8 * 4
    assert transpose["origin"] == "argument: params"
    assert transpose["source"] == "params['dense']['kernel']"
    assert not real["transpose"] and real["bytes"] == 16 * 4
    assert real["origin"] == "backward"
    assert fused["fused"] and not fused["transpose"]
    summary = peak_memory.copy_summary(HLO)
    assert summary["by_origin"]["argument: params"]["transpose"] == [128, 1]
    assert summary["by_origin"]["backward"]["real"] == [64, 1]
    assert summary["fused"] == 128


def test_origin_follows_copies_to_residual_arguments():
    instructions = peak_memory.parse_hlo(HLO.replace("add(%param.2, %param.2)", "copy(%param.2)"))
    copied, kind, source = peak_memory.origin(instructions, "copy.2")
    assert copied and kind == "argument: residuals" and source == "opt_state[0].residuals['w']"


def test_load_config_reads_the_named_file():
    config = common.load_config("bert_base_squad")
    assert config.model.name == "bert_base"
    assert common.load_config("default").model.name == "digits_mlp"
    case = common.Case("default", {"width": 32}, batch_per_worker=4)
    assert dict(case.load().model.overrides) == {"width": 32}


def test_fill_prose_keeps_hand_written_blocks(tmp_path):
    source = tmp_path / "x.md"
    source.write_text("# old\n<!-- prose: why -->\nBecause.\n<!-- /prose -->\n| 1 |\n")
    out = common.fill_prose("# new\n<!-- prose: why -->\n| 2 |\n<!-- prose: new -->\n", "x", source)
    assert out == (
        "# new\n<!-- prose: why -->\nBecause.\n<!-- /prose -->\n| 2 |\n"
        "<!-- prose: new -->\n<!-- /prose -->\n"
    )


def test_a_page_in_another_folder_keeps_its_own_prose(tmp_path):
    """A results page outside ``benchmarks/results`` (a variant of a benchmark's run)
    starts from the committed page's prose and keeps its own once written."""
    name = "peak_memory"
    committed = common.fill_prose("<!-- prose: about -->\n", name)
    generated = "| 1 |\n<!-- prose: about -->\n"
    common.write_markdown(name, generated, tmp_path, echo=False)
    page = tmp_path / f"{name}.md"
    assert page.read_text() == "| 1 |\n" + committed
    page.write_text("| 1 |\n<!-- prose: about -->\nIts own.\n<!-- /prose -->\n")
    common.write_markdown(name, generated.replace("1", "2"), tmp_path, echo=False)
    assert page.read_text() == "| 2 |\n<!-- prose: about -->\nIts own.\n<!-- /prose -->\n"


def test_with_variant_spells_bf16_residuals():
    config = compiled_step.with_variant(common.load_config("default"), "w+2d+bf16")
    assert config.compression.variant == "w+2d"
    assert config.compression.residual_dtype == "bfloat16"
    assert compiled_step.variant_label(config) == "w+2d+bf16"
    for plain in ("ef", "w+2d"):  # the suffix decides, not the config it starts from
        config_of_plain = compiled_step.with_variant(config, plain)
        assert config_of_plain.compression.residual_dtype == ""
        assert compiled_step.variant_label(config_of_plain) == plain
    assert compiled_step.variant_label(compiled_step.with_variant(config, "ef+bf16")) == "ef+bf16"
    float8 = compiled_step.with_variant(config, "ef+f8")
    assert (float8.compression.variant, float8.compression.residual_dtype) == (
        "ef",
        "float8_e4m3fn",
    )
    assert compiled_step.variant_label(float8) == "ef+f8"
    for wrong in ("w+3d", "w+2d+f8+bf16", "ef+int5", "ef+int4/0"):
        with pytest.raises(ValueError, match="variant"):
            compiled_step.with_variant(config, wrong)


@pytest.mark.parametrize(
    ("variant", "store", "residual_format"),
    [("ef+int4", "ef", "int4"), ("w+2d+int8", "w+2d", "int8"),
     ("2d+int4/64/stochastic", "2d", "int4/64/stochastic"), ("w+float8", "w", "float8")],
)  # fmt: skip
def test_with_variant_spells_residual_formats(variant, store, residual_format):
    """'+<format>' sets compression.residual_format (and clears a cast), and the label
    gives the variant back; the config validates."""
    from train import config_schema

    start = compiled_step.with_variant(common.load_config("byte_gpt"), "w+2d+bf16")
    config = compiled_step.with_variant(start, variant)
    assert config.compression.variant == store
    assert config.compression.residual_format == residual_format
    assert config.compression.residual_dtype == ""
    assert compiled_step.variant_label(config) == variant
    config_schema.validate(config)
    assert compiled_step.with_variant(config, store).compression.residual_format == ""


def test_compiled_step_peak_is_memory_analysis_sum():
    config = common.load_config("default")
    step = compiled_step.compile_step(config, variant="ef", batch_per_worker=4, num_workers=2)
    ma = step.compiled.memory_analysis()
    expected = (
        ma.argument_size_in_bytes
        + ma.output_size_in_bytes
        - ma.alias_size_in_bytes
        + ma.temp_size_in_bytes
    )
    assert step.peak.peak == expected > 0
    # donated: every parameter and optimizer-state output reuses its input buffer
    assert ma.alias_size_in_bytes > 0
    assert step.variant == "ef"


def test_memory_report_has_the_variant_beside_ef_and_dense():
    report = compiled_step.memory_report(
        common.load_config("default"), 4, num_workers=2, guard=False
    )
    assert [r["variant"] for r in report.rows] == ["w+2d+int3", "ef", "dense"]
    assert report.row("dense")["residuals"] == 0
    assert report.row("w+2d+int3")["residuals"] < report.row("ef")["residuals"]
    text = report.text()
    assert "w+2d+int3" in text and "dense" in text
    # The default's int3 residuals are a few KiB: the table is in KiB, and shows them.
    residuals = report.row("w+2d+int3")["residuals"]
    assert 0 < residuals < 2**20 / 20 and "residuals KiB" in text and "MiB" not in text
    row = next(line for line in text.splitlines() if line.strip().startswith("w+2d+int3"))
    assert float(row.split()[3]) == round(residuals / 2**10, 1) > 0


def _accuracy_payload(runs, variants, command):
    import accuracy

    tasks = sorted({r["task"] for r in runs})
    return {
        "command": command,
        "overrides": {},
        "variants": variants,
        "complete": True,
        "settings": {t: {"steps": 1} for t in tasks},
        "seconds": 10.0,
        "summary": accuracy.summarize(runs, tasks, variants),
        "runs": runs,
    }


def _run(task, variant, seed, final):
    return {
        "task": task,
        "variant": variant,
        "seed": seed,
        "final": final,
        "residual_bytes": 1,
        "ef_residual_bytes": 2,
        "skipped_steps": 0,
        "seconds": 1.0,
    }


def test_accuracy_merge_replaces_rerun_seeds_and_keeps_other_tasks():
    import accuracy

    before = _accuracy_payload(
        [_run("digits", "ef", 0, 90.0), _run("digits", "ef", 1, 92.0)], ["ef"], "first"
    )
    now = _accuracy_payload(
        [
            _run("digits", "ef", 1, 96.0),  # replaces seed 1
            _run("byte_gpt_deep", "ef", 0, 10.0),
            _run("byte_gpt_deep", "w+2d", 0, 10.5),
        ],
        ["ef", "w+2d"],
        "second",
    )
    before["complete"] = False  # an interrupted first command: its finished runs stay
    merged = accuracy.merge_payloads(before, now)
    assert merged["complete"] is True  # the latest command's
    assert accuracy.merge_payloads(now, {**now, "complete": False})["complete"] is False
    assert merged["commands"] == ["first", "second"]
    assert list(merged["settings"]) == ["digits", "byte_gpt_deep"]  # TASKS order
    assert merged["variants"] == ["ef", "w+2d"]
    assert merged["seconds"] == 20.0
    rows = {(r["task"], r["variant"]): r for r in merged["summary"]}
    assert rows[("digits", "ef")]["finals"] == [90.0, 96.0]
    assert rows[("digits", "ef")]["mean"] == 93.0
    assert rows[("byte_gpt_deep", "w+2d")]["delta_vs_ef"] == 0.5
    assert len(merged["runs"]) == 4
    setting = {
        "description": "d",
        "steps": 1,
        "workers": 8,
        "batch_per_worker": 1,
        "compressor": "topk",
        "density": 0.01,
        "min_size": 1,
        "max_group_size": 3,
        "intra_layers": "x",
    }
    merged = {**merged, "settings": dict.fromkeys(merged["settings"], setting), "cpu_count": 2}
    table = accuracy.markdown(merged)
    assert "Produced by: `first`; `second`." in table
    assert "overrides" not in table.lower()  # none were set
    table = accuracy.markdown({**merged, "overrides": {"local_devices": 4}})
    assert "**Config overrides on every run**: `local_devices=4`." in table


def test_accuracy_merge_refuses_runs_fine_tuned_from_another_pretraining(
    tmp_path, monkeypatch, capsys
):
    import accuracy

    from resireduce_jax import runtime

    monkeypatch.setattr(runtime, "configure_cpu", lambda workers: None)  # JAX runs already
    monkeypatch.setattr(accuracy, "pretrained", lambda task: "unused")
    monkeypatch.setattr(accuracy, "pretrained_digest", lambda workdir: "new")

    def fake_train_one(task, variant, seed, steps, extra, scratch, recipe="base"):
        return {**_run(task, variant, seed, 5.0), "pretrained_digest": "new", "steps": 600,
                "bytes_sent": 1, "dense_bytes": 10}  # fmt: skip

    monkeypatch.setattr(accuracy, "train_one", fake_train_one)
    monkeypatch.setattr(accuracy, "write_outputs", lambda payload, out: saved.append(payload))
    monkeypatch.setattr(accuracy, "write_results", lambda *args, **kwargs: None)  # partial
    monkeypatch.setattr(accuracy, "markdown", lambda payload: "")
    saved = []
    old = [
        {**_run("byte_gpt_finetune", "ef", 1, 6.0), "pretrained_digest": "old", "steps": 600},
        {**_run("byte_gpt_finetune", "dense", 1, 5.9), "steps": 600},  # before digests were
        {**_run("byte_gpt_finetune", "ef", 2, 5.8), "pretrained_digest": "new", "steps": 600},
        {**_run("byte_gpt_finetune", "ef", 3, 5.7), "pretrained_digest": "new", "steps": 400},
        {**_run("digits", "ef", 0, 97.0), "steps": 300},
    ]
    with pytest.raises(ValueError, match=r"different step counts \(\[400, 600\]\)"):
        accuracy.summarize(old, ["byte_gpt_finetune"], ["ef"])  # a file merged before
    payload = {**_accuracy_payload(old[-1:], ["dense", "ef"], "first"), "runs": old}
    (tmp_path / "accuracy.json").write_text(json.dumps(payload))
    argv = ["--tasks", "byte_gpt_finetune", "--variants", "ef", "--seeds", "1", "--merge",
            "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit):
        accuracy.main(argv)
    error = capsys.readouterr().err
    assert "holds 3 byte_gpt_finetune runs that do not compare" in error
    assert "(600 steps from pre-trained model new)" in error
    assert "1 at 400 steps from pre-trained model new" in error  # the step count differs
    assert "1 at 600 steps from pre-trained model old" in error
    assert "1 at 600 steps from pre-trained model unrecorded" in error
    assert "--supersede" in error
    assert saved == []  # refused before anything trained or was written

    accuracy.main([*argv, "--supersede"])
    runs = {(r["task"], r["variant"], r["seed"]): r["final"] for r in saved[-1]["runs"]}
    # The three stale runs are gone; the comparable run and the other task stay.
    assert runs == {
        ("byte_gpt_finetune", "ef", 0): 5.0,
        ("byte_gpt_finetune", "ef", 2): 5.8,
        ("digits", "ef", 0): 97.0,
    }
    assert saved[-1]["settings"]["byte_gpt_finetune"]["pretrained_digest"] == "new"
    assert "dropped (--supersede)" in capsys.readouterr().err


def test_accuracy_rows_per_recipe_with_ratio_to_dense_and_bytes_sent():
    import accuracy

    def run(variant, recipe, seed, final, sent):
        return {**_run("byte_gpt", variant, seed, final), "recipe": recipe,
                "bytes_sent": sent, "dense_bytes": 100}  # fmt: skip

    runs = [
        run("dense", "base", 0, 4.0, 100),
        run("dense", "base", 1, 4.0, 100),
        run("ef", "base", 0, 10.0, 4),
        run("ef", "cm", 0, 5.0, 9),
        run("ef", "cm", 1, 5.4, 9),
        run("w+2d", "cm", 0, 5.1, 9),
        run("w+2d", "cm", 1, 5.7, 9),
    ]
    rows = {
        (r["recipe"], r["variant"]): r
        for r in accuracy.summarize(runs, ["byte_gpt"], ["dense", "ef", "w+2d"], ["base", "cm"])
    }
    assert set(rows) == {("base", "dense"), ("base", "ef"), ("cm", "ef"), ("cm", "w+2d")}
    assert rows[("cm", "ef")]["over_dense"] == pytest.approx(5.2 / 4.0)
    assert rows[("cm", "w+2d")]["delta_vs_ef"] == pytest.approx(0.2)  # paired with cm's ef
    assert rows[("cm", "w+2d")]["sent_over_dense"] == pytest.approx(0.09)
    assert rows[("base", "ef")]["delta_vs_ef"] is None
    sgd, adam = accuracy.TASKS["byte_gpt_sgdm"], accuracy.TASKS["byte_gpt"]
    assert accuracy.applicable(sgd, "dgc_warmup", "dgc")
    assert not accuracy.applicable(adam, "base", "dgc")  # DGC's memory is SGD's
    assert not accuracy.applicable(sgd, "cm", "dgc")
    assert not accuracy.applicable(sgd, "cm_dgc", "dgc")
    assert accuracy.applicable(sgd, "cm_global", "ef")
    assert accuracy.applicable(sgd, "cm_global", "ef+bf16")
    assert accuracy.applicable(sgd, "cm_global", "w+2d")
    assert not accuracy.applicable(sgd, "cm_global", "dgc")
    assert not accuracy.applicable(sgd, "dense_warmup", "dgc")  # masking empties a dense step
    assert not accuracy.applicable(adam, "cm", "dense")  # dense is the base only
    assert accuracy.RECIPES["cm"].overrides(sgd)["optimizer.name"] == "compressed_momentum_sgd"
    assert accuracy.RECIPES["cm"].overrides(adam)["optimizer.name"] == "compressed_momentum_adam"


def test_hierarchical_accuracy_reuses_flat_runs_and_merges_by_layout(tmp_path, monkeypatch):
    import accuracy
    import hierarchical

    trained = []

    def fake_train_one(task, variant, seed, steps, extra, scratch):
        trained.append((task, variant, extra["local_devices"], seed))
        return {**_run(task, variant, seed, 20.0 + extra["local_devices"]), "steps": 1200}

    monkeypatch.setattr(accuracy, "train_one", fake_train_one)
    flat_file = tmp_path / "accuracy.json"
    flat_runs = [
        {**_run("byte_gpt_deep", v, s, 10.0 + s), "steps": 1200}
        for v in ("ef", "w+2d")
        for s in (0, 1)
    ]
    flat_file.write_text(json.dumps({"runs": flat_runs[:3]}))  # w+2d seed 1 is missing
    saved = []
    now = hierarchical.measure_accuracy(
        ["byte_gpt_deep"], 2, 400, (4,), str(flat_file), on_record=lambda r: saved.append(len(r))
    )
    # Only L=4 everywhere and the one missing flat run are trained; L=2 and L=8 are not.
    assert sorted(trained) == sorted(
        [("byte_gpt_deep", v, 4, s) for v in ("ef", "w+2d") for s in (0, 1)]
        + [("byte_gpt_deep", "w+2d", 0, 1)]
    )
    assert saved == list(range(1, 9))  # saved after every one of the 8 runs
    flat = {(r["variant"], r["seed"]): r for r in now if r["layout"] == "flat"}
    assert flat[("ef", 1)]["final"] == 11.0 and flat[("ef", 1)]["from"] == str(flat_file)
    assert "from" not in flat[("w+2d", 1)]

    before = [
        {**_run("byte_gpt_deep", "ef", 0, 99.0), "steps": 1200, "layout": "L=4"},
        {**_run("digits", "ef", 0, 98.0), "steps": 300, "layout": "L=4"},
    ]
    merged = hierarchical.merge_accuracy(before, now)
    assert len(merged) == 9  # the rerun replaced its record, digits kept
    assert [
        r["final"]
        for r in merged
        if r["task"] == "byte_gpt_deep"
        and r["layout"] == "L=4"
        and r["variant"] == "ef"
        and r["seed"] == 0
    ] == [24.0]
    table = hierarchical.markdown({"bytes": {}, "accuracy": merged})
    assert "| byte_gpt_deep | 1200 | ef | flat* | 2 | 10.50 ± 0.71 | +0.00 |" in table
    assert "| byte_gpt_deep | 1200 | ef | L=4 | 2 | 24.00 ± 0.00 | +13.50 |" in table


def test_guard_cost_merge_replaces_the_rerun_cases_in_place():
    import guard_cost

    def row(model, optimizer, guard, peak):
        return {
            "model": model,
            "variant": "ef",
            "optimizer": optimizer,
            "guard": guard,
            "peak": peak,
        }

    before = [
        row("conv", "sgd", "none", 1),
        row("conv", "adan_r", "none", 2),
        row("mlp", "adan_r", "loss", 3),
    ]
    now = [
        row("mlp", "adan_r", "loss", 30),
        row("conv", "adan_r", "none", 20),
        row("vit", "adan_r", "none", 40),
    ]
    merged = guard_cost.merge_rows(before, now)
    assert [r["peak"] for r in merged] == [1, 20, 30, 40]
    assert [r["model"] for r in merged] == ["conv", "conv", "mlp", "vit"]


def test_density_schedule_merge_replaces_the_rerun_cases_in_place():
    import density_schedule

    def row(variant, schedule, peak):
        return {"model": "gpt2_medium", "variant": variant, "schedule": schedule, "peak": peak}

    before = [row("ef", "constant", 1), row("ef", "dense", 2), row("w+2d", "dense", 3)]
    now = [row("w+2d", "dense_bf16", 40), row("ef", "dense", 20)]
    merged = density_schedule.merge_rows(before, now)
    assert [r["peak"] for r in merged] == [1, 20, 3, 40]


def test_density_schedule_counts_a_bfloat16_phase_twice_on_cpu_only():
    """XLA:CPU all-reduces bfloat16 in float32 and float16 in float16: the compiled bytes
    of both, test_compressors.test_compiled_collective_bytes_equal_payload_bytes."""
    import density_schedule

    import resireduce_jax as rr

    bf16, f16 = rr.compressors.Cast("bfloat16", feedback=False), rr.compressors.Cast("float16")
    assert density_schedule.wire_bytes(bf16, 100, "cpu") == 200
    assert density_schedule.wire_bytes(bf16, 100, "gpu") == 100
    assert density_schedule.wire_bytes(f16, 100, "cpu") == 100
    assert density_schedule.wire_bytes(rr.compressors.topk(0.01), 100, "cpu") == 100


def test_temp_packing_counts_the_most_temp_bytes_alive_at_once(tmp_path):
    """From hand-made XLA dumps of a 300-byte temp buffer: ``a`` and ``b`` overlap in time
    (200 B), ``e`` is ``b``'s tuple alias at the same offset (counted once), ``c`` reuses
    ``a``'s slot after it and overlaps ``d`` (200 B); a parameter's value is not temp. At
    most 200 B are alive at once; the other 100 B are what the packing lost."""
    prefix = tmp_path / "module_0001.jit_body.cpu_after_optimizations"
    (tmp_path / (prefix.name + "-buffer-assignment.txt")).write_text(
        "allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:\n"
        " value: <1 param.1 @0> (size=64,offset=0): f32[16]{0}\n"
        "allocation 1: size 300, preallocated-temp:\n"
        " value: <2 a @0> (size=100,offset=0): f32[25]{0}\n"
        " value: <3 b @0> (size=100,offset=100): f32[25]{0}\n"
        " value: <4 c @0> (size=100,offset=0): f32[25]{0}\n"
        " value: <5 d @0> (size=100,offset=200): f32[25]{0}\n"
        " value: <6 e{0} @0> (size=100,offset=100): f32[25]{0}\n"
    )
    (tmp_path / (prefix.name + "-live-range.txt")).write_text(
        "HloLiveRange (max 5):\n  BufferLiveRange:\n"
        "    param.1{}:0-5\n    a{}:0-2\n    b{}:1-3\n    e{0}:2-2\n    c{}:4-5\n    d{}:5-5\n"
        "  Live ranges at 5 (peak):\n"
    )
    assert peak_memory.temp_packing(str(tmp_path)) == {"allocation": 300, "most_alive": 200}


def test_gpu_check_refuses_cpu_and_runs_every_section_with_allow_cpu(tmp_path, capsys, monkeypatch):
    """On CPU: exit status 2 and the one-line message; with ``--allow-cpu`` (tiny sizes, one
    worker, a child process per variant's memory) every section, positive times."""
    import math

    import gpu_check

    monkeypatch.delenv(gpu_check.PREALLOCATE, raising=False)  # main() sets it; undone here
    with pytest.raises(SystemExit) as refused:
        gpu_check.main(["--out", str(tmp_path)])
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip() == gpu_check.REFUSAL

    gpu_check.main(["--allow-cpu", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "gpu_check.json").read_text())
    variants = ["dense", "ef", "w+2d"]  # the config's variant is w+2d
    assert [r["variant"] for r in payload["step_time"]] == variants
    assert all(t > 0 for r in payload["step_time"] for t in r["seconds_per_step"])
    assert all(math.isfinite(r["final_loss"]) for r in payload["step_time"])
    assert [r["variant"] for r in payload["memory"]] == variants
    for row in payload["memory"]:  # the CPU client keeps no memory_stats()
        assert row["compiled_peak"] > 0 and row["ratio"] is None and row["note"]
    assert [r["method"] for r in payload["topk"]] == ["topk", "fast_topk", "lax.top_k"]
    assert all(r["median"] > 0 and r["recall"] > 0.9 for r in payload["topk"])
    page = (tmp_path / "gpu_check.md").read_text()
    for heading in ("## Step time", "## Memory", "## Top-k", payload["meta"]["jax"]):
        assert heading in page
    # Where the backend has memory_stats(), the ratio is the measured peak over the compiled.
    stats = {"bytes_in_use": 10, "peak_bytes_in_use": 30, "bytes_limit": 100}
    row = gpu_check.memory_row("ef", {"peak": 20}, stats, {**stats, "peak_bytes_in_use": 50})
    assert math.isfinite(row["ratio"]) and row["ratio"] == 2.5 and row["note"] is None


RENDERED = [  # (script, extra arguments, page under benchmarks/results/)
    ("step_time", [], "step_time.md"),
    ("step_time", ["--backward-order"], "step_time_backward.md"),
    ("step_time", ["--weight-update-order"], "step_time_order.md"),
    ("guard_cost", [], "guard_cost.md"),
    ("density_schedule", [], "density_schedule.md"),
    ("memory_figures", [], "memory_figures.md"),
    ("peak_memory", [], "peak_memory.md"),
    ("model_states", [], "model_states.md"),
    ("fit", [], "fit.md"),
    ("hierarchical", [], "hierarchical.md"),
    ("faults", [], "reliability.md"),
    ("accuracy", [], "accuracy.md"),
    ("accuracy", [], "accuracy_long/accuracy.md"),
    ("accuracy", [], "accuracy_formats/accuracy.md"),
]


@pytest.mark.parametrize(("script", "extra", "page"), RENDERED, ids=[r[2] for r in RENDERED])
def test_committed_results_page_is_what_its_json_renders(script, extra, page, tmp_path):
    """Each page's tables come from its JSON (``--from-json``), table first, prose after."""
    import importlib
    import shutil

    committed = os.path.join(common.RESULTS, page)
    folder = os.path.dirname(committed)
    for name in os.listdir(folder):
        if name.endswith(".json"):
            shutil.copy(os.path.join(folder, name), tmp_path)
    module = importlib.import_module(script)
    if script == "accuracy":
        module.main(["--from-json", str(tmp_path / "accuracy.json"), "--out", str(tmp_path)])
    else:
        module.main(["--from-json", "--out", str(tmp_path), *extra])
    rendered = (tmp_path / os.path.basename(page)).read_text()
    with open(committed) as f:
        assert rendered == f.read()
    first_table = rendered.index("\n|")
    first_prose = rendered.find("<!-- prose:")
    assert first_prose == -1 or first_table < first_prose


def test_model_states_reference_layouts_are_their_arithmetic():
    import model_states

    # 1-bit Adam: m, v, a worker error and 1/N of a server error, all float32.
    assert model_states.one_bit_adam([100, 28], 4) == {
        "params": 512,
        "grads": 512,
        "optimizer": 1024,
        "residuals": 512 + 128,
    }
    # 8-bit Adam: a small tensor keeps both moments in float32; 5,000 values are 20 blocks
    # of 256, each a float32 absmax, beside one byte a value, for each moment.
    assert model_states.eight_bit_adam([10, 5000])["optimizer"] == 2 * 4 * 10 + 2 * (5000 + 80)


def test_model_states_rows_are_the_training_programs_states():
    import model_states

    payload = model_states.measure()
    rows = {r["layout"]: r["per_parameter"] for r in payload["rows"]}
    # AdamW: m and v in float32 (and a few scalars: step counters).
    expected = {"params": 4, "grads": 4, "optimizer": 8, "residuals": 0, "total": 16}
    assert rows["adamw"] == pytest.approx(expected, abs=1e-3)
    # Error feedback keeps a float32 residual of each compressed leaf (the small leaves
    # travel dense): under 4 bytes a parameter, the same for AdamW and compressed momentum.
    assert 3 < rows["adamw_ef"]["residuals"] == rows["cm_ef"]["residuals"] < 4
    assert rows["cm_w2d"]["residuals"] < rows["cm_ef"]["residuals"]
    shipped = rows["shipped"]
    assert shipped["optimizer"] + shipped["residuals"] <= 2.5
    assert shipped["params"] == shipped["grads"] == 4
