"""Checks that run before any worker starts; each failure is one line naming the fix."""

from __future__ import annotations

import difflib
import inspect
import json
import os
from collections.abc import Sequence
from typing import Any

import torch
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

BACKENDS = ("simulated", "gloo", "nccl")
LR_SCALINGS = ("none", "linear")
PARTITIONS = ("iid", "dirichlet")
# Optimizer hyper-parameters that torch requires to be non-negative numbers.
NON_NEGATIVE_OPTIMIZER_KEYS = ("lr", "momentum", "weight_decay", "dampening", "eps")

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
    "outer": {"base", "replicas", "comm", "optimizers"},
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
        raise ConfigError(not_an_option_message(f"{group}.{unknown[0]}", target, params))


def process_count(cfg: DictConfig) -> int:
    """Processes a gloo/nccl run of `cfg` starts: `workers`, unless the algorithm's class says
    otherwise through a `num_processes(workers)` classmethod (e.g. a parameter server)."""
    try:
        count = getattr(get_object(cfg.algorithm._target_), "num_processes", None)
    except Exception:  # noqa: BLE001 - a bad target is reported by check_target
        count = None
    return int(count(cfg.workers)) if count is not None else int(cfg.workers)


def not_an_option_message(key: str, target: str, params: Any) -> str:
    """One line for a plug-in key its `_target_` does not take (`params`: its parameters)."""
    group, _, leaf = key.partition(".")
    allowed = sorted(set(params) - RUNTIME_ARGS.get(group, set()) - {"self", "kw", "kwargs"})
    close = difflib.get_close_matches(leaf, allowed, n=1, cutoff=0.6)
    hint = f"did you mean {group}.{close[0]}? " if close else ""
    return f"{key} is not an option of {target}; {hint}valid options: {', '.join(allowed)}"


def validate(cfg: DictConfig, overrides: Sequence[str] = ()) -> None:
    """Raise `ConfigError` for any configuration that would fail once workers are running, or
    that would run silently other than asked. `overrides` are the command line's (Hydra's
    `key=value` strings); they tell which keys the user set (see `check_run_length`). Needs no
    data and builds nothing; `preflight.preflight` adds the checks that do."""
    check_schema_keys(cfg)
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
    check_run_length(cfg, overrides)
    if cfg.train.log_every < 1:
        raise ConfigError(f"train.log_every={cfg.train.log_every}: must be at least 1")
    if cfg.train.eval_every is not None and cfg.train.eval_every < 1:
        raise ConfigError(
            f"train.eval_every={cfg.train.eval_every}: must be at least 1 "
            "(or null: evaluate at every epoch end)"
        )
    if cfg.train.eval_batch_size < 1:
        raise ConfigError(f"train.eval_batch_size={cfg.train.eval_batch_size}: must be at least 1")
    if cfg.backend.threads is not None and cfg.backend.threads < 1:
        raise ConfigError(
            f"backend.threads={cfg.backend.threads}: must be at least 1 "
            "(or null: the cores divided among this machine's processes)"
        )
    if cfg.backend.timeout_s <= 0:
        raise ConfigError(
            f"backend.timeout_s={cfg.backend.timeout_s}: must be > 0 seconds "
            "(how long a collective waits for a peer)"
        )
    if cfg.backend.heartbeat_s is not None and cfg.backend.heartbeat_s <= 0:
        raise ConfigError(
            f"backend.heartbeat_s={cfg.backend.heartbeat_s}: must be > 0 seconds "
            "(or null: no watchdog)"
        )
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
    if cfg.network.message_overhead_us < 0 or cfg.network.allgather_factor <= 0:
        raise ConfigError(
            "network.message_overhead_us must be >= 0 and network.allgather_factor > 0"
        )
    ag_latency = cfg.network.get("allgather_latency_us")
    if ag_latency is not None and ag_latency < 0:
        raise ConfigError(
            f"network.allgather_latency_us={ag_latency}: must be >= 0 (or null: latency_us)"
        )
    if cfg.network.get("compute_step_s", 0.0) < 0:
        raise ConfigError(
            f"network.compute_step_s={cfg.network.compute_step_s}: must be >= 0 seconds"
        )
    if cfg.logger.mode is not None and cfg.logger.mode not in ("online", "offline", "disabled"):
        raise ConfigError(
            f"logger.mode={cfg.logger.mode}; choose one of: online, offline, disabled"
        )
    if cfg.logger.init_timeout_s <= 0:
        raise ConfigError(f"logger.init_timeout_s={cfg.logger.init_timeout_s}: must be > 0")
    check_run_control(cfg)
    for group in RUNTIME_ARGS:
        if group != "outer" or cfg.get("outer"):  # outer=none: no node
            check_target(group, cfg[group])
    check_data_options(cfg.data)
    check_optimizer_values(cfg.optimizer)
    check_schedule_values(cfg.schedule)
    check_compression(cfg)
    check_algorithm(cfg)
    check_outer(cfg)
    OmegaConf.resolve(OmegaConf.create(OmegaConf.to_container(cfg)))


NONFINITE_MODES = ("stop", "skip_step", "continue")


def check_run_control(cfg: DictConfig) -> None:
    """`train.checkpoint_every`, `checkpoint_keep`, `resume` and `on_nonfinite`."""
    from dpresearch.run.checkpoint import CheckpointError, checkpoint_interval, find_resume

    tc = cfg.train
    if str(tc.checkpoint_every).strip().startswith("-"):
        raise ConfigError(
            f"train.checkpoint_every={tc.checkpoint_every}: must be >= 0 (steps, e.g. 500, "
            "or epochs, e.g. 1ep; 0 or null: off)"
        )
    try:
        interval = checkpoint_interval(tc.checkpoint_every, 1)
        find_resume(tc.resume if tc.resume != "auto" else None, None)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    if tc.checkpoint_keep < 1:
        raise ConfigError(f"train.checkpoint_keep={tc.checkpoint_keep}: must be at least 1")
    if tc.on_nonfinite not in NONFINITE_MODES:
        raise ConfigError(
            f"train.on_nonfinite={tc.on_nonfinite}; choose one of: {', '.join(NONFINITE_MODES)}"
        )
    try:
        algorithm = get_object(cfg.algorithm._target_)
    except Exception:  # noqa: BLE001 - a bad target is reported by check_target
        return
    if not getattr(algorithm, "checkpointable", True) and (interval or tc.resume is not None):
        raise ConfigError(
            f"{cfg.algorithm._target_} cannot checkpoint yet (its state has no state_dict); "
            "leave train.checkpoint_every and train.resume unset"
        )
    skippable = getattr(algorithm, "checkpointable", True) and getattr(algorithm, "skippable", True)
    if tc.on_nonfinite == "skip_step" and not skippable:
        raise ConfigError(
            f"train.on_nonfinite=skip_step is not supported by {cfg.algorithm._target_}; "
            "use stop or continue"
        )


def unknown_key_message(key: str, candidates: Sequence[str]) -> str:
    """One line for a key that the schema does not have, suggesting the closest ones."""
    parent, _, leaf = key.rpartition(".")
    close = difflib.get_close_matches(leaf, list(candidates), n=2, cutoff=0.6)
    guess = " or ".join(f"{parent + '.' if parent else ''}{c}" for c in close)
    hint = f"did you mean {guess}? " if guess else ""
    return f"{key} is not a config key; {hint}list the keys with --cfg job"


def _schema() -> DictConfig:
    """The registered structured schema (`base_config`), whatever nodes it holds."""
    from hydra.core.config_store import ConfigStore

    return ConfigStore.instance().load("base_config.yaml").node


def check_schema_keys(cfg: DictConfig) -> None:
    """Every key of a typed section (`train`, `backend`, ... and the top level) is in the schema:
    `+train.stepz=5` adds a key the framework would silently ignore."""

    def walk(node: DictConfig, schema: DictConfig, prefix: str) -> None:
        for key in node:
            if prefix == "" and key == "hydra":
                continue
            if key not in schema:
                raise ConfigError(unknown_key_message(f"{prefix}{key}", list(schema)))
            sub, sub_schema = node[key], schema[key]
            # an open node of the schema (`outer`) is a plug-in: its keys are its target's
            if (
                isinstance(sub, DictConfig)
                and isinstance(sub_schema, DictConfig)
                and OmegaConf.is_struct(sub_schema)
            ):
                walk(sub, sub_schema, f"{prefix}{key}.")

    walk(cfg, _schema(), "")


def _given(overrides: Sequence[str]) -> dict[str, Any]:
    """key → value of the plain `key=value` overrides (sweeps and unparsable ones left out)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given: dict[str, Any] = {}
    parser = OverridesParser.create()
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except Exception:  # noqa: BLE001 - composition has already judged the syntax
            continue
        if not override.is_sweep_override() and not override.is_delete():
            given[override.key_or_group] = override.value()
    return given


def check_run_length(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """`train.steps` wins over `train.epochs`, so setting `train.epochs` on the command line
    while steps is set (on the same line, or by the config) would be ignored: reject it."""
    given = _given(overrides)
    epochs = given.get("train.epochs")
    if epochs is None or cfg.train.steps is None:
        return
    if given.get("train.steps") is not None:
        raise ConfigError(
            f"train.steps={cfg.train.steps} and train.epochs={epochs} are both given; pass one: "
            "train.steps=N runs N steps, train.epochs=E runs E epochs"
        )
    raise ConfigError(
        f"train.epochs={epochs} would be ignored: train.steps={cfg.train.steps} is set by the "
        "config; add train.steps=null to train by epochs"
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _show(value: Any) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    return json.dumps(value).replace(" ", "") if isinstance(value, list) else str(value)


def check_data_options(node: Any) -> None:
    """The partition options every `Dataset` takes, and the download deadline."""
    partition = node.get("partition", "iid")
    if partition not in PARTITIONS:
        raise ConfigError(f"data.partition={partition}; choose one of: {', '.join(PARTITIONS)}")
    alpha = node.get("alpha", 1.0)
    if not _is_number(alpha) or alpha <= 0:
        raise ConfigError(
            f"data.alpha={_show(alpha)}: the Dirichlet concentration must be a number > 0 "
            "(0.1: few classes per worker; 100: nearly iid)"
        )
    deadline = node.get("download_timeout_s", 1.0)
    if not _is_number(deadline) or deadline <= 0:
        raise ConfigError(f"data.download_timeout_s={_show(deadline)}: must be > 0 seconds")


def check_optimizer_values(node: Any) -> None:
    """The hyper-parameters torch would reject mid-start, named by their key."""
    for key in NON_NEGATIVE_OPTIMIZER_KEYS:
        if key in node and (not _is_number(node[key]) or node[key] < 0):
            raise ConfigError(f"optimizer.{key}={_show(node[key])}: must be a number >= 0")
    if "betas" in node:
        betas = node.betas
        values = list(betas) if isinstance(betas, ListConfig) else None
        if (
            values is None
            or len(values) != 2
            or not all(_is_number(b) and 0 <= b < 1 for b in values)
        ):
            raise ConfigError(
                f"optimizer.betas={_show(betas)}: must be two numbers in [0, 1), e.g. [0.9,0.999]"
            )


def check_schedule_values(node: Any) -> None:
    """Milestones and warm-up, whose errors would otherwise surface at the first step."""
    if "milestones" in node:
        milestones = node.milestones
        if not isinstance(milestones, ListConfig) or not all(_is_number(m) for m in milestones):
            raise ConfigError(
                f"schedule.milestones={_show(milestones)}: must be a list of epochs, e.g. [150,250]"
            )
    for key in ("warmup_epochs", "warmup_from", "gamma"):
        if key in node and (not _is_number(node[key]) or node[key] < 0):
            raise ConfigError(f"schedule.{key}={_show(node[key])}: must be a number >= 0")


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


def check_outer(cfg: DictConfig) -> None:
    """An outer optimizer (`outer=...`) over the algorithm: its optimizer node's values and the
    outer node's own checks (`algorithms.outer.check_config`)."""
    from dpresearch.algorithms import outer

    node = outer.outer_node(cfg)
    if node is None:
        return
    if "optimizer" in node:
        check_target("optimizer", node.optimizer)
        try:
            check_optimizer_values(node.optimizer)
        except ConfigError as exc:
            raise ConfigError(f"outer.{exc}") from None
    try:
        outer.check_config(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc).strip().splitlines()[0]) from None


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


# The data set `prepare_data` loaded last, keyed by its resolved node: checking a run and then
# running it in this process (simulated runs, sequential sweeps) reads the files once.
_LOADED: dict[str, Any] = {}


def prepare_data(cfg: DictConfig):
    """Load (and, with `data.download=true`, fetch) the data set once, before any worker starts,
    so a missing or corrupt data set is one line here rather than K tracebacks later. Returns
    the data set on the CPU; the same node again returns the same object (call
    `forget_data()` to drop it)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    key = json.dumps(OmegaConf.to_container(cfg.data, resolve=True), sort_keys=True)
    if key in _LOADED:
        return _LOADED[key]
    try:
        dataset = instantiate(cfg.data, device="cpu")
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, (OSError, ValueError, ConnectionError, ImportError)):
            raise ConfigError(str(cause).strip().splitlines()[0]) from None
        raise
    _LOADED.clear()
    _LOADED[key] = dataset
    return dataset


def forget_data() -> None:
    """Drop the data set `prepare_data` keeps (e.g. before worker processes load their own)."""
    _LOADED.clear()
