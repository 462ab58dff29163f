"""Readable W&B run names and groups, derived from the run when the config leaves them null.

Name: what was run, from the config-group choices — `<algorithm>-<compressor>[-<ef>]-<model>-
<data>-w<workers>-s<seed>`, e.g. `sync-topk-ef14-resnet20-cifar10-w8-s0` — plus, for a sweep
point, the swept overrides that made the point (`[optimizer.lr=0.1]`; the overrides every point
shares are left out, and the seed is already in the name). A study's points are named by the
study itself (`<case> | lr=<lr> | seed=<seed>`). Group: the sweep (its directory), else the study
(`experiment=`), else none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig


def swept_keys(sweep_dir: Path) -> set[str] | None:
    """The keys a multirun sweeps (`seed=0,1`, `x=range(3)`, `choice(...)`...), read from the
    `multirun.yaml` Hydra writes in the sweep directory; None when there is none."""
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        config = yaml.safe_load((sweep_dir / "multirun.yaml").read_text())
        overrides = list(config["hydra"]["overrides"]["task"])
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None
    parsed = OverridesParser.create().parse_overrides(overrides)
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


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
    if multirun:
        swept = swept_keys(Path(str(hc.sweep.dir)))
        if swept is None:  # no record of the sweep: every override of the point
            if hc.job.override_dirname:
                name += f" [{hc.job.override_dirname}]"
        else:
            varying = [o for o in hc.overrides.task if o.split("=", 1)[0] in swept - {"seed"}]
            if varying:
                name += f" [{','.join(varying)}]"
    if multirun:
        sweep_dir = Path(str(hc.sweep.dir))
        group = "/".join(sweep_dir.parts[-3:])
    else:
        group = choices.get("experiment")
    return cfg.logger.name or name, cfg.logger.group or group
