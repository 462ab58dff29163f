"""Two-level clusters: nodes of G workers joined by a fast link, nodes joined by a slower one.

`comm.hierarchy.workers_per_node=G` makes workers nG … nG+G−1 node n, led by worker nG. The
communicator of such a run carries `tiers`: `intra`, collectives inside every node at once
(each node its own group of G; priced on `network.intra`), and `inter`, collectives among the
node leaders (a group of N = K/G; priced on `network.inter`, by default the run's network),
held only by processes holding a leader. Both record into the process's ledger, their ops tagged
with the tier (`comm/bytes_intra`, `comm/bytes_inter`; `comm/modeled_s` prices each tier on its
own link).

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

from dpresearch.comm.base import Communicator, ExchangePlan
from dpresearch.comm.network import NetworkModel

if TYPE_CHECKING:
    from dpresearch.comm.ledger import LedgerView

INTRA, INTER = "intra", "inter"


@dataclass(frozen=True)
class Hierarchy:
    """Nodes of `workers_per_node` workers; `intra` prices links inside a node, `inter` links
    between nodes."""

    workers_per_node: int
    intra: NetworkModel
    inter: NetworkModel

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
    holding no leader. leaders: the process's rows that lead their node, in `inter`'s order."""

    hierarchy: Hierarchy
    intra: Communicator
    inter: Communicator | None
    leaders: list[int]


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


def _price_tiers(parent: Communicator, hierarchy: Hierarchy) -> None:
    parent.ledger.tiers.update({INTRA: hierarchy.intra, INTER: hierarchy.inter})


def simulated_tiers(parent: Communicator, hierarchy: Hierarchy) -> Tiers:
    """The tiers of a simulated communicator holding all K workers."""
    from dpresearch.comm.simulated import SimulatedCommunicator

    _price_tiers(parent, hierarchy)
    k, g = parent.world_size, hierarchy.workers_per_node
    n = hierarchy.nodes(k)
    leaders = list(range(0, k, g))
    intra = NodeGroups(k, g, hierarchy.intra, parent.ledger.view(range(k), INTRA))
    inter = SimulatedCommunicator(
        n,
        hierarchy.inter,
        parent.reduction,
        parent.deterministic,
        ledger=parent.ledger.view(leaders, INTER),
    )
    return Tiers(hierarchy, intra, inter, leaders)


def distributed_tiers(parent: Communicator, hierarchy: Hierarchy, **options) -> Tiers:
    """The tiers of a process holding one worker of K torch.distributed ranks: creates every
    node's group and the leaders' group (all ranks, same order), keeps its own. `options` go to
    the tiers' `DistributedCommunicator`s (deterministic, p2p_schedule)."""
    import torch.distributed as dist

    from dpresearch.comm.distributed import DistributedCommunicator

    _price_tiers(parent, hierarchy)
    k, g = parent.world_size, hierarchy.workers_per_node
    n = hierarchy.nodes(k)
    me = parent.local_workers[0]
    groups = [dist.new_group(list(range(i * g, (i + 1) * g))) for i in range(n)]
    leaders_group = dist.new_group([i * g for i in range(n)])
    intra = DistributedCommunicator(
        hierarchy.intra,
        parent.reduction,
        group=groups[me // g],
        ledger=parent.ledger.view([0], INTRA),
        **options,
    )
    inter = None
    if me % g == 0:
        inter = DistributedCommunicator(
            hierarchy.inter,
            parent.reduction,
            group=leaders_group,
            ledger=parent.ledger.view([0], INTER),
            **options,
        )
    return Tiers(hierarchy, intra, inter, [0] if inter is not None else [])


