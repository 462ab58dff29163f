"""Top-k of a chunked DCT (DeMo's message: Peng, Quesnelle & Kingma 2024, arXiv 2411.19870).

Chunks (the reference code's `TransformDCT`, bloc97/DeMo). A compression chunk is seen as a
matrix: a parameter of 2 dimensions as it is, of 1 dimension (n entries) or a chunk with no
shape (a bucket) as 1 × n, a scalar as 1 × 1, and a tensor of more dimensions as
shape[0] × (the product of the others), in the flat row's order. Each dimension of n entries is
cut into blocks of s = the largest divisor of n that is at most `chunk` (n itself when
n ≤ chunk; 1 for a prime n > chunk), the reference's `_get_smaller_split`; so a 768 × 3072
matrix is tiled by 64 × 64 blocks, a 65-entry dimension by 13s. Each h × w block gets the
separable orthonormal DCT-II (C_h · block · C_wᵀ, C[u, j] = α_u·cos(π(2j + 1)u / 2n),
α_0 = √(1/n), α_u = √(2/n); IDCT = Cᵀ · coefficients · C), computed as matrix products. Its h·w
coefficients are ranked by |value| and the top min(topk, h·w) kept; their index inside the
block (row-major, u·w + v) and value are sent.

Bytes per worker for a chunk set (a bucket; the whole model for DeMo): the values in the input
dtype, then the indices in the narrowest integer that holds every block's largest index of the
set: one byte (uint8) where every block has at most 256 coefficients, two (int16) up to 32768
(so 64 × 64 blocks cost two), else four (int32). Σ_chunks blocks·k·(value bytes + index
bytes), no header, no padding. Non-linear: rows are gathered; a receiver sums the workers'
coefficients block by block, then applies one IDCT per chunk (the IDCT is linear, so this is
the sum of the decoded messages), and the aggregate is their mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.compress.codec import Codec, WirePlan
from dpresearch.compress.wire import RowLayout, Spec


def dct_matrix(n: int, dtype: torch.dtype = torch.float64, device: Any = "cpu") -> Tensor:
    """The orthonormal DCT-II matrix C (`[n, n]`): C[u, j] = α_u·cos(π(2j + 1)u / 2n),
    α_0 = √(1/n), α_u = √(2/n); C·x are x's coefficients, Cᵀ·c inverts. Built in float64."""
    j = torch.arange(n, dtype=torch.float64)
    u = j[:, None]
    c = torch.cos(math.pi * (2 * j[None, :] + 1) * u / (2 * n)) * math.sqrt(2 / n)
    c[0] /= math.sqrt(2)
    return c.to(dtype=dtype, device=device)


def block_side(n: int, chunk: int) -> int:
    """The largest divisor of n that is at most `chunk` (the reference's `_get_smaller_split`)."""
    return max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)


def as_matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) a tensor of `shape` is chunked as (see the module docstring)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def index_dtype(largest_block: int) -> torch.dtype:
    """The narrowest integer type holding every index below `largest_block`."""
    if largest_block <= 256:
        return torch.uint8
    if largest_block <= 2**15:
        return torch.int16
    return torch.int32


@dataclass(frozen=True)
class TensorChunks:
    """How one tensor is chunked: columns [offset, offset + rows·cols) of the flat row, seen as
    a rows × cols matrix tiled by h × w blocks, k coefficients kept per block, its entries at
    [start, start + blocks·k) of the message."""

    offset: int
    rows: int
    cols: int
    h: int
    w: int
    k: int
    start: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def blocks(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    @property
    def entries(self) -> int:
        return self.blocks * self.k


def tensor_chunks(shape: tuple[int, ...], chunk: int, topk: int, offset: int = 0,
                  start: int = 0) -> TensorChunks | None:  # fmt: skip
    """The blocks of a tensor of `shape` at `offset` (None for an empty tensor)."""
    rows, cols = as_matrix(tuple(shape))
    if rows * cols == 0:
        return None
    h, w = block_side(rows, chunk), block_side(cols, chunk)
    return TensorChunks(offset, rows, cols, h, w, min(topk, h * w), start)


# Blocks of at most `topk` coefficients are sent whole (top min(topk, h·w)), as the reference's
# `_clamp_topk` does for a bias or a small dimension. A message of more than this share of the
# dense bytes compresses little: said once before the run (`whole_blocks_note`).
DENSE_SHARE_NOTED = 0.5


def whole_blocks_note(shapes: Sequence[tuple[int, ...]], chunk: int, topk: int, key: str,
                      itemsize: int = 4) -> str | None:  # fmt: skip
    """Check `topk` against the DCT blocks of tensors of `shapes` with values of `itemsize`
    bytes (`key`: the config node holding topk and chunk). ValueError (one line) where every
    block holds at most `topk` coefficients (each sent whole with its indices: more bytes than
    no compression); a warning line, naming the blocks sent whole, where the message is more
    than `DENSE_SHARE_NOTED` of the dense bytes; else None."""
    tensors = [t for t in (tensor_chunks(tuple(s), chunk, topk) for s in shapes) if t is not None]
    if not tensors:
        return None
    largest = max(t.h * t.w for t in tensors)
    blocks = sum(t.blocks for t in tensors)
    whole = sum(t.blocks for t in tensors if t.k == t.h * t.w)
    sides = f"each dimension cut by its largest divisor <= {key}.chunk={chunk}"
    if whole == blocks:
        raise ValueError(
            f"{key}.topk={topk} sends every coefficient: this model's largest DCT block holds "
            f"{largest} ({sides}), so all {blocks} blocks would go whole, indices included; "
            f"use {key}.topk < {largest}"
        )
    index = torch.empty((), dtype=index_dtype(largest)).element_size()
    message = sum(t.entries for t in tensors) * (itemsize + index)
    share = message / (sum(t.numel for t in tensors) * itemsize)
    if share <= DENSE_SHARE_NOTED:
        return None
    return (
        f"{key}.topk={topk} sends {share:.0%} of the dense bytes (values and indices): "
        f"{whole} of this model's {blocks} DCT blocks hold at most {topk} coefficients and go "
        f"whole ({sides}); a smaller {key}.topk compresses"
    )


class ChunkedDCT:
    """The chunked DCT of flat rows laid out as `layout` ((offset, shape) per tensor; see the
    module docstring), keeping `topk` coefficients per block. `encode` / `decode` work on one
    tensor's columns of `[R, D]` rows at once."""

    def __init__(
        self,
        layout: Sequence[tuple[int, Sequence[int]]],
        chunk: int,
        topk: int,
        dtype: torch.dtype,
        device: Any,
    ) -> None:
        tensors, start = [], 0
        for offset, shape in layout:
            t = tensor_chunks(tuple(shape), chunk, topk, offset, start)
            if t is not None:
                tensors.append(t)
                start += t.entries
        self.tensors: list[TensorChunks] = tensors
        self.entries = start  # coefficients one worker sends per step
        self.largest_block = max((t.h * t.w for t in tensors), default=1)
        self._bases = {n: dct_matrix(n, dtype, device) for t in tensors for n in (t.h, t.w)}

    def encode(self, t: TensorChunks, x: Tensor) -> Tensor:
        """`x` `[R, rows·cols]` (one tensor's columns of R rows) → its blocks' coefficients
        `[R, blocks, h·w]` (block-row-major; a block's coefficients row-major)."""
        r = x.shape[0]
        blocks = x.reshape(r, t.rows // t.h, t.h, t.cols // t.w, t.w)
        coeffs = torch.einsum("aihjw,uh,vw->aijuv", blocks, self._bases[t.h], self._bases[t.w])
        return coeffs.reshape(r, t.blocks, t.h * t.w)

    def decode(self, t: TensorChunks, coeffs: Tensor) -> Tensor:
        """The inverse of `encode`: `[R, blocks, h·w]` → `[R, rows·cols]`."""
        r = coeffs.shape[0]
        c = coeffs.reshape(r, t.rows // t.h, t.cols // t.w, t.h, t.w)
        x = torch.einsum("aijuv,uh,vw->aihjw", c, self._bases[t.h], self._bases[t.w])
        return x.reshape(r, t.numel)


def chunk_shape(chunk: Chunk) -> tuple[int, ...]:
    """The shape a chunk is chunked as: its parameter's, else a flat run of its entries."""
    return chunk.shape if chunk.shape is not None else (chunk.numel,)


class DCTTopKCodec(Codec):
    """Per chunk: one DCT of every block of all rows (two matrix products), one `torch.topk`
    per block, values and indices written as two regions of the wire row; decoded by one
    scatter into the blocks and one IDCT per chunk (a sum of rows: summed coefficients, then
    one IDCT)."""

    compressor: DCTTopK

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.compressor
        layout = [(ch.offset, chunk_shape(ch)) for ch in self.chunks]
        self.dct = ChunkedDCT(layout, c.chunk, c.topk, self.dtype, self.device)
        self.index = index_dtype(self.dct.largest_block)

    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        rows = x.shape[0]
        for t in self.dct.tensors:
            coeffs = self.dct.encode(t, x[:, t.offset : t.offset + t.numel])
            top = coeffs.abs().topk(t.k, dim=-1, sorted=False).indices
            kept = coeffs.gather(-1, top)
            self.layout.write_region(wire, self.dtype, kept.reshape(rows, -1), start=t.start)
            self.layout.write_region(wire, self.index, top.reshape(rows, -1), start=t.start)

    def coefficients(self, wire: Tensor, ones: bool = False) -> list[Tensor]:
        """Every chunk's blocks of coefficients `[R, blocks, h·w]` as wire rows `[R, L]` send
        them (zero where nothing was sent; `ones`: 1 where a coefficient was sent)."""
        values = self.layout.region(wire, self.dtype)
        index = self.layout.region(wire, self.index).long()
        rows, out = wire.shape[0], []
        for t in self.dct.tensors:
            part = slice(t.start, t.start + t.entries)
            where = index[:, part].reshape(rows, t.blocks, t.k)
            dense = values.new_zeros(rows, t.blocks, t.h * t.w)
            if ones:
                out.append(dense.scatter_(-1, where, 1.0))
            else:
                sent = values[:, part].reshape(rows, t.blocks, t.k)
                out.append(dense.scatter_(-1, where, sent))
        return out

    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        out.zero_()
        for t, coeffs in zip(self.dct.tensors, self.coefficients(wire), strict=True):
            out[:, t.offset : t.offset + t.numel] = self.dct.decode(t, coeffs)

    def accumulate(
        self, rows: Tensor, step: int, out: Tensor, weights: Tensor | None = None
    ) -> None:
        b, count = rows.shape[:2]
        coeffs = self.coefficients(rows.reshape(b * count, -1))
        for t, dense in zip(self.dct.tensors, coeffs, strict=True):
            dense = dense.view(b, count, t.blocks, t.h * t.w)
            if weights is not None:
                dense = dense * weights.to(dense.dtype).view(b, count, 1, 1)
            total = dense[:, 0].clone()
            for r in range(1, count):  # one r at a time, in order (every backend the same)
                total.add_(dense[:, r])
            out[:, t.offset : t.offset + t.numel] += self.dct.decode(t, total).to(out.dtype)


class DCTTopK(SingleRoundCompressor):
    """Keep the `topk` largest-magnitude DCT-II coefficients of every block of each chunk
    (see the module docstring for the blocks and the bytes). topk: coefficients per block
    (≥ 1; the paper's 32); chunk: the target block side (≥ 1; the paper's 64). Best with
    `granularity=tensor` (a parameter's matrix shape sets its blocks)."""

    codec_class = DCTTopKCodec

    def __init__(self, topk: int = 32, chunk: int = 64, seed: int = 0) -> None:
        super().__init__(seed)
        for name, value in (("topk", topk), ("chunk", chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value}: must be an integer >= 1")
        self.topk, self.chunk = int(topk), int(chunk)

    def _spec(self, chunk: Chunk, dtype: torch.dtype, index: torch.dtype) -> Spec:
        t = tensor_chunks(chunk_shape(chunk), self.chunk, self.topk)
        entries = t.entries if t is not None else 0
        return [(dtype, entries), (index, entries)]

    def largest_block(self, chunks: Sequence[Chunk]) -> int:
        """The most coefficients of one block among `chunks`."""
        blocks = (tensor_chunks(chunk_shape(ch), self.chunk, self.topk) for ch in chunks)
        return max((t.h * t.w for t in blocks if t is not None), default=1)

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return self._spec(chunk, dtype, index_dtype(self.largest_block([chunk])))

    def chunk_set_bytes(self, chunks: Sequence[Chunk], dtype: torch.dtype = torch.float32) -> int:
        """A set's bytes as `wire_plan` lays it out: every chunk's indices at the set's width."""
        index = index_dtype(self.largest_block(chunks))
        specs = (self._spec(ch, dtype, index) for ch in chunks)
        return sum(count * dt.itemsize for spec in specs for dt, count in spec)

    def wire_plan(
        self, chunks: Sequence[Chunk], dtype: torch.dtype, linear: bool | None = None
    ) -> WirePlan:
        """One index width for the whole set: the narrowest that holds its largest block."""
        index = index_dtype(self.largest_block(chunks))
        specs = [self._spec(ch, dtype, index) for ch in chunks]
        return WirePlan(tuple(chunks), RowLayout(specs, False))
