"""Byte accounting: every collective records what left each worker.

`comm/bytes` in the metrics comes from these records — the size of the tensors each worker
handed to the network (values, indices, scales, padding: whatever the payload holds) — never a
formula. A collective counts its payload once per worker; a point-to-point send of D bytes to p
peers counts p·D for the sender (an exponential graph is not as cheap as a ring), and a
receiver is charged nothing for what it only received. The network model turns the same records
into modeled seconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from dpresearch.comm.network import NetworkModel


@dataclass(frozen=True)
class CommOp:
    """One collective, as the network model prices it.

    kind: "allreduce", "allreduce_ps" (parameter-server: gather to worker 0 + broadcast),
    "allgather", "broadcast" or "p2p" (neighbour exchange).
    nbytes: bytes of the payload row each worker handed to the collective.
    group: number of workers taking part.
    peers: for "p2p", the largest number of peers any worker sent its row to (the round ends
    when the busiest link is done).
    """

    kind: str
    nbytes: int
    group: int
    peers: int = 0


@dataclass
class CommLedger:
    """Cumulative bytes per local worker, modeled and measured seconds, and the ops of the
    current step. `num_local`: how many workers this process holds (their ids are the
    communicator's `local_workers`, in that order)."""

    network: NetworkModel
    num_local: int = 1
    bytes_by_worker: list[int] = field(default_factory=list)
    modeled_s: float = 0.0
    measured_s: float = 0.0
    op_counts: Counter = field(default_factory=Counter)
    op_totals: Counter = field(default_factory=Counter)  # CommOp -> times recorded
    step_ops: list[CommOp] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.bytes_by_worker:
            self.bytes_by_worker = [0] * self.num_local

    @property
    def bytes_sent(self) -> int:
        """Bytes sent by the first local worker (every worker's, for collectives)."""
        return self.bytes_by_worker[0]

    def record(self, op: CommOp, sent_by_worker: Sequence[int] | None = None) -> None:
        """Record `op`. `sent_by_worker`: bytes each local worker sent (default: `op.nbytes`
        each, the case of every collective)."""
        sent = sent_by_worker if sent_by_worker is not None else [op.nbytes] * self.num_local
        for w, nbytes in enumerate(sent):
            self.bytes_by_worker[w] += int(nbytes)
        self.modeled_s += self.network.op_seconds(op)
        self.op_counts[op.kind] += 1
        self.op_totals[op] += 1
        self.step_ops.append(op)

    def add_measured(self, seconds: float) -> None:
        self.measured_s += seconds

    def end_step(self) -> list[CommOp]:
        """Return and clear the ops recorded since the last call."""
        ops, self.step_ops = self.step_ops, []
        return ops

    def reset(self) -> None:
        self.bytes_by_worker = [0] * self.num_local
        self.modeled_s, self.measured_s = 0.0, 0.0
        self.op_counts.clear()
        self.op_totals.clear()
        self.step_ops.clear()

    def op_table(self) -> list[list]:
        """Every distinct op with its count, `[kind, nbytes, group, peers, count]`, so a run
        can be re-priced on any network afterwards (`NetworkModel.total_seconds`)."""
        return [[op.kind, op.nbytes, op.group, op.peers, n] for op, n in self.op_totals.items()]
