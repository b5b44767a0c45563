"""The training loop: data-parallel steps with compressed gradients, eval, checkpoints.

train_and_evaluate(config, workdir) runs one experiment end to end, flax-examples style.
It builds data, model and chain, prints where the memory goes, then trains and evaluates.
It checkpoints every checkpoint_every steps and on SIGTERM.
The same workdir again resumes bit-identically: step t's batch and key depend on (seed, t).
With config.local_devices the run is hierarchical: nodes x devices per node.
Details: docs/design.md, "The training loop (train/train.py)" and docs/training.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from resireduce_jax import models
from train import (
    checkpointing,
    compiled_step,
    config_schema,
    factory,
    input_pipeline,
    memory_plan,
    remat_model,
    residual_analysis,
    tasks,
)
from train import metrics as metrics_lib

log = logging.getLogger(__name__)

__all__ = [
    "Preempted",
    "RunSummary",
    "build_run",
    "check_config",
    "train_and_evaluate",
    "worker_axes",
]

AXIS = "data"
# Multi-process runs agree on SIGTERM every this many steps (one tiny host all-gather), so
# that all processes stop at the same step.
STOP_SYNC_EVERY = 8
# Written to the workdir at the end of every run (also a preempted one): RunSummary as JSON.
SUMMARY_FILE = "summary.json"
# Called with the number of every finished step (train/main.py reports it to the
# supervising parent process, which names the step if a peer is lost).
STEP_CALLBACKS: list[Callable[[int], None]] = []


class Preempted(Exception):
    """Raised internally when SIGTERM asked the run to stop after checkpointing."""


class NonFiniteGradients(FloatingPointError):
    """Gradients had NaN/Inf and the config says ``compression.nonfinite='raise'``."""


@dataclasses.dataclass
class RunSummary:
    """What a finished (or preempted) run reports."""

    step: int
    eval: dict[str, float]
    train: dict[str, float]
    skipped_steps: int
    preempted: bool
    memory: dict[str, Any]
    params_digest: str
    communication: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Run:
    """Everything built from a config before training starts (no arrays allocated)."""

    config: ml_collections.ConfigDict
    dataset: Any
    task: tasks.Task
    mesh: Any
    tx: optax.GradientTransformation
    baseline_tx: optax.GradientTransformation
    global_batch: int
    steps_per_epoch: float
    total_steps: int
    remat_choice: rr.remat.RematChoice | None = None

    @property
    def local_devices(self) -> int | None:
        """Devices per node of a hierarchical run, ``None`` for a flat one."""
        return config_schema.local_devices(self.config)

    @property
    def worker_axes(self) -> str | tuple[str, str]:
        return worker_axes(self.config)


def worker_axes(config: ml_collections.ConfigDict) -> str | tuple[str, str]:
    """``"data"``, or ``("data", "local")`` for a hierarchical run (``local_devices``)."""
    return compiled_step.worker_axes(config)


def check_config(config: ml_collections.ConfigDict) -> None:
    """Raises for any mistake in ``config`` that shows without data or compilation.

    Names and ranges (:func:`train.config_schema.validate`, with the known models and
    datasets), then the optax chain is built (no arrays): the compressor, the optimizer
    and their arguments. :func:`train_and_evaluate` calls it before it creates the workdir.

    Raises:
      ConfigError, ValueError: naming the key, the bad value and the valid choices.
    """
    config_schema.validate(
        config, known_models=models.MODELS, known_datasets=input_pipeline.DATASETS
    )
    factory.build_tx(config, steps_per_epoch=1.0, total_steps=1)


def build_run(
    config: ml_collections.ConfigDict,
    remat: tuple[remat_model.SequentialModel, rr.remat.RematChoice] | None = None,
) -> Run:
    """Validates ``config`` and builds dataset, model, mesh and optax chain.

    Every config mistake surfaces here, before anything is compiled. ``remat``: a model
    already planned (by ``memory.budget``, :mod:`train.memory_plan`) and its report.
    """
    config_schema.validate(
        config, known_models=models.MODELS, known_datasets=input_pipeline.DATASETS
    )
    dataset = input_pipeline.get_dataset(config.dataset, seed=config.seed)
    model_config = models.get_config(config.model.name, **config_schema.model_overrides(config))
    task = tasks.make_task(model_config.build(), model_config, dataset.task)
    remat_choice = None
    if remat is not None:
        model, remat_choice = remat
        task = dataclasses.replace(task, model=model)
    elif config.remat.budget:
        example = dataset.train_batch(0, config.batch_size_per_worker, 0, 1)
        model, remat_choice = remat_model.plan_sequential_model(
            config.model.name,
            model_config,
            config_schema.model_overrides(config),
            config.remat.budget,
            task.example_inputs(example),
        )
        task = dataclasses.replace(task, model=model)
    global_batch = config.num_workers * config.batch_size_per_worker
    if jax.process_count() > 1:
        config_schema.check_processes(config, jax.process_count())
        if global_batch % jax.process_count():
            raise ValueError(
                f"The global batch ({global_batch}) must split evenly over "
                f"{jax.process_count()} processes."
            )
    mesh = compiled_step.build_mesh(config)
    steps_per_epoch = dataset.num_train_examples / global_batch
    if config.num_steps is not None:
        total_steps = int(config.num_steps)
    else:
        total_steps = max(1, math.ceil(config.num_epochs * steps_per_epoch))
    # The guarded chain (hierarchical with local_devices); the memory report's baseline is
    # plain error feedback, flat: every device keeps a full residual in the gradients' dtype.
    tx = compiled_step.build_train_tx(config, steps_per_epoch, total_steps)
    baseline = compiled_step.with_variant(config, "ef")
    baseline_tx = factory.build_tx(baseline, steps_per_epoch, total_steps)
    return Run(
        config=config,
        dataset=dataset,
        task=task,
        mesh=mesh,
        tx=tx,
        baseline_tx=baseline_tx,
        global_batch=global_batch,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        remat_choice=remat_choice,
    )


@dataclasses.dataclass
class InitialState:
    """Freshly initialized train state of a run, and its jitted step."""

    params: Any
    opt_state: Any
    model_state: Any
    step_fn: rr.parallel.DataParallelStep
    abstract_params: Any


def initial_state(run: Run) -> InitialState:
    """Initializes params (seeded), model state and optimizer state on the run's mesh."""
    config = run.config
    init_batch = run.dataset.train_batch(0, run.global_batch, 0, jax.process_count())
    per_worker = {k: v[: config.batch_size_per_worker] for k, v in init_batch.items()}
    key = jax.random.PRNGKey(config.seed)
    abstract = jax.eval_shape(run.task.init, key, per_worker)
    variables = jax.jit(run.task.init)(key, per_worker)
    if config.init_from:
        variables = pretrained_variables(config.init_from, variables)
    params = variables.pop("params")
    model_state = rr.parallel.replicated(dict(variables), run.mesh)
    # The mesh's "local" axis, if any, makes the step hierarchical (batch, per-worker state
    # and metrics over both axes).
    step_fn = compiled_step.build_step(run.task, run.tx, run.mesh, run.config.weight_update_order)
    params, opt_state = step_fn.init(params)
    return InitialState(params, opt_state, model_state, step_fn, abstract["params"])


def pretrained_variables(workdir: str, fresh: dict[str, Any]) -> dict[str, Any]:
    """The parameters (and model state) of the newest complete checkpoint of the run in
    ``workdir``, in place of ``fresh`` ones of the same structure (``config.init_from``:
    fine-tuning; the optimizer state starts anew)."""
    try:
        saved = final_state(workdir)
    except FileNotFoundError as error:
        raise config_schema.ConfigError(
            f"init_from={workdir!r}: {error} Point it at the workdir of a finished run."
        ) from None
    loaded = {"params": saved["params"], **saved.get("model_state", {})}
    want = jax.tree.map(lambda x: (x.shape, x.dtype), fresh)
    have = jax.tree.map(lambda x: (x.shape, x.dtype), loaded)
    if jax.tree.structure(want) != jax.tree.structure(have) or want != have:
        raise config_schema.ConfigError(
            f"init_from={workdir!r}: its checkpoint holds another model (parameter names, "
            "shapes or dtypes differ from this config's); use the same model and "
            "model.overrides as the run that wrote it."
        )
    return jax.tree.map(jnp.asarray, loaded)


def exchange_plan(run: Run, abstract_params) -> rr.exchange.ExchangePlan:
    """Where the run's exchange transform keeps each leaf's residual (one device's shards
    in a hierarchical run)."""
    return layout_plan(run.config, abstract_params, run.local_devices)


def layout_plan(
    config: ml_collections.ConfigDict, abstract_params, local_devices: int | None
) -> rr.exchange.ExchangePlan:
    """The exchange plan of ``config`` for ``local_devices`` per node (``None``: flat),
    e.g. the layout a checkpoint was written with."""
    local_axis = rr.parallel.LOCAL_AXIS if local_devices else None
    exchange = factory.build_exchange(
        config.compression,
        axis_name=AXIS,
        local_axis=local_axis,
        layer_stacks=factory.layer_stacks(config),
    )
    return exchange.plan(abstract_params, local_size=local_devices or 1)


def worker_redistribution(run: Run, abstract_params):
    """``on_worker_change="average"`` for this run's optimizer state (see checkpointing).

    The returned function also takes the checkpoint's ``saved_local_devices`` (``None``:
    flat): the saved residuals are read with that layout's plan and re-planned for this
    run's (:func:`resireduce_jax.exchange.resize_workers` with ``new_plan``), so a change of
    the devices per node is covered too. An int8 frozen second moment keeps its codes
    (:func:`resireduce_jax.compressed_momentum.resize_frozen_nu`; refused while warm).
    """
    plan = exchange_plan(run, abstract_params)
    is_exchange = lambda x: isinstance(x, rr.ExchangeState)
    is_dgc = lambda x: isinstance(x, rr.DGCState)
    is_frozen_nu = lambda x: isinstance(x, rr.compressed_momentum.FrozenNu)
    is_cm = lambda x: isinstance(x, rr.CompressedMomentumState)
    residual_format = run.config.compression.get("residual_format", "") or None
    warmup = rr.compressed_momentum.warmup_steps(
        factory.build_exchange(run.config.compression, total_steps=run.total_steps)
    )

    def redistribute(opt_state, specs, num_workers, saved_local_devices=None):
        saved = layout_plan(run.config, abstract_params, saved_local_devices)

        def nu_leaf(x, spec, like, frozen):
            if is_frozen_nu(x):  # frozen: the codes kept; warm: refused
                return rr.compressed_momentum.resize_frozen_nu(
                    x, math.prod(like.shape), num_workers, frozen=frozen
                )
            return checkpointing.mean_per_worker(x, spec, num_workers)

        def node(x, spec):
            if is_exchange(x):
                return rr.exchange.resize_workers(x, spec, saved, num_workers, new_plan=plan)
            if is_dgc(x):  # u and v decoded, averaged, encoded again
                return rr.dgc.resize_workers(
                    x, abstract_params, num_workers, residual_format=residual_format
                )
            if is_cm(x):  # its own fields: an int8 frozen v is not averaged
                if any(map(is_frozen_nu, jax.tree.leaves(x.nu, is_leaf=is_frozen_nu))):
                    frozen = warmup is not None and int(np.ravel(x.count)[0]) >= warmup
                    nu = jax.tree.map(
                        lambda n, s, p: nu_leaf(n, s, p, frozen),
                        x.nu,
                        spec.nu,
                        abstract_params,
                        is_leaf=is_frozen_nu,
                    )
                else:
                    nu = checkpointing.mean_per_worker(x.nu, spec.nu, num_workers)
                return x._replace(
                    mu=checkpointing.mean_per_worker(x.mu, spec.mu, num_workers),
                    nu=nu,
                    exchange=node(x.exchange, spec.exchange),
                )
            return checkpointing.mean_per_worker(x, spec, num_workers)

        def leaf(x):
            return is_exchange(x) or is_dgc(x) or is_cm(x)

        return jax.tree.map(node, opt_state, specs, is_leaf=leaf)

    return redistribute


def _memory_report(
    run: Run, abstract_params, compiled: jax.stages.Compiled, compile_seconds: float
) -> tuple[str, dict[str, Any]]:
    local_devices = run.local_devices
    exchange_only = factory.build_tx(
        run.config, run.steps_per_epoch, run.total_steps, local_axis=factory.local_axis(run.config)
    )
    comparison = rr.memory.MemoryComparison(
        baseline=rr.memory.model_state_bytes(abstract_params, run.baseline_tx),
        reduced=compiled_step.state_bytes(abstract_params, exchange_only, run.mesh),
    )
    variant = run.config.compression.variant
    if local_devices:
        nodes = run.config.num_workers // local_devices
        lines = [
            f"Model states per device ({nodes} nodes x {local_devices} devices, residuals "
            f"sharded over a node's devices): hierarchical {variant} vs. plain error "
            "feedback (flat)",
        ]
    else:
        lines = [f"Model states per worker: {variant} vs. plain error feedback"]
    lines.append(str(comparison))
    # Residual bytes of one device, beside the same variant's flat exchange.
    flat = rr.memory.model_state_bytes(
        abstract_params, factory.build_tx(run.config, run.steps_per_epoch, run.total_steps)
    ).residuals
    per_device = comparison.reduced.residuals
    if local_devices:
        ratio = f"flat / {flat / per_device:.2f}" if per_device else "none kept"
        lines.append(
            f"residuals per device: {per_device / 2**20:,.3f} MiB (flat {variant}: "
            f"{flat / 2**20:,.3f} MiB; {ratio})"
        )
    if run.config.compression.variant not in ("dense", "none", "ef", "dgc"):  # no groups
        grouping = factory.build_grouping(run.config.compression)
        comp = run.config.compression
        report = rr.grouping.report(
            abstract_params,
            grouping,
            comp.min_size,
            layer_stacks=factory.layer_stacks(run.config),
            residual_format=comp.get("residual_format", "") or None,
            residual_dtype=comp.residual_dtype or None,
        )
        title = "Residual groups:"
        if local_devices:
            title = f"Residual groups (whole layers; each device keeps 1/{local_devices} of each):"
        lines += ["", title, str(report)]
    buffers = _buffer_bytes(abstract_params, exchange_only, run.mesh)
    if buffers is not None:
        lines.append(
            "optimizer and residual state per parameter per worker: "
            + ", ".join(f"{name} {value:.3f} B" for name, value in buffers.items())
        )
    figures = {
        "bytes_per_parameter": buffers,
        "baseline": comparison.baseline.as_dict(),
        "reduced": comparison.reduced.as_dict(),
        "saving": comparison.saving,
        "local_devices": local_devices,
        "residual_bytes_per_device": per_device,
        "flat_residual_bytes_per_device": flat,
    }
    # What users gain is the compiled peak of the step they run, not the state bytes: the
    # executable the loop runs (compiled once), optionally beside plain EF's and the dense
    # exchange's steps (compiled for analysis).
    variant = compiled_step.variant_label(run.config)
    rows = [compiled_step.report_row(variant, compiled, per_device, compile_seconds)]
    if run.config.memory.compare_baselines:
        rows += compiled_step.memory_report(
            run.config,
            variants=tuple(v for v in ("ef", "dense") if v != variant),
            num_workers=run.mesh.size,
            task=run.task,
            steps_per_epoch=run.steps_per_epoch,
            total_steps=run.total_steps,
        ).rows
    report = compiled_step.MemoryReport(
        run.mesh.size, run.config.batch_size_per_worker, True, rows, local_devices
    )
    lines += ["", str(report)]
    figures["compiled_peak"] = report.as_dict()
    if run.remat_choice is not None:
        choice = run.remat_choice
        lines += ["", "Activation checkpointing (per worker):", choice.summary()]
        figures["remat"] = {
            "budget_bytes": choice.budget_bytes,
            "compiled_peak_bytes": choice.compiled.peak,
            "no_remat_peak_bytes": choice.no_remat.peak,
            "flops_overhead": choice.flops_overhead,
            "checkpoints": choice.plan.num_checkpoints,
            "plan": choice.plan.compact(),
        }
    return "\n".join(lines), figures


def _buffer_bytes(abstract_params, tx, mesh) -> dict[str, float] | None:
    """Bytes per parameter per worker (device) of each buffer of a compressed-momentum
    optimizer (:func:`resireduce_jax.compressed_momentum.buffer_bytes`: ``m``, ``v``, the
    residual stores) and their total; ``None`` for other optimizers."""
    # In shard_map: a hierarchical plan reads the local axis size, and a quantized frozen
    # v's warm-up slice the number of workers.
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P())
    state = jax.eval_shape(init, abstract_params)
    found = rr.compressed_momentum.buffer_bytes(state)
    if found is None:
        return None
    size = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))
    per = {name: value / size for name, value in found.items()}
    return {**per, "total": sum(per.values())}


class _StopFlag:
    """Set by SIGTERM; the loop checkpoints and stops at the next step boundary."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        del signum, frame
        self.requested = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def agreed(self, step: int) -> bool:
        """Whether to stop after ``step``: SIGTERM reached *any* process.

        Single process: checked every step. Multi-process: the processes exchange their
        flags every ``STOP_SYNC_EVERY`` steps and all stop at the same step; a process
        that stopped alone would save a checkpoint while its peers wait in the next
        step's collectives, and the run would hang.
        """
        if jax.process_count() == 1:
            return self.requested
        if step % STOP_SYNC_EVERY:
            return False
        flags = multihost_utils.process_allgather(np.asarray(self.requested))
        return bool(np.any(flags))


def _eval_fn(task: tasks.Task, mesh, axes: str | tuple[str, ...] = AXIS):
    span = task.kind == "span_qa"

    def body(params, model_state, batch):
        out = task.eval_outputs(params, model_state, batch)
        if span:
            return out
        return jax.tree.map(lambda x: lax.psum(x, axes), out)

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), P(), P(axes)),
            out_specs=P(axes) if span else P(),
        )
    )


def _local_rows(x: jax.Array) -> np.ndarray:
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def evaluate(run: Run, eval_fn, params, model_state) -> dict[str, float]:
    """Metrics over the whole eval split (all processes take part)."""
    totals: dict[str, float] = {}
    pid, pcount = jax.process_index(), jax.process_count()
    for batch in run.dataset.eval_batches(run.global_batch, pid, pcount):
        device_batch = rr.parallel.shard_batch(batch, run.mesh, run.worker_axes)
        out = eval_fn(params, model_state, device_batch)
        if run.task.kind == "span_qa":
            start, end = _local_rows(out["start_logits"]), _local_rows(out["end_logits"])
            sums = run.dataset.squad_metrics(start, end, batch)
        else:
            sums = {k: float(v) for k, v in jax.device_get(out).items()}
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    if run.task.kind == "span_qa" and pcount > 1:
        keys = sorted(totals)
        gathered = multihost_utils.process_allgather(np.array([totals[k] for k in keys]))
        totals = dict(zip(keys, np.asarray(gathered).sum(0).tolist(), strict=True))
    return tasks.Task.summarize(run.task.kind, totals)


def _nonfinite_cause(params, index: int) -> str:
    """What ``SkipNonFiniteState.bad_leaf`` names: a leaf's gradient, or the loss."""
    if index == rr.nonfinite.LOSS:
        return "the loss"
    paths = rr.tree_paths.leaf_paths(params)
    return f"the gradient of '{paths[index]}'" if 0 <= index < len(paths) else f"leaf #{index}"


def params_digest(params) -> str:
    """SHA-256 of this process's first local replica of every parameter (hex)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        shard = min(leaf.addressable_shards, key=lambda s: s.device.id)
        h.update(np.ascontiguousarray(np.asarray(shard.data)).tobytes())
    return h.hexdigest()


def _phase_of(phases: list, count: int) -> int | None:
    """The density phase of the exchange at ``count`` (``None``: a schedule of one phase,
    compiled as it is)."""
    return rr.compressors.schedule.phase_at(phases, count) if len(phases) > 1 else None


def _phase_note(phases: list, report_phase: int, *, planned: bool) -> str:
    """What the memory report's compiled step is, for a run of several density phases:
    the program of the phase the run starts in (each other phase's is compiled when its
    first step comes, and its peak printed then), and where the others' peaks are."""
    names = [
        memory_plan.phase_name(i, p.compressor) + f" from step {p.start}"
        for i, p in enumerate(phases)
    ]
    note = (
        f"Density schedule: {len(phases)} phases, one program each ({', '.join(names)}); "
        f"the peaks above are of the phase this run starts in, {names[report_phase]}; "
        "each later phase's peak is printed when its program is compiled, at its first step."
    )
    if planned:
        note += (
            f" memory.budget planned every phase: {memory_plan.PLAN_FILE}'s chosen row has "
            "the largest peak over them (peak_bytes) and its phase (peak_phase)."
        )
    else:
        note += (
            " The others may peak higher (measured: benchmarks/results/density_schedule.md); "
            "--plan_only with memory.budget compiles every phase."
        )
    return note


def _print_phase_peak(phases: list, phase: int, executable) -> None:
    """Prints the compiled peak of a density phase's program, compiled at its first step."""
    peak = rr.hlo.peak_memory(executable).peak
    name = memory_plan.phase_name(phase, phases[phase].compressor)
    print(
        f"Density phase {name}: its program compiled, peak {peak / 2**20:,.2f} MiB per device.",
        flush=True,
    )


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, *, halt_after_step: int | None = None
) -> RunSummary:
    """Trains and evaluates one experiment; resumes from ``workdir`` if it has checkpoints.

    ``halt_after_step`` stops after that step exactly as SIGTERM does (checkpoint, then
    return with ``preempted=True``): for jobs run in chunks, and for resumption tests.

    Returns:
      A :class:`RunSummary` with the final step, last eval and train metrics, the number
      of skipped (non-finite) steps, whether SIGTERM stopped the run, and the memory report.
    """
    check_config(config)  # before anything is written to the workdir
    compiled_step.use_compilation_cache(config, workdir)
    remat = None
    if config.memory.budget is not None:  # the fastest configuration that fits, first
        config, remat = memory_plan.plan_for_training(config, workdir)
    run = build_run(config, remat)
    is_main = jax.process_index() == 0
    os.makedirs(workdir, exist_ok=True)
    if is_main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))

    # ------------------------------------------------------------ initial state
    state = initial_state(run)
    params, opt_state, model_state, step_fn = (
        state.params,
        state.opt_state,
        state.model_state,
        state.step_fn,
    )
    eval_fn = _eval_fn(run.task, run.mesh, run.worker_axes)

    checkpointer = checkpointing.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        keep=config.keep_checkpoints,
        num_workers=config.num_workers,
        on_worker_change=config.on_worker_change,
        local_devices=run.local_devices,
    )
    start = 0
    latest = checkpointer.latest_step()
    if latest is not None:
        restored = checkpointer.restore(
            latest,
            {"params": params, "opt_state": opt_state, "model_state": model_state},
            step_fn.state_specs,
            run.mesh,
            redistribute=worker_redistribution(run, state.abstract_params),
        )
        params, opt_state, model_state = (
            restored["params"],
            restored["opt_state"],
            restored["model_state"],
        )
        start = latest
        if is_main:
            print(f"Resumed from checkpoint at step {latest} in {workdir}.", flush=True)

    # The step is compiled once, for the state it starts from: the memory report reads
    # the executable the loop then runs. With a density schedule, each phase has its own
    # program: the report's is the phase the run starts in, and every other phase is
    # compiled when its first step comes (a short or resumed run compiles only the phases
    # it runs).
    phases = factory.density_phases(config, run.total_steps)
    skipped_seen = int(jax.device_get(opt_state.skipped))
    report_phase = _phase_of(phases, start - skipped_seen)
    base_key = jax.random.PRNGKey(config.seed + 1)
    pid, pcount = jax.process_index(), jax.process_count()
    first_batch = rr.parallel.shard_batch(
        run.dataset.train_batch(start, run.global_batch, pid, pcount), run.mesh, run.worker_axes
    )
    started = time.perf_counter()
    compiled = step_fn.compile(
        params,
        opt_state,
        model_state,
        first_batch,
        jax.random.fold_in(base_key, start),
        density_phase=report_phase,
    )
    report, memory_figures = _memory_report(
        run, state.abstract_params, compiled, time.perf_counter() - started
    )
    if len(phases) > 1:
        note = _phase_note(phases, report_phase, planned=config.memory.budget is not None)
        report += "\n" + note
        memory_figures["compiled_peak"]["density_phase"] = report_phase
        memory_figures["compiled_peak"]["density_phases"] = len(phases)
    if is_main:
        print(report, flush=True)

    def save(step: int, wait: bool = False) -> None:
        state = {"params": params, "opt_state": opt_state, "model_state": model_state}
        checkpointer.save(step, state, step_fn.state_specs, wait=wait)

    # ------------------------------------------------------------ training
    writer = metrics_lib.MetricWriter(workdir, enabled=is_main)
    progress = metrics_lib.Progress(start, run.total_steps, enabled=is_main)
    analysis = residual_analysis.Recorder.from_config(
        config.residual_analysis,
        workdir,
        is_main,
        grouping=factory.build_grouping(config.compression),
        phi=config.compression.phi,
    )
    stop = _StopFlag()
    stop.install()
    raise_on_nonfinite = config.compression.nonfinite == "raise"
    last_train: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    # One compiled step per phase of the density schedule, each run in its steps. The
    # schedule runs on the exchange's count, which a skipped step does not advance: the
    # phase is that of step - skipped, and the skips are read (a sync) only at a step
    # where they could hold the phase back.
    skips_known = skipped_seen
    phase = _phase_of(phases, start - skips_known)
    compiled_phases = {report_phase}
    step = start
    preempted = False
    try:
        while step < run.total_steps:
            batch = rr.parallel.shard_batch(
                run.dataset.train_batch(step, run.global_batch, pid, pcount),
                run.mesh,
                run.worker_axes,
            )
            rng = jax.random.fold_in(base_key, step)
            if _phase_of(phases, step - skips_known) != phase:
                skips_known = int(jax.device_get(opt_state.skipped))
                phase = _phase_of(phases, step - skips_known)
                if phase not in compiled_phases:
                    compiled_phases.add(phase)
                    executable = step_fn.compile(
                        params, opt_state, model_state, batch, rng, density_phase=phase
                    )
                    if is_main:
                        _print_phase_peak(phases, phase, executable)
            params, opt_state, model_state, step_metrics = step_fn(
                params, opt_state, model_state, batch, rng, density_phase=phase
            )
            step += 1
            for callback in STEP_CALLBACKS:
                callback(step)
            if raise_on_nonfinite and bool(jax.device_get(opt_state.last_skipped)):
                bad = int(jax.device_get(opt_state.bad_leaf))
                raise NonFiniteGradients(
                    f"Non-finite value at step {step - 1} in {_nonfinite_cause(params, bad)} "
                    "(on at least one worker); the step was not applied. Lower the learning "
                    "rate, check the data, or set --config.compression.nonfinite=skip to skip "
                    "such steps."
                )
            if step % config.log_every == 0 or step == run.total_steps:
                last_train = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
                skipped = int(jax.device_get(opt_state.skipped))
                if skipped > skipped_seen and is_main:
                    bad = int(jax.device_get(opt_state.bad_leaf))
                    log.warning(
                        "%d step(s) skipped for non-finite values up to step %d (the last in %s).",
                        skipped - skipped_seen,
                        step,
                        _nonfinite_cause(params, bad),
                    )
                skipped_seen = skipped
                writer.write(step, "train", {**last_train, "skipped_steps": skipped})
                progress.update(step, loss=f"{last_train['loss']:.4f}")
            if analysis.due(step, run.total_steps):
                analysis.record(step, opt_state, exchange_plan(run, state.abstract_params))
            if step % config.eval_every == 0 or step == run.total_steps:
                last_eval = evaluate(run, eval_fn, params, model_state)
                writer.write(step, "eval", last_eval)
            if step % config.checkpoint_every == 0 or step == run.total_steps:
                save(step)
            halt = halt_after_step is not None and step >= halt_after_step
            if stop.agreed(step) or halt:
                preempted = True
                if step % config.checkpoint_every != 0 and step != run.total_steps:
                    save(step)
                if is_main:
                    print(f"Stopping: checkpointed step {step}.", flush=True)
                break
    finally:
        stop.restore()
        progress.close()
        checkpointer.close()
        writer.close()
    analysis.finish()
    if step == start == run.total_steps:  # a finished run started again: nothing to train
        if is_main:
            print(
                f"The run in {workdir} was already complete at step {step}; evaluating its "
                "final checkpoint.",
                flush=True,
            )
        last_eval = evaluate(run, eval_fn, params, model_state)
        last_train = _last_train_metrics(workdir, step)
    digest = params_digest(params)
    if jax.process_count() > 1:  # every process must hold the very same replica
        multihost_utils.assert_equal(
            np.frombuffer(bytes.fromhex(digest), np.uint8),
            "Parameter replicas differ between processes at the end of training.",
        )
    summary = RunSummary(
        step=step,
        eval=last_eval,
        train=last_train,
        skipped_steps=int(jax.device_get(opt_state.skipped)),
        preempted=preempted,
        memory=memory_figures,
        params_digest=digest,
        communication=communication_summary(run, state.abstract_params, step),
    )
    print(f"Process {jax.process_index()}: params sha256 {digest}", flush=True)
    if is_main:
        with open(os.path.join(workdir, SUMMARY_FILE), "w") as f:
            json.dump(dataclasses.asdict(summary), f, indent=2)
    if is_main and not preempted:
        print("Final eval: " + ", ".join(f"{k}={v:.4f}" for k, v in last_eval.items()), flush=True)
        print(_bytes_line(summary.communication), flush=True)
        print(_wire_line(summary.communication), flush=True)
    return summary


def _last_train_metrics(workdir: str, step: int) -> dict[str, float]:
    """The training metrics ``metrics.jsonl`` logged last, up to ``step`` ({} if none)."""
    try:
        records = metrics_lib.read_metrics(workdir)
    except OSError:
        return {}
    train = [r for r in records if r["split"] == "train" and r["step"] <= step]
    if not train:
        return {}
    return {k: v for k, v in train[-1].items() if k not in ("step", "split", "skipped_steps")}


def communication_summary(run: Run, abstract_params, steps: int) -> dict[str, Any]:
    """What one worker sent in the first ``steps`` steps, beside a dense exchange's bytes.

    Exact payload bytes from the compressors (``ExchangeTransformation.bytes_sent``): every
    phase of the density schedule at its own size, dense leaves all-reduced in their dtype.
    A hierarchical run counts one device's payload across nodes. Steps skipped for
    non-finite values still exchange and are counted at the phase of their step number.

    ``bytes_sent_per_worker`` is each worker's own payload. What the network carries is
    ``wire_bytes_per_worker`` (``ExchangeTransformation.wire_bytes``: an all-gathered
    payload reaches every other worker, an all-reduced one costs ``2 (N - 1) / N`` of it),
    beside a dense ring all-reduce's, and ``crossover_workers``: the fewest workers at which
    the run's exchange, flat, would carry more than the dense all-reduce (``None``: never).
    A hierarchical run adds both across nodes and its own crossover, a multiple of
    ``local_devices``.
    """
    local = run.local_devices
    compression = run.config.compression
    exchange = factory.build_exchange(
        compression, local_axis=factory.local_axis(run.config), total_steps=run.total_steps
    )
    sent = exchange.bytes_sent(abstract_params, steps, local_size=local or 1)
    dense = rr.exchange.dense_bytes(abstract_params) * steps
    workers = run.config.num_workers
    wire = exchange.wire_bytes(abstract_params, steps, workers, local_size=local or 1)
    flat = exchange
    if local:
        flat = factory.build_exchange(compression, total_steps=run.total_steps)
    summary = {
        "steps": steps,
        "bytes_sent_per_worker": sent,
        "dense_bytes_per_worker": dense,
        "sent_over_dense": sent / dense if dense else 0.0,
        "num_workers": workers,
        "wire_bytes_per_worker": wire.exchange,
        "dense_wire_bytes_per_worker": wire.dense,
        "crossover_workers": flat.crossover_workers(abstract_params, steps),
    }
    if local:
        summary["local_devices"] = local
        summary["wire_bytes_across_nodes_per_worker"] = wire.exchange_across_nodes
        summary["dense_wire_bytes_across_nodes_per_worker"] = wire.dense_across_nodes
        summary["crossover_workers_hierarchical"] = exchange.crossover_workers(
            abstract_params, steps, local_size=local
        )
    return summary


def _bytes_line(c: dict[str, Any]) -> str:
    return (
        f"Sent per worker over {c['steps']} steps: {c['bytes_sent_per_worker'] / 2**20:,.2f} "
        f"MiB, {100 * c['sent_over_dense']:.2f} % of a dense exchange "
        f"({c['dense_bytes_per_worker'] / 2**20:,.2f} MiB)."
    )


def _wire_line(c: dict[str, Any]) -> str:
    """One line: what the network carries per worker against a dense all-reduce."""
    part = "_across_nodes" if "local_devices" in c else ""
    wire, dense = c[f"wire_bytes{part}_per_worker"], c[f"dense_wire_bytes{part}_per_worker"]
    crossover = c["crossover_workers_hierarchical" if part else "crossover_workers"]
    beyond = "never" if crossover is None else f"from {crossover} workers on"
    return (
        f"On the wire{part.replace('_', ' ')} per worker ({c['num_workers']} workers): "
        f"{wire / 2**20:,.2f} MiB against {dense / 2**20:,.2f} MiB for a dense all-reduce; "
        f"more than dense {beyond}."
    )


def final_state(workdir: str, step: int | None = None) -> dict[str, Any]:
    """Loads a run's checkpoint (default: the newest complete one) as numpy arrays.

    For tests and analysis. Works in any process layout: checkpoints written by several
    processes (whose devices this process does not have) are read onto one local device.
    """
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    registry = checkpointing.handler_registry(
        ocp.StandardCheckpointHandler(), ocp.args.StandardSave, ocp.args.StandardRestore
    )
    manager = ocp.CheckpointManager(directory, handler_registry=registry)
    try:
        if step is None:
            step = checkpointing.latest_complete_step(directory, manager.all_steps())
        if step is None:
            raise FileNotFoundError(f"No complete checkpoint in {directory}.")
        local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=local),
            manager.item_metadata(step)["state"],
        )
        restored = manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        )
    finally:
        manager.close()
    return jax.tree.map(np.asarray, restored["state"])
