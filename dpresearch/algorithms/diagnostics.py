"""Diagnostics of drifting and compressed methods, over the stacked `[W, D]` rows.

Outer methods (`OuterDiagnostics`, logged by every outer optimizer), from the Gram matrix
G = Δ Δᵀ of the workers' pseudo-gradients Δ_k = θ − x_k at a sync point (before the outer
step; the rows the base algorithm averages: SGP's push-sum numerators):

- `outer/pseudo_grad_cosine`, `outer/pseudo_grad_cosine_min`: the mean and the min over worker
  pairs k < j of cos(Δ_k, Δ_j) = G_kj / √(G_kk·G_jj) (0 where a Δ is 0);
- `outer/drift`: the mean over workers of the Euclidean (L2) distance of x_k from the workers'
  average x̄, over all trained parameters: x_k − x̄ = Δ̄ − Δ_k.

The rows are centered first (C = Δ − Δ̄, so the drift is ‖C_k‖ with no cancellation) and G is
rebuilt from C Cᵀ, C Δ̄ and ‖Δ̄‖²: two products over D in the rows' dtype, the rest K × K in
float64. With Streaming DiLoCo's fragments each fragment's parts are taken when it is sent and
the logged figures use the sum of every fragment's latest ones (the whole model, each part at
its own sync point; with one fragment: the last outer step's). Every worker's row is needed for
the pairs (no allgather of norms or dots gives Δ_k·Δ_j): on real ranks one allgather of the Δ
rows at each sync (purpose "metrics": in `comm/bytes_metrics`, never in `comm/modeled_s` or
`time/modeled_s`); the simulator makes the same call, so both log the same bytes and figures.

`outer_momentum_norm`: the L2 norm of the outer optimizer's momentum over the whole anchor
(SGD's `momentum_buffer`, Adam's `exp_avg`; 0 without one) — `outer/momentum_norm`.

`memory_norm`: `ef/memory_norm`, the mean over all K workers of the L2 norm of each worker's
error-feedback memory (EF14's e_w; EF21's state h_w), every memory it holds together (all
fragments or buckets); one allgather of a scalar per worker (purpose "metrics"). Logged by
synchronous SGD, every outer method with compressed Δ and asynchronous SGD in the simulator (on
real ranks each worker's push memory lives on its own process, which logs nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.comm.ledger import METRICS
from dpresearch.compress.error_feedback import ErrorFeedback

MOMENTUM_KEYS = ("momentum_buffer", "exp_avg")  # torch SGD's, Adam(W)'s
CHUNK = 1 << 16  # columns centered at a time: a [K, CHUNK] block stays in cache


def gram_metrics(centered: Tensor, to_mean: Tensor, mean_sq: Tensor) -> dict[str, float]:
    """The cosine and drift figures of the module docstring from the Gram of the centered rows
    C = Δ − Δ̄ (`[K, K]`), the dots C_k·Δ̄ (`[K]`) and ‖Δ̄‖², all float64: the Gram of Δ is
    G_kj = C_kj + (C_k + C_j)·Δ̄ + ‖Δ̄‖², and ‖x_k − x̄‖ = ‖C_k‖ (no cancellation)."""
    k = centered.shape[0]
    gram = centered + to_mean[:, None] + to_mean[None, :] + mean_sq
    norms = gram.diagonal().clamp_min(0).sqrt()
    scale = norms[:, None] * norms[None, :]
    cos = torch.where(scale > 0, gram / scale, torch.zeros_like(gram))
    pairs = cos[torch.triu_indices(k, k, 1).unbind()]
    return {
        "outer/pseudo_grad_cosine": pairs.mean().item() if k > 1 else float("nan"),
        "outer/pseudo_grad_cosine_min": pairs.min().item() if k > 1 else float("nan"),
        "outer/drift": centered.diagonal().clamp_min(0).sqrt().mean().item(),
    }


class OuterDiagnostics:
    """Per fragment, the latest sync's Gram parts (see `gram_metrics`). `group`: the rows come
    in runs of `group` equal rows (a node of hierarchical DiLoCo, `Traits.node_replicas`), so
    the pairs are taken between the runs' first rows: cosines between nodes (the drift, equal
    on a node's workers, is the same either way)."""

    def __init__(self, fragments: int, group: int = 1) -> None:
        self.parts: list[tuple[Tensor, Tensor, Tensor] | None] = [None] * fragments
        self.group = group

    def observe(self, fragment: int, delta: Tensor, comm: Communicator) -> None:
        """Fragment `fragment`'s local Δ rows `[W, n]`, before they are averaged."""
        rows = comm.all_gather_read(delta, record=METRICS)  # [K, n]: read, never written
        mean = rows.mean(0)
        k = rows.shape[0]
        gram, to_mean = rows.new_zeros(k, k), rows.new_zeros(k)
        # centered a block of columns at a time (no [K, n] copy); two products over n in the
        # rows' dtype, everything after K × K in float64
        for start in range(0, rows.shape[1], CHUNK):
            part = mean[start : start + CHUNK]
            centered = rows[:, start : start + CHUNK] - part
            gram.addmm_(centered, centered.T)
            to_mean.addmv_(centered, part)
        self.parts[fragment] = (
            gram.double(),
            to_mean.double(),
            torch.linalg.vector_norm(mean, dtype=torch.float64).square(),
        )

    def metrics(self) -> dict[str, float]:
        seen = [p for p in self.parts if p is not None]
        if not seen:
            return {}
        gram, to_mean, mean_sq = (sum(parts) for parts in zip(*seen, strict=True))
        if self.group > 1:
            firsts = torch.arange(0, gram.shape[0], self.group)
            gram, to_mean = gram[firsts][:, firsts], to_mean[firsts]
        return gram_metrics(gram, to_mean, mean_sq)

    def state_dict(self) -> dict:
        return {"parts": list(self.parts)}

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None:  # (None: a checkpoint from before the diagnostics)
            self.parts = [None if p is None else tuple(p) for p in state["parts"]]


def outer_momentum_norm(optimizers: Iterable[torch.optim.Optimizer]) -> float:
    """L2 norm of the outer optimizers' momentum over all their parameters (0: none)."""
    total = 0.0
    for opt in optimizers:
        for state in opt.state.values():
            buffer = next((state[k] for k in MOMENTUM_KEYS if state.get(k) is not None), None)
            if buffer is not None:
                total += float(torch.linalg.vector_norm(buffer)) ** 2  # (a cast costs more)
    return total**0.5


def memory_norm(memories: Sequence[ErrorFeedback], comm: Communicator) -> dict[str, float]:
    """`ef/memory_norm` over `memories` (each bound to this process's local rows); {} when
    none holds a memory."""
    held = [m.memory for m in memories if m.memory is not None]
    if not held:
        return {}
    # [W]: each local worker's ‖e‖² over all its memories
    local = sum(torch.linalg.vector_norm(m, dim=1).double().square() for m in held)
    every = comm.all_gather(local.unsqueeze(1), record=METRICS)  # [K, 1]
    return {"ef/memory_norm": every.sqrt().mean().item()}


def reducers_memory_norm(reducers: Sequence[Any]) -> dict[str, float]:
    """`memory_norm` of synchronous reducers' memories (`CompressedReducer`s, each over its
    own communicator). On a two-level cluster (`HierarchicalReducer`) the memory is the node
    leaders', over the inter-node communicator: the mean is over nodes, and a process that
    leads no node logs nothing."""
    holders = [getattr(r, "inner", r) for r in reducers]
    holders = [h for h in holders if h is not None]
    if not holders:
        return {}
    return memory_norm([h.memory for h in holders], holders[0].comm)
