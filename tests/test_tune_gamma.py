"""`python -m dpresearch.tune_gamma` (issue 7, item 5): the offline γ tuner finds ChocoSGD's
published step size and the obvious one for exact gossip."""

from __future__ import annotations

import json

import pytest
from helpers import REPO, run_cli

from dpresearch.tune_gamma import compose_tuning_config, tune


def test_top1_percent_on_a_ring_of_nine_picks_choco_sgds_gamma():
    """ChocoSGD tuned γ = 0.04 for top-1% on a ring of 9 workers, d = 2000."""
    cfg = compose_tuning_config(
        ["compressor.ratio=0.01", "steps=300", "gammas=[0.004,0.04,0.4]", "workers=9"]
    )
    result = tune(cfg)
    assert result["best_gamma"] == 0.04
    final = result["final"]
    assert final[0.04] < 0.1 < final[0.004] < 1.0  # too small: slow; 0.04 contracts
    assert final[0.4] > 1.0  # too large: diverges


def test_exact_gossip_prefers_the_full_step():
    cfg = compose_tuning_config(["compressor=identity", "steps=30", "gammas=[0.1,0.5,1.0]"])
    assert tune(cfg)["best_gamma"] == 1.0


@pytest.mark.slow  # a command-line run; the curve in-process above, the CLI's bad option below
def test_command_line_prints_the_curve_and_writes_json(tmp_path):
    out = tmp_path / "curves.json"
    result = run_cli(
        ["workers=4", "steps=20", "gammas=[0.1,1.0]", "compressor=sign", f"output={out}"],
        cwd=REPO,
        module="dpresearch.tune_gamma",
    )
    assert result.returncode == 0, result.stderr
    assert "best gamma:" in result.stdout
    saved = json.loads(out.read_text())
    assert set(saved["curves"]) == {"0.1", "1.0"} and len(saved["curves"]["0.1"]) == 21


@pytest.mark.slow
def test_bad_option_is_one_error_line():
    result = run_cli(["topology=torus", "workers=7"], cwd=REPO, module="dpresearch.tune_gamma")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: topology=torus"), result.stderr
