"""CHOCO-SGD (Koloskova, Stich & Jaggi, ICML 2019; Koloskova, Lin et al., ICLR 2020): gossip
with compressed messages and any single-round compressor of the library.

Per step, every worker i:
    x_i^{t+½} = x_i^t − η·u_i                        (local optimizer step on its gradient)
    q_i = C(x_i^{t+½} − x̂_i)                         (encode; sent to the out-peers)
    x̂_j ← x̂_j + D(q_j)   for j = i and every in-peer
    x_i^{t+1} = x_i^{t+½} + γ Σ_j w_ij (x̂_j − x̂_i)

x̂ starts at 0. As in the authors' code, a worker keeps only its own x̂_i and
s_i = Σ_j w_ij x̂_j (updated by s_i += Σ_j w_ij D(q_j), self first, then in-peers in ascending
order), since Σ_j w_ij (x̂_j − x̂_i) = s_i − x̂_i when rows of W sum to one — two `[W, D]`
buffers instead of one per neighbour. That needs W fixed over time: time-varying topologies
are rejected. D(q_i) is decoded from the wire row itself, so x̂_i is exactly what the
neighbours hold for worker i.

Bytes: each worker sends its wire row (the compressor's documented payload for the parameter
chunks) to each out-peer; float buffers are mixed uncompressed, as in D-PSGD.
With the identity compressor and γ = 1 this is D-PSGD with order=adapt_then_combine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dpresearch.algorithms.gossip import Gossip, GossipOptions
from dpresearch.comm.base import Communicator
from dpresearch.comm.topology import Topology
from dpresearch.compress import ChannelNeeds, open_channel
from dpresearch.compress.build import ChannelOptions
from dpresearch.replicas import Replicas


@dataclass(frozen=True)
class ChocoOptions(GossipOptions, ChannelOptions):
    """CHOCO-SGD's keys (`algorithm=choco`; its compressor is the `compressor` node)."""

    gamma: float = 0.5
    """consensus step size γ in (0, 1]; tune it (python -m dpresearch.tune_gamma): ChocoSGD
    used 0.04 for top-1% and 0.45 for sign on a ring"""
    state_dtype: str = "float64"
    """dtype of x̂ and s, running sums whose rounding accumulates: float64 | float32 (half the
    memory)"""

    def check(self) -> None:
        check_gamma(self.gamma)
        check_state_dtype(self.state_dtype)


class ChocoSGD(Gossip):
    """CHOCO-SGD with consensus step size `gamma` ∈ (0, 1] and a gossip-capable compressor.

    compressor: the `compressor` config node (built once per local worker, seeded by
    (`seed`, worker id)); granularity: "tensor" (one chunk per parameter tensor, as the
    sync reducer's default), "bucket" or "model" (one chunk for the whole model).
    state_dtype: dtype of x̂ and s. They are running sums never recomputed from scratch, so in
    float32 their rounding accumulates step after step (with the identity compressor and γ = 1,
    1.6e-6 away from D-PSGD after 10 steps of a small MLP, against 3.6e-7 in float64);
    "float32" halves their memory for large models.
    """

    channel = ChannelNeeds.gossip("CHOCO-SGD")
    OPTIONS = ChocoOptions

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        topology: Mapping[str, Any] | None = None,
        gamma: float = ChocoOptions.gamma,
        compressor: Mapping[str, Any] | None = None,
        error_feedback: Mapping[str, Any] | None = None,
        seed: int = 0,
        granularity: str = ChocoOptions.granularity,
        bucket_mb: float = ChocoOptions.bucket_mb,
        state_dtype: str = ChocoOptions.state_dtype,
        mix_buffers: bool = ChocoOptions.mix_buffers,
        eval_local_models: bool = ChocoOptions.eval_local_models,
    ) -> None:
        super().__init__(replicas, comm, optimizers, topology, mix_buffers, eval_local_models)
        check_gamma(gamma)
        self.gamma = gamma
        params = replicas.params
        # (the identity too runs the codec: x̂ and s are written against decoded messages)
        self.codec = open_channel(
            self.channel,
            replicas.models[0],
            params,
            comm.local_workers,
            compressor,
            error_feedback,
            seed,
            granularity,
            bucket_mb,
            shortcut=False,
        ).codec
        check_state_dtype(state_dtype)
        dtype = STATE_DTYPES[state_dtype]
        self.x_hat = torch.zeros_like(params, dtype=dtype)
        self.s = torch.zeros_like(params, dtype=dtype)

    @classmethod
    def check_topology(cls, topology: Topology) -> None:
        super().check_topology(topology)
        if topology.period != 1:
            raise ValueError(TIME_VARYING_MESSAGE.format(name=topology.name))

    def after_backward(self, step: int) -> None:
        self.step_optimizers()
        params, x_hat, s, codec = self.replicas.params, self.x_hat, self.s, self.codec
        wire = codec.encode((params - x_hat).to(params.dtype), step)
        received = self.start_exchange(wire, step, "wire").wait()  # [W, P, L]
        own_w, peer_w = self.local_weights(step)
        # x̂_i += D(q_i); s_i += w_ii·D(q_i) + Σ_j w_ij·D(q_j), self first, then in-peers in
        # ascending order (padding slots are zero rows with weight 0).
        codec.accumulate(wire.unsqueeze(1), step, x_hat)
        rows = self.workspace("rows", (wire.shape[0], 1 + received.shape[1], wire.shape[1]), wire)
        rows[:, 0].copy_(wire)
        rows[:, 1:].copy_(received)
        codec.accumulate(rows, step, s, torch.cat([own_w.unsqueeze(1), peer_w], 1))
        # x^{t+1} = x^{t+½} + γ (s − x̂), formed in the state's precision
        params.copy_(params + self.gamma * (s - x_hat))
        self.mix_float_buffers(step)

    def state_dict(self) -> dict:
        return {"x_hat": self.x_hat.clone(), "s": self.s.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.x_hat.copy_(state["x_hat"])
        self.s.copy_(state["s"])

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        err = (self.replicas.params - self.x_hat).double().pow(2).sum(dim=1, keepdim=True)
        self.comm.all_reduce(err, op="sum", record="metrics")
        # How far the public copies x̂ trail the models: what compression has not yet delivered.
        out["gossip/x_hat_error"] = err[0, 0].item() / self.comm.world_size
        return out


STATE_DTYPES = {"float64": torch.float64, "float32": torch.float32}
TIME_VARYING_MESSAGE = (
    "algorithm=choco keeps s_i = Σ_j w_ij x̂_j, which needs a fixed graph; "
    "topology={name} changes every step: use a static topology (ring, torus, exponential, ...)"
)


def check_state_dtype(state_dtype: str) -> None:
    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"algorithm.state_dtype={state_dtype}; choose one of: {', '.join(STATE_DTYPES)}"
        )


def check_gamma(gamma: float) -> None:
    if not 0.0 < float(gamma) <= 1.0:
        raise ValueError(f"algorithm.gamma={gamma}: the consensus step size must be in (0, 1]")
