"""Chunk-wise top-k whose kept values are quantized to a few bits: SparseLoCo's message (Sarfi et
al. 2025, "Communication Efficient LLM Pre-training with SparseLoCo", arXiv 2508.15706).

Per compression chunk (a tensor, `granularity=tensor`) of d entries, per worker:

1. Selection. The tensor's flat row is cut into blocks of B = min(chunk_size, d) consecutive
   entries (the last block holds the d mod B left over); each block keeps its
   k = max(1, round(density·b)) entries of largest |x| (b its length, round half to even).
   SparseLoCo's chunks (its reference code, `ChunkingTransform`, chunk_size 64) are 64 × 64
   tiles of each matrix (4096 entries; 64-entry pieces of a vector), k scaled to the tile
   (the paper: 1–3 % density; the reference configuration keeps 128 of 4096, the CCLoco
   sweeps 32). Here a block is a run of the flattened tensor of the same 4096 entries — a
   tile of a row-major matrix is not a run, so the blocks group other entries than the
   tiles (same counts, same 12 index bits); a vector's blocks are 4096 long, not 64.
2. Quantization of the K kept values v of the whole tensor (all its blocks) to `bits` = b
   bits, SparseLoCo's "statistical" quantizer (its reference code, `TopKCompressor._quantize`;
   templar's 8-bit one with 2^b bins): with n = 2^b bins and R = `range_sigmas`,
       μ = mean(v),  c = v − μ,  σ = ‖c‖₂ / √(K − 1)  (0 when K = 1),
       s = R·σ / n   (s = 1 if s is 0 or not finite),
       q = clamp(round(c / s + n/2), 0, n − 1)   (round half to even),
       L[j] = mean of c over the entries with q = j  (0 for an empty bin),
       decoded value = L[q] + μ.
   The codebook L is each bin's centroid, so the decoded values are unbiased per bin. The
   reference computes in float32; here in the rows' dtype.

Wire bytes per tensor chunk (elements of the input dtype for the scales, e.g. 4 bytes for fp32):
    scales   (1 + 2^b) · itemsize            μ, then the 2^b codebook entries L
    values   ⌈K·b / 8⌉                       the codes q, bit-packed
    indices  ⌈K·i / 8⌉, i = max(1, ⌈log₂ B⌉)  block-local positions, ascending per block
(i > 8: the low 8 bits as bytes, then the high i − 8 bits packed — the same ⌈K·i/8⌉ bytes; B =
4096 gives the paper's 12 bits per index). Exactly that: no header, K is fixed by d.

Non-linear (indices and codebooks are per worker): payloads are gathered (allgather) and every
receiver decodes all of them. The aggregate, `average`:
    all      (default) their mean over all K workers, (1/K)·Σ_k m_k — SparseLoCo's Algorithm 1;
    senders  each entry's mean over the workers that sent it, Σ_k m_k[j] / #{k : j sent by k}
             (0 where none did) — SparseLoCo's reference code, which aggregates with
             `scatter_reduce(..., "mean", include_self=False)` as DeMo's does (demo.py:296).
At an entry s of the K workers sent, `senders` is K/s times `all`: at density 1.56 % most
entries are sent by one worker, so the anchor's step there is up to K times larger at the same
outer lr. The bytes are the same. `senders` needs every worker's message at once, so it
serves the synchronous exchange only (not gossip or pushes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dpresearch.compress.base import AVERAGES, Chunk, SingleRoundCompressor
from dpresearch.compress.codec import Codec
from dpresearch.compress.topk import kept
from dpresearch.compress.wire import Spec, pack_rows, packed_size, unpack_rows

MAX_CHUNK = 1 << 16  # block-local indices in at most 16 bits


@dataclass(frozen=True)
class Blocks:
    """How a chunk of `numel` entries is cut and what it sends: `full` blocks of `size`
    entries keeping `k` each, then (if `rest` > 0) one block of `rest` entries keeping
    `k_rest`; `kept` entries in all, each index in `index_bits`, each value in `bits`."""

    numel: int
    size: int
    full: int
    k: int
    rest: int
    k_rest: int
    bits: int

    @property
    def kept(self) -> int:
        return self.full * self.k + self.k_rest

    @property
    def index_bits(self) -> int:
        return max(1, (self.size - 1).bit_length())

    @property
    def value_bytes(self) -> int:
        return packed_size(self.kept, self.bits)

    @property
    def index_bytes(self) -> int:
        return packed_size(self.kept, self.index_bits)

    def starts(self) -> Tensor:
        """Each kept slot's block start within the chunk, `[kept]` (block order)."""
        starts = torch.arange(self.full, dtype=torch.long) * self.size
        full = torch.repeat_interleave(starts, self.k)
        tail = torch.full((self.k_rest,), self.full * self.size, dtype=torch.long)
        return torch.cat([full, tail])


class QuantizedTopKCodec(Codec):
    """Per chunk (tensor): one `torch.topk` over its full blocks for all rows, one over its
    last block, one quantization pass over all rows; codes and indices bit-packed per row."""

    compressor: QuantizedTopK

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.compressor
        self.bins = 1 << c.bits
        self.blocks = [c.blocks(ch.numel) for ch in self.chunks]
        # bucket column of each kept slot before its block-local index: chunk offset + start
        self.bases = [(b.starts() + ch.offset).to(self.device)
                      for b, ch in zip(self.blocks, self.chunks, strict=True)]  # fmt: skip
        self.scales = [self.layout.slots[i][0][1] for i in range(len(self.chunks))]
        self.payload = [self.layout.slots[i][1][1] for i in range(len(self.chunks))]

    # -- encode ---------------------------------------------------------------------------------
    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        packed = self.layout.region(wire, torch.uint8)
        for i, (ch, blocks) in enumerate(zip(self.chunks, self.blocks, strict=True)):
            local = select(x[:, ch.slice], blocks)  # [R, K] block-local, ascending per block
            values = x.gather(1, local + self.bases[i])
            codes, shift, codebook = quantize(values, self.bins, self.compressor.range_sigmas)
            scales = torch.cat([shift, codebook], dim=1)
            self.layout.write_region(wire, self.dtype, scales, start=self.scales[i])
            row = packed[:, self.payload[i] : self.payload[i] + blocks.value_bytes
                         + blocks.index_bytes]  # fmt: skip
            pack_rows(codes, blocks.bits, row[:, : blocks.value_bytes], self.ws)
            self._pack_indices(local, blocks, row[:, blocks.value_bytes :])

    def _pack_indices(self, local: Tensor, blocks: Blocks, out: Tensor) -> None:
        bits, kept_ = blocks.index_bits, blocks.kept
        if bits <= 8:
            pack_rows(local.to(torch.uint8), bits, out, self.ws)
            return
        out[:, :kept_].copy_(local & 0xFF)
        pack_rows((local >> 8).to(torch.uint8), bits - 8, out[:, kept_:], self.ws)

    # -- decode ---------------------------------------------------------------------------------
    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        packed = self.layout.region(wire, torch.uint8)
        scales = self.layout.region(wire, self.dtype)
        out.zero_()
        for i, blocks in enumerate(self.blocks):
            row = packed[:, self.payload[i] : self.payload[i] + blocks.value_bytes
                         + blocks.index_bytes]  # fmt: skip
            shift = scales[:, self.scales[i] : self.scales[i] + 1]
            codebook = scales[:, self.scales[i] + 1 : self.scales[i] + 1 + self.bins]
            codes = unpack_rows(row[:, : blocks.value_bytes], blocks.bits, blocks.kept, self.ws)
            values = codebook.gather(1, codes.long()).add_(shift)
            local = self._unpack_indices(row[:, blocks.value_bytes :], blocks)
            out.scatter_(1, local + self.bases[i], values.to(out.dtype))

    def sent_counts(self, wire: Tensor) -> Tensor:
        """How many of the wire rows `[R, L]` sent each entry: `[numel]` integers (a row sends an
        entry at most once)."""
        packed = self.layout.region(wire, torch.uint8)
        counts = torch.zeros(self.numel, dtype=torch.long, device=self.device)
        for i, blocks in enumerate(self.blocks):
            row = packed[:, self.payload[i] + blocks.value_bytes : self.payload[i]
                         + blocks.value_bytes + blocks.index_bytes]  # fmt: skip
            positions = self._unpack_indices(row, blocks) + self.bases[i]
            counts += torch.bincount(positions.reshape(-1), minlength=self.numel)
        return counts

    def _unpack_indices(self, row: Tensor, blocks: Blocks) -> Tensor:
        bits, kept_ = blocks.index_bits, blocks.kept
        if bits <= 8:
            return unpack_rows(row, bits, kept_, self.ws).long()
        low = row[:, :kept_].long()
        return low | (unpack_rows(row[:, kept_:], bits - 8, kept_, self.ws).long() << 8)


def select(x: Tensor, blocks: Blocks) -> Tensor:
    """Block-local indices `[R, kept]` of each block's k largest |x| of the rows `x` `[R, d]`,
    ascending within each block (a row's bytes depend on its input only)."""
    magnitude = x.abs()
    rows, parts = x.shape[0], []
    if blocks.full:
        full = magnitude[:, : blocks.full * blocks.size].reshape(rows, blocks.full, blocks.size)
        top = torch.topk(full, blocks.k, dim=-1, sorted=False).indices.sort(-1).values
        parts.append(top.reshape(rows, -1))
    if blocks.rest:
        tail = magnitude[:, blocks.full * blocks.size :]
        parts.append(torch.topk(tail, blocks.k_rest, dim=-1, sorted=False).indices.sort(-1).values)
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def quantize(values: Tensor, bins: int, range_sigmas: float) -> tuple[Tensor, Tensor, Tensor]:
    """The statistical quantizer (module docstring) of each row of `values` `[R, K]`: codes
    `[R, K]` (uint8), μ `[R, 1]` and the codebook L `[R, bins]` (the rows' dtype)."""
    rows, count = values.shape
    shift = values.mean(dim=1, keepdim=True)
    centered = values - shift
    if count > 1:
        sigma = centered.norm(dim=1, keepdim=True) / math.sqrt(count - 1)
    else:
        sigma = torch.zeros_like(shift)
    step = sigma * (range_sigmas / bins)
    step = torch.where((step > 0) & torch.isfinite(step), step, torch.ones_like(step))
    codes = (centered / step + bins // 2).round_().clamp_(0, bins - 1).to(torch.uint8)
    # one masked sum per bin (plain reductions: the same sums on every run and device, where
    # an index_add would add in the atomics' order on a GPU)
    codebook = values.new_zeros(rows, bins)
    for j in range(bins):
        member = codes == j
        count = member.sum(1, keepdim=True)
        total = torch.where(member, centered, torch.zeros_like(centered)).sum(1, keepdim=True)
        codebook[:, j : j + 1] = torch.where(count > 0, total / count.clamp(min=1), 0.0)
    return codes, shift, codebook


class QuantizedTopK(SingleRoundCompressor):
    """Keep each block's k largest-magnitude entries, send their codes in `bits` bits with a
    per-tensor codebook (see the module docstring for the exact rule and bytes).

    density: k / block length, in (0, 1]; chunk_size: the block length B (1..65536; the
    paper's 4096); bits: 1..8 (the paper's 2); range_sigmas: the quantizer's range R in
    standard deviations (the reference's 6); average: "all" (the mean over all workers,
    Algorithm 1) or "senders" (each entry's mean over the workers that sent it, the reference
    code's)."""

    codec_class = QuantizedTopKCodec

    def __init__(
        self,
        density: float = 0.015625,
        chunk_size: int = 4096,
        bits: int = 2,
        range_sigmas: float = 6.0,
        average: str = "all",
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        if isinstance(density, bool) or not isinstance(density, int | float):
            raise ValueError(f"density={density}: must be a number in (0, 1]")
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density={density}: must be in (0, 1]")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise ValueError(f"chunk_size={chunk_size}: must be a whole number in 1..{MAX_CHUNK}")
        if not 1 <= chunk_size <= MAX_CHUNK:
            raise ValueError(
                f"chunk_size={chunk_size}: must be in 1..{MAX_CHUNK} (block-local indices "
                "travel in at most 16 bits)"
            )
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise ValueError(f"bits={bits}: must be a whole number in 1..8")
        if isinstance(range_sigmas, bool) or not isinstance(range_sigmas, int | float):
            raise ValueError(f"range_sigmas={range_sigmas}: must be a number > 0")
        if not (range_sigmas > 0 and math.isfinite(range_sigmas)):
            raise ValueError(f"range_sigmas={range_sigmas}: must be a number > 0")
        if average not in AVERAGES:
            raise ValueError(
                f"average={average}: choose one of: {', '.join(AVERAGES)} (all: the mean over "
                "all workers, the paper's; senders: over the workers that sent each entry, "
                "the reference code's)"
            )
        self.density, self.chunk_size = float(density), int(chunk_size)
        self.bits, self.range_sigmas = int(bits), float(range_sigmas)
        self.average = average
        if average == "senders":
            # an instance trait: the per-entry mean needs every worker's message at once
            self.gossip = False
            self.gossip_note = (
                "with average=senders averages each entry over the workers that sent it, "
                "which needs every worker's message at once (set compressor.average=all)"
            )

    def finalize_gathered(self, total: Tensor, gathered: Tensor, codec: Codec) -> None:
        if self.average == "all":
            super().finalize_gathered(total, gathered, codec)
            return
        assert isinstance(codec, QuantizedTopKCodec)
        total.div_(codec.sent_counts(gathered).to(total.dtype).clamp_(min=1))

    def blocks(self, numel: int) -> Blocks:
        """The blocks of a chunk of `numel` entries and what each keeps."""
        size = min(self.chunk_size, numel)
        full, rest = divmod(numel, size)
        k_rest = kept(rest, self.density) if rest else 0
        return Blocks(numel, size, full, kept(size, self.density), rest, k_rest, self.bits)

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        blocks = self.blocks(chunk.numel)
        return [(dtype, 1 + (1 << self.bits)),
                (torch.uint8, blocks.value_bytes + blocks.index_bytes)]  # fmt: skip
