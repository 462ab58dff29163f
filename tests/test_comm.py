"""Communicators: collective semantics, byte accounting and the α-β network model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dpresearch.comm.distributed import DistributedCommunicator
from dpresearch.comm.ledger import CommOp
from dpresearch.comm.network import PRESETS, NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator

NET = NetworkModel.preset("1gbe")


def stacked(k: int, d: int) -> torch.Tensor:
    return torch.arange(k * d, dtype=torch.float32).reshape(k, d)


def test_all_reduce_mean_and_sum():
    comm = SimulatedCommunicator(4, NET)
    x = stacked(4, 5)
    expected = x.mean(0)
    comm.all_reduce(x, op="mean")
    assert torch.equal(x, expected.expand(4, 5))
    y = stacked(4, 5)
    comm.all_reduce(y, op="sum")
    assert torch.equal(y[2], stacked(4, 5).sum(0))


def test_all_gather_broadcast_and_neighbor_exchange():
    comm = SimulatedCommunicator(3, NET)
    x = stacked(3, 2)
    assert torch.equal(comm.all_gather(x), x)
    b = stacked(3, 2)
    comm.broadcast(b, src=2)
    assert torch.equal(b, stacked(3, 2)[2].expand(3, 2))
    ring = [[(i - 1) % 3, (i + 1) % 3] for i in range(3)]
    comm.ledger.reset()
    got = comm.neighbor_exchange(stacked(3, 2), ring, ring)
    assert got.shape == (3, 2, 2)
    assert torch.equal(got[0], stacked(3, 2)[[1, 2]])  # in-peers in ascending order
    op = comm.ledger.step_ops[-1]
    assert (op.kind, op.peers, op.nbytes) == ("p2p", 2, 2 * 4)
    assert comm.ledger.bytes_sent == 2 * 2 * 4  # D bytes to each of 2 peers


def test_allreduce_bytes_are_payload_size_per_worker():
    """Acceptance D: an allreduce of D fp32 elements records D·4 bytes per worker."""
    d, k = 1000, 4
    comm = SimulatedCommunicator(k, NET)
    comm.all_reduce(torch.randn(k, d))
    assert comm.ledger.bytes_sent == d * 4
    assert comm.ledger.step_ops == [CommOp("allreduce", d * 4, k)]
    comm.all_reduce(torch.randn(k, d, dtype=torch.float16), record=True)
    assert comm.ledger.bytes_sent == d * 4 + d * 2
    comm.all_reduce(torch.randn(k, d), record=False)
    assert comm.ledger.bytes_sent == d * 6


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_modeled_time_is_the_alpha_beta_formula(preset):
    """Acceptance D: modeled time of a ring allreduce = 2(n−1)α + 2(n−1)/n·D/B."""
    latency_us, gbit = PRESETS[preset]
    alpha, bandwidth = latency_us * 1e-6, gbit * 1e9 / 8
    n, d = 8, 4 * 11_173_962
    comm = SimulatedCommunicator(n, NetworkModel.preset(preset))
    comm.all_reduce(torch.zeros(n, d // 4))
    expected = 2 * (n - 1) * alpha + 2 * (n - 1) / n * d / bandwidth
    assert comm.ledger.modeled_s == pytest.approx(expected, rel=1e-12)


def test_other_collective_formulas_and_centralized_reduction():
    net = NetworkModel(latency_s=1e-4, bandwidth_Bps=1e8)
    a, b, n, d = 1e-4, 1e8, 4, 4000
    assert net.op_seconds(CommOp("allgather", d, n)) == pytest.approx(3 * a + 3 * d / b)
    assert net.op_seconds(CommOp("allreduce_ps", d, n)) == pytest.approx(2 * a + 2 * 3 * d / b)
    assert net.op_seconds(CommOp("broadcast", d, n)) == pytest.approx(2 * (a + d / b))
    assert net.op_seconds(CommOp("p2p", d, n, peers=2)) == pytest.approx(a + 2 * d / b)
    assert net.op_seconds(CommOp("allreduce", d, 1)) == 0.0
    comm = SimulatedCommunicator(n, net, reduction="centralized")
    x = stacked(n, 1000)
    comm.all_reduce(x, op="mean")
    assert torch.equal(x[0], stacked(n, 1000).mean(0))
    assert comm.ledger.step_ops[-1].kind == "allreduce_ps"
    # Bandwidth-bound (large) payloads: the server's link carries 2(n−1)·D against the ring's
    # 2(n−1)/n·D, so the parameter server is slower; latency-bound ones favour it (2α vs 6α).
    big = 4_000_000
    assert net.op_seconds(CommOp("allreduce_ps", big, n)) > net.op_seconds(
        CommOp("allreduce", big, n)
    )
    assert net.op_seconds(CommOp("allreduce_ps", 4, n)) < net.op_seconds(CommOp("allreduce", 4, n))


def test_network_presets_units():
    net = NetworkModel.preset("1gbe")
    assert net.bandwidth_Bps == 125e6
    assert math.isclose(net.latency_s, 50e-6)
    with pytest.raises(ValueError, match="choose one of"):
        NetworkModel.preset("carrier-pigeon")


def test_distributed_bytes_equal_tensor_handed_to_collective(one_process_group, monkeypatch):
    """Recorded bytes equal the bytes of the tensor torch.distributed actually received."""
    handed = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        handed.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", spy)
    comm = DistributedCommunicator(NET)
    x = torch.randn(1, 777)
    comm.all_reduce(x)
    assert handed == [777 * 4]
    assert comm.ledger.bytes_sent == sum(handed)
    gathered = comm.all_gather(torch.ones(1, 3, dtype=torch.uint8))
    assert gathered.shape == (1, 3)
    assert comm.ledger.bytes_sent == 777 * 4 + 3


def test_collective_rejects_wrong_row_count():
    comm = SimulatedCommunicator(4, NET)
    with pytest.raises(ValueError, match="one row per local worker"):
        comm.all_reduce(torch.zeros(3, 2))


def test_message_overhead_and_allgather_factor_extend_the_model():
    """Both terms default to the ideal fabric; set, the overhead is paid once per message (as
    α is) and the factor scales only allgather's bandwidth term."""
    a, b, n, d, o = 1e-4, 1e8, 4, 40_000, 2e-3
    ideal = NetworkModel(a, b)
    gloo = NetworkModel(a, b, overhead_s=o, allgather_factor=1.25)
    units = NetworkModel.from_units(100.0, 0.8)
    assert (units.overhead_s, units.allgather_factor) == (0.0, 1.0)
    messages = {"allreduce": 6, "allreduce_ps": 2, "broadcast": 2}
    for kind, count in messages.items():
        op = CommOp(kind, d, n)
        assert ideal.messages(op) == count
        assert gloo.op_seconds(op) == pytest.approx(ideal.op_seconds(op) + count * o)
    ag = CommOp("allgather", d, n)
    assert gloo.op_seconds(ag) == pytest.approx(3 * (a + o) + 1.25 * 3 * d / b)
    p2p = CommOp("p2p", d, n, peers=2)
    assert gloo.op_seconds(p2p) == pytest.approx(a + o + 2 * d / b)
    assert gloo.op_seconds(CommOp("allgather", d, 1)) == 0.0  # alone: no message


def test_allgather_latency_replaces_alpha_in_allgather_only():
    """α_ag prices each allgather round (with o added, as to α); every other kind keeps α, and
    unset it is α itself."""
    a, a_ag, b, n, d, o = 1e-4, 2.5e-4, 1e8, 4, 40_000, 2e-3
    plain = NetworkModel(a, b, overhead_s=o, allgather_factor=1.1)
    gloo = NetworkModel(a, b, overhead_s=o, allgather_factor=1.1, allgather_latency_s=a_ag)
    ag = CommOp("allgather", d, n)
    assert gloo.op_seconds(ag) == pytest.approx(3 * (a_ag + o) + 1.1 * 3 * d / b)
    assert gloo.op_seconds(ag) - plain.op_seconds(ag) == pytest.approx(3 * (a_ag - a))
    for kind in ("allreduce", "allreduce_ps", "broadcast"):
        assert gloo.op_seconds(CommOp(kind, d, n)) == plain.op_seconds(CommOp(kind, d, n))
    assert gloo.op_seconds(CommOp("p2p", d, n, 2)) == plain.op_seconds(CommOp("p2p", d, n, 2))
    assert gloo.messages(ag) == plain.messages(ag) == 3
    assert NetworkModel.from_units(100.0, 0.8, allgather_latency_us=250.0).allgather_latency_s == (
        pytest.approx(250e-6)
    )


def test_network_config_reaches_the_model():
    from helpers import compose_config

    from dpresearch.run.build import network_model

    cfg = compose_config(
        "network=custom",
        "network.message_overhead_us=150",
        "network.allgather_factor=1.3",
        "network.allgather_latency_us=300",
    )
    net = network_model(cfg)
    assert net.overhead_s == pytest.approx(150e-6) and net.allgather_factor == 1.3
    assert net.allgather_latency_s == pytest.approx(300e-6)
    assert network_model(compose_config("network=custom")).allgather_latency_s is None
    assert network_model(compose_config("network=1gbe")) == NetworkModel.preset("1gbe")
