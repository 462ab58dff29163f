"""The plug-in nodes' values that every data set, torch optimizer or schedule would reject
mid-start: `data`, `optimizer` (and an outer optimizer's node), `schedule`."""

from __future__ import annotations

import inspect
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig

from dpresearch.config.checks.common import is_number, show
from dpresearch.data.base import Dataset
from dpresearch.errors import ConfigError

PARTITIONS = ("iid", "dirichlet", "shared")
NOT_TAKEN = object()  # `data_value`: the data set neither is given nor declares the key
# Optimizer hyper-parameters that torch requires to be non-negative numbers.
NON_NEGATIVE_OPTIMIZER_KEYS = ("lr", "momentum", "weight_decay", "dampening", "eps")


def _data_target(node: DictConfig) -> Any:
    """What the data node's `_target_` names, or None where it does not import (the target
    check reports it)."""
    try:
        return get_object(node._target_)
    except Exception:
        return None


def partitions_of(node: DictConfig) -> tuple[str, ...]:
    """The partitions the data set of `node` declares (`Dataset.PARTITIONS`): its `_target_`'s
    class where the target is a class or one of its class methods, the default set otherwise."""
    target = _data_target(node)
    owner = target.__self__ if inspect.ismethod(target) else target
    if isinstance(owner, type) and issubclass(owner, Dataset):
        return owner.PARTITIONS
    return PARTITIONS


def data_value(node: DictConfig, key: str) -> Any:
    """`data.<key>` as the data set will take it: the node's value, else the default its
    `_target_` declares (its signature); `NOT_TAKEN` where neither gives one."""
    if key in node:
        return node[key]
    target = _data_target(node)
    try:
        param = inspect.signature(target).parameters.get(key) if target else None
    except (TypeError, ValueError):
        param = None
    if param is None or param.default is inspect.Parameter.empty:
        return NOT_TAKEN
    return param.default


def check_data(cfg: DictConfig) -> None:
    """The partition options every `Dataset` takes, and the download deadline; a key the node
    leaves out is checked at the data set's declared default (`data_value`)."""
    node = cfg.data
    partition = data_value(node, "partition")
    partitions = partitions_of(node)
    if partition is not NOT_TAKEN and partition not in partitions:
        raise ConfigError(f"data.partition={partition}; choose one of: {', '.join(partitions)}")
    alpha = data_value(node, "alpha")
    if alpha is not NOT_TAKEN and (not is_number(alpha) or alpha <= 0):
        raise ConfigError(
            f"data.alpha={show(alpha)}: the Dirichlet concentration must be a number > 0 "
            "(0.1: few classes per worker; 100: nearly iid)"
        )
    deadline = data_value(node, "download_timeout_s")
    if deadline is not NOT_TAKEN and (not is_number(deadline) or deadline <= 0):
        raise ConfigError(f"data.download_timeout_s={show(deadline)}: must be > 0 seconds")


def check_optimizer(cfg: DictConfig) -> None:
    """The hyper-parameters torch would reject mid-start, named by their key."""
    check_optimizer_values(cfg.optimizer, "optimizer")


def check_optimizer_values(node: DictConfig, where: str) -> None:
    """An optimizer node's values torch would reject mid-start, named `where.<key>`."""
    for key in NON_NEGATIVE_OPTIMIZER_KEYS:
        if key in node and (not is_number(node[key]) or node[key] < 0):
            raise ConfigError(f"{where}.{key}={show(node[key])}: must be a number >= 0")
    # (issue 43) accepted silently before: a momentum of 1 or more never forgets a gradient,
    # and `if "maybe"` reads as true
    momentum = node.get("momentum")
    if is_number(momentum) and momentum >= 1:
        raise ConfigError(
            f"{where}.momentum={show(momentum)}: must be in [0, 1) (at 1 or more every past "
            "gradient keeps its full weight and the steps grow without bound; 0.9 is usual)"
        )
    own = node.get("exclude_bn_bias_from_weight_decay", False)
    if not isinstance(own, bool):
        raise ConfigError(
            f"{where}.exclude_bn_bias_from_weight_decay={show(own)}: must be true or false"
        )
    if "betas" in node:
        betas = node.betas
        values = list(betas) if isinstance(betas, ListConfig) else None
        if (
            values is None
            or len(values) != 2
            or not all(is_number(b) and 0 <= b < 1 for b in values)
        ):
            raise ConfigError(
                f"{where}.betas={show(betas)}: must be two numbers in [0, 1), e.g. [0.9,0.999]"
            )


def check_schedule(cfg: DictConfig) -> None:
    """Milestones and warm-up, whose errors would otherwise surface at the first step."""
    node = cfg.schedule
    if "milestones" in node:
        milestones = node.milestones
        if not isinstance(milestones, ListConfig) or not all(is_number(m) for m in milestones):
            raise ConfigError(
                f"schedule.milestones={show(milestones)}: must be a list of epochs, e.g. [150,250]"
            )
    for key in ("warmup_epochs", "warmup_from", "gamma"):
        if key in node and (not is_number(node[key]) or node[key] < 0):
            raise ConfigError(f"schedule.{key}={show(node[key])}: must be a number >= 0")
