"""The traffic of asynchronous pushes: one point-to-point message per gradient, charged to the
sending worker, priced by the network model, and reported under the usual `comm/` keys."""

from __future__ import annotations

from typing import Any

from dpresearch.asynchrony.protocol import Protocol
from dpresearch.asynchrony.server import ParameterServer
from dpresearch.comm.ledger import CommOp
from dpresearch.comm.network import NetworkModel


def transfer_seconds(network: NetworkModel, nbytes: int) -> float:
    """One point-to-point message of `nbytes` between a worker and the server: α + bytes/B."""
    return network.op_seconds(CommOp("p2p", nbytes, 2, peers=1))


def push_accounting(pushes: list[int], push_bytes: int, push_s: float) -> dict[str, float]:
    """`comm/bytes` (mean over workers), `comm/bytes_max` and `comm/modeled_s` of the pushes
    made so far (`pushes[w]` by worker w)."""
    return {
        "comm/bytes": sum(pushes) * push_bytes / len(pushes),
        "comm/bytes_max": float(max(pushes) * push_bytes),
        "comm/modeled_s": sum(pushes) * push_s,
    }


def run_summary(
    server: ParameterServer, protocol: Protocol, pushes: list[int], push_bytes: int
) -> dict[str, Any]:
    """End-of-run facts: the τ histogram and counts, and the pushes as an op table."""
    out: dict[str, Any] = {**server.stats.summary(), "async/updates": server.version}
    if protocol.name == "ssp":
        out["async/ssp_max_ahead"] = protocol.max_ahead
    out["comm/op_counts"] = {"p2p": sum(pushes)}
    out["comm/ops"] = [["p2p", push_bytes, len(pushes), 1, sum(pushes)]]
    return out
