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


def point_dir(sweep_config: DictConfig, num: int) -> Path:
    """The directory Hydra will give the point composed as `sweep_config`, numbered `num`."""
    with open_dict(sweep_config):
        sweep_config.hydra.job.num = num
    return Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)


def check_point(
    config_loader: Any, master: DictConfig, overrides: Sequence[str], num: int
) -> str | None:
    """None if the point can be launched as job `num`; otherwise its one-line reason."""
    from dpresearch.config.cli_check import task_config
    from dpresearch.config.preflight import preflight
    from dpresearch.config.validate import ConfigError
    from dpresearch.launch.run_dir import holds_run

    try:
        sweep_config = config_loader.load_sweep_config(master, list(overrides))
    except Exception as exc:  # noqa: BLE001 - any composition failure is this point's
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    directory = point_dir(sweep_config, num)
    resume = sweep_config.get("train", {}).get("resume")
    existing = holds_run(directory) if directory.is_dir() and resume is None else None
    if existing is not None:
        return (
            f"{directory} already holds another run ({existing}); pass a new hydra.sweep.dir, "
            "or train.resume=auto to continue its runs"
        )
    task_overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
    try:
        preflight(task_config(sweep_config), task_overrides)
    except ConfigError as exc:
        return str(exc)
    return None


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
