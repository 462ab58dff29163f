"""The compressed gradient reduction the synchronous algorithm calls once per step."""

from __future__ import annotations

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.compress.base import Compressor
from dpresearch.compress.casts import Identity
from dpresearch.compress.error_feedback import ErrorFeedback
from dpresearch.compress.layout import ParamLayout, plan_buckets
from dpresearch.compress.pairing import check_pairing
from dpresearch.compress.workspace import Workspace


class CompressedReducer:
    """Replaces every local worker's gradient row with the aggregate of all K workers' compressed
    gradients, as decoded — the same on every worker.

    compressor: the method (one instance for this process's workers); memory: error feedback
    (None: none), bound here to the `[W, D]` rows. layout: (offset, shape) of each parameter in
    the flat row. granularity / bucket_mb: see `layout.plan_buckets`; "auto" takes "tensor".
    collective: "auto" (allreduce for linear payloads, allgather otherwise), or force
    "allreduce" / "allgather". dtype / device: the gradient rows'.

    Each bucket's protocol (`Compressor.aggregation`: plan, codec, buffers) is built once here;
    a step is, per bucket: p = memory.compensate(g); aggregate(p) → out, sent;
    memory.update(p, sent). Written only against the Communicator API: W = K simulated workers
    in one process and W = 1 worker per torch.distributed process give the same result.
    """

    def __init__(
        self,
        compressor: Compressor,
        comm: Communicator,
        layout: ParamLayout,
        memory: ErrorFeedback | None = None,
        granularity: str = "auto",
        bucket_mb: float = 25.0,
        collective: str = "auto",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        memory = memory or ErrorFeedback(mode="none")
        check_pairing(compressor, memory, "sync", collective)
        self.compressor, self.memory, self.comm = compressor, memory, comm
        self.collective = collective
        self.granularity = "tensor" if granularity == "auto" else granularity
        self.buckets = plan_buckets(layout, self.granularity, bucket_mb, dtype.itemsize)
        numel = self.buckets[-1].end if self.buckets else 0
        workers = comm.local_workers
        self.aggregations = [
            compressor.aggregation(b.chunks, workers, dtype, device, collective)
            for b in self.buckets
        ]
        memory.bind(len(workers), numel, dtype, device)
        self._out = torch.empty(numel, dtype=dtype, device=device)
        self.ws = Workspace()
        # Uncompressed, stateless aggregation is one allreduce of the whole row: no buckets,
        # no copies (the same bytes, the same sums).
        self.passthrough = (
            type(compressor) is Identity and not memory.active and collective != "allgather"
        )

    def reduce(self, grads: Tensor, step: int) -> None:
        """In place: every row of `grads` [W, D] becomes the aggregated gradient."""
        if self.passthrough:
            self.comm.all_reduce(grads, op="mean")
            return
        memory, comm = self.memory, self.comm
        for bucket, aggregation in zip(self.buckets, self.aggregations, strict=True):
            cols = slice(bucket.start, bucket.end)
            g, out = grads[:, cols], self._out[cols]
            p = memory.compensate(g, step, cols=cols)
            if memory.warming_up(step):
                dense = self.ws.get("dense", tuple(p.shape), p.dtype, p.device)
                dense.copy_(p)
                comm.all_reduce(dense, op="sum")
                torch.div(dense[0], comm.world_size, out=out)
                memory.warm(p, out, cols=cols)
            else:
                sent = None
                if memory.wants_sent:
                    sent = self.ws.get("sent", tuple(p.shape), p.dtype, p.device)
                aggregation.run(p, comm, step, out, sent)
                if sent is not None:
                    memory.update(p, sent, cols=cols)
                memory.combine(out, cols)
            g.copy_(out.expand_as(g))

    def payload_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes one worker sends per compressed step (sum of the documented formulas)."""
        chunks = [ch for b in self.buckets for ch in b.chunks]
        return sum(self.compressor.payload_bytes(ch.numel, ch.shape, dtype) for ch in chunks)

    def state_dict(self) -> dict:
        """The error-feedback memory of the local workers and the compressor's state (live
        tensors)."""
        return {"memory": self.memory.state_dict(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state["memory"])
        self.compressor.load_state_dict(state["compressor"])
