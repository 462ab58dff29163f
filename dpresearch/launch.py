"""Placing workers on processes.

- simulated: all K workers in this process.
- gloo / nccl on one machine: K worker processes started with torch's elastic launcher (the
  engine under torchrun); if any worker fails, the agent stops the others and the job fails
  with that worker's traceback.
- under torchrun (its environment variables present): this process *is* one worker.
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from dpresearch.comm.network import NetworkModel

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """True when torchrun (or the elastic launcher) started this process as a worker."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def network_model(cfg: DictConfig) -> NetworkModel:
    return NetworkModel.from_units(cfg.network.latency_us, cfg.network.bandwidth_gbit)


def threads_per_process(cfg: DictConfig, local_processes: int) -> int:
    if cfg.backend.threads:
        return int(cfg.backend.threads)
    return max(1, (os.cpu_count() or 1) // local_processes)


def run_simulated(cfg: DictConfig, run_dir: Path | None, dataset: Any = None) -> dict[str, Any]:
    """Run all K workers in this process (on `dataset` if already loaded)."""
    from dpresearch.comm.simulated import SimulatedCommunicator
    from dpresearch.trainer import Trainer

    if cfg.backend.threads:
        torch.set_num_threads(int(cfg.backend.threads))
    device_name = cfg.train.device
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    comm = SimulatedCommunicator(
        cfg.workers, network_model(cfg), cfg.comm.reduction, cfg.comm.deterministic
    )
    return Trainer(cfg, comm, torch.device(device_name), run_dir, dataset).run()


def process_device(cfg: DictConfig) -> torch.device:
    """The device this launched process computes on (its own GPU for NCCL, else the CPU)."""
    from dpresearch.comm.distributed import default_device_for

    return default_device_for(cfg.backend.name, int(os.environ["LOCAL_RANK"]))


def run_as_worker(cfg: DictConfig, run_dir: Path | None) -> dict[str, Any]:
    """Run this process as one torch.distributed process (environment set by the launcher):
    one worker of the training loop, or — for an algorithm with its own `run_process`
    classmethod (the asynchronous parameter server) — whatever part it gives this rank."""
    import torch.distributed as dist
    from hydra.utils import get_object

    backend = cfg.backend.name
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    torch.set_num_threads(threads_per_process(cfg, local_world))
    device = process_device(cfg)
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.backend.timeout_s))
    try:
        own = getattr(get_object(cfg.algorithm._target_), "run_process", None)
        summary = own(cfg, run_dir) if own is not None else _train(cfg, run_dir, device)
        # Leave together: a rank that exits while a peer still uses the gloo pair can abort it.
        dist.barrier()
        return summary
    finally:
        dist.destroy_process_group()


def _train(cfg: DictConfig, run_dir: Path | None, device: torch.device) -> dict[str, Any]:
    """This process as worker `rank` of the training loop (rank 0 writes `run_dir`)."""
    from dpresearch.comm.distributed import DistributedCommunicator
    from dpresearch.trainer import Trainer

    comm = DistributedCommunicator(
        network_model(cfg),
        cfg.comm.reduction,
        deterministic=cfg.comm.deterministic,
        p2p_schedule=cfg.comm.p2p_schedule,
    )
    writer_dir = run_dir if comm.is_main_process else None
    return Trainer(cfg, comm, device, writer_dir).run()


@record
def _worker_entry(cfg_container: dict, run_dir: str | None) -> dict[str, Any]:
    """Entry point of a process started by `launch_local` (must be importable: spawn)."""
    cfg = OmegaConf.create(cfg_container)
    return run_as_worker(cfg, Path(run_dir) if run_dir else None)


def launch_local(cfg: DictConfig, run_dir: Path | None) -> dict[str, Any]:
    """Start the K worker processes (`validate.process_count`) on this machine; return rank 0's
    summary.

    Raises torch's `ChildFailedError` (which carries the failed worker's traceback) if any
    worker fails; the others are stopped at once.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from dpresearch.validate import process_count

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=process_count(cfg),
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
    )
    container = OmegaConf.to_container(cfg, resolve=True)
    results = elastic_launch(config, _worker_entry)(container, str(run_dir) if run_dir else None)
    return results[0]
