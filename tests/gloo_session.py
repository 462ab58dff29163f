"""Many real-process checks for the price of one process start.

Starting gloo worker processes (each joins a rendezvous; spawned, each imports torch) costs
seconds per process on a small machine, far more than the tiny trainings the equivalence tests
run in them. `spawn_sequence` starts `world` processes once and runs a list of calls in them, one
after another; each call sets up and tears down its own process group, exactly as a launched
worker does, so the checks stay independent. `train_on_gloo` trains several configurations that
way through `dpresearch.launch.run_as_worker`, the code a launched worker runs (the launcher
itself, torch's elastic agent, is exercised by the tests that start runs through `train()` or
the command line).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now (all held open until every one is chosen)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _run_calls(rank: int, calls: Sequence[tuple[Callable[..., Any], tuple]], context) -> None:
    from dpresearch.launch.forkserver import adopt

    adopt(context)
    for fn, args in calls:
        fn(rank, *args)


def spawn_sequence(world: int, calls: Sequence[tuple[Callable[..., Any], tuple]]) -> None:
    """Start `world` processes once; each runs `fn(rank, *args)` for every call in order
    (functions importable by the children: module-level in a test module). They start as the
    launcher starts workers: forked from its fork server where it can (the same server, so it
    is started once per test session), else spawned (`dpresearch.launch.forkserver`)."""
    from dpresearch.launch.forkserver import choose

    method, context = choose("forkserver")
    torch.multiprocessing.start_processes(
        _run_calls, args=(list(calls), context), nprocs=world, join=True, start_method=method
    )


def train_rank(rank: int, world: int, cfg: dict, run_dir: str, port: int) -> None:
    """This process as rank `rank` of a `world`-process run of `cfg` (rank 0 writes
    `run_dir`): the environment torch's launcher would give it, then `run_as_worker`."""
    from dpresearch.launch.processes import run_as_worker

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    run_as_worker(OmegaConf.create(cfg), Path(run_dir) if rank == 0 else None)


def train_on_gloo(world: int, jobs: Sequence[tuple[DictConfig, Path]]) -> list[dict]:
    """Train every (config, run directory) on the same `world` gloo processes, one after
    another; returns each run's final model (`model_final.pt`)."""
    ports = free_ports(len(jobs))
    calls = [
        (train_rank, (world, OmegaConf.to_container(cfg, resolve=True), str(run_dir), port))
        for (cfg, run_dir), port in zip(jobs, ports, strict=True)
    ]
    for _, run_dir in jobs:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    spawn_sequence(world, calls)
    return [torch.load(Path(run_dir) / "model_final.pt") for _, run_dir in jobs]
