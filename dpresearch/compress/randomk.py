"""Random-k sparsification with indices shared by all workers (Stich et al. 2018)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dpresearch.compress import rng
from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.compress.topk import kept
from dpresearch.compress.wire import Spec


class RandomK(SingleRoundCompressor):
    """Send the entries at k = max(1, round(ratio·d)) random positions. Linear: every worker
    draws the same positions from a generator seeded by (run seed, chunk key, step), so only the
    values go on the wire and allreduce sums them position by position.

    Wire bytes per chunk of d fp32 elements: k·4 (values only).

    Positions are k independent uniform draws (`torch.randint`: one pass over k, no
    permutation of d), so a position can repeat. Decoding:
    - unbiased=False: C(x) keeps x at the drawn positions, zero elsewhere (a repeat just
      rewrites the same value) — the biased operator used with error feedback;
    - unbiased=True: C(x) = (d/k)·Σ_j x_{i_j} e_{i_j}, repeats accumulating; since each draw
      hits position i with probability 1/d, E[C(x)] = x exactly.
    """

    linear = True

    def __init__(
        self, ratio: float = 0.01, unbiased: bool = False, seed: int = 0, worker: int = 0
    ) -> None:
        super().__init__(seed, worker)
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio={ratio}: must be in (0, 1]")
        self.ratio, self.unbiased = ratio, unbiased
        self._drawn: dict[str, tuple[int, int, Tensor]] = {}

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return [(dtype, kept(chunk.numel, self.ratio))]

    def indices(self, chunk: Chunk, step: int, device: torch.device) -> Tensor:
        """The positions all workers use for `chunk` at `step`."""
        cached = self._drawn.get(chunk.key)
        if cached is not None and cached[:2] == (step, chunk.numel) and cached[2].device == device:
            return cached[2]
        gen = rng.generator(rng.stream_seed("randomk", self.seed, chunk.key, step))
        k = kept(chunk.numel, self.ratio)
        idx = torch.randint(0, chunk.numel, (k,), generator=gen).to(device)
        self._drawn[chunk.key] = (step, chunk.numel, idx)
        return idx

    def compress(self, x: Tensor, chunk: Chunk, step: int) -> list[Tensor]:
        return [x[self.indices(chunk, step, x.device)]]

    def decompress(self, payload: Sequence[Tensor], chunk: Chunk, step: int, out: Tensor) -> None:
        idx = self.indices(chunk, step, out.device)
        out.zero_()
        if self.unbiased:
            out.index_add_(0, idx, payload[0], alpha=chunk.numel / idx.numel())
        else:
            # A repeated position carries the same value every time, so write order is moot.
            out.index_put_((idx,), payload[0])
