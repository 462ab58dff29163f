"""Top-k sparsification (Aji & Heafield 2017; Lin et al. 2018, "Deep Gradient Compression")."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from dpresearch.compress import rng
from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.compress.kernels import entries_at_least
from dpresearch.compress.wire import Spec
from dpresearch.compress.workspace import scratch

SELECTIONS = ("exact", "sampled")


def kept(numel: int, ratio: float) -> int:
    """k = max(1, round(ratio·d)), at most d."""
    return min(numel, max(1, round(ratio * numel)))


class TopK(SingleRoundCompressor):
    """Keep the k = max(1, round(ratio·d)) entries of largest magnitude. Non-linear: each worker
    picks its own indices, so payloads are gathered and every receiver scatters all of them.

    Wire bytes per chunk of d fp32 elements: k·(4 + 4) — k values, then k int32 indices.
    Always exactly k entries, so rows need no header.

    selection:
    - "exact": `torch.topk` over |x| (≈ 40–100 memory passes on a large CPU vector).
    - "sampled": DGC's threshold estimate. Draw `sample_size` random entries (the worker's
      own stream), take the ⌈margin·k·sample_size/d⌉-th largest of their |x| as threshold
      (margin > 1 aims below the true k-th largest), keep the candidates |x| ≥ threshold,
      then truncate to exactly k with `torch.topk` over the candidates only. When the
      candidates number at least k they contain the true top k, so the result equals exact
      selection (up to ties); when the sample overshot and fewer than k qualify (rare, ≈4.5σ
      with the defaults) it falls back to exact selection rather than padding, so the payload
      always holds the k largest entries. Cost on the CPU for d = 11M, k = 1%: ≈ 5 memory
      passes (exact: ≈ 70); see experiments/bench/compressor_cost.py.
    """

    def __init__(
        self,
        ratio: float = 0.01,
        selection: str = "exact",
        sample_size: int = 0,
        margin: float = 1.25,
        seed: int = 0,
        worker: int = 0,
    ) -> None:
        super().__init__(seed, worker)
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio={ratio}: must be in (0, 1]")
        if selection not in SELECTIONS:
            raise ValueError(f"selection={selection!r}; choose one of: {', '.join(SELECTIONS)}")
        if margin < 1.0:
            raise ValueError(f"margin={margin}: must be >= 1")
        self.ratio, self.selection, self.margin = ratio, selection, margin
        # Default sample: enough that the threshold's rank in the sample is ~320 (±6% count).
        self.sample_size = sample_size or math.ceil(256 / ratio)

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        k = kept(chunk.numel, self.ratio)
        return [(dtype, k), (torch.int32, k)]

    def compress(self, x: Tensor, chunk: Chunk, step: int) -> list[Tensor]:
        d = x.numel()
        k = kept(d, self.ratio)
        if self.selection == "sampled" and 2 * self.sample_size < d:
            found = self._sampled(x, k, chunk, step)
            if found is not None:
                return [found[1], found[0].to(torch.int32)]
        magnitude = torch.abs(x, out=scratch("topk.abs", d, x.dtype, x.device))
        top = torch.topk(magnitude, k, sorted=False).indices
        return [x[top], top.to(torch.int32)]

    def _sampled(self, x: Tensor, k: int, chunk: Chunk, step: int) -> tuple[Tensor, Tensor] | None:
        """(indices, values) of the top k, or None if the sampled threshold was too high."""
        d, s = x.numel(), self.sample_size
        gen = rng.generator(rng.stream_seed("topk", self.seed, self.worker, chunk.key, step))
        sample = torch.randint(0, d, (s,), generator=gen).to(x.device)
        rank = min(s, math.ceil(self.margin * k * s / d))
        threshold = torch.topk(x[sample].abs(), rank, sorted=False).values.min()
        candidates, values = entries_at_least(x, float(threshold))
        if candidates.numel() < k:
            return None
        best = torch.topk(values.abs(), k, sorted=False).indices
        return candidates[best], values[best]

    def decompress(self, payload: Sequence[Tensor], chunk: Chunk, step: int, out: Tensor) -> None:
        values, idx = payload
        out.zero_()
        out.index_put_((idx.long(),), values)

    def decompress_sum(
        self, payloads: Sequence[Sequence[Tensor]], chunk: Chunk, step: int, out: Tensor
    ) -> None:
        values = torch.cat([p[0] for p in payloads])
        idx = torch.cat([p[1] for p in payloads])
        out.zero_()
        # On the CPU index_add_ adds in index order (worker order): bitwise reproducible. CUDA's
        # atomics may add a coordinate chosen by several workers in any order.
        out.index_add_(0, idx, values)
