"""Identity and 16-bit casts: linear payloads summed by allreduce."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.compress.codec import Codec
from dpresearch.compress.wire import Spec


class CastCodec(Codec):
    """The whole bucket converted to the wire dtype in one copy (chunks are laid out in order,
    so the wire row is the cast row); decoding converts back."""

    compressor: Identity | Cast

    @property
    def wire_dtype(self) -> torch.dtype:
        return self.compressor.wire_dtype_for(self.dtype)

    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        if self.linear:
            wire.copy_(x)
            return
        cast = self.ws.get("cast", tuple(x.shape), self.wire_dtype, self.device)
        cast.copy_(x)
        self.layout.write_region(wire, self.wire_dtype, cast)

    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        out.copy_(self.layout.region(wire, self.wire_dtype))

    def accumulate(
        self, rows: Tensor, step: int, out: Tensor, weights: Tensor | None = None
    ) -> None:
        values = self.layout.region(rows, self.wire_dtype)
        term = self.ws.get("term", tuple(out.shape), out.dtype, self.device)
        for r in range(rows.shape[1]):
            if weights is None:
                out.add_(values[:, r])
            else:
                torch.mul(values[:, r], weights[:, r : r + 1], out=term)
                out.add_(term)


class Identity(SingleRoundCompressor):
    """No compression: the gradient itself. Linear.

    Wire bytes per chunk of d elements: d·s, s the gradient's element size (4·d for fp32).
    """

    linear = True
    codec_class = CastCodec

    def wire_dtype_for(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return [(dtype, chunk.numel)]


class Cast(SingleRoundCompressor):
    """Cast to a narrower float type for the wire and back. Linear: the allreduce sums in the
    wire type, so the sum of K workers is rounded to it (fp16 overflows above 65504).

    Wire bytes per chunk of d elements: 2·d for fp16 and bf16.
    """

    linear = True
    codec_class = CastCodec
    wire_dtype: ClassVar[torch.dtype] = torch.float16

    def wire_dtype_for(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return [(self.wire_dtype, chunk.numel)]


class FP16(Cast):
    """IEEE half precision on the wire: 2·d bytes."""

    wire_dtype = torch.float16


class BF16(Cast):
    """bfloat16 on the wire (fp32's range, 8-bit mantissa): 2·d bytes."""

    wire_dtype = torch.bfloat16
