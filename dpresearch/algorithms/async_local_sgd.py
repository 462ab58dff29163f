"""Asynchronous Local-SGD (Liu et al. 2024, "Asynchronous Local-SGD Training for Language
Modeling"): every worker runs H local steps of its own optimizer from the parameters it pulled,
at its own speed, and pushes its pseudo-gradient Δ = x_start − x_end to a parameter server,
which applies each Δ on arrival with an outer optimizer (DiLoCo's SGD with Nesterov momentum,
lr 0.7, momentum 0.9); the worker then pulls the server's current parameters and starts again.

It is asynchronous SGD's server over its event simulator (`AsyncSGD`, `asynchrony/`): the same
protocol node (asgd applies each Δ on arrival; sync averages the K pushes of a round, which is
DiLoCo), staleness policy and statistics (τ = updates the server made while the worker ran its
H steps), push channel (compressed Δ with each worker's error feedback), speed models and
clock — the clock draws a worker's H compute times per push (`EventClock.steps`).

One step is one local step of one worker, on its own next batch (`train.steps` counts batches,
as for asynchronous SGD): the clock names the next worker to push, which runs its H_w steps
(its row holds its pull since it was released: nothing computed on it meanwhile, so computing
them now gives the same result as computing them as the simulated time passes), then pushes.
`time/simulated_s` (and so `time/modeled_s`) of a step is the arrival time of the push it
belongs to.

Options (`AsyncLocalOptions`): `period` H; `delayed_nesterov` N (Delayed Nesterov, the paper's
Algorithm 2 with c = 0): the pseudo-gradients g_t are buffered, and

    every arrival:     θ ← θ − (ε/N)·g_t                       (plain outer-lr steps)
    every N-th:        m ← β·m + (1/N)·Σ_window g;  θ ← θ − ε·β·m

which is: the outer optimizer steps every N arrivals on the window's mean, from where the window
started (θ_s ← OuterOpt(θ_s, Σ g/N), θ ← θ_s), and in between θ = θ_s − (ε/N)·Σ_so_far g —
the same outer optimizer object as DiLoCo's (N = 1: it steps on every arrival);
`dynamic_local_updates` (DyLU): worker k runs H_k = max(1, ⌊H·v_k/v_max⌋) local steps, v_k its
mean speed under the speed model (1 / (compute_s × its slowdown)).

Real ranks (`backend=gloo|nccl`): K workers and a server as for asynchronous SGD; a worker
(`AsyncLocalWorker`) runs its H_w steps per pull on its own rank and pushes Δ; the server takes
the push at a round's first step and applies it at its H_w-th, so `train.steps` counts the same
local steps and, with `async.order=seeded`, a real run computes what the simulator computes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from dpresearch.algorithms.async_sgd import (
    AsyncSGD,
    AsyncSGDOptions,
    AsyncWorker,
    uses_channels_last,
)
from dpresearch.algorithms.base import Algorithm, StepPlan
from dpresearch.algorithms.diagnostics import outer_momentum_norm
from dpresearch.asynchrony.options import AsyncOptions
from dpresearch.asynchrony.transport import ProcessTransport
from dpresearch.comm.base import Communicator
from dpresearch.optim import build_optimizer
from dpresearch.replicas import Replicas
from dpresearch.stacked_step import FlatRows, step_together


@dataclass(frozen=True)
class AsyncLocalOptions(AsyncSGDOptions):
    """The `algorithm` node's own keys for `algorithm=async_local_sgd`: asynchronous SGD's
    (the `async` node, the protocol, compressor and error feedback are its too) and these."""

    period: int = 8
    """H: local steps a worker runs between its pull and its push."""
    delayed_nesterov: int = 1
    """N: the outer optimizer steps every N arrivals on their mean, with plain steps of
    lr/N in between (Delayed Nesterov, c = 0); 1: every arrival is an outer step."""
    dynamic_local_updates: bool = False
    """DyLU: worker k runs max(1, ⌊H·v_k/v_max⌋) local steps, v_k its mean speed."""

    def check(self) -> None:
        """Raise ValueError, one line naming the fix."""
        super().check()
        for key, value in (("period", self.period), ("delayed_nesterov", self.delayed_nesterov)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"algorithm.{key}={value}: must be a whole number >= 1")
        if not isinstance(self.dynamic_local_updates, bool):
            raise ValueError(
                f"algorithm.dynamic_local_updates={self.dynamic_local_updates}: "
                "must be true or false"
            )


def local_steps(options: AsyncLocalOptions, seconds_per_step: list[float]) -> list[int]:
    """H_k of every worker: H, or with DyLU max(1, ⌊H·v_k/v_max⌋) with v_k = 1/(its mean
    seconds per step)."""
    h = options.period
    if not options.dynamic_local_updates:
        return [h] * len(seconds_per_step)
    fastest = min(seconds_per_step)
    return [max(1, math.floor(h * fastest / s)) for s in seconds_per_step]


class AsyncLocalSGD(AsyncSGD):
    """Asynchronous Local-SGD (see the module docstring). `outer_optimizer`: the outer
    optimizer node (the `optimizer` group's form; the YAML's is DiLoCo's Nesterov);
    `period`, `delayed_nesterov`, `dynamic_local_updates`: `AsyncLocalOptions`; the rest as
    `AsyncSGD` takes them."""

    server_clips = False  # `train.grad_clip`: each worker clips its local steps' gradients
    OPTIONS = AsyncLocalOptions

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        outer_optimizer: Mapping[str, Any],
        period: int = AsyncLocalOptions.period,
        delayed_nesterov: int = AsyncLocalOptions.delayed_nesterov,
        dynamic_local_updates: bool = AsyncLocalOptions.dynamic_local_updates,
        **node: Any,
    ) -> None:
        self.local = AsyncLocalOptions(
            period=period,
            delayed_nesterov=delayed_nesterov,
            dynamic_local_updates=dynamic_local_updates,
        )
        self.local.check()
        self.outer_node = outer_optimizer
        super().__init__(replicas, comm, optimizers, **node)
        self.local_steps = local_steps(self.local, self.speed.scale)
        self.clock.steps = self.local_steps  # (nothing started yet: the first plan begins)
        self.start = replicas.params.new_empty(replicas.params.shape[1])  # x_start of the pusher
        self.left = 0  # local steps the current worker has still to run
        # a round's later steps: the pusher's row here; on real ranks the server computes nothing
        self._own_plans = [
            StepPlan((w,) if self.transport.computes_here else ()) for w in range(comm.world_size)
        ]
        self.window: Replicas | None = None  # Delayed Nesterov's θ_s, its outer optimizer
        if self.local.delayed_nesterov > 1:
            device, nhwc = replicas.params.device, uses_channels_last(replicas)
            self.window = Replicas(replicas.models[0], 1, device, nhwc)  # the server's layout
            self.window.params.copy_(self.server.params)
            params = [p for p in self.window.models[0].parameters() if p.requires_grad]
            self.outer = build_optimizer(self.outer_node, params)
            self._window_rows = FlatRows(self.window.params, self.window.grads)
            self.window.grads.zero_()  # Σ g of the open window

    def server_optimizer(
        self, replicas: Replicas, optimizers: list[torch.optim.Optimizer]
    ) -> torch.optim.Optimizer:
        """The outer optimizer over the template model; with Delayed Nesterov (N > 1) plain
        SGD at the outer lr / N (the outer optimizer itself steps θ_s every N arrivals)."""
        params = [p for p in replicas.models[0].parameters() if p.requires_grad]
        outer = build_optimizer(self.outer_node, params)
        n = self.local.delayed_nesterov
        if n == 1:
            return outer
        return torch.optim.SGD(params, lr=outer.param_groups[0]["lr"] / n)

    # -- configuration ---------------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Asynchronous SGD's checks, the local options, and what this method cannot take."""
        super().check_config(cfg)
        alg = cfg.algorithm
        AsyncLocalOptions.from_node(alg).check()
        opts = AsyncOptions.from_node(alg.get("options"))
        if opts.delay is not None:
            raise ValueError(
                "async.delay is asynchronous SGD's fixed-delay mode; algorithm=async_local_sgd "
                "takes its delays from the event simulator: drop async.delay"
            )
        if opts.delay_compensation:
            raise ValueError(
                "async.delay_compensation is DC-ASGD's gradient correction; a pseudo-gradient "
                "of H steps has none: set async.delay_compensation=0"
            )

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        facts["async"].update(
            period=self.local.period,
            local_steps=list(self.local_steps),
            delayed_nesterov=self.local.delayed_nesterov,
        )
        return facts

    # -- the step --------------------------------------------------------------------------------
    def set_lr(self, multiplier: float) -> None:
        """The schedule drives the workers' local optimizers (the outer lr stays, as
        DiLoCo's)."""
        Algorithm.set_lr(self, multiplier)

    def attach_compute(self, compute: Any) -> None:
        """Nothing is computed ahead: a worker's next steps depend on its previous ones."""

    @classmethod
    def part(cls, comm: Communicator) -> type[Algorithm]:
        """The server on rank 0 (and in a simulating process), `AsyncLocalWorker` on worker
        ranks."""
        return cls if super().part(comm) is cls else AsyncLocalWorker

    def plan(self, step: int) -> StepPlan:
        """A round's first step: the next push (the clock's next arrival; on real ranks, the
        push received); then its H_w steps (on real ranks, the worker ran them on its own
        rank: the server waits them out, so the update lands at the same step)."""
        if self.left == 0:
            plan = self.mode.plan(step)
            w = self._worker
            self.left = self.local_steps[w]
            transport = self.transport
            if isinstance(transport, ProcessTransport):
                transport.keep_received()  # applied H_w steps on: other pushes arrive meanwhile
            else:
                self.start.copy_(self.replicas.params[w])  # its pull, untouched since released
            return plan
        return self._own_plans[self._worker]

    def after_backward(self, step: int) -> None:
        w = self._worker
        here = self.transport.computes_here
        if here:
            self.step_optimizer(w)
        self.left -= 1
        if self.left:
            self.tell_workers()  # (a checkpoint or the end reaches the workers at any step)
            return
        self.steps += 1
        replicas = self.replicas
        if here:  # Δ = x_start − x_end, pushed from the gradient row
            torch.sub(self.start, replicas.params[w], out=replicas.grads[w])
        push = self.transport.take(w)
        version = self.server.version
        released = self.server.push(w, push.gradient, push.read_version, None, push.buffers)
        if self.window is not None and self.server.version != version:
            self._delayed_nesterov()
        self.mode.applied(released)

    def _delayed_nesterov(self) -> None:
        """Add the update just applied to the window; every N-th, the outer optimizer steps
        θ_s on the window's mean and the server continues from it."""
        window = self.window
        assert window is not None
        window.grads[0].add_(self.server.applied)
        n = self.local.delayed_nesterov
        if self.server.version % n:
            return
        window.grads.div_(n)
        step_together([self.outer], self._window_rows)
        window.grads.zero_()
        self.server.params.copy_(window.params[0])

    def metrics(self) -> dict[str, float]:
        """Asynchronous SGD's (staleness, updates, the clock) and `outer/momentum_norm`."""
        outer = self.outer if self.window is not None else self.server.optimizer
        return {**super().metrics(), "outer/momentum_norm": outer_momentum_norm([outer])}

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Asynchronous SGD's state, the current worker's start and steps left, and Delayed
        Nesterov's window (θ_s, Σ g, the outer optimizer's momentum). On real ranks inside a
        round, the push received and not yet applied is saved first among the pushes held."""
        transport = self.transport
        current = self.left > 0 and isinstance(transport, ProcessTransport)
        if current:
            transport.held.appendleft(transport.received)
        try:
            state = super().state_dict()
        finally:
            if current:
                transport.held.popleft()
        state["local"] = {"start": self.start, "left": self.left}
        if self.window is not None:
            state["local"]["window"] = {
                "params": self.window.params,
                "sum": self.window.grads,
                "outer": self.outer.state_dict(),
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        local = state["local"]
        self.start.copy_(local["start"])
        self.left = int(local["left"])
        if self.left and isinstance(self.transport, ProcessTransport):
            self.transport.received = self.transport.held.popleft()  # the round's own push
        if self.window is not None:
            saved = local["window"]
            self.window.params.copy_(saved["params"])
            self.window.grads.copy_(saved["sum"])
            self.outer.load_state_dict(saved["outer"])


class AsyncLocalWorker(AsyncWorker):
    """Asynchronous Local-SGD, a worker's side on real ranks (`AsyncLocalSGD.part`): a pull
    starts a round of H_w local steps of its own optimizer, one per loop step, on its own
    batches; the last one pushes Δ = x_start − x_end (through `AsyncWorker`'s push: header,
    compressed wire, buffers). Control messages arrive between rounds."""

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        **node: Any,
    ) -> None:
        super().__init__(replicas, comm, optimizers, **node)
        options = AsyncLocalOptions.from_node(node)
        self.local_steps = local_steps(options, self.speed.scale)[self.worker]
        self.start = replicas.params[0].clone()
        self.left = 0
        self._round = StepPlan((0,))

    def set_lr(self, multiplier: float) -> None:
        """The worker's own optimizer, by its own step count (a schedule other than constant
        makes the real run differ from the simulator's, which counts every worker's steps)."""
        Algorithm.set_lr(self, multiplier)

    def plan(self, step: int) -> StepPlan:
        if self.left:
            return self._round
        plan = super().plan(step)  # the server's next message
        if self._control is None:
            self.left = self.local_steps
            self.start.copy_(self.replicas.params[0])
        return plan

    def after_backward(self, step: int) -> None:
        if self._control is not None:
            return
        self.step_optimizer(0)
        self.left -= 1
        if self.left:
            return
        torch.sub(self.start, self.replicas.params[0], out=self.replicas.grads[0])
        super().after_backward(step)

    def state_dict(self) -> dict:
        """`AsyncWorker`'s, and the round (a checkpoint comes between rounds: none open)."""
        return {**super().state_dict(), "left": self.left, "start": self.start}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.left = int(state["left"])
        self.start.copy_(state["start"])
