"""Gradient averaging overlapped with backward (one worker per process)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpresearch.algorithms.overlap import OverlappedGradientAverage
from dpresearch.comm.distributed import DistributedCommunicator
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.replicas import Replicas


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )


def test_buckets_start_during_backward_and_give_the_plain_average(one_process_group):
    comm = DistributedCommunicator(NetworkModel.preset("10gbe"))
    assert comm.can_overlap
    replicas = Replicas(model(), 1, torch.device("cpu"))
    overlap = OverlappedGradientAverage(replicas, comm, bucket_mb=1.0, first_bucket_mb=0.5)
    # Reverse order, contiguous, covering the whole row.
    assert overlap.ranges[0][1] == replicas.num_params and overlap.ranges[-1][0] == 0
    assert all(a[0] == b[1] for a, b in zip(overlap.ranges, overlap.ranges[1:], strict=False))
    assert len(overlap.ranges) >= 2
    x, y = torch.randn(32, 64), torch.randint(10, (32,))
    replicas.zero_grad()
    F.cross_entropy(replicas.models[0](x), y).backward()
    assert set(overlap.pending) == set(range(len(overlap.ranges)))  # all started in backward
    overlap.finish()
    expected = replicas.grads.clone()
    assert comm.ledger.bytes_sent == replicas.num_params * 4
    assert comm.ledger.op_counts["allreduce"] == len(overlap.ranges)
    # Same gradients as the whole-row reduction done after backward.
    plain = Replicas(model(), 1, torch.device("cpu"))
    F.cross_entropy(plain.models[0](x), y).backward()
    comm.all_reduce(plain.grads, op="mean")
    assert torch.equal(expected, plain.grads)


def test_unused_parameters_are_reduced_at_finish(one_process_group):
    comm = DistributedCommunicator(NetworkModel.preset("10gbe"))
    replicas = Replicas(model(), 1, torch.device("cpu"))
    overlap = OverlappedGradientAverage(replicas, comm, bucket_mb=0.1, first_bucket_mb=0.1)
    replicas.zero_grad()
    replicas.models[0][4](torch.randn(4, 512)).sum().backward()  # only the last layer
    assert len(overlap.pending) < len(overlap.ranges)
    overlap.finish()
    assert comm.ledger.bytes_sent == replicas.num_params * 4


def test_simulated_workers_never_overlap():
    assert not SimulatedCommunicator(4, NetworkModel.preset("10gbe")).can_overlap
