"""ResiReduce paper (§5.2, Table 1): BERT-base on SQuAD v1.1, 8 workers, top-k 1 %, w+2d.

Full scale, for a GPU cluster. Data: tfds ``squad/v1.1`` and the ``bert-base-uncased``
WordPiece vocabulary (set ``dataset.vocab_file``; see ``docs/data.md``), sequences of 384
tokens with a document stride of 128. Hyperparameters follow the reference code
(``examples/nlp/bert_base/run_sqaud_resireduce.sh``, NVIDIA's ``run_squad.py``): 8 workers x
4 sequences, 4 epochs, learning rate 3e-5 with a linear warm-up over the first 10 % of
the steps, gradient norm clipped to 1.0 (BertAdam's default), weight decay 0.01. Three
differences: NVIDIA's BertAdam has no bias correction and does not decay biases and
LayerNorm weights, while this config uses optax's AdamW on all parameters; the reference
decays the learning rate linearly after the warm-up, this config uses a cosine decay to 0
(the training program has no linear-decay schedule); and the reference fine-tunes a
pretrained checkpoint while this program starts from a random initialization.

Reusable groups (§4.1, reference ``resireducebert.py``): each weight role of three
consecutive encoder layers (layers 0-2, 3-5, 6-8, 9-11) shares one residual: 4 groups for
each of the query, key, value, attention-output, intermediate and output kernels (biases
and LayerNorms are below ``min_size`` and travel dense). Intra-layer 2-D reduction (§4.3)
applies to the word embeddings (30522 x 768), as the reference's ``is_dim_compress``.

    python -m train --config configs/bert_base_squad.py --workdir /tmp/rr_bert_base \
        --config.dataset.vocab_file=$DATA/uncased_L-12_H-768_A-12/vocab.txt
"""

from train.config_lib import adamw_cosine, consecutive_layer_rules, paper_run
from train.config_schema import base_config

NUM_LAYERS = 12


def group_rules(num_layers: int) -> tuple:
    """One rule per run of three consecutive encoder layers, labelled by the run."""
    return consecutive_layer_rules(num_layers, scope="encoder/layer", label="encoder/layers_")


def get_config():
    c = base_config()
    c.model.name = "bert_base"
    c.dataset = {
        "name": "squad",
        "vocab_file": "~/data/bert/uncased_L-12_H-768_A-12/vocab.txt",
        "context_length": 384,
        "doc_stride": 128,
        "max_query_length": 64,
        "max_answer_length": 30,
        "lowercase": True,
    }
    c.num_workers = 8
    c.batch_size_per_worker = 4
    c.num_epochs = 4.0
    # warm-up: 10 % of 4 epochs
    adamw_cosine(c, learning_rate=3e-5, eps=1e-6, weight_decay=0.01, warmup_epochs=0.4)
    c.optimizer.max_grad_norm = 1.0
    paper_run(
        c,
        rules=group_rules(NUM_LAYERS),
        intra_layers=r"^embeddings/word_embeddings/embedding$",
        eval_every=2000,
    )
    return c
