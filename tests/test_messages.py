"""Point-to-point messages in the communicator (issue 17, item 1): send to a peer, receive from
any peer (with its id) or from one, lists of tensors as one message, a timeout, and the bytes
recorded at the send in O(1) per worker and purpose with the sender's clock; the same on K
simulated workers and on gloo processes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, load_scaled, spawn_sequence

from dpresearch.comm.base import PeerTimeout
from dpresearch.comm.distributed import DistributedCommunicator, pack, packed_size, unpack, views
from dpresearch.comm.ledger import CommOp
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator

NET = NetworkModel.preset("1gbe")
SERVER = -1  # an endpoint without a worker, held by the simulating process


def test_simulated_messages_arrive_in_order_with_their_sender():
    comm = SimulatedCommunicator(3, NET)
    a, b = torch.arange(4.0), torch.arange(6, dtype=torch.int32)
    comm.isend(a, dst=SERVER, src=2)
    comm.send([a, b], dst=SERVER, src=0, record="pull")
    comm.isend(b, dst=1, src=0)
    sender, got = comm.recv_any(dst=SERVER)
    assert sender == 2 and got is a  # handed over, not copied
    out = [torch.empty(4), torch.empty(6, dtype=torch.int32)]
    sender, got = comm.recv_any(out, dst=SERVER)
    assert sender == 0 and got is out and torch.equal(out[1], b)
    assert torch.equal(comm.recv(0, dst=1), b)
    with pytest.raises(PeerTimeout, match="nobody else can send"):
        comm.recv_any(dst=SERVER, timeout_s=5)
    # in one process a laid-out message is plain tensors of the same dtypes and shapes
    packed = comm.packed([a, b])
    assert packed.buffer is None and [(t.dtype, t.shape) for t in packed] == [
        (a.dtype, a.shape),
        (b.dtype, b.shape),
    ]


def test_recv_from_one_sender_skips_the_others():
    comm = SimulatedCommunicator(3, NET)
    for w in (0, 1, 2):
        comm.isend(torch.tensor([float(w)]), dst=SERVER, src=w)
    assert comm.recv(1, dst=SERVER).item() == 1.0
    assert [comm.recv_any(dst=SERVER)[0] for _ in range(2)] == [0, 2]


def test_message_bytes_are_charged_to_the_sender_per_purpose_in_constant_time():
    comm = SimulatedCommunicator(4, NET)
    ledger = comm.ledger
    grad, header = torch.zeros(250), torch.zeros(4, dtype=torch.float64)
    for i in range(1000):
        comm.isend([header, grad], dst=SERVER, src=i % 3, at=0.5 * i)
    comm.isend(grad, dst=2, src=SERVER)  # the server holds no worker: charged to nobody
    comm.isend(header, dst=SERVER, src=3, record="metrics")
    size = 32 + 1000
    assert ledger.bytes_by_purpose["algorithm"] == [334 * size, 333 * size, 333 * size, 0]
    assert ledger.bytes_of("metrics") == [0, 0, 0, 32]
    assert ledger.clock[:3] == [0.5 * 999, 0.5 * 997, 0.5 * 998]
    op = CommOp("p2p", size, 2, peers=1)
    assert ledger.op_totals[op] == 1000 and ledger.op_counts["p2p"] == 1001
    assert ledger.modeled_by_purpose["algorithm"] == pytest.approx(
        1000 * NET.op_seconds(op) + NET.op_seconds(CommOp("p2p", 1000, 2, peers=1))
    )
    assert NET.op_seconds(op) == pytest.approx(NET.latency_s + size / NET.bandwidth_Bps)
    assert NetworkModel.preset("1gbe").total_seconds(ledger.op_table()) == pytest.approx(
        ledger.modeled_s
    )
    restored = SimulatedCommunicator(4, NET).ledger
    restored.load_state_dict(ledger.state_dict())
    assert restored.bytes_by_purpose == ledger.bytes_by_purpose
    assert restored.clock == ledger.clock


def test_recording_a_send_in_place_records_what_the_send_would():
    """`record_send` (two endpoints of one process reading each other's tensors in place, e.g.
    a simulated AD-PSGD pair): the ledger afterwards is the one `isend` of the same messages
    leaves — bytes per worker and purpose, ops, modeled seconds, clocks — and nothing is
    queued for a receiver."""
    sent, recorded = SimulatedCommunicator(4, NET), SimulatedCommunicator(4, NET)
    row, buffers = torch.zeros(250), torch.zeros(3, dtype=torch.float64)
    for i, (src, dst) in enumerate([(0, 1), (1, 0), (2, 3), (3, 2), (2, 1)]):
        sent.isend([row, buffers], dst=dst, src=src, at=0.25 * i)
        recorded.record_send(row.nbytes + buffers.nbytes, src, at=0.25 * i)
    sent.isend(row, dst=0, src=SERVER, record="metrics")  # no worker: charged to nobody
    recorded.record_send(row.nbytes, SERVER, record="metrics")
    sent.isend(row, dst=0, src=1, record=False)  # unrecorded
    recorded.record_send(row.nbytes, 1, record=False)
    a, b = sent.ledger, recorded.ledger
    assert b.bytes_by_purpose == a.bytes_by_purpose == {"algorithm": [1024, 1024, 2048, 1024]}
    assert b.clock == a.clock == [0.0, 0.25, 1.0, 0.75]
    assert b.op_totals == a.op_totals and b.op_counts == a.op_counts
    assert b.purpose_op_counts == a.purpose_op_counts
    assert b.modeled_by_purpose == a.modeled_by_purpose
    assert b.op_table() == a.op_table() and b.end_step() == a.end_step()
    assert not any(recorded._mailbox.values())
    with pytest.raises(PeerTimeout):
        recorded.recv(0, dst=1)
    # a pair's two messages in one call: the same ledger as two calls
    pair = SimulatedCommunicator(4, NET)
    for i, (src, dst) in enumerate([(0, 1), (2, 3)]):
        pair.record_sends(row.nbytes + buffers.nbytes, (src, dst), at=0.25 * i)
    fresh = SimulatedCommunicator(4, NET)
    for i, (src, dst) in enumerate([(0, 1), (2, 3)]):
        fresh.record_send(row.nbytes + buffers.nbytes, src, at=0.25 * i)
        fresh.record_send(row.nbytes + buffers.nbytes, dst, at=0.25 * i)
    c, d = pair.ledger, fresh.ledger
    assert c.bytes_by_purpose == d.bytes_by_purpose == {"algorithm": [1024] * 4}
    assert c.clock == d.clock and c.op_counts == d.op_counts and c.op_table() == d.op_table()


def test_pack_round_trip_keeps_every_dtype():
    parts = [
        torch.tensor([1.5, -2.0], dtype=torch.float64),
        torch.arange(3, dtype=torch.uint8),
        torch.randn(5),
        torch.tensor([7], dtype=torch.int32),
    ]
    buf = torch.empty(packed_size(parts), dtype=torch.uint8)
    assert buf.numel() == 16 + 8 + 24 + 8  # each part at an 8-byte boundary
    pack(parts, buf)
    out = [torch.empty_like(p) for p in parts]
    unpack(buf, out)
    assert all(torch.equal(a, b) for a, b in zip(parts, out, strict=True))
    # a packed message's tensors are these places in the buffer (what `packed` lays out)
    laid_out = views(buf, parts)
    assert all(torch.equal(a, b) for a, b in zip(parts, laid_out, strict=True))
    laid_out[2].zero_()
    assert buf[24:44].eq(0).all() and buf[16:19].tolist() == [0, 1, 2]


def _gloo_peer(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    comm = DistributedCommunicator(NET, messages=True, first_worker=1)
    header, body = torch.zeros(2, dtype=torch.float64), torch.zeros(3, dtype=torch.int32)
    result: dict = {}
    if rank == 0:  # the server: hears every worker, in any order
        got = {}
        # the first message lands in plain tensors (copied out of a receive buffer), the
        # second in a packed message's own buffer (in place)
        inbox = comm.packed([header, body])
        assert inbox.buffer is not None and inbox[1].data_ptr() == inbox.buffer.data_ptr() + 16
        for place in ([header, body], inbox):
            sender, message = comm.recv_any(place)
            assert message is place
            got[sender] = (place[0].tolist(), place[1].tolist())
        result["got"] = got
        comm.send(torch.tensor([42.0]), dst=2, record=False)
        result["heard"] = comm.ledger.heard["algorithm"]
    else:
        message = [
            torch.tensor([rank, 0.5], dtype=torch.float64),
            torch.full((3,), 10 * rank, dtype=torch.int32),
        ]
        if rank == 2:  # sent as its buffer, with no copy
            packed = comm.packed(message)
            for place, part in zip(packed, message, strict=True):
                place.copy_(part)
            message = packed
        comm.send(message, dst=0, at=float(rank))
        if rank == 2:
            result["answer"] = comm.recv(0, torch.empty(1)).item()
        result["sent"] = list(comm.ledger.bytes_by_worker)
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_gloo_messages_from_any_peer_with_a_timeout(tmp_path):
    world = 3
    spawn_sequence(world, [(_gloo_peer, (world, free_port(), str(tmp_path)))])
    server, one, two = (torch.load(tmp_path / f"rank{r}.pt") for r in range(world))
    assert server["got"] == {1: ([1.0, 0.5], [10] * 3), 2: ([2.0, 0.5], [20] * 3)}
    size = 16 + 12
    assert server["heard"] == {1: size, 2: size}  # what each worker sent, heard
    assert one["sent"] == [size] and two["sent"] == [size]
    assert two["answer"] == 42.0


def _silent_peer(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = DistributedCommunicator(NET, messages=True)
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(PeerTimeout, match="no message within 1 s"):
            comm.recv_any(torch.empty(1), timeout_s=1.0)
        (Path(out) / "waited").write_text(str(time.monotonic() - start))
    else:  # alive, but silent (gloo closed the pair: nothing more is sent) until rank 0 is done
        deadline = time.monotonic() + 300  # a hang guard
        while not (Path(out) / "waited").exists() and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.mark.distributed
def test_gloo_receive_times_out_on_a_silent_peer(tmp_path):
    spawn_sequence(2, [(_silent_peer, (free_port(), str(tmp_path)))])
    assert 0.9 <= float((tmp_path / "waited").read_text()) < load_scaled(30)  # a hang guard
