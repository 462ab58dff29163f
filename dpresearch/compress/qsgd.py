"""QSGD: unbiased stochastic quantization (Alistarh et al. 2017)."""

from __future__ import annotations

import torch
from torch import Tensor

from dpresearch.compress.quantize import MAX_LEVELS, BucketQuantizer, QuantizeCodec, level_bits


class QSGD(BucketQuantizer):
    """Q_s(v)_i = ‖v‖₂·sign(v_i)·ξ_i/s per bucket of `bucket_size` entries of a chunk (null: one
    bucket per chunk), ξ_i the stochastic rounding of s·|v_i|/‖v‖₂ (see `quantize.py`).
    Unbiased, with E‖Q_s(v) − v‖² ≤ min(d/s², √d/s)·‖v‖² per bucket of d entries (Lemma 3.1).
    Non-linear (per-worker norms): gathered.

    Wire bytes per chunk of d entries with b = ⌈log₂(2s+1)⌉ bits per level (sign included):
    4·⌈d/B⌉ + ⌈d·b/8⌉ — the fp32 bucket norms, then the bit-packed levels.
    """

    codec_class = QuantizeCodec

    def __init__(self, levels: int = 7, bucket_size: int | None = 512, seed: int = 0) -> None:
        if not 1 <= levels <= MAX_LEVELS:
            raise ValueError(f"levels={levels}: must be in 1..{MAX_LEVELS} (at most 8 bits)")
        super().__init__(level_bits(levels), bucket_size, seed)
        self.levels = levels

    def norms(self, buckets: Tensor) -> Tensor:
        """The norm of each bucket as the wire carries it, fp32: `[..., B]` → `[...]` (the scale
        each level is a fraction of); accumulated in fp32, or fp64 for fp64 rows."""
        accumulate = torch.promote_types(buckets.dtype, torch.float32)
        return torch.linalg.vector_norm(buckets, 2, dim=-1, dtype=accumulate).float()
