"""In-process collectives: K simulated workers held as the rows of stacked tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.comm.network import NetworkModel


class SimulatedCommunicator(Communicator):
    """All K workers live in this process (W = K); collectives are tensor operations."""

    def __init__(
        self,
        world_size: int,
        network: NetworkModel,
        reduction: str = "ring",
        deterministic: bool = False,
    ) -> None:
        super().__init__(world_size, range(world_size), network, reduction, deterministic)

    def _all_reduce_sum(self, x: Tensor) -> None:
        # Always worker order: `deterministic` changes nothing in-process.
        x.copy_(x.sum(dim=0, keepdim=True).expand_as(x))

    def _all_gather(self, x: Tensor) -> Tensor:
        return x.clone()

    def _broadcast(self, x: Tensor, src: int) -> None:
        x.copy_(x[src : src + 1].expand_as(x))

    def _neighbor_exchange(
        self, x: Tensor, out_peers: Sequence[Sequence[int]], in_peers: Sequence[Sequence[int]]
    ) -> list[Tensor]:
        return [
            torch.stack([x[j] for j in in_peers[i]])
            if in_peers[i]
            else x.new_empty((0,) + x.shape[1:])
            for i in self.local_workers
        ]
