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


class OneBitCodec(SignCodec):
    """Sign bits packed as the sign codec packs them (one pass over the bucket), and per segment
    two fp32 values — the mean of its negative entries, the mean of the rest — found for all
    rows and segments at once by three scatter-adds over a per-entry segment index (each row
    summed in entry order, so a row's bytes never depend on the rows beside it); decoding picks
    one of its segment's two values per entry by its sign."""

    compressor: OneBit

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        per = self.compressor.per
        parts, sizes, first = [], [], 0
        for ch in self.chunks:
            count, c = segments(ch, per)
            parts.append(torch.arange(ch.numel) % c + first)
            sizes.append(torch.full((count,), ch.numel // count, dtype=torch.float32))
            first += count
        self.num_segments = first
        empty = torch.zeros(0, dtype=torch.long)
        self.segment = (torch.cat(parts) if parts else empty).to(self.device)  # [n]
        self.sizes = (torch.cat(sizes) if sizes else empty.float()).to(self.device)  # [S]

    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        if self.compressor.sign_rule == "less_than":  # x < 0: −0.0 (and NaN) with the others
            x = torch.where(x < 0, x, x.abs())
        self._pack_signs(x, wire)
        negative = self.ws.get("signbit", tuple(x.shape), torch.bool, self.device)
        torch.signbit(x, out=negative)
        rows, s = x.shape[0], self.num_segments
        index = self.segment.expand(rows, -1)
        values = x.to(torch.float32)
        total = torch.zeros(rows, s, device=self.device).scatter_add_(1, index, values)
        below = torch.zeros(rows, s, device=self.device).scatter_add_(
            1, index, values.masked_fill(~negative, 0.0)
        )
        count = torch.zeros(rows, s, device=self.device).scatter_add_(
            1, index, negative.to(torch.float32)
        )
        means = torch.stack(
            [below / count.clamp(min=1.0), (total - below) / (self.sizes - count).clamp(min=1.0)],
            dim=-1,
        )  # [R, S, 2]: (negatives' mean, the others' mean) per segment
        self.layout.write_region(wire, torch.float32, means.view(rows, 2 * s))

    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        signs = self.ws.get("signs", tuple(out.shape), self.dtype, self.device)
        self._unpack_signs(wire, signs)
        means = self.layout.region(wire, torch.float32).view(wire.shape[0], -1, 2).to(out.dtype)
        low = means[..., 0].index_select(1, self.segment)
        high = means[..., 1].index_select(1, self.segment)
        torch.where(signs < 0, low, high, out=out)


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
