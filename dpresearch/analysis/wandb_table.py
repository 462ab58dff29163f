"""The final table as a `wandb.Table`, when a W&B logger is wanted (import guarded)."""

from __future__ import annotations

import os
from collections.abc import Sequence


def log_table(
    df,
    columns: Sequence[str],
    key: str = "results",
    project: str = "dpresearch",
    group: str | None = None,
    mode: str | None = None,
) -> bool:
    """Log `columns` of `df` as one `wandb.Table` under `key` in a run of its own
    (`job_type="analysis"`, `group` = the study). Returns False, logging nothing, when wandb
    is not installed. `mode`: online / offline / disabled (None: WANDB_MODE, else online)."""
    try:
        import wandb
    except ImportError:
        return False
    # Read WANDB_MODE now: W&B reads the environment once per process (at its first use), so a
    # mode set after an earlier run in this process would otherwise be ignored.
    mode = mode or os.environ.get("WANDB_MODE") or "online"
    rows = df[list(columns)].astype(object).where(df[list(columns)].notna(), None)
    table = wandb.Table(columns=[str(c) for c in columns], data=rows.values.tolist())
    run = wandb.init(
        project=project, group=group, job_type="analysis", mode=mode, reinit="finish_previous"
    )
    try:
        run.log({key: table})
    finally:
        run.finish()
    return True
