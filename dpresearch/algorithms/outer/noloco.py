"""NoLoCo (Kolehmainen et al. 2025, "NoLoCo: No-all-reduce Low Communication Training Method
for Large Models", arXiv 2506.10911): DiLoCo without the all-reduce.

Every worker i keeps its own slow weights φ_i and outer momentum Δ_i (there is no global model).
It runs H inner steps of its base optimizer from φ_i to its fast weights θ_i (local SGD's steps,
any torch optimizer), then, instead of averaging over all K workers, it meets ONE peer j: the
workers are paired by a random perfect matching drawn afresh for every outer round from a seeded
stream every worker computes alike, and each pair {i, j} (n = 2) takes the outer step

    δ_i = φ_i − θ_i                                                (the pseudo-gradient)
    Δ_i ← α·Δ_i − β·(1/n)·Σ_{k∈{i,j}} δ_k − γ·(φ_i − (1/n)·Σ_{k∈{i,j}} φ_k)
    φ_i ← φ_i + Δ_i;    θ_i ← φ_i                                    (restart from φ_i)

α = `momentum`, β = `lr`, γ = `gamma`. The γ term pulls each replica toward its pair's mean
slow weights; with γ = 0 and K = 2 (the pair is everyone) it is DiLoCo with heavy-ball outer
momentum (torch SGD, momentum α, lr β). Inner optimizer states stay local and are kept.

One message per worker and round. Rewritten as
    Δ_i ← α·Δ_i − mean_{k∈{i,j}}(m_k) − γ·φ_i,    m_k = β·δ_k − γ·φ_k,
the pair's step needs only the peer's m_j: each worker sends one `[D]` row to its peer (a
point-to-point exchange), 4·D bytes in fp32 — where sending φ_j and δ_j would take twice that.
Float buffers (BatchNorm statistics) are averaged with the peer (`buffers=average`, "buffers"
traffic) or left (`local`). On the modeled clock (`time/modeled_s`) a round is one of each pair: a
worker waits for its peer only (`meetings`).

Evaluation: the mean of the K slow weights φ̄ (one allreduce, "eval" traffic).

Diagnostics, at each outer step before the update (`dpresearch/algorithms/diagnostics.py`):
`outer/pseudo_grad_cosine(_min)` over the δ rows, `outer/drift` = mean_k ‖θ_k − θ̄‖ (each
worker's distance from the workers' average: NoLoCo's replicas never share a model, so this is
taken from the θ rows themselves, not from the pseudo-gradients), `outer/momentum_norm` = the
mean over workers of ‖Δ_k‖; each one allgather, "metrics" traffic.

Source: the paper's abstract and the authors' public code (jkolehm/noloco, the group outer
step `sparse_optimizer_c.outer_step`: averages of φ and of θ − φ over a random group, then
m ← α·m + β·mean(θ − φ) + β·(mean φ − φ_i), φ ← φ + m, θ ← φ), whose β and γ are one
`outer_lr`; the paper's text (its equation with separate β and γ) could not be opened here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig
from torch import Tensor

from dpresearch.algorithms.base import Algorithm
from dpresearch.algorithms.diagnostics import OuterDiagnostics
from dpresearch.algorithms.outer.optimizer import OuterOptimizer, no_drift_message
from dpresearch.comm.base import Communicator
from dpresearch.comm.ledger import BUFFERS, METRICS
from dpresearch.compress.rng import generator, stream_seed
from dpresearch.options import Options
from dpresearch.replicas import Replicas

BUFFER_MODES = ("average", "local")


@dataclass(frozen=True)
class NoLoCoOptions(Options):
    """The `outer=noloco` node (`dpresearch/conf/outer/noloco.yaml` carries these defaults;
    its `seed` is the run's, wiring)."""

    NODE: ClassVar[str] = "outer"

    period: int | None = None
    """H, inner steps per outer round; null takes local SGD's `algorithm.period`."""
    momentum: float = 0.9
    """α, the outer momentum (the authors' code default `outer_momentum`)."""
    lr: float = 0.7
    """β, the outer learning rate on the pair's mean pseudo-gradient (`outer_lr`)."""
    gamma: float = 0.7
    """γ, the pull toward the pair's mean slow weights (the authors' code: equal to β)."""
    buffers: str = "average"
    """Float buffers (BatchNorm statistics): averaged with the peer, or kept `local`."""

    @classmethod
    def from_node(cls, node: Mapping[str, Any] | None) -> NoLoCoOptions:
        """Options from the `outer` node (missing keys: the defaults); `_target_` and
        `_recursive_` are Hydra's. ValueError (one line) for an unknown key."""
        values = {
            k: v for k, v in (node or {}).items() if not str(k).startswith("_") and k != "seed"
        }
        known = [f.name for f in fields(cls)]
        for key in values:
            if key not in known:
                raise ValueError(f"outer.{key} is not a NoLoCo option; valid: {', '.join(known)}")
        return cls(**values)

    def check(self) -> None:
        """ValueError (one line naming the fix) for a value NoLoCo cannot run."""
        period = self.period
        whole = isinstance(period, int) and not isinstance(period, bool)
        if period is not None and not (whole and period >= 1):
            raise ValueError(f"outer.period={period}: a whole number of steps >= 1, or null")
        for key in ("momentum", "lr", "gamma"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"outer.{key}={value}: must be a number")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"outer.momentum={self.momentum}: α must be in [0, 1)")
        if self.lr <= 0:
            raise ValueError(f"outer.lr={self.lr}: β must be > 0")
        if not 0.0 <= self.gamma <= 2.0:
            raise ValueError(
                f"outer.gamma={self.gamma}: γ must be in [0, 2] (γ > 2 overshoots the pair's mean)"
            )
        if self.buffers not in BUFFER_MODES:
            raise ValueError(
                f"outer.buffers={self.buffers}; choose one of: {', '.join(BUFFER_MODES)}"
            )


def pairing(workers: int, seed: int, round_: int) -> list[int]:
    """The peer of every worker in outer round `round_` (0-based): a uniformly random perfect
    matching of the `workers` (even) workers, the pairs (π₀, π₁), (π₂, π₃), … of a random
    permutation π seeded by (seed, round) alone, so every process draws the same one."""
    perm = torch.randperm(workers, generator=generator(stream_seed("noloco", seed, round_)))
    peer = [0] * workers
    for a, b in perm.view(-1, 2).tolist():
        peer[a], peer[b] = b, a
    return peer


class NoLoCo(OuterOptimizer):
    """NoLoCo over local SGD (see the module docstring).

    The outer optimizer's delegation to the base algorithm, its traffic accounting and its
    schedule are reused; its anchor θ and torch optimizer are not used (NoLoCo keeps one slow
    model per worker and steps it by hand).
    """

    OPTIONS = NoLoCoOptions

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        base: Algorithm,
        period: int | None = NoLoCoOptions.period,
        momentum: float = NoLoCoOptions.momentum,
        lr: float = NoLoCoOptions.lr,
        gamma: float = NoLoCoOptions.gamma,
        buffers: str = NoLoCoOptions.buffers,
        seed: int = 0,
    ) -> None:
        self.options = NoLoCoOptions(period, momentum, lr, gamma, buffers)
        self.seed = seed  # the pairings' (the run's seed)
        self.options.check()
        check_world(comm.world_size)
        super().__init__(
            replicas,
            comm,
            optimizers,
            base,
            {"_target_": "torch.optim.SGD", "lr": 1.0},
            period=period,
            buffers=buffers,
        )
        if self.base.hand_over_averaging() is None:
            raise ValueError(base_message(type(base).__name__))
        self._deltas = []  # the all-reduce's Δ buffers (W·D): NoLoCo forms its rows per round
        # φ_i and Δ_i of the local workers, `[W, D]`
        self.slow = self.base.model_rows().clone()
        self.velocity = torch.zeros_like(self.slow)
        self.rounds = 0
        self.drift = OuterDiagnostics(1)  # over the θ rows: only its drift is read
        self._met: list[tuple[int, int]] | None = None  # the pairs of this step's round

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """The node's options, an even number of workers, local SGD's period to take over."""
        from hydra.utils import get_object

        options = NoLoCoOptions.from_node(cfg.outer)
        options.check()
        check_world(int(cfg.workers))
        base = get_object(cfg.algorithm._target_)
        if not base.traits.drifts:
            raise ValueError(no_drift_message(base.__name__))
        if base.outer_handover(cfg.algorithm) is None:
            raise ValueError(base_message(base.__name__))

    # -- the outer step ----------------------------------------------------------------------------
    def _outer(self, step: int) -> None:
        done = step + 1
        if done % self.schedule.period:
            return
        with self._accounted() as sent:
            self._round(done // self.schedule.period - 1)
        self.peak_step_bytes = max(self.peak_step_bytes, sent[0])

    def _round(self, round_: int) -> None:
        """Outer round `round_`: pair, exchange one row with the peer, step φ, restart θ."""
        o, comm = self.options, self.comm
        theta = self.base.model_rows()
        delta = self.slow - theta  # δ_i
        self.diagnostics.observe(0, delta, comm)
        self.drift.observe(0, theta, comm)
        self.last_delta_norm = float(delta[0].double().norm())
        peer = pairing(comm.world_size, self.seed, round_)
        peers = [(p,) for p in peer]
        self._met = [(i, p) for i, p in enumerate(peer) if i < p]
        message = delta.mul_(o.lr).sub_(self.slow, alpha=o.gamma)  # m_i = β·δ_i − γ·φ_i
        received = comm.neighbor_exchange(message, peers, peers)[:, 0]
        pair_mean = message.add_(received).mul_(0.5)
        # Δ_i ← α·Δ_i − mean(m) − γ·φ_i;  φ_i ← φ_i + Δ_i
        self.velocity.mul_(o.momentum).sub_(pair_mean).sub_(self.slow, alpha=o.gamma)
        self.slow.add_(self.velocity)
        self.replicas.params.copy_(self.slow)
        rows = self.replicas.buffers
        if o.buffers == "average" and rows.shape[1] > 0:
            theirs = comm.neighbor_exchange(rows, peers, peers, record=BUFFERS)[:, 0]
            rows.add_(theirs).mul_(0.5)
        self.base.restarted()
        self.rounds += 1

    def meetings(self) -> list[tuple[int, int]] | None:
        """The pairs that met in the step just taken (None: no round; the modeled clock asks
        once per step, `run/modeled_clock.py`)."""
        met, self._met = self._met, None
        return met

    # -- evaluation, reporting ---------------------------------------------------------------------
    def consensus(self) -> tuple[Tensor, Tensor]:
        """φ̄ and the workers' mean buffers (one allreduce each, "eval" traffic)."""
        params, buffers = self.slow.clone(), self.replicas.buffers.clone()
        self.comm.all_reduce(params, op="mean", record="eval")
        self.comm.all_reduce(buffers, op="mean", record="eval")
        return params[0], buffers[0]

    def metrics(self) -> dict[str, float]:
        rounds = self.rounds
        norms = torch.linalg.vector_norm(self.velocity.double(), dim=1, keepdim=True)
        every = self.comm.all_gather(norms, record=METRICS)
        drift = self.drift.metrics().get("outer/drift")
        return {
            **self.base.metrics(),
            "outer/rounds": float(rounds),
            "outer/peak_step_bytes": float(self.peak_step_bytes),
            "outer/bytes_per_round": self.outer_bytes / rounds if rounds else 0.0,
            "outer/modeled_s_per_round": self.outer_modeled_s / rounds if rounds else 0.0,
            "outer/delta_norm": self.last_delta_norm,
            **self.diagnostics.metrics(),
            **({"outer/drift": drift} if drift is not None else {}),
            "outer/momentum_norm": every.mean().item(),
        }

    def describe(self) -> dict[str, Any]:
        o = self.options
        return {
            **self.base.describe(),
            "outer/period": self.schedule.period,
            "noloco/momentum": o.momentum,
            "noloco/lr": o.lr,
            "noloco/gamma": o.gamma,
        }

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "base": self.base.state_dict(),
            "slow": self.slow,
            "velocity": self.velocity,
            "rounds": self.rounds,
            "peak_step_bytes": self.peak_step_bytes,
            "outer_bytes": self.outer_bytes,
            "outer_modeled_s": self.outer_modeled_s,
            "last_delta_norm": self.last_delta_norm,
            "diagnostics": self.diagnostics.state_dict(),
            "drift": self.drift.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.base.load_state_dict(state["base"])
        self.slow.copy_(state["slow"])
        self.velocity.copy_(state["velocity"])
        self.rounds = int(state["rounds"])
        self.peak_step_bytes = int(state["peak_step_bytes"])
        self.outer_bytes = int(state["outer_bytes"])
        self.outer_modeled_s = float(state["outer_modeled_s"])
        self.last_delta_norm = float(state["last_delta_norm"])
        self.diagnostics.load_state_dict(state["diagnostics"])
        self.drift.load_state_dict(state["drift"])


def check_world(workers: int) -> None:
    """A perfect matching needs an even number of workers."""
    if workers < 2 or workers % 2:
        raise ValueError(
            f"workers={workers}: NoLoCo pairs every worker with one peer, so it needs an even "
            "number of workers >= 2"
        )


def base_message(name: str) -> str:
    return (
        f"outer=noloco replaces local SGD's periodic averaging and {name} has none to hand "
        "over; use algorithm=local_sgd (its algorithm.period is H, or set outer.period)"
    )


__all__ = ["NoLoCo", "NoLoCoOptions", "pairing"]
