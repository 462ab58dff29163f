"""Bytes by purpose (issue 11, acceptance B): `comm/bytes` is the algorithm's payload alone;
BatchNorm buffer broadcasts, evaluation and metric traffic are their own counters; a receiver
is never charged for what it only received."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import compose_config, free_port, spawn_sequence

from dpresearch.comm.distributed import DistributedCommunicator
from dpresearch.comm.ledger import OFF_STEP_PURPOSES, CommOp
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.data.base import Dataset
from dpresearch.run.trainer import Trainer

NET = NetworkModel.preset("1gbe")


def tiny_images(n_train: int = 64, n_test: int = 16) -> Dataset:
    """Random 3×32×32 images: ResNet-20's real shapes without loading CIFAR."""
    g = torch.Generator().manual_seed(0)
    return Dataset(
        torch.randn(n_train, 3, 32, 32, generator=g),
        torch.randint(10, (n_train,), generator=g),
        torch.randn(n_test, 3, 32, 32, generator=g),
        torch.randint(10, (n_test,), generator=g),
        num_classes=10,
    )


def test_record_names_the_purpose_and_false_records_nothing():
    comm = SimulatedCommunicator(2, NET)
    comm.all_reduce(torch.zeros(2, 10))  # True: the algorithm's
    comm.all_reduce(torch.zeros(2, 3), record="metrics")
    comm.all_gather(torch.zeros(2, 5), record="eval")
    comm.all_reduce(torch.zeros(2, 7), record=False)
    assert comm.ledger.bytes_by_worker == [40, 40]
    assert comm.ledger.bytes_sent == 40
    assert comm.ledger.bytes_of("metrics") == [12, 12]
    assert comm.ledger.bytes_of("eval") == [20, 20]
    assert comm.ledger.bytes_of("never") == [0, 0]
    # eval and metrics are priced apart, not in the training steps' modeled time
    assert comm.ledger.modeled_s == pytest.approx(NET.op_seconds(CommOp("allreduce", 40, 2)))
    assert comm.ledger.op_counts == {"allreduce": 1}
    with pytest.raises(ValueError, match="purpose"):
        comm.all_reduce(torch.zeros(2, 1), record="")


def test_broadcast_charges_only_its_source():
    comm = SimulatedCommunicator(4, NET)
    comm.broadcast(torch.zeros(4, 6), src=2, record="buffers")
    assert comm.ledger.bytes_of("buffers") == [0, 0, 24, 0]
    assert comm.ledger.bytes_by_worker == [0, 0, 0, 0]
    # real traffic of the step: priced into the modeled time
    assert comm.ledger.modeled_s == pytest.approx(NET.op_seconds(CommOp("broadcast", 24, 4)))


def topk_formula(model: torch.nn.Module, ratio: float) -> int:
    """TopK's documented payload per step with tensor granularity: 8·k per parameter tensor,
    k = max(1, round(ratio·d))."""
    return sum(8 * max(1, round(ratio * p.numel())) for p in model.parameters())


def test_resnet20_topk_counts_gradient_bytes_only():
    """Acceptance B: ResNet-20, top-k 1% + EF, K=4 simulated workers."""
    steps = 3
    cfg = compose_config(
        "model=resnet20",
        "workers=4",
        "train.batch_size=8",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.progress=false",
        "compressor=topk",
        "compressor.ratio=0.01",
        "error_feedback=ef14",
        "backend.threads=1",
    )
    comm = SimulatedCommunicator(4, NET)
    comm.ledger.history = []
    trainer = Trainer(cfg, comm, torch.device("cpu"), None, tiny_images())
    model = trainer.replicas.models[0]
    per_step = topk_formula(model, 0.01)
    buffer_bytes = sum(b.numel() * 4 for b in model.buffers() if b.is_floating_point())
    assert buffer_bytes == 5504  # ResNet-20's BatchNorm running means and variances
    summary = trainer.run()

    ledger = comm.ledger
    assert ledger.bytes_by_worker == [steps * per_step] * 4
    assert summary["comm/bytes"] == summary["comm/bytes_max"] == steps * per_step
    # The BatchNorm broadcast: worker 0 sends, the receivers are charged nothing (the logged
    # figure is the mean over the 4 workers).
    assert ledger.bytes_of("buffers") == [steps * buffer_bytes, 0, 0, 0]
    assert summary["comm/bytes_buffers"] == steps * buffer_bytes / 4
    # Logging (loss sums, byte counters) at each of the 3 logs; evaluation once at the end.
    assert min(ledger.bytes_of("metrics")) > 0 and summary["comm/bytes_metrics"] > 0
    assert min(ledger.bytes_of("eval")) > 0 and summary["comm/bytes_eval"] > 0
    # Modeled time: the gradient allgathers and the buffer broadcasts, nothing else.
    ops = ledger.history
    priced = [op for op in ops if op.purpose in ("algorithm", "buffers")]
    assert {op.kind for op in priced} == {"allgather", "broadcast"}
    assert ledger.modeled_s == pytest.approx(sum(NET.op_seconds(op) for op in priced))
    assert ledger.modeled_s < sum(NET.op_seconds(op) for op in ops)
    assert sum(ledger.op_totals.values()) == len(priced)  # what modeled_s prices, counted
    # the loop ends every step: what is left is the final evaluation's, not the steps'
    assert all(op.purpose in OFF_STEP_PURPOSES for op in ledger.step_ops)


def _broadcast_worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        comm = DistributedCommunicator(NET)
        x = torch.full((1, 100), float(rank))
        comm.broadcast(x, src=0, record="buffers")
        comm.all_reduce(torch.ones(1, 10))
        Path(out, f"{rank}.json").write_text(
            json.dumps(
                {
                    "value": x[0, 0].item(),
                    "buffers": comm.ledger.bytes_of("buffers"),
                    "algorithm": comm.ledger.bytes_by_worker,
                }
            )
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_gloo_broadcast_receiver_is_not_charged(tmp_path):
    spawn_sequence(2, [(_broadcast_worker, (free_port(), str(tmp_path)))])
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [g["value"] for g in got] == [0.0, 0.0]
    assert [g["buffers"] for g in got] == [[400], [0]]
    assert [g["algorithm"] for g in got] == [[40], [40]]
