"""Random-k sparsification with indices shared by all workers (Stich et al. 2018)."""

from __future__ import annotations

import torch
from torch import Tensor

from dpresearch.compress import rng
from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.compress.codec import Codec
from dpresearch.compress.topk import kept
from dpresearch.compress.wire import Spec


class RandomKCodec(Codec):
    """All chunks' positions for a step drawn once (one stream per chunk), as one list of bucket
    columns: encoding is one gather over all rows, decoding one scatter."""

    compressor: RandomK

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        ks = [kept(ch.numel, self.compressor.ratio) for ch in self.chunks]
        # unbiased decoding scales each chunk's entries by d/k
        scales = [ch.numel / k for ch, k in zip(self.chunks, ks, strict=True)]
        self.scale = torch.repeat_interleave(
            torch.tensor(scales, dtype=self.dtype), torch.tensor(ks, dtype=torch.long)
        ).to(self.device)
        self._drawn: tuple[int, Tensor] | None = None

    def columns(self, step: int) -> Tensor:
        """The bucket columns all workers send at `step` (chunk by chunk, in draw order)."""
        if self._drawn is None or self._drawn[0] != step:
            parts = [
                self.compressor.indices(ch, step, self.device).add(ch.offset) for ch in self.chunks
            ]
            empty = torch.zeros(0, dtype=torch.long, device=self.device)
            self._drawn = (step, torch.cat(parts) if parts else empty)
        return self._drawn[1]

    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        values = x[:, self.columns(step)]
        self.layout.write_region(wire, self.dtype, values)

    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        values, cols = self.layout.region(wire, self.dtype), self.columns(step)
        out.zero_()
        if self.compressor.unbiased:
            out.index_add_(1, cols, values * self.scale)
        else:
            # A repeated position carries the same value every time, so write order is moot.
            out.index_copy_(1, cols, values)


class RandomK(SingleRoundCompressor):
    """Send the entries at k = max(1, round(ratio·d)) random positions of each chunk. Linear:
    every worker draws the same positions from a generator seeded by (run seed, chunk key,
    step), so only the values go on the wire and allreduce sums them position by position.

    Wire bytes per chunk of d fp32 elements: k·4 (values only).

    Positions are k independent uniform draws (`torch.randint`: one pass over k, no
    permutation of d), so a position can repeat. Decoding:
    - unbiased=False: C(x) keeps x at the drawn positions, zero elsewhere (a repeat just
      rewrites the same value) — the biased operator used with error feedback;
    - unbiased=True: C(x) = (d/k)·Σ_j x_{i_j} e_{i_j}, repeats accumulating; since each draw
      hits position i with probability 1/d, E[C(x)] = x exactly.
    """

    linear = True
    codec_class = RandomKCodec

    def __init__(self, ratio: float = 0.01, unbiased: bool = False, seed: int = 0) -> None:
        super().__init__(seed)
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio={ratio}: must be in (0, 1]")
        self.ratio, self.unbiased = ratio, unbiased

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return [(dtype, kept(chunk.numel, self.ratio))]

    def indices(self, chunk: Chunk, step: int, device: torch.device | str = "cpu") -> Tensor:
        """The chunk-local positions all workers use for `chunk` at `step`."""
        gen = rng.generator(rng.stream_seed("randomk", self.seed, chunk.key, step))
        k = kept(chunk.numel, self.ratio)
        return torch.randint(0, chunk.numel, (k,), generator=gen).to(device)
