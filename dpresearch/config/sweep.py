"""Sweeps that survive their bad points: the logic of the `dpresearch` Hydra sweeper.

The sweeper (`hydra_plugins/dpresearch_sweeper`) expands `-m` overrides as Hydra's basic
sweeper does, then, before launching anything, checks every point here: its configuration
composes, passes `preflight`, and its directory does not already hold another run. A bad point
is reported in one `error:` line and not launched (no directory); the good points run under
whatever launcher is configured; a point that fails while running is reported by its task.
At the end, `report_failures` lists every failed point in one line and exits non-zero.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict


@dataclass(frozen=True)
class FailedPoint:
    overrides: tuple[str, ...]
    reason: str

    @property
    def name(self) -> str:
        return ",".join(self.overrides) or "(no overrides)"


@dataclass(frozen=True)
class Checked:
    """What the check decided for one point: launch it with `overrides` (its own, plus a
    `hydra.sweep.subdir` where its folder name had to be made safe), or not — `reason` (one
    line: it cannot run) or `done` (one line: nothing to do, its run finished)."""

    overrides: tuple[str, ...]
    reason: str | None = None
    done: str | None = None


# Characters a point's folder name may not hold as they are: path separators (a value such as
# `../x` or `/abs` would leave the sweep directory or nest folders), `%` (the escape itself),
# `$`, `{`, `}` (an interpolation once handed back to Hydra), and control characters.
_UNSAFE = set("/\\%${}") | {chr(c) for c in range(32)} | {chr(127)}
NAME_MAX_BYTES = 200  # under the usual 255-byte limit of one path component


def safe_folder_name(name: str) -> str:
    """`name` as one folder name inside its parent: unsafe characters percent-encoded (so two
    names never map to one), never `.` or `..`, at most `NAME_MAX_BYTES` bytes (a longer one
    is cut and ends with a hash of the whole)."""
    import hashlib

    safe = "".join(f"%{ord(c):02X}" if c in _UNSAFE else c for c in name)
    if safe in ("", ".", ".."):
        safe = "%2E" * len(safe) or "_"
    if len(safe.encode()) > NAME_MAX_BYTES:
        digest = hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:12]
        safe = safe.encode()[: NAME_MAX_BYTES - 13].decode(errors="ignore") + "-" + digest
    return safe


def point_dir(sweep_config: DictConfig, num: int) -> Path:
    """The directory Hydra will give the point composed as `sweep_config`, numbered `num`."""
    with open_dict(sweep_config):
        sweep_config.hydra.job.num = num
    return Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)


def inside(path: Path, folder: Path) -> bool:
    """`path` (resolved, symbolic links followed) is `folder` or below it."""
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def check_point(
    config_loader: Any, master: DictConfig, overrides: Sequence[str], num: int
) -> Checked:
    """Whether the point can be launched as job `num`, and with which overrides (see
    `Checked`). Its folder is always one folder inside the sweep directory: a folder name
    that a value would break (`../`, an absolute path, ...) is made safe
    (`safe_folder_name`) by a `hydra.sweep.subdir` override added to the point."""
    from dpresearch.config.cli_check import quote_value, task_config
    from dpresearch.config.preflight import preflight
    from dpresearch.config.selects import with_selected_choices
    from dpresearch.config.validate import ConfigError, process_count
    from dpresearch.launch.run_dir import holds_run
    from dpresearch.run.resume import check_resume, finished_run

    overrides = tuple(with_selected_choices(overrides))
    try:
        sweep_config = config_loader.load_sweep_config(master, list(overrides))
        directory = point_dir(sweep_config, num)
        subdir = str(sweep_config.hydra.sweep.subdir)
        if safe_folder_name(subdir) != subdir:
            overrides += (f"hydra.sweep.subdir={quote_value(safe_folder_name(subdir))}",)
            sweep_config = config_loader.load_sweep_config(master, list(overrides))
            directory = point_dir(sweep_config, num)
    except Exception as exc:
        return Checked(overrides, reason=(str(exc).strip().splitlines() or [type(exc).__name__])[0])
    sweep_dir = Path(str(sweep_config.hydra.sweep.dir))
    if not inside(directory, sweep_dir) or directory.resolve() == sweep_dir.resolve():
        return Checked(
            overrides,
            reason=f"its directory {directory} is not a folder inside the sweep directory "
            f"{sweep_dir}; set hydra.sweep.subdir to a name without ../ (e.g. its default)",
        )
    resume = sweep_config.get("train", {}).get("resume")
    existing = holds_run(directory) if directory.is_dir() and resume is None else None
    if existing is not None:
        return Checked(
            overrides,
            reason=f"{directory} already holds another run ({existing}); pass a new "
            "hydra.sweep.dir, or train.resume=auto to continue its runs",
        )
    task_overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
    task = task_config(sweep_config)
    try:
        preflight(task, task_overrides)
        # A refused or finished resume is settled here, before the job writes anything.
        if finished_run(task, directory) is not None:
            done = f"{directory} already holds this run, finished; nothing to resume"
            return Checked(overrides, done=done)
        processes = 1 if task.backend.name == "simulated" else process_count(task)
        check_resume(task, directory, processes)
    except ConfigError as exc:
        return Checked(overrides, reason=str(exc))
    return Checked(overrides)


def job_failure(result: Any) -> str | None:
    """The one-line reason of a launched job that failed (Hydra's `JobReturn`), or None."""
    from hydra.core.utils import JobStatus

    if result.status != JobStatus.FAILED:
        return None
    exc = result._return_value
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def report_failures(failed: Sequence[FailedPoint], total: int) -> None:
    """Exit with status 1 naming every failed point, if any failed."""
    if not failed:
        return
    names = "; ".join(f"{p.name} ({p.reason})" for p in failed)
    print(
        f"error: {len(failed)} of {total} sweep points failed, the others ran: {names}",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(1)
