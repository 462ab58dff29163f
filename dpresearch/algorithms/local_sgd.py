"""Local SGD (periodic model averaging; Stich 2019, Lin et al. 2020).

Every worker steps its own optimizer on its own gradient; every `period` steps the parameters
are averaged over all workers. Floating-point buffers (BatchNorm statistics) are averaged with
them by default (`average_buffers`; recorded as "buffers" traffic, apart from `comm/bytes`).
Optimizer state (momentum) stays local by default — the choice of Lin et al.'s local SGD — or
is averaged too with `average_optimizer_state=true`.
`period=1` with plain SGD is synchronous SGD; a period longer than the run gives K independent
workers. Post-local SGD (Lin et al. 2020): `sync_epochs` = E averages after every step for the
first E epochs (set it to the first lr decay) and every `period` steps after; the periods count
from the switch.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

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
        sync_epochs: float = 0.0,
    ) -> None:
        super().__init__(replicas, comm, optimizers)
        check_options(period, sync_epochs)
        self.period, self.sync_epochs = period, sync_epochs
        self.sync_steps = 0  # set from sync_epochs once the epoch length is known
        self.average_buffers = average_buffers
        self.average_optimizer_state = average_optimizer_state

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """The averaging period and the synchronous start, before any worker starts."""
        alg = cfg.algorithm
        check_options(alg.get("period", 8), alg.get("sync_epochs", 0.0))

    def set_run_length(self, steps_per_epoch: int, total_steps: int) -> None:
        self.sync_steps = round(self.sync_epochs * steps_per_epoch)

    def averages_after(self, step: int) -> bool:
        """Whether the parameters are averaged after `step` (0-based)."""
        if step < self.sync_steps:
            return True
        return (step + 1 - self.sync_steps) % self.period == 0

    def describe(self) -> dict:
        return {"local_sgd/sync_steps": self.sync_steps} if self.sync_steps else {}

    def after_backward(self, step: int) -> None:
        self.step_optimizers()
        if self.averages_after(step):
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


def check_options(period: Any, sync_epochs: Any) -> None:
    """Raise ValueError (one line) for a period that is not a whole number >= 1 or a negative
    synchronous start."""
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(
            f"algorithm.period={period}: average every N >= 1 steps (1: synchronous SGD)"
        )
    number = isinstance(sync_epochs, (int, float)) and not isinstance(sync_epochs, bool)
    if not number or sync_epochs < 0:
        raise ValueError(f"algorithm.sync_epochs={sync_epochs}: must be a number of epochs >= 0")
