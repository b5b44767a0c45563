"""ResiReduce paper (§5.2, Table 1): GPT-2 medium on WikiText-103, 8 workers, top-k 1 %, w+2d.

Full scale, for a GPU cluster. Data: the raw WikiText-103 files and GPT-2's byte-level BPE
``tokenizer.json`` (see ``docs/data.md``; set the three paths below, e.g. with
``--config.dataset.train_files=...``), windows of 1024 tokens. Hyperparameters follow the
reference code (``examples/nlp/gpt2/run_gpt2_resireduce.{py,sh}``, HuggingFace's
``run_clm_no_trainer``): 8 workers x 2 sequences, 2 epochs, AdamW with learning rate 5e-5,
betas (0.9, 0.999), eps 1e-8, no weight decay, no warm-up. Two differences: the
reference decays the learning rate linearly to 0, this config uses a cosine decay to 0
(the training program has no linear-decay schedule), and the reference fine-tunes the
pretrained ``gpt2-medium`` while this program starts from a random initialization.

Reusable groups (§4.1, reference ``resireducegpt2.py``): each weight role of three
consecutive blocks (``h_0-2``, ``h_3-5``, ... ``h_21-23``) shares one residual: 8 groups
for each of ``attn/c_attn``, ``attn/c_proj``, ``mlp/c_fc`` and ``mlp/c_proj`` kernels
(biases and LayerNorms are below ``min_size`` and travel dense). Intra-layer 2-D
reduction (§4.3) applies to the token embedding ``wte`` (50257 x 1024, which is also the
tied LM head), as the reference's ``is_dim_compress`` does; ``wpe`` keeps a full residual.

    python -m train --config configs/gpt2_medium_wikitext.py --workdir /tmp/rr_gpt2m \
        --config.dataset.train_files=$DATA/wikitext-103-raw/wiki.train.raw \
        --config.dataset.eval_files=$DATA/wikitext-103-raw/wiki.valid.raw \
        --config.dataset.tokenizer=$DATA/gpt2/tokenizer.json
"""

from train.config_lib import adamw_cosine, consecutive_layer_rules, paper_run
from train.config_schema import base_config

NUM_LAYERS = 24


def group_rules(num_layers: int) -> tuple:
    """One rule per run of three consecutive blocks: ``h_{i}/x`` (scanned: the slice
    ``h/{i}/x``) -> ``h{a}-{b}/x``."""
    return consecutive_layer_rules(num_layers, scope="h", label="h")


def get_config():
    c = base_config()
    c.model.name = "gpt2_medium"
    c.dataset = {
        "name": "text_files",
        "train_files": "~/data/wikitext-103-raw/wiki.train.raw",
        "eval_files": "~/data/wikitext-103-raw/wiki.valid.raw",
        "tokenizer": "~/data/gpt2/tokenizer.json",
        "context_length": 1024,
    }
    c.num_workers = 8
    c.batch_size_per_worker = 2
    c.num_epochs = 2.0
    adamw_cosine(c, learning_rate=5e-5, eps=1e-8, weight_decay=0.0, warmup_epochs=0.0)
    paper_run(c, rules=group_rules(NUM_LAYERS), intra_layers=r"^wte/embedding$", eval_every=5000)
    return c
