"""Real images learn (issue 3, acceptance E) — slow: ~4 min on 2 idle cores."""

from __future__ import annotations

import json

import pytest
from helpers import SHARED, run_cli

SUBSET = SHARED / "data" / "cifar10-subset"


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(not SUBSET.is_dir(), reason=f"no CIFAR subset at {SUBSET}")
def test_resnet20_reaches_50_percent_on_the_subset_within_20_epochs(tmp_path):
    """ResNet-20, 4 simulated sync workers × 32, Nesterov SGD, 20 epochs on the 5085-image
    subset: at least 50% test accuracy (on the subset's 1017 test images)."""
    out = run_cli(
        [
            "experiment=resnet20_cifar10_subset",
            f"data.root={SUBSET}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        timeout=3600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["epoch"] == pytest.approx(20.0)
    assert summary["best/test_acc"] >= 0.50, summary
