"""Scratch tensors owned by the object that uses them (a codec, an error-feedback memory, a
protocol).

A fresh multi-megabyte tensor costs page faults on first touch (on a small VM about as much as
eight copies of it), so per-step temporaries (dithers, absolute values, wire rows) come from
buffers that grow once and are then reused. There is no module-level cache: each codec owns its
`Workspace`, built with it once per layout, so two codecs never share (or race on) a buffer and
dropping the codec frees its memory.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class Workspace:
    """Named scratch buffers. `get(name, ...)` returns an uninitialised view of the buffer kept
    under `name` (grown when too small); it stays valid until the next `get` of that name, so a
    caller uses it within one call and never keeps it."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}

    def get(
        self,
        name: str,
        shape: int | tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> Tensor:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        numel = math.prod(shape)
        key = (name, dtype, torch.device(device))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)


def scratch_or_new(
    ws: Workspace | None, name: str, shape: int | tuple[int, ...], dtype: torch.dtype, device
) -> Tensor:
    """`ws.get(...)`, or a fresh tensor when no workspace is given."""
    if ws is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return ws.get(name, shape, dtype, device)
