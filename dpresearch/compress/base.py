"""The compressor contract.

A `Compressor` is a compression *method*: its hyper-parameters, the run's seed, and its
capabilities, declared as class traits and checked in one place (`pairing.check_pairing`):

- `linear`: payloads of different workers can be summed element-wise and the sum decoded
  (allreduce; sums happen in the payload's dtype, so fp16 casts are summed in fp16). Otherwise
  every worker's payload is gathered (allgather), each is decoded, and the decoded tensors are
  combined by `finalize_gathered` (by default `finalize`: their mean).
- `rounds`: collectives per bucket per step (PowerSGD: 2).
- `gossip`: decoded messages may be combined with arbitrary weights, one sender at a time —
  compressed gossip (CHOCO-SGD) and asynchronous pushes need this (false for majority vote,
  whose aggregate is a vote, and for multi-round protocols).
- `memories`: the error-feedback modes that make sense with it (majority vote: "none" only),
  and `memories_note`, why (shown when a configuration asks for another).
- `gossip_note`: why it cannot serve gossip or pushes (shown when asked; default: a
  multi-round protocol or a vote).
- `variable_size`: the payload's size depends on the data (threshold sparsification): its
  aggregation exchanges the sizes first, then rows padded to the largest.
- `applies_momentum`: it keeps momentum itself (FetchSGD's momentum in sketch space), so
  neither the optimizer nor the error-feedback memory may add another.
- `default_granularity`: what `granularity=auto` means for it ("tensor": one chunk per
  parameter; "model": one chunk for the whole model, as a count sketch of the gradient).

One instance per process serves all its local workers. It builds, once per chunk set (a bucket),
an `Aggregation` — the synchronous protocol with its plan and buffers — whose `run` takes the
stacked inputs `[W, n]` of the W local workers. A *chunk* (`chunks.Chunk`) is one compression
unit (a tensor, a bucket of flattened tensors, or the whole model), named by a `key` stable
across steps. All payloads of one worker for one bucket travel as ONE row in ONE collective per
round, so the bytes the ledger records are exactly the payload bytes each compressor documents.

Single-round compressors (compress → one collective → decompress) subclass
`SingleRoundCompressor` and provide a `Codec` (`codec.py`): encode all rows `[W, n] → [W, L]`,
decode any rows, weighted accumulation. Synchronous aggregation is then encode → allreduce or
allgather → decode (`CollectiveAggregation`); compressed gossip is encode → neighbour exchange →
weighted decode; a push is encode one row → send → decode. The simplest way to add one is
`ChunkCompressor`: write `compress` / `decompress` for one chunk of one worker and the generic
`ChunkCodec` runs them; a batched `Codec` subclass makes it fast.

Randomness is drawn from streams seeded by (purpose, run seed, worker, chunk key, step)
(`rng.py`), never from state, so every backend and every grouping of workers draws the same
numbers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.compress.chunks import Chunk
from dpresearch.compress.codec import ChunkCodec, Codec, WirePlan
from dpresearch.compress.error_feedback import MODES
from dpresearch.compress.wire import RowLayout, Spec

COLLECTIVES = ("auto", "allreduce", "allgather")

__all__ = [
    "COLLECTIVES",
    "Aggregation",
    "Chunk",
    "ChunkCompressor",
    "CollectiveAggregation",
    "Compressor",
    "SingleRoundCompressor",
    "WirePlan",
]


# How a sparse aggregate is averaged: over all K workers (the papers' algorithms), or each
# entry over the workers that sent it (the DeMo and SparseLoCo reference codes).
AVERAGES = ("all", "senders")


class Aggregation(ABC):
    """One chunk set's synchronous protocol on one process, built once with its plan and
    buffers (`Compressor.aggregation`): for `chunks`, run by the local workers `workers`
    (global ids) on rows of `dtype` on `device`; collective: "auto", or force "allreduce" /
    "allgather" (checked beforehand by `check_pairing`)."""

    def __init__(
        self,
        compressor: Compressor,
        chunks: Sequence[Chunk],
        workers: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str,
        collective: str = "auto",
    ) -> None:
        self.compressor, self.chunks, self.workers = compressor, tuple(chunks), tuple(workers)
        self.dtype, self.device, self.collective = dtype, torch.device(device), collective

    @abstractmethod
    def run(
        self, x: Tensor, comm: Communicator, step: int, out: Tensor, sent: Tensor | None = None
    ) -> None:
        """x: the local workers' inputs `[W, n]` (rows in `comm.local_workers` order; never
        modified). Writes into `out` `[n]` the aggregate that every worker uses (the same on
        all workers); if `sent` `[W, n]` is given, writes into `sent[w]` worker w's own message
        as the receivers decode it — what error feedback subtracts."""


class Compressor(ABC):
    """A compression method (see the module docstring). seed: the run's seed, supplied at
    build time, never in a config file."""

    linear: ClassVar[bool] = False
    rounds: ClassVar[int] = 1
    gossip: ClassVar[bool] = False
    memories: ClassVar[tuple[str, ...]] = MODES
    memories_note: ClassVar[str] = ""
    gossip_note: ClassVar[str] = ""
    variable_size: ClassVar[bool] = False
    applies_momentum: ClassVar[bool] = False
    default_granularity: ClassVar[str] = "tensor"
    aggregation_class: ClassVar[type[Aggregation]]

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)

    @abstractmethod
    def payload_bytes(
        self, numel: int, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32
    ) -> int:
        """Exact bytes one worker sends for one chunk of `numel` elements (all rounds)."""

    def chunk_set_bytes(self, chunks: Sequence[Chunk], dtype: torch.dtype = torch.float32) -> int:
        """Exact bytes one worker sends for one chunk set (a bucket: one codec, one row): the
        sum of its chunks' `payload_bytes`, unless the compressor lays out a set as a whole
        (DCT top-k: one index width for the set)."""
        return sum(self.payload_bytes(ch.numel, ch.shape, dtype) for ch in chunks)

    def aggregation(self, *args, **kwargs) -> Aggregation:
        """The synchronous protocol for a chunk set: `aggregation_class(self, ...)`, given the
        arguments of `Aggregation` after the compressor (chunks, workers, dtype, device,
        collective)."""
        return self.aggregation_class(self, *args, **kwargs)

    def state_dict(self) -> dict:
        """State to checkpoint (live tensors; e.g. PowerSGD's warm-start Q)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""


class CollectiveAggregation(Aggregation):
    """encode all local rows → one allreduce (linear layout) or allgather → decode → finalize."""

    compressor: SingleRoundCompressor

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.compressor
        linear = c.linear if self.collective == "auto" else self.collective == "allreduce"
        self.codec = c.codec(self.chunks, self.dtype, self.device, self.workers, linear)
        self.charge = c.charged_bytes(self.chunks)  # None: the ledger counts the wire row

    def run(
        self, x: Tensor, comm: Communicator, step: int, out: Tensor, sent: Tensor | None = None
    ) -> None:
        codec = self.codec
        wire = codec.encode(x, step)
        if sent is not None:
            # Decode from the wire bytes: error feedback subtracts exactly what receivers see.
            codec.decode(wire, step, sent)
        if codec.linear:
            comm.all_reduce(wire, op="sum")
            codec.decode(wire[:1], step, out.unsqueeze(0))
        else:
            gathered = comm.all_gather(wire, charge=self.charge)
            out.zero_()
            codec.accumulate(gathered.unsqueeze(0), step, out.unsqueeze(0))
            self.compressor.finalize_gathered(out, gathered, codec)
            return
        self.compressor.finalize(out, comm.world_size)


class SingleRoundCompressor(Compressor):
    """A compress → one collective → decompress compressor, with a `Codec` over stacked rows.

    Subclasses implement `payload_spec` and set `codec_class` (or subclass `ChunkCompressor`
    for the generic per-chunk codec); `finalize` turns the sum of decoded messages into the
    aggregate.
    """

    gossip: ClassVar[bool] = True
    codec_class: ClassVar[type[Codec]]
    aggregation_class = CollectiveAggregation

    @abstractmethod
    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        """The payload components for `chunk`: a list of (dtype, element count). Fixed by the
        chunk's size, so a receiver can split a row without headers."""

    def wire_plan(
        self, chunks: Sequence[Chunk], dtype: torch.dtype, linear: bool | None = None
    ) -> WirePlan:
        """The row layout for `chunks` of a `dtype` input. linear: lay the row out in the
        payload's own dtype so rows can be summed (default: `self.linear`); else bytes."""
        linear = self.linear if linear is None else linear
        specs = [self.payload_spec(ch, dtype) for ch in chunks]
        return WirePlan(tuple(chunks), RowLayout(specs, linear))

    def codec(
        self,
        chunks: Sequence[Chunk],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        workers: Sequence[int] = (0,),
        linear: bool | None = None,
    ) -> Codec:
        """This compressor's codec for `chunks` (built once per layout; see `codec.py`)."""
        linear = self.linear if linear is None else linear
        return self.codec_class(self, chunks, dtype, device, workers, linear)

    def charged_bytes(self, chunks: Sequence[Chunk]) -> int | None:
        """The bytes per worker the ledger records for an allgathered row of `chunks`, where a
        byte-accounting option counts other than the wire row (natural compression's
        `bits_per_value=8`); None (default): the wire row's own bytes."""
        return None

    def finalize(self, total: Tensor, count: int) -> None:
        """Turn the sum of `count` decoded messages into the aggregate, in place (mean)."""
        total.div_(count)

    def finalize_gathered(self, total: Tensor, gathered: Tensor, codec: Codec) -> None:
        """Turn `total`, the sum of the decoded all-gathered rows `gathered` `[K, L]` (every
        worker's message, worker order), into the aggregate, in place: by default `finalize`
        over the K messages. A sparse codec's mean over the workers that sent each entry
        (`QuantizedTopK(average="senders")`) reads the rows' positions here."""
        self.finalize(total, gathered.shape[0])

    def payload_bytes(
        self, numel: int, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32
    ) -> int:
        spec = self.payload_spec(Chunk("", 0, numel, shape), dtype)
        return sum(count * dt.itemsize for dt, count in spec)


class ChunkCompressor(SingleRoundCompressor):
    """A single-round compressor written one chunk of one worker at a time: implement
    `payload_spec`, `compress` and `decompress`; the generic `ChunkCodec` calls them for every
    row and chunk."""

    codec_class: ClassVar[type[Codec]] = ChunkCodec

    @abstractmethod
    def compress(self, x: Tensor, chunk: Chunk, step: int, worker: int) -> list[Tensor]:
        """Encode worker `worker`'s flat 1-D `x` (`chunk.numel` elements) into payload
        components matching `payload_spec`. Must not modify `x`."""

    @abstractmethod
    def decompress(self, payload: Sequence[Tensor], chunk: Chunk, step: int, out: Tensor) -> None:
        """Decode `payload` into `out` (1-D, `chunk.numel` elements); never depends on the
        sender (a receiver decodes every worker's payload)."""
