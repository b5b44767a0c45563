"""Byte-level GPT-2 on CPython's pydoc topics (embedded text), 8 simulated workers.

The recommended recipe for Adam at top-k 1 % (docs/exchange.md, "Compressed momentum"):
dense AdamW for the first 12.5 % of the steps, sent in bfloat16 (the bytes of 6.25 % in
float32), then the second moment frozen and each worker's update direction sent
compressed, its residual kept by ResiReduce w+2d. At width 64 the 2-D rule
(``intra_layers="auto"``: singletons holding >= 10 % of the compressed elements) picks no
layer, the byte embedding holding just under that, so the groups alone reduce the
residuals; ``'--config.compression.intra_layers=^wte/embedding$'`` keeps the embedding's
residual in 2-D too, ``--config.compression.variant=ef`` is plain error feedback. The
perplexities these reach against dense, the bytes sent and the residual bytes:
benchmarks/results/accuracy_400/accuracy.md (this config's 400 steps) and
benchmarks/results/accuracy.md (1,200 steps).
``--config.optimizer.name=adamw`` with ``--config.compression.density_schedule.dense_fraction=0``
is error feedback on AdamW. The one-buffer form (each worker's momentum and error as one
int4 buffer in its own store, the frozen second moment as 8-bit codes; docs/exchange.md,
"One buffer for the momentum and its error"): ``--config.compression.variant=ef
--config.compression.residual_format=int4 --config.optimizer.one_buffer=on
--config.optimizer.frozen_nu_format=int8``.

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
    c.schedule.name = "warmup_cosine"
    c.schedule.warmup_epochs = 0.05
    c.schedule.end_factor = 0.1
    c.compression.variant = "w+2d"
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
