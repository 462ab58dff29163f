"""Reusable scratch buffers for compressor temporaries.

A fresh multi-megabyte tensor costs page faults on first touch (on a small VM about as much as
eight copies of it), so the per-step temporaries of compression (dithers, absolute values, wire
rows) come from buffers that grow once and are then reused. A scratch tensor is valid until the
next request under the same name: callers use it within one call and never keep it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_BUFFERS: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}


def scratch(name: str, shape: int | tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    """An uninitialised tensor of `shape`, a view of the buffer cached under `name`."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = math.prod(shape)
    key = (name, dtype, torch.device(device))
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _BUFFERS[key] = buf
    return buf[:numel].view(shape)


def clear() -> None:
    """Release every cached buffer."""
    _BUFFERS.clear()
