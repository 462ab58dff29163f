"""FP4: 4-bit floating-point codes with one fp32 scale per bucket — the outer-gradient format of
Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512).

A code is a 4-bit float: a sign bit above a 3-bit magnitude index m, m = 0…7 an index into the
format's eight non-negative values, in increasing order (so m is the format's own exponent |
mantissa bit field, and the code its bit pattern):

- `e3m0`: 1 sign, 3 exponent bits (bias 3), no mantissa: exponent 0 is zero, exponent e ≥ 1 is
  2^(e−3) — magnitudes {0, ¼, ½, 1, 2, 4, 8, 16};
- `e2m1` (OCP MX FP4): 1 sign, 2 exponent bits (bias 1), 1 mantissa bit, exponent 0 subnormal
  — magnitudes {0, ½, 1, 1½, 2, 3, 4, 6}.

Neither has an infinity or a NaN: every code is finite.

Each bucket of a chunk is sent with its scale s = max|v| / top (fp32; top the format's largest
magnitude, so the bucket's largest entry lands on the top code), and an entry v becomes the
magnitude nearest |v|/s (`rounding=nearest`; a tie goes to the larger magnitude) or one of the
two magnitudes around |v|/s, the upper one with probability equal to the distance from the
lower one over the gap (`rounding=stochastic`: unbiased; one 16-bit draw per entry from the
worker's stream for (method, seed, worker, chunk key, step), as QSGD's dither). |v|/s and the
fraction are computed in fp32. Decoding is sign·magnitude·s in the output dtype.

The bucket plan (scales region, packing runs) is `quantize.ScaledCodec`'s.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import Tensor

from dpresearch.compress import rng
from dpresearch.compress.quantize import BucketQuantizer, ScaledCodec, absmax

# the eight magnitudes of each format, by magnitude index (read-only)
FORMATS = MappingProxyType(
    {
        "e3m0": (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0),
        "e2m1": (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    }
)
FORMAT_NOTES = MappingProxyType(
    {
        "e3m0": "sign + 3 exponent bits, Streaming DiLoCo's",
        "e2m1": "sign + 2 exponent bits + 1 mantissa bit, OCP MX FP4",
    }
)
ROUNDINGS = ("nearest", "stochastic")
SIGN = 8  # the sign bit of a 4-bit code


class FP4Codec(ScaledCodec):
    """The codec of `FP4`: all rows and chunks in a few passes — the scales per group of
    equal-size chunks, |v|/s per bucket, the magnitude index by one `bucketize` against the
    midpoints (or the grid, for stochastic rounding), one `pack_rows` per run of chunks."""

    compressor: FP4

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        grid = torch.tensor(self.compressor.magnitudes, dtype=torch.float32)
        self.grid = grid.to(self.device)
        self.midpoints = ((grid[1:] + grid[:-1]) / 2).to(self.device)  # exact: dyadic values
        # the gap above each magnitude; ∞ above the top one, so nothing rounds past it
        self.gaps = torch.cat([grid[1:] - grid[:-1], torch.tensor([torch.inf])]).to(self.device)
        self.values = torch.cat([grid, -grid]).to(self.device, self.dtype)  # code → value

    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        c = self.compressor
        scales = self.bucket_norms(x)
        y = self.ws.get("y", tuple(x.shape), torch.float32, self.device)
        torch.abs(x, out=y)
        # An all-zero bucket has scale 0: divide it by 1 instead (its entries stay 0).
        self.scale_buckets(y, torch.where(scales > 0, scales, 1.0), Tensor.div_)
        if c.rounding == "nearest":
            index = torch.bucketize(y, self.midpoints, right=True, out_int32=True)
        else:
            # lower neighbour: the number of non-zero magnitudes ≤ |v|/s (0 is always ≤ it)
            index = torch.bucketize(y, self.grid[1:], right=True, out_int32=True)
            fraction = y.sub_(self.grid[index]).div_(self.gaps[index])
            u = self.ws.get("u", tuple(x.shape), torch.float32, self.device)
            for row, worker in enumerate(workers):
                for ch in self.chunks:
                    seed = rng.stream_seed(self.name, c.seed, worker, ch.key, step)
                    rng.Int16Stream(seed, self.device).fill(u[row, ch.slice])
            # u = (r + 2¹⁵ + ½)/2¹⁶ ∈ (0, 1) for r uniform on −2¹⁵…2¹⁵−1: up with P = fraction
            u.add_(32768.5).div_(65536.0)
            index += u < fraction
        codes = self.ws.get("codes", tuple(x.shape), torch.uint8, self.device)
        codes.copy_(index)
        codes.add_((x < 0).to(torch.uint8), alpha=SIGN)
        self.pack_codes(codes, wire)
        self.layout.write_region(wire, torch.float32, scales)

    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        codes = self.ws.get("codes.decode", (wire.shape[0], self.numel), torch.uint8, self.device)
        self.unpack_codes(wire, codes)
        out.copy_(torch.take(self.values, codes.long()))
        self.scale_buckets(out, self.layout.region(wire, torch.float32))


class FP4(BucketQuantizer):
    """Every entry as a 4-bit float (`format`: `e3m0` | `e2m1`, see the module docstring) times
    its bucket's fp32 scale s = max|v|/top, with `bucket_size` entries per bucket (null: one
    scale per chunk — per tensor with `granularity=tensor`). `rounding=nearest` (a cast;
    biased: pair it with error feedback where that matters) or `stochastic` (unbiased).
    Non-linear (per-worker scales): gathered, decoded, averaged; the mean is formed in the
    rows' dtype (fp32), as Streaming DiLoCo accumulates its FP4 outer gradients in fp32.

    Wire bytes per chunk of d entries: 4·⌈d/B⌉ + ⌈d/2⌉ — the fp32 scales, then 4 bits per entry.
    """

    codec_class = FP4Codec

    def __init__(
        self,
        format: str = "e3m0",
        rounding: str = "nearest",
        bucket_size: int | None = None,
        seed: int = 0,
    ) -> None:
        if format not in FORMATS:
            choices = ", ".join(f"{name} ({note})" for name, note in FORMAT_NOTES.items())
            raise ValueError(f"format={format}; choose one of: {choices}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding={rounding}; choose one of: {', '.join(ROUNDINGS)}")
        super().__init__(4, bucket_size, seed)
        self.format, self.rounding = format, rounding
        self.magnitudes = FORMATS[format]

    def norms(self, buckets: Tensor) -> Tensor:
        """The scale of each bucket, max|v|/top, fp32."""
        return absmax(buckets).div_(self.magnitudes[-1])
