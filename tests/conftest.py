"""Shared fixtures: compose the project's Hydra config in-process, run the CLI as a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import dpresearch.train  # noqa: F401 - registers the structured config schema
from dpresearch import CONF_DIR

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# A small, fast experiment: 1024 synthetic examples, a 16-32-10 MLP.
SMALL = [
    "data.num_train=1024",
    "data.num_test=256",
    "data.num_features=16",
    "model.hidden=[32]",
    "train.progress=false",
    "train.log_every=5",
]


def compose_config(*overrides: str) -> DictConfig:
    """The composed config for `overrides`, exactly as `python -m dpresearch.train` builds it."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """`backend.threads` in a simulated run sets this process's thread count: undo it."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread. On a loaded machine a 2-thread BLAS call waits a
    scheduler tick (~16 ms) for its second thread, even for a 24×12 matmul."""
    import torch

    torch.set_num_threads(1)  # restored by _restore_torch_threads
    yield


@pytest.fixture
def small_config() -> Callable[..., DictConfig]:
    """compose(SMALL + overrides)."""
    return lambda *overrides: compose_config(*SMALL, *overrides)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(**extra: str) -> dict[str, str]:
    """This environment for a CLI subprocess, importing this checkout's package whatever its
    working directory (an editable install elsewhere would otherwise win)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path, **extra)


def run_cli(
    args: list[str],
    cwd: Path,
    timeout: float = 120,
    module: str = "dpresearch.train",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run `python -m <module> args` in `cwd` (`env`: variables added to this environment);
    returns the completed process (text output)."""
    env = cli_env(WANDB_MODE="disabled", HYDRA_FULL_ERROR="0", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun_two_nodes(
    cwd: Path, args: list[str], timeout: float = 240
) -> tuple[list[int], list[str]]:
    """Run `torchrun -m dpresearch.train args` as 2 "nodes" × 2 processes with a c10d rendezvous
    on 127.0.0.1; returns each node's exit code and output."""
    port = free_port()
    env = cli_env(WANDB_MODE="disabled")
    nodes = []
    for node_rank in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node_rank),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "dpresearch-test", "--max-restarts", "0",
            "-m", "dpresearch.train", *args,
        ]  # fmt: skip
        nodes.append(
            subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [p.communicate(timeout=timeout)[0] for p in nodes]
    return [p.returncode for p in nodes], outputs
