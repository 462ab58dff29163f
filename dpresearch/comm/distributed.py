"""Collectives over torch.distributed: one worker per process (W = 1), gloo or NCCL.

Messages (`isend` / `recv_any` / `recv`) travel as one byte buffer each on the CPU (the
message's tensors packed at 8-byte-aligned offsets), over the group itself on gloo and over a
gloo group beside NCCL (NCCL cannot receive from any source), created with the communicator
when `messages=True`. A `packed` message's tensors are views into its own buffer: sent as it is,
received in place; any other message is copied into a buffer kept per (peer, size) and out of one
kept per size. A receive waits on one `irecv`; gloo closes the connections of one that
times out, so `PeerTimeout` ends the messages between these processes (a peer is taken as lost).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dpresearch.comm.base import (
    Communicator,
    ExchangePlan,
    Message,
    Packed,
    PeerTimeout,
    PendingOp,
    message_bytes,
    message_parts,
)
from dpresearch.comm.hierarchy import INTER, INTRA, Hierarchy, Tiers, price_tiers
from dpresearch.comm.ledger import CommLedger, CommOp, LedgerView, purpose_of
from dpresearch.comm.network import NetworkModel


class DistributedCommunicator(Communicator):
    """This process is worker `dist.get_rank(group)` of the `dist.get_world_size(group)` workers
    of `group` (None: the default group, which must already be initialised).

    Worker ids are ranks within `group`. "centralized" reduction is a real parameter-server
    pattern: `reduce` to worker 0, then `broadcast` from it. `messages`: point-to-point
    messages will be used (on NCCL: creates the gloo group they travel in, a collective).
    `first_worker`: ranks below it hold no worker (see `Communicator`).
    """

    def __init__(
        self,
        network: NetworkModel,
        reduction: str = "ring",
        group: dist.ProcessGroup | None = None,
        deterministic: bool = False,
        p2p_schedule: str = "auto",
        hierarchy: Hierarchy | None = None,
        ledger: CommLedger | LedgerView | None = None,
        messages: bool = False,
        first_worker: int = 0,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistributedCommunicator needs an initialised process group")
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        super().__init__(size, [rank], network, reduction, deterministic, ledger)
        self.first_worker = first_worker
        self.group = group
        self._message_group = group
        if messages and dist.get_backend(group) != "gloo":
            self._message_group = dist.new_group(
                backend="gloo", ranks=None if group is None else dist.get_process_group_ranks(group)
            )
        self._sends: dict[tuple[int, int], tuple[Tensor, PendingOp]] = {}  # (dst, size)
        self._inbox: dict[int, Tensor] = {}  # receive buffers by size
        self._p2p_ready = False
        if p2p_schedule not in P2P_SCHEDULES:
            raise ValueError(
                f"comm.p2p_schedule={p2p_schedule}; choose one of: {', '.join(P2P_SCHEDULES)}"
            )
        if p2p_schedule == "auto":
            p2p_schedule = default_p2p_schedule(dist.get_backend(group))
        self.split_p2p_rounds = p2p_schedule == "by_distance"
        if hierarchy is not None:  # subgroups created here, once, by every rank
            self.tiers = self._two_level(hierarchy, p2p_schedule)

    def _two_level(self, hierarchy: Hierarchy, p2p_schedule: str) -> Tiers:
        """The tiers of this rank: creates every node's group and the leaders' group (every
        rank, in the same order: NCCL's rule) and keeps its own node's and, on a leader, the
        leaders'."""
        price_tiers(self, hierarchy)
        k, g = self.world_size, hierarchy.workers_per_node
        nodes = hierarchy.nodes(k)
        me = self.local_workers[0]
        groups = [dist.new_group(list(range(i * g, (i + 1) * g))) for i in range(nodes)]
        leaders = dist.new_group([i * g for i in range(nodes)])

        def tier(network: NetworkModel, group: dist.ProcessGroup, name: str):
            return DistributedCommunicator(
                network,
                self.reduction,
                group,
                self.deterministic,
                p2p_schedule,
                ledger=self.ledger.view([0], name),
            )

        intra = tier(hierarchy.intra, groups[me // g], INTRA)
        inter = tier(hierarchy.inter, leaders, INTER) if me % g == 0 else None
        return Tiers(hierarchy, intra, inter, [0] if inter is not None else [])

    def _global(self, worker: int) -> int:
        """Global rank of worker `worker` of the group (the id torch.distributed calls take)."""
        return worker if self.group is None else dist.get_global_rank(self.group, worker)

    def _all_reduce_sum(self, x: Tensor) -> None:
        if self.deterministic:
            # The simulated communicator's exact operation on the same [K, ...] rows.
            x.copy_(self._all_gather(x).sum(dim=0, keepdim=True))
        elif self.reduction == "ring":
            dist.all_reduce(x[0], op=dist.ReduceOp.SUM, group=self.group)
        else:
            dist.reduce(x[0], dst=self._global(0), op=dist.ReduceOp.SUM, group=self.group)
            dist.broadcast(x[0], src=self._global(0), group=self.group)

    def _all_gather(self, x: Tensor) -> Tensor:
        out = x.new_empty((self.world_size,) + tuple(x.shape[1:]))
        dist.all_gather(list(out.unbind(0)), x[0].contiguous(), group=self.group)
        return out

    def _broadcast(self, x: Tensor, src: int) -> None:
        dist.broadcast(x[0], src=self._global(src), group=self.group)

    def _reduce(self, x: Tensor, dst: int) -> None:
        if self.deterministic:
            # The simulated communicator's exact operation on the same [K, ...] rows.
            every = self._all_gather(x)
            if self.local_workers[0] == dst:
                x[0].copy_(every.sum(dim=0))
            return
        dist.reduce(x[0], dst=self._global(dst), op=dist.ReduceOp.SUM, group=self.group)

    def _all_to_all(self, x: Tensor) -> Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out[0], x[0].contiguous(), group=self.group)
        return out

    def _start_neighbor_exchange(
        self, x: Tensor, plan: ExchangePlan, out: Tensor
    ) -> tuple[Tensor, Callable[[], float | None]]:
        if not self._p2p_ready:
            # NCCL requires every rank of the group in the first batched P2P call unless a
            # collective ran before it (pytorch#73960): a one-element allreduce guarantees that.
            dist.all_reduce(x.new_zeros(1), group=self.group)
            self._p2p_ready = True
        me = self.local_workers[0]
        send = x[0].contiguous()
        received = out
        received[0, len(plan.in_peers[me]) :] = 0
        rounds = self._p2p_rounds(plan, me, send, received)
        # gloo: one round at a time (see `split_p2p_rounds`); the first starts now, so it
        # overlaps whatever the caller does before `wait()`. NCCL: everything in one group.
        if not self.split_p2p_rounds:
            rounds = [[op for ops in rounds for op in ops]]
        requests = dist.batch_isend_irecv(rounds[0]) if rounds and rounds[0] else []

        def finish() -> None:  # gloo's point-to-point work has no future: completion unknown
            for request in requests:
                request.wait()
            for ops in rounds[1:]:
                for request in dist.batch_isend_irecv(ops):
                    request.wait()

        return received, finish

    def _p2p_rounds(
        self, plan: ExchangePlan, me: int, send: Tensor, received: Tensor
    ) -> list[list[dist.P2POp]]:
        """This worker's sends and receives grouped by ring distance d = (dst − src) mod K,
        in ascending d over every distance the plan uses (the same list on every rank, so all
        ranks run the rounds in one order; a round is a permutation, so none can deadlock).
        Within a round, for each pair the lower rank posts its send first and the higher rank
        its receive first: matching operations in the same order on both sides (NCCL ignores
        tags). Peers are deduplicated: one send and at most one receive per peer."""
        k = self.world_size
        outs, ins = plan.out_peers[me], plan.in_peers[me]
        distances = sorted({(j - i) % k for i, peers in enumerate(plan.out_peers) for j in peers})
        rounds = []
        for d in distances:
            ops = []
            dst, src = (me + d) % k, (me - d) % k
            if dst in outs:
                ops.append(dist.P2POp(dist.isend, send, self._global(dst), self.group))
            if src in ins:
                slot = received[0, ins.index(src)]
                recv = dist.P2POp(dist.irecv, slot, self._global(src), self.group)
                ops.insert(0 if me > src else len(ops), recv)
            if ops:  # a round without this worker needs nothing from it
                rounds.append(ops)
        return rounds

    # -- messages --------------------------------------------------------------------------
    def _message_rank(self, endpoint: int) -> int:
        group = self._message_group
        return endpoint if group is None else dist.get_global_rank(group, endpoint)

    def packed(self, like: Message) -> Packed:
        parts = message_parts(like)
        buf = torch.empty(packed_size(parts), dtype=torch.uint8)
        return Packed(views(buf, parts), buf)

    def _isend(self, parts: list[Tensor], dst: int, src: int, recorded: bool) -> PendingOp:
        # a packed message's tensors are its buffer, the caller's to keep unchanged until sent
        own = isinstance(parts, Packed) and parts.buffer is not None
        buf = parts.buffer if own else self._send_buffer(parts, dst)
        start = time.perf_counter()
        work = dist.isend(buf, dst=self._message_rank(dst), group=self._message_group)

        def finish() -> None:
            wait_start = time.perf_counter()
            work.wait()
            if recorded:
                end = time.perf_counter()
                self.ledger.add_time((start, end), (wait_start, end))

        op = PendingOp(finish)
        if not own:
            self._sends[(dst, buf.numel())] = (buf, op)
        return op

    def _send_buffer(self, parts: list[Tensor], dst: int) -> Tensor:
        """`parts` copied into this communicator's buffer for messages of their size to `dst`."""
        key = (dst, packed_size(parts))
        held = self._sends.get(key)
        if held is not None:
            # the buffer's previous message has left (through its idempotent op: a second
            # wait() on gloo's send work waits for another send)
            held[1].wait()
            buf = held[0]
        else:
            buf = torch.empty(key[1], dtype=torch.uint8)
        pack(parts, buf)
        return buf

    def _recv(
        self,
        out: Message | None,
        src: int | None,
        dst: int,
        timeout_s: float | None,
        purpose: str | None,
    ) -> tuple[int, Message]:
        if out is None:
            raise ValueError("a receive across processes needs `out` (the message's tensors)")
        in_place = isinstance(out, Packed) and out.buffer is not None
        parts = message_parts(out)
        buf = out.buffer if in_place else self._receive_buffer(packed_size(parts))
        peer = None if src is None else self._message_rank(src)
        work = dist.irecv(buf, src=peer, group=self._message_group)
        start = time.perf_counter()
        try:
            work.wait() if timeout_s is None else work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower():
                raise PeerTimeout(f"no message within {timeout_s:g} s ({exc})") from None
            raise
        end = time.perf_counter()
        sender = src if src is not None else self._sender(work)
        if not in_place:
            unpack(buf, parts)
        if purpose is not None:
            nbytes = message_bytes(parts)
            self.ledger.record_heard(sender, nbytes, purpose)
            # priced here too: the process that hears every worker holds the run's op table
            self.ledger.record_message(None, nbytes, purpose)
            self.ledger.add_time((start, end), (start, end))
        return sender, out

    def _receive_buffer(self, size: int) -> Tensor:
        buf = self._inbox.get(size)
        if buf is None:
            buf = self._inbox[size] = torch.empty(size, dtype=torch.uint8)
        return buf

    def _sender(self, work: Any) -> int:
        rank = work._source_rank()
        group = self._message_group
        return rank if group is None else dist.get_group_rank(group, rank)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def gather_objects(self, obj: Any) -> list[Any] | None:
        main = self.is_main_process
        out: list[Any] | None = [None] * self.world_size if main else None
        dist.gather_object(obj, out, dst=self._global(0), group=self.group)
        return out

    def scatter_objects(self, objs: list[Any] | None) -> Any:
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs, src=self._global(0), group=self.group)
        return out[0]

    @property
    def can_overlap(self) -> bool:
        return self.reduction == "ring" and not self.deterministic

    def start_all_reduce_sum(self, x: Tensor, record: bool | str = True) -> PendingOp:
        if not self.can_overlap:
            return super().start_all_reduce_sum(x, record)
        purpose = purpose_of(record)
        start = time.perf_counter()
        work = dist.all_reduce(x[0], op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        completed: list[float] = []
        if not x.is_cuda:
            # gloo completes the future on its own thread when the data has arrived; NCCL's
            # would complete at kernel launch, so there the completion is seen at wait().
            work.get_future().add_done_callback(lambda _: completed.append(time.perf_counter()))

        def finish() -> float | None:
            work.wait()
            return completed[0] if completed else None

        op = CommOp("allreduce", x[0].numel() * x.element_size(), self.world_size)
        return PendingOp(self._accounted(purpose, start, finish, op))


P2P_SCHEDULES = ("auto", "by_distance", "one_batch")
ALIGN = 8


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def packed_size(parts: Sequence[Tensor]) -> int:
    """Bytes of the buffer `pack` fills: each tensor at an 8-byte-aligned offset."""
    return sum(_aligned(t.numel() * t.element_size()) for t in parts)


def pack(parts: Sequence[Tensor], buf: Tensor) -> None:
    """Copy `parts` into the uint8 CPU buffer `buf` (see `packed_size`)."""
    offset = 0
    for t in parts:
        n = t.numel() * t.element_size()
        buf[offset : offset + n].view(t.dtype).copy_(t.reshape(-1))
        offset += _aligned(n)


def views(buf: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Tensors shaped like `like`'s, viewing the uint8 CPU buffer `buf` where `pack` puts them
    (see `packed_size`)."""
    out, offset = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        out.append(buf[offset : offset + n].view(t.dtype).view(t.shape))
        offset += _aligned(n)
    return out


def unpack(buf: Tensor, parts: Sequence[Tensor]) -> None:
    """Copy the packed `buf` into `parts` (the same dtypes and sizes as packed)."""
    offset = 0
    for t in parts:
        n = t.numel() * t.element_size()
        t.view(-1).copy_(buf[offset : offset + n].view(t.dtype))
        offset += _aligned(n)


def default_p2p_schedule(backend: str) -> str:
    """How a neighbour exchange is posted when `comm.p2p_schedule=auto`.

    gloo sends a message only once the receiver's "ready" note arrives, and that note queues
    behind the receiver's own outgoing data on the same TCP stream, so sending both ways
    between two ranks at once serialises the directions: on a 100 Mbit link a ring exchange took
    1.65–1.8× α + 2·D/B in one batch, 1.09× one distance at a time (`by_distance`). Between
    processes of one machine (loopback, CPU-bound) the extra rounds cost more than they save
    (5.3 MB ring exchange, 4 ranks: 51 ms by distance, 33 ms in one batch). NCCL has no such
    coupling. So: `by_distance` for gloo across machines, `one_batch` otherwise.
    """
    import os

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    world = int(os.environ.get("WORLD_SIZE", "0") or 0)
    across_machines = 0 < local < world
    return "by_distance" if backend != "nccl" and across_machines else "one_batch"


def default_device_for(backend: str, local_rank: int) -> torch.device:
    """The device a worker of `backend` computes on: its own GPU for NCCL, else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
