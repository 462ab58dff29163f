"""The compressed gradient reduction the synchronous algorithm calls once per step."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.compress.base import Compressor
from dpresearch.compress.channel import uncompressed
from dpresearch.compress.error_feedback import ErrorFeedback
from dpresearch.compress.layout import ParamLayout, plan_buckets
from dpresearch.compress.pairing import SYNC, check_pairing
from dpresearch.compress.workspace import Workspace


class CompressedReducer:
    """Replaces every local worker's gradient row with the aggregate of all K workers' compressed
    gradients, as decoded — the same on every worker.

    compressor: the method (one instance for this process's workers); memory: error feedback
    (None: none), bound here to the `[W, D]` rows. layout: (offset, shape) of each parameter in
    the flat row. granularity / bucket_mb: see `layout.plan_buckets`; "auto" takes the compressor's
    `default_granularity` ("tensor", or "model" for a count sketch).
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
        check_pairing(compressor, memory, SYNC, collective)
        self.compressor, self.memory, self.comm = compressor, memory, comm
        self.collective = collective
        auto = compressor.default_granularity
        self.granularity = auto if granularity == "auto" else granularity
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
        self.passthrough = uncompressed(compressor, memory) and collective != "allgather"

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
        return sum(self.compressor.chunk_set_bytes(b.chunks, dtype) for b in self.buckets)

    def state_dict(self) -> dict:
        """The error-feedback memory of the local workers and the compressor's state (live
        tensors)."""
        return {"memory": self.memory.state_dict(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state["memory"])
        self.compressor.load_state_dict(state["compressor"])


class HierarchicalReducer:
    """Two-level reduction on a cluster of nodes (`comm.tiers`, see `dpresearch.comm.hierarchy`):
    per step, every node sums its G gradients exactly at its leader (an intra-node reduce), the
    N leaders aggregate the node means with the compressor and error feedback — a
    `CompressedReducer` over the inter-node communicator, the memory on the node leader (it is
    the only one that compresses; the leader's memory holds what its node's messages left out)
    — and each leader broadcasts the aggregate back into its node. The aggregate is the mean over
    nodes of node means: with the identity compressor, the flat mean of all K gradients.

    Bytes: the reduce charges every non-leader its row (intra), the inter aggregation charges
    the leaders the compressor's payload (inter), the broadcast charges the leaders (intra;
    priced as a ring, `comm.hierarchy.intra_algorithm=ring`, every worker of the chain but the
    node's last); each op is priced on its tier's link.

    With `replicated_nodes` every node's G rows are known to be equal (each node one model,
    `Traits.node_replicas`): the intra reduce is skipped, the leader's row is its node's mean,
    and only the inter aggregation and the intra broadcast travel.
    """

    passthrough = False

    def __init__(self, compressor: Compressor, comm: Communicator, layout: ParamLayout,
                 memory: ErrorFeedback | None = None, *args,
                 replicated_nodes: bool = False, **kwargs) -> None:  # fmt: skip
        tiers = comm.tiers
        if tiers is None:
            raise ValueError("HierarchicalReducer needs a communicator with tiers")
        memory = memory or ErrorFeedback(mode="none")
        # the collective as the inner reducer takes it (positional or not, its declared default)
        call = inspect.signature(CompressedReducer).bind(
            compressor, tiers.inter, layout, memory, *args, **kwargs
        )
        call.apply_defaults()
        check_pairing(compressor, memory, SYNC, call.arguments["collective"])
        self.tiers, self.compressor, self.memory = tiers, compressor, memory
        self.nodes_size = tiers.hierarchy.workers_per_node
        self.inner = (
            CompressedReducer(compressor, tiers.inter, layout, memory, *args, **kwargs)
            if tiers.inter is not None
            else None
        )
        self.leaders = torch.tensor(tiers.leaders, dtype=torch.long)
        self.rows: Tensor | None = None
        self.replicated_nodes = replicated_nodes

    def reduce(self, grads: Tensor, step: int) -> None:
        """In place: every row of `grads` [W, D] becomes the aggregated gradient."""
        intra = self.tiers.intra
        if not self.replicated_nodes:
            intra.reduce(grads, dst=0)  # leaders' rows: their node's sum
        if self.inner is not None:
            leaders = self.leaders.to(grads.device)
            if self.rows is None:
                self.rows = grads.new_empty(len(self.leaders), grads.shape[1])
            torch.index_select(grads, 0, leaders, out=self.rows)
            if not self.replicated_nodes:
                self.rows.div_(self.nodes_size)
            self.inner.reduce(self.rows, step)
            grads.index_copy_(0, leaders, self.rows)
        intra.broadcast(grads, src=0)

    def payload_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes one node leader sends between nodes per compressed step."""
        return self.inner.payload_bytes(dtype) if self.inner is not None else 0

    def state_dict(self) -> dict:
        return self.inner.state_dict() if self.inner is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(state)
