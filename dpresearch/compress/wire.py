"""Wire formats: bit packing, and the single row each worker hands to one collective.

Bit streams are little-endian: element i of a `bits`-wide stream occupies bits
[i·bits, (i+1)·bits) counted from bit 0 of byte 0, so n elements take exactly ⌈n·bits/8⌉ bytes.
On the CPU 1-bit streams go through numpy's packbits/unpackbits (one pass, SIMD); elsewhere, and
for widths 2 and 4, through vectorised torch shifts — the two paths give identical bytes.
`pack_rows` / `unpack_rows` pack every row of a `[R, m]` tensor as its own stream in one call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from dpresearch.compress.kernels import numpy_path
from dpresearch.compress.workspace import Workspace, scratch_or_new


def packed_size(numel: int, bits: int) -> int:
    """Bytes of a `bits`-wide stream of `numel` elements: ⌈numel·bits/8⌉."""
    return (numel * bits + 7) // 8


def pack_bits(values: Tensor, bits: int, ws: Workspace | None = None) -> Tensor:
    """Pack the low `bits` bits of each uint8 (or bool) element into a new uint8 stream."""
    values = values.reshape(-1)
    if values.dtype == torch.bool:
        values = values.view(torch.uint8)
    if bits == 8:
        return values.clone()
    if bits == 1 and numpy_path(values):
        return torch.from_numpy(np.packbits(values.numpy(), bitorder="little"))
    if bits in (1, 2, 4):
        return _merge_pairs(values, bits, ws)
    if not 1 <= bits < 8:
        raise ValueError(f"bit width must be in 1..8, got {bits}")
    shifts = torch.arange(bits, dtype=torch.uint8, device=values.device)
    planes = (values.unsqueeze(1) >> shifts) & 1  # [n, bits]: element-major bit stream
    return pack_bits(planes.reshape(-1), 1, ws)


def unpack_bits(packed: Tensor, bits: int, numel: int, ws: Workspace | None = None) -> Tensor:
    """Inverse of `pack_bits`: `numel` uint8 values. May return a view of a buffer of `ws`:
    consume it before the next call, or clone it."""
    if bits == 8:
        return packed[:numel]
    if bits == 1 and numpy_path(packed):
        unpacked = np.unpackbits(packed.contiguous().numpy(), count=numel, bitorder="little")
        return torch.from_numpy(unpacked)
    if bits in (1, 2, 4):
        return _split_pairs(packed, bits, numel, ws)
    stream = unpack_bits(packed, 1, numel * bits, ws).view(numel, bits)
    values = stream[:, 0].clone()
    for j in range(1, bits):
        values |= stream[:, j] << j
    return values


def pack_rows(values: Tensor, bits: int, out: Tensor, ws: Workspace | None = None) -> None:
    """Pack each row of the uint8/bool `[R, m]` `values` as its own stream into `out`
    `[R, packed_size(m, bits)]` (any row stride)."""
    rows, m = values.shape
    if bits == 1 and numpy_path(values):
        flags = values.numpy() if values.dtype == torch.bool else values.numpy().view(np.bool_)
        out.copy_(torch.from_numpy(np.packbits(flags, axis=1, bitorder="little")))
        return
    width = _whole_bytes(m, bits)
    if width != m:  # zero-pad each row so that rows end on a byte: one stream for all rows
        padded = scratch_or_new(ws, "wire.pad", (rows, width), torch.uint8, values.device)
        padded[:, m:].zero_()
        padded[:, :m].copy_(values)
        values = padded
    packed = pack_bits(values.contiguous(), bits, ws).view(rows, -1)
    out.copy_(packed[:, : out.shape[1]])


def unpack_rows(packed: Tensor, bits: int, m: int, ws: Workspace | None = None) -> Tensor:
    """Inverse of `pack_rows`: `[R, m]` uint8 values from `[R, packed_size(m, bits)]` (any row
    stride). May return a view of a buffer of `ws`."""
    rows, nbytes = packed.shape
    if bits == 1 and numpy_path(packed):
        unpacked = np.unpackbits(packed.numpy(), axis=1, count=m, bitorder="little")
        return torch.from_numpy(unpacked)
    width = _whole_bytes(m, bits)
    full = width * bits // 8
    if full != nbytes or not packed.is_contiguous():
        wide = scratch_or_new(ws, "wire.unpad", (rows, full), torch.uint8, packed.device)
        wide[:, nbytes:].zero_()
        wide[:, :nbytes].copy_(packed)
        packed = wide
    return unpack_bits(packed.reshape(-1), bits, rows * width, ws).view(rows, width)[:, :m]


def _whole_bytes(m: int, bits: int) -> int:
    """The smallest m' ≥ m whose m'·bits bits fill whole bytes."""
    step = 8 // np.gcd(8, bits)
    return -(-m // step) * step


def _merge_pairs(values: Tensor, bits: int, ws: Workspace | None = None) -> Tensor:
    """Merge neighbouring fields pairwise until a byte is full: the byte pair (a, b), read as
    the little-endian int16 v = a | b<<8 with a, b < 2^w, holds a | b<<w in the low byte of
    v | v>>(8−w). Each level halves the data; temporaries live in `ws`."""
    width = bits
    while True:
        if values.numel() % 2:
            values = torch.cat([values, values.new_zeros(1)])
        pairs = values.view(torch.int16)
        merged = scratch_or_new(ws, f"wire.merge{width}", pairs.numel(), torch.int16, pairs.device)
        torch.bitwise_right_shift(pairs, 8 - width, out=merged).bitwise_or_(pairs)
        width *= 2
        if width == 8:
            return merged.to(torch.uint8)
        values = scratch_or_new(ws, f"wire.merged{width}", pairs.numel(), torch.uint8, pairs.device)
        values.copy_(merged)


def _split_pairs(packed: Tensor, bits: int, numel: int, ws: Workspace | None = None) -> Tensor:
    """Inverse of `_merge_pairs`: the byte a | b<<w, widened to int16 v, becomes
    (v | v<<(8−w)) & mask, whose two bytes are a and b."""
    values, width = packed, 8
    while width > bits:
        width //= 2
        wide = scratch_or_new(ws, f"wire.split{width}", values.numel(), torch.int16, values.device)
        wide.copy_(values)
        spread = scratch_or_new(
            ws, f"wire.spread{width}", values.numel(), torch.int16, values.device
        )
        torch.bitwise_left_shift(wide, 8 - width, out=spread).bitwise_or_(wide)
        low = (1 << width) - 1
        values = spread.bitwise_and_(low | low << 8).view(torch.uint8)
    return values[:numel]


def sign_bits(x: Tensor) -> Tensor:
    """Packed sign bits of `x` (1 = negative, including -0.0): ⌈n/8⌉ bytes."""
    if numpy_path(x):
        return torch.from_numpy(np.packbits(np.signbit(x.numpy()), bitorder="little"))
    return pack_bits(torch.signbit(x), 1)


def sign_table(dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """`[256, 8]`: row b holds the ±1 of the 8 signs packed in byte value b (bit j = entry j,
    1 = negative), so decoding packed signs is one gather of a row per byte."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return (1 - 2 * bits).to(dtype).to(device)


Spec = Sequence[tuple[torch.dtype, int]]


class RowLayout:
    """Where every payload component of every chunk sits in one worker's wire row.

    Linear payloads are summed by allreduce, so their row has the payload's own dtype (all
    components must share it) and holds the components in chunk order. Non-linear payloads are
    gathered as raw bytes: the row is uint8 and is cut into one *region* per component dtype,
    widest first (so each region starts aligned to its own element size), each holding that
    dtype's components of every chunk in chunk order, with no padding. Either way the row's
    size in bytes is exactly the sum of the components' sizes.

    Stacked codecs read and write a whole region for all chunks and rows at once (`region`);
    `slots[i]` says where chunk i's components lie inside their regions (`write` / `read` for
    one chunk of one row).
    """

    def __init__(self, specs: Sequence[Spec], linear: bool) -> None:
        self.linear = linear
        dtypes = {dtype for spec in specs for dtype, _ in spec}
        if linear:
            if len(dtypes) > 1:
                raise ValueError(f"a linear payload must have one dtype, got {dtypes}")
            self.dtype = dtypes.pop() if dtypes else torch.float32
            order = [self.dtype]
        else:
            self.dtype = torch.uint8
            order = sorted(dtypes, key=lambda d: (-d.itemsize, str(d)))
        filled = dict.fromkeys(order, 0)
        # slots[i]: (dtype, element offset inside the dtype's region, count) per component
        self.slots: list[list[tuple[torch.dtype, int, int]]] = []
        for spec in specs:
            self.slots.append([(dtype, filled[dtype], count) for dtype, count in spec])
            for dtype, count in spec:
                filled[dtype] += count
        self.regions: dict[torch.dtype, tuple[int, int]] = {}  # dtype -> (byte offset, count)
        offset = 0
        for dtype in order:
            self.regions[dtype] = (offset, filled[dtype])
            offset += filled[dtype] * dtype.itemsize
        self.size = offset // self.dtype.itemsize

    def region(self, rows: Tensor, dtype: torch.dtype) -> Tensor:
        """The `dtype` region of wire rows `[..., size]`, as `[..., count]` of `dtype`: a view
        when the rows' alignment allows (always for rows this layout's codec wrote), else a
        copy (read it, do not write into it)."""
        start, count = self.regions[dtype]
        if self.linear:
            return rows[..., start : start + count]
        nbytes = count * dtype.itemsize
        part = rows[..., start : start + nbytes]
        if dtype == torch.uint8:
            return part
        size = dtype.itemsize
        aligned = part.stride(-1) == 1 and part.storage_offset() % size == 0
        aligned = aligned and all(s % size == 0 for s in part.stride()[:-1])
        if not aligned:
            part = torch.empty(part.shape, dtype=torch.uint8, device=part.device).copy_(part)
        return part.view(dtype)

    def writable_region(self, rows: Tensor, dtype: torch.dtype) -> Tensor | None:
        """The `dtype` region of wire rows `[..., size]` as a view to write into, or None if
        the rows' alignment does not allow one (then use `write_region`)."""
        view = self.region(rows, dtype)
        shares = view.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
        return view if shares else None

    def write_region(
        self, rows: Tensor, dtype: torch.dtype, values: Tensor, start: int = 0
    ) -> None:
        """Write `values` `[..., m]` (converted to `dtype`) into elements [start, start + m) of
        the `dtype` region of wire rows `[..., size]` (any alignment)."""
        offset, _ = self.regions[dtype]
        m = values.shape[-1]
        if self.linear:
            rows[..., offset + start : offset + start + m].copy_(values)
            return
        size = dtype.itemsize
        first = offset + start * size
        target = rows[..., first : first + m * size]
        if dtype != torch.uint8:
            values = values.to(dtype).contiguous().view(torch.uint8)
        target.copy_(values)

    def write(self, row: Tensor, index: int, components: Sequence[Tensor]) -> None:
        """Copy chunk `index`'s payload components into the 1-D `row`."""
        for (dtype, offset, count), comp in zip(self.slots[index], components, strict=True):
            assert comp.dtype == dtype and comp.numel() == count, (comp.dtype, comp.shape, dtype)
            self.write_region(row, dtype, comp.reshape(-1), offset)

    def read(self, row: Tensor, index: int) -> list[Tensor]:
        """Chunk `index`'s payload components, viewed (or, if misaligned, copied) from the 1-D
        `row`."""
        return [
            self.region(row, dtype)[offset : offset + count]
            for dtype, offset, count in self.slots[index]
        ]
