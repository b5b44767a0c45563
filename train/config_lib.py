"""What the config files in ``configs/`` share: the reference's layer groups, sibling configs.

consecutive_layer_rules groups each weight role of consecutive layers, as the reference.
sibling_config loads a config next to the calling one, by path, from any directory.
paper_run is the paper's setting (§5.2): w+2d, top-k 1 %, the reference's groups.
adamw_cosine and cifar100_config are the transformer and CIFAR-100 recipes.
Details: docs/design.md, "Config helpers (train/config_lib.py)".
"""

from __future__ import annotations

import importlib.util
import os
import re
import types

import ml_collections

from train.config_schema import base_config

__all__ = [
    "CIFAR100_EPOCH_STEPS",
    "LAYERS_PER_GROUP",
    "adamw_cosine",
    "cifar100_config",
    "consecutive_layer_rules",
    "paper_run",
    "sibling_config",
]

#: Consecutive layers per residual group in the reference's transformer configurations.
LAYERS_PER_GROUP = 3

#: Steps of one CIFAR-100 epoch (50,000 images) at 8 workers x 32 images.
CIFAR100_EPOCH_STEPS = 1563


def consecutive_layer_rules(
    num_layers: int, scope: str, label: str, per_group: int = LAYERS_PER_GROUP
) -> tuple[tuple[str, str], ...]:
    """One :func:`resireduce_jax.grouping.regex` rule per run of ``per_group`` layers.

    Layer ``i``'s parameter ``x`` goes to group ``{label}{a}-{b}/x``, where ``a..b`` is the
    run holding ``i``, whether the layers are written out (``{scope}_{i}/x``) or scanned
    (``model.scan_layers``: slice ``i`` of the stacked ``{scope}/x`` is ``{scope}/{i}/x``,
    :mod:`resireduce_jax.layer_stacks`), so the groups of a scanned run are those of the
    written-out one (GPT-2: ``scope="h"``, ``label="h"``). Patterns are anchored
    (``^...$``): rules are ``re.search``-ed in paths.
    """
    rules = []
    for first in range(0, num_layers, per_group):
        last = min(first + per_group, num_layers) - 1
        members = "|".join(str(i) for i in range(first, last + 1))
        pattern = rf"^{re.escape(scope)}[_/]({members})/(.+)$"
        rules.append((pattern, rf"{label}{first}-{last}/\2"))
    return tuple(rules)


def sibling_config(config_file: str, name: str) -> types.ModuleType:
    """The config module ``name`` (``"gpt2_medium_wikitext"``) next to ``config_file``.

    Call it with the calling config's ``__file__``.
    """
    path = os.path.join(os.path.dirname(os.path.abspath(config_file)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"configs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def paper_run(
    c: ml_collections.ConfigDict,
    *,
    rules: tuple[tuple[str, str], ...],
    intra_layers: str,
    eval_every: int,
) -> None:
    """Sets what every paper config shares (§5.2, Table 1) on ``c``, in place.

    ResiReduce-w+2d with top-k at 1 % density, the reference's reusable groups as
    :func:`resireduce_jax.grouping.regex` ``rules`` (§4.1), intra-layer 2-D reduction on
    ``intra_layers`` (§4.3), a log line every 100 steps and an evaluation and a checkpoint
    every ``eval_every`` steps.
    """
    c.compression.variant = "w+2d"
    c.compression.compressor = "topk"
    c.compression.density = 0.01
    c.compression.grouping = "regex"
    c.compression.rules = rules
    c.compression.intra_layers = intra_layers
    c.log_every = 100
    c.eval_every = eval_every
    c.checkpoint_every = eval_every


def adamw_cosine(
    c: ml_collections.ConfigDict,
    *,
    learning_rate: float,
    eps: float,
    weight_decay: float,
    warmup_epochs: float,
) -> None:
    """Sets the transformer configs' optimizer and schedule on ``c``, in place.

    AdamW with betas (0.9, 0.999), a linear warm-up over ``warmup_epochs`` and a cosine
    decay to 0 (the reference decays linearly; the training program has no linear-decay
    schedule).
    """
    c.optimizer.name = "adamw"
    c.optimizer.learning_rate = learning_rate
    c.optimizer.kwargs = {"b1": 0.9, "b2": 0.999, "eps": eps}
    c.optimizer.weight_decay = weight_decay
    c.schedule.name = "warmup_cosine"
    c.schedule.warmup_epochs = warmup_epochs
    c.schedule.end_factor = 0.0


def cifar100_config(
    model: str, *, rules: tuple[tuple[str, str], ...], intra_layers: str
) -> ml_collections.ConfigDict:
    """A paper config for ``model`` on CIFAR-100 (§5.2, Table 1) with the reference's recipe.

    8 workers x 32 augmented images, 80 epochs; SGD with momentum 0.9, peak learning rate
    0.0125 x 8 workers = 0.1 after a 5-epoch linear warm-up, x0.1 at epochs 30 and 60,
    weight decay 5e-5 (L2, as torch's ``SGD(weight_decay=...)``); an evaluation and a
    checkpoint every epoch. Compression as :func:`paper_run`.
    """
    c = base_config()
    c.model.name = model
    c.dataset = {"name": "cifar100", "augment": True}
    c.num_workers = 8
    c.batch_size_per_worker = 32
    c.num_epochs = 80.0
    c.optimizer.name = "sgd"
    c.optimizer.learning_rate = 0.1
    c.optimizer.kwargs = {"momentum": 0.9}
    c.optimizer.weight_decay = 5e-5
    c.schedule.name = "warmup_piecewise"
    c.schedule.warmup_epochs = 5.0
    c.schedule.boundaries_epochs = (30.0, 60.0)
    c.schedule.decay_factor = 0.1
    paper_run(c, rules=rules, intra_layers=intra_layers, eval_every=CIFAR100_EPOCH_STEPS)
    return c
