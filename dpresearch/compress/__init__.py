"""Gradient compression: compressors with exact wire bytes, codecs over stacked rows, one
error-feedback memory, and the reducer and DDP hook that run them over any worker layout.

Aggregating stacked rows synchronously (gradients, an outer optimizer's pseudo-gradients):

    reducer = build_reducer(cfg.compressor, cfg.error_feedback, comm, layout, cfg.seed,
                            dtype=rows.dtype, device=rows.device)
    reducer.reduce(rows, step)     # rows [W, D]: each becomes the aggregate, EF applied

The pieces, for an algorithm that exchanges compressed rows its own way (gossip, pushes):

    compressor = build_compressor(cfg.compressor, cfg.seed)        # the method, one per process
    memory = build_memory(cfg.error_feedback).bind(W, n, dtype, device)
    check_pairing(compressor, memory, use="sync" | "gossip" | "push")   # once, before any step
    codec = compressor.codec(chunks, dtype, device, workers)       # once per chunk set (layout)

    p = memory.compensate(x, step)             # x [W, n] -> p [W, n] (rows=, cols= to address
    wire = codec.encode(p, step)               #   part of the state); wire [W, L], exact bytes
    ...send wire rows: allreduce (codec.linear), allgather, neighbour exchange, a push...
    codec.decode(wire, step, sent)             # own rows as the receivers decode them
    memory.update(p, sent)                     # e ← p − sent (EF14), h ← h + sent (EF21), ...
    codec.accumulate(received, step, out, weights)   # out[b] += Σ_r weights[b,r]·D(received[b,r])

`codec.py` explains codecs, `base.py` the compressor contract and capabilities, `pairing.py`
what may be combined, `error_feedback.py` the memory (EF14, EF21, DGC momentum and masking,
dense warm-up). PowerSGD's two rounds are its `aggregation` (`reducer` runs it). Write a
compressor by subclassing `ChunkCompressor` (per chunk, per worker) or `SingleRoundCompressor`
with your own batched `Codec` (see the README). Config nodes are validated by
`check_compatibility` / `check_algorithm_node`.
"""

from dpresearch.compress.base import (
    Aggregation,
    Chunk,
    ChunkCompressor,
    Compressor,
    SingleRoundCompressor,
)
from dpresearch.compress.build import (
    build_compressor,
    build_memory,
    build_reducer,
    check_algorithm_node,
    check_compatibility,
)
from dpresearch.compress.casts import BF16, FP16, Identity
from dpresearch.compress.codec import ChunkCodec, Codec, WirePlan
from dpresearch.compress.ddp_hook import make_comm_hook
from dpresearch.compress.error_feedback import ErrorFeedback
from dpresearch.compress.layout import param_layout, plan_buckets
from dpresearch.compress.natural import Natural
from dpresearch.compress.onebit import OneBit
from dpresearch.compress.pairing import check_pairing
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
    "FP16",
    "QSGD",
    "Aggregation",
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
    "param_layout",
    "plan_buckets",
]
