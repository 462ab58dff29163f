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
        returns, launched, total = [], 0, 0
        while not self.is_done():
            batch = self.get_job_batch()
            total += len(batch)
            good = []
            for point in batch:
                reason = check_point(
                    self.hydra_context.config_loader, self.config, point, launched + len(good)
                )
                if reason is None:
                    good.append(point)
                    continue
                print(
                    f"error: sweep point {','.join(point)}: {reason}", file=sys.stderr, flush=True
                )
                failed.append(FailedPoint(tuple(point), reason))
            if not good:
                continue
            results = self.launcher.launch(good, initial_job_idx=launched)
            for point, result in zip(good, results, strict=True):
                reason = job_failure(result)
                if reason is not None:
                    failed.append(FailedPoint(tuple(point), reason))
            launched += len(good)
            returns.append(results)
        report_failures(failed, total)
        return returns
