"""Sign compressors: scaled sign (EF-signSGD) and majority vote (signSGD / Signum)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.compress.kernels import BLOCK, numpy_path
from dpresearch.compress.wire import Spec, packed_size, sign_bits, unpack_bits
from dpresearch.compress.workspace import scratch


def _signs(packed: Tensor, numel: int, magnitude: float, out: Tensor) -> None:
    """`out` = ±magnitude from packed sign bits (bit 1 = negative), block by block so that the
    second pass over each block of `out` hits the cache."""
    base = torch.tensor(magnitude, dtype=out.dtype, device=out.device)
    block = BLOCK if numpy_path(out) else max(numel, 1)
    for start in range(0, numel, block):
        size = min(block, numel - start)
        part = out[start : start + size]
        part.copy_(unpack_bits(packed[start // 8 : (start + size + 7) // 8], 1, size))
        torch.add(base, part, alpha=-2 * magnitude, out=part)  # m − 2m·bit


def _l1_and_signs(x: Tensor) -> tuple[Tensor, Tensor]:
    """(‖x‖₁ as fp32, packed sign bits). On the CPU both are computed block by block, so x is
    read from memory once and the |x| temporary stays in cache."""
    if not numpy_path(x):
        return torch.linalg.vector_norm(x, 1, dtype=torch.float32), sign_bits(x)
    numel = x.numel()
    packed = np.empty(packed_size(numel, 1), dtype=np.uint8)
    magnitude = scratch("sign.abs", min(BLOCK, numel), x.dtype, x.device)
    total = 0.0  # fp32 block sums, accumulated in fp64 (a fp64 torch reduction is 2x slower)
    for start in range(0, numel, BLOCK):  # BLOCK is a multiple of 8: blocks pack independently
        block = x[start : start + BLOCK]
        total += float(torch.abs(block, out=magnitude[: block.numel()]).sum())
        bits = np.packbits(np.signbit(block.numpy()), bitorder="little")
        packed[start // 8 : start // 8 + bits.size] = bits
    return torch.tensor(total, dtype=torch.float32), torch.from_numpy(packed)


class ScaledSign(SingleRoundCompressor):
    """C(x) = (‖x‖₁/d)·sign(x) (Karimireddy et al. 2019, EF-signSGD; zero counts as positive).
    Non-linear (per-worker scale): gathered, decoded, averaged. Use it with error feedback.

    Wire bytes per chunk of d entries: ⌈d/8⌉ + 4 — one fp32 scale, then the signs packed
    8 per byte.
    """

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return [(torch.float32, 1), (torch.uint8, packed_size(chunk.numel, 1))]

    def compress(self, x: Tensor, chunk: Chunk, step: int) -> list[Tensor]:
        l1, packed = _l1_and_signs(x)
        return [(l1 / x.numel()).reshape(1), packed]

    def decompress(self, payload: Sequence[Tensor], chunk: Chunk, step: int, out: Tensor) -> None:
        scale, packed = payload
        _signs(packed, chunk.numel, float(scale[0]), out)


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

    Not a gossip codec: its aggregate is a vote, not a weighted sum of decoded messages.
    """

    gossip = False

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return [(torch.uint8, packed_size(chunk.numel, 1))]

    def compress(self, x: Tensor, chunk: Chunk, step: int) -> list[Tensor]:
        return [sign_bits(x)]

    def decompress(self, payload: Sequence[Tensor], chunk: Chunk, step: int, out: Tensor) -> None:
        _signs(payload[0], chunk.numel, 1.0, out)

    def finalize(self, total: Tensor, count: int) -> None:
        total.sign_()
