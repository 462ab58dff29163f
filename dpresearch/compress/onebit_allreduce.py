"""Error-compensated 1-bit allreduce (1-bit Adam, Tang et al. 2021, Algorithm 1; DeepSpeed's
`compressed_allreduce`), over stacked rows.

With K workers, a row of D entries is cut into K chunks of c entries (c = ⌈D/K⌉ rounded up to
a multiple of 8, so every chunk's bits fill whole bytes; the last chunks may hold fewer real
entries, or none). Worker k serves chunk k (the paper's server, spread over the workers):

    worker w:  b = x_w + δ_w;  C(b) = (‖b‖₂/√D)·sign(b);  δ_w ← b − C(b)
               send chunk k of C(b) to worker k          (one all-to-all: scale + c sign bits)
    server k:  a = (1/K) Σ_w chunk k of C(b_w) + δ̄_k;  C(a) = (‖a‖₂/√n_k)·sign(a);
               δ̄_k ← a − C(a)                            (n_k: the chunk's real entries)
    everyone:  x̄ = the K chunks C(a_k), gathered        (one allgather: scale + c sign bits)

sign(0) = +1 (as DeepSpeed: a 1-bit code has no zero). The scale makes C(b) as long as b in ℓ2.
Chunk sums add workers in order and every norm is one row's own reduction, so a row's result
never depends on how workers are spread over processes.

Bytes per worker and call: K·(4 + c/8) handed to the all-to-all (its K messages, its own
included), then 4 + c/8 to the allgather.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.compress.wire import pack_rows, sign_table


class OneBitAllreduce:
    """The error-compensated 1-bit allreduce of rows of `numel` entries over `comm` (see the
    module docstring). Holds the worker errors δ (`[W, D]`, one per local worker) and the server
    errors δ̄ (`[W, c]`, for the chunk each local worker serves), zero at first."""

    def __init__(
        self,
        comm: Communicator,
        numel: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.comm, self.numel = comm, numel
        k = comm.world_size
        self.chunk = 8 * math.ceil(math.ceil(numel / k) / 8)
        self.message = 4 + self.chunk // 8  # bytes: scale, then packed signs
        self.dtype, self.device = dtype, torch.device(device)
        rows = comm.num_local
        self.worker_error = torch.zeros(rows, numel, dtype=dtype, device=device)
        self.server_error = torch.zeros(rows, self.chunk, dtype=dtype, device=device)
        # real entries of the chunk each local row serves
        served = torch.tensor(comm.local_workers)
        self.real = (numel - served * self.chunk).clamp(0, self.chunk).tolist()
        self.valid = (torch.arange(self.chunk).unsqueeze(0) < served.new_tensor(self.real)
                      .unsqueeze(1)).to(device)  # fmt: skip
        self.table = sign_table(dtype, self.device)

    @property
    def bytes_per_call(self) -> int:
        """Bytes one worker hands to the collectives per call."""
        return (self.comm.world_size + 1) * self.message

    def __call__(self, x: Tensor, out: Tensor) -> None:
        """`out[w]` = the compressed average of all K workers' `x` rows (`[W, D]` each; the
        same for every row); `x` is not modified (`out` may be `x`)."""
        comm, k, c = self.comm, self.comm.world_size, self.chunk
        rows = x.shape[0]
        compensated = x + self.worker_error
        scales = torch.stack([_rms(row) for row in compensated])  # [W]
        padded = compensated.new_zeros(rows, k * c)
        padded[:, : self.numel] = compensated
        negative = padded < 0
        decoded = torch.where(negative[:, : self.numel], -scales[:, None], scales[:, None])
        torch.sub(compensated, decoded, out=self.worker_error)
        wire = torch.empty(rows, k, self.message, dtype=torch.uint8, device=self.device)
        wire[:, :, :4] = scales.to(torch.float32)[:, None, None].view(torch.uint8).expand(
            rows, k, 4
        )  # fmt: skip
        pack_rows(negative.view(rows * k, c), 1, wire.view(rows * k, -1)[:, 4:])
        received = comm.all_to_all(wire)  # [W, K, message]: row w's chunk from every worker

        served = self._decode(received.view(rows * k, -1)).view(rows, k, c)
        average = served[:, 0].clone()
        for j in range(1, k):
            average.add_(served[:, j])
        average.div_(k).add_(self.server_error).mul_(self.valid)
        server_scales = torch.stack(
            [_rms(row[:n]) if n else row.new_zeros(()) for row, n in zip(average, self.real,
                                                                         strict=True)]
        )  # fmt: skip
        server_negative = average < 0
        decoded = torch.where(server_negative, -server_scales[:, None], server_scales[:, None])
        torch.sub(average, decoded, out=self.server_error).mul_(self.valid)
        reply = torch.empty(rows, self.message, dtype=torch.uint8, device=self.device)
        reply[:, :4] = server_scales.to(torch.float32)[:, None].view(torch.uint8)
        pack_rows(server_negative, 1, reply[:, 4:])
        gathered = comm.all_gather(reply)  # [K, message]: every served chunk
        result = self._decode(gathered).reshape(-1)[: self.numel]
        out.copy_(result.expand_as(out))

    def _decode(self, messages: Tensor) -> Tensor:
        """(scale · ±1) of every message `[M, message]`: `[M, c]`."""
        scales = messages[:, :4].contiguous().view(torch.float32).to(self.dtype)  # [M, 1]
        signs = self.table.index_select(0, messages[:, 4:].reshape(-1).long())
        return signs.view(messages.shape[0], self.chunk) * scales

    def state_dict(self) -> dict[str, Tensor]:
        """The worker and server errors (live tensors)."""
        return {"worker_error": self.worker_error, "server_error": self.server_error}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])


def _rms(row: Tensor) -> Tensor:
    """‖row‖₂/√len(row), accumulated in fp32 (fp64 for fp64 rows) and rounded to the fp32 the
    wire carries: the scale that makes (scale·sign) as long as `row`."""
    norm = torch.linalg.vector_norm(row, 2, dtype=torch.promote_types(row.dtype, torch.float32))
    return (norm / math.sqrt(row.numel())).float().to(row.dtype)
