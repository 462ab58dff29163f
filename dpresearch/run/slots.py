"""Where each tensor of a model sits in the flat rows of `Replicas`: the `[S, *shape]` views that
the batched and stacked computations (`run/batched.py`, `run/stacked.py`) read and write."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dpresearch.replicas import Replicas


@dataclass(frozen=True)
class Slot:
    """One tensor of the model inside a flat row: its name, offset, shape and layout."""

    name: str
    offset: int
    shape: torch.Size
    nhwc: bool = False

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def view(self, flat: Tensor) -> Tensor:
        """The `[S, *shape]` view of this tensor in the rows of `flat` (`[S, D]`)."""
        block = flat[:, self.offset : self.offset + self.numel]
        if not self.nhwc:
            return block.view(flat.shape[0], *self.shape)
        n, c, h, w = self.shape
        return block.view(flat.shape[0], n, h, w, c).permute(0, 1, 4, 2, 3)


def slots(replicas: Replicas) -> tuple[list[Slot], list[Slot], list[Slot]]:
    """(parameters, float buffers, integer buffers) of the template replica, in the order
    `Replicas` lays them out in its rows."""
    template = replicas.models[0]
    params, offset = [], 0
    for name, p in template.named_parameters():
        if p.requires_grad:
            nhwc = replicas.channels_last and p.dim() == 4
            params.append(Slot(name, offset, p.shape, nhwc))
            offset += p.numel()
    floats, ints, f_off, i_off = [], [], 0, 0
    stacked_ints = replicas.int_buffers.shape[1] > 0
    for name, b in template.named_buffers():
        if b.is_floating_point():
            floats.append(Slot(name, f_off, b.shape))
            f_off += b.numel()
        elif stacked_ints:
            ints.append(Slot(name, i_off, b.shape))
            i_off += b.numel()
    return params, floats, ints


class _Null:
    """A context that does nothing (no autocast)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NULL_CONTEXT = _Null()
