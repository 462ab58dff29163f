"""Byte accounting: every collective records what left each worker.

`comm/bytes` in the metrics is the sum of `CommOp.nbytes` — the size of the tensors each worker
handed to collectives (values, indices, scales, padding: whatever the payload holds) — never a
formula. The network model turns the same records into modeled seconds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from dpresearch.comm.network import NetworkModel


@dataclass(frozen=True)
class CommOp:
    """One collective as seen by one worker.

    kind: "allreduce", "allreduce_ps" (parameter-server: gather to worker 0 + broadcast),
    "allgather", "broadcast" or "p2p" (neighbour exchange).
    nbytes: bytes of the payload this worker handed to the collective.
    group: number of workers taking part.
    peers: for "p2p", how many peers this worker sent its payload to.
    """

    kind: str
    nbytes: int
    group: int
    peers: int = 0


@dataclass
class CommLedger:
    """Cumulative per-worker bytes and modeled seconds, plus the ops of the current step."""

    network: NetworkModel
    bytes_sent: int = 0
    modeled_s: float = 0.0
    measured_s: float = 0.0
    op_counts: Counter = field(default_factory=Counter)
    step_ops: list[CommOp] = field(default_factory=list)

    def record(self, op: CommOp) -> None:
        self.bytes_sent += op.nbytes
        self.modeled_s += self.network.op_seconds(op)
        self.op_counts[op.kind] += 1
        self.step_ops.append(op)

    def add_measured(self, seconds: float) -> None:
        self.measured_s += seconds

    def end_step(self) -> list[CommOp]:
        """Return and clear the ops recorded since the last call."""
        ops, self.step_ops = self.step_ops, []
        return ops

    def reset(self) -> None:
        self.bytes_sent, self.modeled_s, self.measured_s = 0, 0.0, 0.0
        self.op_counts.clear()
        self.step_ops.clear()
