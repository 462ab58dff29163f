"""Decentralized training: workers average with their graph neighbours instead of everyone.

`Gossip` is the base of the gossip algorithms (D-PSGD here, CHOCO-SGD in `choco.py`, SGP in
`sgp.py`). It owns the communication graph (a `Topology` built for K workers from the
`topology` config node), the per-step mixing weights of the local workers, the weighted sum
they apply to what they receive, the consensus-distance metric and the evaluation of every
worker's own model beside the average model x̄.

Conventions shared by every gossip algorithm:
- Row i of the mixing matrix W(t) holds the weights worker i gives to itself and to its
  in-peers: x_i ← Σ_j w_ij x_j, added self first, then in-peers in ascending id order, with
  separate multiply and add (no fused kernels), so the result is bit-identical on K simulated
  workers and on K processes.
- BatchNorm statistics and other float buffers are mixed like the parameters, with the same
  weights, every step (`mix_buffers=true`), and travel uncompressed (recorded as "buffers"
  traffic, apart from the algorithm's `comm/bytes`).
- Optimizer state (momentum) stays local.
- `consensus()` is the average model x̄ = (1/K) Σ_i x_i ("eval" traffic); it is what
  `test/acc` evaluates. `test/acc_local_mean` / `test/acc_local_min` evaluate each worker's own
  model (`eval_local_models=true`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import Tensor

from dpresearch.algorithms.base import Algorithm, Traits
from dpresearch.comm.base import Communicator, PendingOp
from dpresearch.comm.ledger import BUFFERS, METRICS
from dpresearch.comm.topology import Topology
from dpresearch.compress.workspace import Workspace
from dpresearch.options import Options
from dpresearch.replicas import Replicas

ORDERS = ("combine_then_adapt", "adapt_then_combine")
# float64 elements of the differences one block of the consensus distance holds (~1 MB).
DISTANCE_BLOCK_ELEMENTS = 1 << 17


def build_topology(topology: Mapping[str, Any], num_workers: int) -> Topology:
    """The topology of the config node `topology` for `num_workers` workers."""
    return instantiate(topology, num_workers=num_workers)


def consensus_distance(comm: Communicator, x: Tensor, workspace: Workspace | None = None) -> float:
    """Ξ² = (1/K) Σ_i ‖x_i − x̄‖² of the workers' rows `x` `[W, D]` in float64 ("metrics"
    traffic: the sum of the rows, then the K squared distances; see `Gossip.metrics`).
    `workspace`: where the blocks of differences go, kept by a caller that measures often (a
    fresh megabyte per block cost page faults several times its arithmetic); the same
    values either way."""
    mean = comm.sum_over_workers(x, torch.float64, record=METRICS)[0]
    mean.div_(comm.world_size)
    sq = torch.zeros(x.shape[0], 1, dtype=torch.float64, device=x.device)
    block = max(4096, DISTANCE_BLOCK_ELEMENTS // max(1, x.shape[0]))
    for lo in range(0, x.shape[1], block):
        cols = x[:, lo : lo + block]
        if workspace is None:
            diff = cols - mean[lo : lo + block]  # float64 (type promotion)
        else:
            out = workspace.get("distance", cols.shape, torch.float64, x.device)
            diff = torch.sub(cols, mean[lo : lo + block], out=out)
        sq[:, 0] += diff.square_().sum(1)
    comm.all_reduce(sq, op="sum", record=METRICS)
    return sq[0, 0].item() / comm.world_size


@dataclass(frozen=True)
class GossipOptions(Options):
    """The keys every gossip algorithm takes (`algorithm=sgp` has these only)."""

    mix_buffers: bool = True
    """mix float buffers (BatchNorm statistics) with the neighbours' every step, with the same
    weights ("buffers" traffic)"""
    eval_local_models: bool = True
    """at evaluation points also evaluate every worker's own model (test/acc_local_mean,
    _min)"""


@dataclass(frozen=True)
class DPSGDOptions(GossipOptions):
    """D-PSGD's keys (`algorithm=dpsgd`; Gossip-PGA with `global_average_every`)."""

    order: str = "combine_then_adapt"
    """combine_then_adapt (Lian: mix, then step on the gradient at the pre-mixing point) |
    adapt_then_combine (step, then mix)"""
    overlap: bool = True
    """with combine_then_adapt, exchange x_t while the forward/backward at x_t computes"""
    global_average_every: int | None = None
    """H: an exact average of all workers every H steps (Gossip-PGA); null: none"""

    def check(self) -> None:
        check_dpsgd_options(self.order, self.global_average_every)


class Gossip(Algorithm):
    """Base class: graph, mixing weights, neighbour averaging, consensus metrics.

    topology: the `topology` config node (a `_target_` taking `num_workers`).
    mix_buffers: average float buffers (BatchNorm statistics) with the neighbours' every step.
    eval_local_models: at evaluation points also evaluate every worker's own model.
    """

    evaluates_local_models = True
    traits = Traits(drifts=True)
    OPTIONS: ClassVar[type[Options]] = GossipOptions
    # the graph when the `topology` node names none
    default_topology: ClassVar[Mapping[str, Any]] = {"_target_": "dpresearch.comm.topology.Ring"}

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        topology: Mapping[str, Any] | None = None,
        mix_buffers: bool = GossipOptions.mix_buffers,
        eval_local_models: bool = GossipOptions.eval_local_models,
    ) -> None:
        super().__init__(replicas, comm, optimizers)
        self.topology = build_topology(topology or self.default_topology, comm.world_size)
        self.check_topology(self.topology)
        self.mix_buffers = mix_buffers
        self.evaluates_local_models = eval_local_models
        self._weights: dict[int, tuple[Tensor, Tensor]] = {}
        self._workspace = Workspace()
        self.setup_state()

    def setup_state(self) -> None:
        """State of a subclass's own beyond the topology and workspace (built last in
        `__init__`; default: none), e.g. SGP's push-sum weights."""

    # -- configuration checks (before any worker starts) --------------------------------------
    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Raise ValueError (one line naming the fix) for a configuration this algorithm cannot
        run: a topology impossible for `workers`, or one whose weights the algorithm cannot
        use; then its declared options' own check."""
        super().check_config(cfg)
        if cfg.workers < 2:
            raise ValueError(f"workers={cfg.workers}: gossip needs at least 2 workers")
        topology = build_topology(
            cfg.algorithm.get("topology") or cls.default_topology, cfg.workers
        )
        cls.check_topology(topology)

    @classmethod
    def check_topology(cls, topology: Topology) -> None:
        """Mean-preserving averaging needs a doubly stochastic W(t)."""
        if not topology.is_doubly_stochastic:
            raise ValueError(
                f"topology={topology.name} with weights={topology.weights} is not doubly "
                "stochastic, so averaging would drift from the mean; set "
                "topology.weights=metropolis, or use algorithm=sgp (push-sum) for this graph"
            )

    def describe(self) -> dict[str, Any]:
        return {"topology": self.topology.describe()}

    # -- mixing ---------------------------------------------------------------------------------
    def peers(self, step: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """(out_peers, in_peers) of every worker at `step`."""
        return self.topology.out_peers(step), self.topology.in_peers(step)

    def local_weights(self, step: int, matrix: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(self weights [W], in-peer weights [W, P]) of the local workers at `step`, in the
        parameters' dtype; P is the largest in-degree, padded with zeros. `matrix`: weights
        other than the mixing matrix (e.g. push-sum's); not cached."""
        phase = step % self.topology.period
        if matrix is None and phase in self._weights:
            return self._weights[phase]
        w = self.topology.mixing_matrix(step) if matrix is None else matrix
        ins = self.topology.in_peers(step)
        width = max((len(p) for p in ins), default=0)
        own = torch.empty(self.comm.num_local, dtype=torch.float64)
        peer = torch.zeros(self.comm.num_local, width, dtype=torch.float64)
        for row, i in enumerate(self.comm.local_workers):
            own[row] = w[i, i]
            for slot, j in enumerate(ins[i]):
                peer[row, slot] = w[i, j]
        dtype, device = self.replicas.params.dtype, self.replicas.params.device
        result = (own.to(device, dtype), peer.to(device, dtype))
        if matrix is None:
            self._weights[phase] = result
        return result

    def workspace(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A buffer of `like`'s dtype and device kept across steps (`compress.Workspace`: a
        fresh multi-megabyte tensor every step costs page faults); its contents are whatever
        the last user left."""
        return self._workspace.get(name, shape, like.dtype, like.device)

    def start_exchange(
        self, x: Tensor, step: int, name: str = "params", record: bool | str = True
    ) -> PendingOp:
        """Send every local row to its out-peers at `step`; `wait()` gives `[W, P, ...]`, held
        in the workspace buffer `name` (valid until the next exchange under that name). The
        exchange named "buffers" (BatchNorm statistics) is recorded as buffers traffic."""
        if record is True and name == BUFFERS:
            record = BUFFERS
        outs, ins = self.peers(step)
        width = self.comm.exchange_plan(outs, ins).width
        out = self.workspace(f"recv.{name}", (x.shape[0], width, *x.shape[1:]), x)
        return self.comm.start_neighbor_exchange(x, outs, ins, record=record, out=out)

    @staticmethod
    def weighted_sum(
        own: Tensor, received: Tensor, own_w: Tensor, peer_w: Tensor, out: Tensor, term: Tensor
    ) -> Tensor:
        """out[w] = own_w[w]·own[w] + Σ_p peer_w[w, p]·received[w, p], self first, then slots in
        order; separate multiply and add, so every backend rounds identically. `out` may be
        `own` (in place); `term` is scratch of own's shape."""
        shape = (-1,) + (1,) * (own.dim() - 1)
        torch.mul(own, own_w.view(shape), out=out)
        for p in range(received.shape[1]):
            torch.mul(received[:, p], peer_w[:, p].view(shape), out=term)
            out.add_(term)
        return out

    def gossip_average(
        self, x: Tensor, step: int, received: Tensor | None = None, name: str = "params"
    ) -> None:
        """In place: x_i ← Σ_j w_ij x_j over the graph of `step` (exchanging x under the
        workspace name `name` unless the received rows are given)."""
        if received is None:
            received = self.start_exchange(x, step, name).wait()
        own_w, peer_w = self.local_weights(step)
        term = self.workspace(f"term.{name}", tuple(x.shape), x)
        self.weighted_sum(x, received, own_w, peer_w, x, term)

    def mix_float_buffers(self, step: int) -> None:
        if self.mix_buffers and self.replicas.buffers.shape[1] > 0:
            self.gossip_average(self.replicas.buffers, step, name="buffers")

    # -- metrics ----------------------------------------------------------------------------------
    def models(self) -> Tensor:
        """The `[W, D]` parameter rows the workers evaluate (and whose spread is measured)."""
        return self.replicas.params

    def metrics(self) -> dict[str, float]:
        """`gossip/consensus_distance`: Ξ² = (1/K) Σ_i ‖x_i − x̄‖² in float64 ("metrics"
        traffic: the sum of the rows, then the K squared distances). Two reads of the rows:
        x̄ is summed straight into float64 (no float64 copy of the rows, no mean written into
        every row), and the distances are taken over column blocks small enough that their
        float64 differences stay in cache."""
        distance = consensus_distance(self.comm, self.models(), self._workspace)
        return {"gossip/consensus_distance": distance}


class DPSGD(Gossip):
    """D-PSGD (Lian et al., NeurIPS 2017), with optional periodic global averaging
    (Gossip-PGA, Chen et al., ICML 2021).

    order="combine_then_adapt" (Lian et al.):  x_{t+1} = Σ_j w_ij x_j^t − η·u_i(g_i(x_i^t)),
      the gradient taken at the pre-mixing point, so the exchange of x_t runs while the
      forward/backward at x_t computes (`overlap=true`; real on processes).
    order="adapt_then_combine":  x_{t+1} = Σ_j w_ij (x_j^t − η·u_j), the local step first —
      CHOCO-SGD's step semantics (CHOCO with the identity compressor and γ = 1 is exactly this).
    u is the local optimizer's update (momentum stays local; with combine_then_adapt, weight
    decay is taken at the mixed point, where the optimizer steps).
    global_average_every=H: every H steps all workers average exactly (one allreduce of the
    parameters and buffers), after the gossip step.
    """

    OPTIONS = DPSGDOptions

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        topology: Mapping[str, Any] | None = None,
        order: str = DPSGDOptions.order,
        overlap: bool = DPSGDOptions.overlap,
        global_average_every: int | None = DPSGDOptions.global_average_every,
        mix_buffers: bool = GossipOptions.mix_buffers,
        eval_local_models: bool = GossipOptions.eval_local_models,
    ) -> None:
        super().__init__(replicas, comm, optimizers, topology, mix_buffers, eval_local_models)
        check_dpsgd_options(order, global_average_every)
        self.order = order
        self.overlap = overlap and order == "combine_then_adapt"
        self.global_average_every = global_average_every
        self._pending: PendingOp | None = None

    def before_forward(self, step: int) -> None:
        if self.overlap:
            self._pending = self.start_exchange(self.replicas.params, step)

    def drop_step(self, step: int) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def after_backward(self, step: int) -> None:
        params = self.replicas.params
        if self.order == "combine_then_adapt":
            received = self._pending.wait() if self._pending is not None else None
            self._pending = None
            self.gossip_average(params, step, received)
            self.step_optimizers()
        else:
            self.step_optimizers()
            self.gossip_average(params, step)
        self.mix_float_buffers(step)
        if self.global_average_every and (step + 1) % self.global_average_every == 0:
            self.comm.all_reduce(params, op="mean")
            if self.mix_buffers and self.replicas.buffers.shape[1] > 0:
                self.comm.all_reduce(self.replicas.buffers, op="mean", record=BUFFERS)


def check_dpsgd_options(order: Any, global_average_every: Any) -> None:
    """Raise ValueError (one line) for an unknown order or a global-averaging period that is
    not a whole number >= 1 (null: never)."""
    if order not in ORDERS:
        raise ValueError(f"algorithm.order={order}; choose one of: {', '.join(ORDERS)}")
    every = global_average_every
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(
            f"algorithm.global_average_every={every}: average every H >= 1 steps, or null"
        )
