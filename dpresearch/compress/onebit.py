"""1-bit SGD (Seide et al. 2014): one sign bit per entry and two reconstruction values per
column or per tensor."""

from __future__ import annotations

import torch
from torch import Tensor

from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.compress.sign import SignCodec
from dpresearch.compress.wire import Spec, packed_size

PER = ("tensor", "column")
SIGN_RULES = ("signbit", "less_than")


def segments(chunk: Chunk, per: str) -> tuple[int, int]:
    """(segments, column count c) of `chunk`: per="column" on a chunk that is one ≥ 2-D
    parameter viewed as `[shape[0], rest]` gives its c = rest columns (entry i·c + j belongs to
    column j); anything else is one segment (c = 1)."""
    if per == "column" and chunk.shape is not None and len(chunk.shape) >= 2 and chunk.numel:
        c = chunk.numel // chunk.shape[0]
        return c, c
    return 1, 1


def pick(mask: Tensor, low: Tensor, high: Tensor, out: Tensor) -> Tensor:
    """`out` = `low` where `mask` is all ones, `high` where it is zero: exactly one of the two,
    chosen on the bit patterns (integer tensors of the floats' width, broadcastable to `out`)
    as high ^ (mask & (low ^ high)) — no branch per entry (`torch.where` takes one on the CPU,
    several times slower on a sign pattern that changes at random). Returns `out`."""
    torch.bitwise_and(mask, low ^ high, out=out)
    return out.bitwise_xor_(high)


class OneBitCodec(SignCodec):
    """Sign bits packed as the sign codec packs them (one pass over the bucket), and per segment
    two fp32 values — the mean of its negative entries, the mean of the rest — from three sums
    per segment and row: of its entries, of its negative entries (each entry's bits masked by
    its sign bit: no branch per entry) and of the negative count (the masks, −1 each). Each is
    one torch sum over the segment's entries, for all rows and segments at once: per="tensor",
    one per group of equal-size chunks (`ChunkTable`; a chunk is a segment), per="column" one
    per chunk over its `[shape[0], rest]` view — sums along a row only, so a row's bytes never
    depend on the rows beside it. Decoding: per="tensor", each packed byte picks its 8 values
    from a 256 × 8 table per row and chunk (the negatives' mean where a bit is set, the others'
    elsewhere), as the scaled sign decodes; per="column", each entry picks from its column's
    pair by its decoded sign."""

    compressor: OneBit

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        per = self.compressor.per
        self.per_tensor = per == "tensor"
        parts, sizes, self.columns, first = [], [], [], 0
        for ch in self.chunks:
            count, c = segments(ch, per)
            parts.append(torch.arange(ch.numel) % c + first)
            sizes.append(torch.full((count,), ch.numel // count, dtype=torch.float32))
            self.columns.append((ch.slice, slice(first, first + count)))
            first += count
        self.num_segments = first
        empty = torch.zeros(0, dtype=torch.long)
        self.sizes = (torch.cat(sizes) if sizes else empty.float()).to(self.device)  # [S]
        self.segment = None  # per="column": each entry's segment, [n]
        if not self.per_tensor:
            self.segment = (torch.cat(parts) if parts else empty).to(self.device)
        self.bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[self.dtype.itemsize]
        # [256, 8] masks in the codec's float width: all ones where byte b's bit j is set (the
        # entry decodes to the negatives' mean), else zero
        table = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        self._low = table.neg().to(self.bits).to(self.device)

    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        if self.compressor.sign_rule == "less_than":  # x < 0: −0.0 (and NaN) with the others
            x = torch.where(x < 0, x, x.abs())
        self._pack_signs(x, wire)
        rows, shape = x.shape[0], tuple(x.shape)
        values = x.to(torch.float32)
        bits = values.view(torch.int32)
        mask = self.ws.get("mask", shape, torch.int32, self.device)
        torch.bitwise_right_shift(bits, 31, out=mask)  # −1 where the sign bit is set, else 0
        below = self.ws.get("below", shape, torch.int32, self.device)
        torch.bitwise_and(bits, mask, out=below)  # the negative entries, +0.0 elsewhere
        sums = self.ws.get("sums", (2, rows, self.num_segments), torch.float32, self.device)
        total, below_sum = self._segment_sums(values, sums[0]), self._segment_sums(below, sums[1])
        counts = self.ws.get("counts", (rows, self.num_segments), torch.int32, self.device)
        count = self._segment_sums(mask, counts).neg().to(torch.float32)
        means = torch.stack(
            [below_sum / count.clamp(min=1.0),
             (total - below_sum) / (self.sizes - count).clamp(min=1.0)],
            dim=-1,
        )  # [R, S, 2]: (negatives' mean, the others' mean) per segment  # fmt: skip
        self.layout.write_region(wire, torch.float32, means.view(rows, 2 * self.num_segments))

    def _segment_sums(self, values: Tensor, out: Tensor) -> Tensor:
        """`out` `[R, S]` = the sum of each segment of `values` `[R, n]` (int32 `values` are
        read as the float32 their bits hold when `out` is float32); returns `out`."""
        if values.dtype != out.dtype:
            values = values.view(out.dtype)
        if self.per_tensor:
            for group, members in zip(self.table.groups, self.members, strict=True):
                part = self.table.view(values, group).sum(-1, dtype=out.dtype)
                out.index_copy_(1, members, part)
            return out
        for cols, segs in self.columns:
            part = values[:, cols].unflatten(-1, (-1, segs.stop - segs.start))
            out[:, segs] = part.sum(-2, dtype=out.dtype)
        return out

    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        rows, bits = wire.shape[0], self.bits
        means = self.layout.region(wire, torch.float32).view(rows, -1, 2).to(self.dtype)
        low, high = means[..., 0], means[..., 1]  # [R, S] each
        if self.per_tensor:
            shape = (rows, self.num_segments, 256, 8)
            tables = self.ws.get("tables", shape, self.dtype, self.device)
            low, high = (m.view(bits).view(*shape[:2], 1, 1) for m in (low, high))
            pick(self._low, low, high, tables.view(bits))
            self._unpack_signs(wire, out, tables)
            return
        signs = self.ws.get("signs", tuple(out.shape), self.dtype, self.device)
        self._unpack_signs(wire, signs)
        mask = signs.view(bits).bitwise_right_shift_(8 * self.dtype.itemsize - 1)  # ±1 → −1, 0
        low = low.index_select(1, self.segment).view(bits)
        high = high.index_select(1, self.segment).view(bits)
        pick(mask, low, high, out.view(bits))


class OneBit(SingleRoundCompressor):
    """1-bit SGD (Seide et al. 2014; GRACE's `onebit`): each entry sends whether it is negative
    (its sign bit; −0.0 counts as negative, 0 as positive: `sign_rule`), and each segment sends
    two fp32 reconstruction values, the mean of its negative entries and the mean of its other
    entries.
    For the sign pattern sent these are the values that minimize the squared reconstruction
    error (a group's best constant in least squares is its mean); a group with no entry sends 0.

    per: "tensor" — one segment per chunk (GRACE); "column" — a chunk that is one ≥ 2-D parameter
    is viewed as `[shape[0], rest]` and each of its `rest` columns is a segment (the paper's
    column-wise quantization of a weight matrix), other chunks one segment.

    sign_rule: which entries are "negative". "signbit" (default): the sign bit is set, so −0.0
    is negative. "less_than": x < 0, so −0.0 (and a NaN) goes with the others — the rule of
    GRACE's `onebit` (`mask0 = tensor < 0`) and of CNTK's 1-bit SGD by Seide et al. (its
    zero-threshold quantizer sends `u >= 0` as the upper bit). They differ only where an entry
    is −0.0 (or NaN): which group's mean it is decoded to, and which group's count it adds to.

    Non-linear (per-worker values): gathered, decoded, averaged. Pair it with error feedback
    (error_feedback=ef14): the paper carries each worker's quantization error into its next
    gradient ("error feedback"), which is what makes 1 bit per value train.

    Wire bytes per chunk of d entries in S segments: ⌈d/8⌉ + 8·S.
    """

    codec_class = OneBitCodec

    def __init__(self, per: str = "tensor", seed: int = 0, sign_rule: str = "signbit") -> None:
        super().__init__(seed)
        if per not in PER:
            raise ValueError(f"per={per}; choose one of: {', '.join(PER)}")
        if sign_rule not in SIGN_RULES:
            raise ValueError(f"sign_rule={sign_rule}; choose one of: {', '.join(SIGN_RULES)}")
        self.per, self.sign_rule = per, sign_rule

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        count, _ = segments(chunk, self.per)
        return [(torch.float32, 2 * count), (torch.uint8, packed_size(chunk.numel, 1))]
