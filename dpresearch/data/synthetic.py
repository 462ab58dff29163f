"""A seeded synthetic classification set: Gaussian clusters, one per class, no download."""

from __future__ import annotations

import torch

from dpresearch.data.base import Dataset


def make_synthetic(
    num_train: int = 4096,
    num_test: int = 1024,
    num_features: int = 32,
    num_classes: int = 10,
    noise: float = 1.0,
    seed: int = 0,
    partition: str = "iid",
    alpha: float = 1.0,
    device: str = "cpu",
) -> Dataset:
    """Class c's inputs are `mean_c + noise · N(0, I)` with `mean_c ~ N(0, I)`; labels are
    uniform. The same `seed` always gives the same tensors. Raises ValueError (one line) for
    sizes that make no classification problem."""
    for key, value, least in (("num_features", num_features, 1), ("num_classes", num_classes, 2)):
        if value < least:
            raise ValueError(f"data.{key}={value}: must be at least {least}")
    if noise < 0:
        raise ValueError(f"data.noise={noise}: the noise standard deviation must be >= 0")
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(num_classes, num_features, generator=g)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(num_classes, (n,), generator=g)
        x = means[y] + noise * torch.randn(n, num_features, generator=g)
        return x, y

    train_x, train_y = draw(num_train)
    test_x, test_y = draw(num_test)
    return Dataset(
        train_x, train_y, test_x, test_y, num_classes, partition=partition, alpha=alpha
    ).to(device)
