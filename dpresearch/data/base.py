"""The data-set contract the trainer relies on.

A data set is held whole as tensors on the training device (no DataLoader, no worker processes):
a batch is an index tensor, and `train_batch` turns it into model inputs, applying augmentation
batched on the device with the worker's own generator, so the same seed gives the same batch on
any backend. Which indices each worker visits is the partitioner's job (`data/partition.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Dataset:
    """Train and test splits as tensors plus the transforms that make model inputs.

    Subclasses override `transform_train` / `transform_test` (default: cast to float).
    `partition` ("iid" or "dirichlet") and `alpha` choose how `make_partitioner` splits the
    training set across workers.
    """

    train_inputs: Tensor
    train_targets: Tensor
    test_inputs: Tensor
    test_targets: Tensor
    num_classes: int
    partition: str = "iid"
    alpha: float = 1.0

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_inputs.shape[1:])

    @property
    def num_train(self) -> int:
        return int(self.train_targets.shape[0])

    def to(self, device: torch.device | str) -> Dataset:
        """Move all split tensors to `device` (in place); returns self."""
        for name in ("train_inputs", "train_targets", "test_inputs", "test_targets"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def transform_train(self, inputs: Tensor, generator: torch.Generator | None) -> Tensor:
        """Model inputs for a training batch; may draw augmentation from `generator`."""
        return inputs.float()

    def transform_test(self, inputs: Tensor) -> Tensor:
        """Model inputs for an evaluation batch (deterministic)."""
        return inputs.float()

    def train_batch(
        self, indices: Tensor, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """Inputs and targets of the training examples at `indices`."""
        if indices.device != self.train_targets.device:
            indices = indices.to(self.train_targets.device)
        # index_select, not x[indices]: the same rows, several times faster on CPUs.
        return (
            self.transform_train(self.train_inputs.index_select(0, indices), generator),
            self.train_targets.index_select(0, indices),
        )

    def test_batches(
        self, batch_size: int, shard: int = 0, num_shards: int = 1
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Evaluation batches over the test split, restricted to shard `shard` of `num_shards`
        contiguous shards (so processes can split evaluation and sum their results)."""
        n = int(self.test_targets.shape[0])
        lo, hi = shard * n // num_shards, (shard + 1) * n // num_shards
        for start in range(lo, hi, batch_size):
            stop = min(start + batch_size, hi)
            yield (
                self.transform_test(self.test_inputs[start:stop]),
                self.test_targets[start:stop],
            )

    def make_partitioner(self, num_workers: int, seed: int):
        """The partitioner that assigns training indices to `num_workers` workers."""
        from dpresearch.data.partition import make_partitioner

        return make_partitioner(
            self.partition, self.train_targets, num_workers, seed, alpha=self.alpha
        )
