"""The α-β network cost model: modeled seconds for each recorded collective.

With latency α (seconds per message), bandwidth B (bytes/second), n workers and a payload of
D bytes per worker:

- ring allreduce:            2(n−1)α + 2(n−1)/n · D/B
- parameter-server allreduce (worker 0 hosts the server; its link carries every payload in and
  the result out):           2α + 2(n−1) · D/B
- ring allgather:            (n−1)α + (n−1) · D/B
- broadcast (binomial tree): ⌈log₂ n⌉ · (α + D/B)
- neighbour exchange to p peers (sends serialised on one full-duplex link): α + p · D/B

A group of one worker costs nothing. The presets are nominal figures for common fabrics; pass
`network=custom network.latency_us=... network.bandwidth_gbit=...` for your own.
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
}


@dataclass(frozen=True)
class NetworkModel:
    """α-β model: `latency_s` per message, `bandwidth_Bps` bytes per second per link."""

    latency_s: float
    bandwidth_Bps: float

    @classmethod
    def from_units(cls, latency_us: float, bandwidth_gbit: float) -> NetworkModel:
        return cls(latency_s=latency_us * 1e-6, bandwidth_Bps=bandwidth_gbit * 1e9 / 8)

    @classmethod
    def preset(cls, name: str) -> NetworkModel:
        if name not in PRESETS:
            raise ValueError(
                f"unknown network preset {name!r}; choose one of: {', '.join(PRESETS)}"
            )
        return cls.from_units(*PRESETS[name])

    def total_seconds(self, op_table: list[list]) -> float:
        """Modeled seconds of a run's `comm/ops` table (`CommLedger.op_table`) on this
        network: re-prices a finished run on another fabric."""
        from dpresearch.comm.ledger import CommOp

        return sum(
            count * self.op_seconds(CommOp(kind, nbytes, group, peers))
            for kind, nbytes, group, peers, count in op_table
        )

    def op_seconds(self, op: CommOp) -> float:
        """Modeled duration of one collective (see the module docstring for the formulas)."""
        n, d, a, b = op.group, op.nbytes, self.latency_s, self.bandwidth_Bps
        if n <= 1:
            return 0.0
        if op.kind == "allreduce":
            return 2 * (n - 1) * a + 2 * (n - 1) / n * d / b
        if op.kind == "allreduce_ps":
            return 2 * a + 2 * (n - 1) * d / b
        if op.kind == "allgather":
            return (n - 1) * a + (n - 1) * d / b
        if op.kind == "broadcast":
            return math.ceil(math.log2(n)) * (a + d / b)
        if op.kind == "p2p":
            return a + op.peers * d / b if op.peers else 0.0
        raise ValueError(f"no cost formula for collective kind {op.kind!r}")
