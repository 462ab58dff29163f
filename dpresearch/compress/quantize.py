"""Unbiased stochastic quantization to 2s+1 signed levels over stacked rows, shared by QSGD and
TernGrad.

Each bucket of B entries of a chunk has a norm ν (fp32). An entry v becomes the integer level
ξ = ⌊v·s/ν + u⌋ ∈ [−s, s] with a dither u uniform in [0, 1), and decodes to ξ·ν/s. Rounding a
signed value with a dither is exactly QSGD's rule — |v|·s/ν rounded up with probability equal
to its fractional part, sign restored — because stochastic rounding commutes with negation.

Levels travel as ξ + s in ⌈log₂(2s+1)⌉ bits (`wire.pack_rows`). The dither has 16 random bits
(u = (r + ½)/2¹⁶, r uniform on 0…2¹⁶−1), so the probability of rounding up is the fractional
part rounded to a multiple of 2⁻¹⁶: the quantizer is unbiased to within 2⁻¹⁷ of one level
step, far below fp32's own rounding of v·s/ν at large s. (16 bits instead of a 24-bit float
draw make the random stream four times cheaper on the CPU.) Each worker and chunk has its own
dither stream, seeded by (method, run seed, worker, chunk key, step).

`QuantizeCodec` quantizes a whole bucket for all rows at once: norms per group of equal-size
chunks (a `[R, G, buckets, B]` view), one dither fill per row and chunk, one pass for the
levels, one `pack_rows` per run of chunks.

The plan it shares with the FP4 codec (`fp4.py`) — one fp32 scale per bucket, bit-packed codes
after them — is `BucketQuantizer` (the compressor side: bucket size, bits, payload) and
`ScaledCodec` (the codec side: where each bucket's scale sits, the packing runs).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dpresearch.compress import rng
from dpresearch.compress.base import SingleRoundCompressor
from dpresearch.compress.chunks import Chunk, ChunkGroup
from dpresearch.compress.codec import Codec
from dpresearch.compress.kernels import cast_into
from dpresearch.compress.wire import Spec, pack_rows, packed_size, unpack_rows

if TYPE_CHECKING:
    from dpresearch.compress.qsgd import QSGD

MAX_LEVELS = 127  # ξ + s must fit in one byte


def level_bits(levels: int) -> int:
    """⌈log₂(2s+1)⌉: bits per entry for 2s+1 signed levels."""
    return (2 * levels).bit_length()


def bucket_parts(view: Tensor, bucket: int) -> list[Tensor]:
    """A group view `[..., d]` cut at bucket boundaries into `[..., full, B]` and, for a partial
    last bucket, `[..., 1, d mod B]` (views, no copies)."""
    d = view.shape[-1]
    full = d // bucket
    parts = []
    if full:
        parts.append(view[..., : full * bucket].unflatten(-1, (full, bucket)))
    if d % bucket:
        parts.append(view[..., full * bucket :].unsqueeze(-2))
    return parts


def absmax(buckets: Tensor) -> Tensor:
    """max |v| of each bucket `[..., B]` → `[...]`, fp32 (exact: a max loses nothing)."""
    low, high = torch.aminmax(buckets, dim=-1)  # one pass; vector_norm(inf) is far slower
    return torch.maximum(-low, high).to(torch.float32)


class BucketQuantizer(SingleRoundCompressor):
    """A quantizer with one fp32 scale per bucket of `bucket_size` entries of a chunk (null: one
    bucket per chunk) and `bits`-wide codes per entry. Payload per chunk of d entries:
    4·⌈d/B⌉ + ⌈d·bits/8⌉ bytes — the scales, then the bit-packed codes. Non-linear (per-worker
    scales): gathered. Subclasses give `bits`, `norms` (the scale of each bucket) and the
    codec."""

    def __init__(self, bits: int, bucket_size: int | None, seed: int = 0) -> None:
        super().__init__(seed)
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"bucket_size={bucket_size}: must be >= 1 (or null: whole chunk)")
        self.bits, self.bucket_size = bits, bucket_size

    def bucket(self, numel: int) -> int:
        """Entries per bucket in a chunk of `numel` entries."""
        return max(1, min(self.bucket_size or numel, numel))

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        buckets = -(-chunk.numel // self.bucket(chunk.numel))
        return [(torch.float32, buckets), (torch.uint8, packed_size(chunk.numel, self.bits))]

    @abstractmethod
    def norms(self, buckets: Tensor) -> Tensor:
        """The scale of each bucket as the wire carries it, fp32: `[..., B]` → `[...]`."""


class ScaledCodec(Codec):
    """The plan of a `BucketQuantizer`'s codec: the fp32 scales of all chunks' buckets in one
    region of the row (`num_norms`; `norm_slots[g]`, group g's slots in it), the packed codes
    in a second one (`spans`: the row columns and code bytes of each run of chunks that packs
    as one stream)."""

    compressor: BucketQuantizer

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.compressor
        self.bits = c.bits
        self.name = type(c).__name__
        self.num_norms = self.layout.regions[torch.float32][1]
        # per group: the slots of its chunks' norms in the norms region, [G·buckets]
        self.norm_slots = []
        for group in self.table.groups:
            count = -(-group.numel // c.bucket(group.numel))
            starts = [self.layout.slots[i][0][1] for i in group.members]
            self.norm_slots.append(
                torch.cat([torch.arange(s, s + count) for s in starts]).to(self.device)
            )
        self.spans = []  # (row columns, packed-level bytes) per run of chunks
        for first, last in self.table.runs(self.bits):
            head, tail = self.chunks[first], self.chunks[last - 1]
            start, end = self.layout.slots[first][1][1], self.layout.slots[last - 1][1][1]
            end += packed_size(tail.numel, self.bits)
            self.spans.append((slice(head.offset, tail.offset + tail.numel), slice(start, end)))

    def _group_parts(
        self, x: Tensor, group: ChunkGroup, slots: Tensor, per_bucket: Tensor
    ) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
        """The bucket parts of `x`'s group view (see `bucket_parts`), each paired with its
        buckets' values from `per_bucket` `[R, NB]` (shaped to broadcast), and the view."""
        bucket = self.compressor.bucket(group.numel)
        view = self.table.view(x, group)
        values = per_bucket[:, slots].view(*view.shape[:-1], -1, 1)
        full = group.numel // bucket
        parts = bucket_parts(view, bucket)
        pairs = [(parts[0], values[..., :full, :])]
        if len(parts) > 1:
            pairs.append((parts[1], values[..., full:, :]))
        return pairs, view

    def bucket_norms(self, x: Tensor) -> Tensor:
        """The scales of every bucket of the rows `x` `[R, n]`: `[R, num_norms]` fp32 (a
        workspace buffer), in the order of the wire's scale region."""
        c = self.compressor
        norms = self.ws.get("norms", (x.shape[0], self.num_norms), torch.float32, self.device)
        for group, slots in zip(self.table.groups, self.norm_slots, strict=True):
            view = self.table.view(x, group)
            found = [c.norms(part) for part in bucket_parts(view, c.bucket(group.numel))]
            norms.index_copy_(1, slots, torch.cat(found, -1).flatten(1))
        return norms

    def scale_buckets(self, x: Tensor, per_bucket: Tensor, op=Tensor.mul_) -> None:
        """`op(bucket, value)` in place on every bucket of the rows `x` `[R, n]` with its value
        from `per_bucket` `[R, num_norms]` (wire order), e.g. multiply by the bucket's scale."""
        for group, slots in zip(self.table.groups, self.norm_slots, strict=True):
            pairs, view = self._group_parts(x, group, slots, per_bucket)
            for part, s in pairs:
                op(part, s)
            if group.index is not None:  # a gathered copy: put it back
                self.table.put(x, group, view)

    def pack_codes(self, codes: Tensor, wire: Tensor) -> None:
        """Bit-pack the uint8 `codes` `[R, n]` into the code region of `wire` `[R, L]`."""
        packed = self.layout.region(wire, torch.uint8)
        for cols, span in self.spans:
            pack_rows(codes[:, cols], self.bits, packed[:, span], self.ws)

    def unpack_codes(self, wire: Tensor, out: Tensor) -> None:
        """The codes of wire rows `[R, L]` into the uint8 `out` `[R, n]`."""
        packed = self.layout.region(wire, torch.uint8)
        for cols, span in self.spans:
            out[:, cols] = unpack_rows(packed[:, span], self.bits, cols.stop - cols.start, self.ws)


class QuantizeCodec(ScaledCodec):
    """The codec of `QSGD` and its subclasses (the compressor supplies `levels`, `bits`,
    `bucket(d)` and `norms(parts)`). Payload per chunk: fp32 norms (one region for all chunks),
    then bit-packed levels (a second region)."""

    compressor: QSGD

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.levels = self.compressor.levels

    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        c = self.compressor
        norms = self.bucket_norms(x)
        scale = torch.where(norms > 0, self.levels * 65536.0 / norms, torch.zeros_like(norms))
        part = self.ws.get("part", tuple(x.shape), torch.float32, self.device)
        for row, worker in enumerate(workers):
            for ch in self.chunks:
                seed = rng.stream_seed(self.name, c.seed, worker, ch.key, step)
                rng.Int16Stream(seed, self.device).fill(part[row, ch.slice])
        # part = r' + 2¹⁶·v·s/ν with r' uniform on −2¹⁵…2¹⁵−1; then v·s/ν + u + s = part/2¹⁶ + c.
        for group, slots in zip(self.table.groups, self.norm_slots, strict=True):
            pairs, view = self._group_parts(part, group, slots, scale)
            xs = bucket_parts(self.table.view(x, group), c.bucket(group.numel))
            for (dither, s), v in zip(pairs, xs, strict=True):
                dither.addcmul_(v, s)
            if group.index is not None:  # a gathered copy: put it back
                self.table.put(part, group, view)
        offset = torch.tensor(self.levels + 32768.5 / 65536.0, device=self.device)
        torch.add(offset, part, alpha=1.0 / 65536.0, out=part)
        codes = self.ws.get("codes", tuple(x.shape), torch.uint8, self.device)
        # Truncation is the floor here (part ≥ 0); the clamp guards v·s/ν rounding above s.
        cast_into(codes, part).clamp_(max=2 * self.levels)
        self.pack_codes(codes, wire)
        self.layout.write_region(wire, torch.float32, norms)

    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        signed = self.ws.get("signed", (wire.shape[0], self.numel), torch.uint8, self.device)
        self.unpack_codes(wire, signed)
        # ξ = codes − s wraps modulo 256 in uint8, which read as int8 is the signed level.
        out.copy_(signed.sub_(self.levels).view(torch.int8))
        self.scale_buckets(out, self.layout.region(wire, torch.float32) / self.levels)
