"""Placing workers on processes.

- simulated: all K workers in this process.
- gloo / nccl on one machine: K worker processes started with torch's elastic launcher (the
  engine under torchrun), forked from a server that imported torch once
  (`dpresearch.launch.forkserver`; `backend.start_method=spawn`: a new interpreter each); if
  any worker fails, the agent stops the others and the job fails with that worker's traceback.
  A worker that stops showing signs of life for `backend.heartbeat_s` (stopped, frozen) is
  killed by a watchdog and the job fails naming it (`WorkerFrozen`). Started under `nohup`
  (SIGHUP ignored), the job keeps ignoring SIGHUP. SIGTERM and SIGINT are not the agent's to
  act on: the launcher forwards the first one to the workers through a stop file
  (`dpresearch.run.stop`), and they stop together at a step boundary with a final checkpoint; a
  second one stops them at once (the agent's own shutdown).
- under torchrun (its environment variables present): this process *is* one worker.

Every worker process dies with its launcher, whatever killed it (`dpresearch.run.lifeline`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import record

from dpresearch.errors import ConfigError
from dpresearch.launch import forkserver, threads
from dpresearch.launch.console import torch_logs_to_file, worker_output
from dpresearch.launch.environment import (
    TORCHRUN_VARS,
    describe_init_failure,
    environment_names,
    from_agent,
)
from dpresearch.launch.heartbeat import Heartbeat, Watchdog, silent_deaths
from dpresearch.run import stop
from dpresearch.run.build import prepare_data, process_count, run_device
from dpresearch.run.lifeline import bind_to_launcher, launcher_environment
from dpresearch.run.trainer import train

HEARTBEAT_ENV = "DPRESEARCH_HEARTBEAT_DIR"
LAUNCHED_AT_ENV = "DPRESEARCH_LAUNCHED_AT"


class WorkerFrozen(RuntimeError):
    """A local worker process went silent for `backend.heartbeat_s`; the message names it."""


class StoppedNow(RuntimeError):
    """A second stop signal made the launcher terminate its workers at once (the first asks
    them to stop at their next step, with a checkpoint); `signum` is the signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


def under_torchrun() -> bool:
    """True when torchrun (or the elastic launcher) started this process as a worker."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_simulated(cfg: DictConfig, run_dir: Path | None, dataset: Any = None) -> dict[str, Any]:
    """Run all K workers in this process (on `dataset` if already loaded), with the intra-op
    threads `dpresearch.launch.threads` chooses (printed)."""
    device = run_device(cfg)
    dataset = dataset if dataset is not None else prepare_data(cfg)
    count, why = threads.for_simulated(cfg, dataset, device.type)
    torch.set_num_threads(count)
    if cfg.train.progress:
        print(threads.describe(count, why), flush=True)
    return train(cfg, device, run_dir, dataset)


def run_as_worker(cfg: DictConfig, run_dir: Path | None) -> dict[str, Any]:
    """Run this process as one torch.distributed process of the training loop (environment set
    by the launcher; rank 0 writes `run_dir`)."""
    import torch.distributed as dist

    backend = cfg.backend.name
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    torch.set_num_threads(threads.choose(cfg, "cpu", None, local_world)[0])
    device = run_device(cfg)
    if backend == "nccl":
        torch.cuda.set_device(device)
    if not from_agent() and global_rank() == 0:
        print(
            f"{environment_names()} (from the environment, not torchrun): waiting up to "
            f"backend.timeout_s={cfg.backend.timeout_s:g} s for the other processes",
            flush=True,
        )
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.backend.timeout_s))
    except (dist.DistError, TimeoutError) as exc:
        raise ConfigError(describe_init_failure(exc, cfg.backend.timeout_s)) from None
    if dist.get_rank() == 0 and cfg.train.progress and LAUNCHED_AT_ENV in os.environ:
        took = time.time() - float(os.environ[LAUNCHED_AT_ENV])
        print(
            f"{backend}: {dist.get_world_size()} processes started and connected in {took:.1f} s; "
            "loading the data, building the model",
            flush=True,
        )
    try:
        summary = train(cfg, device, run_dir)
    except BaseException:
        dist.destroy_process_group()
        raise
    if dist.get_rank() == 0 and cfg.train.progress:
        # (the processes' shutdown takes seconds, more on a busy machine: not a hang)
        print(
            f"{backend}: training done, results written; shutting down the "
            f"{dist.get_world_size()} processes",
            flush=True,
        )
    leave_together()
    return summary


def leave_together() -> None:
    """Wait for every rank, then tear the process group down (a rank that exits while a peer
    still uses the gloo pair can abort it). The barrier's work is held here until the group is
    gone: otherwise gloo's worker thread may drop the last reference to it — a destructor that
    takes the GIL — while this thread, holding the GIL, joins that worker thread in the
    group's destructor: a deadlock seen at the end of 2-rank DDP runs."""
    import torch.distributed as dist

    work = dist.barrier(async_op=True)
    try:
        work.wait()
    finally:
        dist.destroy_process_group()
        del work


@record
def _worker_entry(cfg_container: dict, run_dir: str | None, context: Any = None) -> dict[str, Any]:
    """Entry point of a process started by `launch_local` (must be importable: spawn); a
    forked one first takes over its launcher's environment (`forkserver.adopt`)."""
    forkserver.adopt(context)
    # First: from here on, this process dies with the launcher (named in its environment;
    # a forked one's parent, the fork server, dies with it too).
    bind_to_launcher()
    cfg = OmegaConf.create(cfg_container)
    beats = os.environ.get(HEARTBEAT_ENV)
    # Stop requests are recorded from the start (the loop honours them at its next step).
    stoppable = stop.STOP_FILE_ENV in os.environ
    stop.exit_on_the_agents_sigterm()
    with worker_output(), stop.handling() if stoppable else contextlib.nullcontext():
        if not beats:
            return run_as_worker(cfg, Path(run_dir) if run_dir else None)
        with Heartbeat(Path(beats), int(os.environ["RANK"]), cfg.backend.heartbeat_s):
            return run_as_worker(cfg, Path(run_dir) if run_dir else None)


def launch_local(cfg: DictConfig, run_dir: Path | None) -> dict[str, Any]:
    """Start the run's processes (`run.build.process_count`) on this machine; return rank
    0's summary.

    Raises torch's `ChildFailedError` (which carries the failed worker's traceback) if any
    worker fails, or `WorkerFrozen` if the watchdog killed a silent one; the others are stopped
    at once.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    processes = process_count(cfg)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=processes,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
        **_elastic_signals(),
    )
    container = OmegaConf.to_container(cfg, resolve=True)
    if cfg.train.progress:
        print(
            f"{cfg.backend.name}: starting {processes} worker processes on this machine "
            "(they join a rendezvous and build the run; this takes a few seconds)",
            flush=True,
        )
    heartbeat_s = cfg.backend.get("heartbeat_s")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_spawnable_start_method())
        stack.enter_context(torch_logs_to_file())  # a worker's fault: our one line, not torch's
        stack.enter_context(
            _environment({LAUNCHED_AT_ENV: str(time.time()), **launcher_environment()})
        )
        watchdog = None
        if heartbeat_s:
            beats = stack.enter_context(tempfile.TemporaryDirectory(prefix="dpresearch-beats-"))
            stack.enter_context(_environment({HEARTBEAT_ENV: beats}))
            watchdog = Watchdog(Path(beats), heartbeat_s)
            stack.callback(watchdog.stop)
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="dpresearch-stop-"))
        stop_file = Path(folder) / "stop"
        stack.enter_context(_environment({stop.STOP_FILE_ENV: str(stop_file)}))
        stack.enter_context(stop.forwarding(stop_file, _stop_workers_now))
        method, context = forkserver.choose(cfg.backend.start_method)
        config = dataclasses.replace(config, start_method=method)
        try:
            results = elastic_launch(config, _worker_entry)(
                container, str(run_dir) if run_dir else None, context
            )
        except SignalException as exc:  # _stop_workers_now's, once torch's agent ended them
            kept = f"; {run_dir} keeps the checkpoints written before it" if run_dir else ""
            raise StoppedNow(
                f"a second {exc.sigval.name} terminated the workers at once{kept}",
                int(exc.sigval),
            ) from None
        except ChildFailedError as exc:
            if watchdog is not None and watchdog.frozen is not None:
                who = "worker" if processes == cfg.workers else "rank"  # ranks are workers?
                raise WorkerFrozen(watchdog.frozen.message(heartbeat_s, who)) from exc
            failure = every_failure(exc, processes)
            # torch reports the processes it saw fail; one killed by a signal may not be among
            # them (a peer's broken connection was seen first): its heartbeat file tells
            failure.silent_deaths = silent_deaths(Path(beats)) if heartbeat_s else []
            raise worker_config_error(failure) or failure from None
    return results[0]


def worker_config_error(exc: Any) -> ConfigError | None:
    """The `ConfigError` that failed the job's first failed worker (e.g. a token id beyond the
    vocabulary in the batch it read), for the entry point's one line; None for another
    failure (its traceback is the report)."""
    _, first = exc.get_first_failure()
    message = first.message.get("message", "") if isinstance(first.message, dict) else ""
    name = f"{ConfigError.__name__}: "
    return (
        ConfigError(message.removeprefix(name).splitlines()[0])
        if message.startswith(name)
        else None
    )


def root_failure(exc: Any) -> tuple[int, Any]:
    """(rank, torch's `ProcessFailure`) of the worker whose failure ended the job: one killed
    by a signal where there is one (its peers then fail on the broken connection, each with an
    error file of its own and often an earlier time stamp), else torch's first failure."""
    killed = [(rank, f) for rank, f in exc.failures.items() if f.exitcode < 0]
    return killed[0] if killed else exc.get_first_failure()


# what gloo's transport raises in a process whose peer is gone
LOST_PEER = ("Connection closed by peer", "Connection reset by peer")


def died_unreported(exc: Any) -> tuple[int, int] | None:
    """(rank, pid) of a worker that died without unwinding (`heartbeat.silent_deaths`) and
    that torch did not report, where every failure torch did report is a peer's lost
    connection (so no error of its own — a server's `WorkerLost`, say — is the cause): the root
    cause of the job's failure; else None."""

    def lost_peer(failure: Any) -> bool:
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else ""
        return failure.exitcode >= 0 and any(text in message for text in LOST_PEER)

    if not all(lost_peer(f) for f in exc.failures.values()):
        return None
    unreported = [(r, pid) for r, pid in getattr(exc, "silent_deaths", []) if r not in exc.failures]
    return unreported[0] if unreported else None


def every_failure(exc: Any, processes: int) -> Any:
    """`exc` (torch's `ChildFailedError`) with every worker's recorded failure, earliest first.

    torch's agent reports the first failed process it notices. When one worker raises, its
    peers fail a moment later on the broken connection, and the agent may notice a peer first
    (forked workers' exits reach it through the fork server) and report the peer's connection
    error as the root cause. Every worker that raised wrote its error file before exiting; the
    earliest written is the root cause, and `ChildFailedError.get_first_failure` picks it
    (earliest timestamp in seconds, ties in the order given here)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = dict(exc.failures)
    attempts = {Path(f.error_file).parent.parent for f in failures.values()}
    if len(attempts) != 1 or not all(Path(f.error_file).is_file() for f in failures.values()):
        return exc  # (no error files to compare)
    (attempt,) = attempts
    for rank in range(processes):  # one machine: a global rank is its local rank
        path = attempt / str(rank) / "error.json"
        if rank not in failures and path.is_file():
            # (raised, so exited with 1 (torch's wrapper); its pid is not recorded)
            try:
                failures[rank] = ProcessFailure(rank, pid=-1, exitcode=1, error_file=str(path))
            except (OSError, ValueError):
                # A peer still writing its file (empty or cut short: torch's parse raises)
                # failed after the files already written, so it is not the root cause.
                continue

    def written(rank: int) -> int:
        try:
            return os.stat(failures[rank].error_file).st_mtime_ns
        except OSError:
            return 2**63

    ordered = {rank: failures[rank] for rank in sorted(failures, key=written)}
    return ChildFailedError(exc.name, ordered)


def _elastic_signals() -> dict[str, str]:
    """`LaunchConfig` settings for the signals torch's elastic agent turns into a stop: its
    default ones but SIGTERM/SIGINT (the launcher forwards them as a clean stop request), and
    not SIGHUP when this process ignores it (started under `nohup`), as a simulated run would.
    (Older torch without the setting: its defaults.)"""
    from torch.distributed.launcher.api import LaunchConfig

    if "signals_to_handle" not in {f.name for f in dataclasses.fields(LaunchConfig)}:
        return {}
    handled = ["SIGQUIT"]
    # (getsignal gives an int 1 for an inherited SIG_IGN, hence `!=`)
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        handled.append("SIGHUP")
    return {"signals_to_handle": ",".join(handled)}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables (inherited by the workers) for the duration."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _spawnable_start_method() -> Iterator[None]:
    """A process pool's own start method (joblib's `loky`, in a parallel sweep's job) is not
    one a spawned worker knows, and multiprocessing hands it down: it fails with "cannot find
    context for 'loky'". Use `spawn`'s for the launch and restore the pool's afterwards."""
    current = multiprocessing.get_start_method(allow_none=True)
    if current is None or current in multiprocessing.get_all_start_methods():
        yield
        return
    multiprocessing.set_start_method("spawn", force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(current, force=True)


def _stop_workers_now(signum: int, frame: object) -> None:
    """A second stop signal: raise the exception on which torch's elastic agent terminates
    the workers at once (what its own handler for SIGTERM/SIGINT does)."""
    raise SignalException(
        f"process {os.getpid()} got {signal.Signals(signum).name}", signal.Signals(signum)
    )
