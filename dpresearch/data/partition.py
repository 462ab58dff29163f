"""Which training examples each worker visits, epoch by epoch.

`IIDPartitioner` reproduces `torch.utils.data.DistributedSampler(shuffle=True, drop_last=True)`
exactly: one permutation of the whole set per epoch (seeded `seed + epoch`), truncated to a
multiple of the number of workers, worker `i` taking every K-th index from position `i`. A torch
DDP program using that sampler therefore sees the same examples, in the same order, as our
workers — the basis of the equivalence tests.

`DirichletPartitioner` gives each worker a fixed, label-skewed shard (non-IID), drawn from a
Dirichlet distribution as in the federated and decentralized-learning literature.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


class Partitioner(ABC):
    """Assigns training-set indices to workers.

    Contract: `epoch_indices(worker, epoch)` returns the ordered indices that `worker` visits in
    `epoch`; it is a pure function of (seed, worker, epoch), so every process computes the same
    answer without communicating. `samples_per_worker` is the length every worker's epoch list
    has at least (steps per epoch = samples_per_worker // batch_size).
    """

    def __init__(self, num_examples: int, num_workers: int, seed: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_examples = num_examples
        self.num_workers = num_workers
        self.seed = seed

    @property
    @abstractmethod
    def samples_per_worker(self) -> int: ...

    @abstractmethod
    def epoch_indices(self, worker: int, epoch: int) -> Tensor: ...

    def epoch_batches(
        self, worker: int, epoch: int, batch_size: int, steps: int, device: torch.device
    ) -> Sequence[Tensor]:
        """Batch n < `steps` of `worker`'s `epoch`: the first `steps × batch_size` of
        `epoch_indices` cut into batches of `batch_size`, on `device`. (A partitioner whose
        epochs are large may draw them as they are read.)"""
        indices = self.epoch_indices(worker, epoch)[: steps * batch_size]
        # Cut once per epoch (one slice per batch costs a dispatched op per step).
        return indices.to(device).split(batch_size)


class IIDPartitioner(Partitioner):
    """Disjoint random shards, reshuffled every epoch (DistributedSampler semantics).

    The permutations of the last `CACHED_EPOCHS` epochs asked for are kept: the K workers of
    one process share each epoch's permutation (drawing it costs O(N), per worker and epoch),
    and asynchronous workers walk neighbouring epochs at once."""

    CACHED_EPOCHS = 4

    def __init__(self, num_examples: int, num_workers: int, seed: int) -> None:
        super().__init__(num_examples, num_workers, seed)
        self._perms: dict[int, Tensor] = {}  # epoch → its permutation, oldest use first

    @property
    def samples_per_worker(self) -> int:
        return self.num_examples // self.num_workers

    def epoch_indices(self, worker: int, epoch: int) -> Tensor:
        perm = self._perms.pop(epoch, None)
        if perm is None:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            perm = torch.randperm(self.num_examples, generator=g)
            if len(self._perms) == self.CACHED_EPOCHS:
                del self._perms[next(iter(self._perms))]
        self._perms[epoch] = perm
        total = self.samples_per_worker * self.num_workers
        return perm[:total][worker :: self.num_workers].clone()  # the caller's to keep


class DirichletPartitioner(Partitioner):
    """Label-skewed disjoint shards: for each class c, the fractions of its examples that go to
    the K workers are drawn from a symmetric Dirichlet Dir_K(alpha) — the per-class convention
    of Yurochkin et al. 2019 that most decentralized-learning work follows (Hsu et al. 2019 draw
    each worker's class mix instead; alpha means the same). Small alpha gives each worker few
    classes; alpha → ∞ approaches IID.

    The split is a pure function of (targets, num_workers, seed, alpha): the proportions are drawn
    with numpy's generator seeded by `seed`, each class's examples are shuffled with the same
    generator and cut into consecutive runs whose sizes round `proportion × class size` by the
    largest-remainder rule (so every worker's count of class c is within 1 of its expectation).
    If some worker would get fewer than `min_samples` examples, the proportions are drawn again
    (up to `max_draws` times) — the usual practice, which conditions the draw on no worker being
    empty. `proportions` (K×C, columns summing to 1) holds the accepted draw and `shards` each
    worker's indices.

    Epochs: shards differ in size, but every worker must take the same number of steps, so
    `samples_per_worker` is N // K, as for IID. In each epoch a worker walks its shard in a fresh
    order (seeded by seed, epoch, worker); a shard smaller than N // K is walked several times
    (each pass reshuffled) and a larger one is cut short, so over epochs every example is seen.
    """

    def __init__(
        self,
        targets: Tensor,
        num_workers: int,
        seed: int,
        alpha: float,
        min_samples: int = 1,
        max_draws: int = 1000,
    ) -> None:
        super().__init__(int(targets.shape[0]), num_workers, seed)
        if not alpha > 0:
            raise ValueError(f"data.alpha={alpha} must be > 0 for data.partition=dirichlet")
        if self.samples_per_worker < 1:
            raise ValueError(
                f"{self.num_examples} training examples cannot feed {num_workers} workers; "
                "use fewer workers or more data"
            )
        self.alpha = float(alpha)
        labels = targets.detach().cpu().numpy().astype(np.int64)
        num_classes = int(labels.max()) + 1 if labels.size else 0
        # The second word keeps this stream apart from the per-epoch ones ([seed, epoch, worker]).
        rng = np.random.default_rng([_word(seed), 0x5350])
        by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
        for _ in range(max_draws):
            proportions = rng.dirichlet(np.full(num_workers, self.alpha), size=num_classes)
            counts = np.stack(
                [
                    _round_preserving_sum(p * len(idx))
                    for p, idx in zip(proportions, by_class, strict=True)
                ]
            )  # C×K
            if counts.sum(axis=0).min() >= min_samples:
                break
        else:
            raise ValueError(
                f"data.alpha={alpha} is too small for {num_workers} workers: in {max_draws} draws "
                f"some worker always got too few examples (< {min_samples}); raise data.alpha or "
                "use fewer workers"
            )
        self.proportions = torch.from_numpy(proportions.T.copy()).float()  # K×C
        self.class_counts = torch.from_numpy(counts.T.copy())  # K×C
        # Worker k takes the run [start, end) of each class's shuffled examples.
        ends = np.cumsum(counts, axis=1)
        starts = ends - counts
        self.shards: list[Tensor] = []
        for k in range(num_workers):
            runs = zip(by_class, starts[:, k], ends[:, k], strict=True)
            self.shards.append(
                torch.from_numpy(np.sort(np.concatenate([i[a:b] for i, a, b in runs])))
            )

    @property
    def samples_per_worker(self) -> int:
        return self.num_examples // self.num_workers

    def epoch_indices(self, worker: int, epoch: int) -> Tensor:
        shard = self.shards[worker]
        rng = np.random.default_rng([_word(self.seed), epoch, worker])
        passes = -(-self.samples_per_worker // len(shard))  # ceil
        order = np.concatenate([rng.permutation(len(shard)) for _ in range(passes)])
        return shard[torch.from_numpy(order[: self.samples_per_worker])]


class SharedPartitioner(Partitioner):
    """Every worker samples the whole training set, each in its own order: in each epoch a
    worker walks a permutation of all N examples seeded by (seed, epoch, worker) — the set-up of
    asynchronous-SGD analyses where every worker draws its minibatches from the full data
    (e.g. Mishchenko et al. 2022). `samples_per_worker` is N, so an epoch is K passes."""

    @property
    def samples_per_worker(self) -> int:
        return self.num_examples

    def epoch_indices(self, worker: int, epoch: int) -> Tensor:
        rng = np.random.default_rng([_word(self.seed), epoch, worker, 0x5348])
        return torch.from_numpy(rng.permutation(self.num_examples))


def _word(seed: int) -> int:
    """`seed` as the non-negative 64-bit integer numpy's seeding requires."""
    return seed % 2**64


def _round_preserving_sum(values: np.ndarray) -> np.ndarray:
    """Integers within 1 of `values` summing to round(sum(values)) (largest-remainder rule)."""
    floors = np.floor(values).astype(np.int64)
    short = int(round(values.sum())) - int(floors.sum())
    # Stable sort so ties go to the lower index: the result is deterministic.
    floors[np.argsort(-(values - floors), kind="stable")[:short]] += 1
    return floors


def make_partitioner(
    kind: str, targets: Tensor, num_workers: int, seed: int, alpha: float = 1.0
) -> Partitioner:
    """Build the partitioner named `kind` ("iid", "dirichlet" with concentration `alpha`, or
    "shared": every worker samples all examples)."""
    if kind == "iid":
        return IIDPartitioner(int(targets.shape[0]), num_workers, seed)
    if kind == "shared":
        return SharedPartitioner(int(targets.shape[0]), num_workers, seed)
    if kind == "dirichlet":
        return DirichletPartitioner(targets, num_workers, seed, alpha)
    raise ValueError(f"data.partition={kind!r} is not known; use one of: iid, dirichlet, shared")
