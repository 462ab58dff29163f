"""Checks that run before any worker starts; each failure is one line naming the fix."""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

BACKENDS = ("simulated", "gloo", "nccl")
LR_SCALINGS = ("none", "linear")

# Arguments the trainer supplies at instantiation, per plug-in group.
RUNTIME_ARGS = {
    "data": {"device"},
    "model": {"num_classes", "input_shape"},
    "optimizer": {"params"},
    "schedule": {"steps_per_epoch", "total_steps"},
    "algorithm": {"replicas", "comm", "optimizers"},
    "compressor": {"seed", "worker"},
    "error_feedback": {"inner"},
    "topology": {"num_workers"},
}
OWN_KEYS = {"optimizer": {"exclude_bn_bias_from_weight_decay"}}


class ConfigError(ValueError):
    """A configuration that cannot run; the message is the one line shown to the user."""


def check_target(group: str, node: Any) -> None:
    """The node's `_target_` exists and accepts its keys plus the trainer's runtime arguments."""
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError(f"{group}: no _target_ set; pick one with {group}=<option>")
    target = node._target_
    try:
        obj = get_object(target)
    except Exception as exc:  # noqa: BLE001 - any import failure is the same user error
        raise ConfigError(f"{group}._target_={target} cannot be imported ({exc})") from None
    keys = [k for k in node if not str(k).startswith("_") and k not in OWN_KEYS.get(group, ())]
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in keys if k not in params]
    if unknown:
        allowed = sorted(set(params) - RUNTIME_ARGS.get(group, set()) - {"self"})
        raise ConfigError(
            f"{group}.{unknown[0]} is not an option of {target}; valid options: "
            + ", ".join(allowed)
        )


def process_count(cfg: DictConfig) -> int:
    """Processes a gloo/nccl run of `cfg` starts: `workers`, unless the algorithm's class says
    otherwise through a `num_processes(workers)` classmethod (e.g. a parameter server)."""
    try:
        count = getattr(get_object(cfg.algorithm._target_), "num_processes", None)
    except Exception:  # noqa: BLE001 - a bad target is reported by check_target
        count = None
    return int(count(cfg.workers)) if count is not None else int(cfg.workers)


def validate(cfg: DictConfig) -> None:
    """Raise `ConfigError` for any configuration that would fail once workers are running."""
    if cfg.workers < 1:
        raise ConfigError(f"workers={cfg.workers}: need at least 1 worker; set workers=1 or more")
    backend = cfg.backend.name
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend} is unknown; choose one of: {', '.join(BACKENDS)}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError(
                "backend=nccl needs CUDA GPUs but none is visible; "
                "use backend=gloo (CPU processes) or backend=simulated"
            )
        local = int(os.environ.get("LOCAL_WORLD_SIZE", process_count(cfg)))
        if torch.cuda.device_count() < local:
            raise ConfigError(
                f"backend=nccl puts one worker per GPU: {local} workers here but only "
                f"{torch.cuda.device_count()} GPUs; lower workers or use backend=simulated"
            )
    if cfg.train.device not in ("auto", "cpu") and not cfg.train.device.startswith("cuda"):
        raise ConfigError(f"train.device={cfg.train.device}: use auto, cpu or cuda[:N]")
    if cfg.train.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"train.device={cfg.train.device} but no GPU is visible; use train.device=cpu"
        )
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        world, expected = int(os.environ["WORLD_SIZE"]), process_count(cfg)
        if world != expected:
            fix = cfg.workers + world - expected
            raise ConfigError(
                f"torchrun started {world} processes but workers={cfg.workers} needs "
                f"{expected}; pass workers={fix}"
            )
        if backend == "simulated":
            raise ConfigError(
                "started by torchrun but backend=simulated; pass backend=gloo or nccl"
            )
    if cfg.train.batch_size < 1:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size}: must be at least 1")
    if cfg.train.steps is not None and cfg.train.steps < 1:
        raise ConfigError(
            f"train.steps={cfg.train.steps}: must be at least 1 (or null to use epochs)"
        )
    if cfg.train.steps is None and cfg.train.epochs <= 0:
        raise ConfigError(f"train.epochs={cfg.train.epochs}: must be positive")
    if cfg.train.log_every < 1:
        raise ConfigError(f"train.log_every={cfg.train.log_every}: must be at least 1")
    if cfg.train.autocast not in (None, "bf16", "fp16"):
        raise ConfigError(f"train.autocast={cfg.train.autocast}; choose one of: null, bf16, fp16")
    if (
        cfg.train.autocast == "fp16"
        and backend != "nccl"
        and not (cfg.train.device.startswith("cuda") or torch.cuda.is_available())
    ):
        raise ConfigError("train.autocast=fp16 needs a GPU; use train.autocast=bf16 on CPUs")
    if cfg.train.lr_scaling not in LR_SCALINGS:
        raise ConfigError(
            f"train.lr_scaling={cfg.train.lr_scaling}; choose one of: {', '.join(LR_SCALINGS)}"
        )
    if cfg.comm.reduction not in ("ring", "centralized"):
        raise ConfigError(f"comm.reduction={cfg.comm.reduction}; choose one of: ring, centralized")
    if cfg.comm.p2p_schedule not in ("auto", "by_distance", "one_batch"):
        raise ConfigError(
            f"comm.p2p_schedule={cfg.comm.p2p_schedule}; choose one of: auto, by_distance, "
            "one_batch"
        )
    if cfg.network.bandwidth_gbit <= 0 or cfg.network.latency_us < 0:
        raise ConfigError("network.bandwidth_gbit must be > 0 and network.latency_us >= 0")
    if cfg.logger.mode is not None and cfg.logger.mode not in ("online", "offline", "disabled"):
        raise ConfigError(
            f"logger.mode={cfg.logger.mode}; choose one of: online, offline, disabled"
        )
    for group in RUNTIME_ARGS:
        check_target(group, cfg[group])
    check_compression(cfg)
    check_algorithm(cfg)
    OmegaConf.resolve(OmegaConf.create(OmegaConf.to_container(cfg)))


def check_algorithm(cfg: DictConfig) -> None:
    """The algorithm's own checks: a `check_config(cfg)` classmethod on its target, if any,
    raising ValueError (e.g. a topology that cannot exist for `workers`)."""
    check = getattr(get_object(cfg.algorithm._target_), "check_config", None)
    if check is None:
        return
    try:
        check(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc).strip().splitlines()[0]) from None
    except Exception as exc:  # noqa: BLE001 - Hydra wraps constructor errors
        cause = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, ValueError):
            raise ConfigError(str(cause).strip().splitlines()[0]) from None
        raise


def _is_default(node: Any, target: str, **defaults: Any) -> bool:
    return node is None or (
        node.get("_target_") == target and all(node.get(k, v) == v for k, v in defaults.items())
    )


def check_compression(cfg: DictConfig) -> None:
    """Compressor and error feedback pair with each other and with the algorithm."""
    from dpresearch.compress.build import check_compatibility

    alg = cfg.algorithm
    if "compressor" not in alg:
        idle = _is_default(cfg.compressor, "dpresearch.compress.casts.Identity") and _is_default(
            cfg.error_feedback,
            "dpresearch.compress.error_feedback.ErrorFeedback",
            mode="none",
            momentum=0.0,
        )
        if not idle:
            raise ConfigError(
                f"{alg._target_.rsplit('.', 1)[-1]} does not use compressor/error_feedback; "
                "use algorithm=sync (compressed gradients) or algorithm=choco (compressed "
                "gossip), or leave compressor=identity error_feedback=none"
            )
        return
    try:
        check_compatibility(
            alg.compressor,
            alg.error_feedback,
            granularity=alg.get("granularity", "auto"),
            bucket_mb=alg.get("bucket_mb", 25.0),
            collective=alg.get("collective", "auto"),
            optimizer_momentum=float(cfg.optimizer.get("momentum", 0.0) or 0.0),
            where="algorithm",
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def prepare_data(cfg: DictConfig):
    """Load (and, with `data.download=true`, fetch) the data set once, before any worker starts,
    so a missing or corrupt data set is one line here rather than K tracebacks later. Returns
    the data set on the CPU."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(cfg.data, device="cpu")
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, (OSError, ValueError, ConnectionError, ImportError)):
            raise ConfigError(str(cause).strip().splitlines()[0]) from None
        raise
