"""Gradient compression: compressors with exact wire bytes, codecs over stacked rows, one
error-feedback memory, and the reducer, DDP hook and channel that run them over any worker
layout.

Aggregating stacked rows synchronously (gradients, an outer optimizer's pseudo-gradients):

    reducer = build_reducer(cfg.compressor, cfg.error_feedback, comm, layout, cfg.seed,
                            dtype=rows.dtype, device=rows.device)
    reducer.reduce(rows, step)     # rows [W, D]: each becomes the aggregate, EF applied

Exchanging compressed parameter rows another way (gossip, pushes): the algorithm declares what
it needs once (`channel = ChannelNeeds.gossip("CHOCO-SGD")` / `ChannelNeeds.push()`, read by
the configuration checks too) and opens one `Channel` (`channel.py`):

    link = open_channel(self.channel, model, params, workers, cfg.compressor,
                        cfg.error_feedback, cfg.seed, granularity, bucket_mb)
    link.plain                                 # identity, no memory: rows travel as they are
    wire = link.codec.encode(x, step)          # x [W, n] -> wire [W, L], exact bytes
    ...send wire rows: neighbour exchange, a message...
    link.codec.accumulate(received, step, out, weights)  # out[b] += Σ_r weights[b,r]·D(...)
    wire, sent = link.encode(row, g, step)     # one row with its own memory (a push)
    link.decode(wire, step, out)               # the receiver's side

The pieces underneath: `build_compressor` / `build_memory` from config nodes; a compressor's
`codec(chunks, dtype, device, workers)` (encode, decode, accumulate); the memory's
`compensate(x, step) -> p` and `update(p, sent)`; `check_pairing(compressor, memory, needs)`.

`codec.py` explains codecs, `base.py` the compressor contract and capabilities, `pairing.py`
what may be combined (`ChannelNeeds`), `error_feedback.py` the memory (EF14, EF21, DGC
momentum and masking, dense warm-up). PowerSGD's two rounds are its `aggregation` (`reducer`
runs it). Write a compressor by subclassing `ChunkCompressor` (per chunk, per worker) or
`SingleRoundCompressor` with your own batched `Codec` (see the README). Config nodes are
validated by `check_compatibility` / `check_algorithm_node`.
"""

from dpresearch.compress.base import (
    Aggregation,
    Chunk,
    ChunkCompressor,
    Compressor,
    SingleRoundCompressor,
)
from dpresearch.compress.build import build_reducer, check_algorithm_node, check_compatibility
from dpresearch.compress.casts import BF16, FP16, Identity
from dpresearch.compress.channel import (
    Channel,
    build_compressor,
    build_memory,
    open_channel,
    parameter_chunks,
)
from dpresearch.compress.codec import ChunkCodec, Codec, WirePlan
from dpresearch.compress.ddp_hook import make_comm_hook
from dpresearch.compress.error_feedback import ErrorFeedback
from dpresearch.compress.fp4 import FP4
from dpresearch.compress.layout import param_layout, plan_buckets
from dpresearch.compress.natural import Natural
from dpresearch.compress.onebit import OneBit
from dpresearch.compress.pairing import ChannelNeeds, check_pairing
from dpresearch.compress.powersgd import PowerSGD
from dpresearch.compress.qsgd import QSGD
from dpresearch.compress.randomk import RandomK
from dpresearch.compress.reducer import CompressedReducer
from dpresearch.compress.sign import MajorityVote, ScaledSign
from dpresearch.compress.sketch import Sketch
from dpresearch.compress.terngrad import TernGrad
from dpresearch.compress.threshold import Threshold
from dpresearch.compress.topk import TopK

__all__ = [
    "BF16",
    "FP4",
    "FP16",
    "QSGD",
    "Aggregation",
    "Channel",
    "ChannelNeeds",
    "Chunk",
    "ChunkCodec",
    "ChunkCompressor",
    "Codec",
    "CompressedReducer",
    "Compressor",
    "ErrorFeedback",
    "Identity",
    "MajorityVote",
    "Natural",
    "OneBit",
    "PowerSGD",
    "RandomK",
    "ScaledSign",
    "SingleRoundCompressor",
    "Sketch",
    "TernGrad",
    "Threshold",
    "TopK",
    "WirePlan",
    "build_compressor",
    "build_memory",
    "build_reducer",
    "check_algorithm_node",
    "check_compatibility",
    "check_pairing",
    "make_comm_hook",
    "open_channel",
    "parameter_chunks",
    "param_layout",
    "plan_buckets",
]
