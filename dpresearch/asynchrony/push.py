"""What a worker pushes for its gradient: the gradient itself, or a compressed message with the
worker's own error-feedback memory.

Uncompressed (identity, no error feedback): the gradient row travels as it is, D elements.
Compressed, worker w with any gossip-capable codec C of the library (top-k, random-k, QSGD,
sign, TernGrad, casts) and the library's error-feedback memory (`compress.ErrorFeedback`, mode
none or ef14):

    p = memory.compensate(g)      (ef14: p = g + e_w; none: p = g)
    wire = C(p)                   (one row laid out by the codec's `WirePlan`, `wire_bytes`)
    d = D(wire)                   (decoded from the wire bytes: exactly what the server sees)
    memory.update(p, d)           (ef14: e_w ← p − d)

The codec's `step` argument is the worker's own gradient count, which the server also knows,
so codecs with shared randomness (random-k) decode the same indices on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dpresearch.compress import build_compressor, build_memory, param_layout, plan_buckets
from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.compress.casts import Identity
from dpresearch.compress.pairing import check_pairing


def parameter_chunks(
    model: nn.Module, granularity: str, bucket_mb: float, itemsize: int
) -> list[Chunk]:
    """The compression units over a flat parameter row of `model`, offsets from the row start."""
    return [
        Chunk(ch.key, bucket.start + ch.offset, ch.numel, ch.shape)
        for bucket in plan_buckets(param_layout(model), granularity, bucket_mb, itemsize)
        for ch in bucket.chunks
    ]


class PushCodec:
    """Encodes the pushes of the local workers `workers` (global ids) and decodes any push.

    compressor / error_feedback: config nodes (None: identity, none). model: the model whose
    flat parameter row is pushed (`Replicas` order). granularity: "tensor", "bucket" or
    "model" (what one chunk covers).
    """

    def __init__(
        self,
        model: nn.Module,
        params: Tensor,
        workers: Sequence[int],
        compressor: Mapping[str, Any] | None = None,
        error_feedback: Mapping[str, Any] | None = None,
        seed: int = 0,
        granularity: str = "tensor",
        bucket_mb: float = 25.0,
    ) -> None:
        method = build_compressor(compressor, seed)
        self.memory = build_memory(error_feedback)
        check_pairing(method, self.memory, "push")
        assert isinstance(method, SingleRoundCompressor)
        self.workers = tuple(workers)
        self.numel, self.dtype, self.device = params.shape[-1], params.dtype, params.device
        self.passthrough = type(method) is Identity and not self.memory.active
        if self.passthrough:
            self.wire_dtype, self.wire_size = params.dtype, self.numel
            return
        chunks = parameter_chunks(model, granularity, bucket_mb, params.element_size())
        self.codec = method.codec(chunks, params.dtype, params.device, self.workers)
        self.wire_dtype, self.wire_size = self.codec.layout.dtype, self.codec.wire_size
        self.memory.bind(len(self.workers), self.numel, params.dtype, params.device)
        self.decoded = torch.empty(1, self.numel, dtype=self.dtype, device=self.device)

    @property
    def wire_bytes(self) -> int:
        """Bytes of one push's gradient message."""
        return self.wire_size * self.wire_dtype.itemsize

    def encode(self, row: int, grad: Tensor, step: int) -> tuple[Tensor, Tensor]:
        """Local row `row`'s push of `grad` at its gradient count `step`: returns (the wire row
        to send, the gradient the server will decode from it). Updates the row's error memory.
        Both results are owned by this object and overwritten by the next call."""
        if self.passthrough:
            return grad, grad
        rows = slice(row, row + 1)
        p = self.memory.compensate(grad.unsqueeze(0), step, rows)
        wire = self.codec.encode(p, step, self.workers[rows])
        self.codec.decode(wire, step, self.decoded)
        self.memory.update(p, self.decoded, rows)
        return wire[0], self.decoded[0]

    def state_dict(self) -> dict:
        """The local workers' error-feedback memories (none when pushes pass through
        uncompressed); live tensors."""
        return {} if self.passthrough else {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.passthrough:
            if state:
                raise ValueError("push codec state: saved compressed, this run pushes plainly")
            return
        self.memory.load_state_dict(state["memory"])

    def decode(self, wire: Tensor, step: int, out: Tensor) -> Tensor:
        """The gradient a pushed wire row carries (server side): decoded into `out`, or `wire`
        itself when pushes pass through uncompressed (no copy: it is read before the wire row
        is overwritten)."""
        if self.passthrough:
            return wire
        self.codec.decode(wire.unsqueeze(0), step, out.unsqueeze(0))
        return out
