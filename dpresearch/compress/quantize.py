"""Unbiased stochastic quantization to 2s+1 signed levels, shared by QSGD and TernGrad.

Each bucket of B entries has a norm ν (fp32). An entry v becomes the integer level
ξ = ⌊v·s/ν + u⌋ ∈ [−s, s] with a dither u uniform in [0, 1), and decodes to ξ·ν/s. Rounding a
signed value with a dither is exactly QSGD's rule — |v|·s/ν rounded up with probability equal
to its fractional part, sign restored — because stochastic rounding commutes with negation.

Levels travel as ξ + s in ⌈log₂(2s+1)⌉ bits (`wire.pack_bits`). The dither has 16 random bits
(u = (r + ½)/2¹⁶, r uniform on 0…2¹⁶−1), so the probability of rounding up is the fractional
part rounded to a multiple of 2⁻¹⁶: the quantizer is unbiased to within 2⁻¹⁷ of one level
step, far below fp32's own rounding of v·s/ν at large s. (16 bits instead of a 24-bit float
draw make the random stream four times cheaper on the CPU.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from dpresearch.compress import rng
from dpresearch.compress.kernels import BLOCK, cast_into
from dpresearch.compress.workspace import scratch

MAX_LEVELS = 127  # ξ + s must fit in one byte


def level_bits(levels: int) -> int:
    """⌈log₂(2s+1)⌉: bits per entry for 2s+1 signed levels."""
    return (2 * levels).bit_length()


def bucket_views(x: Tensor, bucket: int, start: int = 0) -> list[tuple[Tensor, slice]]:
    """The 1-D `x`, which begins at entry `start` of its chunk, cut at bucket boundaries into
    2-D views (no copies): a partial first bucket, [full buckets, B], a partial last bucket;
    each with the slice of per-bucket norms it uses."""
    d, pos, index = x.numel(), 0, start // bucket
    parts = []
    head = min((-start) % bucket, d)
    if head:
        parts.append((x[:head].view(1, -1), slice(index, index + 1)))
        pos, index = head, index + 1
    full = (d - pos) // bucket
    if full:
        parts.append((x[pos : pos + full * bucket].view(full, bucket), slice(index, index + full)))
        pos, index = pos + full * bucket, index + full
    if pos < d:
        parts.append((x[pos:].view(1, -1), slice(index, index + 1)))
    return parts


def bucket_norms(x: Tensor, bucket: int, ord: float = 2.0) -> Tensor:
    """fp32 norm of each bucket of `x`: ⌈d/B⌉ values."""
    views = bucket_views(x, bucket)
    norms = [torch.linalg.vector_norm(v, ord, dim=1, dtype=torch.float32) for v, _ in views]
    return torch.cat(norms)


def quantize(x: Tensor, norms: Tensor, levels: int, bucket: int, seed: int) -> Tensor:
    """Levels ξ + s ∈ [0, 2s] of `x` (uint8, one per entry), given each bucket's norm; a view
    of a scratch buffer, to be packed before the next call.

    Works block by block (`kernels.BLOCK` entries) so that the fp32 temporary stays in cache."""
    d = x.numel()
    scale = torch.where(norms > 0, levels * 65536.0 / norms, torch.zeros_like(norms))
    offset = torch.tensor(levels + 32768.5 / 65536.0, device=x.device)
    dither = rng.Int16Stream(seed, x.device)
    codes = scratch("quantize.codes", d, torch.uint8, x.device)
    y = scratch("quantize.y", min(BLOCK, d), torch.float32, x.device)
    for start in range(0, d, BLOCK):
        size = min(BLOCK, d - start)
        part = dither.fill(y[:size])
        # part = r' + 2¹⁶·v·s/ν with r' uniform on −2¹⁵…2¹⁵−1; then v·s/ν + u + s = part/2¹⁶ + c.
        pairs = zip(
            bucket_views(x[start : start + size], bucket, start),
            bucket_views(part, bucket, start),
            strict=True,
        )
        for (view, rows), (part_view, _) in pairs:
            part_view.addcmul_(view, scale[rows].unsqueeze(1))
        torch.add(offset, part, alpha=1.0 / 65536.0, out=part)
        # Truncation is the floor here (part ≥ 0); the clamp guards v·s/ν rounding above s.
        cast_into(codes[start : start + size], part)
    return codes.clamp_(max=2 * levels)


def dequantize(codes: Tensor, norms: Tensor, levels: int, bucket: int, out: Tensor) -> None:
    """`out` = (codes − s)·ν/s per bucket, block by block (the scaling pass hits the cache)."""
    step = norms / levels
    d = codes.numel()
    signed = scratch("dequantize.signed", min(BLOCK, d), torch.uint8, codes.device)
    for start in range(0, d, BLOCK):
        size = min(BLOCK, d - start)
        part = out[start : start + size]
        # ξ = codes − s wraps modulo 256 in uint8, which read as int8 is the signed level.
        torch.sub(codes[start : start + size], levels, out=signed[:size])
        part.copy_(signed[:size].view(torch.int8))
        for view, rows in bucket_views(part, bucket, start):
            view.mul_(step[rows].unsqueeze(1))
