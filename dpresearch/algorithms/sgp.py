"""Stochastic Gradient Push (Assran, Loizou, Ballas & Rabbat, ICML 2019): push-sum gossip on
directed, possibly time-varying graphs.

Every worker i holds a push-sum weight w_i (starting at 1) and trains the de-biased model
z_i = x_i / w_i (what `replicas.params` holds, what forward/backward and evaluation see). Per
step, as in the authors' implementation:
    z_i ← z_i − η·u_i                                (local optimizer step at z_i)
    x_i = w_i·z_i
    i sends a_i·(x_i, w_i) to each out-peer and keeps a_i·(x_i, w_i), a_i = 1/(outdeg_i + 1)
    (x_i, w_i) ← Σ of what i kept and received      (self first, then in-peers ascending)
    z_i = x_i / w_i
The weights a form the column-stochastic push matrix P(t) = `topology.push_matrix(t)`, so
Σ_i x_i and Σ_i w_i are preserved and z_i → Σ x / Σ w without a doubly stochastic matrix:
any strongly connected directed graph works (default: the time-varying one-peer exponential
graph of the paper). On regular graphs such as that one, w stays exactly 1 and SGP is D-PSGD
(adapt then combine) with W = P.

Bytes: one row of D + 1 elements (parameters and the weight) per out-peer per step; float
buffers travel as a second push-sum row when `mix_buffers=true`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dpresearch.algorithms.gossip import Gossip
from dpresearch.comm.topology import Topology

DEFAULT_TOPOLOGY = {"_target_": "dpresearch.comm.topology.OnePeerExponential"}


class SGP(Gossip):
    """Push-sum SGD; the consensus model is Σ_i x_i / Σ_i w_i."""

    default_topology = DEFAULT_TOPOLOGY

    def setup_state(self) -> None:
        params = self.replicas.params
        self.ps_weight = torch.ones(
            self.comm.num_local, 1, dtype=params.dtype, device=params.device
        )

    @classmethod
    def check_topology(cls, topology: Topology) -> None:
        """Push-sum needs only the column-stochastic push matrix, which every graph has."""

    def after_backward(self, step: int) -> None:
        self.step_optimizers()
        params = self.replicas.params
        share = self._share(step)
        weight = self.ps_weight
        d = params.shape[1]
        message = self.workspace("message", (params.shape[0], d + 1), params)
        torch.mul(params, weight, out=message[:, :d])
        message[:, d:] = weight
        message.mul_(share)
        total = self._push(message, step, "params")
        new_weight = total[:, d:].clone()
        if self.mix_buffers and self.replicas.buffers.shape[1] > 0:
            buffers = self.replicas.buffers
            pushed = self._push(buffers * weight * share, step, "buffers")
            torch.div(pushed, new_weight, out=buffers)
        torch.div(total[:, :d], new_weight, out=params)
        self.ps_weight.copy_(new_weight)

    def _share(self, step: int) -> Tensor:
        """[W, 1]: a_i = 1/(outdeg_i + 1), the fraction each local worker keeps and sends."""
        push = self.topology.push_matrix(step)
        own = [push[i, i].item() for i in self.comm.local_workers]
        params = self.replicas.params
        return torch.tensor(own, dtype=params.dtype, device=params.device).unsqueeze(1)

    def _push(self, message: Tensor, step: int, name: str) -> Tensor:
        """In place: `message` becomes the Σ of the kept share and the received shares
        (already scaled by their senders)."""
        received = self.start_exchange(message, step, name).wait()
        ones = torch.ones(message.shape[0], dtype=message.dtype, device=message.device)
        present = torch.zeros(received.shape[:2], dtype=message.dtype, device=message.device)
        ins = self.topology.in_peers(step)
        for row, i in enumerate(self.comm.local_workers):
            present[row, : len(ins[i])] = 1
        term = self.workspace(f"term.{name}", tuple(message.shape), message)
        return self.weighted_sum(message, received, ones, present, message, term)

    def consensus(self) -> tuple[Tensor, Tensor]:
        numerators = self.replicas.params * self.ps_weight
        weights = self.ps_weight.clone()
        buffers = self.replicas.buffers * self.ps_weight
        self.comm.all_reduce(numerators, op="mean", record="eval")
        self.comm.all_reduce(weights, op="mean", record="eval")
        self.comm.all_reduce(buffers, op="mean", record="eval")
        return numerators[0] / weights[0], buffers[0] / weights[0]

    def model_rows(self) -> Tensor:
        """The push-sum numerators x_i = w_i·z_i: Σ_i w_i = K is preserved, so their mean is
        Σ x / Σ w, the consensus (the plain mean of the z_i, where the weights differ)."""
        return self.replicas.params * self.ps_weight

    def restarted(self) -> None:
        """Every worker restarts from one model z with weight 1 (x = z), as at the start."""
        self.ps_weight.fill_(1.0)

    def state_dict(self) -> dict:
        return {"ps_weight": self.ps_weight.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.ps_weight.copy_(state["ps_weight"])
