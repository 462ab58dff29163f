"""Readable W&B run names and groups, derived from the run when the config leaves them null.

Name: what was run, from the config-group choices — `<algorithm>-<compressor>[-<ef>]-<model>-
<data>-w<workers>-s<seed>`, e.g. `sync-topk-ef14-resnet20-cifar10-w8-s0` — plus, for a sweep
point, the overrides that made the point. Group: the sweep (its directory), else the study
(`experiment=`), else none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig


def default_names(cfg: DictConfig, hc: Any) -> tuple[str, str | None]:
    """(name, group) for `cfg` run under Hydra config `hc`; set values in `cfg.logger` win."""
    from hydra.types import RunMode

    choices = hc.runtime.choices
    parts = [choices.get("algorithm"), choices.get("compressor")]
    if choices.get("error_feedback") not in (None, "none"):
        parts.append(choices.get("error_feedback"))
    parts += [choices.get("model"), choices.get("data"), f"w{cfg.workers}", f"s{cfg.seed}"]
    name = "-".join(str(p) for p in parts if p)
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun and hc.job.override_dirname:
        name += f" [{hc.job.override_dirname}]"
    if multirun:
        sweep_dir = Path(str(hc.sweep.dir))
        group = "/".join(sweep_dir.parts[-3:])
    else:
        group = choices.get("experiment")
    return cfg.logger.name or name, cfg.logger.group or group
