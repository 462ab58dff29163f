"""Codecs: a compressor's encoder and decoder for one chunk set, over stacked rows.

A `Codec` belongs to one process and one chunk set (a bucket, or all chunks of a model). It is
built once per layout and owns what that layout needs: its `WirePlan` (where every payload
component of every chunk sits in a wire row), a `ChunkTable` (equal-size groups of chunks,
bit-packing runs) and a `Workspace` of scratch buffers. Every call handles all rows and all
chunks at once:

    wire = codec.encode(x, step)                  # x [W, n] -> wire [W, L], one row per worker
    codec.decode(wire, step, out)                 # wire [R, L] -> out [R, n], each row decoded
    codec.accumulate(rows, step, out, weights)    # out[b] += Σ_r weights[b, r]·D(rows[b, r])

Row w of `x` is worker `workers[w]`'s input: the worker ids (and the step) seed every random
stream (`rng.py`), so a worker draws the same numbers whether its row is encoded alone (one
process per worker, an asynchronous push) or with all others (simulated workers). A decoder
never depends on the sender's state, only on the wire row, the chunk and the step.

`ChunkCodec` is the generic codec: it calls a compressor's per-chunk `compress` / `decompress`
for each row and chunk — what a new compressor gets for free. The shipped compressors have their
own codec classes with batched kernels (one top-k per group of equal-size chunks, one sign or
quantization pass over the whole bucket) that give the same results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dpresearch.compress.chunks import Chunk, ChunkTable
from dpresearch.compress.wire import RowLayout
from dpresearch.compress.workspace import Workspace

if TYPE_CHECKING:
    from dpresearch.compress.base import SingleRoundCompressor

DECODE_BLOCK = 1 << 24  # entries decoded per call in `accumulate` (64 MiB of fp32)


@dataclass(frozen=True)
class WirePlan:
    """One chunk set's plan-time facts: its chunks and where each chunk's payload components
    sit in a worker's wire row (`layout.size` elements of `layout.dtype`)."""

    chunks: tuple[Chunk, ...]
    layout: RowLayout

    @property
    def numel(self) -> int:
        """Input elements the chunks cover (the bucket's length)."""
        return max((ch.offset + ch.numel for ch in self.chunks), default=0)


class Codec:
    """Encoder/decoder of one chunk set over stacked rows (see the module docstring).

    compressor: the method (hyper-parameters, run seed); chunks: the units tiling a row of
    `numel` elements of `dtype` on `device`; workers: the global ids of the rows `encode` sees
    by default; linear: lay rows out in the payload's dtype so they can be summed by allreduce
    (default: the compressor's `linear`), else as bytes for allgather.

    Subclasses implement `encode_rows` and `decode_rows`; `accumulate` has a generic form
    (decode, weight, add) that sparse codecs replace.
    """

    def __init__(
        self,
        compressor: SingleRoundCompressor,
        chunks: Sequence[Chunk],
        dtype: torch.dtype,
        device: torch.device | str,
        workers: Sequence[int],
        linear: bool,
    ) -> None:
        self.compressor = compressor
        self.plan = compressor.wire_plan(chunks, dtype, linear)
        self.layout = self.plan.layout
        self.chunks = self.plan.chunks
        self.table = ChunkTable(self.chunks, device)
        self.numel = self.plan.numel
        self.dtype, self.device = dtype, torch.device(device)
        self.workers = tuple(workers)
        self.linear = linear
        self.ws = Workspace()

    @property
    def wire_size(self) -> int:
        """Elements of `layout.dtype` in one wire row."""
        return self.layout.size

    @property
    def wire_bytes(self) -> int:
        """Bytes of one wire row: exactly the compressor's payload formula summed over chunks."""
        return self.layout.size * self.layout.dtype.itemsize

    def encode(self, x: Tensor, step: int, workers: Sequence[int] | None = None) -> Tensor:
        """Wire rows `[R, L]` for the inputs `x` `[R, n]` (never modified) of workers `workers`
        (global ids; default: this codec's workers). The result is this codec's buffer, valid
        until the next `encode`."""
        workers = self.workers if workers is None else tuple(workers)
        if len(workers) != x.shape[0]:
            raise ValueError(f"encode: {x.shape[0]} rows for workers {workers}")
        wire = self.ws.get("wire", (x.shape[0], self.layout.size), self.layout.dtype, self.device)
        self.encode_rows(x, step, workers, wire)
        return wire

    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        """Fill `wire` `[R, L]` with the encoded rows of `x` `[R, n]`."""
        raise NotImplementedError

    def decode(self, wire: Tensor, step: int, out: Tensor) -> None:
        """`out[r]` = D(wire[r]) for wire rows `[R, L]` (any worker's; a sum of rows for linear
        codecs), `out` `[R, n]`. Must not modify `wire`."""
        self.decode_rows(wire, step, out)

    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        raise NotImplementedError

    def accumulate(
        self, rows: Tensor, step: int, out: Tensor, weights: Tensor | None = None
    ) -> None:
        """`out[b] += Σ_r weights[b, r]·D(rows[b, r])` for `rows` `[B, R, L]`, `out` `[B, n]`
        (any float dtype), `weights` `[B, R]` (None: all ones, no multiply). Terms are formed
        in the codec's dtype and added one r at a time, in order — the sums every backend
        forms identically. A wire row of zero bytes decodes to zeros (padding slots of a
        neighbour exchange, weighted 0, add nothing)."""
        b, count = out.shape[0], rows.shape[1]
        # several r decoded per call (a decode's Python cost once per block, not per row),
        # within DECODE_BLOCK entries of scratch
        per = max(1, min(count, DECODE_BLOCK // max(b * self.numel, 1)))
        term = self.ws.get("accumulate.term", tuple(out.shape), out.dtype, self.device)
        for first in range(0, count, per):
            last = min(count, first + per)
            shape = (b, last - first, self.numel)
            decoded = self.ws.get("accumulate.decoded", shape, self.dtype, self.device)
            block = rows[:, first:last].reshape(-1, rows.shape[-1])
            self.decode(block, step, decoded.view(-1, self.numel))
            for r in range(first, last):
                if weights is None:
                    out.add_(decoded[:, r - first])
                else:
                    torch.mul(decoded[:, r - first], weights[:, r : r + 1], out=term)
                    out.add_(term)


class ChunkCodec(Codec):
    """The generic codec: the compressor's per-chunk `compress` / `decompress`, called for each
    row and chunk. Correct for any `SingleRoundCompressor`; the shipped compressors replace it
    with batched codecs."""

    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        for row, worker in enumerate(workers):
            for i, ch in enumerate(self.chunks):
                payload = self.compressor.compress(x[row, ch.slice], ch, step, worker)
                self.layout.write(wire[row], i, payload)

    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        for row in range(wire.shape[0]):
            for i, ch in enumerate(self.chunks):
                payload = self.layout.read(wire[row], i)
                self.compressor.decompress(payload, ch, step, out[row, ch.slice])
