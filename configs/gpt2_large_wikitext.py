"""ResiReduce paper (§5.3, Fig. 9b): GPT-2 large on WikiText-103, 8 workers, top-k 1 %, w+2d.

Full scale, for a GPU cluster: ``gpt2_medium_wikitext.py`` (data, hyperparameters of the
reference code and the differences from it, listed there) with the large model and its
groups; the reference fine-tunes the pretrained ``gpt2-large`` while this program starts
from a random initialization.

Reusable groups (§4.1, reference ``resireducegpt2.py``) as for GPT-2 medium, over 36
blocks: 12 groups of three consecutive blocks (``h_0-2`` ... ``h_33-35``) for each of the
four kernel roles; intra-layer 2-D reduction (§4.3) on the token embedding ``wte``
(50257 x 1280, also the tied LM head).

    python -m train --config configs/gpt2_large_wikitext.py --workdir /tmp/rr_gpt2l \
        --config.dataset.train_files=$DATA/wikitext-103-raw/wiki.train.raw \
        --config.dataset.eval_files=$DATA/wikitext-103-raw/wiki.valid.raw \
        --config.dataset.tokenizer=$DATA/gpt2/tokenizer.json
"""

from train.config_lib import sibling_config

medium = sibling_config(__file__, "gpt2_medium_wikitext")

NUM_LAYERS = 36


def get_config():
    c = medium.get_config()
    c.model.name = "gpt2_large"
    c.compression.rules = medium.group_rules(NUM_LAYERS)
    return c
