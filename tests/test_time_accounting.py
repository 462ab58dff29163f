"""Time accounting (issue 11, acceptance A): compute + exposed comm + other = wall at every
logged step; communication overlapped with backward is its own figure, not comm time."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch
from helpers import compose_config, free_port, spawn_sequence

from dpresearch.comm.ledger import CommLedger
from dpresearch.comm.network import NetworkModel
from dpresearch.run.logger import NullLogger
from dpresearch.train import train

NET = NetworkModel.preset("1gbe")
TERMS = ("time/compute_s", "time/comm_s", "time/other_s")


def test_ledger_separates_exposed_from_overlapped_time():
    ledger = CommLedger(NET)
    ledger.add_time((0.0, 1.0), (0.0, 1.0))  # synchronous: all exposed
    ledger.add_time((2.0, 5.0), (4.5, 5.0))  # in flight 3 s, waited 0.5 s of it
    ledger.add_time((3.0, 6.0), (5.0, 6.0))  # concurrent with the previous one
    assert ledger.exposed_s == pytest.approx(2.5)
    assert ledger.busy_s == pytest.approx(1.0 + 4.0)  # union: [0, 1] ∪ [2, 6]
    assert ledger.overlapped_s == pytest.approx(2.5)
    # an op already complete when waited for: the wait itself still counts as busy
    ledger.add_time((7.0, 7.5), (8.0, 8.1))
    assert ledger.busy_s == pytest.approx(5.6)
    assert ledger.overlapped_s == pytest.approx(5.6 - 2.6)
    ledger.reset()
    assert (ledger.exposed_s, ledger.busy_s) == (0.0, 0.0)


def assert_adds_up(rows: list[dict]) -> None:
    """Every logged row: the three terms sum to the wall clock within 5%, none negative."""
    for row in rows:
        total = sum(row[k] for k in TERMS)
        assert abs(total - row["time/wall_s"]) <= 0.05 * row["time/wall_s"], row
        assert all(row[k] >= 0 for k in (*TERMS, "time/comm_overlapped_s")), row


def run_metrics(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    run_dir = tmp_path / name
    cfg = compose_config(
        "data=synthetic",
        "train.progress=false",
        "train.save_model=false",
        "train.log_every=1",
        *overrides,
    )
    train(cfg, run_dir)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def test_simulated_run_adds_up_and_overlaps_nothing(tmp_path, one_thread):
    rows = run_metrics(
        tmp_path,
        "sim",
        "workers=4",
        "data.num_train=1024",
        "model.hidden=[32]",
        "train.steps=12",
        "train.eval_every=4",
        "backend.threads=1",
    )
    assert_adds_up(rows)
    assert all(row["time/comm_overlapped_s"] == 0.0 for row in rows)
    assert rows[-1]["time/other_s"] > 0  # evaluation and logging happen between steps


# Five 4 MiB layers in 4 MiB buckets: each bucket's allreduce runs while the layers below it
# are still in backward, so much of the communication overlaps.
OVERLAP_MLP = [
    "backend=gloo",
    "workers=2",
    "backend.threads=1",
    "data=synthetic",
    "data.num_train=4096",
    "data.num_test=64",
    "data.num_features=1024",
    "model.hidden=[1024,1024,1024,1024,1024]",
    "train.batch_size=96",
    "train.log_every=1",
    "train.progress=false",
    "train.save_model=false",
    "algorithm.bucket_mb=4",
]
BLOCK, ROUNDS = 6, 6


class Rows(NullLogger):
    """Keeps every logged row (a trainer is run block after block, so nothing is written)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def log(self, metrics: dict) -> None:
        self.rows.append(dict(metrics))


def _overlap_worker(rank: int, port: int, out: str, rounds: int = ROUNDS) -> None:
    """Both settings in the same two processes, taking turns by blocks of steps (the order
    alternating): a shared machine's load, which drifts over seconds, hits both alike."""
    import torch.distributed as dist

    from dpresearch.comm.distributed import DistributedCommunicator
    from dpresearch.config.validate import prepare_data
    from dpresearch.run.build import network_model
    from dpresearch.run.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        trainers, loggers = {}, {}
        for overlap in ("true", "false"):
            cfg = compose_config(
                *OVERLAP_MLP, f"train.steps={BLOCK}", f"algorithm.overlap={overlap}"
            )
            comm = DistributedCommunicator(network_model(cfg))
            trainers[overlap] = Trainer(cfg, comm, torch.device("cpu"), None, prepare_data(cfg))
            loggers[overlap] = trainers[overlap].logger = Rows()
        blocks: dict[str, list[list[dict]]] = {"true": [], "false": []}
        for r in range(rounds + 1):  # round 0 warms both up
            for overlap in ("true", "false") if r % 2 else ("false", "true"):
                loggers[overlap].rows.clear()
                trainers[overlap].run()
                if r:
                    blocks[overlap].append(list(loggers[overlap].rows))
        if rank == 0:
            Path(out).write_text(json.dumps(blocks))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def per_step(block: list[dict], key: str) -> float:
    """Median over a block's steps (the first excluded) of the per-step increment of `key`."""
    return statistics.median(b[key] - a[key] for a, b in zip(block[1:], block[2:], strict=False))


def overlap_blocks(
    tmp_path: Path, rounds: int = ROUNDS
) -> tuple[list[list[dict]], list[list[dict]]]:
    """The logged rows of each timed block with overlap on and with it off (gloo × 2), `rounds`
    blocks of each after a warm-up block."""
    out = tmp_path / "blocks.json"
    spawn_sequence(2, [(_overlap_worker, (free_port(), str(out), rounds))])
    blocks = json.loads(out.read_text())
    return blocks["true"], blocks["false"]


@pytest.mark.distributed
@pytest.mark.slow
def test_gloo_overlap_on_and_off_add_up(tmp_path):
    """Acceptance A, gloo × 2, with the bucketed allreduce overlapping backward and without:
    every logged row adds up with no term negative, and only overlap reports overlapped comm.
    Counting overlapped buckets as exposed comm (launch to completion, as before issue 11)
    fails here: the buckets are in flight concurrently, so compute comes out negative. (One
    timed block of each: adding up holds for every row; the slow test below needs rounds.)"""
    on, off = overlap_blocks(tmp_path, rounds=1)
    for block in on + off:
        assert len(block) == BLOCK
        assert_adds_up(block)
    assert all(row["time/comm_overlapped_s"] == 0.0 for block in off for row in block)
    assert all(block[-1]["time/comm_overlapped_s"] > 0.0 for block in on)


# Slow-marked: timing comparisons between settings are noise-bound on a shared machine under
# load (the agreement bound failed once at load 10+ before the settings were interleaved).
@pytest.mark.slow
@pytest.mark.distributed
def test_gloo_overlap_on_and_off_agree_on_compute(tmp_path):
    """Acceptance A: the median compute per step agrees between overlap on and off within
    50%. Both run in the same processes, alternating by blocks, but on loopback the overlapped
    allreduce's copying shares the two cores with backward, so compute with overlap runs 0–40%
    higher here (a NIC would take that work off the CPU). The overlapped time is a large share
    of the step (checked: > 25%; 40–60% here): counted as comm, it would leave compute far
    below the other setting's."""
    on, off = overlap_blocks(tmp_path)
    compute_on = statistics.median(per_step(b, "time/compute_s") for b in on)
    compute_off = statistics.median(per_step(b, "time/compute_s") for b in off)
    assert abs(compute_on - compute_off) <= 0.5 * max(compute_on, compute_off)
    overlapped = statistics.median(per_step(b, "time/comm_overlapped_s") for b in on)
    assert overlapped > 0.25 * compute_on
    # Hiding communication shortens the exposed part.
    exposed_on = statistics.median(per_step(b, "time/comm_s") for b in on)
    assert exposed_on < statistics.median(per_step(b, "time/comm_s") for b in off)
