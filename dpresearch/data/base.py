"""The data-set contract the trainer relies on.

A data set is held whole as tensors on the training device (no DataLoader, no worker processes):
a batch is an index tensor, and `train_batch` turns it into model inputs, applying augmentation
batched on the device with the worker's own generator, so the same seed gives the same batch on
any backend. Which indices each worker visits is the partitioner's job (`data/partition.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

SPLIT_TENSORS = (
    "train_inputs",
    "train_targets",
    "test_inputs",
    "test_targets",
    "val_inputs",
    "val_targets",
)
VALIDATION_SEED = 0  # the held-out examples are the same in every run


@dataclass
class Dataset:
    """Train and test splits as tensors plus the transforms that make model inputs.

    Subclasses override `transform_train` / `transform_test` (default: cast to float).
    `val_inputs` / `val_targets`: a validation split held out of the training set
    (`hold_out`), None without one.
    `partition` ("iid", "dirichlet" or "shared") and `alpha` choose how `make_partitioner`
    splits the training set across workers.
    The task is a trait of the class: `classification` (the default, cross-entropy on class
    targets, accuracy reported) or not (a subclass giving its own `loss`, no accuracy).
    """

    classification: ClassVar[bool] = True
    # The `data.partition` values `make_partitioner` takes.
    PARTITIONS: ClassVar[tuple[str, ...]] = ("iid", "dirichlet", "shared")
    # Whether the data set brings its own validation split (`val/*` reported without
    # `train.val_size`), e.g. an optimization problem validated on all its rows.
    own_validation: ClassVar[bool] = False

    train_inputs: Tensor
    train_targets: Tensor
    test_inputs: Tensor
    test_targets: Tensor
    num_classes: int
    partition: str = "iid"
    alpha: float = 1.0
    val_inputs: Tensor | None = None
    val_targets: Tensor | None = None
    # Whether `transform_train` draws from its generator (augmentation). If not, it must act on
    # each example alone, so several workers' batches are transformed together in
    # `train_batches`.
    transform_draws: ClassVar[bool] = False

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_inputs.shape[1:])

    @property
    def num_train(self) -> int:
        return int(self.train_targets.shape[0])

    @property
    def output_shape(self) -> tuple[int, ...]:
        """The model's output per example: one score per class (a language model: one per
        token of its window and vocabulary entry)."""
        return (self.num_classes,)

    @property
    def tokens_per_example(self) -> int | None:
        """Tokens in one training example (text: a window), None for data without tokens."""
        return None

    def facts(self) -> dict[str, Any]:
        """What a run records about its data beyond the sizes (`summary.json`, `data/...`)."""
        return {}

    def split_metrics(self, split: str, loss: float) -> dict[str, float]:
        """Metrics derived from the mean loss of evaluation split `split` (text: bits per
        character)."""
        return {}

    def sample(self, model: torch.nn.Module, generator: torch.Generator) -> str | None:
        """A sample of what `model` generates (text data: a passage), None for other data."""
        return None

    def probe_batch(
        self, rows: int, batch: int, generator: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        """Random inputs `[rows, batch, *input_shape]` and targets of the data's kinds, for
        probing a model (`run.batched.probe`)."""
        return (
            torch.randn(rows, batch, *self.input_shape, generator=generator),
            torch.randint(self.num_classes, (rows, batch), generator=generator),
        )

    def to(self, device: torch.device | str) -> Dataset:
        """Move all split tensors to `device` (in place); returns self."""
        for name in SPLIT_TENSORS:
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))
        return self

    def hold_out(self, size: float, seed: int = VALIDATION_SEED) -> Dataset:
        """A copy of this data set with `size` training examples (a count >= 1, or a fraction
        of the training set < 1) moved into the validation split; `size` 0 returns self.

        The held-out examples are a uniformly random draw from a generator seeded with `seed`
        alone, not the run's seed, so every seed of a study trains on the same examples and is
        selected on the same validation set; the training examples keep their file order."""
        if not size:
            return self
        n = self.num_train
        count = round(size * n) if size < 1 else int(size)
        if size < 0 or count < 1 or count >= n or (size >= 1 and size != int(size)):
            raise ValueError(
                f"train.val_size={size} must be a count of examples in [1, {n - 1}] or a "
                f"fraction in (0, 1) of the {n} training examples (0: no validation split)"
            )
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        held = order[:count].sort().values.to(self.train_targets.device)
        keep = order[count:].sort().values.to(self.train_targets.device)
        split = copy.copy(self)  # shallow: the test split and settings are shared
        split.val_inputs = self.train_inputs.index_select(0, held)
        split.val_targets = self.train_targets.index_select(0, held)
        split.train_inputs = self.train_inputs.index_select(0, keep)
        split.train_targets = self.train_targets.index_select(0, keep)
        return split

    def loss(self, outputs: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
        """The training objective on a batch (default: cross-entropy on class targets)."""
        return F.cross_entropy(outputs, targets, reduction=reduction)

    def hits(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Per example, whether the prediction is right (classification only)."""
        return outputs.argmax(1) == targets

    def transform_train(self, inputs: Tensor, generator: torch.Generator | None) -> Tensor:
        """Model inputs for a training batch; may draw augmentation from `generator`."""
        return inputs if inputs.dtype == torch.float32 else inputs.float()

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

    def train_batches(
        self, indices: Sequence[Tensor], generators: Sequence[torch.Generator | None]
    ) -> tuple[Tensor, Tensor]:
        """Inputs `[S, B, ...]` and targets `[S, B]` of S batches of equal size B, batch s
        transformed with `generators[s]`: the same tensors as stacking
        `train_batch(indices[s], generators[s])`, with one gather for all of them."""
        index = torch.cat(list(indices))
        if index.device != self.train_targets.device:
            index = index.to(self.train_targets.device)
        raw = self.train_inputs.index_select(0, index)
        targets = self.train_targets.index_select(0, index).view(len(indices), -1)
        inputs = self.transform_batches(raw, generators)
        return inputs.view(len(indices), -1, *inputs.shape[1:]), targets

    def transform_batches(
        self, inputs: Tensor, generators: Sequence[torch.Generator | None]
    ) -> Tensor:
        """`transform_train` of `inputs` cut into `len(generators)` equal batches, batch s
        with `generators[s]`; one call over all of them where the transform draws nothing."""
        if not self.transform_draws:
            return self.transform_train(inputs, None)
        chunks = inputs.chunk(len(generators))
        return torch.cat(
            [self.transform_train(c, g) for c, g in zip(chunks, generators, strict=True)]
        )

    def test_batches(
        self, batch_size: int, shard: int = 0, num_shards: int = 1, split: str = "test"
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Evaluation batches over the `split` split ("test" or "val"), restricted to shard
        `shard` of `num_shards` contiguous shards (so processes can split evaluation and sum
        their results)."""
        inputs, targets = getattr(self, f"{split}_inputs"), getattr(self, f"{split}_targets")
        n = int(targets.shape[0])
        lo, hi = shard * n // num_shards, (shard + 1) * n // num_shards
        for start in range(lo, hi, batch_size):
            stop = min(start + batch_size, hi)
            yield self.transform_test(inputs[start:stop]), targets[start:stop]

    def make_partitioner(self, num_workers: int, seed: int):
        """The partitioner that assigns training indices to `num_workers` workers."""
        from dpresearch.data.partition import make_partitioner

        return make_partitioner(
            self.partition, self.train_targets, num_workers, seed, alpha=self.alpha
        )
