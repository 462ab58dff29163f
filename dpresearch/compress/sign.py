"""Sign compressors: scaled sign (EF-signSGD) and majority vote (signSGD / Signum)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.compress.codec import Codec
from dpresearch.compress.kernels import BLOCK, numpy_path
from dpresearch.compress.wire import Spec, pack_rows, packed_size


class SignCodec(Codec):
    """Sign bits of the whole bucket packed in a few passes (one `pack_rows` per run of chunks
    whose sizes fill whole bytes: all of them in the usual layouts), for all rows at once; the
    scaled sign adds one fp32 scale per chunk, ‖x‖₁/d, summed per group of equal-size chunks."""

    scaled = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.runs = self.table.runs(1)
        self.spans = self._spans()
        numels = [float(ch.numel) for ch in self.chunks]
        self.numels = torch.tensor(numels, dtype=torch.float32, device=self.device)
        self.members = [torch.tensor(g.members, device=self.device) for g in self.table.groups]
        # row b of the table: the ±1 of the 8 signs packed in byte value b (bit j = entry j)
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        self._table = (1 - 2 * bits).to(self.dtype).to(self.device)

    def _spans(self) -> list[tuple[slice, slice]]:
        """Per run of chunks [first, last): (its columns of a row, its bytes of the packed-sign
        region)."""
        spans = []
        for first, last in self.runs:
            head, tail = self.chunks[first], self.chunks[last - 1]
            start, end = self.layout.slots[first][-1][1], self.layout.slots[last - 1][-1][1]
            cols = slice(head.offset, tail.offset + tail.numel)
            spans.append((cols, slice(start, end + packed_size(tail.numel, 1))))
        return spans

    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        self._pack_signs(x, wire)
        if self.scaled:
            self.layout.write_region(wire, torch.float32, self._l1(x).div_(self.numels))

    def _pack_signs(self, x: Tensor, wire: Tensor) -> Tensor:
        """Pack the sign bits of `x` `[R, n]` (1 = negative, −0.0 included) into the packed-bit
        region of `wire`; returns the negative mask `[R, n]` (a workspace buffer, valid until
        the next call)."""
        bits = self.layout.region(wire, torch.uint8)
        negative = self.ws.get("negative", tuple(x.shape), torch.bool, self.device)
        if numpy_path(x):
            np.signbit(x.numpy(), out=negative.numpy())
        else:
            torch.signbit(x, out=negative)
        for cols, span in self.spans:
            pack_rows(negative[:, cols], 1, bits[:, span], self.ws)
        return negative

    def _l1(self, x: Tensor) -> Tensor:
        """‖x‖₁ of every chunk of every row, `[R, C]` fp32: one |x| pass, then a sum per group
        (chunks over `BLOCK` entries: fp32 block sums accumulated in fp64)."""
        magnitude = self.ws.get("abs", tuple(x.shape), x.dtype, self.device)
        torch.abs(x, out=magnitude)
        l1 = self.ws.get("l1", (x.shape[0], len(self.chunks)), torch.float32, self.device)
        for group, members in zip(self.table.groups, self.members, strict=True):
            view = self.table.view(magnitude, group)
            if group.numel <= BLOCK:
                sums = view.sum(-1, dtype=torch.float32)
            else:
                total = torch.zeros(view.shape[:-1], dtype=torch.float64, device=self.device)
                for start in range(0, group.numel, BLOCK):
                    total += view[..., start : start + BLOCK].sum(-1, dtype=torch.float32)
                sums = total.to(torch.float32)
            l1.index_copy_(1, members, sums)
        return l1

    def _signs(self, wire: Tensor) -> Tensor:
        """±1 for each entry of wire rows `[R, L]`, `[R, n]` in the codec's dtype: every packed
        byte looked up in a 256 × 8 table (one gather, no unpacked bits in between)."""
        packed = self.layout.region(wire, torch.uint8)
        rows = wire.shape[0]
        if len(self.spans) == 1:  # the usual case: one stream for the whole row
            cols, span = self.spans[0]
            codes = packed[:, span].reshape(-1).long()
            signs = self.ws.get("signs", (rows, codes.numel() // rows * 8), self.dtype, self.device)
            torch.index_select(self._table, 0, codes, out=signs.view(-1, 8))
            return signs[:, : cols.stop - cols.start]
        signs = self.ws.get("signs", (rows, self.numel), self.dtype, self.device)
        for cols, span in self.spans:
            codes = packed[:, span].reshape(-1).long()
            looked_up = self._table.index_select(0, codes).view(rows, -1)
            signs[:, cols].copy_(looked_up[:, : cols.stop - cols.start])
        return signs

    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        signs = self._signs(wire)
        if not self.scaled:
            out.copy_(signs)
            return
        scale = self.layout.region(wire, torch.float32)  # [R, C]
        for group, members in zip(self.table.groups, self.members, strict=True):
            m = scale[:, members].unsqueeze(-1)  # [R, G, 1]
            if group.index is None:
                torch.mul(self.table.view(signs, group), m, out=self.table.view(out, group))
            else:
                self.table.put(out, group, self.table.view(signs, group) * m)


class ScaledSignCodec(SignCodec):
    scaled = True


class ScaledSign(SingleRoundCompressor):
    """C(x) = (‖x‖₁/d)·sign(x) (Karimireddy et al. 2019, EF-signSGD; zero counts as positive),
    one scale per chunk. Non-linear (per-worker scale): gathered, decoded, averaged. Use it
    with error feedback.

    Wire bytes per chunk of d entries: ⌈d/8⌉ + 4 — one fp32 scale, the signs packed 8 per byte.
    """

    codec_class = ScaledSignCodec

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return [(torch.float32, 1), (torch.uint8, packed_size(chunk.numel, 1))]


class MajorityVote(SingleRoundCompressor):
    """signSGD with majority vote (Bernstein et al. 2018); with local momentum before the
    compressor (`error_feedback.momentum`) this is Signum.

    Each worker sends only sign(x) (zero counts as positive). Aggregation is non-linear: the
    packed signs are gathered, every receiver decodes the K sign vectors, sums them (the vote
    count, an integer in [−K, K], exact in fp32), and `finalize` takes the sign of the sum, so
    the aggregate is ±1 per coordinate, or 0 on a tie (even K). Every worker computes the same
    vote locally — the allgather replaces the paper's parameter server, which would send the
    1-bit vote back. The aggregate has unit magnitude: pair it with a small learning rate.

    Wire bytes per chunk of d entries: ⌈d/8⌉ (signs packed 8 per byte).

    Not a gossip codec: its aggregate is a vote, not a weighted sum of decoded messages; and no
    error feedback (unscaled signs would make the memory accumulate p − sign(p)).
    """

    gossip = False
    memories = ("none",)
    memories_note = (
        "unscaled signs would make the memory accumulate p - sign(p) (Signum: "
        "error_feedback.momentum=0.9; EF-signSGD: compressor=sign)"
    )
    codec_class = SignCodec

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return [(torch.uint8, packed_size(chunk.numel, 1))]

    def finalize(self, total: Tensor, count: int) -> None:
        total.sign_()
