"""The typed run nodes' checks (`schema.py`): workers, backend, device, train, run control,
communication, network model and logger."""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from dpresearch.config.schema import HierarchyConfig, NetworkConfig, TrainConfig
from dpresearch.errors import ConfigError
from dpresearch.launch.environment import check_distributed_environment
from dpresearch.run.build import algorithm_class, process_count
from dpresearch.run.evaluation import BN_STATS

BACKENDS = ("simulated", "gloo", "nccl")
START_METHODS = ("forkserver", "spawn")  # backend.start_method (dpresearch.launch.forkserver)
LR_SCALINGS = ("none", "linear")
AUTOCASTS = (None, "bf16", "fp16")
NONFINITE_MODES = ("stop", "skip_step", "continue")
_MISSING = object()
REDUCTIONS = ("ring", "centralized")
P2P_SCHEDULES = ("auto", "by_distance", "one_batch")
WANDB_MODES = ("online", "offline", "disabled")


def check_workers(cfg: DictConfig) -> None:
    if cfg.workers < 1:
        raise ConfigError(f"workers={cfg.workers}: need at least 1 worker; set workers=1 or more")


def check_backend(cfg: DictConfig) -> None:
    """The backend exists, its devices are there, a torchrun world fits, thread and time
    limits are positive."""
    import torch

    backend, bc = cfg.backend.name, cfg.backend
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
    check_distributed_environment(backend)
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
    if bc.threads is not None and bc.threads < 1:
        raise ConfigError(
            f"backend.threads={bc.threads}: must be at least 1 "
            "(or null: the cores divided among this machine's processes)"
        )
    if bc.timeout_s <= 0:
        raise ConfigError(
            f"backend.timeout_s={bc.timeout_s}: must be > 0 seconds "
            "(how long a collective waits for a peer)"
        )
    if bc.heartbeat_s is not None and bc.heartbeat_s <= 0:
        raise ConfigError(
            f"backend.heartbeat_s={bc.heartbeat_s}: must be > 0 seconds (or null: no watchdog)"
        )
    if bc.start_method not in START_METHODS:
        raise ConfigError(
            f"backend.start_method={bc.start_method}; choose one of: {', '.join(START_METHODS)}"
        )


def check_device(cfg: DictConfig) -> None:
    """`train.device` and `train.autocast` for the devices there are."""
    import torch

    tc = cfg.train
    if tc.device not in ("auto", "cpu") and not tc.device.startswith("cuda"):
        raise ConfigError(f"train.device={tc.device}: use auto, cpu or cuda[:N]")
    if tc.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={tc.device} but no GPU is visible; use train.device=cpu")
    if tc.autocast not in AUTOCASTS:
        raise ConfigError(f"train.autocast={tc.autocast}; choose one of: null, bf16, fp16")
    if (
        tc.autocast == "fp16"
        and cfg.backend.name != "nccl"
        and not (tc.device.startswith("cuda") or torch.cuda.is_available())
    ):
        raise ConfigError("train.autocast=fp16 needs a GPU; use train.autocast=bf16 on CPUs")


def check_train(cfg: DictConfig) -> None:
    """Batch sizes, run length, logging and evaluation intervals, lr scaling, how several
    workers compute, gradient clipping."""
    tc = cfg.train
    if tc.batch_size < 1:
        raise ConfigError(f"train.batch_size={tc.batch_size}: must be at least 1")
    if tc.steps is not None and tc.steps < 1:
        raise ConfigError(f"train.steps={tc.steps}: must be at least 1 (or null to use epochs)")
    if tc.steps is None and tc.epochs <= 0:
        raise ConfigError(f"train.epochs={tc.epochs}: must be positive")
    if tc.log_every < 1:
        raise ConfigError(f"train.log_every={tc.log_every}: must be at least 1")
    if tc.eval_every is not None and tc.eval_every < 1:
        raise ConfigError(
            f"train.eval_every={tc.eval_every}: must be at least 1 "
            "(or null: evaluate at every epoch end)"
        )
    if tc.eval_batch_size < 1:
        raise ConfigError(f"train.eval_batch_size={tc.eval_batch_size}: must be at least 1")
    if tc.get("eval_bn_stats", TrainConfig.eval_bn_stats) not in BN_STATS:
        raise ConfigError(
            f"train.eval_bn_stats={tc.eval_bn_stats}; choose one of: {', '.join(BN_STATS)}"
        )
    if tc.lr_scaling not in LR_SCALINGS:
        raise ConfigError(
            f"train.lr_scaling={tc.lr_scaling}; choose one of: {', '.join(LR_SCALINGS)}"
        )
    from dpresearch.run.batched import MODES, batched_mode

    if batched_mode(tc.batched_workers) not in MODES:
        raise ConfigError(
            f"train.batched_workers={tc.batched_workers}; choose one of: {', '.join(MODES)}"
        )
    if not tc.loss_scale > 0:
        raise ConfigError(
            f"train.loss_scale={tc.loss_scale}: must be > 0 (fp16's static loss scale)"
        )
    from dpresearch.grad_clip import check_grad_clip

    problem = check_grad_clip(tc.get("grad_clip"))
    if problem is not None:
        raise ConfigError(problem)


def check_run_control(cfg: DictConfig) -> None:
    """`train.checkpoint_every`, `checkpoint_keep`, `resume` and `on_nonfinite`, and what the
    algorithm's traits allow of them."""
    from dpresearch.run.checkpoint_files import CheckpointError, checkpoint_interval, find_resume

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
    for key in tc.get("resume_allow_changes") or []:
        if OmegaConf.select(cfg, str(key), default=_MISSING) is _MISSING:
            raise ConfigError(
                f"train.resume_allow_changes: {key} is not a config key; name keys or nodes "
                "of this configuration, e.g. [train.steps, optimizer]"
            )
    if tc.on_nonfinite not in NONFINITE_MODES:
        raise ConfigError(
            f"train.on_nonfinite={tc.on_nonfinite}; choose one of: {', '.join(NONFINITE_MODES)}"
        )
    cls = algorithm_class(cfg)
    if cls is None:
        return
    traits = cls.traits
    if not traits.checkpointable and (interval or tc.resume is not None):
        raise ConfigError(
            f"{cfg.algorithm._target_} cannot checkpoint yet (its state has no state_dict); "
            "leave train.checkpoint_every and train.resume unset"
        )
    if tc.on_nonfinite == "skip_step" and not (traits.checkpointable and traits.skippable):
        raise ConfigError(
            f"train.on_nonfinite=skip_step is not supported by {cfg.algorithm._target_}; "
            "use stop or continue"
        )


def check_comm(cfg: DictConfig) -> None:
    if cfg.comm.reduction not in REDUCTIONS:
        raise ConfigError(
            f"comm.reduction={cfg.comm.reduction}; choose one of: {', '.join(REDUCTIONS)}"
        )
    if cfg.comm.p2p_schedule not in P2P_SCHEDULES:
        raise ConfigError(
            f"comm.p2p_schedule={cfg.comm.p2p_schedule}; choose one of: {', '.join(P2P_SCHEDULES)}"
        )
    check_hierarchy(cfg)


def check_hierarchy(cfg: DictConfig) -> None:
    """`comm.hierarchy` (a two-level cluster): nodes that divide the workers, and an algorithm
    that reduces in two levels; `intra_algorithm` one of ROOTED_ALGORITHMS, set only with
    nodes."""
    from dpresearch.comm.base import ROOTED_ALGORITHMS

    per_node = cfg.comm.hierarchy.workers_per_node
    intra = cfg.comm.hierarchy.get("intra_algorithm", HierarchyConfig.intra_algorithm)
    if intra not in ROOTED_ALGORITHMS:
        raise ConfigError(
            f"comm.hierarchy.intra_algorithm={intra}; choose one of: {', '.join(ROOTED_ALGORITHMS)}"
        )
    if per_node is None:
        if intra != HierarchyConfig.intra_algorithm:
            raise ConfigError(
                f"comm.hierarchy.intra_algorithm={intra} prices the intra-node step of a "
                "two-level cluster; set comm.hierarchy.workers_per_node too, or drop it"
            )
        return
    if per_node < 1:
        raise ConfigError(
            f"comm.hierarchy.workers_per_node={per_node}: must be at least 1 (or null: flat)"
        )
    if cfg.workers % per_node:
        divisors = [g for g in range(1, cfg.workers + 1) if cfg.workers % g == 0]
        raise ConfigError(
            f"comm.hierarchy.workers_per_node={per_node} does not divide workers={cfg.workers} "
            f"into whole nodes; choose one of: {', '.join(map(str, divisors))}"
        )
    cls = algorithm_class(cfg)
    if cls is not None and not cls.traits.two_level:
        raise ConfigError(
            "comm.hierarchy is a two-level cluster for algorithm=sync or node_sync; drop "
            f"comm.hierarchy.workers_per_node for {cfg.algorithm._target_.rsplit('.', 1)[-1]}"
        )


def check_network(cfg: DictConfig) -> None:
    from dpresearch.comm.network import PRESETS

    net = cfg.network
    for key in ("intra", "inter"):
        name = net.get(key)
        if name is not None and name not in PRESETS:
            raise ConfigError(
                f"network.{key}={name} is not a network preset; choose one of: {', '.join(PRESETS)}"
            )
    if net.bandwidth_gbit <= 0 or net.latency_us < 0:
        raise ConfigError("network.bandwidth_gbit must be > 0 and network.latency_us >= 0")
    if net.message_overhead_us < 0 or net.allgather_factor <= 0:
        raise ConfigError(
            "network.message_overhead_us must be >= 0 and network.allgather_factor > 0"
        )
    ag_latency = net.get("allgather_latency_us")
    if ag_latency is not None and ag_latency < 0:
        raise ConfigError(
            f"network.allgather_latency_us={ag_latency}: must be >= 0 (or null: latency_us)"
        )
    if net.get("compute_step_s", NetworkConfig.compute_step_s) < 0:
        raise ConfigError(f"network.compute_step_s={net.compute_step_s}: must be >= 0 seconds")


def check_logger(cfg: DictConfig) -> None:
    lc = cfg.logger
    if lc.mode is not None and lc.mode not in WANDB_MODES:
        raise ConfigError(f"logger.mode={lc.mode}; choose one of: {', '.join(WANDB_MODES)}")
    if lc.init_timeout_s <= 0:
        raise ConfigError(f"logger.init_timeout_s={lc.init_timeout_s}: must be > 0")
