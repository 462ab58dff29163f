"""Part (a) of the asynchronous study: the least-squares set-up of Mishchenko et al. 2022
("Asynchronous SGD beats minibatch SGD under arbitrary delays"; konstmish/asynchronous_sgd).

    f(x) = 1/(2n) ‖Ax − b‖²,  A ∈ R^{n×d} with entries U(0, 1)/√d,  b = A·x̄ + 1e-5·N(0, I),
    n = 10⁴, d = 400, x₀ = 0; every worker samples its minibatch of 256 rows (without
    replacement) from all n rows with its own generator; M = 40 workers.

The simulation is `AsyncSGD` itself — the event clock, protocols, server and staleness policies
of `algorithm=async_sgd` — driven by this script, which computes each planned worker's minibatch
gradient in closed form (Aᵢᵀ(Aᵢx − bᵢ)/256) in place of the trainer's forward/backward.
Compute times: exponential with mean 1 (the unit of simulated time); the straggler case slows
worker 0 by 100×, as the authors' "bad worker" sleeps 100× its compute time. Methods:
minibatch SGD (protocol=sync: the mean of the 40 gradients per update), asynchronous SGD with a
constant lr, and asynchronous SGD with the delay-adaptive lr η·M/max(M, τ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from dpresearch.algorithms.async_sgd import AsyncSGD
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.replicas import Replicas

N, DIM, BATCH, WORKERS = 10_000, 400, 256, 40

METHODS: dict[str, dict] = {
    "minibatch SGD (sync)": {"protocol": "sync"},
    "async SGD, constant lr": {"protocol": "asgd", "lr_policy": "constant"},
    "async SGD, delay-adaptive lr": {"protocol": "asgd", "lr_policy": "delay_adaptive"},
}
# lr grids (sync: the lr of the mean of M gradients, = M × the authors' lr on their sum).
GRIDS: dict[str, list[float]] = {
    "minibatch SGD (sync)": [1.0, 2.0, 4.0, 7.6, 12.0],
    "async SGD, constant lr": [0.1, 0.2, 0.43, 0.8, 1.6],
    "async SGD, delay-adaptive lr": [0.2, 0.43, 0.8, 1.6, 3.2],
}
CASES = {"no straggler": {}, "one 100× straggler": {"slow_workers": [0], "slowdown": 100.0}}


@dataclass
class Problem:
    a: torch.Tensor
    b: torch.Tensor
    f_star: float

    def loss(self, x: torch.Tensor) -> float:
        r = self.a @ x - self.b
        return 0.5 * float(r.double().pow(2).mean())


def make_problem(seed: int = 42) -> Problem:
    """The authors' generator (numpy, seed 42), in float64."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(size=(N, DIM)) / np.sqrt(DIM)
    x_bar = rng.normal(size=DIM)
    b = a @ x_bar + 1e-5 * rng.normal(size=N)
    x_opt = np.linalg.lstsq(a, b, rcond=None)[0]
    f_star = 0.5 * float(np.mean((a @ x_opt - b) ** 2))
    return Problem(torch.from_numpy(a), torch.from_numpy(b), f_star)


@dataclass
class Trace:
    """f(x) − f* of the server's model against simulated time, pushes and updates."""

    time: list[float] = field(default_factory=list)
    pushes: list[int] = field(default_factory=list)
    updates: list[int] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)

    @property
    def final(self) -> float:
        return self.gap[-1]

    def at(self, t: float) -> float:
        """f − f* at the last point recorded no later than simulated time `t`."""
        before = [g for s, g in zip(self.time, self.gap, strict=True) if s <= t]
        return before[-1] if before else self.gap[0]


def simulate(
    problem: Problem,
    method: str,
    lr: float,
    case: str,
    budget_s: float,
    seed: int = 0,
    points: int = 60,
) -> Trace:
    """Run `method` at `lr` until `budget_s` of simulated time; record `points` points."""
    torch.manual_seed(seed)
    model = nn.Linear(DIM, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    replicas = Replicas(model, WORKERS, torch.device("cpu"))
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in replicas.models]
    comm = SimulatedCommunicator(WORKERS, NetworkModel.preset("10gbe"))
    options = {"speed": "exponential", "compute_s": 1.0, **METHODS[method], **CASES[case]}
    algorithm = AsyncSGD(replicas, comm, optimizers, options=options, seed=seed)
    generators = [np.random.default_rng([seed, w]) for w in range(WORKERS)]
    grads, params = replicas.grads, replicas.params
    trace, every = Trace(), budget_s / points
    server = algorithm.server
    step, next_point = 0, 0.0
    while True:
        plan = algorithm.plan(step)
        now = algorithm.simulated_s
        if now >= next_point or now > budget_s:
            t = min(now, budget_s)
            trace.time.append(t)
            trace.pushes.append(step)
            trace.updates.append(server.version)
            gap = problem.loss(server.params) - problem.f_star
            trace.gap.append(gap if math.isfinite(gap) else math.inf)
            next_point = now + every
            if now > budget_s or not math.isfinite(gap) or gap > 1e12:
                break
        for w in plan.workers:
            rows = torch.from_numpy(generators[w].choice(N, size=BATCH, replace=False))
            a, b = problem.a.index_select(0, rows), problem.b.index_select(0, rows)
            grads[w].copy_(a.T @ (a @ params[w] - b) / BATCH)
        algorithm.set_lr(1.0)
        algorithm.after_backward(step)
        step += 1
    trace.histogram = algorithm.summary()["async/tau_histogram"]
    return trace


def tune(problem: Problem, case: str, budget_s: float, log=print) -> dict[str, tuple]:
    """Every method at every lr of its grid; returns {method: (best lr, {lr: trace})}, the best
    being the lowest final f − f* (seed 0)."""
    out = {}
    for method, grid in GRIDS.items():
        traces = {}
        for lr in grid:
            traces[lr] = simulate(problem, method, lr, case, budget_s)
            log(f"  {case} | {method} | lr {lr:g}: f−f* {traces[lr].final:.3e}")
        best = min(grid, key=lambda lr: traces[lr].final)
        out[method] = (best, traces)
    return out
