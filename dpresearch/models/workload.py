"""How much arithmetic a model's forward pass is: what the thread and batching rules decide on.

Counted with `torch.utils.flop_counter` on the `meta` device (no memory, no compute), memoised
per model node and input shape. Models that cannot be built on `meta` give None (unknown).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

_MACS: dict[str, float | None] = {}


def forward_macs(
    model_node: Any, input_shape: Sequence[int], num_classes: int, tokens: bool = False
) -> float | None:
    """Multiply-adds of one example's forward pass through the model `model_node` builds (a
    `model` config node) on float inputs of `input_shape` (`tokens`: token ids), or None where
    it cannot be counted."""
    from hydra.utils import instantiate
    from omegaconf import DictConfig, OmegaConf
    from torch.utils.flop_counter import FlopCounterMode

    node = (
        OmegaConf.to_container(model_node, resolve=True)
        if isinstance(model_node, DictConfig)
        else model_node
    )
    key = json.dumps([node, list(input_shape), num_classes, tokens], sort_keys=True, default=str)
    if key not in _MACS:
        try:
            with torch.device("meta"):
                model = instantiate(node, num_classes=num_classes, input_shape=tuple(input_shape))
                # two: BatchNorm refuses one in training
                x = torch.zeros(2, *input_shape, dtype=torch.long if tokens else torch.float32)
            with FlopCounterMode(display=False) as counter:
                model(x)
            _MACS[key] = counter.get_total_flops() / 2 / 2
        except Exception:
            _MACS[key] = None
    return _MACS[key]


def describe_macs(macs: float) -> str:
    """`1.3 G` / `170 M` / `2.0 M` multiply-adds, for one-line messages."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if macs >= size:
            return f"{macs / size:.3g} {unit}"
    return f"{macs:.3g}"
