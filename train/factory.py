"""Builds the optax chain of a run from its config: compression transform, schedule, optimizer.

The chain is the gradient exchange, then the optimizer, so the optimizer stays replicated.
compression.variant (the paper's names: ef, a, w, d, 2d, w+2d, ...) maps to the exchange here.
ResiReduce's store kinds use the same words: a group gets inter's, a 2-D layer intra's.
dgc is Deep Gradient Compression's memory followed by SGD without momentum.
The density follows compression.density_schedule, as fractions of the run's steps.
compressed_momentum_adam replaces the chain around the variant's exchange.
The variant table and the store kinds: docs/design.md, "Config to optax chain
(train/factory.py)".
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

import ml_collections
import optax

import resireduce_jax as rr
from resireduce_jax.optimizers import registry
from train import config_schema

__all__ = [
    "build_compressor",
    "build_exchange",
    "build_grouping",
    "build_optimizer",
    "build_schedule",
    "build_store_plans",
    "build_tx",
    "density_phases",
    "density_schedule",
    "layer_stacks",
    "local_axis",
    "resireduce_arguments",
]

#: Variants that are not ResiReduce (see the table above).
_OTHER_EXCHANGES = ("dense", "none", "ef", "dgc")

#: ``optimizer.name`` of the compressed-momentum optimizers, which take the exchange inside
#: them instead of after them.
COMPRESSED_MOMENTUM = {
    "compressed_momentum_adam": rr.compressed_momentum_adam,
    "compressed_momentum_sgd": rr.compressed_momentum_sgd,
}


def resireduce_arguments(variant: str) -> dict[str, str] | None:
    """``resireduce``'s ``inter`` / ``intra`` for a config ``variant``; ``None`` if not ResiReduce.

    The one mapping from ``compression.variant`` to the library's arguments (module table).
    """
    if variant in _OTHER_EXCHANGES:
        return None
    inter, intra = config_schema.parse_variant(variant)
    return {"inter": inter, "intra": intra}


def density_schedule(
    comp: ml_collections.ConfigDict, total_steps: int
) -> rr.compressors.DensitySchedule | None:
    """``compression.density_schedule`` for a run of ``total_steps``; ``None`` if off.

    The first ``dense_fraction`` of the steps travel uncompressed (in ``dense_dtype``, see
    :func:`build_compressor`); then DGC's warm-up
    stages (density ``dgc_start``, divided by ``dgc_factor`` from stage to stage while above
    ``compression.density``) share the next ``dgc_fraction`` of the steps; then
    ``compression.density``. A non-zero fraction lasts at least one step.
    """
    s = comp.density_schedule
    dense = max(1, round(s.dense_fraction * total_steps)) if s.dense_fraction else 0
    if not s.dgc_fraction:
        return rr.compressors.dense_warmup(dense, comp.density) if dense else None
    shape = {"start": s.dgc_start, "factor": s.dgc_factor}
    stages = rr.compressors.schedule.dgc_stages(comp.density, **shape)
    stage_steps = max(1, round(s.dgc_fraction * total_steps / max(len(stages), 1)))
    return rr.compressors.dgc_warmup(comp.density, stage_steps, dense_steps=dense, **shape)


def density_phases(
    config: ml_collections.ConfigDict, total_steps: int, variant: str | None = None
) -> tuple[rr.compressors.schedule.Phase, ...]:
    """The phases of the run's exchange (one, unless ``compression.density_schedule`` is
    on): the training program compiles one step per phase and runs each in its steps."""
    if (variant or config.compression.variant) == "dense":
        return rr.compressors.schedule.phases(rr.compressors.none())
    return rr.compressors.schedule.phases(build_compressor(config.compression, total_steps))


def build_compressor(
    comp: ml_collections.ConfigDict, total_steps: int | None = None
) -> rr.compressors.Compressor:
    """The compressor named by ``compression.compressor`` with its arguments.

    With ``total_steps`` its density follows :func:`density_schedule` (a compressor without
    a density gets the dense warm-up alone), its dense warm-up sent in
    ``density_schedule.dense_dtype`` when one is set
    (:func:`resireduce_jax.compressors.schedule.with_dense_dtype`); without, it is the
    steady-state compressor.
    """
    factory = rr.compressors.REGISTRY.get(comp.compressor)
    if factory is None:
        raise ValueError(
            f"compression.compressor={comp.compressor!r}; choose one of "
            f"{sorted(rr.compressors.REGISTRY)}."
        )
    kwargs = config_schema.free_form(comp.options)
    has_density = "density" in inspect.signature(factory).parameters
    schedule = None if total_steps is None else density_schedule(comp, total_steps)
    if has_density and "density" not in kwargs:
        kwargs["density"] = comp.density if schedule is None else schedule
    compressor = rr.compressors.get(comp.compressor, **kwargs)
    if schedule is not None and not has_density:
        if comp.density_schedule.dgc_fraction:
            raise ValueError(
                f"compression.density_schedule.dgc_fraction needs a sparsifying compressor "
                f"(topk, fast_topk, randomk, dgc); {comp.compressor!r} has no density."
            )
        compressor = rr.compressors.schedule.with_dense_start(schedule.starts[1], compressor)
    if schedule is not None and comp.density_schedule.dense_dtype:
        dtype = comp.density_schedule.dense_dtype
        compressor = rr.compressors.schedule.with_dense_dtype(compressor, dtype)
    return compressor


def build_grouping(comp: ml_collections.ConfigDict) -> rr.grouping.Grouping:
    """The config's grouping. A ``"regex"`` rule that matches no leaf warns rather than
    raises: a paper config's rules, written for its full depth, stay valid on a model made
    shallower with ``model.overrides`` (tests/test_configs.py checks that every shipped
    rule matches its full-size model)."""
    if comp.grouping == "regex":
        return rr.grouping.regex([tuple(rule) for rule in comp.rules], unmatched="warn")
    return rr.grouping.auto(comp.max_group_size or None)


def layer_stacks(config: ml_collections.ConfigDict) -> dict[str, int] | None:
    """The exchange's ``layer_stacks`` for the config's model: ``{"h": 0}`` for GPT-2 with
    ``model.scan_layers`` (its blocks scanned), ``None`` for a model written out."""
    return rr.models.get_config(
        config.model.name, **config_schema.model_overrides(config)
    ).layer_stacks


def local_axis(config: ml_collections.ConfigDict) -> str | None:
    """The mesh axis of a node's devices when ``config.local_devices`` is set, else ``None``."""
    return rr.parallel.LOCAL_AXIS if config_schema.local_devices(config) else None


def build_exchange(
    comp: ml_collections.ConfigDict,
    *,
    variant: str | None = None,
    axis_name: str = "data",
    local_axis: str | None = None,
    total_steps: int | None = None,
    layer_stacks: dict[str, int] | None = None,
) -> rr.ExchangeTransformation:
    """The gradient-exchange transform of a residual ``variant`` (default: the config's).

    ``local_axis``: the hierarchical exchange over a node's devices (``config.local_devices``;
    :func:`local_axis`), ``None``: flat. ``total_steps``: the run's length, for the
    compressor's density schedule (``None``: the steady-state compressor, which keeps the
    same residuals: enough for plans and layouts). ``dgc``'s residual layout is plain
    error feedback's (its memory is built by :func:`build_tx`). ``layer_stacks``: the
    model's stacked layers (:func:`layer_stacks`), ``None``: none.
    """
    variant = variant or comp.variant
    options = {"min_size": comp.min_size, "local_axis": local_axis, "layer_stacks": layer_stacks}
    if variant == "dense":
        return rr.compressed_mean(rr.compressors.none(), axis_name, **options)
    compressor = build_compressor(comp, total_steps)
    scope = comp.get("selection_scope", "leaf")
    if variant == "none":
        return rr.compressed_mean(compressor, axis_name, selection_scope=scope, **options)
    if variant == "ef":
        return rr.error_feedback(
            compressor,
            axis_name,
            residual_dtype=comp.residual_dtype or None,
            residual_format=comp.get("residual_format", "") or None,
            selection_scope=scope,
            **options,
        )
    if variant == "dgc":
        return rr.error_feedback(compressor, axis_name, **options)
    return rr.resireduce(
        compressor,
        axis_name,
        local_axis=local_axis,
        layer_stacks=layer_stacks,
        selection_scope=scope,
        **_resireduce_options(comp, variant),
    )


def _resireduce_options(comp: ml_collections.ConfigDict, variant: str) -> dict[str, Any]:
    arguments = resireduce_arguments(variant)
    if arguments is None:
        raise ValueError(f"compression.variant={variant!r} is not a ResiReduce variant.")
    return dict(
        grouping=build_grouping(comp),
        **arguments,
        intra_layers=comp.intra_layers,
        row_ratio=comp.row_ratio,
        col_ratio=comp.col_ratio,
        selection=comp.selection,
        phi=comp.phi,
        weight_source=comp.weight_source,
        norm_source=comp.norm_source,
        residual_dtype=comp.residual_dtype or None,
        residual_format=comp.get("residual_format", "") or None,
        min_size=comp.min_size,
    )


def build_store_plans(
    comp: ml_collections.ConfigDict,
    params,
    *,
    local_axis: str | None = None,
    local_size: int = 1,
    layer_stacks: dict[str, int] | None = None,
) -> list | None:
    """ResiReduce's residual store plans for ``params`` (``None`` for other variants).

    With ``local_axis`` and ``local_size > 1`` (the hierarchical exchange) every plan is one
    device's shard (:func:`resireduce_jax.residual_stores.shard_store`), as the transform
    built by :func:`build_exchange` with that ``local_axis`` keeps it. With
    ``layer_stacks`` the plans are those of the unstacked params (one unit per slice).
    """
    if resireduce_arguments(comp.variant) is None:
        return None
    if layer_stacks is not None:
        params = rr.layer_stacks.layout(params, rr.layer_stacks.check(layer_stacks)).view()
    plans = rr.residual_reduction.plan_stores(params, **_resireduce_options(comp, comp.variant))
    if local_axis is not None and local_size > 1:
        plans = [rr.residual_stores.shard_store(p, local_axis, local_size) for p in plans]
    return plans


def build_schedule(config: ml_collections.ConfigDict, steps_per_epoch: float, total_steps: int):
    """Learning rate per step: linear warm-up, then constant, step decays or cosine."""
    s, peak = config.schedule, config.optimizer.learning_rate
    warmup = round(s.warmup_epochs * steps_per_epoch)
    if s.name == "constant":
        after = optax.constant_schedule(peak)
    elif s.name == "warmup_piecewise":
        boundaries = {
            max(1, round(e * steps_per_epoch) - warmup): s.decay_factor for e in s.boundaries_epochs
        }
        after = optax.piecewise_constant_schedule(peak, boundaries)
    else:  # warmup_cosine
        after = optax.cosine_decay_schedule(peak, max(1, total_steps - warmup), alpha=s.end_factor)
    if warmup == 0:
        return after
    ramp = optax.linear_schedule(peak / warmup, peak, warmup)
    return optax.join_schedules([ramp, after], [warmup])


#: ``optimizer.name = "optax.adamw"``: optax's own optimizer even where the registry maps the
#: plain name to this library's equivalent (``adamw``, ``sgd``); the memory planner's
#: "original optimizer" candidates (train/memory_plan.py).
OPTAX_PREFIX = "optax."


def _optimizer_factory(name: str):
    """``optax.NAME``: optax's alias ``NAME``; any other name: the library's registry."""
    if not name.startswith(OPTAX_PREFIX):
        return registry.optimizer_factory(name)
    alias = name.removeprefix(OPTAX_PREFIX)
    if alias not in registry.optax_optimizer_names():
        raise ValueError(f"optax has no optimizer {alias!r} (e.g. 'optax.adamw', 'optax.sgd').")
    return getattr(optax, alias)


def _more_optimizers(name: str) -> str:
    """The end of an unknown ``optimizer.name``'s message: the names only the training
    program takes, and the closest known name."""
    optax_names = registry.optax_optimizer_names()
    if name.startswith(OPTAX_PREFIX):
        name, known, prefix = name.removeprefix(OPTAX_PREFIX), optax_names, OPTAX_PREFIX
    else:
        known, prefix = [*COMPRESSED_MOMENTUM, *registry.OPTIMIZERS, *optax_names], ""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {prefix + close[0]!r}?" if close else ""
    return (
        f" The training program also takes {sorted(COMPRESSED_MOMENTUM)} (the exchange "
        f"inside the optimizer) and 'optax.NAME' for optax's own NAME.{hint}"
    )


def _frozen_nu(o: ml_collections.ConfigDict) -> dict[str, str]:
    """``frozen_nu_format=`` for compressed_momentum_adam where the config sets one."""
    value = o.get("frozen_nu_format", "float32")
    return {} if value == "float32" else {"frozen_nu_format": value}


def build_optimizer(config: ml_collections.ConfigDict, schedule) -> optax.GradientTransformation:
    """The optimizer ``optimizer.name``: one of ours (``adamw_r``, ...) or an optax optimizer.

    Looked up in the library's registry
    (:func:`resireduce_jax.optimizers.registry.optimizer_factory`); ``optax.NAME`` is
    optax's own ``NAME`` (``optax.adamw`` rather than the registry's ``adamw``).
    ``optimizer.weight_decay`` goes to the optimizer's own ``weight_decay`` argument when
    it has one (decoupled, AdamW-style), else it is added as L2 to the gradients before the
    optimizer, like torch.optim.SGD's weight_decay. ``optimizer.max_grad_norm`` clips the
    global norm of the (already averaged) gradient first.
    """
    o = config.optimizer
    try:
        factory = _optimizer_factory(o.name)
    except ValueError as e:
        raise ValueError(f"optimizer.name={o.name!r}: {e}{_more_optimizers(o.name)}") from None
    kwargs = config_schema.free_form(o.kwargs)
    params = inspect.signature(factory).parameters
    decoupled = "weight_decay" in params
    if decoupled:
        kwargs.setdefault("weight_decay", o.weight_decay)
    # Ours clip in their own per-leaf pass; optax's get a clip_by_global_norm first.
    fused_clip = "max_grad_norm" in params
    if fused_clip and o.max_grad_norm is not None:
        kwargs.setdefault("max_grad_norm", o.max_grad_norm)
    try:
        optimizer = factory(learning_rate=schedule, **kwargs)
    except TypeError as e:
        raise ValueError(f"optimizer {o.name!r} does not accept {sorted(kwargs)}: {e}") from None
    chain = []
    if o.max_grad_norm is not None and not fused_clip:
        chain.append(optax.clip_by_global_norm(o.max_grad_norm))
    if o.weight_decay and not decoupled:
        chain.append(optax.add_decayed_weights(o.weight_decay))
    return optax.chain(*chain, optimizer) if chain else optimizer


def build_tx(
    config: ml_collections.ConfigDict,
    steps_per_epoch: float,
    total_steps: int,
    *,
    variant: str | None = None,
    local_axis: str | None = None,
) -> optax.GradientTransformation:
    """``chain(exchange, optimizer)`` for the config (or another residual ``variant``).

    ``local_axis``: the exchange is hierarchical over that mesh axis (:func:`local_axis`
    of a config with ``local_devices``); ``None``: flat.
    """
    schedule = build_schedule(config, steps_per_epoch, total_steps)
    comp, o = config.compression, config.optimizer
    variant = variant or comp.variant
    if variant == "dgc":
        if local_axis is not None:
            raise ValueError("compression.variant='dgc' has no hierarchical exchange.")
        momentum = config_schema.free_form(o.kwargs).get("momentum", 0.0)
        chain = [optax.add_decayed_weights(o.weight_decay)] if o.weight_decay else []
        memory = rr.dgc_memory(
            build_compressor(comp, total_steps),
            momentum,
            o.max_grad_norm,
            min_size=comp.min_size,
            residual_format=comp.get("residual_format", "") or None,
        )
        return optax.chain(*chain, memory, rr.optimizers.sgd(schedule))
    exchange = build_exchange(
        comp,
        variant=variant,
        local_axis=local_axis,
        total_steps=total_steps,
        layer_stacks=layer_stacks(config),
    )
    if o.name in COMPRESSED_MOMENTUM:
        return COMPRESSED_MOMENTUM[o.name](
            schedule,
            exchange,
            weight_decay=o.weight_decay,
            max_grad_norm=o.max_grad_norm,
            one_buffer=config_schema.ONE_BUFFER[o.get("one_buffer", "auto")],
            **_frozen_nu(o),
            **config_schema.free_form(o.kwargs),
        )
    return optax.chain(exchange, build_optimizer(config, schedule))
