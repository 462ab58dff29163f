"""The `dpresearch` Hydra sweeper (`hydra/sweeper: dpresearch`, the project's default).

Hydra's basic sweeper stops a whole sweep at its first bad point (and before that, our task's
`sys.exit` for a bad config ends the process). This one checks every point before launching
any, launches only the good ones, keeps going when one fails while running, and exits non-zero
listing the failed points at the end. The logic lives in `dpresearch.config.sweep`; Hydra only
instantiates plugins from the `hydra_plugins` package, hence this module.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf


class DpresearchSweeper(BasicSweeper):
    """Cartesian-product sweeps (as `BasicSweeper`) that run every good point."""

    def sweep(self, arguments: list[str]) -> Any:
        from dpresearch.config.sweep import FailedPoint, check_point, job_failure, report_failures

        assert self.config is not None and self.launcher is not None
        assert self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([*self._parse_config(), *arguments])
        self.overrides = self.split_arguments(overrides, self.max_batch_size)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")

        failed: list[FailedPoint] = []
        returns, total = [], 0
        while not self.is_done():
            batch = self.get_job_batch()
            # Job k is the sweep's k-th point whatever happened to the others, so a point's
            # folder is the same in every run of the sweep (train.resume=auto finds it).
            runs: list[tuple[int, list[list[str]], list[list[str]]]] = []
            for num, point in enumerate(batch, start=total):
                checked = check_point(self.hydra_context.config_loader, self.config, point, num)
                if checked.done is not None:
                    print(f"sweep point {','.join(point)}: {checked.done}", flush=True)
                elif checked.reason is not None:
                    print(
                        f"error: sweep point {','.join(point)}: {checked.reason}",
                        file=sys.stderr,
                        flush=True,
                    )
                    failed.append(FailedPoint(tuple(point), checked.reason))
                elif runs and runs[-1][0] + len(runs[-1][1]) == num:
                    runs[-1][1].append(list(checked.overrides))
                    runs[-1][2].append(point)
                else:
                    runs.append((num, [list(checked.overrides)], [point]))
            total += len(batch)
            for first, launch, points in runs:  # consecutive good points go out together
                results = self.launcher.launch(launch, initial_job_idx=first)
                for point, result in zip(points, results, strict=True):
                    reason = job_failure(result)
                    if reason is not None:
                        failed.append(FailedPoint(tuple(point), reason))
                returns.append(results)
        report_failures(failed, total)
        return returns
