"""Asynchronous training on real processes (issue 8, acceptance E): a gloo server and 4 worker
processes train the MLP with τ ≈ K − 1 under equal speeds; a killed worker ends the run
non-zero within 30 s; a hung worker is named by the server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMALL, load_scaled, worker_processes
from test_equivalence import run_ours

ASYNC = "algorithm=async_sgd"


@pytest.mark.distributed
def test_four_gloo_workers_train_with_staleness_k_minus_one(small_config, tmp_path):
    steps, k = 160, 4
    run_ours(
        small_config, tmp_path, "real", f"workers={k}", ASYNC, "backend=gloo",
        "backend.threads=1", "async.inject_delay=0.03", "compressor=topk",
        "compressor.ratio=0.1", "error_feedback=ef14", f"train.steps={steps}",
    )  # fmt: skip
    summary = json.loads((tmp_path / "real" / "summary.json").read_text())
    histogram = summary["async/tau_histogram"]
    mean = sum(t * n for t, n in enumerate(histogram)) / sum(histogram)
    assert sum(histogram) == steps == summary["async/updates"]
    assert abs(mean - (k - 1)) <= 0.3 * (k - 1), histogram
    assert min(summary["async/applied_per_worker"]) > 0
    assert summary["async"]["mode"] == "real processes"
    assert summary["test/acc"] > 0.5 and summary["train/loss"] < 1.5


def _holds(pid: int, name: str) -> bool:
    """Whether process `pid` has a file called `name` open."""
    try:
        return any(os.readlink(fd).endswith(name) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """A long real-mode run; returns it once it is logging, with its metrics file."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    run = subprocess.Popen(
        [
            sys.executable, "-m", "dpresearch.train", ASYNC, "backend=gloo", "workers=4",
            "async.inject_delay=0.05", "train.steps=1000000", "train.log_every=1",
            *SMALL[:-1], *extra,
        ],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + load_scaled(180)
    while time.monotonic() < deadline:
        found = list(tmp_path.rglob("metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 5:
            return run, found[0]
        assert run.poll() is None, run.communicate()[1][-3000:]
        time.sleep(0.5)
    run.kill()
    raise AssertionError("the run did not start logging in time")


def _a_worker(run: subprocess.Popen) -> int:
    """A worker process of `run` (not the server, which writes metrics.jsonl)."""
    procs = worker_processes(run.pid)
    workers = [p for p in procs if not _holds(p, "metrics.jsonl")]
    assert len(procs) == 5 and len(workers) == 4, (procs, workers)
    return workers[1]


@pytest.mark.distributed
def test_killed_worker_ends_the_run_within_30_s(tmp_path):
    run, _ = _start(tmp_path)
    try:
        os.kill(_a_worker(run), signal.SIGKILL)
        killed = time.monotonic()
        _, err = run.communicate(timeout=load_scaled(60))
        elapsed = time.monotonic() - killed
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    assert elapsed < load_scaled(30), f"took {elapsed:.1f}s"
    assert "error: worker process failed" in err and "SIGKILL" in err


@pytest.mark.slow
@pytest.mark.distributed
def test_hung_worker_is_named_by_the_server(tmp_path):
    run, _ = _start(tmp_path, "async.timeout_s=5")
    victim = _a_worker(run)
    try:
        os.kill(victim, signal.SIGSTOP)
        _, err = run.communicate(timeout=load_scaled(120))
    finally:
        if run.poll() is None:
            run.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    assert run.returncode != 0
    assert "WorkerLost" in err and "sent no gradient for async.timeout_s=5s" in err
