"""The communicator contract: collectives over K workers, of which this process holds W.

Tensors are *stacked*: row `w` of a `[W, ...]` tensor belongs to local worker
`local_workers[w]`. The same algorithm code then runs on K simulated workers in one process
(W = K) and on K torch.distributed ranks (W = 1).

Every op takes `record=True`: the bytes each worker handed to the collective are written to
the ledger (`comm/bytes`) and priced by the network model (`comm/modeled_s`). Metric and
evaluation traffic passes `record=False`, so the accounting holds only the algorithm's bytes.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import contextmanager

from torch import Tensor

from dpresearch.comm.ledger import CommLedger, CommOp
from dpresearch.comm.network import NetworkModel

REDUCTIONS = ("ring", "centralized")


class PendingOp:
    """A collective in flight: `wait()` blocks until it has finished (idempotent)."""

    def __init__(self, finish) -> None:
        self._finish = finish
        self._done = False

    def wait(self) -> None:
        if not self._done:
            self._finish()
            self._done = True


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
    """

    def __init__(
        self,
        world_size: int,
        local_workers: Sequence[int],
        network: NetworkModel,
        reduction: str = "ring",
        deterministic: bool = False,
    ) -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction={reduction!r}; choose one of: {', '.join(REDUCTIONS)}")
        self.world_size = world_size
        self.local_workers = list(local_workers)
        self.reduction = reduction
        self.deterministic = deterministic
        self.ledger = CommLedger(network)

    @property
    def num_local(self) -> int:
        return len(self.local_workers)

    @property
    def is_main_process(self) -> bool:
        """True in the process holding worker 0 (the one that writes the run directory)."""
        return 0 in self.local_workers

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, x: Tensor, op: str = "mean", record: bool = True) -> None:
        """In place: every row becomes the sum (op="sum") or mean (op="mean") over all K
        workers' rows."""
        if op not in ("sum", "mean"):
            raise ValueError(f"all_reduce op must be 'sum' or 'mean', got {op!r}")
        kind = "allreduce" if self.reduction == "ring" else "allreduce_ps"
        with self._timed(record, kind, x):
            self._all_reduce_sum(x)
        if op == "mean":
            x.div_(self.world_size)

    def all_gather(self, x: Tensor, record: bool = True) -> Tensor:
        """Every worker's row, `[K, ...]` in worker order (the same for all local workers)."""
        with self._timed(record, "allgather", x):
            return self._all_gather(x)

    def broadcast(self, x: Tensor, src: int = 0, record: bool = True) -> None:
        """In place: every row becomes worker `src`'s row."""
        with self._timed(record, "broadcast", x):
            self._broadcast(x, src)

    def neighbor_exchange(
        self,
        x: Tensor,
        out_peers: Sequence[Sequence[int]],
        in_peers: Sequence[Sequence[int]],
        record: bool = True,
    ) -> list[Tensor]:
        """Each worker i sends its row to every worker in `out_peers[i]` and receives from every
        worker in `in_peers[i]` (both indexed by global worker id; they must be consistent:
        j in out_peers[i] ⇔ i in in_peers[j]). Returns, per local worker, a `[len(in_peers), ...]`
        tensor of the received rows in `in_peers` order."""
        peers = max((len(out_peers[w]) for w in self.local_workers), default=0)
        with self._timed(record, "p2p", x, peers=peers):
            return self._neighbor_exchange(x, out_peers, in_peers)

    def barrier(self) -> None:
        """Block until every process has reached this point."""

    @property
    def can_overlap(self) -> bool:
        """Whether `start_all_reduce_sum` really runs in the background (one worker per
        process, ring reduction, not deterministic)."""
        return False

    def start_all_reduce_sum(self, x: Tensor, record: bool = True) -> PendingOp:
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

    @abstractmethod
    def _neighbor_exchange(
        self, x: Tensor, out_peers: Sequence[Sequence[int]], in_peers: Sequence[Sequence[int]]
    ) -> list[Tensor]: ...

    # -- accounting -------------------------------------------------------------------------
    @contextmanager
    def _timed(self, record: bool, kind: str, x: Tensor, peers: int = 0):
        if x.shape[0] != self.num_local:
            raise ValueError(
                f"collective expects one row per local worker ({self.num_local}), "
                f"got shape {tuple(x.shape)}"
            )
        start = time.perf_counter()
        yield
        if record:
            self.ledger.add_measured(time.perf_counter() - start)
            row_bytes = x[0].numel() * x.element_size()
            self.ledger.record(CommOp(kind, row_bytes, self.world_size, peers))
