"""Threshold sparsification (Strom 2015; GRACE's `threshold`): send the entries with |x| ≥ v."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.compress.base import Aggregation, Compressor


class ThresholdAggregation(Aggregation):
    """Two allgathers per bucket: first every worker's entry count (one int32), then every
    worker's (value, index) pairs in a row padded to the largest count — a collective needs
    rows of one size, so the padding is really sent (and counted). Padding pairs are (0, 0):
    adding 0 to entry 0 changes nothing, so receivers need no mask. Indices are int32 bucket
    columns, ascending; the decoded sum adds workers in order."""

    compressor: Threshold

    def run(
        self, x: Tensor, comm: Communicator, step: int, out: Tensor, sent: Tensor | None = None
    ) -> None:
        keep = x.abs() >= self.compressor.threshold
        counts = keep.sum(1, dtype=torch.int32)  # [W]
        every = comm.all_gather(counts.unsqueeze(1))  # [K, 1]: the sizes round
        width = int(every.max()) if every.numel() else 0
        if sent is not None:
            torch.mul(x, keep, out=sent)
        out.zero_()
        if width == 0:  # nobody sends anything (every process knows): no second round
            return
        rows, cols = keep.nonzero(as_tuple=True)  # row-major: each row's columns ascending
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(rows.numel(), device=x.device) - starts[rows].long()
        if self.compressor.index_bytes == 8:
            self._run_int64(x, comm, out, rows, cols, slot, width)
            return
        # one row per worker: [values as int32 bit patterns | int32 columns], 8·width bytes
        wire = torch.zeros(x.shape[0], 2 * width, dtype=torch.int32, device=x.device)
        wire[rows, slot] = x[rows, cols].to(torch.float32).view(torch.int32)
        wire[rows, width + slot] = cols.to(torch.int32)
        gathered = comm.all_gather(wire.view(torch.uint8)).view(torch.int32)  # [K, 2·width]
        values = gathered[:, :width].reshape(-1).view(torch.float32).to(out.dtype)
        out.index_add_(0, gathered[:, width:].reshape(-1).long(), values)
        out.div_(comm.world_size)

    def _run_int64(
        self, x: Tensor, comm: Communicator, out: Tensor, rows: Tensor, cols: Tensor,
        slot: Tensor, width: int,
    ) -> None:  # fmt: skip
        """The second round with int64 indices (GRACE's `torch.where` indices): each row is
        [fp32 values | int64 columns] as bytes, 12·width bytes, padding pairs (0, 0)."""
        values = torch.zeros(x.shape[0], width, dtype=torch.float32, device=x.device)
        index = torch.zeros(x.shape[0], width, dtype=torch.int64, device=x.device)
        values[rows, slot] = x[rows, cols].to(torch.float32)
        index[rows, slot] = cols
        wire = torch.cat([values.view(torch.uint8), index.view(torch.uint8)], dim=1)
        gathered = comm.all_gather(wire)  # [K, 12·width]
        got = gathered[:, : 4 * width].contiguous().view(torch.float32).reshape(-1)
        at = gathered[:, 4 * width :].contiguous().view(torch.int64).reshape(-1)
        out.index_add_(0, at, got.to(out.dtype))
        out.div_(comm.world_size)


INDEX_BYTES = (4, 8)


class Threshold(Compressor):
    """Threshold-v sparsification (Strom 2015, as GRACE's `threshold` sends it): every entry with
    |x| ≥ v is sent as (fp32 value, int32 index), the rest not at all. How many entries pass
    depends on the data, so the payload has no fixed size: each bucket's aggregation first
    allgathers the counts (4 bytes per worker, one more α-β round), then the pairs in rows padded
    to the largest count (see `ThresholdAggregation`). Non-linear: gathered, summed, averaged.
    Pair it with error feedback (error_feedback=ef14): Strom keeps the residual below the
    threshold and adds it to the next gradient.

    index_bytes: 4 (default: int32 indices, enough for any bucket under 2³¹ entries) or 8
    (GRACE's: `torch.where` gives int64 indices, so its pairs are 12 bytes). The same entries
    and values either way; only the bytes on the wire, and so in the ledger, differ.

    Bytes per worker per bucket and step: 4 + (4 + index_bytes)·max_w n_w, n_w the entries
    worker w keeps in the bucket (max over all workers: the padded row everyone sends).
    `payload_bytes` gives the upper bound (4 + index_bytes)·d + 4 (everything kept).
    """

    variable_size = True
    rounds = 2
    gossip = False
    gossip_note = (
        "sends a data-dependent number of entries: its messages have no fixed size for a "
        "neighbour exchange or a push"
    )
    aggregation_class: ClassVar[type[Aggregation]] = ThresholdAggregation

    def __init__(self, threshold: float = 0.01, seed: int = 0, index_bytes: int = 4) -> None:
        super().__init__(seed)
        if isinstance(index_bytes, bool) or index_bytes not in INDEX_BYTES:
            raise ValueError(
                f"index_bytes={index_bytes}; choose one of: 4 (int32), 8 (int64, GRACE's)"
            )
        self.index_bytes = int(index_bytes)
        if not threshold > 0:
            raise ValueError(
                f"threshold={threshold}: must be > 0 (the magnitude an entry needs to be sent)"
            )
        self.threshold = float(threshold)

    def payload_bytes(
        self, numel: int, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32
    ) -> int:
        return (4 + self.index_bytes) * numel + 4
