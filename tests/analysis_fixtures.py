"""Run directories written by hand, with answers known in advance (for the analysis tests)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

STEPS_PER_EPOCH = 5
OPS = [["allreduce", 1000, 4, 0, 10]]  # 10 steps × one allreduce of 1000 bytes, K = 4


def _dumps(row: dict[str, Any]) -> str:
    # As the trainer's logger writes them: non-finite floats as strings.
    return json.dumps(
        {
            k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()
        }
    )


def write_run(
    path: Path,
    *,
    lr: float,
    seed: int,
    accs: list[float],
    final_loss: float,
    case: str | None = None,
    finished: bool = True,
    status: str | None = None,
    network: tuple[float, float] = (20.0, 10.0),
) -> Path:
    """A run of len(accs) logged steps (one per step): epoch = step/5, comm/bytes = 1000·step,
    comm/modeled_s = 0.01·step, time/wall_s = 2·step, test/acc = accs[step-1]; the final
    training loss `final_loss` (NaN: diverged). `finished=False` writes no summary."""
    path.mkdir(parents=True)
    config = {
        "workers": 4,
        "seed": seed,
        "optimizer": {"_target_": "torch.optim.SGD", "lr": lr},
        "network": {"name": "10gbe", "latency_us": network[0], "bandwidth_gbit": network[1]},
        "model": {"hidden": [32]},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    if case is not None:
        (path / "study_point.json").write_text(json.dumps({"study": "fixture", "case": case}))
    rows = []
    for step, acc in enumerate(accs, 1):
        rows.append(
            {
                "step": step,
                "epoch": step / STEPS_PER_EPOCH,
                "train/loss": 2.0 / step,
                "comm/bytes": 1000.0 * step,
                "comm/modeled_s": 0.01 * step,
                "time/wall_s": 2.0 * step,
                "test/acc": acc,
            }
        )
    rows[-1]["train/loss"] = final_loss
    (path / "metrics.jsonl").write_text("".join(_dumps(r) + "\n" for r in rows))
    if finished:
        summary = {
            **rows[-1],
            "best/test_acc": max(accs),
            "comm/ops": OPS,
            "comm/bytes_per_epoch": 1000.0 * STEPS_PER_EPOCH,
            **({"status": status} if status else {}),
        }
        (path / "summary.json").write_text(_dumps(summary))
    return path


def ramp(final: float, n: int = 10) -> list[float]:
    """n accuracies rising linearly from final/n to final."""
    return [final * (i + 1) / n for i in range(n)]
