"""Diagnostics of drifting and compressed methods, over the stacked `[W, D]` rows.

Outer methods (`OuterDiagnostics`, logged by every outer optimizer), from the Gram matrix
G = Δ Δᵀ of the workers' pseudo-gradients Δ_k = θ − x_k at a sync point (before the outer
step; the rows the base algorithm averages: SGP's push-sum numerators), in float64:

- `outer/pseudo_grad_cosine`, `outer/pseudo_grad_cosine_min`: the mean and the min over worker
  pairs k < j of cos(Δ_k, Δ_j) = G_kj / √(G_kk·G_jj) (0 where a Δ is 0);
- `outer/drift`: the mean over workers of the Euclidean (L2) distance of x_k from the workers'
  average x̄, over all trained parameters: x_k − x̄ = Δ̄ − Δ_k, so
  ‖x_k − x̄‖² = G_kk − (2/K)·Σ_j G_kj + (1/K²)·Σ_ij G_ij.

With Streaming DiLoCo's fragments each fragment's Gram is taken when it is sent and the logged
figures use the sum of every fragment's latest one (the whole model, each part at its own sync
point; with one fragment: the last outer step's). Every worker's row is needed for the pairs:
on real ranks one allgather of the Δ rows at each sync (purpose "metrics": in `comm/bytes_metrics`,
never in `comm/modeled_s`); the simulator makes the same call, so both log the same bytes and the
same Gram.

`outer_momentum_norm`: the L2 norm of the outer optimizer's momentum over the whole anchor
(SGD's `momentum_buffer`, Adam's `exp_avg`; 0 without one) — `outer/momentum_norm`.

`memory_norm`: `ef/memory_norm`, the mean over all K workers of the L2 norm of each worker's
error-feedback memory (EF14's e_w; EF21's state h_w), every memory it holds together (all
fragments or buckets); one allgather of a scalar per worker (purpose "metrics").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.comm.ledger import METRICS
from dpresearch.compress.error_feedback import ErrorFeedback

MOMENTUM_KEYS = ("momentum_buffer", "exp_avg")  # torch SGD's, Adam(W)'s


def gram_metrics(gram: Tensor) -> dict[str, float]:
    """The cosine and drift figures of the module docstring from a `[K, K]` float64 Gram."""
    k = gram.shape[0]
    norms = gram.diagonal().clamp_min(0).sqrt()
    scale = norms[:, None] * norms[None, :]
    cos = torch.where(scale > 0, gram / scale, torch.zeros_like(gram))
    pairs = cos[torch.triu_indices(k, k, 1).unbind()]
    row_mean = gram.mean(1)
    drift_sq = gram.diagonal() - 2 * row_mean + gram.mean()
    return {
        "outer/pseudo_grad_cosine": pairs.mean().item() if k > 1 else float("nan"),
        "outer/pseudo_grad_cosine_min": pairs.min().item() if k > 1 else float("nan"),
        "outer/drift": drift_sq.clamp_min(0).sqrt().mean().item(),
    }


class OuterDiagnostics:
    """The latest Gram of each of `fragments` fragments' pseudo-gradient rows."""

    def __init__(self, fragments: int) -> None:
        self.grams: list[Tensor | None] = [None] * fragments

    def observe(self, fragment: int, delta: Tensor, comm: Communicator) -> None:
        """Fragment `fragment`'s local Δ rows `[W, n]`, before they are averaged."""
        rows = comm.all_gather(delta, record=METRICS).to(torch.float64)  # [K, n]
        self.grams[fragment] = rows @ rows.T

    def metrics(self) -> dict[str, float]:
        seen = [g for g in self.grams if g is not None]
        return gram_metrics(torch.stack(seen).sum(0)) if seen else {}

    def state_dict(self) -> dict:
        return {"grams": list(self.grams)}

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None:  # (None: a checkpoint from before the diagnostics)
            self.grams = list(state["grams"])


def outer_momentum_norm(optimizers: Iterable[torch.optim.Optimizer]) -> float:
    """L2 norm of the outer optimizers' momentum over all their parameters (0: none)."""
    total = 0.0
    for opt in optimizers:
        for state in opt.state.values():
            buffer = next((state[k] for k in MOMENTUM_KEYS if state.get(k) is not None), None)
            if buffer is not None:
                total += float(buffer.double().square().sum())
    return total**0.5


def memory_norm(memories: Sequence[ErrorFeedback], comm: Communicator) -> dict[str, float]:
    """`ef/memory_norm` over `memories` (each bound to this process's local rows); {} when
    none holds a memory."""
    held = [m.memory for m in memories if m.memory is not None]
    if not held:
        return {}
    local = sum(m.double().square().sum(1) for m in held)  # [W]: each local worker's ‖e‖²
    every = comm.all_gather(local.unsqueeze(1), record=METRICS)  # [K, 1]
    return {"ef/memory_norm": every.sqrt().mean().item()}
