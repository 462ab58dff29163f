"""The compressed gradient reduction the synchronous algorithm calls once per step."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.compress.base import COLLECTIVES, Compressor
from dpresearch.compress.layout import ParamLayout, plan_buckets


class CompressedReducer:
    """Replaces every local worker's gradient row with the aggregate of all K workers' compressed
    gradients, as decoded — the same on every worker.

    compressors: one per local worker, in `comm.local_workers` order (each may be wrapped in
    `ErrorFeedback`; all of one class). layout: (offset, shape) of each parameter in the flat
    row. granularity / bucket_mb: see `layout.plan_buckets`; "auto" takes the compressor's
    preferred granularity ("tensor"). collective: "auto" (allreduce for linear payloads,
    allgather otherwise), or force "allreduce" / "allgather".

    Written only against the Communicator API: W = K simulated workers in one process and
    W = 1 worker per torch.distributed process give the same result.
    """

    def __init__(
        self,
        compressors: Sequence[Compressor],
        comm: Communicator,
        layout: ParamLayout,
        granularity: str = "auto",
        bucket_mb: float = 25.0,
        collective: str = "auto",
        itemsize: int = 4,
    ) -> None:
        if len(compressors) != comm.num_local:
            raise ValueError(
                f"need one compressor per local worker ({comm.num_local}), got {len(compressors)}"
            )
        if len({type(c) for c in compressors}) != 1:
            raise ValueError("all local workers must use the same compressor class")
        if collective not in COLLECTIVES:
            raise ValueError(f"collective={collective!r}; choose one of: {', '.join(COLLECTIVES)}")
        if collective == "allreduce" and not compressors[0].linear:
            raise ValueError(
                f"{type(compressors[0].wraps).__name__} is not linear: its payloads cannot be "
                "summed by allreduce; use collective=allgather (or auto)"
            )
        self.compressors = list(compressors)
        self.comm = comm
        self.collective = collective
        self.granularity = "tensor" if granularity == "auto" else granularity
        self.buckets = plan_buckets(layout, self.granularity, bucket_mb, itemsize)
        self._out: Tensor | None = None
        # Uncompressed, stateless aggregation is one allreduce of the whole row: no buckets,
        # no copies (the same bytes, the same sums).
        self.passthrough = collective != "allgather" and all(
            _is_plain_identity(c) for c in compressors
        )

    def reduce(self, grads: Tensor, step: int) -> None:
        """In place: every row of `grads` [W, D] becomes the aggregated gradient."""
        if self.passthrough:
            self.comm.all_reduce(grads, op="mean")
            return
        if self._out is None or self._out.shape[0] != grads.shape[1]:
            self._out = torch.empty(grads.shape[1], dtype=grads.dtype, device=grads.device)
        protocol = type(self.compressors[0]).aggregate
        for bucket in self.buckets:
            x = grads[:, bucket.start : bucket.end]
            out = self._out[bucket.start : bucket.end]
            protocol(
                self.compressors,
                list(x.unbind(0)),
                bucket.chunks,
                self.comm,
                step,
                out,
                collective=self.collective,
            )
            x.copy_(out.expand_as(x))

    def payload_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes one worker sends per compressed step (sum of the documented formulas)."""
        c = self.compressors[0]
        chunks = [ch for b in self.buckets for ch in b.chunks]
        return sum(c.payload_bytes(ch.numel, ch.shape, dtype) for ch in chunks)

    def state_dict(self) -> dict:
        """Each local worker's compressor state, in local-worker order."""
        return {"workers": [c.state_dict() for c in self.compressors]}

    def load_state_dict(self, state: dict) -> None:
        for c, s in zip(self.compressors, state["workers"], strict=True):
            c.load_state_dict(s)


def _is_plain_identity(compressor: Compressor) -> bool:
    """True for the identity compressor, bare or in an error-feedback wrapper that does nothing
    (mode "none", no momentum)."""
    from dpresearch.compress.casts import Identity
    from dpresearch.compress.error_feedback import ErrorFeedback

    if isinstance(compressor, ErrorFeedback):
        if compressor.mode != "none" or compressor.momentum > 0:
            return False
        compressor = compressor.inner
    return type(compressor) is Identity
