"""Synchronous data-parallel SGD: aggregate the workers' (compressed) gradients, every worker
steps on the result.

The gradient exchange is a `CompressedReducer` built from the `compressor` and
`error_feedback` nodes: linear payloads are allreduced, the others allgathered and decoded. On a
two-level cluster (`comm.hierarchy`) it is a `HierarchicalReducer`: exact sums inside each node,
compression between node leaders, broadcast back.
With the identity compressor this is exactly what torch DDP computes. Gradient clipping
(`train.grad_clip`) clips the averaged gradient, as DDP + `clip_grad_norm_` does; with a
compressor (or error feedback) each worker's own gradient, before it is encoded. BatchNorm
buffers follow DDP's default (`broadcast_buffers=True`): before every forward, worker 0's
buffers are copied to all workers, so the running statistics are worker 0's (recorded as
"buffers" traffic, charged to worker 0, not as the algorithm's `comm/bytes`); `buffers="local"`
keeps each worker's own (DDP with `broadcast_buffers=False`) and evaluates with worker 0's, or
with the workers' mean under `train.eval_bn_stats=average` (`dpresearch/run/evaluation.py`).
Running statistics never enter a training-mode forward, so the buffer mode changes evaluation
only, not the trajectory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from dpresearch.algorithms.base import Algorithm, Traits
from dpresearch.algorithms.diagnostics import reducers_memory_norm
from dpresearch.algorithms.overlap import OverlappedGradientAverage
from dpresearch.comm.base import Communicator
from dpresearch.comm.hierarchy import INTER, INTRA
from dpresearch.compress import ChannelNeeds, build_reducer, param_layout
from dpresearch.compress.build import ChannelOptions
from dpresearch.compress.channel import uncompressed
from dpresearch.replicas import Replicas

BUFFER_MODES = ("broadcast", "local")
TIERS = (INTRA, INTER)


@dataclass(frozen=True)
class SyncOptions(ChannelOptions):
    """Synchronous SGD's keys (`algorithm=sync`; its codec: the `compressor` and
    `error_feedback` nodes)."""

    buffers: str = "broadcast"
    """broadcast (DDP's default: worker 0's BatchNorm statistics before every forward) |
    local"""
    granularity: str = "auto"
    """what one compressor call sees: auto | tensor | bucket | model"""
    collective: str = "auto"
    """auto | allreduce | allgather: how the compressed messages are aggregated"""
    overlap: bool = True
    """average uncompressed gradients during backward on one-worker processes (as DDP)"""

    def check(self) -> None:
        check_buffers(self.buffers)


def tier_bytes(comm: Communicator, device: torch.device) -> dict[str, float]:
    """Per tier of a two-level cluster: `comm/bytes_<tier>`, the mean over all K workers of
    the algorithm's bytes each sent in that tier, and `comm/modeled_s_<tier>`, the modeled
    seconds of that tier's ops (the most any process recorded: on real ranks only leaders
    take part in the inter tier). One gather, recorded as metrics traffic."""
    ledger = comm.ledger
    zeros = [0] * comm.num_local
    seconds = ledger.modeled_by_tier()
    mine = torch.tensor(
        [ledger.bytes_by_tier.get(t, zeros) for t in TIERS]
        + [[seconds.get(t, 0.0)] * comm.num_local for t in TIERS],
        dtype=torch.float64,
        device=device,
    ).T.contiguous()
    every = comm.all_gather(mine, record="metrics")
    means, most = every[:, : len(TIERS)].mean(0).tolist(), every[:, len(TIERS) :].amax(0).tolist()
    return {
        **{f"comm/bytes_{t}": m for t, m in zip(TIERS, means, strict=True)},
        **{f"comm/modeled_s_{t}": s for t, s in zip(TIERS, most, strict=True)},
    }


class SyncSGD(Algorithm):
    """Gradient aggregation (compressed or not), then one optimizer step per worker.

    compressor / error_feedback: config nodes (`_target_`s) built once for this process's
    workers (worker w's random streams seeded by (`seed`, w)); None means identity without
    error feedback. overlap: average
    uncompressed gradients during backward where a process holds one worker (see
    `overlap.py`); the result is the same as after backward.
    """

    traits = Traits(two_level=True)  # a `HierarchicalReducer` on `comm.hierarchy`
    channel = ChannelNeeds()  # every worker's gradients aggregated by a collective
    OPTIONS = SyncOptions

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        buffers: str = SyncOptions.buffers,
        compressor: Mapping[str, Any] | None = None,
        error_feedback: Mapping[str, Any] | None = None,
        seed: int = 0,
        granularity: str = SyncOptions.granularity,
        bucket_mb: float = SyncOptions.bucket_mb,
        collective: str = SyncOptions.collective,
        overlap: bool = SyncOptions.overlap,
    ) -> None:
        super().__init__(replicas, comm, optimizers)
        check_buffers(buffers)
        self.buffer_mode = buffers
        comm = self.gradient_comm()
        self.reducer = build_reducer(
            compressor,
            error_feedback,
            comm,
            param_layout(replicas.models[0]),
            seed,
            granularity=granularity,
            bucket_mb=bucket_mb,
            collective=collective,
            dtype=replicas.grads.dtype,
            device=replicas.grads.device,
        )
        # whether the aggregate is the exact mean (the identity, no memory; whatever collective)
        self.exact = uncompressed(self.reducer.compressor, self.reducer.memory)
        # Uncompressed gradients on one-worker processes are averaged during backward.
        self.overlap = (
            OverlappedGradientAverage(replicas, comm, bucket_mb)
            if overlap and self.reducer.passthrough and comm.can_overlap and replicas.num_local == 1
            else None
        )

    def gradient_comm(self) -> Communicator:
        """The communicator the gradients are averaged over: all K workers."""
        return self.comm

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """The buffer mode, before any worker starts (the compressor: `check_compatibility`)."""
        opts = SyncOptions.from_node(cfg.algorithm)
        opts.check()
        if opts.buffers == "broadcast" and cfg.train.get("eval_bn_stats") == "average":
            # Broadcast before every forward, the workers' statistics are worker 0's but for
            # the last step's update: their mean would not be the workers' own.
            raise ValueError(
                "train.eval_bn_stats=average with algorithm=sync averages worker 0's broadcast "
                "statistics; add algorithm.buffers=local so each worker keeps its own"
            )

    def before_forward(self, step: int) -> None:
        if self.buffer_mode == "broadcast" and self.replicas.buffers.shape[1] > 0:
            self.gradient_comm().broadcast(self.replicas.buffers, src=0, record="buffers")

    def drop_step(self, step: int) -> None:
        if self.overlap is not None:
            self.overlap.finish()

    def after_backward(self, step: int) -> None:
        # `train.grad_clip`: an exact average is clipped as DDP + clip_grad_norm_ clips it
        # (every row holds it); a compressed exchange clips each worker's own gradient before
        # the codec and its error-feedback memory, so a spike neither travels nor is stored
        # unclipped to be replayed later
        exact = self.exact
        if self.overlap is not None:
            self.overlap.finish()
        else:
            if not exact:
                self.clip_gradients()
            self.reducer.reduce(self.replicas.grads, step)
        if exact:
            self.clip_gradients()
        self.step_optimizers(clip=False)

    def metrics(self) -> dict[str, float]:
        """On a two-level cluster: `comm/bytes_intra` and `comm/bytes_inter`, the algorithm's
        bytes each worker sent inside its node and between nodes (means over all K workers;
        they add up to `comm/bytes`); with an error-feedback memory, `ef/memory_norm`."""
        ef = reducers_memory_norm([self.reducer])
        if self.comm.tiers is None:
            return ef
        return {**tier_bytes(self.comm, self.replicas.grads.device), **ef}

    def state_dict(self) -> dict:
        return {"reducer": self.reducer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.reducer.load_state_dict(state["reducer"])

    def consensus(self) -> tuple[Tensor, Tensor]:
        # Parameters are identical on every worker; the buffers are worker 0's.
        buffers = self.replicas.buffers.clone()
        self.comm.broadcast(buffers, src=0, record="eval")
        return self.replicas.params[0].clone(), buffers[0]


def check_buffers(buffers: str) -> None:
    if buffers not in BUFFER_MODES:
        raise ValueError(f"algorithm.buffers={buffers}; choose one of: {', '.join(BUFFER_MODES)}")
