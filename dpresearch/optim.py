"""Optimizer construction: a Hydra `_partial_` optimizer plus parameter groups.

The `optimizer` node is any `torch.optim` class as `_target_` with `_partial_: true`; the one
extra key `exclude_bn_bias_from_weight_decay` (ours, removed before instantiation) puts
BatchNorm weights and all biases (every parameter with fewer than two dimensions) in a group
without weight decay, as in Goyal et al. 2017.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

OWN_KEYS = ("exclude_bn_bias_from_weight_decay",)


def make_optimizer(
    cfg: DictConfig, model: nn.Module, lr_scale: float = 1.0
) -> torch.optim.Optimizer:
    """Instantiate the optimizer node for `model`'s trainable parameters; lr × `lr_scale`."""
    return build_optimizer(cfg, [p for p in model.parameters() if p.requires_grad], lr_scale)


def build_optimizer(
    cfg: DictConfig | dict, params: list[nn.Parameter], lr_scale: float = 1.0
) -> torch.optim.Optimizer:
    """Instantiate the optimizer node for `params` (e.g. one fragment of a model); lr ×
    `lr_scale`."""
    node: dict[str, Any] = (
        OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    )  # type: ignore[assignment]
    exclude = bool(node.pop("exclude_bn_bias_from_weight_decay", False))
    node["_partial_"] = True
    node["lr"] = float(node.get("lr", 0.1)) * lr_scale
    factory = instantiate(node)
    if not exclude:
        return factory(params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return factory([g for g in groups if g["params"]])


def set_lr(optimizer: torch.optim.Optimizer, base_lrs: list[float], multiplier: float) -> None:
    """Set every group's lr to its base lr × `multiplier`."""
    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
        group["lr"] = base * multiplier


def step_together(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """`opt.step()` for every optimizer in `optimizers` (one per local worker). Where they are
    all plain `torch.optim.SGD` with the same hyper-parameters group by group, each group of
    all of them is one call of torch's own multi-tensor SGD (`torch.optim.sgd.sgd`,
    `foreach=True`) over every worker's parameters at once: the same arithmetic, tensor by
    tensor, as each optimizer's own step (bit for bit: tested), without K passes through the
    optimizer's Python. Otherwise one by one."""
    if len(optimizers) < 2 or not _same_plain_sgd(optimizers):
        for opt in optimizers:
            opt.step()
        return
    from torch.optim.sgd import sgd

    with torch.no_grad():
        for groups in zip(*(opt.param_groups for opt in optimizers), strict=True):
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor | None] = []
            states: list[dict] = []
            first = groups[0]
            for opt, group in zip(optimizers, groups, strict=True):
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise ValueError("step_together: sparse gradients are not supported")
                    params.append(p)
                    grads.append(p.grad)
                    if first["momentum"] != 0:  # as SGD: no state entry without momentum
                        state = opt.state[p]
                        buffers.append(state.get("momentum_buffer"))
                        states.append(state)
                    else:
                        buffers.append(None)
            sgd(params, grads, buffers, foreach=True, weight_decay=first["weight_decay"],
                momentum=first["momentum"], lr=first["lr"], dampening=first["dampening"],
                nesterov=first["nesterov"], maximize=first["maximize"])  # fmt: skip
            if first["momentum"] != 0:
                for state, buffer in zip(states, buffers, strict=True):
                    state["momentum_buffer"] = buffer


# Hyper-parameters of an SGD group that must agree for its workers to step together.
_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")


def _same_plain_sgd(optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """All exactly `torch.optim.SGD`, none with hooks, fused or differentiable steps, with the
    same number of groups and the same hyper-parameters group by group (gradients are dense:
    the replicas' are views of one flat tensor)."""
    first = optimizers[0]
    for opt in optimizers:
        if type(opt) is not torch.optim.SGD or len(opt.param_groups) != len(first.param_groups):
            return False
        if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:  # noqa: SLF001
            return False
        for group, reference in zip(opt.param_groups, first.param_groups, strict=True):
            if group.get("fused") or group.get("differentiable"):
                return False
            if any(group[k] != reference[k] for k in _SGD_KEYS):
                return False
    return True
