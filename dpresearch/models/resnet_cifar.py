"""The CIFAR ResNets of He et al. 2016 ("Deep Residual Learning", §4.2): ResNet-20/32/44/56/110.

Depth 6n+2: a 3×3 stem convolution with 16 channels, three stages of n basic blocks with 16, 32
and 64 channels (the second and third start with stride 2), global average pooling and one linear
layer. Parameter counts for 10 classes with shortcut "A": 0.27M / 0.46M / 0.66M / 0.85M / 1.73M.

Shortcut options (where a block changes width or resolution; elsewhere the shortcut is identity):
- "A" (default, the paper's CIFAR choice): identity subsampled with stride 2 and zero-padded with
  the extra channels; parameter-free.
- "B": 1×1 convolution with stride 2 plus BatchNorm (projection); adds a few thousand parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from dpresearch.models import init_weights

SHORTCUTS = ("A", "B")


class PadShortcut(nn.Module):
    """Option-A shortcut: spatial subsampling by `stride`, then zero channels appended."""

    def __init__(self, extra_channels: int, stride: int) -> None:
        super().__init__()
        self.extra_channels = extra_channels
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, 0, self.extra_channels))


class BasicBlock(nn.Module):
    """Two 3×3 conv–BN layers and a shortcut: relu(bn2(conv2(relu(bn1(conv1 x)))) + shortcut x).

    `shortcut` ("A" or "B", see the module docstring) only matters when `stride != 1` or the
    width changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, shortcut: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module
        if stride == 1 and in_channels == out_channels:
            self.shortcut = nn.Identity()
        elif shortcut == "A":
            if out_channels < in_channels:
                raise ValueError("shortcut A cannot reduce the number of channels; use B")
            self.shortcut = PadShortcut(out_channels - in_channels, stride)
        elif shortcut == "B":
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            raise ValueError(f"model.shortcut={shortcut!r} is not known; use one of: A, B")

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def make_stage(
    in_channels: int, out_channels: int, num_blocks: int, stride: int, shortcut: str
) -> nn.Sequential:
    """`num_blocks` basic blocks; only the first changes width and applies `stride`."""
    blocks = [BasicBlock(in_channels, out_channels, stride, shortcut)]
    blocks += [BasicBlock(out_channels, out_channels, 1, shortcut) for _ in range(num_blocks - 1)]
    return nn.Sequential(*blocks)


def zero_init_last_bn(model: nn.Module) -> None:
    """Start every residual branch at zero (Goyal et al. 2017), so each block begins as its
    shortcut; helps large-batch training."""
    for m in model.modules():
        if isinstance(m, BasicBlock):
            nn.init.zeros_(m.bn2.weight)


class ResNetCifar(nn.Module):
    """ResNet-`depth` for CIFAR (depth = 6n+2: 20, 32, 44, 56, 110, ...).

    Args: `num_classes`; `input_shape` (C, H, W) — any H, W work thanks to global pooling;
    `depth`; `shortcut` "A" or "B"; `width` channels of the first stage (16 in the paper; later
    stages double it); `zero_init_residual` zero-initialises each block's last BN weight.
    """

    def __init__(
        self,
        num_classes: int,
        input_shape: Sequence[int] = (3, 32, 32),
        depth: int = 20,
        shortcut: str = "A",
        width: int = 16,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6 != 0:
            raise ValueError(
                f"model.depth={depth} is not 6n+2; use one of: 20, 32, 44, 56, 110 (or 6n+2)"
            )
        shortcut = str(shortcut).upper()
        if shortcut not in SHORTCUTS:
            raise ValueError(f"model.shortcut={shortcut!r} is not known; use one of: A, B")
        n = (depth - 2) // 6
        in_channels = int(input_shape[0])
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        self.stage1 = make_stage(width, width, n, 1, shortcut)
        self.stage2 = make_stage(width, 2 * width, n, 2, shortcut)
        self.stage3 = make_stage(2 * width, 4 * width, n, 2, shortcut)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, num_classes)
        init_weights(self)
        if zero_init_residual:
            zero_init_last_bn(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stage3(self.stage2(self.stage1(self.stem(x))))
        return self.fc(self.pool(x).flatten(1))
