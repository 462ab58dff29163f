"""The run, built once from its configuration: every part the loop drives, by name.

Everything a run is made of is built here from the configuration, and only here: the
communicator of this process (`build_communicator`: the network model, the two-level hierarchy,
all K workers simulated, or this rank of the process group the launcher joined), the device it
computes on (`run_device`), the data set loaded once (`prepare_data`), the algorithm's class and
the processes it needs (`algorithm_class`, `process_count`), and the rest in `build_run`.

`build_run` makes, for the workers this process holds, in this order (each from the config's
own factories, seeded as before so a run is reproducible): the data set (validation split held
out) and its partitioner, the replicas (worker 0's initial state — `train.init_from`'s weights
where given, `run.init_from` — broadcast to every process),
one optimizer per replica, the algorithm, the run length, the learning-rate schedule and the
workers' forward/backward (`WorkerCompute`). The result is a `Run`.

A `Run`'s stateful parts checkpoint themselves: `Run.state_dict()` is this process's part of
a checkpoint, one entry per part in `Run.STATEFUL` (replicas, optimizers, algorithm, compute,
the ledger, the global random streams and the gradient clipping's pre-clip norms), and
`load_state_dict` puts it back; the loop's own position (step, best accuracy, last metrics,
clock) is the loop's (`run.loop.LoopState`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from dpresearch.algorithms import outer
from dpresearch.algorithms.base import Algorithm
from dpresearch.comm.base import Communicator
from dpresearch.comm.distributed import DistributedCommunicator, default_device_for
from dpresearch.comm.hierarchy import Hierarchy
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.data.base import Dataset
from dpresearch.data.partition import Partitioner
from dpresearch.errors import ConfigError
from dpresearch.grad_clip import GradClip
from dpresearch.optim import make_optimizer
from dpresearch.replicas import Replicas
from dpresearch.run import init_from
from dpresearch.run.checkpoint_files import checkpoint_interval
from dpresearch.run.compute import WorkerCompute
from dpresearch.run.modeled_clock import ModeledClock
from dpresearch.run.time_scenarios import Repricing, scenarios_of


def algorithm_class(cfg: DictConfig) -> type[Algorithm] | None:
    """The class `algorithm._target_` names, or None where it cannot be imported (reported by
    the target check). Raises `ConfigError` for a target that is not an `Algorithm`."""
    try:
        cls = get_object(cfg.algorithm._target_)
    except Exception:
        return None
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ConfigError(
            f"algorithm._target_={cfg.algorithm._target_} is not an Algorithm subclass "
            "(dpresearch.algorithms.base.Algorithm); pick one with algorithm=<option>"
        )
    return cls


def process_count(cfg: DictConfig) -> int:
    """Processes a gloo/nccl run of `cfg` starts: one per worker, plus the algorithm's
    `traits.extra_processes` (e.g. a parameter server)."""
    cls = algorithm_class(cfg)
    return cls.traits.processes(cfg.workers) if cls is not None else int(cfg.workers)


def network_model(cfg: DictConfig) -> NetworkModel:
    """The α-β cost model of the `network` node (a key it leaves out: `from_units`' default)."""
    net = cfg.network
    optional = ("message_overhead_us", "allgather_factor", "allgather_latency_us", "compute_step_s")
    return NetworkModel.from_units(
        net.latency_us, net.bandwidth_gbit, **{key: net[key] for key in optional if key in net}
    )


def scenario_pricings(cfg: DictConfig) -> dict[str, Repricing]:
    """Each time scenario's (`train.time_scenarios`) pricing of the run's ops: its network and
    its cluster's tiers, as a run of that network would price them."""
    out = {}
    for name, scenario in scenarios_of(cfg).items():
        cluster = scenario.cluster(cfg)
        out[name] = Repricing.on(network_model(cluster), hierarchy_of(cluster))
    return out


def hierarchy_of(cfg: DictConfig) -> Hierarchy | None:
    """The two-level cluster `comm.hierarchy` describes (None: flat): nodes of
    `workers_per_node`, links priced on `network.intra` inside and `network.inter` (null: the
    run's network) between, the intra-node step priced as `intra_algorithm`."""
    hierarchy = cfg.comm.get("hierarchy", {})
    per_node = hierarchy.get("workers_per_node")
    if per_node is None:
        return None
    net = cfg.network
    inter = net.get("inter")
    return Hierarchy(
        int(per_node),
        NetworkModel.preset(net.get("intra") or "nvlink"),
        NetworkModel.preset(inter) if inter else network_model(cfg),
        hierarchy.get("intra_algorithm", Hierarchy.intra_algorithm),
    )


def run_device(cfg: DictConfig) -> torch.device:
    """The device this process computes on: `train.device` for a simulated run (auto: a GPU
    where there is one), a launched process's own GPU for NCCL, else the CPU."""
    if cfg.backend.name != "simulated":
        return default_device_for(cfg.backend.name, int(os.environ["LOCAL_RANK"]))
    name = cfg.train.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def build_communicator(cfg: DictConfig) -> Communicator:
    """This process's communicator: all K workers here (`backend=simulated`), or this rank of
    the process group the launcher initialised, with the processes the algorithm adds
    (`Traits.extra_processes`) first."""
    network, hierarchy, cc = network_model(cfg), hierarchy_of(cfg), cfg.comm
    if cfg.backend.name == "simulated":
        return SimulatedCommunicator(
            cfg.workers, network, cc.reduction, cc.deterministic, hierarchy=hierarchy
        )
    traits = algorithm_class(cfg).traits
    return DistributedCommunicator(
        network,
        cc.reduction,
        deterministic=cc.deterministic,
        p2p_schedule=cc.p2p_schedule,
        hierarchy=hierarchy,
        messages=traits.messages,
        first_worker=traits.extra_processes,
    )


# The data set `prepare_data` loaded last, keyed by its resolved node: checking a run and then
# running it in this process (simulated runs, sequential sweeps) reads the files once.
_LOADED: dict[str, Any] = {}


def prepare_data(cfg: DictConfig) -> Dataset:
    """Load (and, with `data.download=true`, fetch) the data set once, before any worker starts,
    so a missing or corrupt data set is one line here rather than K tracebacks later. Returns
    the data set on the CPU; the same node again returns the same object (call
    `forget_data()` to drop it)."""
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


class GlobalRandom:
    """The process's global random streams: torch (CPU, and CUDA where initialised), numpy
    (its key as an int64 tensor: a checkpoint holds no numpy array), Python."""

    def state_dict(self) -> dict[str, Any]:
        numpy_state = np.random.get_state(legacy=False)
        key = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
        numpy_state["state"] = dict(numpy_state["state"], key=key)
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": numpy_state,
            "python": random.getstate(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        numpy_state = dict(state["numpy"])
        key = numpy_state["state"]["key"].numpy().astype(np.uint32)
        numpy_state["state"] = dict(numpy_state["state"], key=key)
        np.random.set_state(numpy_state)
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class Optimizers(list):
    """One optimizer per local replica; checkpoints as the list of their state dicts."""

    def state_dict(self) -> list[dict]:
        return [opt.state_dict() for opt in self]

    def load_state_dict(self, state: list[dict]) -> None:
        for opt, saved in zip(self, state, strict=True):
            opt.load_state_dict(saved)


@dataclass
class Run:
    """Everything one process of a run drives, built once (`build_run`)."""

    cfg: DictConfig
    comm: Communicator
    device: torch.device
    data: Dataset
    partitioner: Partitioner
    replicas: Replicas
    eval_model: nn.Module  # the architecture evaluation loads the consensus model into
    optimizers: Optimizers
    base_lr: float
    algorithm: Algorithm
    schedule: Any  # step -> lr multiplier
    compute: WorkerCompute
    steps_per_epoch: int
    total_steps: int
    checkpoint_every: int  # steps (0: only on a stop request)
    gradients_per_step: int
    setup: dict[str, Any]  # the algorithm's and the compute's description of the set-up
    rng: GlobalRandom
    clip: GradClip  # `train.grad_clip` and the pre-clip norms since the last metrics row
    modeled: ModeledClock  # `time/modeled_s`: every worker's modeled compute and communication

    # The parts whose state is the run's state, each with state_dict / load_state_dict.
    STATEFUL: ClassVar[tuple[str, ...]] = (
        "replicas",
        "optimizers",
        "algorithm",
        "compute",
        "ledger",
        "rng",
        "clip",
        "modeled",
    )
    # parts a checkpoint made before them lacks
    ADDED: ClassVar[tuple[str, ...]] = ("clip", "modeled")

    @property
    def ledger(self):
        return self.comm.ledger

    @property
    def processes(self) -> int:
        """Processes of the run."""
        return self.comm.world_size // self.comm.num_local

    @property
    def lockstep(self) -> bool:
        """Whether every process takes every step together (see `Traits.lockstep`)."""
        return self.algorithm.traits.lockstep or self.processes == 1

    def state_dict(self) -> dict[str, Any]:
        """This process's part of a checkpoint: each stateful part's own (live tensors: read
        between steps)."""
        return {name: getattr(self, name).state_dict() for name in self.STATEFUL}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s parts, in `STATEFUL` order (replicas and optimizers before
        the algorithm, which may read them)."""
        for name in self.STATEFUL:
            part = state.get(name) if name in self.ADDED else state[name]
            getattr(self, name).load_state_dict(part)


def build_run(
    cfg: DictConfig,
    comm: Communicator,
    device: torch.device,
    dataset: Dataset | None = None,
    algorithm_extra: dict[str, Any] | None = None,
) -> Run:
    """Build the run of `cfg` for the workers `comm` says this process holds (`dataset`: the
    data set if already loaded, on any device). The algorithm is this process's part of the
    configured one (`Algorithm.part`). `algorithm_extra`: arguments added to the `algorithm`
    node's instantiation."""
    k, tc = cfg.workers, cfg.train
    torch.manual_seed(cfg.seed)
    data: Dataset = (
        dataset.to(device) if dataset is not None else instantiate(cfg.data, device=str(device))
    ).hold_out(tc.val_size)
    partitioner = data.make_partitioner(k, cfg.seed)
    worker_steps = partitioner.samples_per_worker // tc.batch_size  # one pass over a shard
    if worker_steps < 1:
        raise ValueError(
            f"train.batch_size={tc.batch_size} is larger than the "
            f"{partitioner.samples_per_worker} examples each of {k} workers holds; "
            "lower train.batch_size or workers"
        )
    torch.manual_seed(cfg.seed)
    model: nn.Module = instantiate(
        cfg.model, num_classes=data.num_classes, input_shape=data.input_shape
    )
    replicas = Replicas(model, comm.num_local, device, tc.channels_last)
    started = init_from.load_into(cfg, comm, replicas)  # train.init_from: the main process
    # Replicas built from one seed are identical, but broadcasting worker 0's state makes
    # that true even where initialisation draws differ between processes (or where worker 0
    # alone read the weights it starts from).
    comm.broadcast(replicas.params, src=0, record=False)
    comm.broadcast(replicas.buffers, src=0, record=False)
    if tc.get("init_from") and replicas.int_buffers.numel():
        comm.broadcast(replicas.int_buffers, src=0, record=False)
    lr_scale = float(k) if tc.lr_scaling == "linear" else 1.0
    optimizers = Optimizers(make_optimizer(cfg.optimizer, m, lr_scale) for m in replicas.models)
    extra = dict(algorithm_extra or {})
    part = get_object(cfg.algorithm._target_).part(comm)
    extra.setdefault("_target_", f"{part.__module__}.{part.__qualname__}")
    runtime = dict(replicas=replicas, comm=comm, optimizers=optimizers)
    # the `outer` node (an outer optimizer) wraps the algorithm the `algorithm` node builds
    algorithm: Algorithm = outer.wrap(
        cfg, instantiate(cfg.algorithm, **runtime, **extra), **runtime
    )
    # One epoch = every worker's shard once: K × worker_steps gradients in all.
    per_step = algorithm.gradients_per_step
    steps_per_epoch = max(1, round(worker_steps * k / per_step))
    total_steps = tc.steps or max(1, math.ceil(tc.epochs * steps_per_epoch))
    algorithm.set_run_length(steps_per_epoch, total_steps)
    schedule = instantiate(cfg.schedule, steps_per_epoch=steps_per_epoch, total_steps=total_steps)
    # the data shard of each local row: its worker id (a process without a worker: none)
    shards = [comm.worker_of(e) for e in comm.local_workers]
    compute = WorkerCompute.for_run(cfg, data, partitioner, replicas, shards, worker_steps, device)
    algorithm.attach_compute(compute)
    clip = GradClip(tc.get("grad_clip"), replicas.num_local, device)
    if clip.active:
        algorithm.set_grad_clip(clip)
    run = Run(
        cfg=cfg,
        comm=comm,
        device=device,
        data=data,
        partitioner=partitioner,
        replicas=replicas,
        eval_model=copy.deepcopy(model).to(device),
        optimizers=optimizers,
        base_lr=optimizers[0].param_groups[0]["lr"],
        algorithm=algorithm,
        schedule=schedule,
        compute=compute,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        checkpoint_every=checkpoint_interval(tc.checkpoint_every, steps_per_epoch),
        gradients_per_step=per_step,
        rng=GlobalRandom(),
        clip=clip,
        modeled=ModeledClock.for_run(
            cfg, algorithm, comm.ledger, comm.num_workers, scenario_pricings(cfg)
        ),
        setup={**started, **algorithm.describe(), **compute.describe()},
    )
    comm.ledger.reset()  # the set-up's traffic is not the run's
    return run
