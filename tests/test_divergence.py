"""A non-finite training loss (issue 9, item 3, acceptance D): `train.on_nonfinite=stop` (the
default) ends the run at the first non-finite step with exit status 3, one `error:` line,
`status: diverged` and no model written; `skip_step` drops those steps' updates and counts
them; `continue` is the old behaviour. Finished runs say `status: finished`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import SMALL, compose_config, run_cli

from dpresearch.train import DIVERGED_EXIT, train

QUICK = [*SMALL, "data.num_train=256", "data.num_test=64", "train.log_every=1", "train.steps=40"]
HUGE_LR = "optimizer.lr=1e6"


def first_nonfinite_step(tmp_path: Path, *extra: str) -> int:
    """The first logged step whose training loss is not finite, under `continue`."""
    run_dir = tmp_path / "continue"
    summary = train(compose_config(*QUICK, HUGE_LR, "train.on_nonfinite=continue", *extra), run_dir)
    assert summary["status"] == "finished"
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        metrics = json.loads(line)
        if not math.isfinite(float(metrics["train/loss"])):
            return metrics["step"]
    raise AssertionError("lr=1e6 never gave a non-finite loss")


def check_diverged_cli(tmp_path: Path, *extra: str) -> None:
    first = first_nonfinite_step(tmp_path, *extra)
    run_dir = tmp_path / "run"
    out = run_cli([*QUICK, HUGE_LR, *extra, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=240)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == DIVERGED_EXIT, out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f"error: non-finite training loss at step {first} "), lines[0]
    assert "lower optimizer.lr" in lines[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == first
    assert not (run_dir / "model_final.pt").exists()
    logged = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(1, first))  # never a non-finite line
    assert all(math.isfinite(m["train/loss"]) for m in logged)


@pytest.mark.slow
def test_huge_lr_stops_at_the_first_nonfinite_step_simulated(tmp_path):
    check_diverged_cli(tmp_path)


@pytest.mark.slow
@pytest.mark.distributed
def test_huge_lr_stops_at_the_first_nonfinite_step_gloo(tmp_path):
    check_diverged_cli(tmp_path, "backend=gloo", "workers=2", "backend.threads=1")


def test_skip_step_drops_and_counts_nonfinite_steps(tmp_path):
    first = first_nonfinite_step(tmp_path)
    run_dir = tmp_path / "run"
    summary = train(compose_config(*QUICK, HUGE_LR, "train.on_nonfinite=skip_step"), run_dir)
    assert summary["status"] == "finished"
    # The model that first gave a non-finite loss is never updated again: every later step is
    # dropped too, and none of their losses is averaged into a logged one.
    assert summary["train/skipped_steps"] == 40 - first + 1
    logged = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(m["train/loss"]) for m in logged[: first - 1])
    assert all(m["train/loss"] == "nan" for m in logged[first - 1 :])  # nothing left to average


def test_adpsgd_stops_at_its_first_nonfinite_event(tmp_path):
    """AD-PSGD's steps are events of one worker (the loop's one-row finiteness check): under
    `stop` it ends at the very event whose loss is first non-finite under `continue`, before
    that event's update (the logged loss of every earlier event is finite)."""
    adpsgd = ("algorithm=adpsgd", "workers=4", "async.speed=exponential")
    first = first_nonfinite_step(tmp_path, *adpsgd)
    assert first > 1  # the check is not trivially at the start
    run_dir = tmp_path / "run"
    summary = train(compose_config(*QUICK, HUGE_LR, *adpsgd), run_dir)
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == first
    logged = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(1, first))
    assert all(math.isfinite(m["train/loss"]) for m in logged)


def test_finished_run_says_so(tmp_path):
    summary = train(compose_config(*QUICK, "train.steps=5"), tmp_path / "run")
    assert summary["status"] == "finished"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "finished"
