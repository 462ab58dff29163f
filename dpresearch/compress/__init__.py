"""Gradient compression: compressors with exact wire bytes, error feedback, and the reducer and
DDP hook that run them over any worker layout.

Build from config: `build_reducer(cfg.compressor, cfg.error_feedback, comm, layout, cfg.seed)`;
validate first with `check_compatibility`.
"""

from dpresearch.compress.base import Chunk, Compressor, SingleRoundCompressor
from dpresearch.compress.build import build_compressor, build_reducer, check_compatibility
from dpresearch.compress.casts import BF16, FP16, Identity
from dpresearch.compress.ddp_hook import make_comm_hook
from dpresearch.compress.error_feedback import ErrorFeedback
from dpresearch.compress.layout import param_layout, plan_buckets
from dpresearch.compress.powersgd import PowerSGD
from dpresearch.compress.qsgd import QSGD
from dpresearch.compress.randomk import RandomK
from dpresearch.compress.reducer import CompressedReducer
from dpresearch.compress.sign import MajorityVote, ScaledSign
from dpresearch.compress.terngrad import TernGrad
from dpresearch.compress.topk import TopK

__all__ = [
    "BF16",
    "FP16",
    "QSGD",
    "Chunk",
    "CompressedReducer",
    "Compressor",
    "ErrorFeedback",
    "Identity",
    "MajorityVote",
    "PowerSGD",
    "RandomK",
    "ScaledSign",
    "SingleRoundCompressor",
    "TernGrad",
    "TopK",
    "build_compressor",
    "build_reducer",
    "check_compatibility",
    "make_comm_hook",
    "param_layout",
    "plan_buckets",
]
