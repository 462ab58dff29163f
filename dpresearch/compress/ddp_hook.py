"""Any compressor (with error feedback) as a communication hook for torch's DistributedDataParallel.

The five lines a user writes (one process per rank, process group initialised):

    from dpresearch.compress import TopK, make_comm_hook
    ddp = DistributedDataParallel(model)
    state, hook = make_comm_hook(lambda rank: TopK(ratio=0.01, seed=0, worker=rank),
                                 error_feedback={"mode": "ef14"}, model=ddp)
    ddp.register_comm_hook(state, hook)
    # ... train as usual; state.comm.ledger.bytes_sent counts the bytes this rank sent.

The hook runs the compressor's own protocol (`Compressor.aggregate`) over the torch.distributed
process group, one worker per process, and returns an already-completed Future: communication
does not overlap the rest of the backward pass (a correctness-first adapter for research runs).
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import Tensor, nn

from dpresearch.comm.distributed import DistributedCommunicator
from dpresearch.comm.network import NetworkModel
from dpresearch.compress.base import Chunk, Compressor
from dpresearch.compress.error_feedback import ErrorFeedback
from dpresearch.compress.layout import tensor_key

HOOK_GRANULARITIES = ("tensor", "bucket")


@dataclass
class HookState:
    """What the hook needs between calls: this rank's compressor (and its memory), the
    communicator (whose ledger counts bytes), and the step counter (one per backward pass)."""

    compressor: Compressor
    comm: DistributedCommunicator
    granularity: str
    collective: str
    keys: dict[int, str] | None
    step: int = 0


def make_comm_hook(
    compressor_factory: Callable[[int], Compressor],
    error_feedback: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    granularity: str = "tensor",
    collective: str = "auto",
    model: nn.Module | None = None,
    network: NetworkModel | None = None,
) -> tuple["HookState", Callable[["HookState", dist.GradBucket], torch.futures.Future]]:
    """(state, hook) for `ddp.register_comm_hook(state, hook)`.

    compressor_factory(rank) builds this rank's compressor. error_feedback: `ErrorFeedback`
    keyword arguments (e.g. {"mode": "ef14"}) or an `error_feedback` config node with
    `_target_`; None: no wrapper. granularity: "tensor" (each parameter its own chunk) or
    "bucket" (each DDP bucket one chunk). model: pass the (DDP) model so that per-tensor chunks
    are keyed by parameter index exactly as `CompressedReducer` keys them — then a hooked DDP run
    reproduces a simulated run; without it chunks are keyed by bucket position. network: prices
    the recorded ops (default: 10 GbE).
    """
    if granularity not in HOOK_GRANULARITIES:
        raise ValueError(
            f"granularity={granularity!r}: a DDP hook sees one bucket at a time; "
            f"choose one of: {', '.join(HOOK_GRANULARITIES)}"
        )
    comm = DistributedCommunicator(network or NetworkModel.preset("10gbe"), group=process_group)
    compressor = compressor_factory(comm.local_workers[0])
    if error_feedback is not None:
        if "_target_" in error_feedback:
            compressor = instantiate(error_feedback, inner=compressor)
        else:
            compressor = ErrorFeedback(compressor, **error_feedback)
    keys = None
    if model is not None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        keys = {id(p): tensor_key(i) for i, p in enumerate(trainable)}
    state = HookState(compressor, comm, granularity, collective, keys)
    return state, compressed_hook


# No `from __future__ import annotations` here: DDP checks these annotations at runtime.
def compressed_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Aggregate one DDP bucket with the state's compressor; a Future of the mean decoded
    gradient."""
    flat = bucket.buffer()
    chunks = _chunks(state, bucket.index(), bucket.parameters(), flat.numel())
    out = torch.empty_like(flat)
    protocol = type(state.compressor).aggregate
    protocol(
        [state.compressor], [flat], chunks, state.comm, state.step, out, collective=state.collective
    )
    if bucket.is_last():
        state.step += 1
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(out)
    return future


def _chunks(
    state: HookState, index: int, params: Sequence[Tensor], numel: int
) -> tuple[Chunk, ...]:
    if state.granularity == "bucket":
        return (Chunk(f"bucket{index}", 0, numel),)
    chunks, offset = [], 0
    for j, p in enumerate(params):
        key = state.keys[id(p)] if state.keys is not None else f"b{index}.{j}"
        if p.numel():
            chunks.append(Chunk(key, offset, p.numel(), tuple(p.shape)))
        offset += p.numel()
    if offset != numel:
        raise RuntimeError(f"DDP bucket {index} holds {numel} entries, its parameters {offset}")
    return tuple(chunks)
