"""The training program's train step, compiled from abstract shapes: its per-worker peak.

compile_step builds what train.train runs and compiles it from shapes: nothing is run.
memory_report compiles the variant beside plain error feedback and dense exchange.
It returns the per-worker peaks (argument + output - alias + temp) and a text table.
With config.local_devices the mesh is nodes x devices and every figure is per device.
Variants use the config's names, plus a +bf16 suffix for bfloat16 residuals.
Details: docs/design.md, "The compiled step (train/compiled_step.py)".
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import resireduce_jax as rr
from resireduce_jax import models
from train import config_schema, factory, tasks

__all__ = [
    "ANALYSIS_OPTIONS",
    "AXIS",
    "AbstractStep",
    "CompiledStep",
    "MemoryReport",
    "StepState",
    "abstract_batch",
    "abstract_step",
    "argument_bytes",
    "build_mesh",
    "build_step",
    "build_task",
    "build_train_tx",
    "compile_step",
    "dataset_kind",
    "memory_report",
    "report_row",
    "state_bytes",
    "use_compilation_cache",
    "variant_label",
    "with_variant",
    "worker_axes",
]

AXIS = "data"  # train.train.AXIS
# compile_step(density_phase=SWITCH_PHASES): no static phase, the exchange's lax.switch.
SWITCH_PHASES = "switch"
_SUFFIX_OF_DTYPE = {dtype: s for s, dtype in config_schema.RESIDUAL_DTYPE_SUFFIXES.items()}
KiB = 2**10
MiB = 2**20


def with_variant(
    config: ml_collections.ConfigDict, variant: str | None
) -> ml_collections.ConfigDict:
    """A copy of ``config`` whose compression is ``variant``: ``"w+2d+bf16"`` stores its
    residuals in bfloat16, ``"ef+f8"`` in float8 (e4m3, a cast), ``"ef+int4"`` in the
    residual format ``int4``, ``"w+2d"`` or ``"ef"`` in the gradients' dtype, whatever the
    config's ``residual_dtype`` and ``residual_format`` (``None``: the config as it is)."""
    config = config.copy_and_resolve_references()
    if variant is None:
        return config
    variant, residual_dtype, residual_format = config_schema.split_variant(variant)
    with config.unlocked():
        config.compression.residual_dtype = residual_dtype
        config.compression.residual_format = residual_format
        config.compression.variant = variant
        if variant != "ef" and config.optimizer.get("one_buffer", "off") == "on":
            config.optimizer.one_buffer = "auto"  # shared and 2-D stores keep two buffers
    return config


def variant_label(config: ml_collections.ConfigDict) -> str:
    """``compression.variant`` with ``+bf16`` / ``+f8`` when its residuals are cast to
    bfloat16 / float8, or ``+<format>`` for a ``residual_format``."""
    comp = config.compression
    if comp.variant in ("dense", "none"):
        return comp.variant
    if comp.get("residual_format", ""):
        return f"{comp.variant}+{comp.residual_format}"
    return comp.variant + _SUFFIX_OF_DTYPE.get(comp.residual_dtype, "")


def worker_axes(config: ml_collections.ConfigDict) -> str | tuple[str, str]:
    """The mesh axes the workers span: ``"data"``, or ``("data", "local")`` with
    ``local_devices`` (batch, per-worker state and the non-finite decision span both)."""
    if config_schema.local_devices(config):
        return (AXIS, rr.parallel.LOCAL_AXIS)
    return AXIS


def build_mesh(config: ml_collections.ConfigDict, num_workers: int | None = None):
    """The run's mesh: ``num_workers`` (default the config's) devices, flat or, with
    ``local_devices``, nodes × devices per node (:func:`resireduce_jax.parallel.make_mesh`)."""
    return rr.parallel.make_mesh(
        num_workers or config.num_workers, AXIS, config_schema.local_devices(config)
    )


def build_train_tx(
    config: ml_collections.ConfigDict,
    steps_per_epoch: float,
    total_steps: int,
    *,
    guard: bool = True,
) -> optax.GradientTransformation:
    """The chain a run trains with: ``build_tx``, inside ``skip_nonfinite`` when guarded.

    Hierarchical (``local_devices``): the exchange over the local axis, and the guard
    decides over every device (both worker axes).
    """
    tx = factory.build_tx(
        config, steps_per_epoch, total_steps, local_axis=factory.local_axis(config)
    )
    if not guard:
        return tx
    return rr.skip_nonfinite(tx, worker_axes(config), mode=config.compression.guard_mode)


def state_bytes(params, tx: optax.GradientTransformation, mesh) -> rr.memory.ModelStateBytes:
    """:func:`resireduce_jax.memory.model_state_bytes` of one device of ``mesh``.

    A hierarchical exchange's state depends on the local axis size, and a quantized
    frozen v's warm-up slice (compressed_momentum_adam) on the number of workers, known
    inside ``shard_map`` only: ``tx.init`` is traced there (shapes only), so sharded
    residuals count ``1/L`` per device.
    """
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P())
    return rr.memory.model_state_bytes(params, optax.GradientTransformation(init, tx.update))


def build_step(
    task: tasks.Task,
    tx: optax.GradientTransformation,
    mesh,
    weight_update_order: str = "last_read",
    backward_order: str = "streamed",
):
    """The donated data-parallel step of the training program (not yet initialized).

    ``weight_update_order``, ``backward_order``: see
    :func:`resireduce_jax.parallel.data_parallel_step`.
    """
    return rr.parallel.data_parallel_step(
        task.loss,
        tx,
        mesh,
        axis_name=AXIS,
        has_aux=True,
        with_model_state=True,
        with_rng=True,
        weight_update_order=weight_update_order,
        backward_order=backward_order,
    )


def build_task(config: ml_collections.ConfigDict) -> tasks.Task:
    """The config's zoo model (with ``model.overrides``) on its kind of dataset."""
    model_config = models.get_config(config.model.name, **config_schema.model_overrides(config))
    return tasks.make_task(model_config.build(), model_config, dataset_kind(model_config))


def dataset_kind(model_config) -> str:
    """The dataset task (``input_pipeline`` vocabulary) a zoo model trains on."""
    return {"classification": "classification", "causal_lm": "language_modeling"}.get(
        model_config.task, "span_qa"
    )


def abstract_batch(model_config, kind: str, rows: int, seq_len: int = 0) -> dict[str, Any]:
    """A batch of ``rows`` of a dataset of ``kind`` as ``ShapeDtypeStruct``s (no data).

    ``seq_len`` is the tokens per sequence of language models (default: the model's).
    """
    if kind == "language_modeling":
        seq_len = seq_len or model_config.sequence_length
        return {"tokens": jax.ShapeDtypeStruct((rows, seq_len + 1), jnp.int32)}
    if seq_len and kind == "span_qa":
        model_config = dataclasses.replace(model_config, seq_len=seq_len)
    return dict(model_config.example_batch(rows))


ANALYSIS_OPTIONS: dict[str, Any] = rr.runtime.ANALYSIS_OPTIONS
"""XLA options of a step compiled only to be measured (the planner, the memory reports).

The level of LLVM's optimization of the generated code: XLA's HLO passes, scheduling and
buffer assignment are the same, so ``memory_analysis()`` and ``cost_analysis()`` are
identical to the optimized program's, and the compilation takes about a third less time
(docs/design.md, "Compiling for analysis"). Never run such a program: its code is slow.
"""


@dataclasses.dataclass(frozen=True)
class StepState:
    """The optimizer chain and its abstract state: the same for every batch and every
    checkpointing of one config's model (they depend on the parameters only)."""

    tx: optax.GradientTransformation
    specs: Any
    opt_state: Any
    residual_bytes: int


@dataclasses.dataclass
class AbstractStep:
    """The program's train step with its arguments as ``jax.ShapeDtypeStruct``s.

    ``args`` are ``(params, opt_state, model_state, batch, rng)`` with the shardings of a
    run; nothing is allocated. :meth:`compile` compiles the step.
    """

    step: rr.parallel.DataParallelStep
    tx: optax.GradientTransformation
    mesh: Any
    params: Any  # abstract, unsharded: the layout the state is planned for
    args: tuple[Any, ...]
    variant: str
    residuals: int | None = None  # residual_bytes, when known already
    density_phase: int | None = None  # the schedule's phase compiled (None: all, switched)

    @property
    def residual_bytes(self) -> int:
        """Error-feedback residuals one device keeps (a hierarchical run: its shards)."""
        if self.residuals is None:
            self.residuals = state_bytes(self.params, self.tx, self.mesh).residuals
        return self.residuals

    @property
    def state(self) -> StepState:
        """What another step of this config and model reuses (see :func:`abstract_step`)."""
        return StepState(self.tx, self.step.state_specs, self.args[1], self.residual_bytes)

    def compile(self, compiler_options: dict[str, Any] | None = ANALYSIS_OPTIONS) -> CompiledStep:
        """Compiles the step (``compiler_options``: :data:`ANALYSIS_OPTIONS` by default)."""
        start = time.perf_counter()
        compiled = self.step.lower(*self.args, density_phase=self.density_phase).compile(
            compiler_options
        )
        seconds = time.perf_counter() - start
        return CompiledStep(compiled, self.params, self.tx, seconds, self.variant, self.mesh)


@dataclasses.dataclass
class CompiledStep:
    """A compiled train step, the abstract params it was built for and its chain."""

    compiled: Any
    params: Any
    tx: optax.GradientTransformation
    compile_seconds: float
    variant: str = ""
    mesh: Any = None

    @property
    def peak(self) -> rr.hlo.PeakMemory:
        return rr.hlo.peak_memory(self.compiled)


def _on(sharding, tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def abstract_step(
    config: ml_collections.ConfigDict,
    *,
    variant: str | None = None,
    guard: bool = True,
    batch_per_worker: int | None = None,
    seq_len: int = 0,
    num_workers: int | None = None,
    steps_per_epoch: float = 100.0,
    total_steps: int = 1000,
    task: tasks.Task | None = None,
    density_phase: int | str | None = None,
    state: StepState | None = None,
) -> AbstractStep:
    """The donated data-parallel train step of ``config`` with residual ``variant``.

    Everything is abstract: parameters, optimizer state, model state and batch are
    ``jax.ShapeDtypeStruct``s with the shardings the training program uses. Defaults come
    from the config (``compression.variant``, ``batch_size_per_worker``, ``num_workers``);
    ``task`` replaces the one built from ``model`` (e.g. a run's rematerialized model).
    ``density_phase``: the phase of ``compression.density_schedule`` to compile (the
    training program compiles one step per phase); default the last, the steady state;
    :data:`SWITCH_PHASES`: one program that switches between the phases at run time.
    ``state``: :attr:`AbstractStep.state` of an earlier call with the same config and
    model parameters, instead of tracing an update again
    (:func:`resireduce_jax.parallel.abstract_state`).
    """
    config, batch_per_worker, num_workers, task = _resolved(
        config, variant, batch_per_worker, num_workers, task
    )
    mesh = build_mesh(config, num_workers)
    axes = worker_axes(config)
    replicated = NamedSharding(mesh, P())
    batch, params, variables = _abstract_inputs(task, num_workers, batch_per_worker, seq_len)
    residuals = None
    if state is None:
        tx = build_train_tx(config, steps_per_epoch, total_steps, guard=guard)
        specs, opt_state = rr.parallel.abstract_state(tx, params, mesh, axes)
    else:
        tx, specs, opt_state, residuals = (
            state.tx,
            state.specs,
            state.opt_state,
            state.residual_bytes,
        )
    step = build_step(task, tx, mesh, config.weight_update_order)
    step.state_specs = specs
    args = (
        _on(replicated, params),
        opt_state,
        _on(replicated, variables),
        _on(NamedSharding(mesh, P(axes)), batch),
        jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated),
    )
    phases = len(factory.density_phases(config, total_steps))
    if phases == 1 or density_phase == SWITCH_PHASES:
        phase = None
    else:
        phase = phases - 1 if density_phase is None else density_phase
    return AbstractStep(step, tx, mesh, params, args, variant_label(config), residuals, phase)


def _resolved(config, variant, batch_per_worker, num_workers, task):
    """The config with ``variant``, and the batch, workers and task it defaults to."""
    config = with_variant(config, variant)
    return (
        config,
        batch_per_worker or config.batch_size_per_worker,
        num_workers or config.num_workers,
        task or build_task(config),
    )


def _abstract_inputs(task: tasks.Task, num_workers: int, batch_per_worker: int, seq_len: int):
    """The global batch, the params and the other model variables, as shapes."""
    kind = {v: k for k, v in tasks.DATASET_TASK.items()}[task.kind]
    batch = abstract_batch(task.model_config, kind, num_workers * batch_per_worker, seq_len)
    per_worker = {
        k: jax.ShapeDtypeStruct((batch_per_worker, *v.shape[1:]), v.dtype) for k, v in batch.items()
    }
    variables = dict(jax.eval_shape(task.init, jax.random.PRNGKey(0), per_worker))
    params = variables.pop("params")
    return batch, params, variables


def argument_bytes(
    config: ml_collections.ConfigDict,
    *,
    variant: str | None = None,
    guard: bool = True,
    batch_per_worker: int | None = None,
    seq_len: int = 0,
    num_workers: int | None = None,
    task: tasks.Task | None = None,
) -> dict[str, int]:
    """What one device holds of the step's arguments before it computes anything, by part.

    ``params``, ``optimizer state`` (the exchange's other state included), ``residuals``,
    ``model state`` and ``batch``. Left out are the scalars (step counts, the guard's
    flags) and the 8-byte PRNG key: JAX drops an argument the step does not read, and a
    scalar may be only written. Every other one stays allocated until the step returns,
    so their sum bounds the compiled peak from below. From shapes alone: nothing is traced
    beyond the model's and the optimizer's ``init``. Arguments as for
    :func:`abstract_step`.
    """
    config, batch_per_worker, num_workers, task = _resolved(
        config, variant, batch_per_worker, num_workers, task
    )
    batch, params, variables = _abstract_inputs(task, num_workers, batch_per_worker, seq_len)
    tx = build_train_tx(config, 100.0, 1000, guard=guard)
    states = state_bytes(params, tx, build_mesh(config, num_workers))
    tree_bytes = rr.memory.tree_bytes
    scalars = [x for x in jax.tree.leaves(jax.eval_shape(tx.init, params)) if not x.shape]
    return {
        "params": tree_bytes(params),
        "optimizer state": states.optimizer + states.compressor - tree_bytes(scalars),
        "residuals": states.residuals,
        "model state": tree_bytes(variables),
        "batch": tree_bytes(batch) // num_workers,
    }


def compile_step(
    config: ml_collections.ConfigDict,
    *,
    compiler_options: dict[str, Any] | None = ANALYSIS_OPTIONS,
    **kwargs: Any,
) -> CompiledStep:
    """Compiles :func:`abstract_step` (same arguments) to be measured.

    ``compiler_options``: :data:`ANALYSIS_OPTIONS` by default (the figures of the optimized
    program, a third less compile time, code not to be run); ``None`` for XLA's defaults.
    """
    return abstract_step(config, **kwargs).compile(compiler_options)


@dataclasses.dataclass
class MemoryReport:
    """Compiled per-worker peaks of the trained step, optionally beside plain EF and dense.

    With ``local_devices`` (hierarchical) a worker is one device of a node; ``residuals``
    are then one device's shards.
    """

    num_workers: int
    batch_per_worker: int
    guard: bool
    rows: list[dict[str, Any]]  # variant, peak, temp, argument, output, alias, residuals
    local_devices: int | None = None

    def row(self, variant: str) -> dict[str, Any]:
        return next(r for r in self.rows if r["variant"] == variant)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self) -> str:
        ef = next((r["peak"] for r in self.rows if r["variant"] == "ef"), None)
        layout = f"{self.num_workers} workers"
        if self.local_devices:
            nodes = self.num_workers // self.local_devices
            layout += f" as {nodes} nodes x {self.local_devices} devices, hierarchical exchange"
        # KiB where one decimal of MiB would show a stored figure as zero (a small model).
        tiny = any(0 < r[k] < MiB / 20 for r in self.rows for k in ("peak", "temp", "residuals"))
        size, name = (KiB, "KiB") if tiny else (MiB, "MiB")
        header = (
            f"  {'variant':<12s} {'peak ' + name:>10s} {'temp ' + name:>10s} "
            f"{'residuals ' + name:>14s}"
        )
        lines = [
            f"Compiled train step per worker ({layout}, "
            f"{self.batch_per_worker} per worker, skip_nonfinite {'on' if self.guard else 'off'}"
            "; peak = argument + output - alias + temp):",
            header + ("" if ef is None else f" {'peak - EF':>10s}"),
        ]
        for r in self.rows:
            line = (
                f"  {r['variant']:<12s} {r['peak'] / size:10.1f} {r['temp'] / size:10.1f} "
                f"{r['residuals'] / size:14.1f}"
            )
            lines.append(line + ("" if ef is None else f" {(r['peak'] - ef) / size:+10.1f}"))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def report_row(variant: str, compiled: Any, residuals: int, seconds: float) -> dict[str, Any]:
    """One :class:`MemoryReport` row: the peak's parts read off a compiled step."""
    return {
        "variant": variant,
        **rr.hlo.peak_memory(compiled).as_dict(),
        "residuals": residuals,
        "compile_seconds": seconds,
    }


def memory_report(
    config: ml_collections.ConfigDict,
    batch_per_worker: int | None = None,
    *,
    variants: tuple[str, ...] | None = None,
    seq_len: int = 0,
    num_workers: int | None = None,
    guard: bool = True,
    task: tasks.Task | None = None,
    steps_per_epoch: float = 100.0,
    total_steps: int = 1000,
) -> MemoryReport:
    """The compiled per-worker peaks of ``variants`` of the config's step.

    ``variants``: default the configured one beside ``ef`` and ``dense`` (each distinct
    variant compiled once, for analysis; see :func:`compile_step`).
    """
    batch_per_worker = batch_per_worker or config.batch_size_per_worker
    num_workers = num_workers or config.num_workers
    if variants is None:
        variants = (variant_label(config), "ef", "dense")
    rows = []
    for variant in dict.fromkeys(variants):
        abstract = abstract_step(
            config,
            variant=variant,
            guard=guard,
            batch_per_worker=batch_per_worker,
            seq_len=seq_len,
            num_workers=num_workers,
            steps_per_epoch=steps_per_epoch,
            total_steps=total_steps,
            task=task,
        )
        step = abstract.compile()
        rows.append(
            report_row(variant, step.compiled, abstract.residual_bytes, step.compile_seconds)
        )
        del step
    return MemoryReport(
        num_workers, batch_per_worker, guard, rows, config_schema.local_devices(config)
    )


def use_compilation_cache(config: ml_collections.ConfigDict, workdir: str) -> str | None:
    """Points JAX's persistent compilation cache at ``config.compilation_cache_dir``.

    Unset: the directory of the environment's ``JAX_COMPILATION_CACHE_DIR`` (JAX's own
    variable, e.g. one cache for every run on a machine) if it names one, else
    ``WORKDIR/compilation_cache``; ``""``: off. A later run that compiles the same
    programs (a second ``--plan_only``, a resumed run) loads them from there. Returns the
    directory, or ``None`` when off.
    """
    directory = config.get("compilation_cache_dir")
    if directory is None:
        directory = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
            workdir, "compilation_cache"
        )
    directory = os.path.abspath(directory) if directory else None
    if jax.config.jax_compilation_cache_dir != directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        compilation_cache.reset_cache()  # the cache is bound to its first directory
    return directory
