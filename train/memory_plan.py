"""``memory.budget``: the training program's candidates for the memory planner, compiled.

:mod:`resireduce_jax.planner` chooses among candidates from compiled peaks but does not
know how to build a train step; :class:`StepCompiler` compiles the program's own step
(:func:`train.compiled_step.compile_step`: the guarded, donated data-parallel step, from
abstract shapes, nothing allocated) for each candidate of a config:

* exchange: ``ef``, ``w+2d``, ``w+2d+bf16`` (:func:`train.compiled_step.with_variant`),
  for a config with error feedback; a config without residuals keeps its own;
* optimizer: ``original`` (optax's: ``optimizer.name = "optax.adamw"``) or ``r`` (this
  library's memory-reduced one: ``adamw_r``, ``lion_r``, the skip-aware ``sgd``), where the
  config's optimizer has both (:func:`optimizer_names`);
* remat: ``none``, or ``rotor`` for chain models (ResNet, GPT-2, ViT): the fastest rotor
  plan whose compiled *train step* fits the budget.

The rotor search works on the rotor dynamic program's plans (:class:`resireduce_jax.remat.
ChainPlanner`, one per batch size) ordered from fastest to leanest, keeping those that
predict less memory than every faster one. The monolithic model without checkpoints comes
first: when it fits, nothing is checkpointed. Otherwise the next plan compiled is the
fastest one predicted to fit, from (in order) plans already compiled for another exchange
or optimizer at this batch, shifted by the difference of the two monolithic steps (the
gradient is the same), or the line from the model's predicted memory to the compiled step
peak through the bracket's ends; without a prediction, the leanest plan. The bracket
(plan that does not fit, plan that fits) shrinks until the two are neighbours, bisecting
when a prediction did not halve it, or until ``max_plan_compiles`` are spent; the fastest
fitting plan compiled is returned.

:func:`plan_for_training` runs :func:`resireduce_jax.planner.fit` for ``memory.budget``
before training, prints the table, writes ``memory_plan.json`` to the workdir, and
returns the chosen configuration (config and, with checkpointing, the planned model);
:func:`plan_only` does the same and trains nothing (``python -m train --plan_only``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
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


@dataclasses.dataclass
class _Chain:
    """One batch size's rotor planner and its plans (fastest first, predicted memory falling)."""

    planner: remat.ChainPlanner
    model: remat_model.SequentialModel
    front: list[remat.Solution]
    unwrapped_memory: int
    seconds: float  # measuring the stages and solving the dynamic program


class StepCompiler:
    """Compiles the training program's step for planner candidates (a ``planner.Compiler``).

    Args:
      config: the run's config (its ``compression``, ``optimizer`` and ``model``).
      num_workers: workers of the compiled mesh (default ``config.num_workers``).
      seq_len: tokens per sequence of language models (default: the model's).
      exchanges: the residual variants to try where the config keeps residuals.
      max_plan_compiles: step compilations a rotor search may spend after the
        no-checkpoint and the leanest plan.
      guard: compile with ``skip_nonfinite`` (the program always trains guarded).
      slots: memory slots of the rotor dynamic program.
      log: called with one line per compilation (e.g. ``tqdm.write``); ``None``: silent.
    """

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        *,
        num_workers: int | None = None,
        seq_len: int = 0,
        exchanges: Sequence[str] = planner.EXCHANGES,
        max_plan_compiles: int = 4,
        guard: bool = True,
        slots: int = 500,
        log: Callable[[str], Any] | None = None,
    ):
        self.config = config.copy_and_resolve_references()
        self.num_workers = num_workers or config.num_workers
        self.seq_len = seq_len
        self.max_plan_compiles = max_plan_compiles
        self.guard = guard
        self.slots = slots
        self.log = log
        self.task = compiled_step.build_task(self.config)
        self.optimizers = optimizer_names(config.optimizer.name)
        own = compiled_step.variant_label(self.config)
        self.exchanges = (own,) if config.compression.variant in _NO_RESIDUALS else tuple(exchanges)
        self.remat_note = _no_chain_reason(self.task.model_config)
        self.chain_model = self.remat_note is None
        self._steps: dict[tuple, Compiled] = {}
        self._chains: dict[int, _Chain] = {}

    @property
    def compilations(self) -> int:
        """Train steps compiled so far (each (candidate, batch, plan) once)."""
        return len(self._steps)

    @property
    def compile_seconds(self) -> float:
        """Wall time of those compilations and of measuring the chains for rotor."""
        steps = sum(c.compile_seconds for c in self._steps.values())
        return steps + sum(c.seconds for c in self._chains.values())

    def records(self) -> list[dict[str, Any]]:
        """One row per compiled step: what, batch, checkpoints, peak, compile seconds."""
        return [
            {
                "exchange": exchange,
                "optimizer": optimizer,
                "batch_per_worker": batch,
                "checkpoints": None if plan is None else plan.num_checkpoints,
                "peak_bytes": compiled.peak_bytes,
                "compile_seconds": compiled.compile_seconds,
            }
            for (exchange, optimizer, batch, plan), compiled in self._steps.items()
        ]

    # ------------------------------------------------------------------ candidates

    def candidates(self) -> list[Candidate]:
        """Every exchange × optimizer × remat combination this config has."""
        remats = planner.REMATS if self.chain_model else ("none",)
        optimizers = [o for o in planner.OPTIMIZERS if o in self.optimizers]
        return planner.candidate_grid(self.exchanges, optimizers, remats)

    def config_for(self, candidate: Candidate) -> ml_collections.ConfigDict:
        """The config that trains ``candidate``'s exchange and optimizer (remat aside)."""
        config = self.config.copy_and_resolve_references()
        with config.unlocked():
            if not candidate.exchange.endswith(compiled_step.BF16_SUFFIX):
                config.compression.residual_dtype = ""
            config.optimizer.name = self.optimizers[candidate.optimizer]
            config.remat.budget = ""
        return compiled_step.with_variant(config, candidate.exchange)

    # ------------------------------------------------------------------ compiling

    def _chain(self, batch: int) -> _Chain:
        """The rotor planner of one worker's batch (as ``remat.budget`` plans it)."""
        if batch in self._chains:
            return self._chains[batch]
        start = time.perf_counter()
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
        chain_planner = rotor.planner(
            variables,
            x,
            rngs=rngs or None,
            mutable=list(model_config.mutable_collections) or False,
            slots=self.slots,
            train=True,
        )
        _, unwrapped = chain_planner.predict(remat.Plan.unwrapped(len(chain.layers)))
        front, lowest = [], unwrapped
        for solution in chain_planner.candidates:  # fastest first
            if solution.plan.num_checkpoints and solution.memory < lowest:
                front.append(solution)
                lowest = solution.memory
        sequential = remat_model.SequentialModel(rotor, input_name, model, chain)
        seconds = time.perf_counter() - start
        self._chains[batch] = _Chain(chain_planner, sequential, front, unwrapped, seconds)
        return self._chains[batch]

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

    def compile(self, candidate: Candidate, batch: int, plan: remat.Plan | None) -> Compiled:
        """The step of ``candidate``'s exchange and optimizer at ``batch``, under ``plan``.

        ``plan=None``: the monolithic model, no checkpointing. Cached.
        """
        key = (candidate.exchange, candidate.optimizer, batch, plan)
        if key in self._steps:
            return self._steps[key]
        task = self.task
        if plan is not None:
            task = dataclasses.replace(task, model=self.model_for(batch, plan))
        start = time.perf_counter()
        step = compiled_step.compile_step(
            self.config_for(candidate),
            guard=self.guard,
            batch_per_worker=batch,
            seq_len=self.seq_len,
            num_workers=self.num_workers,
            task=task,
        )
        # Per device (a hierarchical exchange keeps 1/local_devices of each residual).
        residuals = compiled_step.state_bytes(step.params, step.tx, step.mesh).residuals
        seconds = time.perf_counter() - start
        settings: dict[str, Any] = {"remat_plan": None}
        if plan is not None:
            settings = {
                "remat_plan": plan.compact(),
                "remat_plan_json": plan.as_json(),
                "checkpoints": plan.num_checkpoints,
            }
        result = Compiled.from_program(
            step.compiled,
            residual_bytes=int(residuals),
            compile_seconds=seconds,
            settings=settings,
        )
        del step
        self._steps[key] = result
        if self.log is not None:
            self.log(
                f"compiled {candidate.exchange} / {candidate.optimizer} / "
                f"{'none' if plan is None else f'{plan.num_checkpoints} checkpoints'}, batch "
                f"{batch}: peak {planner.format_bytes(result.peak_bytes)} in {seconds:.1f} s"
            )
        return result

    def _with_overhead(self, candidate: Candidate, batch: int, compiled: Compiled, **fields):
        base = self._steps.get((candidate.exchange, candidate.optimizer, batch, None))
        overhead = None
        if base is not None and base.flops > 0:
            overhead = compiled.flops / base.flops - 1.0
        return dataclasses.replace(compiled, flops_overhead=overhead, **fields)

    def leanest(self, candidate: Candidate, batch: int) -> Compiled:
        """No checkpointing, or for ``rotor`` the rotor plan predicting the least memory."""
        if not candidate.adaptive:
            return self.compile(candidate, batch, None)
        front = self._chain(batch).front
        if not front:
            return self.compile(candidate, batch, None)
        return self._with_overhead(candidate, batch, self.compile(candidate, batch, front[-1].plan))

    def fastest_fitting(self, candidate: Candidate, batch: int, budget_bytes: int) -> Compiled:
        """The fastest configuration whose compiled step fits, else the leanest one.

        For ``rotor``: no checkpointing if that fits; otherwise the search of the module
        docstring over the chain's plans.
        """
        none = self.compile(candidate, batch, None)
        if not candidate.adaptive or none.peak_bytes <= budget_bytes:
            return none
        chain = self._chain(batch)
        front = chain.front
        if not front:
            return none
        compiled = {-1: none}  # index -1: the monolithic step, which does not fit

        def step(i: int) -> Compiled:
            if i not in compiled:
                compiled[i] = self.compile(candidate, batch, front[i].plan)
            return compiled[i]

        def memory(i: int) -> int:
            return chain.unwrapped_memory if i < 0 else front[i].memory

        def estimate(i: int, lo: int, hi: int | None) -> float | None:
            """Step peak of plan ``i``: this candidate's, else another's shifted, else a line."""
            if i in compiled:
                return compiled[i].peak_bytes
            shifted = self._transferred_peak(candidate, batch, front[i].plan, none.peak_bytes)
            if shifted is not None:
                return shifted
            if hi is None or memory(lo) == memory(hi):
                return None
            # Compiled step peak ~ linear in the model's predicted memory along the plans.
            peak_lo, peak_hi = compiled[lo].peak_bytes, compiled[hi].peak_bytes
            return peak_hi + (memory(i) - memory(hi)) * (peak_lo - peak_hi) / (
                memory(lo) - memory(hi)
            )

        leanest = len(front) - 1
        lo, hi = -1, None  # lo does not fit; hi fits (None: none known yet)
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
            compilations=len(compiled) - 1,
        )

    def _transferred_peak(
        self, candidate: Candidate, batch: int, plan: remat.Plan, none_peak: int
    ) -> float | None:
        """``plan``'s step peak from other candidates at ``batch``: theirs shifted by the
        difference of the monolithic steps (the gradient is the same; the optimizer state,
        residuals and exchange differ)."""
        shifts = [
            compiled.peak_bytes - base.peak_bytes
            for (exchange, optimizer, b, p), compiled in self._steps.items()
            if b == batch
            and p == plan
            and (exchange, optimizer) != (candidate.exchange, candidate.optimizer)
            and (base := self._steps.get((exchange, optimizer, batch, None))) is not None
        ]
        return none_peak + sum(shifts) / len(shifts) if shifts else None

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
    progress = None
    if verbose:

        def progress(items: Iterable[Any], desc: str) -> Iterable[Any]:
            return tqdm.tqdm(items, desc=desc, unit="candidate", leave=False, disable=None)

    config_schema.validate(config, known_models=models.MODELS)
    os.makedirs(workdir, exist_ok=True)
    # The batch the run trains on: the dataset's sequence length for text.
    seq_len = int(config.dataset.get("context_length", 0) or 0)
    log = tqdm.tqdm.write if verbose else None
    compiler = StepCompiler(config, seq_len=seq_len, log=log)
    try:
        result = planner.fit(
            compiler.candidates(),
            compiler,
            config.memory.budget,
            batch_per_worker=config.batch_size_per_worker,
            progress=progress,
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
        print(
            "Chosen: "
            + ", ".join(f"{k}={v!r}" for k, v in overrides.items())
            + f" (compiled peak {planner.format_bytes(result.chosen.compiled.peak_bytes)}).",
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
