"""Faults a real-process run survives or ends cleanly (issue 9, item 5, acceptance E's
launcher-level parts): a frozen worker ends the job within `backend.heartbeat_s` + 10 s naming
it in one line (torch's own log of it in `train.log`, issue 33); SIGHUP under `setsid nohup`
does not stop a gloo run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import SMALL, cli_env, load_scaled, start_cli, wait_for_step, worker_processes

QUICK = [*SMALL, "data.num_train=256", "data.num_test=64", "train.log_every=1"]


def worker_pid(parent: int, rank: int) -> int:
    """The pid of worker `rank` under launcher `parent`, from the heartbeat file it writes."""
    mine = set(worker_processes(parent))
    for beat in Path(tempfile.gettempdir()).glob(f"dpresearch-beats-*/worker-{rank}"):
        try:
            pid = int(beat.read_text())
        except (OSError, ValueError):
            continue
        if pid in mine:
            return pid
    raise AssertionError(f"no heartbeat of worker {rank} under pid {parent}")


@pytest.mark.slow  # the default suite's failing gloo jobs: test_launch, test_launcher_death
@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs procfs to find workers")
def test_a_stopped_worker_ends_the_job_within_the_heartbeat(tmp_path):
    """The issue's bound is `heartbeat_s` + 10 s (measured: 6.1 s at a load of 6 on 2 cores);
    the assertion allows 20 s more for a machine shared with other jobs (at a load of 18 the
    teardown alone took 12 s). Without the watchdog the job would wait for the collectives'
    `backend.timeout_s` (120 s here) plus the agent's 30 s."""
    heartbeat_s = 5
    shared_machine_margin_s = 20
    run_dir = tmp_path / "run"
    proc = start_cli(
        [
            "backend=gloo",
            "workers=2",
            f"backend.heartbeat_s={heartbeat_s}",
            "backend.timeout_s=120",
            "train.steps=1000000",
            *QUICK,
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    try:
        wait_for_step(run_dir, proc, 1, timeout=240)
        frozen = worker_pid(proc.pid, rank=1)
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=heartbeat_s + load_scaled(60))
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"worker 1 stopped; the job ended {took:.1f} s later (load {os.getloadavg()[0]:.1f})")
    assert proc.returncode == 1, err[-3000:]
    assert took <= heartbeat_s + load_scaled(10 + shared_machine_margin_s), f"took {took:.1f} s"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    # our one line, torch's own log (the agent's ~50 lines: the peer's traceback) in train.log
    assert len(lines) == 1, err[-3000:]
    last = lines[0]
    assert last.startswith(f"error: worker 1 (pid {frozen}) showed no sign of life"), last
    assert "backend.heartbeat_s=5" in last
    assert "torch/distributed/elastic" in (run_dir / "train.log").read_text()


def test_torch_logs_go_to_the_log_file_not_the_console(tmp_path, monkeypatch, capfd):
    """torch's own handlers (stderr) are swapped for the job's log file during a
    launch, and put back after it."""
    import importlib
    import logging

    from dpresearch.launch.console import LOG_ENV, torch_logs_to_file

    importlib.import_module("torch.distributed")  # installs torch's own log handlers
    log = tmp_path / "train.log"
    monkeypatch.setenv(LOG_ENV, str(log))
    agent = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    spawn = logging.getLogger("torch.multiprocessing.spawn")
    before = [list(logging.getLogger(n).handlers) for n in ("torch", "torch.distributed")]
    with torch_logs_to_file():
        agent.error("failed (exitcode: 1) local_rank: 0")
        spawn.warning("Terminating process 1 via signal SIGTERM")
    assert "failed (exitcode: 1)" not in capfd.readouterr().err
    assert "failed (exitcode: 1) local_rank: 0" in log.read_text()
    assert "Terminating process 1" in log.read_text()
    assert [logging.getLogger(n).handlers for n in ("torch", "torch.distributed")] == before


@pytest.mark.slow
@pytest.mark.distributed
def test_gloo_run_survives_sighup_under_setsid_nohup(tmp_path):
    """Under `nohup` SIGHUP is ignored; the elastic agent used to stop the job on it."""
    run_dir = tmp_path / "run"
    steps = 400
    proc = subprocess.Popen(
        [
            "setsid",
            "nohup",
            sys.executable,
            "-m",
            "dpresearch.train",
            "backend=gloo",
            "workers=2",
            f"train.steps={steps}",
            *QUICK,
            "train.log_every=20",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env=cli_env(WANDB_MODE="disabled"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_step(run_dir, proc, 1, timeout=240)
        os.killpg(os.getpgid(proc.pid), signal.SIGHUP)  # the whole session: agent and workers
        _, err = proc.communicate(timeout=load_scaled(240))
    finally:
        if proc.poll() is None:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["total_steps"] == steps


def test_a_peer_still_writing_its_error_file_is_not_taken_for_the_root_cause(tmp_path):
    """CI caught it (a gloo worker killed at step 35): torch's agent reported worker 1, and its
    peer's error file existed but was still empty; reading it raised JSONDecodeError out of the
    launcher instead of the failure. A file that does not parse yet is skipped: it is written
    after the root cause's."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from dpresearch.launch.processes import every_failure

    attempt = tmp_path / "attempt_0"
    for rank in (0, 1):
        (attempt / str(rank)).mkdir(parents=True)
    extra = {"py_callstack": "Traceback ...", "timestamp": "1700000000"}
    message = {"message": "InjectedFailure: at step 35", "extraInfo": extra}
    (attempt / "1" / "error.json").write_text(json.dumps({"message": message}))
    (attempt / "0" / "error.json").write_text("")  # the peer, mid-write
    reported = ProcessFailure(1, pid=123, exitcode=1, error_file=str(attempt / "1" / "error.json"))
    result = every_failure(ChildFailedError("train", {1: reported}), 2)
    assert isinstance(result, ChildFailedError) and list(result.failures) == [1]
    assert "InjectedFailure" in result.failures[1].message["message"]
    # once the peer's file is complete (and older), it is listed, earliest first
    (attempt / "0" / "error.json").write_text(json.dumps({"message": message}))
    os.utime(attempt / "0" / "error.json", ns=(1, 1))
    assert list(every_failure(ChildFailedError("train", {1: reported}), 2).failures) == [0, 1]
