"""One compressed channel for every consumer that exchanges parameter rows its own way (gossip,
pushes): the factory that builds the compressor and the error-feedback memory from their config
nodes, checks their pairing against what the consumer declared (`ChannelNeeds`), plans the
chunks over the model's flat parameter row and decides the no-compression shortcut.

An algorithm declares what it needs once, as a class attribute, and opens its channel in a few
lines:

    class DeepSqueeze(Gossip):
        channel = ChannelNeeds.gossip("DeepSqueeze")     # read by the configuration checks too

        def __init__(self, replicas, comm, optimizers, compressor=None, seed=0, ...):
            ...
            self.link = open_channel(self.channel, replicas.models[0], replicas.params,
                                     comm.local_workers, compressor, seed=seed)
            wire = self.link.codec.encode(x, step)          # [W, L], exact bytes
            self.link.codec.accumulate(received, step, out, weights)

A push (one row, with the worker's own memory) is `link.encode(row, g, step)` → (wire row,
what the receiver decodes), and `link.decode(wire, step, out)` on the receiving side. Where
compression is the identity without memory and the consumer takes the shortcut (`shortcut`,
the default), the channel is `plain`: no codec, rows travel as they are.

Synchronous aggregation has its own consumer (`reducer.CompressedReducer`, built by
`build.build_reducer`), which uses the same compressor and memory builders and the same test for
the shortcut (`uncompressed`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from hydra.utils import instantiate
from torch import Tensor, nn

from dpresearch.compress.base import Chunk, Compressor, SingleRoundCompressor
from dpresearch.compress.casts import Identity
from dpresearch.compress.codec import Codec
from dpresearch.compress.error_feedback import ErrorFeedback
from dpresearch.compress.layout import param_layout, plan_buckets
from dpresearch.compress.pairing import ChannelNeeds, check_pairing

IDENTITY = MappingProxyType({"_target_": "dpresearch.compress.casts.Identity"})


def build_compressor(compressor_cfg: Mapping[str, Any] | None, seed: int) -> Compressor:
    """The compressor a `compressor` node describes (None: identity), seeded by the run."""
    return instantiate(compressor_cfg or dict(IDENTITY), seed=seed)


def build_memory(error_feedback_cfg: Mapping[str, Any] | None) -> ErrorFeedback:
    """The error feedback an `error_feedback` node describes (None: none). A node without
    `_target_` holds `ErrorFeedback` keyword arguments."""
    if error_feedback_cfg is None:
        return ErrorFeedback(mode="none")
    if "_target_" in error_feedback_cfg:
        return instantiate(error_feedback_cfg)
    return ErrorFeedback(**error_feedback_cfg)


def uncompressed(compressor: Compressor, memory: ErrorFeedback) -> bool:
    """Whether messages may travel as the rows themselves: the identity compressor and a
    memory that does nothing (the one test of the no-compression shortcut)."""
    return type(compressor) is Identity and not memory.active


def is_identity(compressor_cfg: Mapping[str, Any] | None) -> bool:
    """Whether a `compressor` node builds the identity (a node that does not build is not)."""
    try:
        return type(build_compressor(compressor_cfg, 0)) is Identity
    except Exception:
        return False


def is_inactive(error_feedback_cfg: Mapping[str, Any] | None) -> bool:
    """Whether an `error_feedback` node builds a memory that changes nothing (`active`; a node
    that does not build is not inactive)."""
    try:
        return not build_memory(error_feedback_cfg).active
    except Exception:
        return False


def compresses(
    compressor_cfg: Mapping[str, Any] | None, error_feedback_cfg: Mapping[str, Any] | None
) -> bool:
    """Whether these nodes change the messages: `uncompressed`'s test on what they build, so
    the classes' own defaults decide, not target strings."""
    return not (is_identity(compressor_cfg) and is_inactive(error_feedback_cfg))


def parameter_chunks(
    model: nn.Module, granularity: str, bucket_mb: float, itemsize: int
) -> list[Chunk]:
    """The compression units over a flat parameter row of `model`, offsets from the row start:
    "tensor" (one per parameter tensor), "bucket" (buckets of `bucket_mb`) or "model"."""
    return [
        Chunk(ch.key, bucket.start + ch.offset, ch.numel, ch.shape)
        for bucket in plan_buckets(param_layout(model), granularity, bucket_mb, itemsize)
        for ch in bucket.chunks
    ]


class Channel:
    """A consumer's compressed messages over the flat parameter rows of the local workers
    `workers` (global ids): `codec` over the model's chunks (None when `plain`) and `memory`,
    the error-feedback memory bound to those rows. Built by `open_channel`."""

    def __init__(
        self,
        needs: ChannelNeeds,
        compressor: Compressor,
        memory: ErrorFeedback,
        model: nn.Module,
        params: Tensor,
        workers: Sequence[int],
        granularity: str = "tensor",
        bucket_mb: float = 25.0,
        shortcut: bool = True,
    ) -> None:
        if not needs.weighted:
            raise ValueError("a sync consumer aggregates through build_reducer, not a channel")
        check_pairing(compressor, memory, needs)
        assert isinstance(compressor, SingleRoundCompressor)  # (`gossip` codecs are)
        self.needs, self.compressor, self.memory = needs, compressor, memory
        self.workers = tuple(workers)
        self.numel, self.dtype, self.device = params.shape[-1], params.dtype, params.device
        self.plain = shortcut and uncompressed(compressor, memory)
        self.codec: Codec | None = None
        if self.plain:
            self.wire_dtype, self.wire_size = params.dtype, self.numel
            return
        chunks = parameter_chunks(model, granularity, bucket_mb, params.element_size())
        self.codec = compressor.codec(chunks, params.dtype, params.device, self.workers)
        self.wire_dtype, self.wire_size = self.codec.layout.dtype, self.codec.wire_size
        memory.bind(len(self.workers), self.numel, params.dtype, params.device)
        self.decoded = torch.empty(1, self.numel, dtype=self.dtype, device=self.device)

    @property
    def wire_bytes(self) -> int:
        """Bytes of one row's message."""
        return self.wire_size * self.wire_dtype.itemsize

    def encode(self, row: int, x: Tensor, step: int) -> tuple[Tensor, Tensor]:
        """Local row `row`'s message of `x` `[D]` at `step` (a push: the worker's gradient
        count): returns (the wire row to send, what the receiver will decode from it), and
        updates the row's error memory. Both results are owned by the channel and overwritten
        by the next call (plain: `x` itself, twice)."""
        if self.codec is None:
            return x, x
        rows = slice(row, row + 1)
        p = self.memory.compensate(x.unsqueeze(0), step, rows)
        wire = self.codec.encode(p, step, self.workers[rows])
        self.codec.decode(wire, step, self.decoded)
        self.memory.update(p, self.decoded, rows)
        return wire[0], self.decoded[0]

    def decode(self, wire: Tensor, step: int, out: Tensor) -> Tensor:
        """The row a received wire row `[L]` carries: decoded into `out` `[D]`, or `wire` itself
        when plain (no copy: read it before the wire row is overwritten)."""
        if self.codec is None:
            return wire
        self.codec.decode(wire.unsqueeze(0), step, out.unsqueeze(0))
        return out

    def state_dict(self) -> dict:
        """The local rows' error-feedback memories (none when plain); live tensors."""
        return {} if self.plain else {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.plain:
            if state:
                raise ValueError("channel state: saved compressed, this run sends plainly")
            return
        self.memory.load_state_dict(state["memory"])


def open_channel(
    needs: ChannelNeeds,
    model: nn.Module,
    params: Tensor,
    workers: Sequence[int],
    compressor: Mapping[str, Any] | None = None,
    error_feedback: Mapping[str, Any] | None = None,
    seed: int = 0,
    granularity: str = "tensor",
    bucket_mb: float = 25.0,
    shortcut: bool = True,
) -> Channel:
    """The channel for a consumer declaring `needs`, from the `compressor` / `error_feedback`
    config nodes (None: identity, none), seeded by the run: `params` are the flat parameter
    rows of `model` (`Replicas` order; one row or the local workers' `[W, D]`) that `workers`
    send. `shortcut=False`: run the codec even for the identity (a consumer whose state update
    is written against decoded messages)."""
    return Channel(needs, build_compressor(compressor, seed), build_memory(error_feedback),
                   model, params, workers, granularity, bucket_mb, shortcut)  # fmt: skip
