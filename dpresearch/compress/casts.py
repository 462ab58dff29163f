"""Identity and 16-bit casts: linear payloads summed by allreduce."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.compress.wire import Spec


class Identity(SingleRoundCompressor):
    """No compression: the gradient itself. Linear.

    Wire bytes per chunk of d elements: d·s, s the gradient's element size (4·d for fp32).
    """

    linear = True

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return [(dtype, chunk.numel)]

    def compress(self, x: Tensor, chunk: Chunk, step: int) -> list[Tensor]:
        return [x]

    def decompress(self, payload: Sequence[Tensor], chunk: Chunk, step: int, out: Tensor) -> None:
        out.copy_(payload[0])


class Cast(SingleRoundCompressor):
    """Cast to a narrower float type for the wire and back. Linear: the allreduce sums in the
    wire type, so the sum of K workers is rounded to it (fp16 overflows above 65504).

    Wire bytes per chunk of d elements: 2·d for fp16 and bf16.
    """

    linear = True
    wire_dtype: torch.dtype = torch.float16

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return [(self.wire_dtype, chunk.numel)]

    def compress(self, x: Tensor, chunk: Chunk, step: int) -> list[Tensor]:
        return [x.to(self.wire_dtype)]

    def decompress(self, payload: Sequence[Tensor], chunk: Chunk, step: int, out: Tensor) -> None:
        out.copy_(payload[0])


class FP16(Cast):
    """IEEE half precision on the wire: 2·d bytes."""

    wire_dtype = torch.float16


class BF16(Cast):
    """bfloat16 on the wire (fp32's range, 8-bit mantissa): 2·d bytes."""

    wire_dtype = torch.bfloat16
