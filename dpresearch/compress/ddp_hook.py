"""Any compressor (with error feedback) as a communication hook for torch's DistributedDataParallel.

The five lines a user writes (one process per rank, process group initialised):

    from dpresearch.compress import TopK, make_comm_hook
    ddp = DistributedDataParallel(model)
    state, hook = make_comm_hook(TopK(ratio=0.01, seed=0), ddp, error_feedback={"mode": "ef14"})
    ddp.register_comm_hook(state, hook)
    # ... train as usual; state.comm.ledger.bytes_sent counts the bytes this rank sent.

The hook runs the compressor's own protocol (`Compressor.aggregation`) over the
torch.distributed process group, one worker per process, and returns an already-completed
Future: communication does not overlap the rest of the backward pass (a correctness-first
adapter for research runs). Chunks are keyed by parameter index exactly as `CompressedReducer`
keys them, and the error-feedback memory is one row over the model's parameters in their flat
order, so a hooked DDP run reproduces a simulated run — also after DDP regroups its buckets.

Tearing down: drop the DDP model (and the hook state) before `destroy_process_group`, and end
with `dpresearch.launch.processes.leave_together()`. A DDP reducer that outlives the group holds
its last reference; releasing it joins gloo's worker threads while holding the GIL, and a worker
still releasing a work that refers to Python objects then waits for the GIL forever (torch 2.13).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dpresearch.comm.distributed import DistributedCommunicator
from dpresearch.comm.network import NetworkModel
from dpresearch.compress.base import Aggregation, Chunk, Compressor
from dpresearch.compress.build import build_memory
from dpresearch.compress.error_feedback import ErrorFeedback
from dpresearch.compress.layout import tensor_key
from dpresearch.compress.pairing import SYNC, check_pairing

HOOK_GRANULARITIES = ("tensor", "bucket")


@dataclass
class BucketPlan:
    """What the hook built for one composition of a DDP bucket."""

    aggregation: Aggregation
    columns: Tensor  # the bucket's entries in the model's flat parameter order


@dataclass
class HookState:
    """What the hook needs between calls: this rank's compressor and error-feedback memory,
    the communicator (whose ledger counts bytes), the step counter (one per backward pass) and
    a plan per bucket composition (DDP rebuilds its buckets after the first iteration)."""

    compressor: Compressor
    memory: ErrorFeedback
    comm: DistributedCommunicator
    granularity: str
    collective: str
    params: dict[int, tuple[str, int]]  # id(parameter) -> (chunk key, flat offset)
    step: int = 0
    plans: dict[tuple[int, ...], BucketPlan] = field(default_factory=dict)


def make_comm_hook(
    compressor: Compressor,
    model: nn.Module,
    error_feedback: ErrorFeedback | Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    granularity: str = "tensor",
    collective: str = "auto",
    network: NetworkModel | None = None,
) -> tuple["HookState", Any]:
    """(state, hook) for `ddp.register_comm_hook(state, hook)`.

    compressor: the method (seeded by the run; this rank's streams use its rank as worker id).
    model: the DDP model (or its module): its trainable parameters define the chunk keys and
    the memory's columns. error_feedback: an `ErrorFeedback`, its keyword arguments (e.g.
    {"mode": "ef14"}) or an `error_feedback` config node with `_target_`; None: none.
    granularity: "tensor" (each parameter its own chunk) or "bucket" (each DDP bucket one
    chunk). network: prices the recorded ops (default: 10 GbE).
    """
    if granularity not in HOOK_GRANULARITIES:
        raise ValueError(
            f"granularity={granularity!r}: a DDP hook sees one bucket at a time; "
            f"choose one of: {', '.join(HOOK_GRANULARITIES)}"
        )
    memory = (
        error_feedback
        if isinstance(error_feedback, ErrorFeedback)
        else build_memory(error_feedback)
    )
    check_pairing(compressor, memory, SYNC, collective)
    comm = DistributedCommunicator(network or NetworkModel.preset("10gbe"), group=process_group)
    params, offset = {}, 0
    trainable = [p for p in model.parameters() if p.requires_grad]
    for i, p in enumerate(trainable):
        params[id(p)] = (tensor_key(i), offset)
        offset += p.numel()
    first = trainable[0] if trainable else torch.empty(0)
    memory.bind(1, offset, first.dtype, first.device)
    state = HookState(compressor, memory, comm, granularity, collective, params)
    return state, compressed_hook


# No `from __future__ import annotations` here: DDP checks these annotations at runtime.
def compressed_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Aggregate one DDP bucket with the state's compressor and memory; a Future of the mean
    decoded gradient."""
    flat = bucket.buffer()
    plan = _plan(state, bucket, flat)
    g, memory, step = flat.unsqueeze(0), state.memory, state.step
    out = torch.empty_like(flat)
    p = memory.compensate(g, step, cols=plan.columns)
    if memory.warming_up(step):
        dense = p.clone()
        state.comm.all_reduce(dense, op="sum")
        torch.div(dense[0], state.comm.world_size, out=out)
        memory.warm(p, out, cols=plan.columns)
    else:
        sent = torch.empty_like(p) if memory.wants_sent else None
        plan.aggregation.run(p, state.comm, step, out, sent)
        if sent is not None:
            memory.update(p, sent, cols=plan.columns)
        memory.combine(out, plan.columns)
    if bucket.is_last():
        state.step += 1
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(out)
    return future


def _plan(state: HookState, bucket: dist.GradBucket, flat: Tensor) -> BucketPlan:
    """The plan for this bucket's composition (built on first sight)."""
    params = bucket.parameters()
    composition = tuple(id(p) for p in params)
    plan = state.plans.get(composition)
    if plan is not None:
        return plan
    chunks, columns, offset = [], [], 0
    for p in params:
        key, start = state.params[id(p)]
        if p.numel():
            chunks.append(Chunk(key, offset, p.numel(), tuple(p.shape)))
        columns.append(torch.arange(start, start + p.numel()))
        offset += p.numel()
    if offset != flat.numel():
        held = f"DDP bucket {bucket.index()} holds {flat.numel()} entries"
        raise RuntimeError(f"{held}, its parameters {offset}")
    if state.granularity == "bucket":
        chunks = [Chunk(f"bucket{bucket.index()}", 0, offset)]
    aggregation = state.compressor.aggregation(
        chunks, state.comm.local_workers, flat.dtype, flat.device, state.collective
    )
    plan = BucketPlan(aggregation, torch.cat(columns).to(flat.device))
    state.plans[composition] = plan
    return plan
