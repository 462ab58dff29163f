"""Diagnostics of outer methods and error-feedback memories (`algorithms/diagnostics.py`),
each against a hand computation in float64 on a tiny run."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import SMALL_512, trainer_for

K, H = 4, 5
TINY = [*SMALL_512, f"workers={K}", f"train.steps={H}", "train.log_every=1"]


def run64(*overrides: str):
    trainer = trainer_for(*TINY, *overrides, mode="false", dtype=torch.float64)
    theta0 = trainer.built.replicas.params[0].clone()
    trainer.run()
    return trainer, theta0


def test_outer_diagnostics_equal_the_hand_computation():
    # DiLoCo's inner phase is local SGD that has not averaged yet: its rows are the x_k
    local, theta0 = run64("algorithm=local_sgd", "algorithm.period=1000")
    x = local.built.replicas.params.clone()
    diloco, _ = run64("algorithm=local_sgd", f"algorithm.period={H}", "outer=nesterov")
    row = diloco.state.last
    deltas = [theta0 - x[k] for k in range(K)]
    cosines = [
        float(torch.dot(a, b) / (a.norm() * b.norm())) for a, b in itertools.combinations(deltas, 2)
    ]
    mean_x = sum(x[k] for k in range(K)) / K
    drift = sum(float((x[k] - mean_x).norm()) for k in range(K)) / K
    # torch's SGD starts its momentum buffer at the first gradient: the mean Δ
    momentum = float((sum(deltas) / K).norm())
    assert row["outer/pseudo_grad_cosine"] == pytest.approx(sum(cosines) / len(cosines), 1e-9)
    assert row["outer/pseudo_grad_cosine_min"] == pytest.approx(min(cosines), rel=1e-9)
    assert row["outer/drift"] == pytest.approx(drift, rel=1e-9)
    assert row["outer/momentum_norm"] == pytest.approx(momentum, rel=1e-9)
    assert 0 < min(cosines) < max(cosines) < 1 and drift > 0  # a case that can tell them apart


@pytest.mark.parametrize(
    "overrides",
    [
        ["compressor=topk", "error_feedback=ef14"],
        ["algorithm=local_sgd", "algorithm.period=2", "outer=sparseloco"],
        ["algorithm=async_sgd", "compressor=topk", "error_feedback=ef14", "train.steps=12"],
    ],
    ids=["sync_topk_ef14", "sparseloco", "async_topk_ef14"],
)
def test_memory_norm_is_the_mean_of_each_workers_norm(overrides):
    trainer, _ = run64(*overrides)
    algorithm = trainer.built.algorithm
    if hasattr(algorithm, "link"):  # asynchronous SGD's push channel
        memories = [algorithm.link.memory.memory]
    else:
        reducers = getattr(algorithm, "reducers", None) or [algorithm.reducer]
        memories = [r.memory.memory for r in reducers]
    norms = [sum(float(m[k].square().sum()) for m in memories) ** 0.5 for k in range(K)]
    assert min(norms) > 0
    assert trainer.state.last["ef/memory_norm"] == pytest.approx(sum(norms) / K, rel=1e-12)


def test_no_memory_no_metric():
    trainer, _ = run64()
    assert "ef/memory_norm" not in trainer.state.last


def test_gram_over_column_blocks_equals_the_pairs(monkeypatch):
    """Blocks of columns (here 3 of 10) give the cosines and drift of the whole rows."""
    from dpresearch.algorithms import diagnostics
    from dpresearch.comm.network import NetworkModel
    from dpresearch.comm.simulated import SimulatedCommunicator

    monkeypatch.setattr(diagnostics, "CHUNK", 3)
    rows = torch.randn(K, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    probe = diagnostics.OuterDiagnostics(1)
    comm = SimulatedCommunicator(K, NetworkModel.preset("1gbe"))
    probe.observe(0, rows, comm)
    cosines = [
        float(torch.dot(a, b) / (a.norm() * b.norm())) for a, b in itertools.combinations(rows, 2)
    ]
    drift = float((rows - rows.mean(0)).norm(dim=1).mean())
    got = probe.metrics()
    assert got["outer/pseudo_grad_cosine"] == pytest.approx(sum(cosines) / len(cosines), 1e-12)
    assert got["outer/pseudo_grad_cosine_min"] == pytest.approx(min(cosines), rel=1e-12)
    assert got["outer/drift"] == pytest.approx(drift, rel=1e-12)
    assert comm.ledger.bytes_of("metrics") == [10 * 8] * K  # the allgather it stands for
