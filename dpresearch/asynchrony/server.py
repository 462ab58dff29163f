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

A group of one gradient with factor 1 and no delay compensation (asgd and ssp with a constant
lr) is applied where it lies: the optimizer's `.grad` views are pointed at the pushed tensor
for that step instead of copying it into the server's own gradient row (the same values, one
full-vector copy fewer per push).
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
        self._total = self.replica.grads[0]  # the open group's sum (scaled, then averaged)
        # The optimizer's `.grad` views, per flat gradient they view (`_views_of`).
        self._trainable = [p for p in self.replica.models[0].parameters() if p.requires_grad]
        self._own_grads = [p.grad for p in self._trainable]
        self._views: dict[int, tuple[Tensor, int, list[Tensor] | None]] = {}
        self._bound = self._total  # the flat gradient the optimizer's `.grad` views now
        self._group: list[tuple[int, int]] = []  # (worker, τ) of the open group
        self._term = torch.empty_like(self.params) if self.delay_compensation else None
        self._multiplier: float | None = None

    def set_lr(self, multiplier: float) -> None:
        if multiplier != self._multiplier:
            set_lr(self.optimizer, self.base_lrs, multiplier)
            self._multiplier = multiplier

    def state_dict(self) -> dict:
        """Parameters, buffers, optimizer, version, τ statistics and the open group (its
        members and accumulated sum); live tensors. The protocol is saved by its owner."""
        return {
            "params": self.params,
            "buffers": self.buffers,
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "stats": self.stats.state_dict(),
            "group": list(self._group),
            "total": self._total,
            "multiplier": self._multiplier,
        }

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.params.copy_(state["params"])
            self.buffers.copy_(state["buffers"])
            self._total.copy_(state["total"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.stats.load_state_dict(state["stats"])
        self._group = [(int(w), int(tau)) for w, tau in state["group"]]
        self._multiplier = state["multiplier"]

    @property
    def applied(self) -> Tensor:
        """The flat gradient the last update stepped on (the open group's scaled mean, or the
        pushed tensor itself): valid until the next push."""
        return self._bound

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
        now (they read `params` and `version` as they are after this call). `grad` is only
        read during the call."""
        tau = self.version - read_version
        factor = self.policy.factor(tau)
        direct = views = None
        if factor is None:
            self.stats.drop()
            apply, released = self.protocol.pushed(worker, accepted=False)
        else:
            apply, released = self.protocol.pushed(worker, accepted=True)
            if apply and not self._group and factor == 1.0 and self._term is None:
                views = self._views_of(grad)  # the whole group: step on it where it lies
                direct = grad if views is not None else None
            if direct is None:
                self._add(grad, factor, x_read)
            self._group.append((worker, tau))
            if buffers is not None and buffers.numel():
                self.buffers.copy_(buffers)
        if apply:
            self._apply(direct, views)
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

    def _apply(self, direct: Tensor | None = None, views: list[Tensor] | None = None) -> None:
        """Step the optimizer on the open group's mean, or on `direct` (the whole group, one
        gradient of factor 1, through its `views`)."""
        if direct is None:
            if len(self._group) > 1:
                self._total.div_(len(self._group))
            direct, views = self._total, self._own_grads
        if direct is not self._bound:
            for p, view in zip(self._trainable, views, strict=True):
                p.grad = view
            self._bound = direct
        self.optimizer.step()
        self.version += 1
        for worker, tau in self._group:
            self.stats.applied(worker, tau)
        self._group.clear()

    def _views_of(self, flat: Tensor) -> list[Tensor] | None:
        """Views of the flat gradient `flat` shaped and strided as the server's own `.grad`
        views, or None where `flat` is not laid out like the server's gradient row. Kept per
        tensor (a worker's gradient row, a decode buffer: one per push would be rebuilt each
        time), with the tensor, so an id is never taken for another's; at most 2K + 2 kept."""
        entry = self._views.get(id(flat))
        if entry is not None and entry[0] is flat and entry[1] == flat.data_ptr():
            return entry[2]
        total = self._total
        views = None
        if (
            flat.dtype == total.dtype
            and flat.shape == total.shape
            and flat.device == total.device
            and flat.is_contiguous()
        ):
            base = total.storage_offset()
            views = [
                flat.as_strided(
                    g.shape, g.stride(), flat.storage_offset() + g.storage_offset() - base
                )
                for g in self._own_grads
            ]
        if len(self._views) > 2 * self.protocol.workers + 2:
            del self._views[next(iter(self._views))]
        self._views[id(flat)] = (flat, flat.data_ptr(), views)
        return views
