"""How pushes reach the parameter server and pulls reach the workers: one interface, two
transports, both through the communicator's point-to-point messages (so the ledger records every
push at its send, per worker, with the worker's own clock).

A push is one message `[header, wire, buffers]`: the header (float64) holds the version the
worker read, its gradient count (the codec's step), and its batch's training loss and accuracy;
the wire row is the gradient as the push channel (`compress.Channel`) encodes it; the buffers
are the worker's float buffers. A pull (server → worker) is `[header, parameters, buffers]`
with the header holding the server's version and what the message means (`PULL`, or a
control: checkpoint now, finish, stop on a signal, diverged); pulls are charged to nobody
(the server holds no worker).

- `EventTransport` (the event simulator, every worker in this process): the event clock
  (`clock.py`, seeded compute times plus network-priced transfers) decides who pushes next;
  that worker computes in this process on the parameters its row holds; its push is sent to the
  server's endpoint and taken from its mailbox; a released worker's row takes the server's
  state (its pull).
- `ProcessTransport` (real ranks: the server on rank 0, worker w on rank w + 1): the server
  receives the next push from whichever worker sends it (`async.order=arrival`), or from the
  worker the event clock names (`seeded`: a real run replays the simulated order exactly), and
  answers released workers with a pull. Before a checkpoint and at the end it waits for every
  push in flight and keeps them (`held`, part of the checkpoint), then tells every worker; so a
  checkpoint holds every message of the run. A worker silent for `async.timeout_s` seconds of
  the server's listening time is named (`WorkerLost`).

`open_transport` picks the one the communicator's layout needs, so the algorithm over it never
asks where its workers run: it reads the transport's `computes_here`, `describe` and `metrics`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from dpresearch.asynchrony.clock import EventClock
from dpresearch.asynchrony.options import AsyncOptions
from dpresearch.asynchrony.server import ParameterServer
from dpresearch.comm.base import Communicator, Packed, PeerTimeout, PendingOp
from dpresearch.compress.channel import Channel
from dpresearch.replicas import Replicas

SERVER = -1  # the server's endpoint in a simulating process (it holds no worker)
SERVER_RANK = 0  # ... and its rank on real processes
HEADER = 4  # push header: read version, gradient count, loss, accuracy
PULL_HEADER = 3  # pull header: [version, kind, signal]; the kinds of pull:
PULL, CHECKPOINT, FINISH, STOP, DIVERGED, IO_FAILED = range(6)


class WorkerLost(RuntimeError):
    """The server heard nothing from some workers within `async.timeout_s`."""


@dataclass
class Push:
    """A push as the server received it (`gradient`, `buffers`: owned by the transport, valid
    until its next receive)."""

    worker: int
    read_version: int
    count: int
    loss: float  # the batch's training loss and accuracy (real ranks; 0 simulated)
    acc: float
    gradient: Tensor
    buffers: Tensor


def pull_message(comm: Communicator, params: Tensor, buffers: Tensor) -> Packed:
    """A pull laid out for `comm`: [header: version, kind, signal (float64)], parameters,
    buffers (see the module docstring)."""
    return comm.packed([torch.empty(PULL_HEADER, dtype=torch.float64), params, buffers])


def push_message(comm: Communicator, codec: Channel, buffers: Tensor) -> Packed:
    """A push laid out for `comm`: [header (float64, `HEADER`), wire row, buffers]."""
    wire = torch.empty(codec.wire_size, dtype=codec.wire_dtype, device=buffers.device)
    return comm.packed([torch.empty(HEADER, dtype=torch.float64), wire, buffers])


class EventTransport:
    """Every worker in this process (rows of `replicas`), ordered by the event `clock`."""

    computes_here = True  # the pushing worker's gradient is computed in this process

    def __init__(
        self, comm: Communicator, replicas: Replicas, codec: Channel, clock: EventClock
    ) -> None:
        self.comm, self.codec, self.clock = comm, codec, clock
        k = comm.world_size
        # Row views made once: selecting a row is a dispatched op, and this runs every push.
        self.params, self.grads = list(replicas.params.unbind(0)), list(replicas.grads.unbind(0))
        self.buffers = list(replicas.buffers.unbind(0))
        self._has_buffers = replicas.buffers.shape[1] > 0
        self._rows = [(w,) for w in range(k)]
        self._headers = torch.zeros(k, HEADER, dtype=torch.float64)
        self._header_rows = list(self._headers.unbind(0))
        self._header_values = self._headers.numpy()  # written without dispatching torch ops
        self.read_version = [0] * k
        self.pushes = [0] * k

    @property
    def now(self) -> float:
        return self.clock.now

    def next_push(self) -> tuple[int, tuple[int, ...]]:
        """The next worker to push (the earliest arrival) and the local rows that compute its
        gradient: its own (it computes here)."""
        w = self.clock.next_arrival()
        return w, self._rows[w]

    def take(self, w: int) -> Push:
        """Worker `w`'s push of the gradient in its row, sent to the server and received."""
        count = self.pushes[w]
        self.pushes[w] = count + 1
        wire, decoded = self.codec.encode(w, self.grads[w], count)
        self._header_values[w, :2] = (self.read_version[w], count)
        self.comm.isend(
            [self._header_rows[w], wire, self.buffers[w]], SERVER, src=w, at=self.clock.now
        )
        self.comm.recv(w, dst=SERVER)
        return Push(w, self.read_version[w], count, 0.0, 0.0, decoded, self.buffers[w])

    def x_read(self, w: int) -> Tensor:
        """The parameters worker `w` computed its push on: its row still holds its pull."""
        return self.params[w]

    def losses_finite(self) -> bool:
        """The pushing worker computed here: the loop checks its loss itself."""
        return True

    def release(self, workers: list[int], server: ParameterServer) -> None:
        """`workers` pull the server's state now and start their next gradient."""
        for w in workers:
            self.params[w].copy_(server.params)
            if self._has_buffers:
                self.buffers[w].copy_(server.buffers)
            self.read_version[w] = server.version
            self.clock.start(w)

    def end(self, kind: int | None, signum: int, server: ParameterServer) -> None:
        """Nothing to tell: every worker lives in this process."""

    def describe(self, options: AsyncOptions) -> dict[str, Any]:
        return {"mode": "event simulator"}

    def metrics(self) -> dict[str, float]:
        """The workers compute here: the loop logs their losses itself."""
        return {}

    def state_dict(self) -> dict:
        return {
            "clock": self.clock.state_dict(),
            "read_version": list(self.read_version),
            "pushes": list(self.pushes),
        }

    def load_state_dict(self, state: dict) -> None:
        self.clock.load_state_dict(state["clock"])
        self.read_version = [int(v) for v in state["read_version"]]
        self.pushes = [int(n) for n in state["pushes"]]


class ProcessTransport:
    """The server's side on real ranks (see the module docstring). `clock`: the event clock
    whose order the server follows (`async.order=seeded`), or None (arrival order)."""

    computes_here = False  # the workers compute on their own ranks

    def __init__(
        self,
        comm: Communicator,
        server: ParameterServer,
        codec: Channel,
        clock: EventClock | None,
        timeout_s: float,
        keep_read_params: bool = False,
    ) -> None:
        self.comm, self.codec, self.clock, self.timeout_s = comm, codec, clock, timeout_s
        k = self.workers = comm.num_workers
        params, buffers = server.params, server.buffers
        self.device = params.device
        # Messages laid out once (`Communicator.packed`): a push lands in `inbox` as it
        # travels, a pull is written into worker w's `outbox[w]` and sent from there.
        self.inbox = push_message(comm, codec, buffers)
        self._push_header = self.inbox[0].numpy()  # read without dispatching torch ops
        self.outbox = [pull_message(comm, params, buffers) for _ in range(k)]
        self._pull_headers = [out[0].numpy() for out in self.outbox]
        self._has_buffers = buffers.numel() > 0
        self._sent: list[PendingOp | None] = [None] * k  # each outbox's message in flight
        self.gradient = torch.empty_like(params)
        self.read_version = [0] * k
        self.pushes = [0] * k
        self.computing: set[int] = set()  # released, push not yet received
        self.held: deque[Push] = deque()  # received before a checkpoint or the end, not applied
        # the parameters each worker last pulled (delay compensation needs x_read)
        self.read_params = (
            [torch.empty_like(params) for _ in range(k)] if keep_read_params else None
        )
        self.listened = 0.0  # seconds spent waiting for pushes
        self.released_at = [0.0] * k  # `listened` when each worker was last released
        self._push: Push | None = None
        self._window = [0.0, 0.0, 0]  # received pushes' loss, accuracy, count

    @property
    def now(self) -> float:
        return self.clock.now if self.clock is not None else float("nan")

    # -- pushes ------------------------------------------------------------------------------
    def next_push(self) -> tuple[int, tuple[int, ...]]:
        """Receive the next push (a held one first); nothing computes on the server."""
        want = self.clock.next_arrival() if self.clock is not None else None
        push = self._held(want)
        if push is None:
            push = self._receive(want)
        self._push = push
        return push.worker, ()

    @property
    def received(self) -> Push | None:
        """The push `next_push` received last (None: none yet); settable (a resumed round's)."""
        return self._push

    @received.setter
    def received(self, push: Push | None) -> None:
        self._push = push

    def keep_received(self) -> None:
        """Copy the push `next_push` received out of the receive buffers, so that later
        receives leave it whole (a server that applies it steps later)."""
        push = self._push
        if push is not None:
            self._push = replace(push, gradient=push.gradient.clone(), buffers=push.buffers.clone())

    def take(self, w: int) -> Push:
        """The push `next_push` received."""
        push = self._push
        assert push is not None and push.worker == w
        window = self._window
        window[0], window[1], window[2] = window[0] + push.loss, window[1] + push.acc, window[2] + 1
        return push

    def describe(self, options: AsyncOptions) -> dict[str, Any]:
        return {
            "mode": "real processes",
            "order": options.order,
            "inject_delay": options.inject_delay,
        }

    def metrics(self) -> dict[str, float]:
        """`train/loss` and `train/acc` of the batches pushed since the last call (the
        workers compute elsewhere; their losses arrive in the pushes)."""
        loss, acc, count = self._window
        self._window = [0.0, 0.0, 0]
        nan = float("nan")
        return {
            "train/loss": loss / count if count else nan,
            "train/acc": acc / count if count else nan,
        }

    def x_read(self, w: int) -> Tensor | None:
        """The parameters worker `w` computed its push on (kept for delay compensation)."""
        return self.read_params[w] if self.read_params is not None else None

    def losses_finite(self) -> bool:
        """Whether the received push's training loss is finite."""
        return self._push is None or math.isfinite(self._push.loss)

    def _held(self, want: int | None) -> Push | None:
        if not self.held:
            return None
        if want is None:
            return self.held.popleft()
        for i, push in enumerate(self.held):
            if push.worker == want:
                del self.held[i]
                return push
        return None

    def _receive(self, want: int | None, record: bool = True) -> Push:
        """Block until the push of `want` (None: anyone) arrives; raise `WorkerLost` if a
        computing worker has been silent for `timeout_s` of listening. `record`: count it
        (the ledger hears it, the push counts)."""
        limit = self.timeout_s
        deadline = min((self.released_at[w] + limit for w in self.computing), default=None)
        wait = max(0.05, deadline - self.listened) if deadline is not None else limit
        start = time.monotonic()
        try:
            if want is None:
                rank, _ = self.comm.recv_any(self.inbox, timeout_s=wait, record=record)
            else:
                rank = want + self.comm.first_worker
                self.comm.recv(rank, self.inbox, timeout_s=wait, record=record)
        except PeerTimeout as exc:
            self.listened += time.monotonic() - start
            raise WorkerLost(self._lost_message(str(exc))) from None
        self.listened += time.monotonic() - start
        w = self.comm.worker_of(rank)
        late = (j for j in self.computing if self.listened - self.released_at[j] > limit)
        if any(j != w for j in late):
            raise WorkerLost(self._lost_message("the others kept pushing"))
        self.computing.discard(w)
        self.pushes[w] += int(record)
        _, wire, buffers = self.inbox
        read_version, count, loss, acc = self._push_header.tolist()
        gradient = self.codec.decode(wire.to(self.device), int(count), self.gradient)
        return Push(w, int(read_version), int(count), loss, acc, gradient, buffers.to(self.device))

    def _lost_message(self, detail: str) -> str:
        limit = self.timeout_s
        silent = sorted(w for w in self.computing if self.listened - self.released_at[w] >= limit)
        return (
            f"worker(s) {silent or sorted(self.computing)} sent no gradient for "
            f"async.timeout_s={limit:g}s ({detail}): a worker process died or hangs; "
            "raise async.timeout_s if its gradients are legitimately that slow"
        )

    # -- pulls -------------------------------------------------------------------------------
    def release(self, workers: list[int], server: ParameterServer) -> None:
        for w in workers:
            self._send(w, server, PULL)
            self.read_version[w] = server.version
            if self.read_params is not None:
                self.read_params[w].copy_(server.params)
            self.released_at[w] = self.listened
            self.computing.add(w)
            if self.clock is not None:
                self.clock.start(w)

    def _send(self, w: int, server: ParameterServer, kind: int, signum: int = 0) -> None:
        """Send worker `w` a pull: [version, kind, signal], the server's parameters and buffers
        (a control message carries them too: the worker's row takes them either way)."""
        sent = self._sent[w]
        if sent is not None:
            sent.wait()  # `outbox[w]` is rewritten: its last message must have left
        out = self.outbox[w]
        self._pull_headers[w][:] = (server.version, kind, signum)
        out[1].copy_(server.params)
        if self._has_buffers:
            out[2].copy_(server.buffers)
        self._sent[w] = self.comm.isend(out, w + self.comm.first_worker, record=False)

    def end(self, kind: int | None, signum: int, server: ParameterServer) -> None:
        """Before a checkpoint or a stop: receive every push in flight and keep it (`held`,
        in arrival order; the checkpoint holds it); at the end of the run (finished,
        diverged) receive and drop them, uncounted (the simulator never computes them). Then
        tell every worker the control message `kind` (None: none)."""
        if kind is None:
            return
        keep = kind in (CHECKPOINT, STOP)
        while self.computing:
            want = min(self.computing) if self.clock is not None else None
            push = self._receive(want, record=keep)
            if keep:
                self.held.append(
                    replace(push, gradient=push.gradient.clone(), buffers=push.buffers.clone())
                )
        for w in range(self.workers):
            self._send(w, server, kind, signum)
        # Delivered before this process goes on: every worker is waiting for it, and a send
        # still in flight when the run ends (its work and buffer freed) may never arrive,
        # leaving its worker waiting forever (seen under load).
        for sent in self._sent:
            if sent is not None:
                sent.wait()

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything a resumed server needs: pushes held (the run's messages in flight at the
        checkpoint), what each worker read, the push counts, the seeded clock."""
        return {
            "held": [
                (p.worker, p.read_version, p.count, p.loss, p.acc, p.gradient, p.buffers)
                for p in self.held
            ],
            "read_version": list(self.read_version),
            "read_params": self.read_params,
            "pushes": list(self.pushes),
            "computing": sorted(self.computing),
            "clock": self.clock.state_dict() if self.clock is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["computing"]:
            raise ValueError("async state: saved with pushes in flight")
        self.held = deque(
            Push(int(w), int(v), int(n), float(loss), float(acc), g.clone(), b.clone())
            for w, v, n, loss, acc, g, b in state["held"]
        )
        self.read_version = [int(v) for v in state["read_version"]]
        self.pushes = [int(n) for n in state["pushes"]]
        if self.read_params is not None:
            for dst, src in zip(self.read_params, state["read_params"], strict=True):
                dst.copy_(src)
        if self.clock is not None:
            self.clock.load_state_dict(state["clock"])


def open_transport(
    comm: Communicator,
    replicas: Replicas,
    server: ParameterServer,
    codec: Channel,
    clock: EventClock,
    options: AsyncOptions,
) -> EventTransport | ProcessTransport:
    """The transport this process's communicator needs: every worker here (a simulating
    process) — the event simulator; otherwise the server's side on real ranks, following the
    clock's order with `async.order=seeded`."""
    if comm.num_local == comm.world_size:
        return EventTransport(comm, replicas, codec, clock)
    seeded = clock if options.order == "seeded" else None
    return ProcessTransport(
        comm, server, codec, seeded, options.timeout_s, bool(options.delay_compensation)
    )
