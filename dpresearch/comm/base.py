"""The communicator contract: collectives over K workers, of which this process holds W.

Tensors are *stacked*: row `w` of a `[W, ...]` tensor belongs to local worker
`local_workers[w]`. The same algorithm code then runs on K simulated workers in one process
(W = K) and on K torch.distributed ranks (W = 1).

Point-to-point messages (`isend`, `send`, `recv_any`, `recv`) go between *endpoints*: a worker
id, or an endpoint a process holds besides its workers (a parameter server; see
`first_worker`). A message is a tensor or a list of tensors; the receiver names where each
arrives (same dtypes and sizes), and learns who sent it. A message sent or received again and
again can be laid out once (`packed`): its tensors are then what travels, with no copy into or
out of a transport buffer.

Every op takes `record: bool | str = True`, the purpose of its traffic: True is the
algorithm's own payload (gradients, models, gossip messages; `comm/bytes`), a string names
another purpose ("buffers", "eval", "metrics", ...; `comm/bytes_<purpose>`), False records
nothing. The ledger keeps the bytes each sending worker handed to the collective per purpose,
prices them with the network model (`comm/modeled_s`) and keeps the time each collective was in
flight and the time its caller was blocked on it (see `ledger.py`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dpresearch.comm.ledger import ALGORITHM, CommLedger, CommOp, LedgerView, purpose_of
from dpresearch.comm.network import NetworkModel

if TYPE_CHECKING:
    from dpresearch.comm.hierarchy import Tiers

REDUCTIONS = ("ring", "centralized")
# How `reduce` and `broadcast` are priced and charged (`Communicator.rooted_algorithm`).
ROOTED_ALGORITHMS = ("tree", "ring")

Message = Tensor | Sequence[Tensor]


def message_parts(x: Message) -> list[Tensor]:
    """A message's tensors, in order."""
    return [x] if isinstance(x, Tensor) else list(x)


class Packed(list):
    """A message laid out once by a communicator (`Communicator.packed`): its tensors, which
    are views into `buffer` (one byte buffer, the form the message travels in) when the
    communicator packs messages, so that a send sends the buffer as it is and a receive lands
    in the tensors themselves; `buffer` is None where messages are not packed (one process)."""

    def __init__(self, parts: Sequence[Tensor], buffer: Tensor | None = None) -> None:
        super().__init__(parts)
        self.buffer = buffer


def message_bytes(parts: Sequence[Tensor]) -> int:
    return sum(t.nbytes for t in parts)


class PeerTimeout(TimeoutError):
    """No message arrived within the time a receive allowed."""


class PendingOp:
    """A collective in flight: `wait()` blocks until it has finished and returns its result
    (None for in-place ops). Idempotent."""

    def __init__(self, finish: Callable[[], None], result: Any = None) -> None:
        self._finish = finish
        self._result = result
        self._done = False

    def wait(self) -> Any:
        if not self._done:
            self._finish()
            self._done = True
        return self._result


@dataclass(frozen=True)
class ExchangePlan:
    """Who sends to whom in one neighbour exchange, normalised and checked.

    out_peers[i] / in_peers[i]: ascending, without duplicates or i itself, for every one of the
    K workers, with j ∈ out_peers[i] ⇔ i ∈ in_peers[j]. width: the largest in-degree (the P of
    the `[W, P, ...]` result, the same on every process); max_out: the largest out-degree.
    """

    out_peers: tuple[tuple[int, ...], ...]
    in_peers: tuple[tuple[int, ...], ...]
    width: int
    max_out: int

    @classmethod
    def build(
        cls, out_peers: Sequence[Sequence[int]], in_peers: Sequence[Sequence[int]], k: int
    ) -> ExchangePlan:
        if len(out_peers) != k or len(in_peers) != k:
            raise ValueError(f"out_peers and in_peers need one entry per worker ({k})")
        outs = tuple(
            tuple(sorted({int(j) for j in peers} - {i})) for i, peers in enumerate(out_peers)
        )
        ins = tuple(
            tuple(sorted({int(j) for j in peers} - {i})) for i, peers in enumerate(in_peers)
        )
        edges_out = {(i, j) for i, peers in enumerate(outs) for j in peers}
        edges_in = {(j, i) for i, peers in enumerate(ins) for j in peers}
        if edges_out != edges_in or any(not 0 <= j < k for _, j in edges_out):
            raise ValueError(
                "inconsistent peers: j must be in out_peers[i] exactly when i is in in_peers[j]"
            )
        width = max((len(p) for p in ins), default=0)
        return cls(outs, ins, width, max((len(p) for p in outs), default=0))


class Communicator(ABC):
    """Collectives over `world_size` workers; this process holds `local_workers`.

    reduction: "ring" (allreduce as a ring/tree collective) or "centralized" (parameter server
    on worker 0: gather, reduce, broadcast back). Both give the same sums; they differ in the
    traffic pattern the network model prices and, on real processes, in the calls made.

    deterministic: sums are added in worker order, ((x₀ + x₁) + x₂) + …, on every backend, so a
    simulated run and a run on processes agree bit for bit (a real ring adds in another order,
    which differs by rounding). On processes this gathers every payload and sums locally: the
    same bytes handed over per worker, more traffic on the wire than the ring; the network model
    still prices the allreduce the algorithm asked for. For reproducibility studies and tests.

    first_worker: endpoints below it are processes of the run that hold no worker (a parameter
    server: rank 0, workers 0…K−1 on ranks 1…K); `worker_of(endpoint)` maps. 0 in-process.
    """

    first_worker: int = 0
    # How `reduce` and `broadcast` are priced and their bytes charged: "tree" (binomial trees;
    # a broadcast charges its source only) or "ring" (NCCL's ring Reduce and Broadcast:
    # pipelined chains along the ring, every hop charged). Only the ledger differs: the values
    # are the same. A two-level cluster's intra tier takes `Hierarchy.intra_algorithm`.
    rooted_algorithm: str = "tree"

    def __init__(
        self,
        world_size: int,
        local_workers: Sequence[int],
        network: NetworkModel,
        reduction: str = "ring",
        deterministic: bool = False,
        ledger: CommLedger | LedgerView | None = None,
    ) -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction={reduction!r}; choose one of: {', '.join(REDUCTIONS)}")
        self.world_size = world_size
        self.local_workers = list(local_workers)
        self.reduction = reduction
        self.deterministic = deterministic
        # A tier's communicator records into its process's ledger (`CommLedger.view`).
        self.ledger = ledger if ledger is not None else CommLedger(network, len(self.local_workers))
        self._plans: dict[tuple, ExchangePlan] = {}
        # The two tiers of a two-level cluster (`comm.hierarchy`), None for a flat one.
        self.tiers: Tiers | None = None

    @property
    def num_local(self) -> int:
        return len(self.local_workers)

    @property
    def is_main_process(self) -> bool:
        """True in the process holding worker 0 (the one that writes the run directory)."""
        return 0 in self.local_workers

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, x: Tensor, op: str = "mean", record: bool | str = True) -> None:
        """In place: every row becomes the sum (op="sum") or mean (op="mean") over all K
        workers' rows."""
        if op not in ("sum", "mean"):
            raise ValueError(f"all_reduce op must be 'sum' or 'mean', got {op!r}")
        kind = "allreduce" if self.reduction == "ring" else "allreduce_ps"
        with self._timed(record, kind, x):
            self._all_reduce_sum(x)
        if op == "mean":
            x.div_(self.world_size)

    def sum_over_workers(
        self, x: Tensor, dtype: torch.dtype | None = None, record: bool | str = True
    ) -> Tensor:
        """The sum of all K workers' rows of `x` (`[W, ...]`), as one row `[1, ...]` in
        `dtype` (default: x's), the same on every process: this process's rows are added here
        (in worker order), then the processes' sums are all-reduced. Recorded as `all_reduce`
        of one `dtype` row per worker would be, but it moves one row per process, and nothing
        when every worker lives here (where `all_reduce` would write the sum into all K
        rows)."""
        if dtype is None or dtype == x.dtype:
            local = x.sum(0, keepdim=True)
        else:
            # row after row: a column reduction that converts the type is several times slower
            local = x[:1].to(dtype, copy=True)
            for w in range(1, x.shape[0]):
                local[0] += x[w]
        rows = local.expand(self.num_local, *local.shape[1:])
        kind = "allreduce" if self.reduction == "ring" else "allreduce_ps"
        if self.num_local == self.world_size:
            with self._timed(record, kind, rows):
                return local
        if self.num_local == 1:
            self.all_reduce(local, op="sum", record=record)
            return local
        padded = torch.zeros_like(rows)
        padded[0] = local[0]
        self.all_reduce(padded, op="sum", record=record)
        return padded[:1]

    def all_gather(self, x: Tensor, record: bool | str = True, charge: int | None = None) -> Tensor:
        """Every worker's row, `[K, ...]` in worker order (the same for all local workers).
        charge: the bytes per row to record instead of the row's own (a codec whose byte
        ledger follows another convention than its wire, e.g. natural compression at 8 bits
        per value, GRACE's count); None: the row's bytes."""
        with self._timed(record, "allgather", x, charge=charge):
            return self._all_gather(x)

    def all_gather_read(self, x: Tensor, record: bool | str = True) -> Tensor:
        """`all_gather(x)`, recorded the same, for a caller that only reads the result: where
        this process holds every worker, `x` itself (no copy of the `[K, ...]` rows)."""
        if self.num_local < self.world_size:
            return self.all_gather(x, record)
        with self._timed(record, "allgather", x):
            return x

    def broadcast(self, x: Tensor, src: int = 0, record: bool | str = True) -> None:
        """In place: every row becomes worker `src`'s row. Bytes: charged to `src` alone (a
        tree: the payload handed in), or, priced as a ring (`rooted_algorithm`), to every
        worker but src − 1, the last of the chain src → src+1 → … → src−1 (each before it
        forwards the row)."""
        if self.rooted_algorithm == "ring":
            last = (src - 1) % self.world_size
            timed = self._timed(record, "broadcast_ring", x, src=last, charge_src=False)
        else:
            timed = self._timed(record, "broadcast", x, src=src)
        with timed:
            self._broadcast(x, src)

    def reduce(self, x: Tensor, dst: int = 0, record: bool | str = True) -> None:
        """In place: worker `dst`'s row becomes the sum of all K workers' rows; the other rows
        are undefined afterwards. Bytes: every worker but `dst` is charged its row (a tree, or
        a ring's chain dst+1 → … → dst, each hop a partial sum of one row)."""
        kind = "reduce_ring" if self.rooted_algorithm == "ring" else "reduce"
        with self._timed(record, kind, x, src=dst, charge_src=False):
            self._reduce(x, dst)

    def all_to_all(self, x: Tensor, record: bool | str = True) -> Tensor:
        """`x` `[W, K, ...]`: slice j of a worker's row is its message to worker j. Returns
        `[W, K, ...]`: slice j of local worker w's row is what worker j sent to w. Bytes: each
        worker is charged its whole row (K slices: the bytes it hands to the collective)."""
        if x.dim() < 2 or x.shape[1] != self.world_size:
            raise ValueError(
                f"all_to_all expects [W, {self.world_size}, ...] rows, got {tuple(x.shape)}"
            )
        with self._timed(record, "alltoall", x):
            return self._all_to_all(x)

    def neighbor_exchange(
        self,
        x: Tensor,
        out_peers: Sequence[Sequence[int]],
        in_peers: Sequence[Sequence[int]],
        record: bool | str = True,
        out: Tensor | None = None,
    ) -> Tensor:
        """Each worker i sends its row to every worker in `out_peers[i]` and receives the row of
        every worker in `in_peers[i]` (both lists given for all K workers, by global id;
        duplicates and i itself are ignored, so a 2-worker ring's left = right peer is one
        peer). Returns `[W, P, ...]`: row p of local worker w is the row of its p-th in-peer in
        ascending id order, zeros beyond its in-degree; P is the largest in-degree of any
        worker, the same on every process.

        Bytes: a worker sending D bytes to p peers is charged p·D; receiving costs nothing.
        `out`: a `[W, P, ...]` tensor to receive into (reused buffers spare the page faults of
        a fresh multi-megabyte tensor every step); allocated if None.
        """
        return self.start_neighbor_exchange(x, out_peers, in_peers, record, out).wait()

    def start_neighbor_exchange(
        self,
        x: Tensor,
        out_peers: Sequence[Sequence[int]],
        in_peers: Sequence[Sequence[int]],
        record: bool | str = True,
        out: Tensor | None = None,
    ) -> PendingOp:
        """`neighbor_exchange` begun in the background: `wait()` returns the `[W, P, ...]`
        result. Neither `x` nor `out` may be touched until then (the send may still be
        reading x, the receives writing out). Bytes: recorded here, at the launch. Time: in
        flight from here until the backend reports completion (or, where it cannot, until
        `wait()` returns); exposed: the time spent in `wait()`."""
        self._check_rows(x)
        purpose = purpose_of(record)
        plan = self.exchange_plan(out_peers, in_peers)
        shape = (x.shape[0], plan.width) + tuple(x.shape[1:])
        if out is None:
            out = x.new_empty(shape)
        elif tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {shape}")
        start = time.perf_counter()
        received, finish = self._start_neighbor_exchange(x, plan, out)
        row_bytes = x[0].numel() * x.element_size()
        sent = [row_bytes * len(plan.out_peers[w]) for w in self.local_workers]
        op = CommOp("p2p", row_bytes, self.world_size, plan.max_out, purpose or ALGORITHM)
        return PendingOp(self._accounted(purpose, start, finish, op, sent), received)

    def exchange_plan(
        self, out_peers: Sequence[Sequence[int]], in_peers: Sequence[Sequence[int]]
    ) -> ExchangePlan:
        """The checked plan for these peer lists (cached: time-varying graphs repeat)."""
        key = (tuple(map(tuple, out_peers)), tuple(map(tuple, in_peers)))
        plan = self._plans.get(key)
        if plan is None:
            plan = ExchangePlan.build(out_peers, in_peers, self.world_size)
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    # -- point-to-point messages ---------------------------------------------------------
    @property
    def num_workers(self) -> int:
        """Workers of the run (endpoints from `first_worker` on)."""
        return self.world_size - self.first_worker

    def worker_of(self, endpoint: int) -> int | None:
        """The worker id endpoint `endpoint` holds (None: a process without a worker)."""
        return endpoint - self.first_worker if endpoint >= self.first_worker else None

    def packed(self, like: Message) -> Packed:
        """A message with the dtypes and shapes of `like`'s tensors (their values are not
        copied), laid out for this communicator: sending it or receiving into it costs no copy
        (see `Packed`). Between processes its tensors are on the CPU, where messages travel;
        in one process, on `like`'s devices."""
        return Packed([torch.empty_like(t) for t in message_parts(like)])

    def isend(
        self,
        x: Message,
        dst: int,
        src: int | None = None,
        record: bool | str = True,
        at: float | None = None,
    ) -> PendingOp:
        """Send message `x` from local endpoint `src` (default: this process's only one) to
        endpoint `dst`; the tensors must stay unchanged until the returned op completes.
        Bytes (O(1), see `CommLedger.record_message`): the message's bytes charged to `src`
        when it is a worker, one "p2p" op priced α + bytes/B, `at` the sender's clock."""
        parts = x if isinstance(x, Packed) else message_parts(x)
        src = self._local_endpoint(src)
        purpose = purpose_of(record)
        if purpose is not None:
            self.record_send(message_bytes(parts), src, purpose, at)
        return self._isend(parts, dst, src, purpose is not None)

    def record_send(
        self, nbytes: int, src: int, record: bool | str = True, at: float | None = None
    ) -> None:
        """Record a message of `nbytes` from local endpoint `src` exactly as `isend` records
        one (its bytes charged to `src` when it is a worker, one "p2p" op, `at` the sender's
        clock), sending nothing: for two endpoints of this process that exchange by reading
        each other's tensors where they lie (what the simulated communicator's `recv` would
        hand over anyway), so the run's bytes and ops are those of the messages."""
        self.record_sends(nbytes, (src,), record, at)

    def record_sends(
        self, nbytes: int, srcs: Sequence[int], record: bool | str = True, at: float | None = None
    ) -> None:
        """`record_send(nbytes, src, record, at)` for each endpoint of `srcs`, in order, in one
        call (a simulated AD-PSGD pair's two messages, recorded every event)."""
        purpose = purpose_of(record)
        if purpose is not None:
            rows, ledger = self._worker_rows, self.ledger
            for src in srcs:
                # the sender's ledger row; a process without a worker is charged nothing
                ledger.record_message(rows.get(src), nbytes, purpose, at)

    def send(self, *args: Any, **kwargs: Any) -> None:
        """`isend` with the same arguments (x, dst, src, record, at), waited for: returns once
        `x` may change again."""
        self.isend(*args, **kwargs).wait()

    def recv_any(
        self,
        out: Message | None = None,
        dst: int | None = None,
        timeout_s: float | None = None,
        record: bool | str = True,
    ) -> tuple[int, Message]:
        """The next message for local endpoint `dst` (default: this process's only one) from
        any sender: (sender, message). `out`: where the message's tensors land (required
        across processes); without it the simulated communicator hands over the sent tensors
        themselves. Raises `PeerTimeout` after `timeout_s` seconds without one (None: the
        backend's own limit). A message from another process is recorded under its sender
        (`CommLedger.record_heard`)."""
        return self._recv(out, None, self._local_endpoint(dst), timeout_s, purpose_of(record))

    def recv(
        self,
        src: int,
        out: Message | None = None,
        dst: int | None = None,
        timeout_s: float | None = None,
        record: bool | str = True,
    ) -> Message:
        """The next message for local endpoint `dst` from endpoint `src` (see `recv_any`)."""
        dst = self._local_endpoint(dst)
        return self._recv(out, src, dst, timeout_s, purpose_of(record))[1]

    @property
    def _worker_rows(self) -> dict[int, int]:
        """Ledger row of each local endpoint that holds a worker (made once)."""
        rows = self.__dict__.get("_rows")
        if rows is None:
            rows = self.__dict__["_rows"] = {
                e: i for i, e in enumerate(self.local_workers) if self.worker_of(e) is not None
            }
        return rows

    def _local_endpoint(self, endpoint: int | None) -> int:
        if endpoint is None:
            if self.num_local != 1:
                raise ValueError("this process holds several endpoints: name the one meant")
            return self.local_workers[0]
        return endpoint

    @abstractmethod
    def _isend(self, parts: list[Tensor], dst: int, src: int, recorded: bool) -> PendingOp:
        """Send `parts` (a `Packed` message as it is: see `packed`)."""

    @abstractmethod
    def _recv(
        self,
        out: Message | None,
        src: int | None,
        dst: int,
        timeout_s: float | None,
        purpose: str | None,
    ) -> tuple[int, Message]: ...

    def barrier(self) -> None:
        """Block until every process has reached this point."""

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every process's `obj` (picklable; tensors on the CPU), in process order, on the main
        process; None on the others. Not recorded (checkpoints, not training traffic)."""
        return [obj]

    def scatter_objects(self, objs: list[Any] | None) -> Any:
        """The inverse of `gather_objects`: the main process hands `objs[p]` to process p
        (the others pass None); returns this process's own."""
        assert objs is not None
        return objs[0]

    @property
    def can_overlap(self) -> bool:
        """Whether `start_all_reduce_sum` really runs in the background (one worker per
        process, ring reduction, not deterministic)."""
        return False

    def start_all_reduce_sum(self, x: Tensor, record: bool | str = True) -> PendingOp:
        """Begin an in-place sum allreduce of `x` ([W, ...]); `wait()` on the result finishes
        it. Here: done at once; communicators that can overlap return a running operation."""
        self.all_reduce(x, op="sum", record=record)
        return PendingOp(lambda: None)

    # -- implementation hooks ---------------------------------------------------------------
    @abstractmethod
    def _all_reduce_sum(self, x: Tensor) -> None: ...

    @abstractmethod
    def _all_gather(self, x: Tensor) -> Tensor: ...

    @abstractmethod
    def _broadcast(self, x: Tensor, src: int) -> None: ...

    def _reduce(self, x: Tensor, dst: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no reduce")

    def _all_to_all(self, x: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no all_to_all")

    @abstractmethod
    def _start_neighbor_exchange(
        self, x: Tensor, plan: ExchangePlan, out: Tensor
    ) -> tuple[Tensor, Callable[[], float | None]]:
        """Begin the exchange into `out` (`[W, plan.width, ...]`, contents undefined: slots
        past a worker's in-degree must be zeroed); return it, filled once the returned finish
        function has run, and that function, which blocks until the exchange is done and
        returns when it completed (`time.perf_counter()`) if the backend knows, else None."""

    # -- accounting -------------------------------------------------------------------------
    def _check_rows(self, x: Tensor) -> None:
        if x.dim() == 0 or x.shape[0] != self.num_local:
            raise ValueError(
                f"collective expects one row per local worker ({self.num_local}), "
                f"got shape {tuple(x.shape)}"
            )

    @contextmanager
    def _timed(
        self,
        record: bool | str,
        kind: str,
        x: Tensor,
        src: int | None = None,
        charge_src: bool = True,
        charge: int | None = None,
    ):
        """Wrap a synchronous collective on `x`: in flight and blocked for the call's
        duration; every local worker charged its row (or `charge` bytes for it), or only `src`
        (a broadcast), or all but `src` (`charge_src=False`: a reduce to `src`)."""
        self._check_rows(x)
        purpose = purpose_of(record)
        start = time.perf_counter()
        yield
        if purpose is not None:
            end = time.perf_counter()
            self.ledger.add_time((start, end), (start, end))
            row_bytes = x[0].numel() * x.element_size() if charge is None else int(charge)
            sent = (
                None
                if src is None
                else [row_bytes * ((w == src) == charge_src) for w in self.local_workers]
            )
            self.ledger.record(CommOp(kind, row_bytes, self.world_size, purpose=purpose), sent)

    def _accounted(
        self,
        purpose: str | None,
        start: float,
        finish: Callable[[], float | None],
        op: CommOp,
        sent: Sequence[int] | None = None,
    ) -> Callable[[], None]:
        """Record `op` now, at its launch (so its bytes belong to the step that sent it,
        whenever it is waited for), and return the `PendingOp` finish function of a collective
        launched at `start`: it runs `finish` (which blocks until done and may return the
        completion time) and records the op's time, in flight from `start` to its completion and
        blocked for the time spent waiting."""
        if purpose is not None:
            self.ledger.record(op, sent)

        def done() -> None:
            wait_start = time.perf_counter()
            completed = finish()
            wait_end = time.perf_counter()
            if purpose is not None:
                end = wait_end if completed is None else min(completed, wait_end)
                self.ledger.add_time((start, max(start, end)), (wait_start, wait_end))

        return done
