"""Asynchronous SGD on a parameter server (Recht et al. 2011's Hogwild! lineage; the delayed-
gradient model of Mishchenko et al. 2022), simulated event by event with K workers in one
process, or run for real on processes (`backend=gloo|nccl`, see `asynchrony/remote.py`).

Every trainer step is one push: the event clock (`asynchrony/clock.py`) pops the earliest
arrival, worker w, whose replica row still holds the parameters it pulled (version v). The
trainer runs w's forward/backward on its next batch; `after_backward` encodes the gradient
(`asynchrony/push.py`, compressed with w's own error-feedback memory if configured), the server
applies it by protocol and staleness policy (`asynchrony/server.py`, τ = version − v), and every
worker the protocol releases pulls the server's parameters into its row and starts its next
gradient. So one step consumes one batch: an epoch is K × (batches per worker) steps, and
`train.steps` counts pushes (with protocol=sync, K pushes per update).

Fixed-delay mode (`async.delay=τ`): step t is computed by worker t mod K on x_{max(0, V−τ)}
(V the server's version), read from a ring buffer of the last τ + 1 server states, and applied
at once: x_{V+1} = x_V − η·g(x_{V−τ}).

Simulated time (`time/simulated_s`) is the arrival time of the step's push; in fixed-delay mode
it advances by compute_s / K per step. Pushes are point-to-point messages, not collectives, so
the algorithm keeps their accounting itself (per push, an O(K) ledger record would cost more
than a small model's step) and reports it under the usual keys: `comm/bytes` (mean over workers
of what each pushed: gradient message and float buffers; a pull is sent by the server and
charged to nobody), `comm/bytes_max`, `comm/modeled_s` (link seconds of all pushes), and, in
summary.json, `comm/ops` with one "p2p" row, so `NetworkModel.total_seconds` re-prices it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from dpresearch.algorithms.base import Algorithm, StepPlan, Traits
from dpresearch.asynchrony.accounting import push_accounting, run_summary, transfer_seconds
from dpresearch.asynchrony.clock import EventClock
from dpresearch.asynchrony.options import AsyncOptions, check_options
from dpresearch.asynchrony.protocol import Protocol
from dpresearch.asynchrony.push import PushCodec
from dpresearch.asynchrony.server import ParameterServer
from dpresearch.asynchrony.speed import SpeedModel
from dpresearch.asynchrony.staleness import StalenessPolicy
from dpresearch.comm.base import Communicator
from dpresearch.compress import check_algorithm_node
from dpresearch.replicas import Replicas


def uses_channels_last(replicas: Replicas) -> bool:
    """Whether the replicas lay 4-D parameters out NHWC in their rows."""
    return any(p.dim() == 4 and not p.is_contiguous() for p in replicas.models[0].parameters())


class AsyncSGD(Algorithm):
    """Simulated asynchronous SGD; `options` is the `async` config node (`AsyncOptions`).

    compressor / error_feedback: config nodes for compressed pushes (None: identity, none);
    granularity / bucket_mb: the compression units (see `PushCodec`).
    """

    # Checkpoints: the simulated mode's whole state is in `state_dict` (server, protocol,
    # speed streams, event queue, push codec, history); the real mode refuses them
    # (`check_config`). A dropped step (`train.on_nonfinite=skip_step`) would leave the popped
    # worker without a next arrival, so it is refused. Real ranks: a server and K workers,
    # each process running `run_process`.
    traits = Traits(skippable=False, extra_processes=1, own_processes=True)

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        options: Mapping[str, Any] | None = None,
        compressor: Mapping[str, Any] | None = None,
        error_feedback: Mapping[str, Any] | None = None,
        seed: int = 0,
        granularity: str = "tensor",
        bucket_mb: float = 25.0,
    ) -> None:
        super().__init__(replicas, comm, optimizers)
        k = comm.world_size
        if comm.num_local != k:
            raise ValueError(
                "AsyncSGD simulates all K workers in one process; on gloo/nccl processes the "
                "real mode runs (dpresearch.asynchrony.remote)"
            )
        self.options = opts = AsyncOptions.from_node(options)
        check_options(opts, k)
        self.protocol = Protocol(opts.protocol, k, opts.max_staleness, opts.softsync_c)
        policy = StalenessPolicy(opts.lr_policy, k, opts.tau_max)
        self.server = ParameterServer(
            replicas.models[0],
            optimizers[0],
            self.protocol,
            policy,
            opts.delay_compensation,
            uses_channels_last(replicas),
        )
        params, buffers = replicas.params, replicas.buffers
        self.push = PushCodec(
            replicas.models[0],
            params,
            comm.local_workers,
            compressor,
            error_feedback,
            seed,
            granularity,
            bucket_mb,
        )
        buffer_bytes = buffers.shape[1] * buffers.element_size()
        self.push_bytes = self.push.wire_bytes + buffer_bytes
        self.pull_bytes = params.shape[1] * params.element_size() + buffer_bytes
        network = comm.ledger.network
        self.speed = SpeedModel(
            opts.speed,
            opts.compute_s,
            k,
            seed,
            opts.cv,
            opts.slow_workers,
            opts.slowdown,
            opts.straggler_prob,
            opts.straggler_factor,
        )
        self.clock = EventClock(
            self.speed,
            transfer_seconds(network, self.pull_bytes),
            transfer_seconds(network, self.push_bytes),
        )
        self._has_buffers = buffers.shape[1] > 0
        # Row views made once: selecting a row is a dispatched op, and this runs every push.
        self._params, self._grads = list(params.unbind(0)), list(replicas.grads.unbind(0))
        self._buffers = list(buffers.unbind(0))
        self._plans = [StepPlan((w,)) for w in range(k)]
        self.read_version = [0] * k
        self.pushes = [0] * k  # gradients each worker has pushed: its codec step
        self.steps = 0
        self._worker = -1
        self.history: Tensor | None = None
        if opts.delay is not None:
            # x_v lives in slot v mod (τ+1) while v ≥ version − τ.
            self.history = self.server.params.expand(opts.delay + 1, -1).clone()
        else:
            for w in self.protocol.begin():
                self._start(w)

    # -- configuration ---------------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Raise ValueError (one line naming the fix) for options, compressors or error
        feedback that asynchronous training cannot run."""
        alg = cfg.algorithm
        opts = AsyncOptions.from_node(alg.get("options"))
        check_options(opts, cfg.workers)
        if opts.delay is not None and cfg.backend.name != "simulated":
            raise ValueError(
                f"async.delay is a simulated mode (x_(t+1) = x_t - η·g(x_(t-τ))); use "
                f"backend=simulated, or drop async.delay for real processes ({cfg.backend.name})"
            )
        if cfg.backend.name != "simulated" and checkpoints_asked(cfg.train):
            raise ValueError(
                f"algorithm=async_sgd on real processes (backend={cfg.backend.name}) cannot "
                "checkpoint yet; use backend=simulated, or leave train.checkpoint_every and "
                "train.resume unset"
            )
        check_algorithm_node(alg, "push")

    @classmethod
    def run_process(cls, cfg: DictConfig, run_dir: Path | None) -> dict[str, Any]:
        """This torch.distributed process's part of a real run (rank 0 the server, rank
        1 + w worker w)."""
        from dpresearch.asynchrony.remote import run_process

        return run_process(cfg, run_dir)

    def describe(self) -> dict[str, Any]:
        opts = self.options
        facts: dict[str, Any] = {
            "mode": "fixed delay" if opts.delay is not None else "event simulator",
            "protocol": opts.protocol,
            "workers": self.comm.world_size,
            "lr_policy": opts.lr_policy,
            "push_bytes": self.push_bytes,
            "pull_bytes": self.pull_bytes,
            "push_s": self.clock.push_s,
            "pull_s": self.clock.pull_s,
            **self.speed.describe(),
        }
        if opts.delay is not None:
            facts["delay"] = opts.delay
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
        if self.history is None:
            self._worker = self.clock.next_arrival()
            return self._plans[self._worker]
        w = step % self.comm.world_size
        read = max(0, self.server.version - self.options.delay)
        self._worker, self.read_version[w] = w, read
        return StepPlan((w,), {w: self.history[read % self.history.shape[0]]})

    def after_backward(self, step: int) -> None:
        w = self._worker
        count = self.pushes[w]
        self.pushes[w] = count + 1
        self.steps += 1
        _, gradient = self.push.encode(w, self._grads[w], count)
        released = self.server.push(
            w, gradient, self.read_version[w], self._params[w], self._buffers[w]
        )
        if self.history is not None:
            version = self.server.version
            self.history[version % self.history.shape[0]].copy_(self.server.params)
            return
        for j in released:
            self._start(j)

    def _start(self, worker: int) -> None:
        """`worker` pulls the server's state now and starts its next gradient."""
        self._params[worker].copy_(self.server.params)
        if self._has_buffers:
            self._buffers[worker].copy_(self.server.buffers)
        self.read_version[worker] = self.server.version
        self.clock.start(worker)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything the simulation changes beyond the replicas' rows (what each worker pulled)
        and the trainer's own state; live tensors."""
        return {
            "server": self.server.state_dict(),
            "protocol": self.protocol.state_dict(),
            "speed": self.speed.state_dict(),
            "clock": self.clock.state_dict(),
            "push": self.push.state_dict(),
            "read_version": list(self.read_version),
            "pushes": list(self.pushes),
            "steps": self.steps,
            "worker": self._worker,
            "history": self.history,
        }

    def load_state_dict(self, state: dict) -> None:
        if (state["history"] is None) != (self.history is None):
            raise ValueError("async state: saved with another async.delay mode")
        self.server.load_state_dict(state["server"])
        self.protocol.load_state_dict(state["protocol"])
        self.speed.load_state_dict(state["speed"])
        self.clock.load_state_dict(state["clock"])
        self.push.load_state_dict(state["push"])
        self.read_version = [int(v) for v in state["read_version"]]
        self.pushes = [int(n) for n in state["pushes"]]
        self.steps, self._worker = int(state["steps"]), int(state["worker"])
        if self.history is not None:
            self.history.copy_(state["history"])

    # -- results ---------------------------------------------------------------------------------
    @property
    def simulated_s(self) -> float:
        if self.history is not None:
            return self.steps * self.options.compute_s / self.comm.world_size
        return self.clock.now

    def consensus(self) -> tuple[Tensor, Tensor]:
        return self.server.params.clone(), self.server.buffers.clone()

    def metrics(self) -> dict[str, float]:
        stats = self.server.stats
        return {
            **push_accounting(self.pushes, self.push_bytes, self.clock.push_s),
            **stats.window(),
            **stats.totals(),
            "async/updates": self.server.version,
            "time/simulated_s": self.simulated_s,
        }

    def summary(self) -> dict[str, Any]:
        return run_summary(self.server, self.protocol, self.pushes, self.push_bytes)


def checkpoints_asked(train: Mapping[str, Any]) -> bool:
    """Whether a `train` node asks for checkpoints (`checkpoint_every`) or a resume."""
    from dpresearch.run.checkpoint import CheckpointError, checkpoint_interval

    try:
        every = checkpoint_interval(train.get("checkpoint_every"), 1)
    except CheckpointError:  # reported by the run-control checks
        every = 0
    return bool(every) or train.get("resume") is not None
