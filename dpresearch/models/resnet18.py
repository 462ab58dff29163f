"""ResNet-18, CIFAR variant: the ImageNet ResNet-18 body (4 stages of 2 basic blocks, 64–512
channels, projection shortcuts) with a 3×3 stride-1 stem and no max-pool, so 32×32 inputs keep
enough resolution. This is the variant most CIFAR papers and repositories call "ResNet-18";
11,173,962 parameters for 10 classes. `width` (default 64) narrows every stage in proportion
(width, 2·width, 4·width, 8·width channels) for studies a CPU can carry: width 8 keeps the
architecture and the layers' aspect ratios (what PowerSGD's low-rank factors act on) at 1/64 of
the compute.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from dpresearch.models import init_weights
from dpresearch.models.resnet_cifar import make_stage, zero_init_last_bn


class ResNet18(nn.Module):
    """ResNet-18 for small images.

    Args: `num_classes`; `input_shape` (C, H, W) — any H, W work thanks to global pooling;
    `zero_init_residual` zero-initialises each block's last BN weight; `width`: the first
    stage's channels (64 in ResNet-18), doubled at each later stage.
    """

    def __init__(
        self,
        num_classes: int,
        input_shape: Sequence[int] = (3, 32, 32),
        zero_init_residual: bool = False,
        width: int = 64,
    ) -> None:
        super().__init__()
        if int(width) < 1:
            raise ValueError(f"model.width={width}: must be a positive number of channels")
        w = int(width)
        self.stem = nn.Sequential(
            nn.Conv2d(int(input_shape[0]), w, 3, 1, 1, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(inplace=True),
        )
        # Shortcut "B" (1×1 projection) where the shape changes, as in the ImageNet ResNet-18.
        self.stage1 = make_stage(w, w, 2, 1, "B")
        self.stage2 = make_stage(w, 2 * w, 2, 2, "B")
        self.stage3 = make_stage(2 * w, 4 * w, 2, 2, "B")
        self.stage4 = make_stage(4 * w, 8 * w, 2, 2, "B")
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8 * w, num_classes)
        init_weights(self)
        if zero_init_residual:
            zero_init_last_bn(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stage4(self.stage3(self.stage2(self.stage1(self.stem(x)))))
        return self.fc(self.pool(x).flatten(1))
