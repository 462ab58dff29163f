"""Local SGD (periodic model averaging; Stich 2019, Lin et al. 2020).

Every worker steps its own optimizer on its own gradient; every `period` steps the parameters
are averaged over all workers. Floating-point buffers (BatchNorm statistics) are averaged with
them by default (`average_buffers`; recorded as "buffers" traffic, apart from `comm/bytes`).
Optimizer state (momentum) stays local by default — the choice of Lin et al.'s local SGD — or
is averaged too with `average_optimizer_state=true`.
`period=1` with plain SGD is synchronous SGD; a period longer than the run gives K independent
workers.
"""

from __future__ import annotations

import torch

from dpresearch.algorithms.base import Algorithm
from dpresearch.comm.base import Communicator
from dpresearch.replicas import Replicas


class LocalSGD(Algorithm):
    """Independent local steps with parameter averaging every `period` steps."""

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        period: int = 8,
        average_buffers: bool = True,
        average_optimizer_state: bool = False,
    ) -> None:
        super().__init__(replicas, comm, optimizers)
        if period < 1:
            raise ValueError(f"algorithm.period must be >= 1, got {period}")
        self.period = period
        self.average_buffers = average_buffers
        self.average_optimizer_state = average_optimizer_state

    def after_backward(self, step: int) -> None:
        for opt in self.optimizers:
            opt.step()
        if (step + 1) % self.period == 0:
            self.comm.all_reduce(self.replicas.params, op="mean")
            if self.average_buffers and self.replicas.buffers.shape[1] > 0:
                self.comm.all_reduce(self.replicas.buffers, op="mean", record="buffers")
            if self.average_optimizer_state:
                self._average_optimizer_state()

    def _average_optimizer_state(self) -> None:
        """Average every floating-point optimizer state tensor (e.g. momentum) over workers."""
        per_worker = []
        for opt in self.optimizers:
            tensors = [
                v
                for group in opt.param_groups
                for p in group["params"]
                for v in opt.state.get(p, {}).values()
                if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0
            ]
            per_worker.append(tensors)
        if not per_worker[0]:
            return
        stacked = torch.stack([torch.cat([t.reshape(-1) for t in ts]) for ts in per_worker])
        self.comm.all_reduce(stacked, op="mean")
        for row, tensors in zip(stacked, per_worker, strict=True):
            offset = 0
            for t in tensors:
                t.copy_(row[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
