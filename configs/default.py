"""The embedded main job: an MLP on scikit-learn's digits, 8 simulated workers, ResiReduce.

Everything ships with the installed packages (no download). Top-k at 1 % with ResiReduce
w+2d: adjacent same-shape hidden layers share one weighted residual, and the large input
layer keeps a 2-D compressed residual, every residual stored as int3 codes with a float32
scale per 128 values, rounded stochastically (``residual_formats``; the accuracy page
has its frontier). The paper's float32 w+2d is
``--config.compression.residual_format=float32``. Runs in about a minute on 2 CPU cores.

    python -m train --config configs/default.py --workdir /tmp/rr_digits
"""

from train.config_schema import base_config


def get_config():
    c = base_config()
    c.model.name = "digits_mlp"
    c.dataset.name = "digits"
    c.num_workers = 8
    c.batch_size_per_worker = 16
    c.num_steps = 600
    c.optimizer.name = "sgd"
    c.optimizer.learning_rate = 0.1
    c.optimizer.kwargs.momentum = 0.9
    c.schedule.name = "warmup_cosine"
    c.schedule.warmup_epochs = 1.0
    c.compression.variant = "w+2d"
    c.compression.residual_format = "int3"
    c.compression.density = 0.01
    c.compression.min_size = 10_000
    c.compression.grouping = "auto"
    c.compression.intra_layers = "hidden_0/kernel"  # input layer: a singleton, 2-D reduced
    c.log_every = 20
    c.eval_every = 200
    c.checkpoint_every = 200
    return c
