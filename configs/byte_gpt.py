"""Byte-level GPT-2 on CPython's pydoc topics (embedded text), 8 simulated workers.

The recommended recipe for Adam at top-k 1 % (docs/exchange.md, "Compressed momentum"):
dense AdamW for the first 12.5 % of the steps, sent in bfloat16 (the bytes of 6.25 % in
float32), then the second moment frozen, as 8-bit codes, and each worker's update
direction sent compressed. Each worker keeps its momentum and its error as one buffer
(docs/exchange.md, "One buffer for the momentum and its error"), in int4 codes with
nearest rounding: the point of the memory-accuracy frontier
(benchmarks/results/accuracy_formats/accuracy.md) that keeps the fewest bytes within 3 %
of float32 error feedback's perplexity on this config's task.

The paper's ResiReduce: ``--config.compression.variant=w+2d
--config.compression.residual_format= --config.optimizer.one_buffer=off
--config.optimizer.frozen_nu_format=float32`` (two float32 buffers, residuals shared by
groups; ``'--config.compression.intra_layers=^wte/embedding$'`` keeps the embedding's in
2-D too, since at width 64 the "auto" rule picks no layer). Plain error feedback on
AdamW: ``--config.optimizer.name=adamw --config.optimizer.one_buffer=off
--config.optimizer.frozen_nu_format=float32
--config.compression.density_schedule.dense_fraction=0``.

python -m train --config configs/byte_gpt.py --workdir /tmp/rr_bytes
"""

from train.config_schema import base_config


def get_config():
    c = base_config()
    c.model.name = "byte_gpt"
    c.model.overrides = {"num_layers": 3, "width": 64, "num_heads": 4, "max_len": 64}
    c.dataset = {"name": "pydoc_text", "context_length": 64}
    c.num_workers = 8
    c.batch_size_per_worker = 8
    c.num_steps = 400
    c.optimizer.name = "compressed_momentum_adam"
    c.optimizer.learning_rate = 3e-3
    c.optimizer.kwargs = {"b1": 0.9, "b2": 0.95}
    c.optimizer.weight_decay = 0.01
    c.optimizer.max_grad_norm = 1.0
    c.optimizer.one_buffer = "on"  # the momentum kept in each worker's residual store
    c.optimizer.frozen_nu_format = "int8"
    c.schedule.name = "warmup_cosine"
    c.schedule.warmup_epochs = 0.05
    c.schedule.end_factor = 0.1
    c.compression.variant = "ef"
    c.compression.residual_format = "int4/128/nearest"
    c.compression.density = 0.01
    c.compression.density_schedule.dense_fraction = 0.125  # the warm-up that fixes v
    c.compression.density_schedule.dense_dtype = "bfloat16"
    c.compression.min_size = 1_000  # at width 64 every matrix is 4k-16k elements
    c.compression.grouping = "auto"
    c.compression.max_group_size = 3
    c.log_every = 20
    c.eval_every = 200
    c.checkpoint_every = 200
    return c
