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
from typing import Any

import torch
from omegaconf import DictConfig

from dpresearch.algorithms.gossip import Gossip
from dpresearch.comm.base import Communicator
from dpresearch.comm.topology import Topology
from dpresearch.compress import build_compressor, param_layout, plan_buckets
from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.replicas import Replicas


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

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        topology: Mapping[str, Any] | None = None,
        gamma: float = 0.5,
        compressor: Mapping[str, Any] | None = None,
        error_feedback: Mapping[str, Any] | None = None,
        seed: int = 0,
        granularity: str = "tensor",
        bucket_mb: float = 25.0,
        state_dtype: str = "float64",
        mix_buffers: bool = True,
        eval_local_models: bool = True,
    ) -> None:
        super().__init__(replicas, comm, optimizers, topology, mix_buffers, eval_local_models)
        check_gamma(gamma)
        self.gamma = gamma
        node = compressor or {"_target_": "dpresearch.compress.casts.Identity"}
        if error_feedback is not None and _ef_active(error_feedback):
            raise ValueError(EF_MESSAGE)
        self.codecs = [build_compressor(node, None, seed, w) for w in comm.local_workers]
        lead = self.codecs[0]
        if not isinstance(lead, SingleRoundCompressor) or not lead.gossip:
            raise ValueError(codec_message(type(lead).__name__))
        chunks = [
            Chunk(ch.key, bucket.start + ch.offset, ch.numel, ch.shape)
            for bucket in plan_buckets(
                param_layout(replicas.models[0]),
                granularity,
                bucket_mb,
                replicas.params.element_size(),
            )
            for ch in bucket.chunks
        ]
        params = replicas.params
        self.wire_plan = lead.wire_plan(chunks, params.dtype)
        check_state_dtype(state_dtype)
        dtype = STATE_DTYPES[state_dtype]
        self.x_hat = torch.zeros_like(params, dtype=dtype)
        self.s = torch.zeros_like(params, dtype=dtype)
        layout = self.wire_plan.layout
        self.wire = torch.empty(
            comm.num_local, layout.size, dtype=layout.dtype, device=params.device
        )

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        super().check_config(cfg)
        alg = cfg.algorithm
        check_gamma(alg.get("gamma", 0.5))
        check_state_dtype(alg.get("state_dtype", "float64"))
        if alg.get("error_feedback") is not None and _ef_active(alg.error_feedback):
            raise ValueError(EF_MESSAGE)
        from hydra.utils import instantiate

        node = alg.get("compressor") or {"_target_": "dpresearch.compress.casts.Identity"}
        codec = instantiate(node, seed=0, worker=0)
        if not isinstance(codec, SingleRoundCompressor) or not codec.gossip:
            raise ValueError(codec_message(type(codec).__name__))

    @classmethod
    def check_topology(cls, topology: Topology) -> None:
        super().check_topology(topology)
        if topology.period != 1:
            raise ValueError(TIME_VARYING_MESSAGE.format(name=topology.name))

    def after_backward(self, step: int) -> None:
        for opt in self.optimizers:
            opt.step()
        params, x_hat, s, plan = self.replicas.params, self.x_hat, self.s, self.wire_plan
        delta = (params - x_hat).to(params.dtype)
        for w, codec in enumerate(self.codecs):
            codec.encode(delta[w], plan, step, self.wire[w])
        received = self.start_exchange(self.wire, step, "wire").wait()
        own_w, peer_w = self.local_weights(step)
        in_degree = [len(self.topology.in_peers(step)[i]) for i in self.comm.local_workers]
        decoded, term = torch.empty_like(params[0]), torch.empty_like(s[0])
        lead = self.codecs[0]
        for w in range(self.comm.num_local):
            lead.decode(self.wire[w], plan, step, decoded)
            x_hat[w].add_(decoded)
            torch.mul(decoded, own_w[w], out=term)
            s[w].add_(term)
            for p in range(in_degree[w]):
                lead.decode(received[w, p], plan, step, decoded)
                torch.mul(decoded, peer_w[w, p], out=term)
                s[w].add_(term)
        # x^{t+1} = x^{t+½} + γ (s − x̂)
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
EF_MESSAGE = (
    "CHOCO-SGD's public copies x̂ already compensate the compression error; set error_feedback=none"
)
TIME_VARYING_MESSAGE = (
    "algorithm=choco keeps s_i = Σ_j w_ij x̂_j, which needs a fixed graph; "
    "topology={name} changes every step: use a static topology (ring, torus, exponential, ...)"
)


def codec_message(name: str) -> str:
    return (
        f"compressor {name} cannot be used for gossip (multi-round protocol or a vote, not a "
        "weighted sum of decoded messages); choose e.g. compressor=topk, randomk, qsgd, sign, "
        "terngrad, fp16 or identity"
    )


def check_state_dtype(state_dtype: str) -> None:
    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"algorithm.state_dtype={state_dtype}; choose one of: {', '.join(STATE_DTYPES)}"
        )


def check_gamma(gamma: float) -> None:
    if not 0.0 < float(gamma) <= 1.0:
        raise ValueError(f"algorithm.gamma={gamma}: the consensus step size must be in (0, 1]")


def _ef_active(node: Mapping[str, Any]) -> bool:
    return node.get("mode", "none") != "none" or float(node.get("momentum", 0.0) or 0.0) > 0
