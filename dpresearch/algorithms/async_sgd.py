"""Asynchronous SGD on a parameter server (Recht et al. 2011's Hogwild! lineage; the delayed-
gradient model of Mishchenko et al. 2022): one algorithm over a transport
(`asynchrony/transport.py`), simulated event by event with K workers in one process, or run
for real on K + 1 processes (`backend=gloo|nccl`: the server on rank 0, worker w on rank w + 1).

Every step of the server's loop is one push: the transport names the next pushing worker w
(the event clock's earliest arrival; on real ranks, whoever pushes next, or the clock's worker
with `async.order=seeded`). Simulated, w's replica row still holds the parameters it pulled
(version v) and the loop runs its forward/backward on its next batch. `after_backward` takes
w's push (the gradient, compressed with w's own error feedback if configured, through the
push channel `compress.open_channel(AsyncSGD.channel, ...)`), the server
applies it by protocol and staleness policy (`asynchrony/server.py`, τ = version − v), and
every worker the protocol releases pulls the server's parameters and starts its next gradient.
So one step consumes one batch: an epoch is K × (batches per worker) steps, and `train.steps`
counts pushes (with protocol=sync, K pushes per update).

Computed ahead (simulated, with batched worker compute, `train.batched_workers`): a worker in
flight holds its pull in its row and its next batch is fixed, so its gradient is the same
whenever it is computed. When the clock names a worker whose gradient is not yet computed, the
plan lists every worker in flight as `StepPlan.ahead`: the compute runs all those not yet
computed in one batched call and holds their gradients in their rows (and their batches'
statistics) until each is named; pushes are applied one at a time in event order as before —
the same events and, up to the rounding of batched kernels, the same result.

On real ranks each worker runs the ordinary training loop too, with `AsyncWorker` (this
algorithm's part for worker ranks): a step receives the server's next message — a pull
(compute on it, push) or a control (checkpoint now, finish, stop) — so checkpoints, stop requests
and the end of the run reach every process through the server (`agree`).

The modes are `AsyncSGD.mode` objects behind one interface (`Streamed`, `FixedDelay`); where the
workers run is the transport's business (`open_transport`), never the algorithm's.

Fixed-delay mode (`async.delay=τ`, simulated): step t is computed by worker t mod K on
x_{max(0, V−τ)} (V the server's version), read from a ring buffer of the last τ + 1 server
states, and applied at once: x_{V+1} = x_V − η·g(x_{V−τ}).

Simulated time (`time/simulated_s`) is the arrival time of the step's push; in fixed-delay mode
it advances by compute_s / K per step. Pushes are point-to-point messages recorded by the
ledger at their send: `comm/bytes` (mean over workers of what each pushed: header, gradient
message and float buffers; a pull is sent by the server and charged to nobody),
`comm/modeled_s` (α + bytes/B per push) and `comm/ops`, like every other algorithm's traffic.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import Tensor

from dpresearch.algorithms.base import Algorithm, StepPlan, Traits, Verdict
from dpresearch.algorithms.diagnostics import memory_norm
from dpresearch.asynchrony.clock import EventClock, transfer_seconds
from dpresearch.asynchrony.options import AsyncOptions, check_options
from dpresearch.asynchrony.protocol import ASGD, DEFAULT_PROTOCOL, Protocol
from dpresearch.asynchrony.server import ParameterServer
from dpresearch.asynchrony.speed import SpeedModel
from dpresearch.asynchrony.staleness import StalenessPolicy
from dpresearch.asynchrony.transport import (
    CHECKPOINT,
    DIVERGED,
    FINISH,
    HEADER,
    IO_FAILED,
    PULL,
    SERVER_RANK,
    STOP,
    EventTransport,
    ProcessTransport,
    open_transport,
    pull_message,
    push_message,
)
from dpresearch.comm.base import Communicator
from dpresearch.compress import ChannelNeeds, open_channel
from dpresearch.compress.build import ChannelOptions
from dpresearch.compress.channel import compresses
from dpresearch.replicas import Replicas


def uses_channels_last(replicas: Replicas) -> bool:
    """Whether the replicas lay 4-D parameters out NHWC in their rows."""
    return any(p.dim() == 4 and not p.is_contiguous() for p in replicas.models[0].parameters())


def control_message(verdict: Verdict) -> tuple[int | None, int]:
    """The control message (kind, signal) a server's verdict sends every worker (kind None:
    none)."""
    if verdict.io_failed:
        kind: int | None = IO_FAILED
    elif verdict.nonfinite:
        kind = DIVERGED
    elif verdict.finished:
        kind = FINISH
    elif verdict.signum:
        kind = STOP
    else:
        kind = CHECKPOINT if verdict.checkpoint else None
    return kind, verdict.signum


def verdict_of(kind: int, signum: int) -> Verdict:
    """A worker's verdict from the server's control message."""
    return Verdict(
        signum=signum,
        nonfinite=kind == DIVERGED,
        checkpoint=kind == CHECKPOINT,
        finished=kind == FINISH,
        io_failed=kind == IO_FAILED,
    )


@dataclass(frozen=True)
class AsyncSGDOptions(ChannelOptions):
    """Asynchronous SGD's own keys (`algorithm=async_sgd`): the compression units of its
    pushes (speeds, lr policy and the real order: the `async` node, `AsyncOptions`; the
    server's rule: the `protocol` node)."""


class AsyncSGD(Algorithm):
    """Asynchronous SGD, the server's side (see the module docstring); `options` is the
    `async` config node (`AsyncOptions`), `protocol` the `protocol` node.

    compressor / error_feedback: config nodes for compressed pushes (None: identity, none);
    granularity / bucket_mb: the compression units (`compress.open_channel`).

    One algorithm over one transport interface (`asynchrony.transport.open_transport`: the
    event simulator, or the server's side on real ranks — its own business); what differs by
    mode is its `mode`: `Streamed` (pushes as the transport delivers them) or `FixedDelay`
    (`async.delay`).
    """

    # A dropped step (`train.on_nonfinite=skip_step`) would leave the pushing worker without a
    # next arrival, so it is refused. Real ranks: a server process besides the K workers.
    traits = Traits(skippable=False, extra_processes=1, lockstep=False, messages=True)
    channel = ChannelNeeds.push()
    OPTIONS = AsyncSGDOptions
    # On real ranks the server clips the pushed gradient (`train.grad_clip`); a subclass whose
    # workers clip their own steps (asynchronous Local-SGD) sets False.
    server_clips = True

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        options: Mapping[str, Any] | None = None,
        protocol: Mapping[str, Any] | None = None,
        compressor: Mapping[str, Any] | None = None,
        error_feedback: Mapping[str, Any] | None = None,
        seed: int = 0,
        granularity: str = AsyncSGDOptions.granularity,
        bucket_mb: float = AsyncSGDOptions.bucket_mb,
    ) -> None:
        super().__init__(replicas, comm, optimizers)
        k = comm.num_workers
        self.options = opts = AsyncOptions.from_node(options)
        check_options(opts, k)
        self.protocol: Protocol = (
            instantiate(protocol, workers=k) if protocol else DEFAULT_PROTOCOL(workers=k)
        )
        self.server = ParameterServer(
            replicas.models[0],
            self.server_optimizer(replicas, optimizers),
            self.protocol,
            StalenessPolicy(opts.lr_policy, k, opts.tau_max),
            opts.delay_compensation,
            uses_channels_last(replicas),
        )
        link = open_channel(
            self.channel,
            replicas.models[0],
            replicas.params,
            comm.local_workers,
            compressor,
            error_feedback,
            seed,
            granularity,
            bucket_mb,
        )
        self.link = link
        params, buffers = replicas.params, replicas.buffers
        buffer_bytes = buffers.shape[1] * buffers.element_size()
        self.push_bytes = 8 * HEADER + link.wire_bytes + buffer_bytes
        self.pull_bytes = 8 * 3 + params.shape[1] * params.element_size() + buffer_bytes
        self.speed = SpeedModel.from_options(opts, k, seed)
        network = comm.ledger.network
        self.clock = EventClock(
            self.speed,
            transfer_seconds(network, self.pull_bytes),
            transfer_seconds(network, self.push_bytes),
        )
        self.transport: EventTransport | ProcessTransport = open_transport(
            comm, replicas, self.server, link, self.clock, opts
        )
        self.steps = 0
        self._worker = -1  # the worker whose push this step applies
        self._ending = Verdict()
        self.mode: Streamed | FixedDelay = (
            FixedDelay(self, opts.delay) if opts.delay is not None else Streamed(self)
        )

    def server_optimizer(
        self, replicas: Replicas, optimizers: list[torch.optim.Optimizer]
    ) -> torch.optim.Optimizer:
        """The optimizer the server's copy of it steps with (over `replicas.models[0]`):
        the workers' own (asynchronous SGD); asynchronous Local-SGD's outer optimizer."""
        return optimizers[0]

    @classmethod
    def part(cls, comm: Communicator) -> type[Algorithm]:
        """The server on rank 0 (and in a simulating process), `AsyncWorker` on worker ranks."""
        if comm.num_local == comm.world_size or comm.worker_of(comm.local_workers[0]) is None:
            return cls
        return AsyncWorker

    # -- configuration ---------------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Raise ValueError (one line naming the fix) for options or protocols that
        asynchronous training cannot run (compressors and error feedback: `channel`, checked by
        the configuration's compression check)."""
        super().check_config(cfg)
        alg = cfg.algorithm
        opts = AsyncOptions.from_node(alg.get("options"))
        check_options(opts, cfg.workers)
        real = cfg.backend.name != "simulated"
        if (
            cfg.train.get("grad_clip") is not None
            and cls.server_clips
            and real
            and compresses(alg.get("compressor"), alg.get("error_feedback"))
        ):
            raise ValueError(
                f"train.grad_clip with algorithm=async_sgd on real processes ({cfg.backend.name}) "
                "clips the gradient the server receives, so the pushes must be uncompressed "
                "(compressed pushes clip before encoding, on the worker); use "
                "compressor=identity error_feedback=none, backend=simulated, or "
                "train.grad_clip=null"
            )
        if opts.delay is not None:
            if cfg.backend.name != "simulated":
                raise ValueError(
                    f"async.delay is a simulated mode (x_(t+1) = x_t - η·g(x_(t-τ))); use "
                    f"backend=simulated, or drop async.delay for real processes "
                    f"({cfg.backend.name})"
                )
            node = alg.get("protocol")
            protocol = (
                instantiate(node, workers=cfg.workers)
                if node
                else DEFAULT_PROTOCOL(workers=cfg.workers)
            )
            if type(protocol) is not ASGD:
                raise ValueError(
                    "async.delay fixes τ and replaces the protocol; drop async.delay or set "
                    f"protocol=asgd (it is {protocol.name})"
                )

    def describe(self) -> dict[str, Any]:
        opts = self.options
        facts: dict[str, Any] = {
            "mode": "",
            **self.protocol.describe(),
            "workers": self.comm.num_workers,
            "lr_policy": opts.lr_policy,
            "push_bytes": self.push_bytes,
            "pull_bytes": self.pull_bytes,
            "push_s": self.clock.push_s,
            "pull_s": self.clock.pull_s,
            **self.speed.describe(),
            **self.mode.facts(),
        }
        if opts.slow_workers:
            facts["slow_workers"] = list(opts.slow_workers)
            facts["slowdown"] = opts.slowdown
        return {"async": facts}

    # -- the step --------------------------------------------------------------------------------
    @property
    def gradients_per_step(self) -> int:
        return 1

    def set_lr(self, multiplier: float) -> None:
        self.server.set_lr(multiplier)

    def plan(self, step: int) -> StepPlan:
        return self.mode.plan(step)

    def attach_compute(self, compute: Any) -> None:
        self.mode.attach_compute(compute)

    def losses_finite(self) -> bool:
        return self.transport.losses_finite()

    def agree(self, proposal: Verdict) -> Verdict:
        """The server decides for every process: its own stop request, a non-finite pushed
        loss, its checkpoint interval and run length; the workers hear it after the step."""
        self._ending = proposal
        return proposal

    def after_backward(self, step: int) -> None:
        w = self._worker
        self.steps += 1
        # `train.grad_clip`: the pushing worker's own gradient, before its push is encoded
        # (simulated); on real ranks the server clips the uncompressed push it received, the
        # same values (compressed pushes there are refused by `check_config`)
        here = self.transport.computes_here
        if here:
            self.clip_gradients(w)
        push = self.transport.take(w)
        if not here and self.grad_clip is not None:
            self.grad_clip(push.gradient.unsqueeze(0))
        released = self.server.push(
            w, push.gradient, push.read_version, self.transport.x_read(w), push.buffers
        )
        self.mode.applied(released)

    def tell_workers(self) -> None:
        """Send the workers the verdict's control message, if it has one (the transport
        receives the pushes in flight first)."""
        self.transport.end(*control_message(self._ending), self.server)

    def drop_step(self, step: int) -> None:
        """A non-finite pushed loss or a refused write ends the run (the push is not applied):
        tell the workers."""
        self.tell_workers()

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything beyond the replicas' rows (what each simulated worker pulled) and the
        loop's own state: server, protocol, speed streams, transport (event queue, or the pushes
        held at the checkpoint), push channel, the mode's (fixed-delay history); live
        tensors."""
        return {
            "server": self.server.state_dict(),
            "protocol": self.protocol.state_dict(),
            "speed": self.speed.state_dict(),
            "transport": self.transport.state_dict(),
            "push": self.transport.codec.state_dict(),
            "steps": self.steps,
            "worker": self._worker,
            **self.mode.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.mode.load_state_dict(state)
        self.server.load_state_dict(state["server"])
        self.protocol.load_state_dict(state["protocol"])
        self.speed.load_state_dict(state["speed"])
        self.transport.load_state_dict(state["transport"])
        self.transport.codec.load_state_dict(state["push"])
        self.steps, self._worker = int(state["steps"]), int(state["worker"])

    # -- results ---------------------------------------------------------------------------------
    @property
    def simulated_s(self) -> float:
        return self.mode.simulated_s

    def consensus(self) -> tuple[Tensor, Tensor]:
        return self.server.params.clone(), self.server.buffers.clone()

    def metrics(self) -> dict[str, float]:
        stats = self.server.stats
        out = {
            **stats.window(),
            **stats.totals(),
            "async/updates": self.server.version,
            **self.transport.metrics(),
        }
        simulated = self.simulated_s
        if not math.isnan(simulated):  # (real ranks in arrival order: no clock)
            out["time/simulated_s"] = simulated
        if self.comm.num_local == self.comm.world_size:  # (real ranks: each worker's own)
            out.update(memory_norm([self.link.memory], self.comm))
        return out

    def summary(self) -> dict[str, Any]:
        return {
            **self.server.stats.summary(),
            "async/updates": self.server.version,
            **self.protocol.summary(),
        }


class Streamed:
    """`AsyncSGD`'s mode for pushes as the transport delivers them (the event simulator, or
    real ranks): each step applies the next push, the protocol's released workers pull, and a
    verdict's control message reaches the workers. With a batched compute on a transport
    whose workers compute here, the workers in flight are computed ahead (`StepPlan.ahead`)."""

    def __init__(self, alg: AsyncSGD) -> None:
        self.alg = alg
        self.started = False
        self.ahead: Any = None  # the run's batched WorkerCompute, when pushes compute ahead
        self._plans: dict[tuple[int, ...], StepPlan] = {}

    def plan(self, step: int) -> StepPlan:
        alg, transport = self.alg, self.alg.transport
        if not self.started:  # (not at construction: a resumed run has started already)
            self.started = True
            transport.release(alg.protocol.begin(), alg.server)
        alg._worker, rows = transport.next_push()
        if self.ahead is not None and not self.ahead.holds(alg._worker):
            return StepPlan(rows, ahead=alg.clock.in_flight())
        plan = self._plans.get(rows)
        if plan is None:
            plan = self._plans[rows] = StepPlan(rows)
        return plan

    def attach_compute(self, compute: Any) -> None:
        if self.alg.transport.computes_here and compute.batched is not None:
            self.ahead = compute

    def applied(self, released: list[int]) -> None:
        self.alg.transport.release(released, self.alg.server)
        self.alg.tell_workers()

    @property
    def simulated_s(self) -> float:
        return self.alg.transport.now

    def facts(self) -> dict[str, Any]:
        transport = self.alg.transport
        facts = transport.describe(self.alg.options)
        if transport.computes_here:
            facts["compute_ahead"] = self.ahead is not None
        return facts

    def state_dict(self) -> dict:
        return {"started": self.started, "history": None}

    def load_state_dict(self, state: dict) -> None:
        if state["history"] is not None:
            raise ValueError("async state: saved with another async.delay mode")
        self.started = bool(state["started"])


class FixedDelay:
    """`AsyncSGD`'s fixed-delay mode (`async.delay=τ`, simulated): step t is computed by worker
    t mod K on x_(max(0, V−τ)), read from a ring buffer of the last τ + 1 server states, and
    applied at once; nothing is computed ahead."""

    def __init__(self, alg: AsyncSGD, delay: int) -> None:
        if not alg.transport.computes_here:
            raise ValueError("async.delay is a simulated mode; use backend=simulated")
        self.alg, self.delay = alg, delay
        # x_v lives in slot v mod (τ+1) while v ≥ version − τ.
        self.history = alg.server.params.expand(delay + 1, -1).clone()

    def plan(self, step: int) -> StepPlan:
        alg = self.alg
        w = step % alg.comm.world_size
        read = max(0, alg.server.version - self.delay)
        alg._worker, alg.transport.read_version[w] = w, read
        return StepPlan((w,), {w: self.history[read % self.history.shape[0]]})

    def attach_compute(self, compute: Any) -> None:
        """Every step reads its own snapshot: nothing to compute ahead."""

    def applied(self, released: list[int]) -> None:
        server = self.alg.server
        self.history[server.version % self.history.shape[0]].copy_(server.params)

    @property
    def simulated_s(self) -> float:
        alg = self.alg
        return alg.steps * alg.options.compute_s / alg.comm.world_size

    def facts(self) -> dict[str, Any]:
        return {"mode": "fixed delay", "delay": self.delay}

    def state_dict(self) -> dict:
        return {"started": False, "history": self.history}

    def load_state_dict(self, state: dict) -> None:
        if state["history"] is None:
            raise ValueError("async state: saved with another async.delay mode")
        self.history.copy_(state["history"])


class AsyncWorker(Algorithm):
    """Asynchronous SGD, a worker's side on real ranks (`AsyncSGD.part`): each step receives
    the server's next message into its replica row — a pull (compute on it, push the gradient)
    or a control (the verdict: checkpoint now, finish, stop, diverged). Built with `AsyncSGD`'s
    arguments."""

    traits = AsyncSGD.traits

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        **node: Any,
    ) -> None:
        """`node`: the `algorithm` node's keys, as `AsyncSGD` takes them (the protocol is the
        server's business)."""
        super().__init__(replicas, comm, optimizers)
        self.options = opts = AsyncOptions.from_node(node.get("options"))
        self.worker = comm.worker_of(comm.local_workers[0])
        seed = node.get("seed", inspect.signature(AsyncSGD).parameters["seed"].default)
        own = AsyncSGDOptions.from_node(node)
        self.codec = open_channel(
            AsyncSGD.channel,
            replicas.models[0],
            replicas.params,
            [self.worker],
            node.get("compressor"),
            node.get("error_feedback"),
            seed,
            own.granularity,
            own.bucket_mb,
        )
        self.speed = SpeedModel.from_options(opts, comm.num_workers, seed)  # (injected delays)
        params, buffers = replicas.params[0], replicas.buffers[0]
        # Messages laid out once (`Communicator.packed`): a pull lands in `inbox` as it
        # travels, a push is written into `outbox` and sent from there.
        self.inbox = pull_message(comm, params, buffers)
        self.outbox = push_message(comm, self.codec, buffers)
        self._pull_header = self.inbox[0].numpy()  # read and written without torch ops
        self._push_header = self.outbox[0].numpy()
        self._has_buffers = buffers.numel() > 0
        self.window = torch.zeros(1, 3, dtype=torch.float64, device=replicas.params.device)
        self.read_version = 0
        self.count = 0  # gradients pushed: the codec's step
        self._compute = StepPlan((0,))
        self._control: Verdict | None = None
        self._compute_stats: Any = None  # the run's WorkerCompute (`attach_compute`)

    @property
    def gradients_per_step(self) -> int:
        return 1

    def plan(self, step: int) -> StepPlan:
        inbox, replicas = self.inbox, self.replicas
        self.comm.recv(SERVER_RANK, inbox, record=False)
        with torch.no_grad():  # (a control message carries the server's state too)
            replicas.params[0].copy_(inbox[1])
            if self._has_buffers:
                replicas.buffers[0].copy_(inbox[2])
        version, kind, signum = self._pull_header.tolist()
        if int(kind) == PULL:
            self._control = None
            self.read_version = int(version)
            return self._compute
        self._control = verdict_of(int(kind), int(signum))
        return StepPlan(())

    def agree(self, proposal: Verdict) -> Verdict:
        """The server's word: a control message's verdict, otherwise carry on (this
        process's own stop requests and losses go to the server, which decides)."""
        return self._control if self._control is not None else Verdict()

    def after_backward(self, step: int) -> None:
        if self._control is not None:
            return
        if self.options.inject_delay > 0:
            time.sleep(self.options.inject_delay * self.speed.relative(self.worker))
        wire, _ = self.codec.encode(0, self.replicas.grads[0], self.count)
        loss, acc = self.batch_loss()
        out = self.outbox
        self._push_header[:] = (self.read_version, self.count, loss, acc)
        out[1].copy_(wire.reshape(-1))
        if self._has_buffers:
            out[2].copy_(self.replicas.buffers[0])
        self.comm.send(out, SERVER_RANK)  # (returns once sent: `outbox` is free again)
        self.count += 1

    def attach_compute(self, compute: Any) -> None:
        self._compute_stats = compute

    def batch_loss(self) -> tuple[float, float]:
        """The loss and accuracy of the batch just computed (the run's compute holds them)."""
        if self._compute_stats is None:
            return 0.0, 0.0
        self._compute_stats.drain(self.window)
        loss, acc, _ = self.window[0].tolist()
        return loss, acc

    def consensus(self) -> tuple[Tensor, Tensor]:
        return self.replicas.params[0].clone(), self.replicas.buffers[0].clone()

    def state_dict(self) -> dict:
        """The worker's push channel (error-feedback memory), gradient count and speed streams;
        at a checkpoint it waits for the server's next message, so nothing is in flight."""
        return {
            "push": self.codec.state_dict(),
            "count": self.count,
            "read_version": self.read_version,
            "speed": self.speed.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.codec.load_state_dict(state["push"])
        self.count, self.read_version = int(state["count"]), int(state["read_version"])
        self.speed.load_state_dict(state["speed"])
