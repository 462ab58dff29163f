"""Outer optimizers over a base algorithm (SlowMo, DiLoCo, Streaming DiLoCo): the `outer`
config node wraps the algorithm the `algorithm` node builds (`wrap`)."""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from dpresearch.algorithms.base import Algorithm
from dpresearch.algorithms.outer.optimizer import OuterOptimizer


def outer_node(cfg: DictConfig) -> DictConfig | None:
    """The run's `outer` node, None for `outer=none` (an empty node) or no node at all."""
    node = cfg.get("outer")
    return node if node else None


def algorithm_name(cfg: DictConfig) -> str:
    """What a checkpoint records as the run's algorithm: the algorithm's target, and the outer
    optimizer's after a "+" (a checkpoint resumes only the same combination)."""
    node = outer_node(cfg)
    target = cfg.algorithm._target_
    return target if node is None else f"{target}+{node._target_}"


def check_config(cfg: DictConfig) -> None:
    """The outer node's own checks (ValueError, one line naming the fix): those of the class
    its `_target_` names (`OuterOptimizer`, `NoLoCo`); nothing for none."""
    from hydra.utils import get_object

    node = outer_node(cfg)
    if node is not None:
        get_object(node._target_).check_config(cfg)


def wrap(cfg: DictConfig, algorithm: Algorithm, **runtime: Any) -> Algorithm:
    """`algorithm` under the run's outer optimizer (itself if `outer=none`); `runtime`: the
    replicas, communicator and optimizers the algorithm was built with."""
    node = outer_node(cfg)
    if node is None:
        return algorithm
    return instantiate(node, base=algorithm, **runtime)


__all__ = ["OuterOptimizer", "algorithm_name", "check_config", "outer_node", "wrap"]
