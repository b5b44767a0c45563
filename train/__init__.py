"""The training program: configs, input pipeline, models, loop, checkpoints and metrics."""
