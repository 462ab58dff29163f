"""Neighbour exchange (issue 7, item 2; acceptance E): stacked `[W, P, ...]` results, peers
deduplicated, bytes charged to senders only, and the same result on gloo processes as in one
process — on rings of 2, 3 and 4 workers (the 2-worker ring used to hang), a directed graph
and an irregular one, with both point-to-point schedules (one batch, one ring distance at a
time)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, load_scaled, spawn_sequence

from dpresearch.comm.distributed import DistributedCommunicator
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator

NET = NetworkModel.preset("1gbe")


def ring(k: int) -> list[list[int]]:
    return [[(i - 1) % k, (i + 1) % k] for i in range(k)]


def star(k: int) -> list[list[int]]:
    return [list(range(1, k))] + [[0] for _ in range(1, k)]


def shift(k: int, distance: int) -> tuple[list[list[int]], list[list[int]]]:
    """Directed: i sends to i + distance."""
    return [[(i + distance) % k] for i in range(k)], [[(i - distance) % k] for i in range(k)]


def graphs(k: int) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    return {"ring": (ring(k), ring(k)), "star": (star(k), star(k)), "shift": shift(k, 1)}


def rows(k: int, d: int = 5) -> torch.Tensor:
    return torch.arange(k * d, dtype=torch.float32).reshape(k, d) + 1


def test_two_worker_ring_has_one_peer_and_charges_it_once():
    comm = SimulatedCommunicator(2, NET)
    got = comm.neighbor_exchange(rows(2), ring(2), ring(2))
    assert got.shape == (2, 1, 5)
    assert torch.equal(got[0, 0], rows(2)[1]) and torch.equal(got[1, 0], rows(2)[0])
    assert comm.ledger.bytes_by_worker == [5 * 4, 5 * 4]


def test_irregular_graph_pads_and_charges_each_sender_its_own_degree():
    comm = SimulatedCommunicator(4, NET)
    got = comm.neighbor_exchange(rows(4), star(4), star(4))
    assert got.shape == (4, 3, 5)
    assert torch.equal(got[0], rows(4)[1:])
    assert torch.equal(got[2, 0], rows(4)[0]) and not got[2, 1:].any()
    assert comm.ledger.bytes_by_worker == [3 * 20, 20, 20, 20]
    op = comm.ledger.step_ops[-1]
    assert (op.peers, op.nbytes) == (3, 20)
    assert comm.ledger.modeled_s == pytest.approx(NET.latency_s + 3 * 20 / NET.bandwidth_Bps)


def test_inconsistent_peers_are_rejected():
    comm = SimulatedCommunicator(3, NET)
    with pytest.raises(ValueError, match="inconsistent peers"):
        comm.neighbor_exchange(rows(3), [[1], [], []], [[], [], []])


def test_start_variant_returns_the_result_on_wait():
    comm, reference = SimulatedCommunicator(3, NET), SimulatedCommunicator(3, NET)
    pending = comm.start_neighbor_exchange(rows(3), ring(3), ring(3))
    expected = reference.neighbor_exchange(rows(3), ring(3), ring(3))
    # recorded when launched: its bytes belong to the step that sent them, however late the wait
    assert comm.ledger.bytes_sent == reference.ledger.bytes_sent > 0
    assert torch.equal(pending.wait(), expected)
    assert comm.ledger.bytes_sent == reference.ledger.bytes_sent  # not counted twice


def _gloo_worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = {}
    for schedule, name, (outs, ins) in [
        (schedule, name, graph)
        for schedule in ("one_batch", "by_distance")
        for name, graph in graphs(world).items()
    ]:
        comm = DistributedCommunicator(NET, p2p_schedule=schedule)
        name = f"{name}/{schedule}"
        x = rows(world)[rank : rank + 1]
        comm.ledger.reset()
        results[name] = (comm.neighbor_exchange(x, outs, ins), list(comm.ledger.bytes_by_worker))
        # The background variant, twice in flight over one graph with the other's sends.
        first = comm.start_neighbor_exchange(x * 2, outs, ins)
        second = comm.start_neighbor_exchange(x * 3, outs, ins)
        results[name + "_started"] = (torch.stack([first.wait(), second.wait()]), None)
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_exchange_equals_simulated(tmp_path, world):
    start = time.perf_counter()
    spawn_sequence(world, [(_gloo_worker, (world, free_port(), str(tmp_path)))])
    assert time.perf_counter() - start < load_scaled(60)  # acceptance E: no hang on small rings
    for name, (outs, ins) in [
        (f"{name}/{schedule}", graph)
        for schedule in ("one_batch", "by_distance")
        for name, graph in graphs(world).items()
    ]:
        sim = SimulatedCommunicator(world, NET)
        expected = sim.neighbor_exchange(rows(world), outs, ins)
        doubled = torch.stack([expected * 2, expected * 3])
        for rank in range(world):
            real, sent = torch.load(tmp_path / f"rank{rank}.pt")[name]
            assert real.shape == (1,) + tuple(expected.shape[1:]), name
            assert torch.equal(real[0], expected[rank]), (name, rank)
            assert sent == [sim.ledger.bytes_by_worker[rank]], (name, rank)
            started, _ = torch.load(tmp_path / f"rank{rank}.pt")[name + "_started"]
            assert torch.equal(started[:, 0], doubled[:, rank]), (name, rank)


@pytest.mark.parametrize(
    "backend, local, world, expected",
    [
        ("gloo", "2", "4", "by_distance"),  # two machines
        ("gloo", "4", "4", "one_batch"),  # one machine: loopback is CPU-bound
        ("gloo", "", "", "one_batch"),  # not under a launcher
        ("nccl", "2", "4", "one_batch"),  # NCCL does not couple the two directions
    ],
)
def test_automatic_p2p_schedule(monkeypatch, backend, local, world, expected):
    from dpresearch.comm.distributed import default_p2p_schedule

    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    monkeypatch.setenv("WORLD_SIZE", world)
    assert default_p2p_schedule(backend) == expected
