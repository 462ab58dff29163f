"""The α-β network cost model: modeled seconds for each recorded collective.

With latency α (seconds per message), bandwidth B (bytes/second), n workers and a payload of
D bytes per worker:

- ring allreduce:            2(n−1)α + 2(n−1)/n · D/B
- parameter-server allreduce (worker 0 hosts the server; its link carries every payload in and
  the result out):           2α + 2(n−1) · D/B
- ring allgather:            (n−1)α + (n−1) · D/B
- broadcast (binomial tree): ⌈log₂ n⌉ · (α + D/B)
- reduce to one worker (binomial tree, the broadcast reversed): ⌈log₂ n⌉ · (α + D/B)
- ring broadcast / ring reduce (NCCL's Broadcast and Reduce: a chain along the ring, from the
  root / ending at it, the payload pipelined through it in chunks, so every link carries D
  once and each of the n−1 hops adds a latency; the limit of fine chunks):
                             (n−1)α + D/B
- all-to-all (each worker's row of D bytes is n slices, one per worker; pairwise exchange):
                             (n−1)α + (n−1)/n · D/B
- neighbour exchange to p peers (sends serialised on one full-duplex link): α + p · D/B

A group of one worker costs nothing. An op recorded as hidden behind h steps of computation
(`CommOp.hidden_steps`: a Streaming DiLoCo fragment launched at step t and merged at t + τ has
h = τ) costs only what exceeds them: max(0, T − h·c), with T its formula above and c the
modeled compute seconds of one step (`compute_step_s`, `network.compute_step_s`; 0 by default,
so nothing is hidden unless a compute time is given). The presets are nominal figures for
common fabrics; pass `network=custom network.latency_us=... network.bandwidth_gbit=...` for
your own.

Three optional terms make the model predict a CPU cluster's gloo rather than an ideal fabric
(all off by default; `experiments/bench/emulated_network.py` measures them on a shaped link):

- `overhead_s` (`network.message_overhead_us`), o: host overhead per message, added to α in
  every formula above (a ring allreduce pays 2(n−1)·o, an allgather (n−1)·o, a broadcast
  ⌈log₂ n⌉·o). α stays the fabric's latency; o is the software's: waking gloo's threads and
  processing TCP on a busy CPU, which in training costs milliseconds per message where a
  tight loop on an idle CPU measures tens of microseconds. It dominates small payloads.
- `allgather_factor` (`network.allgather_factor`): multiplies the allgather bandwidth term.
  gloo's TCP allgather achieves about 70–80% of the link in each direction (a sender waits for
  the receiver's ready notification, which queues behind the receiver's own outgoing data),
  i.e. a factor ≈ 1.05–1.4; its ring allreduce is not affected.
- `allgather_latency_s` (`network.allgather_latency_us`), α_ag: the latency of one allgather
  round in place of α (None: α). The same handshake (data waits for the receiver's ready
  notification) costs gloo's allgather about one more message per round: a 4-byte allgather
  between two hosts took 2.0–3.3 α over six calibrations (α = half a 4-byte allreduce),
  which the model with α alone prices at 1 α. Small allgathers (top-k,
  random-k, QSGD, sign payloads of a few KB) are latency-bound and feel it; o is added to it
  as to α.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpresearch.comm.ledger import CommOp

# name: (latency in microseconds, bandwidth in Gbit/s)
PRESETS: dict[str, tuple[float, float]] = {
    "1gbe": (50.0, 1.0),
    "10gbe": (20.0, 10.0),
    "25gbe": (10.0, 25.0),
    "100gb_ib": (2.0, 100.0),
    "nvlink": (2.0, 2400.0),  # 300 GB/s per direction (A100 NVLink 3)
    # a wide-area link between sites (DiLoCo's setting): 100 Mbit/s, 10 ms one way
    "wan_100mbit": (10_000.0, 0.1),
}


@dataclass(frozen=True)
class NetworkModel:
    """α-β model: `latency_s` per message, `bandwidth_Bps` bytes per second per link, plus
    host `overhead_s` per message, `allgather_factor` on allgather's bandwidth term and
    `allgather_latency_s` per allgather round in place of `latency_s` (None: the same);
    `compute_step_s`: the compute seconds of one training step an overlapped op hides behind."""

    latency_s: float
    bandwidth_Bps: float
    overhead_s: float = 0.0
    allgather_factor: float = 1.0
    allgather_latency_s: float | None = None
    compute_step_s: float = 0.0

    @classmethod
    def from_units(
        cls,
        latency_us: float,
        bandwidth_gbit: float,
        message_overhead_us: float = 0.0,
        allgather_factor: float = 1.0,
        allgather_latency_us: float | None = None,
        compute_step_s: float = 0.0,
    ) -> NetworkModel:
        return cls(
            latency_s=latency_us * 1e-6,
            bandwidth_Bps=bandwidth_gbit * 1e9 / 8,
            overhead_s=message_overhead_us * 1e-6,
            allgather_factor=allgather_factor,
            allgather_latency_s=(
                None if allgather_latency_us is None else allgather_latency_us * 1e-6
            ),
            compute_step_s=compute_step_s,
        )

    @classmethod
    def preset(cls, name: str, compute_step_s: float = 0.0) -> NetworkModel:
        if name not in PRESETS:
            raise ValueError(
                f"unknown network preset {name!r}; choose one of: {', '.join(PRESETS)}"
            )
        return cls.from_units(*PRESETS[name], compute_step_s=compute_step_s)

    def total_seconds(
        self, op_table: list[list], tiers: dict[str, NetworkModel] | None = None
    ) -> float:
        """Modeled seconds of a run's `comm/ops` table (`CommLedger.op_table`) on this
        network: re-prices a finished run on another fabric. Rows of a two-level cluster carry
        their tier (sixth entry); `tiers` prices them on that tier's link (else they are priced
        here). Rows of ops hidden behind computation carry `hidden_steps` (seventh entry), the
        steps of this network's `compute_step_s` they hide behind."""
        total = 0.0
        for row in op_table:
            kind, nbytes, group, peers, count = row[:5]
            network = (tiers or {}).get(row[5] if len(row) > 5 else "", self)
            seconds = network.seconds(kind, nbytes, group, peers)
            if len(row) > 6 and row[6]:
                seconds = max(0.0, seconds - row[6] * self.compute_step_s)
            total += count * seconds
        return total

    def op_seconds(self, op: CommOp) -> float:
        """Modeled exposed duration of one collective (see the module docstring for the
        formulas and for ops hidden behind computation)."""
        return self.seconds(op.kind, op.nbytes, op.group, op.peers, op.hidden_steps)

    def seconds(
        self, kind: str, nbytes: int, group: int, peers: int = 0, hidden_steps: int = 0
    ) -> float:
        """Modeled exposed duration of one collective of `kind` moving `nbytes` per worker
        among `group` workers (`peers`: a point-to-point op's largest out-degree), run behind
        `hidden_steps` steps of computation."""
        latency = self.latency_s
        if kind == "allgather" and self.allgather_latency_s is not None:
            latency = self.allgather_latency_s
        a = latency + self.overhead_s
        if group <= 1 or (kind == "p2p" and not peers):
            return 0.0
        seconds = self._seconds(kind, group, nbytes, a, self.bandwidth_Bps, peers)
        if hidden_steps:
            return max(0.0, seconds - hidden_steps * self.compute_step_s)
        return seconds

    def messages(self, op: CommOp) -> int:
        """Message rounds of `op`: how many times its formula charges α (and o)."""
        if op.group <= 1 or (op.kind == "p2p" and not op.peers):
            return 0
        return round(self._seconds(op.kind, op.group, 0, 1.0, 1.0, op.peers))

    def _seconds(self, kind: str, n: int, d: int, a: float, b: float, peers: int) -> float:
        if kind == "allreduce":
            return 2 * (n - 1) * a + 2 * (n - 1) / n * d / b
        if kind == "allreduce_ps":
            return 2 * a + 2 * (n - 1) * d / b
        if kind == "allgather":
            return (n - 1) * a + self.allgather_factor * (n - 1) * d / b
        if kind in ("broadcast", "reduce"):
            return math.ceil(math.log2(n)) * (a + d / b)
        if kind in ("broadcast_ring", "reduce_ring"):
            return (n - 1) * a + d / b
        if kind == "alltoall":
            return (n - 1) * a + (n - 1) / n * d / b
        if kind == "p2p":
            return a + peers * d / b
        raise ValueError(f"no cost formula for collective kind {kind!r}")
