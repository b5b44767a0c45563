"""``memory.budget``: the training program's candidates for the memory planner, compiled.

resireduce_jax.planner chooses from compiled peaks but cannot build a train step.
StepCompiler compiles the program's own step, from abstract shapes, for each candidate.
Candidates: exchange (memory.exchanges: residual stores and formats), optimizer (optax's or
the R one), remat.
The rotor search compiles few plans, predicting the others from those already compiled.
With a density schedule a configuration fits only when every phase fits.
plan_for_training and plan_only (python -m train --plan_only) print the table.
The search and its pruning: docs/design.md, "Memory planning" and "The program's memory
planner (train/memory_plan.py)".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections
import tqdm

import resireduce_jax as rr
from resireduce_jax import models, planner, remat
from resireduce_jax.planner import Candidate, Compiled
from train import compiled_step, config_schema, factory, remat_model, tasks

__all__ = [
    "PLAN_FILE",
    "StepCompiler",
    "optimizer_names",
    "plan_for_training",
    "plan_only",
    "with_configured_format",
    "write_plan",
]

PLAN_FILE = "memory_plan.json"

# optimizer.name -> (optax's original, this library's memory-reduced one). The registry's
# "adamw" and "sgd" already build the library's skip-aware equivalents (bit-identical
# updates), so optax's own are named "optax.adamw" / "optax.sgd" (train/factory.py).
_PAIRS = {
    "adamw": ("optax.adamw", "adamw_r"),
    "adamw_r": ("optax.adamw", "adamw_r"),
    "sgd": ("optax.sgd", "sgd"),
    "lion": ("optax.lion", "lion_r"),
    "lion_r": ("optax.lion", "lion_r"),
}
_NO_RESIDUALS = ("dense", "none")


def optimizer_names(name: str) -> dict[str, str]:
    """``{"original": ..., "r": ...}`` config names of an ``optimizer.name``'s two versions.

    Only the versions that exist: ``adan_r`` has no optax original (``optax.adan`` is a
    different algorithm) and an optax-only optimizer (``adabelief``) no reduced version.
    """
    base = name.removeprefix(factory.OPTAX_PREFIX)
    if base in _PAIRS:
        original, reduced = _PAIRS[base]
        return {"original": original, "r": reduced}
    if name in rr.optimizers.registry.OPTIMIZERS:
        return {"r": name}
    return {"original": name}


def _no_chain_reason(model_config: Any) -> str | None:
    """Why rotor has no chain of stages to plan (``None``: a chain model), e.g. a model
    scanned over its layers (``model.scan_layers``)."""
    try:
        model_config.chain_stages()
    except ValueError as error:
        return str(error)
    return None


def with_configured_format(exchange: str, config: ml_collections.ConfigDict) -> str:
    """``exchange`` (``"ef+int4"``) with the config's block size and rounding
    (``"ef+int4/128/nearest"``) where the config keeps its residuals in the same codes and
    the exchange names no block size or rounding of its own; else ``exchange``."""
    variant, _, residual_format = config_schema.split_variant(exchange)
    configured = config.compression.get("residual_format", "") or ""
    if not residual_format or "/" in residual_format:
        return exchange
    if configured.split("/")[0] != residual_format:
        return exchange
    return f"{variant}+{configured}"


@dataclasses.dataclass
class _Chain:
    """One batch size's rotor planner and its plans (fastest first, predicted memory falling)."""

    planner: remat.ChainPlanner
    model: remat_model.SequentialModel
    front: list[remat.Solution]
    unwrapped_time: float  # the rotor model's FLOPs of the gradient without checkpoints
    unwrapped_memory: int
    seconds: float  # measuring the stages and solving the dynamic program


# (exchange, optimizer, batch per worker, plan or None, density phase or None: the last)
_Key = tuple[str, str, int, Any, int | None]


def phase_name(index: int, compressor: Any) -> str:
    """A density phase for the planner's table: ``"0 dense"``, ``"1 topk 1%"``."""
    if isinstance(compressor, rr.compressors.NoCompression):
        return f"{index} dense"
    if rr.compressors.is_dense(compressor):
        return f"{index} dense {compressor.dtype}"
    density = getattr(compressor, "density", None)
    if isinstance(density, int | float):
        return f"{index} {compressor.name} {100 * density:g}%"
    return f"{index} {compressor.name}"


class StepCompiler:
    """Compiles the training program's step for planner candidates (a ``planner.Compiler``).

    Steps are compiled for analysis (:data:`train.compiled_step.ANALYSIS_OPTIONS`: the
    optimized program's figures in a third less time) and each (candidate, batch, plan)
    once, also when several threads ask for it. With ``prune`` the compiler also gives
    the planner :meth:`peak_bound` and :meth:`predicted_peak`, and the rotor search skips
    plans predicted to exceed the budget by more than ``planner.PREDICTION_MARGIN``;
    without it every candidate is compiled (the exhaustive search).

    A run with a density schedule (``compression.density_schedule``) trains one program
    per phase (:func:`train.factory.density_phases`). :meth:`compile` and :meth:`leanest`
    compile the last phase, the steady state; :meth:`over_phases` compiles the others of
    a configuration, and :meth:`fastest_fitting` does so wherever the last phase fits: a
    configuration fits when every phase does. Each (candidate, batch, plan, phase) is
    compiled once. The bounds and predictions are the last phase's: every phase takes
    the same arguments (one optimizer state runs them all), so the bound holds for each.

    Args:
      config: the run's config (its ``compression``, ``optimizer`` and ``model``).
      num_workers: workers of the compiled mesh (default ``config.num_workers``).
      seq_len: tokens per sequence of language models (default: the model's).
      exchanges: the residual variants to try where the config keeps residuals, most
        accurate first (default: ``memory.exchanges``, else ``planner.EXCHANGES``).
      max_plan_compiles: step compilations a rotor search may spend after the
        no-checkpoint and the leanest plan.
      guard: compile with ``skip_nonfinite`` (the program always trains guarded).
      slots: memory slots of the rotor dynamic program.
      log: called with one line per compilation (e.g. ``tqdm.write``); ``None``: silent.
      prune: rule out and skip compilations from bounds and predictions.
      total_steps: the run's length, for the density schedule's phases (their number and
        compressors; the steps only place them).
    """

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        *,
        num_workers: int | None = None,
        seq_len: int = 0,
        exchanges: Sequence[str] | None = None,
        max_plan_compiles: int = 4,
        guard: bool = True,
        slots: int = 500,
        log: Callable[[str], Any] | None = None,
        prune: bool = True,
        total_steps: int = 1000,
    ):
        self.config = config.copy_and_resolve_references()
        self.total_steps = total_steps
        self.num_workers = num_workers or config.num_workers
        self.seq_len = seq_len
        self.max_plan_compiles = max_plan_compiles
        self.guard = guard
        self.slots = slots
        self.log = log
        self.prune = prune
        self.task = compiled_step.build_task(self.config)
        self.optimizers = optimizer_names(config.optimizer.name)
        own = compiled_step.variant_label(self.config)
        self.whole_model_topk = self.config.compression.get("selection_scope") == "global"
        exchanges = exchanges or self.config.memory.get("exchanges") or planner.EXCHANGES
        self.exchanges = (own,) if config.compression.variant in _NO_RESIDUALS else tuple(exchanges)
        self.remat_note = _no_chain_reason(self.task.model_config)
        self.chain_model = self.remat_note is None
        self._steps = planner.OnceMap()  # _Key -> Compiled
        self._chains = planner.OnceMap()  # batch -> _Chain
        self._states = planner.OnceMap()  # (exchange, optimizer) -> compiled_step.StepState
        self._arguments = planner.OnceMap()  # (exchange, optimizer, batch) -> bytes by part
        self._activations = planner.OnceMap()  # batch -> smallest activation between stages
        self._phases = planner.OnceMap()  # exchange -> names of the density phases

    @property
    def compilations(self) -> int:
        """Train steps compiled so far (each (candidate, batch, plan) once)."""
        return len(self._steps)

    @property
    def compile_seconds(self) -> float:
        """Wall time of those compilations and of measuring the chains for rotor."""
        steps = sum(c.compile_seconds for _, c in self._steps.items())
        return steps + sum(c.seconds for _, c in self._chains.items())

    def records(self) -> list[dict[str, Any]]:
        """One row per compiled step: what, batch, checkpoints, density phase (``None``:
        the last), peak, compile seconds."""
        return [
            {
                "exchange": exchange,
                "optimizer": optimizer,
                "batch_per_worker": batch,
                "checkpoints": None if plan is None else plan.num_checkpoints,
                "density_phase": phase,
                "peak_bytes": compiled.peak_bytes,
                "compile_seconds": compiled.compile_seconds,
            }
            for (exchange, optimizer, batch, plan, phase), compiled in self._steps.items()
        ]

    def _last_steps(self) -> list[tuple[tuple[str, str, int, Any], Compiled]]:
        """``((exchange, optimizer, batch, plan), compiled)`` of the last phase's steps
        compiled so far (what predictions and the rotor search read)."""
        return [(key[:4], c) for key, c in self._steps.items() if key[4] is None]

    def _step(self, exchange: str, optimizer: str, batch: int, plan: Any) -> Compiled | None:
        """The last phase's step of that configuration if it is compiled, else ``None``."""
        return self._steps.peek((exchange, optimizer, batch, plan, None))

    def phase_names(self, candidate: Candidate) -> tuple[str, ...]:
        """The density phases of ``candidate``'s run (:func:`phase_name`), in order; one
        name for a run without a schedule."""

        def names() -> tuple[str, ...]:
            found = factory.density_phases(self.config_for(candidate), self.total_steps)
            return tuple(phase_name(i, p.compressor) for i, p in enumerate(found))

        return self._phases.get(candidate.exchange, names)

    # ------------------------------------------------------------------ candidates

    def candidates(self) -> list[Candidate]:
        """Every exchange × optimizer × remat combination this config has."""
        remats = planner.REMATS if self.chain_model else ("none",)
        optimizers = [o for o in planner.OPTIMIZERS if o in self.optimizers]
        return planner.candidate_grid(self.exchanges, optimizers, remats)

    def config_for(self, candidate: Candidate) -> ml_collections.ConfigDict:
        """The config that trains ``candidate``'s exchange and optimizer (remat aside).

        An exchange that names only its codes (``"ef+int4"``) keeps the config's own block
        size and rounding for those codes: a config whose residuals are
        ``int4/128/nearest`` is planned, and trained, in them."""
        config = self.config.copy_and_resolve_references()
        with config.unlocked():
            config.optimizer.name = self.optimizers[candidate.optimizer]
            config.remat.budget = ""
        exchange = with_configured_format(candidate.exchange, config)
        return compiled_step.with_variant(config, exchange)

    # ------------------------------------------------------------------ the chain

    def _chain_inputs(self, batch: int):
        """The zoo model's chain, its rotor layers and abstract variables and input."""
        model_config = self.task.model_config
        (input_name,) = model_config.input_names
        kind = {v: k for k, v in tasks.DATASET_TASK.items()}[self.task.kind]
        rows = compiled_step.abstract_batch(model_config, kind, batch, self.seq_len)
        inputs = jax.eval_shape(self.task.example_inputs, rows)
        x = jax.ShapeDtypeStruct(inputs[input_name].shape, inputs[input_name].dtype)
        overrides = config_schema.free_form(self.config.model.overrides)
        chain = remat.zoo.model_chain(self.config.model.name, **overrides)
        rotor = remat.RotorSequential(chain.layers)
        model = model_config.build()
        variables = chain.chain_variables(
            jax.eval_shape(lambda k, x: model.init(k, x, train=False), jax.random.key(0), x)
        )
        rngs = {name: jax.random.key(i) for i, name in enumerate(model_config.rng_names)}
        mutable = list(model_config.mutable_collections) or False
        return input_name, chain, rotor, model, variables, x, rngs or None, mutable

    def _chain(self, batch: int) -> _Chain:
        """The rotor planner of one worker's batch (as ``remat.budget`` plans it)."""

        def measure() -> _Chain:
            start = time.perf_counter()
            input_name, chain, rotor, model, variables, x, rngs, mutable = self._chain_inputs(batch)
            chain_planner = rotor.planner(
                variables, x, rngs=rngs, mutable=mutable, slots=self.slots, train=True
            )
            time_unwrapped, unwrapped = chain_planner.predict(
                remat.Plan.unwrapped(len(chain.layers))
            )
            front, lowest = [], unwrapped
            for solution in chain_planner.candidates:  # fastest first
                if solution.plan.num_checkpoints and solution.memory < lowest:
                    front.append(solution)
                    lowest = solution.memory
            sequential = remat_model.SequentialModel(rotor, input_name, model, chain)
            seconds = time.perf_counter() - start
            return _Chain(chain_planner, sequential, front, time_unwrapped, unwrapped, seconds)

        return self._chains.get(batch, measure)

    def _smallest_activation(self, batch: int) -> int:
        """Bytes of the smallest activation between two stages of the chain (0 without one).

        The forward pass writes each of them while every argument of the step is live.
        """

        def smallest() -> int:
            if not self.chain_model:
                return 0
            _, _, rotor, _, variables, x, rngs, mutable = self._chain_inputs(batch)
            shapes = rotor.activation_shapes(variables, x, rngs=rngs, mutable=mutable, train=True)
            return min(remat.costs.tree_bytes(h) for h in shapes[1:])

        return self._activations.get(batch, smallest)

    def model_for(self, batch: int, plan: remat.Plan) -> remat_model.SequentialModel:
        """The chain model whose gradient follows ``plan`` (planned for ``batch``)."""
        model = self._chain(batch).model
        return dataclasses.replace(model, rotor=dataclasses.replace(model.rotor, plan=plan))

    def plan_of(self, row: planner.Row) -> remat.Plan | None:
        """The checkpointing plan of a table row (``None``: no checkpointing)."""
        nested = row.compiled.settings.get("remat_plan_json")
        if nested is None:
            return None
        stages = len(self._chain(row.batch_per_worker).model.chain.layers)
        return remat.Plan.from_json(nested, stages)

    def task_for(self, row: planner.Row) -> tasks.Task:
        """The task that trains a table row: the config's model, or its planned chain."""
        plan = self.plan_of(row)
        if plan is None:
            return self.task
        return dataclasses.replace(self.task, model=self.model_for(row.batch_per_worker, plan))

    # ------------------------------------------------------------------ compiling

    def _step_arguments(self, candidate: Candidate, batch: int) -> dict[str, Any]:
        """The arguments of ``candidate``'s step at ``batch`` per worker that
        :func:`compiled_step.abstract_step` and :func:`compiled_step.argument_bytes` share."""
        return dict(
            config=self.config_for(candidate),
            guard=self.guard,
            batch_per_worker=batch,
            seq_len=self.seq_len,
            num_workers=self.num_workers,
        )

    def _abstract(
        self, candidate: Candidate, batch: int, plan: remat.Plan | None, phase: int | None = None
    ):
        task = self.task
        if plan is not None:
            task = dataclasses.replace(task, model=self.model_for(batch, plan))
        pair = (candidate.exchange, candidate.optimizer)
        abstract = compiled_step.abstract_step(
            **self._step_arguments(candidate, batch),
            total_steps=self.total_steps,
            task=task,
            density_phase=phase,
            state=self._states.peek(pair),
        )
        self._states.get(pair, lambda: abstract.state)
        return abstract

    def compile(
        self,
        candidate: Candidate,
        batch: int,
        plan: remat.Plan | None,
        phase: int | None = None,
    ) -> Compiled:
        """The step of ``candidate``'s exchange and optimizer at ``batch``, under ``plan``.

        ``plan=None``: the monolithic model, no checkpointing. ``phase``: the density
        phase compiled (:meth:`phase_names`); ``None``: the last, the steady state, whose
        figures ``peak_phase`` and ``phase_peaks`` name for a run of several. Cached.
        """
        names = self.phase_names(candidate)
        if phase is not None and not 0 <= phase < len(names):
            raise ValueError(f"phase={phase}, but the run has {len(names)} density phases.")
        if phase == len(names) - 1:
            phase = None

        def compile_once() -> Compiled:
            abstract = self._abstract(candidate, batch, plan, phase)
            step = abstract.compile()
            settings: dict[str, Any] = {"remat_plan": None}
            if plan is not None:
                settings = {
                    "remat_plan": plan.compact(),
                    "remat_plan_json": plan.as_json(),
                    "checkpoints": plan.num_checkpoints,
                }
            # Per device (a hierarchical exchange keeps 1/local_devices of each residual).
            result = Compiled.from_program(
                step.compiled,
                residual_bytes=int(abstract.residual_bytes),
                compile_seconds=step.compile_seconds,
                settings=settings,
            )
            if len(names) > 1:
                name = names[-1 if phase is None else phase]
                result = dataclasses.replace(
                    result, peak_phase=name, phase_peaks=((name, result.peak_bytes),)
                )
            if self.log is not None:
                self.log(
                    f"compiled {candidate.exchange} / {candidate.optimizer} / "
                    f"{'none' if plan is None else f'{plan.num_checkpoints} checkpoints'}, batch "
                    f"{batch}"
                    + (f", density phase {result.peak_phase}" if len(names) > 1 else "")
                    + f": peak {planner.format_bytes(result.peak_bytes)} in "
                    f"{step.compile_seconds:.1f} s"
                )
            return result

        key = (candidate.exchange, candidate.optimizer, batch, plan, phase)
        return self._steps.get(key, compile_once)

    def over_phases(self, candidate: Candidate, batch: int, compiled: Compiled) -> Compiled:
        """``compiled`` (a configuration's last phase, from :meth:`compile`) with the
        other density phases of the same configuration compiled (cached):
        :meth:`planner.Compiled.with_phases`, the peak the largest over the phases.
        ``compiled`` itself for a run of one phase, or one already over every phase or
        ruled out (nothing compiled)."""
        names = self.phase_names(candidate)
        if len(names) == 1 or compiled.all_phases or compiled.settings.get("ruled_out"):
            return compiled
        nested = compiled.settings.get("remat_plan_json")
        plan = None
        if nested is not None:
            plan = remat.Plan.from_json(nested, len(self._chain(batch).model.chain.layers))
        others = [self.compile(candidate, batch, plan, i) for i in range(len(names) - 1)]
        peaks = [(n, c.peak_bytes) for n, c in zip(names[:-1], others, strict=True)]
        return compiled.with_phases([*peaks, (names[-1], compiled.peak_bytes)], others)

    def _fitting(
        self,
        candidate: Candidate,
        batch: int,
        compiled: Compiled,
        budget: int,
        every_phase: bool = True,
    ) -> Compiled:
        """``compiled`` over every phase when its last phase fits the budget (it fits when
        they all do), else as it is: a last phase over the budget needs nothing more.
        ``every_phase=False``: as it is (the last phase judges)."""
        if compiled.peak_bytes > budget or not every_phase:
            return compiled
        return self.over_phases(candidate, batch, compiled)

    # ------------------------------------------------------------------ without compiling

    def argument_bytes(self, candidate: Candidate, batch: int) -> dict[str, int]:
        """Per-device bytes of the step's arguments by part (no compilation)."""
        return self._arguments.get(
            (candidate.exchange, candidate.optimizer, batch),
            lambda: compiled_step.argument_bytes(
                **self._step_arguments(candidate, batch), task=self.task
            ),
        )

    def peak_bound(self, candidate: Candidate, batch: int) -> planner.PeakBound | None:
        """The step's arguments plus the chain's smallest activation (``None`` unpruned)."""
        if not self.prune:
            return None
        parts = dict(self.argument_bytes(candidate, batch))
        activation = self._smallest_activation(batch)
        if activation:
            parts["smallest activation"] = activation
        return planner.PeakBound(parts)

    def _leanest_plan(self, candidate: Candidate, batch: int) -> tuple[bool, remat.Plan | None]:
        """``(known, plan)``: the leanest form's plan, if the chain at ``batch`` is measured."""
        if not candidate.adaptive:
            return True, None
        chain = self._chains.peek(batch)
        if chain is None:
            return False, None
        return True, (chain.front[-1].plan if chain.front else None)

    def predicted_peak(self, candidate: Candidate, batch: int) -> planner.Prediction | None:
        """The leanest form's peak predicted from the steps compiled so far, or ``None``."""
        if not self.prune:
            return None
        known, plan = self._leanest_plan(candidate, batch)
        return self._predicted(candidate, batch, plan) if known else None

    def _shift(self, candidate: Candidate, other: tuple[str, str], batch: int, peak: float):
        """``(shift, uncertainty)``: ``candidate``'s step peak minus ``other``'s for the same
        model program at ``batch``, where ``other``'s is about ``peak``.

        A chain of differences between exchange-optimizer pairs, the least uncertain one.
        A difference is measured where two pairs are compiled with a common model program:
        it holds the exchanges' and optimizers' temporaries, and moves by well under 1 % of
        the peak from one program to another (by half of it more, from another batch).
        Else it is the difference of their arguments, uncertain by half of it (a residual
        variant's peak saving against its state saving: ``benchmarks/results/peak_memory.md``)
        and, between two optimizers, by a quarter of the peak (an optax optimizer's state
        through the guard's select: ``benchmarks/results/guard_cost.md``).

        With whole-model Top-k (``compression.selection_scope="global"``) two exchanges'
        peaks are not compared at all (uncertainty ``inf``): every member of a shared or
        2-D store is compensated into a buffer of its own that lives until the one joint
        selection, so a store's smaller residual can come with a higher peak (w+2d's above
        EF's on GPT-2 medium width: ``benchmarks/results/peak_memory_global``), and that
        excess depends on what else is alive at the exchange, so it does not carry from one
        model program to another.
        """
        pair = (candidate.exchange, candidate.optimizer)
        peaks: dict[tuple, dict[tuple, int]] = {}  # (exchange, optimizer) -> (batch, plan) -> peak
        for (e, o, b, p), compiled in self._last_steps():
            peaks.setdefault((e, o), {})[(b, p)] = compiled.peak_bytes
        arguments = {  # they differ by the states alone, whatever the batch
            q: sum(self.argument_bytes(Candidate(*q), 1).values()) for q in {pair, other, *peaks}
        }

        def step(p: tuple[str, str], q: tuple[str, str]) -> tuple[float, float]:
            if self.whole_model_topk and p[0] != q[0]:
                return 0.0, math.inf
            common = set(peaks.get(p, {})) & set(peaks.get(q, {}))
            if common:
                b, plan = min(common, key=lambda bp: bp[0] != batch)
                shift = peaks[q][(b, plan)] - peaks[p][(b, plan)]
                return shift, 0.01 * peak + (0 if b == batch else abs(shift) / 2)
            shift = arguments[q] - arguments[p]
            fraction = 0.25 if p[1] != q[1] else 0.01
            return shift, abs(shift) / 2 + fraction * peak

        # Dijkstra over the pairs, the uncertainty as the distance.
        best = {other: (0.0, 0.0)}
        done: set[tuple[str, str]] = set()
        while pair not in done:
            node = min((q for q in best if q not in done), key=lambda q: best[q][1])
            done.add(node)
            for q in arguments:
                if q in done:
                    continue
                shift, uncertainty = step(node, q)
                total = (best[node][0] + shift, best[node][1] + uncertainty)
                if q not in best or total[1] < best[q][1]:
                    best[q] = total
        return best[pair]

    def _predicted(
        self, candidate: Candidate, batch: int, plan: remat.Plan | None
    ) -> planner.Prediction | None:
        """The step peak of ``(candidate, batch, plan)`` from compiled steps, or ``None``.

        Another exchange or optimizer compiled with the same plan at this batch, shifted
        (:meth:`_shift`); without checkpointing, also every smaller batch's monolithic step
        as a low end, since peaks grow with the batch.
        """
        pair = (candidate.exchange, candidate.optimizer)
        lows, points = [], []  # points: (uncertainty, value, high, source)
        for (exchange, optimizer, b, p), compiled in self._last_steps():
            if p != plan or b > batch or (b < batch and plan is not None):
                continue
            source = f"{exchange} / {optimizer} at batch {b}"
            if (exchange, optimizer) == pair:
                if b == batch:
                    peak = compiled.peak_bytes
                    return planner.Prediction(peak, peak, peak, "its compiled program")
                lows.append(compiled.peak_bytes)
                continue
            shift, uncertainty = self._shift(
                candidate, (exchange, optimizer), batch, compiled.peak_bytes
            )
            if math.isinf(uncertainty):  # no comparable program (whole-model Top-k)
                continue
            value = compiled.peak_bytes + shift
            lows.append(value - uncertainty)
            if b == batch:
                points.append((uncertainty, value, value + uncertainty, source))
        if not lows:
            return None
        low = max(lows)
        if not points:
            return planner.Prediction(low, low, math.inf, "a smaller batch's programs")
        _, value, high, source = min(points)
        return planner.Prediction(value, min(low, value), max(high, low), source)

    def _compile_unless_over(
        self, candidate: Candidate, batch: int, plan: remat.Plan | None, budget: int
    ) -> Compiled:
        """The compiled step, or, when pruning predicts it over the budget
        (``planner.Prediction.over``), that prediction (``settings["ruled_out"]`` says so;
        nothing compiled)."""
        if self.prune and self._step(candidate.exchange, candidate.optimizer, batch, plan) is None:
            predicted = self._predicted(candidate, batch, plan)
            if predicted is not None and predicted.over(budget):
                return Compiled(
                    peak_bytes=int(predicted.value),
                    flops_overhead=None,
                    compilations=0,
                    settings={"ruled_out": predicted.describe()},
                )
        return self.compile(candidate, batch, plan)

    def _with_overhead(self, candidate: Candidate, batch: int, compiled: Compiled, **fields):
        """``compiled`` with its FLOPs over its monolithic step's.

        That step's FLOPs: compiled; else another exchange's or optimizer's monolithic
        step shifted by the difference of the two programs under this plan (the model's
        FLOPs are the same); else this program's less the recomputation that the rotor
        cost model predicts for the plan.
        """
        if compiled.settings.get("ruled_out") or compiled.settings.get("remat_plan") is None:
            return dataclasses.replace(compiled, **fields)
        chain = self._chain(batch)
        plan = remat.Plan.from_json(
            compiled.settings["remat_plan_json"], len(chain.model.chain.layers)
        )
        base = self._step(candidate.exchange, candidate.optimizer, batch, None)
        base_flops = None if base is None else base.flops
        if base_flops is None:
            for (exchange, optimizer, b, p), other in self._last_steps():
                other_base = self._step(exchange, optimizer, batch, None)
                if b == batch and p == plan and other_base is not None:
                    base_flops = other_base.flops + compiled.flops - other.flops
                    break
        if base_flops is None:
            solution = next((s for s in chain.front if s.plan == plan), None)
            if solution is not None:
                base_flops = compiled.flops - (solution.time - chain.unwrapped_time)
        overhead = None if not base_flops or base_flops <= 0 else compiled.flops / base_flops - 1
        return dataclasses.replace(compiled, flops_overhead=overhead, **fields)

    def leanest(self, candidate: Candidate, batch: int) -> Compiled:
        """No checkpointing, or for ``rotor`` the rotor plan predicting the least memory."""
        if not candidate.adaptive:
            return self.compile(candidate, batch, None)
        front = self._chain(batch).front
        if not front:
            return self.compile(candidate, batch, None)
        return self._with_overhead(candidate, batch, self.compile(candidate, batch, front[-1].plan))

    def fastest_fitting(
        self, candidate: Candidate, batch: int, budget_bytes: int, every_phase: bool = True
    ) -> Compiled:
        """The fastest configuration whose compiled step fits, else the leanest one.

        A configuration fits when its step fits in every density phase
        (:meth:`over_phases`, compiled where the last phase fits), or with
        ``every_phase=False`` when its last phase does (nothing else compiled). For ``rotor``: no
        checkpointing if that fits; otherwise the search over the chain's plans (docs/design.md,
        "The program's memory planner"; a plan whose warm-up phase does not fit counts as
        not fitting, so the search goes on to more checkpoints).
        """
        if not candidate.adaptive:
            return self._fitting(
                candidate, batch, self.compile(candidate, batch, None), budget_bytes, every_phase
            )
        none = self._compile_unless_over(candidate, batch, None, budget_bytes)
        none = self._fitting(candidate, batch, none, budget_bytes, every_phase)
        if none.peak_bytes <= budget_bytes:
            return none
        chain = self._chain(batch)
        front = chain.front
        if not front:
            return self._fitting(
                candidate, batch, self.compile(candidate, batch, None), budget_bytes, every_phase
            )
        compiled = {-1: none}  # index -1: the monolithic step, which does not fit

        def step(i: int) -> Compiled:
            if i not in compiled:
                compiled[i] = self._fitting(
                    candidate,
                    batch,
                    self._compile_unless_over(candidate, batch, front[i].plan, budget_bytes),
                    budget_bytes,
                    every_phase,
                )
            return compiled[i]

        def memory(i: int) -> int:
            return chain.unwrapped_memory if i < 0 else front[i].memory

        def estimate(i: int, lo: int, hi: int | None) -> float | None:
            """Step peak of plan ``i``: this candidate's, else another's shifted, else a line."""
            if i in compiled:
                return compiled[i].peak_bytes
            predicted = self._predicted(candidate, batch, front[i].plan)
            if predicted is not None:
                return predicted.value
            if hi is None:  # one end compiled: the model's savings, byte for byte
                return compiled[lo].peak_bytes - (memory(lo) - memory(i))
            if memory(lo) == memory(hi):
                return None
            # Compiled step peak ~ linear in the model's predicted memory along the plans.
            peak_lo, peak_hi = compiled[lo].peak_bytes, compiled[hi].peak_bytes
            return peak_hi + (memory(i) - memory(hi)) * (peak_lo - peak_hi) / (
                memory(lo) - memory(hi)
            )

        leanest = len(front) - 1
        lo, hi = -1, None  # lo does not fit; hi fits (None: none known yet)
        known = self._step(candidate.exchange, candidate.optimizer, batch, front[leanest].plan)
        if known is not None and known.peak_bytes <= budget_bytes:  # e.g. by a batch search
            known = self._fitting(candidate, batch, known, budget_bytes, every_phase)
            compiled[leanest] = known
            if known.peak_bytes <= budget_bytes:
                hi = leanest
            else:  # a warm-up phase does not fit: not even the leanest plan does
                return self._with_overhead(candidate, batch, known)
        halved = True
        for _ in range(self.max_plan_compiles + 1):
            top = leanest if hi is None else hi - 1
            if top <= lo:
                break
            guess = (lo + 1 + top) // 2 if hi is not None and not halved else None
            if guess is None:
                fitting = (
                    i
                    for i in range(lo + 1, top + 1)
                    if (e := estimate(i, lo, hi)) is not None and e <= budget_bytes
                )
                # None predicted to fit: the leanest, or the neighbour of the fitting plan.
                guess = next(fitting, top)
            width = (leanest + 1 if hi is None else hi) - lo
            if step(guess).peak_bytes <= budget_bytes:
                hi = guess
            elif guess == leanest:
                break  # not even the leanest plan fits
            else:
                lo = guess
            halved = 2 * ((leanest + 1 if hi is None else hi) - lo) <= width
        if hi is None and step(leanest).peak_bytes <= budget_bytes:
            hi = leanest  # the compilations ran out before the leanest plan was tried
        if hi is None:
            return self._with_overhead(candidate, batch, step(leanest))
        return self._with_overhead(
            candidate,
            batch,
            step(hi),
            # Its own compilations: the monolithic step (index -1) is the "none" row's.
            compile_seconds=sum(c.compile_seconds for i, c in compiled.items() if i >= 0),
            compilations=sum(c.compilations for i, c in compiled.items() if i >= 0),
        )

    def remat_choice(self, row: planner.Row, budget_bytes: int) -> remat.RematChoice:
        """The training report's view of a chosen rotor row (compiles two gradients).

        Its ``budget_bytes`` is the gradient's share of the step budget: the budget less
        what the step holds beyond the gradient computation (optimizer state, residuals,
        exchange), as compiled.
        """
        chain = self._chain(row.batch_per_worker)
        plan = self.plan_of(row)
        gradient = chain.planner.compile(plan)
        return remat.RematChoice(
            plan=plan,
            budget_bytes=budget_bytes - (row.compiled.peak_bytes - gradient.peak),
            compiled=gradient,
            predicted=next(s for s in chain.planner.candidates if s.plan == plan),
            no_remat=chain.planner.no_remat,
            compilations=chain.planner.compilations,
        )


# ------------------------------------------------------------------ the training program


def _planned_overrides(compiler: StepCompiler, row: planner.Row) -> dict[str, Any]:
    config = compiler.config_for(row.candidate)
    return {
        "compression.variant": config.compression.variant,
        "compression.residual_dtype": config.compression.residual_dtype,
        "compression.residual_format": config.compression.residual_format,
        "optimizer.name": config.optimizer.name,
        "remat_plan": row.compiled.settings.get("remat_plan"),
    }


def write_plan(result: planner.FitResult, compiler: StepCompiler, workdir: str) -> str:
    """Writes ``memory_plan.json`` (the :meth:`FitResult.as_dict` table and the overrides)."""
    payload = {
        **result.as_dict(),
        "planned": _planned_overrides(compiler, result.chosen),
        "num_workers": compiler.num_workers,
        "local_devices": config_schema.local_devices(compiler.config),
        "compilations": compiler.compilations,
        "compile_seconds": compiler.compile_seconds,
        "density_phases": list(compiler.phase_names(result.chosen.candidate)),
        "rotor": "planned" if compiler.chain_model else f"not a candidate: {compiler.remat_note}",
    }
    path = os.path.join(workdir, PLAN_FILE)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=repr)
        f.write("\n")
    return path


def _plan(
    config: ml_collections.ConfigDict, workdir: str, *, verbose: bool
) -> tuple[planner.FitResult, StepCompiler]:
    if config.memory.budget is None:
        raise config_schema.ConfigError(
            "--plan_only needs a budget: pass --config.memory.budget=SIZE (e.g. 12GiB)."
        )
    progress = functools.partial(tqdm.tqdm, leave=False, disable=None) if verbose else None
    config_schema.validate(config, known_models=models.MODELS)
    os.makedirs(workdir, exist_ok=True)
    compiled_step.use_compilation_cache(config, workdir)
    # The batch the run trains on: the dataset's sequence length for text.
    seq_len = int(config.dataset.get("context_length", 0) or 0)
    log = tqdm.tqdm.write if verbose else None
    # The schedule's phases: their number and compressors do not depend on the run's
    # length, which an epoch-based run knows only from its dataset.
    total_steps = int(config.num_steps) if config.num_steps is not None else 1000
    compiler = StepCompiler(config, seq_len=seq_len, log=log, total_steps=total_steps)
    try:
        result = planner.fit(
            compiler.candidates(),
            compiler,
            config.memory.budget,
            batch_per_worker=config.batch_size_per_worker,
            progress=progress,
            threads=planner.compile_threads(config.memory.compile_threads),
            prefer=config.memory.get("prefer", "accuracy"),
        )
    except planner.BudgetError as error:
        raise config_schema.ConfigError(
            f"memory.budget={config.memory.budget!r}: {error}"
        ) from None
    if verbose:
        print(result.table(), flush=True)
        if not compiler.chain_model:
            print(f"Rotor is not a candidate: {compiler.remat_note}", flush=True)
        overrides = _planned_overrides(compiler, result.chosen)
        chosen = result.chosen.compiled
        phase = f", density phase {chosen.peak_phase}" if chosen.peak_phase else ""
        print(
            "Chosen: "
            + ", ".join(f"{k}={v!r}" for k, v in overrides.items())
            + f" (compiled peak {planner.format_bytes(chosen.peak_bytes)}{phase}).",
            flush=True,
        )
        print(f"Memory plan written to {write_plan(result, compiler, workdir)}.", flush=True)
    return result, compiler


def plan_only(config: ml_collections.ConfigDict, workdir: str) -> planner.FitResult:
    """``--plan_only``: prints the candidate table and writes ``memory_plan.json``.

    Raises:
      ConfigError: without ``memory.budget``, or when nothing fits (the smallest peak).
    """
    return _plan(config, workdir, verbose=jax.process_index() == 0)[0]


def plan_for_training(
    config: ml_collections.ConfigDict, workdir: str
) -> tuple[ml_collections.ConfigDict, tuple[remat_model.SequentialModel, remat.RematChoice] | None]:
    """Plans ``memory.budget`` and returns what to train.

    Returns:
      ``(config, remat)``: the config with the chosen exchange and optimizer, and for a
      chosen checkpointing plan the planned model with its report, else ``None``.

    Raises:
      ConfigError: when nothing fits (the message names the smallest compiled peak).
    """
    result, compiler = _plan(config, workdir, verbose=jax.process_index() == 0)
    chosen = result.chosen
    planned = compiler.config_for(chosen.candidate)
    if compiler.plan_of(chosen) is None:
        return planned, None
    choice = compiler.remat_choice(chosen, result.budget_bytes)
    return planned, (compiler.task_for(chosen).model, choice)
