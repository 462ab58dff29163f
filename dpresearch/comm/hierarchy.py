"""Two-level clusters: nodes of G workers joined by a fast link, nodes joined by a slower one.

`comm.hierarchy.workers_per_node=G` makes workers nG … nG+G−1 node n, led by worker nG. The
communicator of such a run carries `tiers`: `intra`, collectives inside every node at once
(each node its own group of G; priced on `network.intra`), and `inter`, collectives among the
node leaders (a group of N = K/G; priced on `network.inter`, by default the run's network),
held only by processes holding a leader. Both record into the process's ledger, their ops tagged
with the tier (`comm/bytes_intra`, `comm/bytes_inter`; `comm/modeled_s` prices each tier on its
own link). `comm.hierarchy.intra_algorithm` prices the intra tier's reduce and broadcast as
binomial trees ("tree", the default) or as NCCL's intra-node ring ("ring": its pipelined Reduce
and Broadcast chains; `Communicator.rooted_algorithm`); the values are the same either way.

Simulated, `intra` is one communicator over all K rows that reduces and broadcasts within each
node's G rows, and `inter` one over the N leader rows. On real ranks the groups are
torch.distributed subgroups created once, when the communicator is built: every rank calls
`new_group` for every node and for the leaders, in the same order (NCCL's rule; see
docs/ARCHITECTURE.md), and collectives then run on the rank's own node group and, on leaders,
the leaders' group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from dpresearch.comm.base import (
    ROOTED_ALGORITHMS,
    Communicator,
    ExchangePlan,
    Message,
    PendingOp,
)
from dpresearch.comm.network import NetworkModel

if TYPE_CHECKING:
    from dpresearch.comm.ledger import LedgerView

INTRA, INTER = "intra", "inter"


@dataclass(frozen=True)
class Hierarchy:
    """Nodes of `workers_per_node` workers; `intra` prices links inside a node, `inter` links
    between nodes; `intra_algorithm` ("tree" or "ring") how the intra tier's reduce and
    broadcast are priced and charged (`Communicator.rooted_algorithm`)."""

    workers_per_node: int
    intra: NetworkModel
    inter: NetworkModel
    intra_algorithm: str = "tree"

    def __post_init__(self) -> None:
        if self.intra_algorithm not in ROOTED_ALGORITHMS:
            raise ValueError(
                f"comm.hierarchy.intra_algorithm={self.intra_algorithm}; choose one of: "
                f"{', '.join(ROOTED_ALGORITHMS)}"
            )

    def nodes(self, workers: int) -> int:
        if workers % self.workers_per_node:
            raise ValueError(
                f"comm.hierarchy.workers_per_node={self.workers_per_node} does not divide "
                f"workers={workers}"
            )
        return workers // self.workers_per_node


@dataclass
class Tiers:
    """A process's view of a two-level cluster. intra: collectives inside each node over all
    the process's rows (worker ids within the node; src/dst 0 is the leader). inter: collectives
    among the leaders over the process's leader rows (ids: node indices), None on a process
    holding no leader. leaders: the process's rows that lead their node, in `inter`'s order.
    Built, it sets `intra`'s `rooted_algorithm` to the hierarchy's `intra_algorithm`."""

    hierarchy: Hierarchy
    intra: Communicator
    inter: Communicator | None
    leaders: list[int]

    def __post_init__(self) -> None:
        self.intra.rooted_algorithm = self.hierarchy.intra_algorithm


class NodeGroups(Communicator):
    """Simulated collectives inside every node at once: K rows as N groups of G, each group its
    own world of G workers (`world_size` = G; row w is worker w mod G of node w div G). Only what
    a two-level reduction needs: allreduce, reduce and broadcast within each node."""

    def __init__(self, workers: int, group: int, network: NetworkModel, ledger: LedgerView):
        super().__init__(group, [w % group for w in range(workers)], network, ledger=ledger)
        self.nodes = workers // group

    def _grouped(self, x: Tensor) -> Tensor:
        return x.view(self.nodes, self.world_size, *x.shape[1:])

    def _all_reduce_sum(self, x: Tensor) -> None:
        v = self._grouped(x)
        v.copy_(v.sum(dim=1, keepdim=True).expand_as(v))

    def _reduce(self, x: Tensor, dst: int) -> None:
        v = self._grouped(x)
        v[:, dst].copy_(v.sum(dim=1))

    def _broadcast(self, x: Tensor, src: int) -> None:
        v = self._grouped(x)
        v.copy_(v[:, src : src + 1].expand_as(v))

    def _all_gather(self, x: Tensor) -> Tensor:
        raise NotImplementedError("NodeGroups has no allgather (each node would get its own)")

    def _start_neighbor_exchange(
        self, x: Tensor, plan: ExchangePlan, out: Tensor
    ) -> tuple[Tensor, Callable[[], float | None]]:
        raise NotImplementedError("NodeGroups has no neighbour exchange")

    def _isend(self, parts: list[Tensor], dst: int, src: int, recorded: bool) -> PendingOp:
        raise NotImplementedError("NodeGroups carries collectives only, no messages")

    def _recv(
        self,
        out: Message | None,
        src: int | None,
        dst: int,
        timeout_s: float | None,
        purpose: str | None,
    ) -> tuple[int, Message]:
        raise NotImplementedError("NodeGroups carries collectives only, no messages")


def price_tiers(parent: Communicator, hierarchy: Hierarchy) -> None:
    """Make `parent`'s ledger price the tiers' ops on their links."""
    parent.ledger.tiers.update({INTRA: hierarchy.intra, INTER: hierarchy.inter})
