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
from dpresearch.compress.workspace import Workspace


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
        # √(real entries) of each local row's served chunk (1 where none: its row is zero)
        self.real_count = torch.tensor(self.real, dtype=torch.float64).clamp(min=1).sqrt().to(
            torch.promote_types(dtype, torch.float32)).to(device)  # fmt: skip
        self.ws = Workspace()
        self._pad: Tensor | None = None
        self._offsets: dict[tuple[int, int], Tensor] = {}

    @property
    def bytes_per_call(self) -> int:
        """Bytes one worker hands to the collectives per call."""
        return (self.comm.world_size + 1) * self.message

    def __call__(self, x: Tensor, out: Tensor) -> None:
        """`out[w]` = the compressed average of all K workers' `x` rows (`[W, D]` each; the
        same for every row); `x` is not modified (`out` may be `x`).

        All rows at once, no per-row Python: one norm per side over the stacked rows, the
        signs packed over `[W·K, c]` in one call, and every decode (the senders' own messages
        for their errors included) one gather from a ±scale table per message (`_decode`)."""
        comm, k, c, d, ws = self.comm, self.comm.world_size, self.chunk, self.numel, self.ws
        rows = x.shape[0]
        dtype, device = self.dtype, self.device
        padded = self._padded(rows)  # [W, K·c], the padding zero
        compensated = torch.add(x, self.worker_error, out=padded[:, :d])
        scales = _rms(compensated, math.sqrt(d))  # [W]
        negative = torch.lt(padded, 0, out=ws.get("negative", (rows, k * c), torch.bool, device))
        wire = ws.get("wire", (rows, k, self.message), torch.uint8, device)
        wire[:, :, :4] = scales.to(torch.float32)[:, None, None].view(torch.uint8).expand(
            rows, k, 4
        )  # fmt: skip
        pack_rows(negative.view(rows * k, c), 1, wire.view(rows * k, -1)[:, 4:])
        sent = ws.get("sent", (rows, k * c), dtype, device)
        self._decode(wire[:, :, 4:].reshape(rows, -1), scales, sent, "own")
        torch.sub(compensated, sent[:, :d], out=self.worker_error)
        received = comm.all_to_all(wire)  # [W, K, message]: row w's chunk from every worker

        served = ws.get("served", (rows * k, c), dtype, device)
        self._decode(received[..., 4:].reshape(rows * k, -1), _scales(received, dtype), served)
        served = served.view(rows, k, c)
        average = ws.get("average", (rows, c), dtype, device).copy_(served[:, 0])
        for j in range(1, k):
            average.add_(served[:, j])
        average.div_(k).add_(self.server_error).mul_(self.valid)
        server_scales = _rms(average, self.real_count)
        server_negative = torch.lt(average, 0, out=ws.get("server_negative", (rows, c),
                                                          torch.bool, device))  # fmt: skip
        reply = ws.get("reply", (rows, self.message), torch.uint8, device)
        reply[:, :4] = server_scales.to(torch.float32)[:, None].view(torch.uint8)
        pack_rows(server_negative, 1, reply[:, 4:])
        server_sent = ws.get("server_sent", (rows, c), dtype, device)
        self._decode(reply[:, 4:], server_scales, server_sent, "server")
        torch.sub(average, server_sent, out=self.server_error).mul_(self.valid)
        gathered = comm.all_gather(reply)  # [K, message]: every served chunk
        result = ws.get("result", (k, c), dtype, device)
        self._decode(gathered[:, 4:], _scales(gathered, dtype), result, "gathered")
        out.copy_(result.view(-1)[:d].expand_as(out))

    def _padded(self, rows: int) -> Tensor:
        """A `[rows, K·c]` buffer whose columns past D stay zero (they are never written)."""
        if self._pad is None or self._pad.shape[0] != rows:
            k, c = self.comm.world_size, self.chunk
            self._pad = torch.zeros(rows, k * c, dtype=self.dtype, device=self.device)
        return self._pad

    def _decode(self, packed: Tensor, scales: Tensor, out: Tensor, name: str = "") -> None:
        """`out` `[M, c]` = scale·(±1) of every message's packed signs `packed` `[M, c/8]` with
        its scale `scales` `[M]`: one gather from a 256 × 8 table of ±scale per message."""
        m, nbytes = packed.shape
        ws, device = self.ws, self.device
        tables = ws.get(f"{name}.tables", (m, 256, 8), self.dtype, device)
        torch.mul(scales.view(m, 1, 1), self.table, out=tables)
        codes = ws.get(f"{name}.codes", (m, nbytes), torch.int32, device).copy_(packed)
        key = (m, nbytes)
        offsets = self._offsets.get(key)
        if offsets is None:  # message i's bytes pick from table i
            offsets = torch.arange(m, dtype=torch.int32, device=device).mul_(256).unsqueeze(1)
            self._offsets[key] = offsets
        codes.add_(offsets)
        torch.index_select(tables.view(-1, 8), 0, codes.view(-1), out=out.view(-1, 8))

    def state_dict(self) -> dict[str, Tensor]:
        """The worker and server errors (live tensors)."""
        return {"worker_error": self.worker_error, "server_error": self.server_error}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])


def _rms(rows: Tensor, root: float | Tensor) -> Tensor:
    """‖row‖₂/root of every row of `rows` `[R, n]` (`root`: √count, one number or `[R]`),
    accumulated in fp32 (fp64 for fp64 rows) and rounded to the fp32 the wire carries: the
    scale that makes (scale·sign) as long as the row's `count` real entries (the rest are
    zeros). `[R]`."""
    norm = torch.linalg.vector_norm(
        rows, 2, dim=1, dtype=torch.promote_types(rows.dtype, torch.float32)
    )
    return (norm / root).float().to(rows.dtype)


def _scales(messages: Tensor, dtype: torch.dtype) -> Tensor:
    """The fp32 scale heading every message of `messages` `[..., message]`: `[M]` in `dtype`."""
    head = messages[..., :4].reshape(-1, 4).contiguous()
    return head.view(torch.float32).view(-1).to(dtype)
