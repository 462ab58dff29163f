"""The real mode: a parameter-server process and K worker processes (`backend=gloo|nccl`).

Rank 0 is the server, rank 1 + w is worker w. Messages are point-to-point, on CPU tensors over
gloo (a gloo group beside NCCL, whose send/recv cannot receive from any source):

- pull (server → worker): [version, stop] + parameters + float buffers;
- push (worker → server): [version read, gradient count, loss, accuracy] + the gradient's wire
  row (`PushCodec`: raw or compressed with the worker's own error feedback) + float buffers.

The server runs the ordinary training loop (`Trainer`) with `RemoteServer` as its algorithm and
a one-process communicator: each step receives the next push from whichever worker sends it
(a receive from any source), applies it with the same `ParameterServer` and `Protocol` as the
simulator, and answers the workers the protocol releases. So τ, the histogram, evaluation,
logging and the run directory are the simulator's, measured on real arrivals. Workers run
`run_worker`: pull, compute on their own next batch, optionally sleep (`async.inject_delay`,
scaled by the speed model), push, until the server answers "stop".

Failure: a worker process that dies makes the launcher stop the job (torch's elastic agent, as
for every multi-process run). Independently, the server stops with an error naming the worker
when one it has released stays silent for `async.timeout_s` seconds of the server's listening
time (time spent waiting for pushes; its own evaluation and logging do not count), which also
catches a hung worker, or when the transport reports a lost peer.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import Tensor

from dpresearch.algorithms.base import Algorithm, StepPlan, Traits
from dpresearch.asynchrony.accounting import push_accounting, run_summary, transfer_seconds
from dpresearch.asynchrony.options import AsyncOptions
from dpresearch.asynchrony.protocol import Protocol
from dpresearch.asynchrony.push import PushCodec
from dpresearch.asynchrony.server import ParameterServer
from dpresearch.asynchrony.speed import SpeedModel
from dpresearch.asynchrony.staleness import StalenessPolicy
from dpresearch.comm.base import Communicator
from dpresearch.replicas import Replicas

HEADER = 4  # float64 entries at the start of every message
HEADER_BYTES = 8 * HEADER


class WorkerLost(RuntimeError):
    """The server heard nothing from some workers, or the transport lost one."""


def _aligned(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


class Message:
    """A fixed-size byte buffer: a float64 header, then fields at 8-byte-aligned offsets."""

    def __init__(self, fields: Mapping[str, tuple[torch.dtype, int]]) -> None:
        self.offsets: dict[str, tuple[int, torch.dtype, int]] = {}
        offset = HEADER_BYTES
        for name, (dtype, count) in fields.items():
            self.offsets[name] = (offset, dtype, count)
            offset += _aligned(count * dtype.itemsize)
        self.size = offset

    def new(self) -> Tensor:
        return torch.zeros(self.size, dtype=torch.uint8)

    @staticmethod
    def header(buf: Tensor) -> Tensor:
        return buf[:HEADER_BYTES].view(torch.float64)

    def field(self, buf: Tensor, name: str) -> Tensor:
        offset, dtype, count = self.offsets[name]
        return buf[offset : offset + count * dtype.itemsize].view(dtype)


def formats(params: Tensor, buffers: Tensor, codec: PushCodec) -> tuple[Message, Message]:
    """(pull, push) message formats for these parameter and buffer rows and this codec."""
    pull = Message(
        {"params": (params.dtype, params.shape[-1]), "buffers": (buffers.dtype, buffers.shape[-1])}
    )
    push = Message(
        {
            "wire": (codec.wire_dtype, codec.wire_size),
            "buffers": (buffers.dtype, buffers.shape[-1]),
        }
    )
    return pull, push


def exchange_group() -> dist.ProcessGroup | None:
    """The group messages travel in: the default one on gloo, a gloo group beside NCCL."""
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


# -- the server ------------------------------------------------------------------------------
class RemoteServer(Algorithm):
    """The server half of `AsyncSGD` (same options), run by rank 0's training loop: one step
    = one push received from any worker. `replicas` holds one row; the server's state is the
    `ParameterServer`."""

    # The workers' processes and messages in flight are not saved: the real mode cannot
    # checkpoint (refused by `AsyncSGD.check_config`; a stop request writes none).
    traits = Traits(checkpointable=False, skippable=False)

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
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(replicas, comm, optimizers)
        self.options = opts = AsyncOptions.from_node(options)
        self.k = k = dist.get_world_size() - 1
        self.group = group
        self.protocol = Protocol(opts.protocol, k, opts.max_staleness, opts.softsync_c)
        self.server = ParameterServer(
            replicas.models[0],
            optimizers[0],
            self.protocol,
            StalenessPolicy(opts.lr_policy, k, opts.tau_max),
            opts.delay_compensation,
        )
        cpu = torch.device("cpu")
        params = self.server.params.detach().to(cpu)
        buffers = self.server.buffers.detach().to(cpu)
        self.codec = PushCodec(
            replicas.models[0],
            params,
            [0],
            compressor,
            error_feedback,
            seed,
            granularity,
            bucket_mb,
        )
        self.pull, self.push_format = formats(params, buffers, self.codec)
        self.push_bytes = self.push_format.size - HEADER_BYTES
        self.push_s = transfer_seconds(comm.ledger.network, self.push_bytes)
        self.outbox = [self.pull.new() for _ in range(k)]  # what each worker last read
        self._sends: list[Any] = [None] * k
        self.inbox = self.push_format.new()
        self.gradient = torch.empty_like(self.server.params)
        self.read_version = [0] * k
        self.pushes = [0] * k
        self.computing: set[int] = set()  # workers holding parameters, still to push
        self._window = [0.0, 0.0, 0]
        self.listened = 0.0  # seconds spent waiting for pushes
        self.released_at = [0.0] * k  # `listened` when each worker was last released
        for w in self.protocol.begin():
            self._release(w)

    @property
    def gradients_per_step(self) -> int:
        return 1

    def plan(self, step: int) -> StepPlan:
        return StepPlan(())

    def set_lr(self, multiplier: float) -> None:
        self.server.set_lr(multiplier)

    # -- messages ----------------------------------------------------------------------------
    def _release(self, worker: int, stop: bool = False) -> None:
        """Send `worker` the server's state now (or "stop")."""
        if self._sends[worker] is not None:
            self._sends[worker].wait()
        buf = self.outbox[worker]
        self.pull.header(buf)[:2] = torch.tensor([self.server.version, float(stop)])
        if not stop:
            self.pull.field(buf, "params").copy_(self.server.params)
            self.pull.field(buf, "buffers").copy_(self.server.buffers)
            self.read_version[worker] = self.server.version
            self.released_at[worker] = self.listened
            self.computing.add(worker)
        self._sends[worker] = dist.isend(buf, dst=worker + 1, group=self.group)

    def _receive(self) -> int:
        """Block until the next push arrives (from any worker) and return its worker; raise
        `WorkerLost` if a computing worker has been silent for `timeout_s` of listening."""
        limit = self.options.timeout_s
        deadline = min((self.released_at[w] + limit for w in self.computing), default=None)
        wait = max(0.05, deadline - self.listened) if deadline is not None else limit
        work = dist.irecv(self.inbox, src=None, group=self.group)
        start = time.monotonic()
        try:
            work.wait(timedelta(seconds=wait))
        except RuntimeError as exc:
            self.listened += time.monotonic() - start
            raise WorkerLost(self._lost_message(str(exc).splitlines()[0])) from None
        self.listened += time.monotonic() - start
        source = work._source_rank()
        if self.group is not None:
            source = dist.get_group_rank(self.group, source)
        worker = source - 1
        late = (w for w in self.computing if self.listened - self.released_at[w] > limit)
        if any(w != worker for w in late):
            raise WorkerLost(self._lost_message("the others kept pushing"))
        return worker

    def _lost_message(self, detail: str) -> str:
        limit = self.options.timeout_s
        silent = sorted(w for w in self.computing if self.listened - self.released_at[w] >= limit)
        return (
            f"worker(s) {silent or sorted(self.computing)} sent no gradient for "
            f"async.timeout_s={limit:g}s ({detail}): a worker process died or hangs; "
            "raise async.timeout_s if its gradients are legitimately that slow"
        )

    def after_backward(self, step: int) -> None:
        w = self._receive()
        self.computing.discard(w)
        header = self.push_format.header(self.inbox).tolist()
        read_version, count, loss, acc = int(header[0]), int(header[1]), header[2], header[3]
        self._window[0] += loss
        self._window[1] += acc
        self._window[2] += 1
        self.pushes[w] += 1
        device = self.server.params.device
        wire = self.push_format.field(self.inbox, "wire").to(device)
        gradient = self.codec.decode(wire, count, self.gradient)
        x_read = self.pull.field(self.outbox[w], "params").to(device)
        buffers = self.push_format.field(self.inbox, "buffers").to(device)
        for j in self.server.push(w, gradient, read_version, x_read, buffers):
            self._release(j)

    def finish(self) -> None:
        """Tell every worker to stop: those waiting at once, the computing ones after their
        last push (which is not applied)."""
        for w in range(self.k):
            if w not in self.computing:
                self._release(w, stop=True)
        while self.computing:
            w = self._receive()
            self.computing.discard(w)
            self._release(w, stop=True)
        for send in self._sends:
            if send is not None:
                send.wait()

    # -- results -----------------------------------------------------------------------------
    def consensus(self) -> tuple[Tensor, Tensor]:
        return self.server.params.clone(), self.server.buffers.clone()

    def metrics(self) -> dict[str, float]:
        loss, acc, count = self._window
        self._window = [0.0, 0.0, 0]
        stats = self.server.stats
        return {
            "train/loss": loss / count if count else float("nan"),
            "train/acc": acc / count if count else float("nan"),
            **push_accounting(self.pushes, self.push_bytes, self.push_s),
            **stats.window(),
            **stats.totals(),
            "async/updates": self.server.version,
        }

    def describe(self) -> dict[str, Any]:
        opts = self.options
        return {
            "async": {
                "mode": "real processes",
                "protocol": opts.protocol,
                "workers": self.k,
                "lr_policy": opts.lr_policy,
                "push_bytes": self.push_bytes,
                "pull_bytes": self.pull.size - HEADER_BYTES,
                "inject_delay": opts.inject_delay,
            }
        }

    def summary(self) -> dict[str, Any]:
        return run_summary(self.server, self.protocol, self.pushes, self.push_bytes)


# -- a worker --------------------------------------------------------------------------------
def run_worker(cfg: DictConfig, worker: int, device: torch.device, group) -> None:
    """Worker `worker`'s loop: pull, compute on its next batch, push, until told to stop."""
    from dpresearch.run.compute import WorkerCompute
    from dpresearch.run.trainer import InjectedFailure

    opts = AsyncOptions.from_node(cfg.algorithm.get("options"))
    alg, tc, k = cfg.algorithm, cfg.train, cfg.workers
    # the trainer's split: a worker trains on the same examples as in every other mode
    data = instantiate(cfg.data, device=str(device)).hold_out(tc.val_size)
    partitioner = data.make_partitioner(k, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, num_classes=data.num_classes, input_shape=data.input_shape)
    replicas = Replicas(model, 1, device, tc.channels_last)
    worker_steps = partitioner.samples_per_worker // tc.batch_size
    compute = WorkerCompute.for_run(
        cfg, data, partitioner, replicas, [worker], worker_steps, device
    )
    codec = PushCodec(
        replicas.models[0],
        replicas.params,
        [worker],
        alg.get("compressor"),
        alg.get("error_feedback"),
        cfg.seed,
        alg.get("granularity", "tensor"),
        alg.get("bucket_mb", 25.0),
    )
    speed = SpeedModel(
        opts.speed,
        opts.compute_s,
        k,
        cfg.seed,
        opts.cv,
        opts.slow_workers,
        opts.slowdown,
        opts.straggler_prob,
        opts.straggler_factor,
    )
    cpu_params = replicas.params[0].detach().to("cpu")
    pull, push = formats(cpu_params, replicas.buffers[0].detach().to("cpu"), codec)
    inbox, outbox = pull.new(), push.new()
    window = torch.zeros(1, 3, dtype=torch.float64, device=device)
    replicas.train()
    count = 0
    while True:
        dist.recv(inbox, src=0, group=group)
        version, stop = pull.header(inbox)[:2].tolist()
        if stop:
            return
        replicas.params[0].copy_(pull.field(inbox, "params"))
        replicas.buffers[0].copy_(pull.field(inbox, "buffers"))
        replicas.zero_grad()
        compute.run([0])
        if cfg.debug.fail_worker == worker and cfg.debug.fail_at_step == count:
            raise InjectedFailure(f"injected failure on worker {worker} at its gradient {count}")
        if opts.inject_delay > 0:
            time.sleep(opts.inject_delay * speed.relative(worker))
        wire, _ = codec.encode(0, replicas.grads[0], count)
        compute.drain(window)
        loss, acc, _ = window[0].tolist()
        push.header(outbox)[:] = torch.tensor([version, count, loss, acc], dtype=torch.float64)
        push.field(outbox, "wire").copy_(wire.reshape(-1))
        push.field(outbox, "buffers").copy_(replicas.buffers[0])
        dist.send(outbox, dst=0, group=group)
        count += 1


# -- the entry point -------------------------------------------------------------------------
def run_process(cfg: DictConfig, run_dir: Path | None) -> dict[str, Any]:
    """This process's part of a real asynchronous run; rank 0 returns the run's summary."""
    from dpresearch.comm.simulated import SimulatedCommunicator
    from dpresearch.launch.processes import network_model, process_device
    from dpresearch.run.trainer import Trainer

    group = exchange_group()
    rank = dist.get_rank()
    device = process_device(cfg)
    if rank > 0:
        run_worker(cfg, rank - 1, device, group)
        return {}
    comm = SimulatedCommunicator(1, network_model(cfg))  # the server's own, local collectives
    trainer = Trainer(
        cfg,
        comm,
        device,
        run_dir,
        algorithm_target=f"{RemoteServer.__module__}.{RemoteServer.__qualname__}",
        algorithm_kwargs={"group": group},
    )
    summary = trainer.run()
    trainer.algorithm.finish()
    return summary
