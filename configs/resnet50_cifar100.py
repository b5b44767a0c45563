"""ResiReduce paper (§5.2, Table 1): ResNet-50 on CIFAR-100, 8 workers, top-k 1 %, w+2d.

Full scale, for a GPU cluster (8 workers x 32 images). Hyperparameters follow the
reference code's ``examples/cv/cifar100_resnet50_topk_resireduce.py`` (Horovod defaults of
Goyal et al. 2017): SGD with momentum 0.9, peak learning rate 0.0125 x 8 workers = 0.1
reached by a linear warm-up over 5 epochs, x0.1 at epochs 30 and 60, 80 epochs, weight
decay 5e-5 (L2 added to the averaged gradient, as torch's ``SGD(weight_decay=...)``).
Augmentation is random crop (4-pixel padding) and horizontal flip; the reference also
rotates by up to 15 degrees, which this input pipeline does not do.

Reusable groups (§4.1, reference ``resir_lib/memory/resireducern50.py``, which groups the
parameters ``conv{2..5}_x.{block}.residual_function.{0,3,6}.weight`` of the
pytorch-cifar100 ResNet that the reference trains): in every stage, the convolution at the same
bottleneck position (conv1 / conv2 / conv3) shares one residual across the stage's blocks
(Fig. 4a: the six conv blocks of stage "Conv4" share one). Block 0's conv1 stays alone (its
input has 4x fewer channels than the later blocks' conv1; stage 1's, 64x64, travels dense
by size); the projection shortcuts (``downsample_conv``) stay alone too. The reference has
no 2-D layer for ResNet-50; here ``intra_layers="auto"`` selects none under w+2d (the
largest singleton holds under 10 % of the compressed elements), so w+2d stores exactly what
the reference's w does.

One difference remains: the reference sends the classifier's ``fc.weight`` uncompressed
(``resir_lib/utils.py``, ``check_not_compress``), so it has no residual there in any
scheme. This library has no per-path "send dense" option yet, so training with this
config compresses ``fc/kernel`` (2048 x 100) with its own residual, 0.8 MB per worker more
than the reference in EF and in w+2d alike. ``benchmarks/memory_figures.py`` applies the
reference's rule; its page, benchmarks/results/memory_figures.md, gives w+2d's saving
either way.

    python -m train --config configs/resnet50_cifar100.py --workdir /tmp/rr_resnet50
"""

from train.config_lib import cifar100_config

# (pattern, label) pairs for resireduce_jax.grouping.regex: the first pattern re.search
# finds in a path wins; anchored, so each matches whole paths.
RULES = (
    # Block 0's conv1 reads the previous stage's output (a different shape): a singleton.
    (r"^layer\d_0/conv1/kernel$", r"\g<0>"),
    # The same bottleneck position across a stage's blocks: one shared residual.
    (r"^layer(\d)_\d+/conv(\d)/kernel$", r"stage\1/conv\2"),
)


def get_config():
    return cifar100_config("resnet50_cifar", rules=RULES, intra_layers="auto")
