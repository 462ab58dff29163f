"""TernGrad: ternary gradients (Wen et al. 2017)."""

from __future__ import annotations

from torch import Tensor

from dpresearch.compress.qsgd import QSGD
from dpresearch.compress.quantize import absmax


class TernGrad(QSGD):
    """g̃_i = s_t·sign(g_i)·b_i with s_t = ‖g‖_∞ of the chunk and b_i ~ Bernoulli(|g_i|/s_t):
    QSGD's quantizer with one level (s = 1) and the max-norm, one scale per chunk. Unbiased.
    Non-linear (per-worker scale): gathered. The paper's optional gradient clipping is not
    applied (it would bias the operator).

    Wire bytes per chunk of d entries: ⌈d/4⌉ + 4 — 2-bit levels {−1, 0, 1}, one fp32 scale.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__(levels=1, bucket_size=None, seed=seed)

    def norms(self, buckets: Tensor) -> Tensor:
        return absmax(buckets)
