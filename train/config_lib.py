"""What the config files in ``configs/`` share: the reference's layer groups, sibling configs.

* :func:`consecutive_layer_rules`: the ResiReduce reference groups each weight role of a
  run of consecutive transformer layers into one residual (§4.1; ``resireducegpt2.py``,
  ``resireducebert.py``); the GPT-2 and BERT configs build their ``compression.rules``
  with it.
* :func:`sibling_config`: a config module next to the calling one, so that a large
  config can start from the medium / base one and override (flax-examples style). It
  loads by path, so it works however the calling config was loaded (``python -m train
  --config configs/x.py`` through ``ml_collections.config_flags``, or
  ``importlib.util.spec_from_file_location``) and from any working directory.
"""

from __future__ import annotations

import importlib.util
import os
import re
import types

__all__ = ["LAYERS_PER_GROUP", "consecutive_layer_rules", "sibling_config"]

#: Consecutive layers per residual group in the reference's transformer configurations.
LAYERS_PER_GROUP = 3


def consecutive_layer_rules(
    num_layers: int, scope: str, label: str, per_group: int = LAYERS_PER_GROUP
) -> tuple[tuple[str, str], ...]:
    """One :func:`resireduce_jax.grouping.regex` rule per run of ``per_group`` layers.

    Layer ``i``'s parameter ``x`` goes to group ``{label}{a}-{b}/x``, where ``a..b`` is the
    run holding ``i``, whether the layers are written out (``{scope}_{i}/x``) or scanned
    (``model.scan_layers``: slice ``i`` of the stacked ``{scope}/x`` is ``{scope}/{i}/x``,
    :mod:`resireduce_jax.layer_stacks`), so the groups of a scanned run are those of the
    written-out one (GPT-2: ``scope="h"``, ``label="h"``).
    """
    rules = []
    for first in range(0, num_layers, per_group):
        last = min(first + per_group, num_layers) - 1
        members = "|".join(str(i) for i in range(first, last + 1))
        rules.append((rf"{re.escape(scope)}[_/]({members})/(.+)", rf"{label}{first}-{last}/\2"))
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
