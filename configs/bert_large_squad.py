"""ResiReduce paper (§5.2, Table 1): BERT-large on SQuAD v1.1, 8 workers, top-k 0.1 %, w+2d.

Full scale, for a GPU cluster: ``bert_base_squad.py`` (data, hyperparameters of the
reference code and the differences from it, listed there) with the large model, the
``bert-large-uncased`` WordPiece vocabulary, the reference's BERT-large density (0.1 %,
``examples/nlp/bert_large/run_squad_large_resireduce.sh``) and its groups.

Reusable groups (§4.1, reference ``resireducebert.py``): each weight role of three
consecutive encoder layers (layers 0-2, 3-5, ..., 21-23) shares one residual: 8 groups for
each of the query, key, value, attention-output, intermediate and output kernels (biases
and LayerNorms are below ``min_size`` and travel dense). Intra-layer 2-D reduction (§4.3)
applies to the word embeddings (30522 x 1024), as the reference's ``is_dim_compress``.

    python -m train --config configs/bert_large_squad.py --workdir /tmp/rr_bert_large \
        --config.dataset.vocab_file=$DATA/uncased_L-24_H-1024_A-16/vocab.txt
"""

from train.config_lib import sibling_config

base = sibling_config(__file__, "bert_base_squad")

NUM_LAYERS = 24


def get_config():
    c = base.get_config()
    c.model.name = "bert_large"
    c.dataset.vocab_file = "~/data/bert/uncased_L-24_H-1024_A-16/vocab.txt"
    c.compression.density = 0.001  # the reference's BERT-large density
    c.compression.rules = base.group_rules(NUM_LAYERS)
    return c
