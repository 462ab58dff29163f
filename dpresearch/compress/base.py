"""The compressor contract.

A `Compressor` instance belongs to ONE worker: it may hold that worker's state (error-feedback
memory, PowerSGD's warm-start Q) and draws its randomness from streams seeded by
(run seed, worker id, key, step) — see `rng.py`. A *chunk* is one compression unit (a tensor, a
bucket of flattened tensors, or the whole model), named by a string `key` that is stable across
steps. The unit of communication is a list of chunks (a bucket): all payloads of one worker for
one bucket travel as ONE row in ONE collective per protocol round, so the bytes the ledger
records are exactly the payload bytes documented by each compressor.

Aggregation algebra (`linear`):
- linear: payloads of different workers can be summed element-wise and the sum decoded
  (allreduce). Sums happen in the payload's dtype (fp16 casts are summed in fp16).
- non-linear: every worker's payload is gathered (allgather), each is decoded, and the decoded
  tensors are combined by `finalize` (by default their mean).

`aggregate` is the protocol hook. `SingleRoundCompressor` implements it once for every
compressor that is a compress → one collective → decompress pipeline; a compressor with a
multi-round protocol (PowerSGD: P round, then Q round) subclasses `Compressor` directly and
writes its own.

Codecs apart from the collective: a `SingleRoundCompressor` also offers `encode` (a worker's
input → one wire row, laid out by a `WirePlan` built once per bucket) and `decode` (a wire row
→ the decoded tensor). Synchronous aggregation is encode → allreduce/allgather → decode;
compressed gossip (CHOCO-SGD) is encode → neighbour exchange → decode each received row and
weight it by the mixing matrix. `gossip` says whether decoded messages may be combined with
arbitrary weights that way (false for majority vote, whose aggregate is a vote, and for
multi-round protocols).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.compress.wire import RowLayout, Spec
from dpresearch.compress.workspace import scratch

COLLECTIVES = ("auto", "allreduce", "allgather")


@dataclass(frozen=True)
class Chunk:
    """One compression unit: `numel` elements at `offset` within its bucket's flat row.

    `shape` is the tensor's own shape when the chunk is exactly one parameter (PowerSGD uses it
    to view a conv weight as out × in·k·k), else None.
    """

    key: str
    offset: int
    numel: int
    shape: tuple[int, ...] | None = None

    @property
    def slice(self) -> slice:
        return slice(self.offset, self.offset + self.numel)


@dataclass(frozen=True)
class WirePlan:
    """One bucket's plan-time facts: its chunks and where each chunk's payload components sit
    in a worker's wire row (`layout.size` elements of `layout.dtype`)."""

    chunks: tuple[Chunk, ...]
    layout: RowLayout

    @property
    def numel(self) -> int:
        """Input elements the chunks cover (the bucket's length)."""
        return max((ch.offset + ch.numel for ch in self.chunks), default=0)


class Compressor(ABC):
    """Per-worker compressor. Subclasses set `linear` and implement `payload_bytes` and
    `aggregate`.

    seed: the run's seed (shared by all workers); worker: this worker's global id. Both are
    supplied at build time, never in a config file.
    """

    linear: ClassVar[bool] = False
    gossip: ClassVar[bool] = False

    def __init__(self, seed: int = 0, worker: int = 0) -> None:
        self.seed = int(seed)
        self.worker = int(worker)

    @abstractmethod
    def payload_bytes(
        self, numel: int, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32
    ) -> int:
        """Exact bytes one worker sends for one chunk of `numel` elements (all rounds)."""

    @classmethod
    @abstractmethod
    def aggregate(
        cls,
        workers: Sequence[Compressor],
        rows: Sequence[Tensor],
        chunks: Sequence[Chunk],
        comm: Communicator,
        step: int,
        out: Tensor,
        local: Sequence[Tensor] | None = None,
        collective: str = "auto",
    ) -> None:
        """Run the protocol for one bucket.

        workers: this process's compressors, one per local worker (in `comm.local_workers`
        order); rows: each local worker's flat input for the bucket (1-D, same length); chunks:
        the compression units tiling the rows. Writes into `out` the aggregate that every worker
        uses (the same on all workers); if `local` is given, writes into `local[w]` worker w's
        own decoded message D(C(rows[w])) — what error feedback subtracts. Never modifies `rows`.
        """

    @property
    def wraps(self) -> Compressor:
        """The compressor that produces the payload (self unless this is a decorator)."""
        return self

    def state_dict(self) -> dict:
        """Per-worker state to checkpoint (tensors keyed by chunk key)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""


class SingleRoundCompressor(Compressor):
    """A compress → one collective → decompress compressor.

    Subclasses implement `payload_spec`, `compress` and `decompress`; `decompress` must depend
    only on the payload, the chunk and the step — never on the sending worker's state — since a
    receiver decodes every worker's payload with its own instance.
    """

    gossip: ClassVar[bool] = True

    def wire_plan(
        self, chunks: Sequence[Chunk], dtype: torch.dtype, linear: bool | None = None
    ) -> WirePlan:
        """The row layout for `chunks` of a `dtype` input. linear: lay the row out in the
        payload's own dtype so rows can be summed (default: `self.linear`); else bytes."""
        linear = self.linear if linear is None else linear
        specs = [self.payload_spec(ch, dtype) for ch in chunks]
        return WirePlan(tuple(chunks), RowLayout(specs, linear))

    def encode(self, x: Tensor, plan: WirePlan, step: int, wire: Tensor) -> None:
        """Compress the 1-D bucket `x` into the wire row `wire` (`plan.layout.size` elements of
        `plan.layout.dtype`). Must not modify `x`."""
        for i, ch in enumerate(plan.chunks):
            plan.layout.write(wire, i, self.compress(x[ch.slice], ch, step))

    def decode(self, wire: Tensor, plan: WirePlan, step: int, out: Tensor) -> None:
        """Decode one wire row (any worker's) into the 1-D `out` of the bucket's length."""
        for i, ch in enumerate(plan.chunks):
            self.decompress(plan.layout.read(wire, i), ch, step, out[ch.slice])

    @abstractmethod
    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        """The payload components for `chunk`: a list of (dtype, element count). Fixed by the
        chunk's size, so a receiver can split a row without headers."""

    @abstractmethod
    def compress(self, x: Tensor, chunk: Chunk, step: int) -> list[Tensor]:
        """Encode the flat 1-D `x` (`chunk.numel` elements) into payload components matching
        `payload_spec`. Must not modify `x`."""

    @abstractmethod
    def decompress(self, payload: Sequence[Tensor], chunk: Chunk, step: int, out: Tensor) -> None:
        """Decode `payload` into `out` (1-D, `chunk.numel` elements)."""

    def decompress_sum(
        self, payloads: Sequence[Sequence[Tensor]], chunk: Chunk, step: int, out: Tensor
    ) -> None:
        """`out` = Σ_k decompress(payloads[k]), summed in worker order."""
        self.decompress(payloads[0], chunk, step, out)
        if len(payloads) > 1:
            tmp = scratch("decode.sum", out.numel(), out.dtype, out.device)
            for payload in payloads[1:]:
                self.decompress(payload, chunk, step, tmp)
                out.add_(tmp)

    def finalize(self, total: Tensor, count: int) -> None:
        """Turn the sum of `count` decoded messages into the aggregate, in place (mean)."""
        total.div_(count)

    def payload_bytes(
        self, numel: int, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32
    ) -> int:
        spec = self.payload_spec(Chunk("", 0, numel, shape), dtype)
        return sum(count * dt.itemsize for dt, count in spec)

    @classmethod
    def aggregate(
        cls,
        workers: Sequence[Compressor],
        rows: Sequence[Tensor],
        chunks: Sequence[Chunk],
        comm: Communicator,
        step: int,
        out: Tensor,
        local: Sequence[Tensor] | None = None,
        collective: str = "auto",
    ) -> None:
        lead = workers[0]
        assert isinstance(lead, SingleRoundCompressor)
        if collective not in COLLECTIVES:
            raise ValueError(f"collective={collective!r}; choose one of: {', '.join(COLLECTIVES)}")
        if collective == "allreduce" and not lead.linear:
            raise ValueError(
                f"{type(lead).__name__} is not linear: its payloads cannot be summed by "
                "allreduce; use collective=allgather (or auto)"
            )
        linear = lead.linear if collective == "auto" else collective == "allreduce"
        plan = lead.wire_plan(chunks, rows[0].dtype, linear)
        layout = plan.layout
        wire = scratch("wire.rows", (len(rows), layout.size), layout.dtype, rows[0].device)
        for w, (worker, row) in enumerate(zip(workers, rows, strict=True)):
            assert isinstance(worker, SingleRoundCompressor)
            worker.encode(row, plan, step, wire[w])
            if local is not None:
                # Decode from the wire bytes, not from the compressor's tensors: EF must
                # subtract exactly what the receivers will see.
                lead.decode(wire[w], plan, step, local[w])
        count = comm.world_size
        if linear:
            comm.all_reduce(wire, op="sum")
            for i, ch in enumerate(chunks):
                lead.decompress(layout.read(wire[0], i), ch, step, out[ch.slice])
                lead.finalize(out[ch.slice], count)
        else:
            gathered = comm.all_gather(wire)
            for i, ch in enumerate(chunks):
                payloads = [layout.read(gathered[k], i) for k in range(count)]
                lead.decompress_sum(payloads, ch, step, out[ch.slice])
                lead.finalize(out[ch.slice], count)
