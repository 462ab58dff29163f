"""Entry point: `python -m dpresearch.train [overrides]` (console script `dpresearch-train`).

Composes the Hydra config, checks it, and launches the workers: in this process
(`backend=simulated`), as K local processes (`backend=gloo|nccl`), or — when torchrun started
this process — as one worker of a multi-node job.

Before Hydra starts, a single run is checked whole (`preflight`: configuration, data, a build of
every component) and its run directory claimed (`run_dir`): every bad input is one `error:`
line and exit status 2, with no run directory created and no worker started. A sweep (`-m`) is
checked point by point by the `dpresearch` sweeper, which runs the good points, and exits
non-zero listing the bad ones. Each run's directory gets `provenance.json`, and its `train.log`
holds what the run printed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from dpresearch import CONF_DIR
from dpresearch.config.preflight import preflight
from dpresearch.config.schema import register_configs
from dpresearch.config.validate import ConfigError, forget_data
from dpresearch.launch.environment import from_agent
from dpresearch.launch.processes import (
    StoppedNow,
    WorkerFrozen,
    global_rank,
    launch_local,
    run_as_worker,
    run_simulated,
    under_torchrun,
)
from dpresearch.run.checkpoint_files import CheckpointError
from dpresearch.run.io_errors import IO_EXIT, MIN_FREE_BYTES, RunIOError, free_bytes
from dpresearch.run.resume import check_resume, finished_run, nothing_to_resume

register_configs()

# When this process started the run (main(), or a sweep job's start): the final line's time.
_STARTED: list[float] = []


class PointFailed(RuntimeError):
    """A sweep point that failed; the message is its one line (the sweeper lists them)."""


def train(cfg: DictConfig, run_dir: Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Check `cfg` and run it; returns worker 0's summary (metrics at the end of training).

    `run_dir` is where the writing process puts config.yaml, metrics.jsonl, summary.json and
    model_final.pt (None: write nothing). `overrides` are the command line's, for the checks
    that depend on what the user set. Raises `ConfigError` for a configuration that cannot
    run.
    """
    dataset = preflight(cfg, overrides)
    if not under_torchrun():  # (a torchrun job: rank 0 checked before Hydra started)
        finished = finished_run(cfg, run_dir)
        if finished is not None:
            print(f"{run_dir} already holds this run, finished; nothing to resume", flush=True)
            return finished
        check_resume(cfg, run_dir, _processes(cfg))
        fresh = nothing_to_resume(cfg, run_dir)
        if fresh is not None:
            print(fresh, flush=True)
    if under_torchrun():
        forget_data()
        return run_as_worker(cfg, run_dir if global_rank() == 0 else None)
    if cfg.backend.name == "simulated":
        return run_simulated(cfg, run_dir, dataset)
    forget_data()  # each worker process loads its own copy
    return launch_local(cfg, run_dir)


def _processes(cfg: DictConfig) -> int:
    from dpresearch.config.validate import process_count

    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return 1 if cfg.backend.name == "simulated" else process_count(cfg)


class NothingToDo(Exception):
    """The command asks for nothing (a finished run resumed); the message is its one line."""


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    from dpresearch.launch.console import job_output
    from dpresearch.launch.provenance import write_provenance
    from dpresearch.launch.run_dir import claim_run_dir
    from dpresearch.run.wandb_names import default_names

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    started = _STARTED[0] if _STARTED and not multirun else time.monotonic()
    writes = not under_torchrun() or global_rank() == 0
    run_dir = Path(hc.runtime.output_dir) if writes else None
    overrides = list(hc.overrides.task)
    parallel = multirun and not hc.launcher._target_.endswith("BasicLauncher")
    label = f"[{hc.job.num}] " if parallel else ""
    log_path = run_dir / f"{hc.job.name}.log" if run_dir is not None else None
    with job_output(log_path, label):
        if run_dir is not None:
            print(f"run directory: {run_dir}", flush=True)
        try:
            what = f"sweep point {run_dir}" if multirun else ""
            resume = cfg.train.resume is not None
            claim = (
                claim_run_dir(run_dir, resume=resume, what=what)
                if run_dir
                else contextlib.nullcontext()
            )
            with claim:
                if run_dir is not None:
                    write_provenance(run_dir, overrides)
                if cfg.logger.wandb:
                    with open_dict(cfg):
                        cfg.logger.name, cfg.logger.group = default_names(cfg, hc)
                summary = train(cfg, run_dir, overrides)
        except (ConfigError, CheckpointError, WorkerFrozen) as exc:
            user_error = isinstance(exc, (ConfigError, CheckpointError))
            _fail(f"error: {exc}", 2 if user_error else 1, multirun)
        except StoppedNow as exc:  # in a sweep too: the user stopped the whole job
            print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.exit(128 + exc.signum)
        except RunIOError as exc:  # before the loop (config.yaml, provenance.json, ...)
            _fail(f"error: {exc.describe()}; free space and run again", IO_EXIT, multirun)
        except KeyboardInterrupt:  # Ctrl-C before the training loop took over the signal
            _fail("error: interrupted before training started; nothing to resume", 130, multirun)
        except Exception as exc:
            if not (multirun or _is_worker_failure(exc)):
                raise  # a bug: Hydra shows its traceback
            _fail(_crash_line(exc), 1, multirun)
        _end_of_run(summary, multirun, run_dir, time.monotonic() - started, hc.overrides.task)
    return summary.get("test/acc")


DIVERGED_EXIT = 3  # a non-finite loss stopped the run (train.on_nonfinite=stop)


def _end_of_run(
    summary: dict[str, Any],
    multirun: bool,
    run_dir: Path | None,
    seconds: float,
    overrides: Sequence[str],
) -> None:
    """The run's last line (`dpresearch.run.ending`): a finished run's status, steps, time and
    directory; for a run that ended short of its last step, its one line and exit status —
    128 + signal for a stop request (130 SIGINT, 143 SIGTERM, with the command that resumes it),
    `DIVERGED_EXIT` for a non-finite loss, `IO_EXIT` for a write the machine refused (a full
    disk; with the command that resumes it)."""
    from dpresearch.run.ending import final_line, interrupted_line, resume_command

    status = summary.get("status")
    if status == "interrupted":
        if run_dir is None:  # a torchrun rank other than 0: rank 0 says it
            sys.exit(int(summary.get("exit_code", 130)))
        command = (
            f"the same torchrun command with hydra.run.dir={run_dir} train.resume=auto"
            if under_torchrun()
            else resume_command(run_dir, overrides)
        )
        line = interrupted_line(summary, run_dir, seconds, command)
        print(line, file=sys.stderr, flush=True)
        # In a sweep too: the user asked the whole job to stop, not this point alone.
        if not multirun:  # (a single run: no sweep to tell; the teardown only delays the end)
            from dpresearch.run.stop import exit_now

            exit_now(int(summary.get("exit_code", 130)))
        sys.exit(int(summary.get("exit_code", 130)))
    if status == "diverged":
        kept = summary.get("last_checkpoint")
        line = (
            f"error: non-finite training loss at step {summary['diverged_at_step']} "
            f"(lr {summary['lr']:.4g}); the run was stopped and no model "
            "written: lower optimizer.lr (or set train.on_nonfinite=skip_step)"
            + (f"; last finite checkpoint {kept}" if kept else "")
        )
        _fail(line, DIVERGED_EXIT, multirun)
    if status == "failed_io":
        kept = summary.get("last_checkpoint")
        how = (
            resume_command(run_dir, overrides)
            if run_dir is not None and not under_torchrun()
            else "train.resume=auto and this run's hydra.run.dir"
        )
        line = (
            f"error: {summary.get('io_error') or 'a write into the run directory failed'}; the "
            f"run stopped after step {summary['failed_at_step']}, "
            + (f"its last good checkpoint is {kept}" if kept else "with no checkpoint")
            + f": free space, then resume with {how}"
            + ("" if summary.get("summary_written", True) else " (summary.json not written)")
        )
        _fail(line, IO_EXIT, multirun)
    if run_dir is not None:
        print(final_line(summary, run_dir, seconds), flush=True)


def _is_worker_failure(exc: BaseException) -> bool:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    return isinstance(exc, ChildFailedError)


def _crash_line(exc: BaseException) -> str:
    """Print what there is to read about a crash (the failed worker's own traceback; the
    launcher's frames add nothing), and return the one line that ends the run."""
    if _is_worker_failure(exc):
        from dpresearch.launch.console import log_only
        from dpresearch.launch.processes import died_unreported, root_failure

        unreported = died_unreported(exc)
        if unreported is not None:  # its peers' broken connections are all torch saw
            rank, pid = unreported
            where = "train.log" if log_only(exc.format_msg()) else "above"
            return (
                f"error: worker process failed: rank {rank} (pid {pid}) died without a report "
                "(killed by a signal such as SIGKILL, or crashed); the job was stopped "
                f"(torch's report of its peers: {where})"
            )
        rank, failure = root_failure(exc)
        if failure.exitcode < 0:  # killed by a signal: torch's block holds no traceback of ours
            where = "train.log" if log_only(exc.format_msg()) else "above"
            return (
                f"error: worker process failed: rank {rank} (pid {failure.pid}) was killed by "
                f"{failure.signal_name()}; the job was stopped (torch's report: {where})"
            )
        print(exc.format_msg(), file=sys.stderr)  # the worker's own traceback
        return f"error: worker process failed: rank {rank}; the job was stopped ({exc.name})"
    traceback.print_exception(exc)
    lines = str(exc).strip().splitlines()
    return f"error: {type(exc).__name__}: {lines[0] if lines else ''}"


def _fail(line: str, status: int, multirun: bool) -> None:
    """Print the run's one error line; end the process (a single run) or the point (a sweep,
    which goes on with its other points)."""
    print(line, file=sys.stderr, flush=True)
    if multirun:
        raise PointFailed(line.removeprefix("error: "))
    sys.exit(status)


def _check_before_hydra(argv: list[str]) -> list[str]:
    """Check the command line and, for a single run, the whole run and its directory, before
    Hydra creates anything; returns the arguments to hand Hydra (the run directory pinned, as
    the default one holds the time). Raises `ConfigError`."""
    from dpresearch.config.cli_check import (
        compose_command_line,
        parse_command_line,
        quote_value,
        task_config,
    )
    from dpresearch.launch.run_dir import claim_run_dir

    cmd = parse_command_line(argv)  # raises for impossible flag combinations
    if not cmd.checkable:
        return argv
    composed = compose_command_line(cmd, CONF_DIR)
    if not cmd.runs or cmd.multirun:
        return argv  # the sweeper checks each point
    preflight(task_config(composed), cmd.overrides)
    if under_torchrun() and global_rank() != 0:
        return argv
    task = task_config(composed)
    run_dir = Path(str(composed.hydra.run.dir)).resolve()
    resume = task.train.resume
    pinned_by_user = any(a.split("=", 1)[0].lstrip("+") == "hydra.run.dir" for a in argv)
    if resume not in (None, "auto") and not pinned_by_user:
        # train.resume=<checkpoint or run directory>: continue in that run's directory.
        from dpresearch.run.checkpoint_files import find_resume, run_dir_of

        run_dir = run_dir_of(find_resume(resume, None)) or run_dir
    claim = claim_run_dir(run_dir, resume=resume is not None)  # held until this process ends
    try:
        free = free_bytes(run_dir)
        if free is not None and free < MIN_FREE_BYTES:
            raise ConfigError(
                f"{run_dir} has {free / 1e3:.0f} kB free on its file system; a run writes its "
                "configuration, metrics and checkpoints there: free space, or pass another "
                "hydra.run.dir"
            )
        # A refused or no-op resume ends here: Hydra has written nothing into the run yet.
        if finished_run(task, run_dir) is not None:
            raise NothingToDo(f"{run_dir} already holds this run, finished; nothing to resume")
        check_resume(task, run_dir, _processes(task))
    except (ConfigError, NothingToDo):
        claim.abandon()
        raise
    pinned = [a for a in argv if a.split("=", 1)[0].lstrip("+") != "hydra.run.dir"]
    return [*pinned, f"hydra.run.dir={quote_value(str(run_dir))}"]


def main() -> None:
    """Console entry: check everything that can be checked before Hydra, then hand over."""
    from dpresearch.config.selects import with_selected_choices
    from dpresearch.launch.provenance import remember_command
    from dpresearch.run.ending import program, remember_invocation

    _STARTED[:] = [time.monotonic()]
    if not CONF_DIR.is_dir():
        print(
            f"error: config directory {CONF_DIR} is missing; install with pip install -e .",
            file=sys.stderr,
        )
        sys.exit(2)
    if under_torchrun() and from_agent():  # one of torchrun's workers: dies with its agent
        from dpresearch.run.lifeline import bind_to_launcher

        bind_to_launcher(os.getppid())
    remember_invocation(sys.argv[0], sys.argv[1:])
    remember_command([*program(sys.argv[0]), *sys.argv[1:]])
    try:
        args = _check_before_hydra(with_selected_choices(sys.argv[1:]))
    except ConfigError as exc:
        # Under torchrun every process checks; one line per machine is enough.
        if _local_rank() == 0:
            print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except NothingToDo as exc:
        print(exc, flush=True)
        sys.exit(0)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM during a download
        print("error: interrupted before the run started; nothing was written", file=sys.stderr)
        sys.exit(128 + getattr(exc, "signum", 2))
    if under_torchrun() and global_rank() != 0:
        # Only global rank 0 may write: keep Hydra's output directory and log files away.
        args += [
            "hydra.output_subdir=null",
            "hydra.run.dir=.",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
        ]
    sys.argv = [sys.argv[0], *args]
    _hydra_main()


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


if __name__ == "__main__":
    main()
