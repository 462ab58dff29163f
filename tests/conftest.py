"""pytest's fixtures and hooks for the suite. The helpers the tests share live in `helpers.py`
(import them from there: no test module imports another test module or this one)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import QUICK_CORE, SMALL, compose_config, in_quick_core, slow_by_measure
from omegaconf import DictConfig


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


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """`-m quick`: only the test modules QUICK_CORE names are collected (collecting all of them
    takes a good part of the core's own time)."""
    if config.getoption("markexpr") != "quick" or not collection_path.name.startswith("test_"):
        return None
    quick_modules = {entry.split("::")[0].rsplit("/", 1)[-1] for entry in QUICK_CORE}
    return True if collection_path.name not in quick_modules else None


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    """`slow` on the tests `helpers.SLOW_BY_MEASURE` names; `-m quick`: the core of the suite
    (`helpers.QUICK_CORE`), slow tests left out."""
    for item in items:
        if slow_by_measure(item.nodeid):
            item.add_marker(pytest.mark.slow)
        if in_quick_core(item.nodeid) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)


# -- CPU seconds per test (`--cpu-durations=N`): a ranking that the machine's load barely moves,
# unlike wall time on a shared machine (the processes a test starts are counted once they end).
def pytest_addoption(parser):
    parser.addoption(
        "--cpu-durations",
        type=int,
        default=None,
        metavar="N",
        help="list the N tests that used the most CPU seconds (this process and the processes "
        "it started; 0: all)",
    )
    parser.addoption(
        "--cpu-log",
        default=None,
        metavar="FILE",
        help="append each test's CPU and wall seconds to FILE as it ends (a long run's figures "
        "so far)",
    )


def _cpu_seconds() -> float:
    """CPU seconds of this process and the processes it started that have ended, including
    worker processes forked by its fork server (`dpresearch.launch.forkserver`), which the
    server reaps, not this process."""
    import resource
    from multiprocessing import forkserver

    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
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
            f.write(
                f"{_CPU[item.nodeid][0]:.2f} {_CPU[item.nodeid][1]:.2f} {load:.1f} {item.nodeid}\n"
            )


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
