"""Shared fixtures: compose the project's Hydra config in-process, run the CLI as a subprocess."""

from __future__ import annotations

import os
import signal
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
def one_process_group():
    """A one-rank gloo group in this process, torn down with `leave_together`. A test that
    builds a DDP model must drop it (and `gc.collect()`) before the fixture ends: a reducer
    holding the group's last reference joins gloo's threads while holding the GIL."""
    import torch.distributed as dist

    from dpresearch.launch.processes import leave_together

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    leave_together()


@pytest.fixture
def small_config() -> Callable[..., DictConfig]:
    """compose(SMALL + overrides)."""
    return lambda *overrides: compose_config(*SMALL, *overrides)


def slowdown() -> float:
    """How much slower than when quiet this machine runs now: the 1-minute load average per
    core, at least 1 (CI and development machines share their few cores with other jobs)."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def load_scaled(seconds: float) -> float:
    """`seconds` stretched by the current `slowdown()`: for hang guards and wall-clock bounds,
    which judge the code under test, not the other jobs sharing the cores. On a quiet machine
    it is `seconds` itself."""
    return seconds * slowdown()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def worker_processes(launcher: int) -> list[int]:
    """The worker processes a launching process started (`launch_local`): its children started
    with multiprocessing's spawn, or the processes its fork server forked (forkserver)."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent_of[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    kids = [p for p, parent in parent_of.items() if parent == launcher]
    workers = [p for p in kids if "--multiprocessing-fork" in cmdline(p)]
    servers = {p for p in kids if "multiprocessing.forkserver" in cmdline(p)}
    workers += [p for p, parent in parent_of.items() if parent in servers]
    return sorted(workers)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminal_signals() -> None:
    """`preexec_fn` of a run a test stops with SIGINT: SIGINT and SIGQUIT at their defaults, as
    in a job a terminal starts. A suite started with them ignored (a script's background job:
    `cmd &` without job control) would pass that on, and a run keeps ignoring an ignored SIGINT
    on purpose (`dpresearch/run/stop.py`) — the test would then wait for a stop that never
    comes."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


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
    returns the completed process (text output). `timeout` is a hang guard, stretched by the
    machine's load (`load_scaled`)."""
    env = cli_env(WANDB_MODE="disabled", HYDRA_FULL_ERROR="0", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=load_scaled(timeout),
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
    outputs = [p.communicate(timeout=load_scaled(timeout))[0] for p in nodes]
    return [p.returncode for p in nodes], outputs


# -- CPU seconds per test (`--cpu-durations=N`): a ranking that the machine's load barely moves,
# unlike wall time on a shared machine (the processes a test starts are counted once they end).
def pytest_addoption(parser):
    parser.addoption(
        "--cpu-durations", type=int, default=None, metavar="N",
        help="list the N tests that used the most CPU seconds (this process and the processes "
        "it started; 0: all)",
    )  # fmt: skip
    parser.addoption(
        "--cpu-log", default=None, metavar="FILE",
        help="append each test's CPU and wall seconds to FILE as it ends (a long run's figures "
        "so far)",
    )  # fmt: skip


def _cpu_seconds() -> float:
    """CPU seconds of this process and the processes it started that have ended, including
    worker processes forked by its fork server (`dpresearch.launch.forkserver`), which the
    server reaps, not this process."""
    import resource
    from multiprocessing import forkserver

    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                       resource.RUSAGE_CHILDREN))  # fmt: skip
    total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    server = forkserver._forkserver._forkserver_pid
    if server is not None:
        try:  # utime, stime, cutime, cstime: fields 14-17 of /proc/PID/stat
            fields = Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            pass
    return total


_CPU: dict[str, tuple[float, float]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import time

    log = item.config.getoption("--cpu-log")
    if item.config.getoption("--cpu-durations") is None and log is None:
        yield
        return
    cpu, wall = _cpu_seconds(), time.perf_counter()
    yield
    _CPU[item.nodeid] = (_cpu_seconds() - cpu, time.perf_counter() - wall)
    if log is not None:
        with open(log, "a") as f:
            load = os.getloadavg()[0]
            f.write(f"{_CPU[item.nodeid][0]:.2f} {_CPU[item.nodeid][1]:.2f} {load:.1f} "
                    f"{item.nodeid}\n")  # fmt: skip


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = config.getoption("--cpu-durations")
    if n is None or not _CPU:
        return
    rows = sorted(_CPU.items(), key=lambda kv: -kv[1][0])
    total_cpu, total_wall = (sum(v[i] for v in _CPU.values()) for i in (0, 1))
    terminalreporter.section(f"CPU seconds per test (load average now {os.getloadavg()[0]:.1f})")
    for nodeid, (cpu, wall) in rows[: n or None]:
        terminalreporter.write_line(f"{cpu:8.1f} cpu {wall:8.1f} wall  {nodeid}")
    terminalreporter.write_line(f"{total_cpu:8.1f} cpu {total_wall:8.1f} wall  in all")
