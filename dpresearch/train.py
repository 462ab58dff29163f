"""Entry point: `python -m dpresearch.train [overrides]` (console script `dpresearch-train`).

Composes the Hydra config, validates it, and launches the workers: in this process
(`backend=simulated`), as K local processes (`backend=gloo|nccl`), or — when torchrun started
this process — as one worker of a multi-node job. Every configuration error is reported as one
line naming the fix, before any worker starts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dpresearch.config import register_configs
from dpresearch.launch import (
    global_rank,
    launch_local,
    run_as_worker,
    run_simulated,
    under_torchrun,
)
from dpresearch.validate import ConfigError, prepare_data, validate

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

register_configs()


def train(cfg: DictConfig, run_dir: Path | None) -> dict[str, Any]:
    """Validate `cfg` and run it; returns worker 0's summary (metrics at the end of training).

    `run_dir` is where the writing process puts config.yaml, metrics.jsonl, summary.json and
    model_final.pt (None: write nothing). Raises `ConfigError` for a configuration that cannot
    run.
    """
    validate(cfg)
    if under_torchrun():
        return run_as_worker(cfg, run_dir if global_rank() == 0 else None)
    dataset = prepare_data(cfg)
    if cfg.backend.name == "simulated":
        return run_simulated(cfg, run_dir, dataset)
    return launch_local(cfg, run_dir)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    writes = not under_torchrun() or global_rank() == 0
    run_dir = Path(HydraConfig.get().runtime.output_dir) if writes else None
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        summary = train(cfg, run_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except ChildFailedError as exc:
        # The report holds the failed worker's own traceback; the launcher's frames add nothing.
        print(exc.format_msg(), file=sys.stderr)
        print(f"error: worker process failed; the job was stopped ({exc.name})", file=sys.stderr)
        sys.exit(1)
    return summary.get("test/acc")


def main() -> None:
    """Console entry: report composition errors in one line, then hand over to Hydra."""
    from dpresearch.cli_check import composition_error

    if not CONF_DIR.is_dir():
        print(
            f"error: config directory {CONF_DIR} is missing; install with pip install -e .",
            file=sys.stderr,
        )
        sys.exit(2)
    message = composition_error(sys.argv[1:], CONF_DIR)
    if message:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    if under_torchrun() and global_rank() != 0:
        # Only global rank 0 may write: keep Hydra's output directory and log files away.
        sys.argv += [
            "hydra.output_subdir=null",
            "hydra.run.dir=.",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
        ]
    _hydra_main()


if __name__ == "__main__":
    main()
