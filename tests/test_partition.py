"""Partitioners: IID matches DistributedSampler; Dirichlet shards follow their drawn proportions,
are disjoint and covering, approach IID as alpha grows, and are reproducible from the seed."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from dpresearch.data.partition import DirichletPartitioner, IIDPartitioner, make_partitioner

NUM_CLASSES = 10


def labels(n: int = 5000, seed: int = 0) -> torch.Tensor:
    """Roughly balanced random labels."""
    return torch.randint(0, NUM_CLASSES, (n,), generator=torch.Generator().manual_seed(seed))


def histogram(targets: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return torch.bincount(targets[indices], minlength=NUM_CLASSES)


def test_iid_matches_distributed_sampler() -> None:
    n, workers, seed = 103, 4, 7
    part = IIDPartitioner(n, workers, seed)
    for epoch in (0, 3):
        for rank in range(workers):
            sampler = DistributedSampler(
                range(n), num_replicas=workers, rank=rank, shuffle=True, seed=seed, drop_last=True
            )
            sampler.set_epoch(epoch)
            assert part.epoch_indices(rank, epoch).tolist() == list(sampler)


@pytest.mark.parametrize("alpha", [0.1, 1.0, 10.0])
def test_dirichlet_counts_follow_proportions(alpha: float) -> None:
    targets = labels()
    part = DirichletPartitioner(targets, num_workers=8, seed=0, alpha=alpha)
    class_totals = torch.bincount(targets, minlength=NUM_CLASSES).double()
    assert part.proportions.shape == (8, NUM_CLASSES)
    # 8 float32 proportions (each rounded once) summed in float32 (7 additions): within
    # 15·u ≈ 1e-6 of 1 in any order (u = 2^-24); 1e-5 covers that with room on any CPU
    assert torch.allclose(part.proportions.sum(0), torch.ones(NUM_CLASSES), atol=1e-5)
    counts = torch.stack([histogram(targets, shard) for shard in part.shards]).double()
    assert torch.equal(counts.long(), part.class_counts)
    # Largest-remainder rounding: each count within one example of proportion × class size.
    assert (counts - part.proportions.double() * class_totals).abs().max() < 1 + 1e-6


@pytest.mark.parametrize("workers", [1, 3, 16])
def test_dirichlet_shards_are_disjoint_and_cover(workers: int) -> None:
    targets = labels(1234)
    part = DirichletPartitioner(targets, num_workers=workers, seed=1, alpha=0.5)
    everything = torch.cat(part.shards)
    assert torch.equal(everything.sort().values, torch.arange(1234))
    assert min(len(s) for s in part.shards) >= 1


def test_large_alpha_approaches_iid() -> None:
    targets = labels(20000)
    part = DirichletPartitioner(targets, num_workers=8, seed=0, alpha=1e6)
    global_dist = torch.bincount(targets, minlength=NUM_CLASSES).double() / len(targets)
    for shard in part.shards:
        dist = histogram(targets, shard).double() / len(shard)
        assert (dist - global_dist).abs().max() < 0.005
        assert abs(len(shard) - len(targets) / 8) <= NUM_CLASSES


def test_small_alpha_is_skewed() -> None:
    targets = labels(20000)
    part = DirichletPartitioner(targets, num_workers=8, seed=0, alpha=0.05)
    top_share = [histogram(targets, s).max().item() / len(s) for s in part.shards]
    assert sum(top_share) / len(top_share) > 0.5  # IID would give ≈ 0.1


def test_dirichlet_is_reproducible_from_seed() -> None:
    targets = labels()
    a = DirichletPartitioner(targets, num_workers=4, seed=5, alpha=0.3)
    b = DirichletPartitioner(targets, num_workers=4, seed=5, alpha=0.3)
    c = DirichletPartitioner(targets, num_workers=4, seed=6, alpha=0.3)
    assert torch.equal(a.proportions, b.proportions)
    assert all(torch.equal(x, y) for x, y in zip(a.shards, b.shards, strict=True))
    assert torch.equal(a.epoch_indices(2, 7), b.epoch_indices(2, 7))
    assert not torch.equal(a.proportions, c.proportions)


def test_dirichlet_epochs_reshuffle_within_own_shard() -> None:
    targets = labels(4000)
    part = DirichletPartitioner(targets, num_workers=4, seed=0, alpha=0.2)
    assert part.samples_per_worker == 1000
    for worker, shard in enumerate(part.shards):
        epoch0, epoch1 = part.epoch_indices(worker, 0), part.epoch_indices(worker, 1)
        for idx in (epoch0, epoch1):
            assert idx.shape == (1000,) and idx.dtype == torch.int64
            assert torch.isin(idx, shard).all()
        assert not torch.equal(epoch0, epoch1)
        visits = torch.bincount(epoch0, minlength=len(targets))[shard]
        if len(shard) >= 1000:  # a large shard is cut short: no repeats
            assert visits.max() == 1
        else:  # a small shard is cycled: every example ⌊L/m⌋ or ⌈L/m⌉ times
            assert visits.min() == 1000 // len(shard)
            assert visits.max() == -(-1000 // len(shard))


def test_make_partitioner_and_errors() -> None:
    targets = labels(100)
    assert isinstance(make_partitioner("dirichlet", targets, 4, 0, alpha=0.5), DirichletPartitioner)
    assert isinstance(make_partitioner("iid", targets, 4, 0), IIDPartitioner)
    with pytest.raises(ValueError, match="iid, dirichlet"):
        make_partitioner("shards", targets, 4, 0)
    with pytest.raises(ValueError, match="data.alpha"):
        DirichletPartitioner(targets, 4, 0, alpha=0.0)
    with pytest.raises(ValueError, match="raise data.alpha"):
        DirichletPartitioner(labels(12), 10, 0, alpha=1e-3, max_draws=5)
    with pytest.raises(ValueError, match="fewer workers"):
        DirichletPartitioner(labels(3), 4, 0, alpha=1.0)
