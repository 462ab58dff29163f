"""Error feedback as a decorator over any compressor, with DGC momentum correction and a
dense warm-up."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.compress.base import Chunk, Compressor
from dpresearch.compress.state import ChunkBuffers
from dpresearch.compress.workspace import scratch

MODES = ("none", "ef14", "ef21")


class ErrorFeedback(Compressor):
    """Wraps `inner` (any compressor, any protocol) with per-worker, per-chunk memory.

    With g_w the worker's gradient (or its local momentum, below), C the inner compressor and
    D(C(·)) the message as every receiver decodes it:
    - mode="none":  send C(g_w).
    - mode="ef14" (Seide et al. 2014; Karimireddy et al. 2019):
          p_w = g_w + e_w;  send C(p_w);  e_w ← p_w − D(C(p_w)).
    - mode="ef21" (Richtárik et al. 2021): worker state h_w, shared estimate H = mean_w h_w
      (both start at 0):
          c_w = C(g_w − h_w);  h_w ← h_w + D(c_w);  H ← H + mean_w D(c_w);  aggregate = H.

    momentum > 0: DGC's momentum correction (Lin et al. 2018): u_w ← m·u_w + g_w, and u_w
    replaces g_w above, so momentum is applied before compression — run the optimizer without
    momentum. momentum_masking: after sending, zero u_w where the decoded message is non-zero
    (DGC's momentum factor masking, meant for sparsifiers; leave it off for dense compressors,
    e.g. Signum = majority vote with local momentum, where it would erase the momentum).

    start_after_steps: steps before that are dense (allreduce-mean of g_w, 4 bytes per entry).
    They leave EF14's memory at zero; EF21 sets h_w = g_w and H = mean_w g_w (its full-gradient
    initialisation), so the estimate carries over into compression.

    Wire bytes: those of `inner`.
    """

    def __init__(
        self,
        inner: Compressor,
        mode: str = "ef14",
        momentum: float = 0.0,
        momentum_masking: bool = False,
        start_after_steps: int = 0,
    ) -> None:
        super().__init__(inner.seed, inner.worker)
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; choose one of: {', '.join(MODES)}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum}: must be in [0, 1)")
        if start_after_steps < 0:
            raise ValueError(f"start_after_steps={start_after_steps}: must be >= 0")
        self.inner, self.mode, self.momentum = inner, mode, momentum
        self.momentum_masking, self.start_after_steps = momentum_masking, start_after_steps
        self.memory = ChunkBuffers()  # e_w (ef14) or h_w (ef21)
        self.estimate = ChunkBuffers()  # H (ef21), identical on every worker
        self.velocity = ChunkBuffers()  # u_w

    @property
    def linear(self) -> bool:  # type: ignore[override]
        return self.inner.linear

    @property
    def wraps(self) -> Compressor:
        return self.inner.wraps

    def payload_bytes(
        self, numel: int, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32
    ) -> int:
        return self.inner.payload_bytes(numel, shape, dtype)

    def state_dict(self) -> dict:
        return {
            "memory": self.memory.state_dict(),
            "estimate": self.estimate.state_dict(),
            "velocity": self.velocity.state_dict(),
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state["memory"])
        self.estimate.load_state_dict(state["estimate"])
        self.velocity.load_state_dict(state["velocity"])
        self.inner.load_state_dict(state["inner"])

    @classmethod
    def aggregate(
        cls,
        workers: Sequence[Compressor],
        rows: Sequence[Tensor],
        chunks: Sequence[Chunk],
        comm: Communicator,
        step: int,
        out: Tensor,
        local: Sequence[Tensor] | None = None,
        collective: str = "auto",
    ) -> None:
        efs = [w for w in workers if isinstance(w, ErrorFeedback)]
        assert len(efs) == len(workers)
        lead, n_workers, numel = efs[0], len(rows), rows[0].numel()
        inners = [ef.inner for ef in efs]
        protocol = type(inners[0]).aggregate

        grads: Sequence[Tensor] = rows
        if lead.momentum:
            grads = []
            for ef, row in zip(efs, rows, strict=True):
                velocity = ef.velocity.get(chunks, row)
                grads.append(velocity.mul_(lead.momentum).add_(row))

        if step < lead.start_after_steps:
            wire = scratch("ef.dense", (n_workers, numel), rows[0].dtype, rows[0].device)
            for w, g in enumerate(grads):
                wire[w].copy_(g)
            comm.all_reduce(wire, op="sum")
            torch.div(wire[0], comm.world_size, out=out)
            if lead.mode == "ef21":  # start from the full gradients, as EF21 allows
                for ef, g in zip(efs, grads, strict=True):
                    ef.memory.get(chunks, g).copy_(g)
                    ef.estimate.get(chunks, out).copy_(out)
            if local is not None:
                for w, g in enumerate(grads):
                    local[w].copy_(g)
            return

        masking = lead.momentum > 0 and lead.momentum_masking
        sent = scratch("ef.sent", (n_workers, numel), rows[0].dtype, rows[0].device)
        if lead.mode == "none":
            wanted = masking or local is not None
            protocol(inners, grads, chunks, comm, step, out, sent if wanted else None, collective)
        elif lead.mode == "ef14":
            memories = [ef.memory.get(chunks, g).add_(g) for ef, g in zip(efs, grads, strict=True)]
            protocol(inners, memories, chunks, comm, step, out, sent, collective)
            for memory, message in zip(memories, sent, strict=True):
                memory.sub_(message)
        else:
            memories = [ef.memory.get(chunks, g) for ef, g in zip(efs, grads, strict=True)]
            deltas = scratch("ef.delta", (n_workers, numel), rows[0].dtype, rows[0].device)
            for delta, g, memory in zip(deltas, grads, memories, strict=True):
                torch.sub(g, memory, out=delta)
            protocol(inners, list(deltas), chunks, comm, step, out, sent, collective)
            for memory, message in zip(memories, sent, strict=True):
                memory.add_(message)
            for ef in efs:
                ef.estimate.get(chunks, out).add_(out)
            out.copy_(lead.estimate.get(chunks, out))

        if masking:
            for velocity, message in zip(grads, sent, strict=True):
                velocity.masked_fill_(message != 0, 0.0)
        if local is not None:
            for w in range(n_workers):
                local[w].copy_(sent[w])
