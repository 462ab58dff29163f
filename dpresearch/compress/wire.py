"""Wire formats: bit packing, and the single row each worker hands to one collective.

Bit streams are little-endian: element i of a `bits`-wide stream occupies bits
[i·bits, (i+1)·bits) counted from bit 0 of byte 0, so n elements take exactly ⌈n·bits/8⌉ bytes.
On the CPU 1-bit streams go through numpy's packbits/unpackbits (one pass, SIMD); elsewhere, and
for widths 2 and 4, through vectorised torch shifts — the two paths give identical bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from dpresearch.compress.kernels import numpy_path
from dpresearch.compress.workspace import scratch


def packed_size(numel: int, bits: int) -> int:
    """Bytes of a `bits`-wide stream of `numel` elements: ⌈numel·bits/8⌉."""
    return (numel * bits + 7) // 8


def pack_bits(values: Tensor, bits: int) -> Tensor:
    """Pack the low `bits` bits of each uint8 (or bool) element into a new uint8 stream."""
    values = values.reshape(-1)
    if values.dtype == torch.bool:
        values = values.view(torch.uint8)
    if bits == 8:
        return values.clone()
    if bits == 1 and numpy_path(values):
        return torch.from_numpy(np.packbits(values.numpy(), bitorder="little"))
    if bits in (1, 2, 4):
        return _merge_pairs(values, bits)
    if not 1 <= bits < 8:
        raise ValueError(f"bit width must be in 1..8, got {bits}")
    shifts = torch.arange(bits, dtype=torch.uint8, device=values.device)
    planes = (values.unsqueeze(1) >> shifts) & 1  # [n, bits]: element-major bit stream
    return pack_bits(planes.reshape(-1), 1)


def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of `pack_bits`: `numel` uint8 values. May return a view of a scratch buffer
    (see `workspace.py`): consume it before the next call, or clone it."""
    if bits == 8:
        return packed[:numel]
    if bits == 1 and numpy_path(packed):
        unpacked = np.unpackbits(packed.contiguous().numpy(), count=numel, bitorder="little")
        return torch.from_numpy(unpacked)
    if bits in (1, 2, 4):
        return _split_pairs(packed, bits, numel)
    stream = unpack_bits(packed, 1, numel * bits).view(numel, bits)
    values = stream[:, 0].clone()
    for j in range(1, bits):
        values |= stream[:, j] << j
    return values


def _merge_pairs(values: Tensor, bits: int) -> Tensor:
    """Merge neighbouring fields pairwise until a byte is full: the byte pair (a, b), read as
    the little-endian int16 v = a | b<<8 with a, b < 2^w, holds a | b<<w in the low byte of
    v | v>>(8−w). Each level halves the data; temporaries live in scratch buffers."""
    width = bits
    while True:
        if values.numel() % 2:
            values = torch.cat([values, values.new_zeros(1)])
        pairs = values.view(torch.int16)
        merged = scratch(f"wire.merge{width}", pairs.numel(), torch.int16, values.device)
        torch.bitwise_right_shift(pairs, 8 - width, out=merged).bitwise_or_(pairs)
        width *= 2
        if width == 8:
            return merged.to(torch.uint8)
        values = scratch(f"wire.merged{width}", pairs.numel(), torch.uint8, values.device)
        values.copy_(merged)


def _split_pairs(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of `_merge_pairs`: the byte a | b<<w, widened to int16 v, becomes
    (v | v<<(8−w)) & mask, whose two bytes are a and b."""
    values, width = packed, 8
    while width > bits:
        width //= 2
        wide = scratch(f"wire.split{width}", values.numel(), torch.int16, values.device)
        wide.copy_(values)
        spread = scratch(f"wire.spread{width}", values.numel(), torch.int16, values.device)
        torch.bitwise_left_shift(wide, 8 - width, out=spread).bitwise_or_(wide)
        low = (1 << width) - 1
        values = spread.bitwise_and_(low | low << 8).view(torch.uint8)
    return values[:numel]


def sign_bits(x: Tensor) -> Tensor:
    """Packed sign bits of `x` (1 = negative, including -0.0): ⌈n/8⌉ bytes."""
    if numpy_path(x):
        return torch.from_numpy(np.packbits(np.signbit(x.numpy()), bitorder="little"))
    return pack_bits(torch.signbit(x), 1)


Spec = Sequence[tuple[torch.dtype, int]]


class RowLayout:
    """Where every payload component of every chunk sits in one worker's wire row.

    Linear payloads are summed by allreduce, so their row has the payload's own dtype (all
    components must share it). Non-linear payloads are gathered as raw bytes: the row is uint8
    and each component is its bytes, back to back, with no padding. Either way the row's size in
    bytes is exactly the sum of the components' sizes.
    """

    def __init__(self, specs: Sequence[Spec], linear: bool) -> None:
        self.linear = linear
        dtypes = {dtype for spec in specs for dtype, _ in spec}
        if linear:
            if len(dtypes) > 1:
                raise ValueError(f"a linear payload must have one dtype, got {dtypes}")
            self.dtype = dtypes.pop() if dtypes else torch.float32
        else:
            self.dtype = torch.uint8
        unit = self.dtype.itemsize
        self.slots: list[list[tuple[int, int, torch.dtype, int]]] = []
        offset = 0
        for spec in specs:
            slots = []
            for dtype, count in spec:
                size = count * dtype.itemsize // unit
                slots.append((offset, size, dtype, count))
                offset += size
            self.slots.append(slots)
        self.size = offset

    def write(self, row: Tensor, index: int, components: Sequence[Tensor]) -> None:
        """Copy chunk `index`'s payload components into `row`."""
        for (offset, size, dtype, count), comp in zip(self.slots[index], components, strict=True):
            assert comp.dtype == dtype and comp.numel() == count, (comp.dtype, comp.shape, dtype)
            flat = comp.reshape(-1)
            row[offset : offset + size].copy_(flat if self.linear else flat.view(torch.uint8))

    def read(self, row: Tensor, index: int) -> list[Tensor]:
        """Chunk `index`'s payload components, viewed (or, if misaligned, copied) from `row`."""
        out = []
        for offset, size, dtype, _count in self.slots[index]:
            part = row[offset : offset + size]
            if not self.linear and dtype != torch.uint8:
                itemsize = dtype.itemsize
                if part.storage_offset() % itemsize:
                    part = part.clone()
                part = part.view(dtype)
            out.append(part)
        return out
