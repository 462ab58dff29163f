"""Synchronous data parallelism inside each node of a two-level cluster, the nodes drifting
apart: the inner algorithm of hierarchical DiLoCo (`algorithm=node_sync`, issue 41 item 4).

On `comm.hierarchy.workers_per_node=G`, every step the G workers of a node average their
gradients exactly over the intra-node tier (`tiers.intra`: one allreduce inside every node at
once, priced on `network.intra`) and each steps its optimizer on the node's mean — DDP inside
the node. Nodes never talk to each other here: an outer optimizer (`outer=nesterov`, DiLoCo)
joins them every `outer.period` steps, and since a node's workers hold one model it exchanges
the pseudo-gradients among the node leaders only (`Traits.node_replicas`; see
`dpresearch/algorithms/outer/optimizer.py`). This is torchft issue #171's "multiple DP groups
within each DiLoCo worker": a DiLoCo replica is a node of G data-parallel workers.

It is `SyncSGD` with the gradient communicator narrowed to the node (`gradient_comm`), and
what follows from the nodes differing: BatchNorm buffers broadcast from each node's leader
(`buffers="broadcast"`) or kept (`"local"`), the consensus the mean over all K workers, no
compressor inside the node (the fast link; the outer node compresses between nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from dpresearch.algorithms.base import Algorithm, Traits
from dpresearch.algorithms.sync import SyncSGD, check_buffers
from dpresearch.comm.base import Communicator
from dpresearch.options import Options
from dpresearch.replicas import Replicas


@dataclass(frozen=True)
class NodeSyncOptions(Options):
    """The `algorithm=node_sync` node (its YAML carries these defaults)."""

    buffers: str = "broadcast"
    """BatchNorm buffers: "broadcast" (each node's leader's, broadcast inside the node before
    every forward, as DDP in each node) or "local" (each worker its own)."""
    overlap: bool = True
    """Average the gradients during backward where a process holds one worker (as DDP)."""
    bucket_mb: float = 25.0
    """Size of the buckets averaged during backward (with `overlap`)."""

    def check(self) -> None:
        """One line naming the fix for a bad value."""
        check_buffers(self.buffers)
        if not isinstance(self.overlap, bool):
            raise ValueError(f"algorithm.overlap={self.overlap}: must be true or false")
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)):
            raise ValueError(f"algorithm.bucket_mb={self.bucket_mb}: must be a number > 0")
        if self.bucket_mb <= 0:
            raise ValueError(f"algorithm.bucket_mb={self.bucket_mb}: must be a number > 0")


NEEDS_HIERARCHY = (
    "algorithm=node_sync averages gradients inside each node of a two-level cluster; set "
    "comm.hierarchy.workers_per_node=G (workers per node)"
)
NEEDS_OUTER = (
    "algorithm=node_sync never joins its nodes by itself; add an outer optimizer across nodes, "
    "e.g. outer=nesterov outer.period=H (hierarchical DiLoCo)"
)


class NodeSyncSGD(SyncSGD):
    """Exact gradient averaging inside each node, one optimizer step per worker (see the
    module docstring). Built with the run's communicator, which must carry `tiers`."""

    traits = Traits(
        drifts=True,
        node_replicas=True,
        two_level=True,
        compression_note="averages its gradients uncompressed inside each node; compress the "
        "pseudo-gradients between nodes with compressor@outer.compressor=... instead",
    )
    channel = None  # nothing compressed inside a node
    OPTIONS = NodeSyncOptions

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        buffers: str = NodeSyncOptions.buffers,
        overlap: bool = NodeSyncOptions.overlap,
        bucket_mb: float = NodeSyncOptions.bucket_mb,
    ) -> None:
        NodeSyncOptions(buffers, overlap, bucket_mb).check()
        if comm.tiers is None:
            raise ValueError(NEEDS_HIERARCHY)
        super().__init__(
            replicas, comm, optimizers, buffers=buffers, bucket_mb=bucket_mb, overlap=overlap
        )

    def gradient_comm(self) -> Communicator:
        """Every node's own G workers (the intra tier)."""
        assert self.comm.tiers is not None
        return self.comm.tiers.intra

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """A two-level cluster, an outer optimizer to join the nodes, the options' values."""
        options = NodeSyncOptions.from_node(cfg.algorithm)
        options.check()
        if cfg.comm.hierarchy.get("workers_per_node") is None:
            raise ValueError(NEEDS_HIERARCHY)
        if not cfg.get("outer"):
            raise ValueError(NEEDS_OUTER)
        if cfg.train.get("eval_bn_stats") == "average" and options.buffers == "broadcast":
            raise ValueError(
                "train.eval_bn_stats=average with algorithm=node_sync averages the node "
                "leaders' broadcast statistics; add algorithm.buffers=local so each worker "
                "keeps its own"
            )

    def consensus(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Nodes differ between outer steps: the mean over all K workers.
        return Algorithm.consensus(self)
