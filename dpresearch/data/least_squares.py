"""Least squares as a data set: f(x) = 1/(2n)‖Ax − b‖², the problem of Mishchenko et al.
2022 ("Asynchronous SGD beats minibatch SGD under arbitrary delays", konstmish/asynchronous_sgd).

A ∈ R^{n×d} has entries U(0, 1)/√d, b = A·x̄ + noise·N(0, I) with x̄ ~ N(0, I), drawn with
numpy's generator seeded by `seed` (the authors' 42) after `seed_draws` draws of a run seed
(their notebook draws its 5 run seeds, `choice(424242)`, before A: `seed_draws: 5` gives their
very matrix). The training objective on a batch is
½·mean((a·x − b)²) (`loss`); the validation and test splits are the training set itself, so
`val/loss` and `test/loss` are both f(x) on all n rows (an optimization problem, not a
generalization one: a study selects on `val/loss`, the objective). `optimum`
holds f* (exact least-squares solution, float64). Every worker samples from all n rows by
default (`partition: shared`), as the authors' workers do.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from dpresearch.data.base import Dataset


class LeastSquares(Dataset):
    """A regression data set: one real target per example, squared loss, no accuracy."""

    classification: ClassVar[bool] = False
    own_validation: ClassVar[bool] = True  # f on all rows: see the module doc
    optimum: float = 0.0

    def loss(self, outputs: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
        squared = 0.5 * (outputs.reshape(targets.shape) - targets).pow(2)
        return squared.sum() if reduction == "sum" else squared.mean()

    def hits(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return torch.zeros(targets.shape[0], dtype=torch.bool, device=targets.device)


def make_least_squares(
    num_train: int = 10_000,
    dim: int = 400,
    noise: float = 1e-5,
    seed: int = 42,
    partition: str = "shared",
    alpha: float = 1.0,
    seed_draws: int = 0,
    device: str = "cpu",
) -> LeastSquares:
    """The problem above; the same arguments always give the same tensors."""
    rng = np.random.default_rng(seed)
    for _ in range(seed_draws):
        rng.choice(424242, size=1, replace=False)
    a = rng.uniform(size=(num_train, dim)) / np.sqrt(dim)
    x_bar = rng.normal(size=dim)
    b = a @ x_bar + noise * rng.normal(size=num_train)
    x_opt = np.linalg.lstsq(a, b, rcond=None)[0]
    inputs = torch.from_numpy(a).float()
    targets = torch.from_numpy(b).float()
    data = LeastSquares(
        inputs,
        targets,
        inputs,
        targets,
        1,
        partition=partition,
        alpha=alpha,
        val_inputs=inputs,
        val_targets=targets,
    )
    data.optimum = 0.5 * float(np.mean((a @ x_opt - b) ** 2))
    return data.to(device)
