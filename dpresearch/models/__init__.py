"""Models, each a class usable as a Hydra `_target_`.

Contract: every model's constructor takes `num_classes: int` and `input_shape: Sequence[int]`
(C, H, W) — the trainer passes both from the data set — plus its own options, and maps a float
batch N×C×H×W to logits N×num_classes.
"""

from __future__ import annotations

from torch import nn


def init_weights(module: nn.Module) -> None:
    """Standard initialisation shared by the built-in CNNs: Kaiming-normal convolutions (fan-out,
    ReLU gain, as torchvision's ResNet), BatchNorm weight 1 / bias 0, zero conv biases; linear
    layers keep PyTorch's default."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
