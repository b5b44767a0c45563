"""ResiReduce paper (§5.2, Table 1): VGG-19-bn on CIFAR-100, 8 workers, top-k 1 %, w+2d.

Full scale, for a GPU cluster (8 workers x 32 images). The model is torchvision's
``vgg19_bn`` with its 1000-way classifier, as the reference code trains it on CIFAR-100
(``examples/cv/cifar100_vgg19_topk_resireduce.py``: ``models.vgg19_bn()``; the paper's
548.1 MB is exactly its 143.7 M float32 parameters); 32x32 inputs are pooled to 7x7 by the
adaptive average pool. Hyperparameters as the reference: SGD with momentum 0.9, peak
learning rate 0.0125 x 8 = 0.1 after a 5-epoch linear warm-up, x0.1 at epochs 30 and 60,
80 epochs, weight decay 5e-5 (L2, as torch's ``SGD(weight_decay=...)``). The reference
also rotates images by up to 15 degrees, which this input pipeline does not do.

Reusable groups (§4.1, reference ``resireducevgg19.py``; torchvision feature indices): the
same-shape 3x3 convolutions between two max-pools share one residual: features 17/20/23
(256->256), 30/33/36 (512->512) and 40/43/46/49 (512->512). The first convolution of each
stage changes the channel count and stays alone; features 0 (1,728 values) travels dense,
by size here and by name in the reference (``resir_lib/utils.py``, ``check_not_compress``).
Intra-layer 2-D reduction (§4.3, ResiReduce-2d) applies to ``classifier_0`` (25088 x 4096,
72 % of all parameters), the layer the reference compresses (``is_dim_compress``:
``classifier.0.weight``).

    python -m train --config configs/vgg19_cifar100.py --workdir /tmp/rr_vgg19
"""

from train.config_lib import cifar100_config

RULES = (  # anchored: grouping.regex re.search-es paths
    (r"^features_(17|20|23)/kernel$", "features_17-23"),
    (r"^features_(30|33|36)/kernel$", "features_30-36"),
    (r"^features_(40|43|46|49)/kernel$", "features_40-49"),
)
INTRA_LAYERS = r"^classifier_0/kernel$"


def get_config():
    return cifar100_config("vgg19_bn", rules=RULES, intra_layers=INTRA_LAYERS)
