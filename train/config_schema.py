"""The training configuration: every key with its default, and validation before compiling.

Config files in ``configs/`` start from :func:`base_config` and change what their
experiment needs (flax-examples style ``get_config()``). Command-line overrides such as
``--config.compression.density=0.001`` are applied by ``ml_collections`` (which rejects
keys that do not exist); :func:`validate` then checks names and ranges, so a typo or an
invalid value fails in a second with the valid choices listed, before any data is loaded
or anything is compiled.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
from typing import Any

import ml_collections
from ml_collections import config_dict

__all__ = [
    "GUARD_MODES",
    "VARIANTS",
    "WEIGHT_UPDATE_ORDERS",
    "ConfigError",
    "base_config",
    "check_processes",
    "local_devices",
    "model_overrides",
    "parse_memory_budget",
    "parse_variant",
    "split_variant",
    "validate",
]

# Residual variant -> (inter, intra) of resireduce_jax.resireduce; see parse_variant.
# "dgc": Deep Gradient Compression's memory instead of error feedback (SGD only).
VARIANTS = ("dense", "none", "ef", "dgc", "a", "w", "d", "2d", "a+d", "a+2d", "w+d", "w+2d")
# Residual storage dtypes ("": the gradients'); float8 only for compressed_momentum_adam.
FLOAT8 = "float8_e4m3fn"
RESIDUAL_DTYPES = ("", "float32", "bfloat16", "float16", FLOAT8)
RESIDUAL_FORMAT = re.compile(
    r"|float32|bfloat16|float16|(int8|float8|int4|int3)(/[1-9]\d*(/(nearest|stochastic))?)?"
)
# Variant suffixes for residuals cast to a narrower dtype than the gradients'; any other
# "+<format>" suffix is a compression.residual_format ("ef+int4/64/stochastic").
RESIDUAL_DTYPE_SUFFIXES = {"+bf16": "bfloat16", "+f8": "float8_e4m3fn"}
SCHEDULES = ("constant", "warmup_piecewise", "warmup_cosine")
# optimizer.one_buffer -> compressed_momentum_*(one_buffer=...)
ONE_BUFFER = {"off": False, "auto": None, "on": True}


class ConfigError(ValueError):
    """A mistake in the configuration or on the command line, not a bug in the program.

    The message is one sentence that names the key (or flag), the bad value and the fix;
    ``python -m train`` prints it as ``error: <message>`` and exits with status 2, without
    a traceback.
    """


# resireduce_jax.nonfinite.MODES, spelled out so that config files load without jax
# (tests/test_train.py checks that the two agree).
GUARD_MODES = ("loss", "strict", "lean")

# resireduce_jax.parallel.WEIGHT_UPDATE_ORDERS, spelled out for the same reason.
WEIGHT_UPDATE_ORDERS = ("last_read", "all_gradients", "unordered")


def base_config() -> ml_collections.ConfigDict:
    """All keys the training program understands, with defaults (the embedded digits job)."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    # Fine-tuning: the workdir of a finished run whose newest checkpoint's parameters (and
    # model state) replace the seeded initialization; the optimizer state starts anew.
    c.init_from = ""
    c.num_workers = 8
    # Devices per node for the hierarchical exchange (beyond the paper): the mesh becomes
    # nodes x local_devices, gradients are reduced densely inside a node, compressed across
    # nodes, and every residual is sharded over the node's devices (1/local_devices of it
    # per device). Must divide num_workers; multi-process runs put one node in one process
    # (devices per process a multiple of it; one process per node: equal). None or 0 =
    # flat (every device compresses and keeps a full residual); 1 = the flat result.
    c.local_devices = config_dict.placeholder(int)

    c.model = ml_collections.ConfigDict()
    c.model.name = "digits_mlp"
    c.model.overrides = ml_collections.ConfigDict()  # free-form, forwarded to models.get_model
    # Apply the repeated layers with nn.scan (GPT-2, BERT, byte_gpt): one leaf per weight
    # with a leading layer axis; the exchange treats every slice as a layer (layer_stacks).
    c.model.scan_layers = False

    # Free-form: `name` plus the fields that dataset takes (train/input_pipeline.py).
    c.dataset = ml_collections.ConfigDict({"name": "digits"})

    c.batch_size_per_worker = 16
    c.num_steps = config_dict.placeholder(int)  # exactly one of num_steps / num_epochs
    c.num_epochs = config_dict.placeholder(float)

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.name = "sgd"  # any optax optimizer, or adamw_r / adan_r / lion_r
    c.optimizer.learning_rate = 0.1
    c.optimizer.kwargs = ml_collections.ConfigDict({"momentum": 0.9})
    c.optimizer.weight_decay = 0.0  # decoupled for *w optimizers, L2 added otherwise
    c.optimizer.max_grad_norm = config_dict.placeholder(float)
    # compressed_momentum_*: "on" keeps each worker's momentum and error as one buffer
    # b1 m + e_i in its leaf's own residual store (variant "ef"; a shared or 2-D store is
    # refused), "auto" where the store allows it in float32 (the two buffers' arithmetic;
    # other optimizers have one buffer or none), "off" two buffers (m replicated, e_i).
    c.optimizer.one_buffer = "auto"
    # compressed_momentum_adam: the frozen second moment as "float32", or "int8" (8-bit
    # codes of sqrt(v) in blocks of 256, "int8/<block size>"), rounded once at the freeze.
    c.optimizer.frozen_nu_format = "float32"

    c.schedule = ml_collections.ConfigDict()
    c.schedule.name = "warmup_piecewise"
    c.schedule.warmup_epochs = 0.0
    c.schedule.boundaries_epochs = ()  # decay points for warmup_piecewise
    c.schedule.decay_factor = 0.1
    c.schedule.end_factor = 0.0  # final lr / peak lr for warmup_cosine

    c.compression = ml_collections.ConfigDict()
    c.compression.variant = "w+2d"
    c.compression.compressor = "topk"
    c.compression.density = 0.01  # for sparsifying compressors
    # How the density changes over the run (resireduce_jax.compressors.schedule), in
    # fractions of the run's steps: the first dense_fraction travel uncompressed (a dense
    # warm-up; any compressor), then DGC's warm-up stages (ICLR 2018 §3.4: density
    # dgc_start, dgc_start / dgc_factor, ... while above `density`; sparsifiers only) share
    # the next dgc_fraction, then `density`. dense_dtype: "" sends the dense warm-up in
    # the gradients' dtype, "bfloat16" / "float16" as a 16-bit all-reduce (half the bytes
    # of float32; the rounding is not fed back). The optimizer compressed_momentum_adam
    # estimates Adam's second moment in the dense warm-up (needs dense_fraction > 0).
    c.compression.density_schedule = ml_collections.ConfigDict(
        {
            "dense_fraction": 0.0,
            "dense_dtype": "",
            "dgc_fraction": 0.0,
            "dgc_start": 0.25,
            "dgc_factor": 4.0,
        }
    )
    c.compression.options = ml_collections.ConfigDict()  # other compressor arguments
    c.compression.min_size = 10_000
    c.compression.residual_dtype = ""  # "" = the leaf dtype; e.g. "bfloat16"
    # "" = residual_dtype's; "int8" / "float8" / "int4" / "int3" (codes, a scale per block),
    # "int4/64/stochastic" (block size, rounding), "bfloat16", "float32"
    c.compression.residual_format = ""
    c.compression.grouping = "auto"  # "auto" or "regex"
    c.compression.max_group_size = 3  # for "auto"; 0 = unlimited
    c.compression.rules = ()  # for "regex": ((pattern, label template), ...)
    c.compression.intra_layers = "auto"  # "auto" or a regex on leaf paths
    c.compression.row_ratio = config_dict.placeholder(float)
    c.compression.col_ratio = 0.5
    c.compression.selection = "top"
    # What a Top-k density applies to: "leaf" (each compressed leaf sends its share) or
    # "global" (whole-model Top-k over every compressed leaf; any variant but dgc, flat
    # exchanges without scanned layers).
    c.compression.selection_scope = "leaf"
    c.compression.weight_source = "residual"
    # What -d/-2d rank rows and columns by: L1 norms of the fresh residual ("residual", the
    # paper) or of the compensated gradient ("compensated", the reference code).
    c.compression.norm_source = "residual"
    c.compression.phi = 0.5
    c.compression.nonfinite = "skip"  # "skip" or "raise"
    # How skip_nonfinite decides (docs/design.md, "The non-finite guard"): "loss" (before
    # the backward pass, so no gradient waits), "strict" (any non-finite gradient, after
    # it; holds every gradient until then) or "lean". One of GUARD_MODES.
    c.compression.guard_mode = "loss"

    c.remat = ml_collections.ConfigDict()
    # Rotor activation checkpointing for ResNet / GPT-2 / ViT models (train/remat_model.py):
    # a fraction of the no-remat peak ("0.6", "60%") or a size ("2GiB"); "" = off.
    c.remat.budget = ""

    c.memory = ml_collections.ConfigDict()
    # Fit the run into a per-worker memory budget ("12GiB", "8 GB", bytes; None = no
    # planning): before training, the planner (train/memory_plan.py) compiles the step with
    # each residual variant of memory.exchanges, optimizer (optax's, memory-reduced) and
    # remat plan, and trains the fastest whose compiled peak fits (memory.prefer).
    c.memory.budget = config_dict.placeholder(str)
    # The residual variants the planner tries, most accurate first, e.g. ("ef", "ef+int8",
    # "w+2d"); () = resireduce_jax.planner.EXCHANGES.
    c.memory.exchanges = ()
    # "accuracy": the fastest fitting configuration of the first exchange that has one (a
    # lossy residual only where no more accurate one fits); "speed": the fastest of all.
    c.memory.prefer = "accuracy"
    # Threads compiling the planner's candidates at once (XLA compiles release the GIL);
    # 0 = the cores no other process is using (os.getloadavg), at least 1.
    c.memory.compile_threads = 0
    # The memory report at the start of a run shows the compiled peak of the step it
    # trains (compiled once, then run); True adds plain error feedback's and the dense
    # exchange's compiled peaks beside it (two more compilations).
    c.memory.compare_baselines = False

    # JAX's persistent compilation cache: compiled programs are stored here and a later
    # run of the same programs (a second --plan_only, a resumed run) loads them instead of
    # compiling. None = $JAX_COMPILATION_CACHE_DIR if set, else WORKDIR/compilation_cache;
    # "" = off.
    c.compilation_cache_dir = config_dict.placeholder(str)

    c.log_every = 10
    c.eval_every = 100
    c.checkpoint_every = 100
    c.keep_checkpoints = 3
    c.on_worker_change = "error"  # or "average": see train/checkpointing.py
    # What orders each in-place weight update after the reads of the old weight
    # (resireduce_jax.parallel.data_parallel_step): "last_read" (no weight copied),
    # "all_gradients" or "unordered" (XLA copies the weights; the lower peak with Adan-R
    # or optax's own optimizers under the default guard, benchmarks/results/guard_cost.md).
    c.weight_update_order = "last_read"

    c.residual_analysis = ml_collections.ConfigDict()
    c.residual_analysis.layers = ""  # regex on leaf paths; "" disables
    c.residual_analysis.every = 0  # steps between snapshots; 0 = only at the end
    c.residual_analysis.bins = 101
    return c


def parse_variant(variant: str) -> tuple[str, str]:
    """``"w+2d"`` -> ``("weighted", "2d")``; ``"ef"`` -> ``("none", "none")``."""
    inter_names = {"a": "average", "w": "weighted"}
    intra_names = {"d": "rows", "2d": "2d"}
    if variant == "ef":
        return "none", "none"
    inter, intra = "none", "none"
    for part in variant.split("+"):
        if part in inter_names:
            inter = inter_names[part]
        elif part in intra_names:
            intra = intra_names[part]
        else:
            raise ConfigError(
                f"compression.variant={variant!r} is unknown; choose one of {list(VARIANTS)}."
            )
    return inter, intra


def split_variant(variant: str) -> tuple[str, str, str]:
    """``"w+2d+int4"`` -> ``("w+2d", "", "int4")``, ``"ef+bf16"`` -> ``("ef", "bfloat16",
    "")``: the exchange variant, its ``residual_dtype`` and its ``residual_format``."""
    for suffix, dtype in RESIDUAL_DTYPE_SUFFIXES.items():
        if variant.endswith(suffix) and variant.removesuffix(suffix) in VARIANTS:
            return variant.removesuffix(suffix), dtype, ""
    if variant in VARIANTS:
        return variant, "", ""
    base, sep, residual_format = variant.rpartition("+")
    if sep and base in VARIANTS and residual_format:
        if RESIDUAL_FORMAT.fullmatch(residual_format) is None:
            raise ValueError(
                f"variant {variant!r}: {residual_format!r} is not a residual format; choose "
                "'int8', 'float8', 'int4', 'int3', 'bfloat16' or 'float32', optionally with a "
                "block size and rounding, e.g. 'ef+int4/64/stochastic'."
            )
        return base, "", residual_format
    raise ValueError(
        f"variant {variant!r}; choose one of {list(VARIANTS)}, optionally with "
        f"one of {list(RESIDUAL_DTYPE_SUFFIXES)} or '+<residual format>' (e.g. 'ef+int4')."
    )


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _known_keys(
    reference: ml_collections.ConfigDict, config: ml_collections.ConfigDict, prefix: str
):
    free_form = {"dataset", "model.overrides", "optimizer.kwargs", "compression.options"}
    for key in config:
        path = f"{prefix}{key}"
        if key not in reference:
            close = difflib.get_close_matches(key, list(reference.keys()), 1, 0.75)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else "."
            raise ConfigError(
                f"Unknown config key '{path}'{hint} Valid keys here: {sorted(reference.keys())}."
            )
        value, ref = config[key], reference[key]
        if isinstance(ref, ml_collections.ConfigDict) and path not in free_form:
            _check(isinstance(value, ml_collections.ConfigDict), f"'{path}' must be a section.")
            _known_keys(ref, value, path + ".")


def validate(config: ml_collections.ConfigDict, *, known_models=None, known_datasets=None) -> None:
    """Raises :class:`ConfigError` naming the key, the bad value and the valid choices."""
    _known_keys(base_config(), config, "")
    c = config
    _check(isinstance(c.num_workers, int) and c.num_workers >= 1, "num_workers must be >= 1.")
    _check(
        not c.init_from or os.path.isdir(os.path.join(c.init_from, "checkpoints")),
        f"init_from={c.init_from!r} holds no checkpoints/ directory: point it at the workdir "
        "of a finished run (python -m train ... --workdir DIR).",
    )
    _check(
        c.local_devices is None
        or (isinstance(c.local_devices, int) and not isinstance(c.local_devices, bool)),
        f"local_devices must be an integer (devices per node) or unset, got {c.local_devices!r}.",
    )
    _check(
        not c.local_devices or (c.local_devices >= 1 and c.num_workers % c.local_devices == 0),
        f"local_devices={c.local_devices} must be >= 1 and divide num_workers={c.num_workers} "
        "(every node has the same number of devices); unset it (or 0) for the flat exchange.",
    )
    _check(
        isinstance(c.model.scan_layers, bool),
        f"model.scan_layers must be true or false, got {c.model.scan_layers!r}.",
    )
    _check(c.batch_size_per_worker >= 1, "batch_size_per_worker must be >= 1.")
    _check(
        (c.num_steps is None) != (c.num_epochs is None),
        "Set exactly one of num_steps and num_epochs "
        f"(got num_steps={c.num_steps}, num_epochs={c.num_epochs}).",
    )
    if c.num_steps is not None:
        _check(c.num_steps >= 1, f"num_steps must be >= 1, got {c.num_steps}.")
    else:
        _check(c.num_epochs > 0, f"num_epochs must be > 0, got {c.num_epochs}.")
    if known_models is not None:
        _check(
            c.model.name in known_models,
            f"model.name={c.model.name!r} is unknown; choose one of {sorted(known_models)}.",
        )
    if known_datasets is not None:
        _check(
            c.dataset.name in known_datasets,
            f"dataset.name={c.dataset.name!r} is unknown; choose one of {sorted(known_datasets)}.",
        )

    comp = c.compression
    _check(
        comp.variant in VARIANTS,
        f"compression.variant={comp.variant!r}; choose one of {list(VARIANTS)}.",
    )
    _check(
        isinstance(comp.density, int | float) and 0 < comp.density <= 1,
        f"compression.density must be in (0, 1], got {comp.density!r}: it is the fraction "
        "of elements each worker sends (0.01 sends 1 %).",
    )
    sched = comp.density_schedule
    _check(
        0 <= sched.dense_fraction < 1
        and 0 <= sched.dgc_fraction < 1
        and sched.dense_fraction + sched.dgc_fraction < 1,
        "compression.density_schedule.dense_fraction and .dgc_fraction must be in [0, 1) "
        f"with a sum below 1 (fractions of the run's steps), got {sched.dense_fraction} and "
        f"{sched.dgc_fraction}.",
    )
    _check(
        sched.dense_dtype in ("", "bfloat16", "float16"),
        "compression.density_schedule.dense_dtype must be '' (the gradients' dtype), "
        f"'bfloat16' or 'float16', got {sched.dense_dtype!r}.",
    )
    _check(
        0 < sched.dgc_start <= 1 and sched.dgc_factor > 1,
        "compression.density_schedule.dgc_start must be in (0, 1] and .dgc_factor > 1 (the "
        f"density falls stage by stage), got {sched.dgc_start} and {sched.dgc_factor}.",
    )
    _check(
        comp.selection_scope in ("leaf", "global"),
        f"compression.selection_scope must be 'leaf' or 'global', got {comp.selection_scope!r}.",
    )
    if comp.selection_scope == "global":
        _check(
            comp.variant != "dgc" and comp.compressor == "topk",
            "compression.selection_scope='global' (whole-model Top-k) takes "
            "compression.compressor='topk' and any variant but 'dgc'; got "
            f"{comp.compressor!r} with {comp.variant!r}.",
        )
        _check(
            not c.local_devices and not c.model.scan_layers,
            "compression.selection_scope='global' ranks whole leaves on a flat exchange: "
            "unset local_devices and model.scan_layers, or use selection_scope='leaf'.",
        )
    if c.optimizer.name == "compressed_momentum_adam":
        _check(
            sched.dense_fraction > 0,
            "optimizer.name='compressed_momentum_adam' estimates Adam's second moment in a "
            "dense warm-up: set compression.density_schedule.dense_fraction > 0 (e.g. 0.05).",
        )
    _check(
        c.optimizer.one_buffer in ONE_BUFFER,
        f"optimizer.one_buffer must be one of {sorted(ONE_BUFFER)}, got "
        f"{c.optimizer.one_buffer!r}.",
    )
    if c.optimizer.one_buffer == "on":
        _check(
            c.optimizer.name.startswith("compressed_momentum_"),
            f"optimizer.one_buffer={c.optimizer.one_buffer!r} is the compressed-momentum "
            f"optimizers' (got optimizer.name={c.optimizer.name!r}); set it to 'off'.",
        )
    _check(
        re.fullmatch(r"float32|int8(/[1-9]\d*)?", str(c.optimizer.frozen_nu_format)) is not None,
        "optimizer.frozen_nu_format must be 'float32', 'int8' or 'int8/<block size>', got "
        f"{c.optimizer.frozen_nu_format!r}.",
    )
    _check(
        c.optimizer.frozen_nu_format == "float32" or c.optimizer.name == "compressed_momentum_adam",
        f"optimizer.frozen_nu_format={c.optimizer.frozen_nu_format!r} is "
        f"compressed_momentum_adam's frozen second moment (got optimizer.name="
        f"{c.optimizer.name!r}); set it to 'float32'.",
    )
    _check(
        c.optimizer.frozen_nu_format == "float32"
        or dict(c.optimizer.kwargs).get("compressed") != "momentum",
        f"optimizer.frozen_nu_format={c.optimizer.frozen_nu_format!r} with "
        "optimizer.kwargs.compressed='momentum': the int8 frozen v is a per-worker buffer, "
        "so the averaged momentum cannot be divided by it after the exchange; drop "
        "kwargs.compressed (the default 'update' divides before it) or set "
        "optimizer.frozen_nu_format='float32'.",
    )
    if c.optimizer.one_buffer == "on":
        _check(
            comp.variant == "ef" and comp.selection_scope == "leaf",
            "optimizer.one_buffer='on' keeps each worker's momentum in its leaf's own "
            f"residual store: compression.variant='ef' (got {comp.variant!r}) with "
            "selection_scope='leaf'; a shared or 2-D store cannot hold a member's momentum "
            "('auto' uses it where the store allows).",
        )
    if c.optimizer.name.startswith("compressed_momentum_"):
        _check(
            comp.variant != "dgc",
            f"optimizer.name={c.optimizer.name!r} exchanges its momentum itself; "
            "compression.variant='dgc' is DGC's own memory: use 'ef', 'none', 'dense' or a "
            "ResiReduce variant ('w+2d', ...).",
        )
    if comp.variant == "dgc":
        _check(
            c.optimizer.name == "sgd",
            "compression.variant='dgc' is DGC's memory with its own momentum correction, "
            f"followed by SGD without momentum: set optimizer.name='sgd' (got "
            f"{c.optimizer.name!r}); optimizer.kwargs.momentum is DGC's momentum.",
        )
    _check(
        comp.grouping in ("auto", "regex"),
        f"compression.grouping={comp.grouping!r}; choose 'auto' or 'regex'.",
    )
    if comp.grouping == "regex":
        _check(len(comp.rules) > 0, "compression.grouping='regex' needs compression.rules.")
    for rule in comp.rules:
        _check(
            isinstance(rule, tuple | list) and len(rule) == 2,
            f"compression.rules entries are (pattern, label template) pairs, got {rule!r}.",
        )
        try:
            re.compile(rule[0])
        except re.error as e:
            raise ConfigError(f"compression.rules pattern {rule[0]!r} is invalid: {e}.") from None
    _check(comp.max_group_size >= 0, "compression.max_group_size must be >= 0 (0 = unlimited).")
    _check(
        comp.residual_dtype in RESIDUAL_DTYPES,
        f"compression.residual_dtype={comp.residual_dtype!r}; choose one of "
        f"{list(RESIDUAL_DTYPES)}.",
    )
    _check(
        comp.residual_dtype != FLOAT8
        or (
            config.optimizer.name == "compressed_momentum_adam"
            and dict(config.optimizer.kwargs).get("compressed", "update") == "update"
        ),
        f"compression.residual_dtype={FLOAT8!r} with optimizer.name={config.optimizer.name!r} "
        f"(kwargs {dict(config.optimizer.kwargs)}): "
        "float8 (e4m3) keeps magnitudes from 2**-9 to 448, which fits the residual of "
        "compressed_momentum_adam (kept in the units of its update, about 1, unless it "
        "compresses the raw momentum: compressed='momentum') but would "
        "flush most of a gradient's residual to zero; choose optimizer.name="
        "'compressed_momentum_adam' or residual_dtype='bfloat16'.",
    )
    residual_format = comp.get("residual_format", "")
    _check(
        RESIDUAL_FORMAT.fullmatch(residual_format) is not None,
        f"compression.residual_format={residual_format!r}; choose '' (residual_dtype's), "
        "'float32', 'bfloat16', 'int8', 'float8', 'int4', 'int3', or one of the last four with a "
        "block size and rounding, e.g. 'int4/64/stochastic'.",
    )
    _check(
        not (residual_format and comp.residual_dtype),
        f"compression.residual_format={residual_format!r} and compression.residual_dtype="
        f"{comp.residual_dtype!r}: give one (residual_dtype is an alias of a float format).",
    )
    _check(
        not residual_format or comp.variant not in ("dense", "none"),
        f"compression.residual_format={residual_format!r} with compression.variant="
        f"{comp.variant!r}: this variant keeps no residuals; unset the format "
        "(--config.compression.residual_format='') or choose a variant with residuals "
        "(ef, dgc, w+2d, ...).",
    )
    _check(
        not comp.residual_dtype or comp.variant not in ("dense", "none", "dgc"),
        f"compression.residual_dtype={comp.residual_dtype!r} with compression.variant="
        f"{comp.variant!r}: "
        + (
            "DGC keeps its own momentum and velocity buffers in the gradients' dtype or "
            "a compression.residual_format"
            if comp.variant == "dgc"
            else "this variant keeps no residuals"
        )
        + "; unset residual_dtype or choose a variant with residuals (ef, w+2d, ...).",
    )
    _check(
        comp.nonfinite in ("skip", "raise"),
        f"compression.nonfinite={comp.nonfinite!r}; choose 'skip' or 'raise'.",
    )
    _check(
        comp.guard_mode in GUARD_MODES,
        f"compression.guard_mode={comp.guard_mode!r}; choose one of "
        f"{', '.join(map(repr, GUARD_MODES))}.",
    )
    _check(
        c.weight_update_order in WEIGHT_UPDATE_ORDERS,
        f"weight_update_order={c.weight_update_order!r}; choose one of "
        f"{', '.join(map(repr, WEIGHT_UPDATE_ORDERS))}.",
    )
    _check(
        c.on_worker_change in ("error", "average"),
        f"on_worker_change={c.on_worker_change!r}; choose 'error' or 'average'.",
    )
    _check(
        c.schedule.name in SCHEDULES,
        f"schedule.name={c.schedule.name!r}; choose one of {list(SCHEDULES)}.",
    )
    _check(
        c.optimizer.learning_rate > 0,
        f"optimizer.learning_rate must be > 0, got {c.optimizer.learning_rate}.",
    )
    _check(c.optimizer.weight_decay >= 0, "optimizer.weight_decay must be >= 0.")
    for name in ("log_every", "eval_every", "checkpoint_every"):
        _check(c[name] >= 1, f"{name} must be >= 1, got {c[name]}.")
    if c.remat.budget:
        from resireduce_jax.remat import parse_budget
        from train.remat_model import budget_value

        try:
            parse_budget(budget_value(c.remat.budget))
        except ValueError as error:
            raise ConfigError(f"remat.budget={c.remat.budget!r}: {error}") from None
    if c.memory.budget is not None:
        try:
            parse_memory_budget(c.memory.budget)
        except ValueError as error:
            raise ConfigError(f"memory.budget={c.memory.budget!r}: {error}") from None
        _check(
            not c.remat.budget,
            f"memory.budget={c.memory.budget!r} plans activation checkpointing itself; unset "
            f"remat.budget={c.remat.budget!r} (or memory.budget).",
        )
    _check(
        c.memory.prefer in ("accuracy", "speed"),
        f"memory.prefer={c.memory.prefer!r}; choose 'accuracy' or 'speed'.",
    )
    _check(
        isinstance(c.memory.exchanges, tuple | list)
        and all(isinstance(e, str) for e in c.memory.exchanges),
        f"memory.exchanges must be a list of residual variants such as ['ef', 'ef+int8'], got "
        f"{c.memory.exchanges!r}.",
    )
    for exchange in c.memory.exchanges:
        try:
            variant = split_variant(exchange)[0]
        except ValueError as error:
            raise ConfigError(f"memory.exchanges: {error}") from None
        _check(
            variant not in ("dense", "none", "dgc"),
            f"memory.exchanges={list(c.memory.exchanges)!r}: {exchange!r} keeps no residuals "
            "for the planner to reduce; list residual variants (ef, w+2d, ... with a format).",
        )
    _check(
        isinstance(c.memory.compile_threads, int)
        and not isinstance(c.memory.compile_threads, bool)
        and c.memory.compile_threads >= 0,
        f"memory.compile_threads must be an integer >= 0 (0 = the idle cores), got "
        f"{c.memory.compile_threads!r}.",
    )
    _check(
        c.compilation_cache_dir is None or isinstance(c.compilation_cache_dir, str),
        f"compilation_cache_dir must be a directory, '' (off) or unset (the workdir's), got "
        f"{c.compilation_cache_dir!r}.",
    )
    _check(c.residual_analysis.bins >= 2, "residual_analysis.bins must be >= 2.")


# resireduce_jax.planner.parse_budget, spelled out so that a bad memory.budget is reported
# before jax is imported (tests/test_train.py checks that the two agree).
def _load_budget_module():
    """``resireduce_jax/planner/budget.py`` (standard library only), loaded from its file so
    that reading a budget imports neither the package nor jax."""
    package = importlib.util.find_spec("resireduce_jax")
    path = os.path.join(package.submodule_search_locations[0], "planner", "budget.py")
    spec = importlib.util.spec_from_file_location("_resireduce_jax_budget", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_memory_budget(budget: int | float | str) -> int:
    """``memory.budget`` in bytes: :func:`resireduce_jax.planner.parse_budget` itself,
    before jax is imported. Raises ValueError with the accepted forms."""
    return _load_budget_module().parse_budget(budget)


def local_devices(config: ml_collections.ConfigDict) -> int | None:
    """``config.local_devices`` as the mesh takes it: ``None`` (flat) for unset or 0."""
    return config.get("local_devices") or None


def check_processes(config: ml_collections.ConfigDict, num_processes: int) -> None:
    """Raises :class:`ConfigError` if the workers do not split over ``num_processes``, or a
    node (``local_devices``) would span processes."""
    _check(
        config.num_workers % num_processes == 0,
        f"num_workers={config.num_workers} does not split over {num_processes} processes; set "
        "--config.num_workers to a multiple of --num_processes.",
    )
    per_process = config.num_workers // num_processes
    local = local_devices(config)
    _check(
        local is None or per_process % local == 0,
        f"local_devices={local} does not fit {per_process} devices per process "
        f"(num_workers={config.num_workers} over {num_processes} processes): a node's devices "
        f"must belong to one process; run one process per node (local_devices={per_process}) "
        "or use a local_devices that divides the devices per process.",
    )


def model_overrides(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The fields of the model configuration that the config sets: ``model.overrides``,
    and ``scan_layers`` when ``model.scan_layers`` is on."""
    overrides = free_form(config.model.overrides)
    if config.model.get("scan_layers"):
        overrides["scan_layers"] = True
    return overrides


def free_form(section: ml_collections.ConfigDict) -> dict[str, Any]:
    """A free-form section (model.overrides, optimizer.kwargs, ...) as a plain dict."""
    return section.to_dict() if isinstance(section, ml_collections.ConfigDict) else dict(section)
