"""VGG (Simonyan & Zisserman 2015) with BatchNorm, CIFAR variant.

The convolutional body is the paper's (configurations A/B/D/E = VGG-11/13/16/19, each 3×3 conv
followed by BatchNorm and ReLU, five 2×2 max-pools). For 32×32 inputs the body ends at 512×1×1, so
the CIFAR variant replaces the three 4096-wide fully connected layers by a single linear
classifier 512→num_classes — the common choice in CIFAR work. Convolutions followed by BatchNorm
have no bias (BN's shift makes it redundant): 9,228,362 parameters for VGG-11 and 14,724,042 for
VGG-16 with 10 classes. Larger inputs are average-pooled to 1×1 first.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from dpresearch.models import init_weights

# Output channels per conv layer; "M" is a 2×2 max-pool.
CONFIGS: dict[int, list[int | str]] = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    13: [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", *[512] * 4, "M", *[512] * 4, "M"],
}


class VGG(nn.Module):
    """VGG-`depth` with BatchNorm (depth 11, 13, 16 or 19).

    Args: `num_classes`; `input_shape` (C, H, W) with H, W >= 32 (five halvings); `depth`;
    `batch_norm` (default True; False gives the original BN-free network, which needs a small
    learning rate to train).
    """

    def __init__(
        self,
        num_classes: int,
        input_shape: Sequence[int] = (3, 32, 32),
        depth: int = 11,
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        if depth not in CONFIGS:
            raise ValueError(f"model.depth={depth} is not a VGG depth; use one of: 11, 13, 16, 19")
        channels, height, width = (int(s) for s in input_shape)
        if min(height, width) < 32:
            raise ValueError(
                f"VGG needs inputs of at least 32×32 (five 2×2 max-pools), got {height}×{width}; "
                "choose a ResNet for smaller images"
            )
        layers: list[nn.Module] = []
        for spec in CONFIGS[depth]:
            if spec == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            out = int(spec)
            layers.append(nn.Conv2d(channels, out, 3, padding=1, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.ReLU(inplace=True))
            channels = out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(512, num_classes)
        init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.pool(self.features(x)).flatten(1))
