"""Building compressors, error feedback and the reducer from the `compressor` and
`error_feedback` config nodes, and rejecting impossible pairings before any worker starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from dpresearch.comm.base import Communicator
from dpresearch.compress.channel import build_compressor, build_memory
from dpresearch.compress.layout import GRANULARITIES, ParamLayout
from dpresearch.compress.pairing import SYNC, ChannelNeeds, check_pairing
from dpresearch.compress.reducer import CompressedReducer, HierarchicalReducer
from dpresearch.options import Options

# The channel's keys an algorithm node may carry beside its compressor (`check_algorithm_node`).
CHANNEL_KEYS = ("granularity", "bucket_mb", "collective")


@dataclass(frozen=True)
class ChannelOptions(Options):
    """The keys of an algorithm whose messages go through a compressor (declarations that
    derive from this one take them; a default may be re-declared)."""

    granularity: str = "tensor"
    """what one compressor call sees: tensor (one chunk per parameter) | bucket | model"""
    bucket_mb: float = 25.0
    """size of a communication bucket, MB (granularity=bucket)"""


def build_reducer(
    compressor_cfg: Mapping[str, Any] | None,
    error_feedback_cfg: Mapping[str, Any] | None,
    comm: Communicator,
    layout: ParamLayout,
    seed: int,
    granularity: str = "auto",
    bucket_mb: float = 25.0,
    collective: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    replicated_nodes: bool = False,
) -> CompressedReducer | HierarchicalReducer:
    """The reducer for these config nodes; worker w draws its streams with (seed, w). On a
    two-level cluster (`comm.tiers`) the `HierarchicalReducer` (node leaders' ids draw);
    `replicated_nodes`: its rows are equal inside each node (`HierarchicalReducer`)."""
    if replicated_nodes and comm.tiers is None:
        raise ValueError("replicated_nodes needs a two-level cluster (comm.tiers)")
    reducer = HierarchicalReducer if comm.tiers is not None else CompressedReducer
    # only the two-level reducer knows the keyword; a flat run calls exactly as before
    extra = {"replicated_nodes": True} if replicated_nodes else {}
    return reducer(
        build_compressor(compressor_cfg, seed),
        comm,
        layout,
        build_memory(error_feedback_cfg),
        granularity,
        bucket_mb,
        collective,
        dtype,
        device,
        **extra,
    )


def check_compatibility(
    compressor_cfg: Mapping[str, Any] | None,
    error_feedback_cfg: Mapping[str, Any] | None = None,
    granularity: str = "auto",
    bucket_mb: float = 25.0,
    collective: str = "auto",
    optimizer_momentum: float = 0.0,
    where: str = "algorithm",
    use: ChannelNeeds | str = SYNC,
) -> None:
    """Raise ValueError (one line, naming the key to change) for a configuration that cannot
    run or would run wrongly: the nodes' own arguments, then `pairing.check_pairing` for the
    consumer's declared needs `use` (`Algorithm.channel`). `where` is the config node holding
    granularity, bucket_mb and collective."""
    try:
        compressor = build_compressor(compressor_cfg, 0)
    except Exception as exc:
        raise ValueError(f"compressor.{_cause(exc)}") from None
    try:
        memory = build_memory(error_feedback_cfg)
    except Exception as exc:
        raise ValueError(f"error_feedback.{_cause(exc)}") from None
    if granularity != "auto" and granularity not in GRANULARITIES:
        raise ValueError(
            f"{where}.granularity={granularity}; choose one of: auto, {', '.join(GRANULARITIES)}"
        )
    if granularity == "bucket" and bucket_mb <= 0:
        raise ValueError(f"{where}.bucket_mb={bucket_mb}: must be > 0 with granularity=bucket")
    check_pairing(compressor, memory, use, collective, optimizer_momentum, where)


def check_algorithm_node(
    algorithm: Mapping[str, Any],
    use: ChannelNeeds | str,
    optimizer_momentum: float = 0.0,
    error_feedback: Mapping[str, Any] | None = None,
    options: Options | None = None,
) -> None:
    """`check_compatibility` for an `algorithm` config node holding `compressor` and,
    optionally, `error_feedback` (else `error_feedback`, the run's node), consumed as the
    algorithm declares (`use`), with the `CHANNEL_KEYS` the node sets, a missing one at the
    default of the algorithm's declared `options` (`OPTIONS.from_node(node)`; None: none
    declared)."""
    knobs = {k: algorithm[k] for k in CHANNEL_KEYS if k in algorithm}
    if options is not None:  # (a missing key: the declared default)
        knobs |= {f.name: getattr(options, f.name) for f in fields(options)}
    check_compatibility(
        algorithm.get("compressor"),
        algorithm.get("error_feedback", error_feedback),
        optimizer_momentum=optimizer_momentum,
        where="algorithm",
        use=use,
        **{k: v for k, v in knobs.items() if k in CHANNEL_KEYS},
    )


def _cause(exc: Exception) -> str:
    """The innermost message (Hydra wraps constructor errors in InstantiationException)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__  # type: ignore[assignment]
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
