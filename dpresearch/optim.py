"""Optimizer construction: a Hydra `_partial_` optimizer plus parameter groups.

The `optimizer` node is any `torch.optim` class as `_target_` with `_partial_: true`; the one
extra key `exclude_bn_bias_from_weight_decay` (ours, removed before instantiation) puts
BatchNorm weights and all biases (every parameter with fewer than two dimensions) in a group
without weight decay, as in Goyal et al. 2017. For a transformer that is nanoGPT's rule too:
weight matrices and embeddings decay, biases and LayerNorm gains do not.

An optimizer class that splits its groups by the model's structure (`muon.MuonAdamW`: hidden
matrices apart from embeddings) has a static `split_param_groups(groups, module)`, called with
the model `make_optimizer` was given (None from `build_optimizer` alone); a node's `adamw_lr`
is scaled with its `lr`.
"""

from __future__ import annotations

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
    params = [p for p in model.parameters() if p.requires_grad]
    return build_optimizer(cfg, params, lr_scale, module=model)


def build_optimizer(
    cfg: DictConfig | dict,
    params: list[nn.Parameter],
    lr_scale: float = 1.0,
    module: nn.Module | None = None,
) -> torch.optim.Optimizer:
    """Instantiate the optimizer node for `params` (e.g. one fragment of a model); lr (and
    `adamw_lr`, where the node has one) × `lr_scale`. `module`: the model `params` belong
    to, for an optimizer class with `split_param_groups` (see the module's docstring)."""
    node: dict[str, Any] = (
        OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    )  # type: ignore[assignment]
    exclude = bool(node.pop("exclude_bn_bias_from_weight_decay", False))
    node["_partial_"] = True
    node["lr"] = float(node["lr"]) * lr_scale
    if "adamw_lr" in node:
        node["adamw_lr"] = float(node["adamw_lr"]) * lr_scale
    factory = instantiate(node)
    split = getattr(getattr(factory, "func", None), "split_param_groups", None)
    if not exclude and split is None:
        return factory(params)
    if exclude:
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    else:
        groups = [{"params": params}]
    groups = [g for g in groups if g["params"]]
    return factory(split(groups, module) if split is not None else groups)


def set_lr(optimizer: torch.optim.Optimizer, base_lrs: list[float], multiplier: float) -> None:
    """Set every group's lr to its base lr × `multiplier`."""
    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
        group["lr"] = base * multiplier
