"""In-process collectives: K simulated workers held as the rows of stacked tensors.

Point-to-point messages go through a mailbox per destination endpoint (the workers 0…K−1, or
any other id this process uses for an endpoint without a worker, e.g. a parameter server):
`isend` appends the sent tensors themselves (nothing is copied; the op is complete at once),
`recv_any` takes the oldest message, `recv` the oldest from one sender. A receive that finds
no message fails at once: in one process nobody else could send one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator, ExchangePlan, Message, PeerTimeout, PendingOp
from dpresearch.comm.hierarchy import (
    INTER,
    INTRA,
    Hierarchy,
    NodeGroups,
    Tiers,
    price_tiers,
)
from dpresearch.comm.ledger import CommLedger, LedgerView
from dpresearch.comm.network import NetworkModel

_DONE = PendingOp(lambda: None)


class SimulatedCommunicator(Communicator):
    """All K workers live in this process (W = K); collectives are tensor operations."""

    def __init__(
        self,
        world_size: int,
        network: NetworkModel,
        reduction: str = "ring",
        deterministic: bool = False,
        hierarchy: Hierarchy | None = None,
        ledger: CommLedger | LedgerView | None = None,
    ) -> None:
        super().__init__(world_size, range(world_size), network, reduction, deterministic, ledger)
        self._gather_index: dict[tuple[ExchangePlan, torch.device], tuple[Tensor, Tensor]] = {}
        self._mailbox: dict[int, deque[tuple[int, list[Tensor]]]] = {}
        if hierarchy is not None:
            self.tiers = self._two_level(hierarchy)

    def _two_level(self, hierarchy: Hierarchy) -> Tiers:
        """The tiers of K simulated workers: node groups over all rows, the leaders' rows."""
        price_tiers(self, hierarchy)
        k, g = self.world_size, hierarchy.workers_per_node
        leaders = list(range(0, k, g))
        intra = NodeGroups(k, g, hierarchy.intra, self.ledger.view(range(k), INTRA))
        inter = SimulatedCommunicator(
            hierarchy.nodes(k),
            hierarchy.inter,
            self.reduction,
            self.deterministic,
            ledger=self.ledger.view(leaders, INTER),
        )
        return Tiers(hierarchy, intra, inter, leaders)

    def _isend(self, parts: list[Tensor], dst: int, src: int, recorded: bool) -> PendingOp:
        box = self._mailbox.get(dst)
        if box is None:
            box = self._mailbox[dst] = deque()
        box.append((src, parts))
        return _DONE

    def _recv(
        self,
        out: Message | None,
        src: int | None,
        dst: int,
        timeout_s: float | None,
        purpose: str | None,
    ) -> tuple[int, Message]:
        box = self._mailbox.get(dst)
        index = (
            0
            if src is None or not box
            else next((i for i, (s, _) in enumerate(box) if s == src), None)
        )
        if not box or index is None:
            who = "any endpoint" if src is None else f"endpoint {src}"
            raise PeerTimeout(
                f"no message from {who} for endpoint {dst}: in one process nobody else can send"
            )
        sender, parts = box.popleft() if index == 0 else _take(box, index)
        if out is None:
            return sender, parts[0] if len(parts) == 1 else parts
        targets = [out] if isinstance(out, Tensor) else list(out)
        if len(targets) != len(parts):
            raise ValueError(f"the message has {len(parts)} tensors, out {len(targets)}")
        for target, part in zip(targets, parts, strict=True):
            target.copy_(part)
        return sender, out

    def _all_reduce_sum(self, x: Tensor) -> None:
        # Always worker order: `deterministic` changes nothing in-process.
        x.copy_(x.sum(dim=0, keepdim=True).expand_as(x))

    def _all_gather(self, x: Tensor) -> Tensor:
        # A view would do for the result's values, but callers may write into x afterwards.
        return x.clone()

    def _broadcast(self, x: Tensor, src: int) -> None:
        x.copy_(x[src : src + 1].expand_as(x))

    def _reduce(self, x: Tensor, dst: int) -> None:
        x[dst].copy_(x.sum(dim=0))

    def _all_to_all(self, x: Tensor) -> Tensor:
        return x.transpose(0, 1).contiguous()

    def _start_neighbor_exchange(
        self, x: Tensor, plan: ExchangePlan, out: Tensor
    ) -> tuple[Tensor, Callable[[], float | None]]:
        index, missing = self._index_for(plan, x.device)
        # one gather: [K, P, ...]
        torch.index_select(x, 0, index.view(-1), out=out.view((-1,) + tuple(x.shape[1:])))
        if missing is not None:
            out[missing] = 0
        return out, lambda: None

    def _index_for(self, plan: ExchangePlan, device: torch.device) -> tuple[Tensor, Tensor]:
        """[K, P] source rows (padded with 0) and the mask of padded slots (None if none)."""
        key = (plan, device)
        if key not in self._gather_index:
            k, width = self.world_size, plan.width
            index = torch.zeros(k, width, dtype=torch.long)
            missing = torch.ones(k, width, dtype=torch.bool)
            for i, peers in enumerate(plan.in_peers):
                index[i, : len(peers)] = torch.tensor(peers, dtype=torch.long)
                missing[i, : len(peers)] = False
            self._gather_index[key] = (
                index.to(device),
                missing.to(device) if bool(missing.any()) else None,
            )
        return self._gather_index[key]


def _take(box: deque, index: int):
    """Remove and return `box[index]`."""
    box.rotate(-index)
    item = box.popleft()
    box.rotate(index)
    return item
