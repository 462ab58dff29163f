"""The checks of each typed config node (`schema.py`), one function per node, and the table
`NODE_CHECKS` that `validate.validate` runs in order; then the plug-in nodes' checks,
`PLUGIN_CHECKS`: the data, optimizer and schedule nodes' values here (`check_data`,
`check_optimizer`, `check_schedule`: what every data set, torch optimizer or schedule would
reject mid-start), compression through `compress.build.check_compatibility`, the algorithm
through its own `Algorithm.check_config` (with `Algorithm.traits` for what the run-control
layers need to know) and the `async` node through `asynchrony.options.check_options`.

Every check raises `ConfigError` (a typed node's) or ValueError (a plug-in's; the first line
becomes the `ConfigError`), one line naming the fix.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

from dpresearch.data.base import Dataset
from dpresearch.errors import ConfigError
from dpresearch.launch.environment import check_distributed_environment
from dpresearch.run.build import algorithm_class, process_count
from dpresearch.run.evaluation import BN_STATS

BACKENDS = ("simulated", "gloo", "nccl")
START_METHODS = ("forkserver", "spawn")  # backend.start_method (dpresearch.launch.forkserver)
PARTITIONS = ("iid", "dirichlet", "shared")
# Optimizer hyper-parameters that torch requires to be non-negative numbers.
NON_NEGATIVE_OPTIMIZER_KEYS = ("lr", "momentum", "weight_decay", "dampening", "eps")
LR_SCALINGS = ("none", "linear")
AUTOCASTS = (None, "bf16", "fp16")
NONFINITE_MODES = ("stop", "skip_step", "continue")
_MISSING = object()
REDUCTIONS = ("ring", "centralized")
P2P_SCHEDULES = ("auto", "by_distance", "one_batch")
WANDB_MODES = ("online", "offline", "disabled")
HIERARCHICAL_ALGORITHMS = (
    "dpresearch.algorithms.sync.SyncSGD",
    "dpresearch.algorithms.node_sync.NodeSyncSGD",
)
DEFAULT_PROTOCOL = "dpresearch.asynchrony.protocol.ASGD"


def _as_config_error(check: Callable[[], object]) -> None:
    """Run `check`; a ValueError it raises (or one Hydra wraps, a constructor's) becomes a
    `ConfigError` with its first line."""
    try:
        check()
    except Exception as exc:
        cause = exc
        while not isinstance(cause, ValueError) and cause.__cause__ is not None:
            cause = cause.__cause__
        if not isinstance(cause, ValueError):
            raise
        raise ConfigError(str(cause).strip().splitlines()[0]) from None


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
    if tc.get("eval_bn_stats", "consensus") not in BN_STATS:
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
    intra = cfg.comm.hierarchy.get("intra_algorithm", "tree")
    if intra not in ROOTED_ALGORITHMS:
        raise ConfigError(
            f"comm.hierarchy.intra_algorithm={intra}; choose one of: {', '.join(ROOTED_ALGORITHMS)}"
        )
    if per_node is None:
        if intra != "tree":
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
    if cfg.algorithm._target_ not in HIERARCHICAL_ALGORITHMS:
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
    if net.get("compute_step_s", 0.0) < 0:
        raise ConfigError(f"network.compute_step_s={net.compute_step_s}: must be >= 0 seconds")


def check_logger(cfg: DictConfig) -> None:
    lc = cfg.logger
    if lc.mode is not None and lc.mode not in WANDB_MODES:
        raise ConfigError(f"logger.mode={lc.mode}; choose one of: {', '.join(WANDB_MODES)}")
    if lc.init_timeout_s <= 0:
        raise ConfigError(f"logger.init_timeout_s={lc.init_timeout_s}: must be > 0")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _show(value: Any) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    return json.dumps(value).replace(" ", "") if isinstance(value, list) else str(value)


def partitions_of(node: DictConfig) -> tuple[str, ...]:
    """The partitions the data set of `node` declares (`Dataset.PARTITIONS`): its `_target_`'s
    class where the target is a class or one of its class methods, the default set otherwise."""
    try:
        target = get_object(node._target_)
    except Exception:
        return PARTITIONS
    owner = target.__self__ if inspect.ismethod(target) else target
    if isinstance(owner, type) and issubclass(owner, Dataset):
        return owner.PARTITIONS
    return PARTITIONS


def check_data(cfg: DictConfig) -> None:
    """The partition options every `Dataset` takes, and the download deadline."""
    node = cfg.data
    partition = node.get("partition", "iid")
    partitions = partitions_of(node)
    if partition not in partitions:
        raise ConfigError(f"data.partition={partition}; choose one of: {', '.join(partitions)}")
    alpha = node.get("alpha", 1.0)
    if not _is_number(alpha) or alpha <= 0:
        raise ConfigError(
            f"data.alpha={_show(alpha)}: the Dirichlet concentration must be a number > 0 "
            "(0.1: few classes per worker; 100: nearly iid)"
        )
    deadline = node.get("download_timeout_s", 1.0)
    if not _is_number(deadline) or deadline <= 0:
        raise ConfigError(f"data.download_timeout_s={_show(deadline)}: must be > 0 seconds")


def check_optimizer(cfg: DictConfig) -> None:
    """The hyper-parameters torch would reject mid-start, named by their key."""
    check_optimizer_values(cfg.optimizer, "optimizer")


def check_optimizer_values(node: DictConfig, where: str) -> None:
    """An optimizer node's values torch would reject mid-start, named `where.<key>`."""
    for key in NON_NEGATIVE_OPTIMIZER_KEYS:
        if key in node and (not _is_number(node[key]) or node[key] < 0):
            raise ConfigError(f"{where}.{key}={_show(node[key])}: must be a number >= 0")
    # (issue 43) accepted silently before: a momentum of 1 or more never forgets a gradient,
    # and `if "maybe"` reads as true
    momentum = node.get("momentum")
    if _is_number(momentum) and momentum >= 1:
        raise ConfigError(
            f"{where}.momentum={_show(momentum)}: must be in [0, 1) (at 1 or more every past "
            "gradient keeps its full weight and the steps grow without bound; 0.9 is usual)"
        )
    own = node.get("exclude_bn_bias_from_weight_decay", False)
    if not isinstance(own, bool):
        raise ConfigError(
            f"{where}.exclude_bn_bias_from_weight_decay={_show(own)}: must be true or false"
        )
    if "betas" in node:
        betas = node.betas
        values = list(betas) if isinstance(betas, ListConfig) else None
        if (
            values is None
            or len(values) != 2
            or not all(_is_number(b) and 0 <= b < 1 for b in values)
        ):
            raise ConfigError(
                f"{where}.betas={_show(betas)}: must be two numbers in [0, 1), e.g. [0.9,0.999]"
            )


def check_schedule(cfg: DictConfig) -> None:
    """Milestones and warm-up, whose errors would otherwise surface at the first step."""
    node = cfg.schedule
    if "milestones" in node:
        milestones = node.milestones
        if not isinstance(milestones, ListConfig) or not all(_is_number(m) for m in milestones):
            raise ConfigError(
                f"schedule.milestones={_show(milestones)}: must be a list of epochs, e.g. [150,250]"
            )
    for key in ("warmup_epochs", "warmup_from", "gamma"):
        if key in node and (not _is_number(node[key]) or node[key] < 0):
            raise ConfigError(f"schedule.{key}={_show(node[key])}: must be a number >= 0")


def _owned_optimizer(cfg: DictConfig) -> type | None:
    """The optimizer class when an algorithm owns its step (`OwnedOptimizer`), else None."""
    from dpresearch.algorithms.compressed_adam import OwnedOptimizer

    try:
        optimizer = get_object(cfg.optimizer._target_)
    except Exception:
        return None
    owned = isinstance(optimizer, type) and issubclass(optimizer, OwnedOptimizer)
    return optimizer if owned else None


def _selected_by(cfg: DictConfig) -> str:
    """How the user named the algorithm: the optimizer option for an algorithm an optimizer
    selects (optimizer=onebit_adam), else algorithm=<class>."""
    optimizer = _owned_optimizer(cfg)
    if optimizer is not None:
        return optimizer.option
    return f"algorithm={cfg.algorithm._target_.rsplit('.', 1)[-1]}"


def check_optimizer_owner(cfg: DictConfig) -> None:
    """An optimizer stepped by its own algorithm (`OwnedOptimizer`: optimizer=onebit_adam) runs
    with that algorithm only."""
    optimizer = _owned_optimizer(cfg)
    if optimizer is not None and cfg.algorithm._target_ != optimizer.algorithm:
        name = cfg.algorithm._target_.rsplit(".", 1)[-1]
        raise ConfigError(
            f"{optimizer.option} runs its own algorithm ({optimizer.algorithm.rsplit('.', 1)[-1]}"
            f", which exchanges the momentum); drop algorithm= (it is {name})"
        )


def check_algorithm(cfg: DictConfig) -> None:
    """The algorithm class's own checks (`Algorithm.check_config`), raising ValueError (e.g. a
    topology that cannot exist for `workers`); the first line becomes the `ConfigError`."""
    cls = algorithm_class(cfg)
    if cls is not None:
        _as_config_error(lambda: cls.check_config(cfg))


def _is_default(node: Any, target: str, **defaults: Any) -> bool:
    return node is None or (
        node.get("_target_") == target and all(node.get(k, v) == v for k, v in defaults.items())
    )


def check_compression(cfg: DictConfig) -> None:
    """Compressor and error feedback pair with each other and with what the algorithm's
    messages need, as its class declares (`Algorithm.channel`: sync aggregation, gossip or
    pushes; None: no compressor)."""
    from dpresearch.compress.build import check_algorithm_node

    alg = cfg.algorithm
    cls = algorithm_class(cfg)
    if cls is None:
        return  # (the target check names it)
    name = alg._target_.rsplit(".", 1)[-1]
    no_memory = _is_default(
        cfg.error_feedback,
        "dpresearch.compress.error_feedback.ErrorFeedback",
        mode="none",
        momentum=0.0,
    )
    if cls.channel is None or "compressor" not in alg:
        if no_memory and _is_default(cfg.compressor, "dpresearch.compress.casts.Identity"):
            return
        note = cls.traits.compression_note
        if note:
            raise ConfigError(
                f"{_selected_by(cfg)} {note}; drop compressor=/error_feedback= (leave "
                "compressor=identity error_feedback=none)"
            )
        if cls.channel is not None:
            raise ConfigError(
                f"{name} declares compressed messages (channel) but its algorithm node passes "
                "no compressor; add `compressor: ${compressor}` to its YAML, or leave "
                "compressor=identity error_feedback=none"
            )
        raise ConfigError(
            f"{name} does not use compressor/error_feedback; use algorithm=sync (compressed "
            "gradients) or algorithm=choco (compressed gossip), or leave compressor=identity "
            "error_feedback=none"
        )
    try:
        check_algorithm_node(
            alg,
            cls.channel,
            float(cfg.optimizer.get("momentum", 0.0) or 0.0),
            error_feedback=cfg.error_feedback,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if "error_feedback" not in alg and not no_memory:
        raise ConfigError(
            f"{name} takes no error_feedback (its messages keep their own copies); leave "
            "error_feedback=none"
        )


def check_outer(cfg: DictConfig) -> None:
    """An outer optimizer (`outer=...`): its optimizer node's values, then the outer node's
    own checks (`algorithms.outer.check_config`: the base algorithm, the schedule, the codec);
    nothing for `outer=none`. The nested nodes are built once by preflight."""
    from dpresearch.algorithms import outer

    node = outer.outer_node(cfg)
    if node is None:
        return
    if node.get("optimizer") is not None:
        check_optimizer_values(node.optimizer, "outer.optimizer")
    try:
        outer.check_config(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc).strip().splitlines()[0]) from None


def check_protocol(cfg: DictConfig) -> None:
    """The `protocol` node builds for `workers` workers, and only an algorithm that takes one
    is given one other than the default."""
    from hydra.utils import instantiate

    node = cfg.get("protocol")
    if node is None:
        return
    if "protocol" not in cfg.algorithm:
        if node.get("_target_") != DEFAULT_PROTOCOL:
            raise ConfigError(
                f"{cfg.algorithm._target_.rsplit('.', 1)[-1]} does not use a protocol; use "
                "algorithm=async_sgd, or leave protocol=asgd"
            )
        return
    _as_config_error(lambda: instantiate(node, workers=cfg.workers))


# Nodes an algorithm takes by reference (`options: ${async}`, `topology: ${topology}`): set
# for an algorithm that does not reference them, they would be ignored without a word.
# (compressor/error_feedback: `check_compression`.)
REFERENCED_NODES = ("async", "topology")


def check_unused_nodes(cfg: DictConfig, overrides: Sequence[str] = ()) -> None:
    """A `REFERENCED_NODES` node that the algorithm's node does not reference is left as it
    is: its schema defaults (`async`) and no override of it on the command line."""
    from dpresearch.asynchrony.options import SPEED_KEYS, AsyncOptions, check_options

    used = json.dumps(OmegaConf.to_container(cfg.algorithm, resolve=False))
    name = cfg.algorithm._target_.rsplit(".", 1)[-1]
    given = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    for node in REFERENCED_NODES:
        if node not in cfg or "${" + node + "}" in used:
            continue
        changed = [k for k in given if k == node or k.startswith(node + ".")]
        if node == "async":
            defaults = OmegaConf.to_container(OmegaConf.structured(AsyncOptions))
            now = OmegaConf.to_container(cfg[node], resolve=True)
            changed += [f"async.{k}" for k, v in now.items() if v != defaults.get(k, v)]
            # the speed model is every family's (`time/modeled_s`, `run/modeled_clock.py`)
            changed = [k for k in changed if k.removeprefix("async.") not in SPEED_KEYS]
            opts = AsyncOptions.from_node(now)
            _as_config_error(lambda opts=opts: check_options(opts, cfg.workers))
        if changed:
            raise ConfigError(
                f"{changed[0]} is set but {name} does not use the {node} options (only an "
                f"algorithm whose node references ${{{node}}} does, e.g. "
                f"{'algorithm=async_sgd' if node == 'async' else 'algorithm=dpsgd'}); "
                f"leave {node} out, or pick that algorithm"
            )


# Every node's check, in the order `validate` runs them: the typed nodes, then (after the
# plug-in targets are known to import and take their keys) the plug-in nodes.
NODE_CHECKS: dict[str, Callable[[DictConfig], None]] = {
    "workers": check_workers,
    "backend": check_backend,
    "train.device": check_device,
    "train": check_train,
    "comm": check_comm,
    "network": check_network,
    "logger": check_logger,
    "train.run_control": check_run_control,
}
PLUGIN_CHECKS: dict[str, Callable[[DictConfig], None]] = {
    "data": check_data,
    "optimizer": check_optimizer,
    "optimizer.owner": check_optimizer_owner,
    "schedule": check_schedule,
    "compressor": check_compression,
    "protocol": check_protocol,
    "algorithm": check_algorithm,
    "outer": check_outer,
}
