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

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from dpresearch.algorithms.base import Algorithm, Traits
from dpresearch.comm.base import Communicator
from dpresearch.options import Options
from dpresearch.replicas import Replicas


@dataclass(frozen=True)
class LocalSGDOptions(Options):
    """Local SGD's keys (`algorithm=local_sgd`)."""

    period: int = 8
    """average the parameters every N >= 1 steps (1 with plain SGD: synchronous SGD)"""
    average_buffers: bool = True
    """average the float buffers (BatchNorm statistics) with the parameters ("buffers"
    traffic)"""
    average_optimizer_state: bool = False
    """average the optimizers' state (momentum) too; false keeps it local (Lin et al.)"""
    sync_epochs: float = 0.0
    """post-local SGD: average every step for the first E epochs, then every `period`"""

    def check(self) -> None:
        check_options(self.period, self.sync_epochs)


class LocalSGD(Algorithm):
    """Independent local steps with parameter averaging every `period` steps.

    Under an outer optimizer (DiLoCo, SlowMo over local SGD) the averaging every `period`
    steps becomes the outer step's exact average: `period` is the outer period unless
    `outer.period` says otherwise, and the algorithm itself no longer averages."""

    traits = Traits(drifts=True)
    OPTIONS = LocalSGDOptions

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        period: int = LocalSGDOptions.period,
        average_buffers: bool = LocalSGDOptions.average_buffers,
        average_optimizer_state: bool = LocalSGDOptions.average_optimizer_state,
        sync_epochs: float = LocalSGDOptions.sync_epochs,
    ) -> None:
        super().__init__(replicas, comm, optimizers)
        check_options(period, sync_epochs)
        self.period, self.sync_epochs = period, sync_epochs
        self.sync_steps = 0  # set from sync_epochs once the epoch length is known
        self.average_buffers = average_buffers
        self.average_optimizer_state = average_optimizer_state
        self.handed_over = False  # an outer optimizer does the averaging

    def set_run_length(self, steps_per_epoch: int, total_steps: int) -> None:
        self.sync_steps = round(self.sync_epochs * steps_per_epoch)

    @classmethod
    def outer_handover(cls, node: Any) -> int | None:
        opts = LocalSGDOptions.from_node(node)
        if float(opts.sync_epochs or 0.0) > 0:
            raise ValueError(
                "post-local SGD's dense phase cannot run under an outer optimizer; set "
                "algorithm.sync_epochs=0"
            )
        if opts.average_optimizer_state:
            raise ValueError(
                "under an outer optimizer the inner optimizer state is the outer's: set "
                "algorithm.average_optimizer_state=false and outer.inner_state=average"
            )
        return int(opts.period)

    def hand_over_averaging(self) -> int | None:
        self.handed_over = True
        return self.period

    def averages_after(self, step: int) -> bool:
        """Whether the parameters are averaged after `step` (0-based)."""
        if self.handed_over:
            return False
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
                average_optimizer_state(self.optimizers, self.comm)


def average_optimizer_state(
    optimizers: list[torch.optim.Optimizer],
    comm: Communicator,
    params: list[list[torch.nn.Parameter]] | None = None,
    keys: Collection[str] | None = None,
) -> None:
    """Average every floating-point state tensor (e.g. momentum) of the local workers'
    optimizers over all K workers, one allreduce (the algorithm's traffic); `params`: per
    local worker, the parameters whose state is averaged (None: all); `keys`: the state names
    averaged (e.g. ("exp_avg",); None: all)."""
    per_worker = []
    for w, opt in enumerate(optimizers):
        mine = (
            [p for group in opt.param_groups for p in group["params"]]
            if params is None
            else params[w]
        )
        per_worker.append(
            [
                v
                for p in mine
                for k, v in opt.state.get(p, {}).items()
                if (keys is None or k in keys)
                and torch.is_tensor(v)
                and v.is_floating_point()
                and v.dim() > 0
            ]
        )
    if not per_worker[0]:
        return
    stacked = torch.stack([torch.cat([t.reshape(-1) for t in ts]) for ts in per_worker])
    comm.all_reduce(stacked, op="mean")
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
