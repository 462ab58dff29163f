"""The parameter server: one copy of the model and one optimizer, updated by pushed gradients.

A push of worker w carries its gradient g (as the server decodes it), the version v it read and,
optionally, the parameters x_read it read (for delay compensation) and its float buffers. With
V the server's version, τ = V − v, and the staleness policy's factor s(τ) (None: dropped), the
server adds

    s(τ) · (g + λ·g⊙g⊙(x_now − x_read))        (λ = delay_compensation; DC-ASGD)

to its open group; when the protocol says so it applies the mean of the group with its
optimizer (lr = base lr × the schedule's multiplier), and its version becomes V + 1. With a
plain SGD optimizer and asgd that is x ← x − η·s(τ)·g. Buffers (BatchNorm statistics): the
server keeps those of the latest accepted push; a worker pulls them with the parameters.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from dpresearch.asynchrony.protocol import Protocol
from dpresearch.asynchrony.staleness import StalenessPolicy, StalenessStats
from dpresearch.optim import set_lr
from dpresearch.replicas import Replicas


def clone_optimizer(
    optimizer: torch.optim.Optimizer, source: nn.Module, target: nn.Module
) -> torch.optim.Optimizer:
    """A fresh optimizer of `optimizer`'s class, hyper-parameters and parameter groups, over
    `target`'s trainable parameters (matched by position with `source`'s)."""
    position = {id(p): i for i, p in enumerate(p for p in source.parameters() if p.requires_grad)}
    targets = [p for p in target.parameters() if p.requires_grad]
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [targets[position[id(p)]] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **defaults)


class ParameterServer:
    """The server's model (a one-row `Replicas` built from `template`), its optimizer (a clone
    of `optimizer`, which must belong to `template`), its version and the τ statistics."""

    def __init__(
        self,
        template: nn.Module,
        optimizer: torch.optim.Optimizer,
        protocol: Protocol,
        policy: StalenessPolicy,
        delay_compensation: float = 0.0,
        channels_last: bool = False,
    ) -> None:
        device = next(template.parameters()).device
        self.replica = Replicas(template, 1, device, channels_last)
        self.optimizer = clone_optimizer(optimizer, template, self.replica.models[0])
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.protocol, self.policy = protocol, policy
        self.delay_compensation = float(delay_compensation)
        self.version = 0
        self.stats = StalenessStats(protocol.workers)
        self.params: Tensor = self.replica.params[0]  # the server's flat parameter row [D]
        self.buffers: Tensor = self.replica.buffers[0]
        self._total = self.replica.grads[0]  # the open group's sum, then the applied gradient
        self._group: list[tuple[int, int]] = []  # (worker, τ) of the open group
        self._term = torch.empty_like(self.params) if self.delay_compensation else None
        self._multiplier: float | None = None

    def set_lr(self, multiplier: float) -> None:
        if multiplier != self._multiplier:
            set_lr(self.optimizer, self.base_lrs, multiplier)
            self._multiplier = multiplier

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def push(
        self,
        worker: int,
        grad: Tensor,
        read_version: int,
        x_read: Tensor | None = None,
        buffers: Tensor | None = None,
    ) -> list[int]:
        """Receive `worker`'s gradient computed at version `read_version` (on `x_read`, needed
        only with delay compensation); apply per protocol. Returns the workers that may start
        now (they read `params` and `version` as they are after this call)."""
        tau = self.version - read_version
        factor = self.policy.factor(tau)
        if factor is None:
            self.stats.drop()
            apply, released = self.protocol.pushed(worker, accepted=False)
        else:
            self._add(grad, factor, x_read)
            self._group.append((worker, tau))
            if buffers is not None and buffers.numel():
                self.buffers.copy_(buffers)
            apply, released = self.protocol.pushed(worker, accepted=True)
        if apply:
            self._apply()
        return released

    def _add(self, grad: Tensor, factor: float, x_read: Tensor | None) -> None:
        total = self._total
        if self._term is not None:
            if x_read is None:
                raise ValueError("delay compensation needs the parameters the worker read")
            term = torch.sub(self.params, x_read, out=self._term)
            term.mul_(grad).mul_(grad).mul_(self.delay_compensation).add_(grad)
            grad = term
        if not self._group:
            total.copy_(grad)
            if factor != 1.0:
                total.mul_(factor)
        else:
            total.add_(grad, alpha=factor)

    def _apply(self) -> None:
        if len(self._group) > 1:
            self._total.div_(len(self._group))
        self.optimizer.step()
        self.version += 1
        for worker, tau in self._group:
            self.stats.applied(worker, tau)
        self._group.clear()
