"""Top-k sparsification (Aji & Heafield 2017; Lin et al. 2018, "Deep Gradient Compression")."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from dpresearch.compress import rng
from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.compress.chunks import ChunkGroup
from dpresearch.compress.codec import Codec
from dpresearch.compress.kernels import numpy_path
from dpresearch.compress.wire import Spec
from dpresearch.compress.workspace import Workspace

SELECTIONS = ("exact", "sampled")
# Exact selection through a threshold (below) pays from this many entries per chunk; smaller
# chunks go straight to torch.topk, batched over the group.
THRESHOLD_MIN_NUMEL = 4096
THRESHOLD_MIN_WORK = 1 << 16  # entries of a group over all rows
# The fixed sample of exact selection: the threshold is the RANK-th largest of the sample,
# aimed at MARGIN·k candidates; a chunk misses (fewer than k, ≈ 2 % of chunks at ±2σ) only
# costs its own torch.topk.
RANK, MARGIN = 16, 2.0


def kept(numel: int, ratio: float) -> int:
    """k = max(1, round(ratio·d)), at most d."""
    return min(numel, max(1, round(ratio * numel)))


class TopKCodec(Codec):
    """Top-k over stacked rows: one selection per group of equal-size chunks for all rows,
    values and indices written as two regions of the wire row (all chunks' values, then all
    chunks' int32 indices, chunk-local and ascending), decoded by one scatter (or index_add
    for sums)."""

    compressor: TopK

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c, device = self.compressor, self.device
        ks = [kept(ch.numel, c.ratio) for ch in self.chunks]
        slot = [0]
        for k in ks:
            slot.append(slot[-1] + k)
        self.kept = sum(ks)
        # bucket column of slot j = its chunk's offset + the chunk-local index on the wire
        offsets = torch.tensor([ch.offset for ch in self.chunks], dtype=torch.long)
        self.base = torch.repeat_interleave(offsets, torch.tensor(ks, dtype=torch.long)).to(device)
        self.slots: list[Tensor] = []  # per group: its chunks' slots, [G·k]
        self.samples: list[Tensor | None] = []  # per group: exact selection's sample positions
        for group in self.table.groups:
            k = kept(group.numel, c.ratio)
            pos = [torch.arange(slot[i], slot[i] + k) for i in group.members]
            self.slots.append(torch.cat(pos).to(device))
            self.samples.append(self._fixed_sample(group.numel, k))

    def _fixed_sample(self, d: int, k: int) -> Tensor | None:
        """Sample positions for exact selection's threshold (None: plain torch.topk)."""
        size = math.ceil(RANK * d / (MARGIN * k))
        if d < THRESHOLD_MIN_NUMEL or 4 * size > d:
            return None
        gen = rng.generator(rng.stream_seed("topk.sample", d, size))
        return torch.randperm(d, generator=gen)[:size].sort().values.to(self.device)

    # -- encode ---------------------------------------------------------------------------------
    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        rows = x.shape[0]
        magnitude = self.ws.get("abs", tuple(x.shape), x.dtype, self.device)
        torch.abs(x, out=magnitude)
        columns = self.ws.get("columns", (rows, self.kept), torch.long, self.device)
        for group, slots, sample in zip(self.table.groups, self.slots, self.samples, strict=True):
            # ascending indices: a row's bytes depend on its input only, not on which rows
            # were selected together (and the decoder's scatter walks memory in order)
            local = self._select(magnitude, group, sample, step, workers).sort(-1).values
            columns.index_copy_(1, slots, local.flatten(1))
        columns.add_(self.base)  # chunk-local → bucket columns
        values = self.layout.writable_region(wire, x.dtype)
        if values is None:
            self.layout.write_region(wire, x.dtype, x.gather(1, columns))
        else:
            torch.gather(x, 1, columns, out=values)
        self.layout.write_region(wire, torch.int32, columns.sub_(self.base))

    def _select(
        self,
        magnitude: Tensor,
        group: ChunkGroup,
        sample: Tensor | None,
        step: int,
        workers: tuple[int, ...],
    ) -> Tensor:
        """Chunk-local indices `[R, G, k]` of each chunk's k largest |x|."""
        c = self.compressor
        d, k = group.numel, kept(group.numel, c.ratio)
        view = self.table.view(magnitude, group)
        if k == d:
            return torch.arange(d, device=self.device).expand(*view.shape[:-1], d)
        if view.numel() < THRESHOLD_MIN_WORK:
            sample = None  # too little work for the threshold's fixed costs
        if c.selection == "sampled" and 2 * c.sample_size < d:
            threshold = self._sampled_threshold(view, group, step, workers)
        elif sample is not None:
            picked = view.gather(-1, sample.expand(*view.shape[:-1], -1))
            rank = min(picked.shape[-1], math.ceil(MARGIN * k * picked.shape[-1] / d))
            threshold = torch.topk(picked, rank, dim=-1, sorted=False).values.amin(-1)
        else:
            return torch.topk(view, k, dim=-1, sorted=False).indices
        return _threshold_top_k(view, threshold, k, self.ws)

    def _sampled_threshold(
        self, view: Tensor, group: ChunkGroup, step: int, workers: tuple[int, ...]
    ) -> Tensor:
        """DGC's estimate: per row and chunk, the ⌈margin·k·s/d⌉-th largest |x| of s entries
        drawn from the worker's stream for this chunk and step."""
        c = self.compressor
        d, s = group.numel, c.sample_size
        k = kept(d, c.ratio)
        positions = torch.empty(*view.shape[:-1], s, dtype=torch.long)
        for row, worker in enumerate(workers):
            for j, i in enumerate(group.members):
                key = self.chunks[i].key
                gen = rng.generator(rng.stream_seed("topk", c.seed, worker, key, step))
                positions[row, j] = torch.randint(0, d, (s,), generator=gen)
        picked = view.gather(-1, positions.to(self.device))
        rank = min(s, math.ceil(c.margin * k * s / d))
        return torch.topk(picked, rank, dim=-1, sorted=False).values.amin(-1)

    # -- decode ---------------------------------------------------------------------------------
    def _columns(self, wire: Tensor) -> tuple[Tensor, Tensor]:
        """(values, bucket columns) of wire rows `[..., L]`: `[..., K]` each."""
        values = self.layout.region(wire, self.dtype)
        index = self.layout.region(wire, torch.int32)
        return values, index.long() + self.base

    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        values, cols = self._columns(wire)
        out.zero_()
        out.scatter_(1, cols, values)  # a row's indices are distinct

    def accumulate(
        self, rows: Tensor, step: int, out: Tensor, weights: Tensor | None = None
    ) -> None:
        values, cols = self._columns(rows)  # [B, R, K]
        if weights is not None:
            values = values * weights.unsqueeze(-1)
        values = values.to(out.dtype)
        if out.is_contiguous():
            base = torch.arange(out.shape[0], device=self.device).mul_(out.shape[1])
            flat = (cols + base.view(-1, 1, 1)).view(-1)
            # On the CPU index_add_ adds in index order: for each coordinate, rows in r order
            # (bitwise reproducible). CUDA's atomics may add them in any order.
            out.view(-1).index_add_(0, flat, values.reshape(-1))
        else:
            for b in range(out.shape[0]):
                out[b].index_add_(0, cols[b].reshape(-1), values[b].reshape(-1))


class TopK(SingleRoundCompressor):
    """Keep the k = max(1, round(ratio·d)) entries of largest magnitude of each chunk.
    Non-linear: each worker picks its own indices, so payloads are gathered and every receiver
    scatters all of them.

    Wire bytes per chunk of d fp32 elements: k·(4 + 4) — k values, then k int32 indices.
    Always exactly k entries, so rows need no header.

    selection (both return the k largest entries; they differ in how a threshold is found, and
    may pick differently among entries of exactly equal magnitude):
    - "exact": chunks under 8192 entries: `torch.topk` over |x|, batched over chunks of equal
      size. Larger chunks: the k-th largest of a fixed sample of |x| (positions drawn once per
      chunk size) sets a threshold aimed at 2k candidates; the candidates are extracted in one
      pass and `torch.topk` picks k among them — unless fewer than k qualified (≈ never), when
      the chunk falls back to `torch.topk` over all of it.
    - "sampled": DGC's threshold estimate. Draw `sample_size` random entries (the worker's
      own stream for this chunk and step), take the ⌈margin·k·sample_size/d⌉-th largest of
      their |x| as threshold, keep the candidates |x| ≥ threshold and truncate to exactly k;
      when fewer than k qualify, fall back to exact selection, so the payload always holds the
      k largest entries. Chunks with d ≤ 2·sample_size use exact selection.
    """

    codec_class = TopKCodec

    def __init__(
        self,
        ratio: float = 0.01,
        selection: str = "exact",
        sample_size: int = 0,
        margin: float = 1.25,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
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


def _threshold_top_k(view: Tensor, threshold: Tensor, k: int, ws: Workspace) -> Tensor:
    """Chunk-local indices `[R, G, k]` of the k largest entries of each chunk of `view`
    `[R, G, d]` (magnitudes): among the candidates ≥ `threshold` `[R, G]` (one pass to find
    them), or, for a chunk with fewer than k candidates, among all its entries."""
    rows, groups, d = view.shape
    segments = rows * groups
    mask = ws.get("topk.mask", tuple(view.shape), torch.bool, view.device)
    torch.ge(view, threshold.unsqueeze(-1), out=mask)
    if numpy_path(mask):
        flat = torch.from_numpy(np.flatnonzero(mask.numpy()))
    else:
        flat = mask.view(-1).nonzero().view(-1)
    segment = torch.div(flat, d, rounding_mode="floor")
    index = flat - segment * d
    counts = torch.bincount(segment, minlength=segments)
    local = torch.empty(segments, k, dtype=torch.long, device=view.device)
    if flat.numel():
        # the candidates' magnitudes, read through the view's strides from its storage
        s0, s1, s2 = view.stride()
        size = view.untyped_storage().nbytes() // view.element_size()
        storage = view.as_strided((size,), (1,), 0)
        rows_of, chunks_of = torch.div(segment, groups, rounding_mode="floor"), segment % groups
        where = view.storage_offset() + rows_of * s0 + chunks_of * s1 + index * s2
        starts = counts.cumsum(0).sub_(counts)
        position = torch.arange(flat.numel(), device=view.device) - starts[segment]
        width = max(int(counts.max()), k)
        padded = torch.full((segments, width), -1.0, dtype=view.dtype, device=view.device)
        padded[segment, position] = storage[where]
        best = torch.topk(padded, k, dim=1, sorted=False).indices
        local = index[best.add_(starts.unsqueeze(1)).clamp_(max=flat.numel() - 1)]
    short = (counts < k).nonzero().view(-1)
    if short.numel():  # the threshold overshot there: exact selection over the whole chunk
        chunk_rows = view[torch.div(short, groups, rounding_mode="floor"), short % groups]
        local[short] = torch.topk(chunk_rows, k, dim=-1, sorted=False).indices
    return local.view(rows, groups, k)
