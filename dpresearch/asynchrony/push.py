"""What a worker pushes for its gradient: the gradient itself, or a compressed message with the
worker's own error-feedback memory.

Uncompressed (identity, no error feedback): the gradient row travels as it is, D elements.
Compressed, worker w with any single-round codec C of the library (top-k, random-k, QSGD,
sign, TernGrad, casts):

    p = g + e_w (ef14; p = g without error feedback)
    wire = C(p)                   (one row laid out by a `WirePlan`, `wire_bytes` bytes)
    d = D(wire)                   (decoded from the wire bytes: exactly what the server sees)
    e_w ← p − d (ef14)

The codec's `step` argument is the worker's own gradient count, which the server also knows,
so codecs with shared randomness (random-k) decode the same indices on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dpresearch.compress import build_compressor, param_layout, plan_buckets
from dpresearch.compress.base import Chunk, SingleRoundCompressor

IDENTITY = "dpresearch.compress.casts.Identity"
EF_MODES = ("none", "ef14")


def error_feedback_mode(node: Mapping[str, Any] | None) -> str:
    """The error-feedback mode of an `error_feedback` node; ValueError for what pushes cannot do
    (EF21's shared estimate, DGC momentum, dense warm-up)."""
    if node is None:
        return "none"
    mode = node.get("mode", "none")
    if mode not in EF_MODES:
        raise ValueError(
            f"error_feedback.mode={mode}: asynchronous pushes support error_feedback=none or "
            "ef14 (each worker's own memory)"
        )
    if float(node.get("momentum", 0.0) or 0.0) > 0 or int(node.get("start_after_steps", 0) or 0):
        raise ValueError(
            "asynchronous pushes take no error_feedback.momentum or start_after_steps; use the "
            "server optimizer's momentum (optimizer.momentum) instead"
        )
    return mode


def check_codec(node: Mapping[str, Any] | None) -> SingleRoundCompressor:
    """The codec a compressor node builds (worker 0's); ValueError if it cannot encode a push."""
    codec = build_compressor(node or {"_target_": IDENTITY}, None, 0, 0)
    if not isinstance(codec, SingleRoundCompressor) or not codec.gossip:
        raise ValueError(
            f"compressor {type(codec).__name__} cannot compress a push (a multi-round protocol "
            "or a vote needs every worker at once); choose e.g. compressor=topk, randomk, qsgd, "
            "sign, terngrad, fp16 or identity"
        )
    return codec


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
    "model" (what one codec call sees).
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
        node = compressor or {"_target_": IDENTITY}
        self.ef = error_feedback_mode(error_feedback)
        self.passthrough = node.get("_target_") == IDENTITY and self.ef == "none"
        self.numel, self.dtype, self.device = params.shape[-1], params.dtype, params.device
        check_codec(node)
        if self.passthrough:
            self.wire_dtype, self.wire_size = params.dtype, self.numel
            return
        self.codecs = [build_compressor(node, None, seed, w) for w in workers]
        chunks = parameter_chunks(model, granularity, bucket_mb, params.element_size())
        self.plan = self.codecs[0].wire_plan(chunks, params.dtype)
        self.wire_dtype, self.wire_size = self.plan.layout.dtype, self.plan.layout.size
        rows = len(self.codecs)
        self.memory = torch.zeros(rows, self.numel, dtype=self.dtype, device=self.device)
        self.wire = torch.empty(rows, self.wire_size, dtype=self.wire_dtype, device=self.device)
        self.decoded = torch.empty(self.numel, dtype=self.dtype, device=self.device)

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
        wire, decoded = self.wire[row], self.decoded
        p = self.memory[row].add_(grad) if self.ef == "ef14" else grad
        self.codecs[row].encode(p, self.plan, step, wire)
        self.codecs[0].decode(wire, self.plan, step, decoded)
        if self.ef == "ef14":
            p.sub_(decoded)
        return wire, decoded

    def state_dict(self) -> dict:
        """The local workers' error-feedback memories and codec states (none when pushes pass
        through uncompressed)."""
        if self.passthrough:
            return {}
        return {"memory": self.memory, "codecs": [c.state_dict() for c in self.codecs]}

    def load_state_dict(self, state: dict) -> None:
        if self.passthrough:
            if state:
                raise ValueError("push codec state: saved compressed, this run pushes plainly")
            return
        self.memory.copy_(state["memory"])
        for codec, saved in zip(self.codecs, state["codecs"], strict=True):
            codec.load_state_dict(saved)

    def decode(self, wire: Tensor, step: int, out: Tensor) -> Tensor:
        """The gradient a pushed wire row carries (server side), into `out`."""
        if self.passthrough:
            return out.copy_(wire)
        self.codecs[0].decode(wire, self.plan, step, out)
        return out
