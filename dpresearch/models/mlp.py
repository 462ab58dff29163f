"""Small models: a multilayer perceptron, logistic regression and a plain linear map."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor, nn


class MLP(nn.Module):
    """Flatten → [Linear → (BatchNorm) → ReLU] × len(hidden) → Linear."""

    def __init__(
        self,
        num_classes: int,
        input_shape: Sequence[int],
        hidden: Sequence[int] = (128, 128),
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        if any(not isinstance(h, int) or h < 1 for h in hidden):
            raise ValueError(
                f"model.hidden={list(hidden)}: every hidden width must be an integer >= 1 "
                "(use model=logreg for no hidden layer)"
            )
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for h in hidden:
            layers.append(nn.Linear(width, h))
            if batch_norm:
                layers.append(nn.BatchNorm1d(h))
            layers.append(nn.ReLU())
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class LogisticRegression(nn.Module):
    """Multinomial logistic regression: one linear layer on the flattened input."""

    def __init__(self, num_classes: int, input_shape: Sequence[int]) -> None:
        super().__init__()
        self.linear = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x.flatten(1))


class Linear(nn.Module):
    """y = Wx (+ b): `num_classes` outputs of the flattened input (least squares: one output).
    `zero_init` starts from W = 0 (and b = 0)."""

    def __init__(
        self,
        num_classes: int,
        input_shape: Sequence[int],
        bias: bool = False,
        zero_init: bool = True,
    ) -> None:
        super().__init__()
        self.linear = nn.Linear(math.prod(input_shape), num_classes, bias=bias)
        if zero_init:
            nn.init.zeros_(self.linear.weight)
            if bias:
                nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x.flatten(1))
