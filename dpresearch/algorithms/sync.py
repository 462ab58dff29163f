"""Synchronous data-parallel SGD: average the workers' gradients, every worker steps.

With identity communication this is exactly what torch DDP computes. BatchNorm buffers follow
DDP's default (`broadcast_buffers=True`): before every forward, worker 0's buffers are copied to
all workers, so the running statistics are worker 0's; `buffers="local"` keeps each worker's
own (DDP with `broadcast_buffers=False`) and evaluates with worker 0's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dpresearch.algorithms.base import Algorithm
from dpresearch.comm.base import Communicator
from dpresearch.replicas import Replicas

BUFFER_MODES = ("broadcast", "local")


class SyncSGD(Algorithm):
    """Gradient averaging by allreduce, then one optimizer step per worker."""

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        buffers: str = "broadcast",
    ) -> None:
        super().__init__(replicas, comm, optimizers)
        if buffers not in BUFFER_MODES:
            raise ValueError(f"algorithm.buffers={buffers!r}; choose one of: {BUFFER_MODES}")
        self.buffer_mode = buffers

    def before_forward(self, step: int) -> None:
        if self.buffer_mode == "broadcast" and self.replicas.buffers.shape[1] > 0:
            self.comm.broadcast(self.replicas.buffers, src=0)

    def after_backward(self, step: int) -> None:
        self.comm.all_reduce(self.replicas.grads, op="mean")
        for opt in self.optimizers:
            opt.step()

    def consensus(self) -> tuple[Tensor, Tensor]:
        # Parameters are identical on every worker; the buffers are worker 0's.
        buffers = self.replicas.buffers.clone()
        self.comm.broadcast(buffers, src=0, record=False)
        return self.replicas.params[0].clone(), buffers[0]
