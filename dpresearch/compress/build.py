"""Building compressors and the reducer from the `compressor` and `error_feedback` config nodes,
and rejecting impossible pairings before any worker starts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hydra.utils import instantiate

from dpresearch.comm.base import Communicator
from dpresearch.compress.base import COLLECTIVES, Compressor
from dpresearch.compress.error_feedback import ErrorFeedback
from dpresearch.compress.layout import GRANULARITIES, ParamLayout
from dpresearch.compress.powersgd import PowerSGD
from dpresearch.compress.reducer import CompressedReducer
from dpresearch.compress.sign import MajorityVote

# Arguments supplied at build time, never by a config file (for validate.RUNTIME_ARGS).
RUNTIME_ARGS = {"compressor": {"seed", "worker"}, "error_feedback": {"inner"}}


def build_compressor(
    compressor_cfg: Mapping[str, Any],
    error_feedback_cfg: Mapping[str, Any] | None,
    seed: int,
    worker: int,
) -> Compressor:
    """Worker `worker`'s compressor, wrapped in error feedback when `error_feedback_cfg` is set."""
    compressor = instantiate(compressor_cfg, seed=seed, worker=worker)
    if error_feedback_cfg is None:
        return compressor
    return instantiate(error_feedback_cfg, inner=compressor)


def build_reducer(
    compressor_cfg: Mapping[str, Any],
    error_feedback_cfg: Mapping[str, Any] | None,
    comm: Communicator,
    layout: ParamLayout,
    seed: int,
    granularity: str = "auto",
    bucket_mb: float = 25.0,
    collective: str = "auto",
) -> CompressedReducer:
    """A reducer whose local worker w uses compressor seeded by (seed, comm.local_workers[w])."""
    compressors = [
        build_compressor(compressor_cfg, error_feedback_cfg, seed, w) for w in comm.local_workers
    ]
    return CompressedReducer(compressors, comm, layout, granularity, bucket_mb, collective)


def check_compatibility(
    compressor_cfg: Mapping[str, Any],
    error_feedback_cfg: Mapping[str, Any] | None = None,
    granularity: str = "auto",
    bucket_mb: float = 25.0,
    collective: str = "auto",
    optimizer_momentum: float = 0.0,
    where: str = "algorithm",
) -> None:
    """Raise ValueError (one line, naming the key to change) for a configuration the reducer
    cannot run or would run wrongly. `where` is the config node holding granularity, bucket_mb
    and collective."""
    try:
        inner = instantiate(compressor_cfg, seed=0, worker=0)
    except Exception as exc:  # noqa: BLE001 - constructor errors are the user's to fix
        raise ValueError(f"compressor.{_cause(exc)}") from None
    ef = None
    if error_feedback_cfg is not None:
        try:
            ef = instantiate(error_feedback_cfg, inner=inner)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"error_feedback.{_cause(exc)}") from None
    name = type(inner).__name__
    if granularity != "auto" and granularity not in GRANULARITIES:
        raise ValueError(
            f"{where}.granularity={granularity}; choose one of: auto, {', '.join(GRANULARITIES)}"
        )
    if granularity == "bucket" and bucket_mb <= 0:
        raise ValueError(f"{where}.bucket_mb={bucket_mb}: must be > 0 with granularity=bucket")
    if collective not in COLLECTIVES:
        choices = ", ".join(COLLECTIVES)
        raise ValueError(f"{where}.collective={collective}; choose one of: {choices}")
    if collective == "allreduce" and not inner.linear:
        raise ValueError(
            f"{where}.collective=allreduce but {name} payloads are not linear (per-worker "
            f"indices or scales cannot be summed); set {where}.collective=auto (allgather)"
        )
    if isinstance(inner, PowerSGD) and collective == "allgather":
        raise ValueError(
            f"{where}.collective=allgather but PowerSGD runs two allreduce rounds; "
            f"set {where}.collective=auto"
        )
    if isinstance(ef, ErrorFeedback):
        if isinstance(inner, MajorityVote) and ef.mode != "none":
            raise ValueError(
                f"error_feedback.mode={ef.mode} with majority vote: unscaled signs would make the "
                "memory accumulate p - sign(p); use error_feedback=none (Signum: "
                "error_feedback.momentum=0.9) or compressor=sign for EF-signSGD"
            )
        if ef.momentum > 0 and optimizer_momentum > 0:
            raise ValueError(
                f"error_feedback.momentum={ef.momentum} applies momentum before compression "
                f"(DGC); set optimizer.momentum=0 (it is {optimizer_momentum})"
            )


def _cause(exc: Exception) -> str:
    """The innermost message (Hydra wraps constructor errors in InstantiationException)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__  # type: ignore[assignment]
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
