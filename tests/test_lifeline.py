"""A worker dies with its launcher itself — not with its parent, the fork server — and never
writes into a run directory whose lock its launcher no longer holds (issue 33, item 5).

Before: a forked worker was bound to the fork server, which outlived a SIGKILLed launcher by
~6 s under load, and the worker went on appending to `metrics.jsonl` after the lock was free.
The gloo jobs themselves: `tests/test_launcher_death.py` (slow)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import cli_env, load_scaled

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists() or not hasattr(os, "pidfd_open"),
    reason="needs procfs and pidfds (Linux)",
)

BOUND_S = 2.0  # the bound, from the launcher's SIGKILL to its last process gone

# A launcher: holds a run directory's lock, starts the fork server and one worker forked from
# it (bound as `launch_local`'s workers are), prints "<server> <worker>", then waits.
LAUNCHER = """
import multiprocessing, os, sys, time
from dpresearch.launch import forkserver
from dpresearch.launch.run_dir import claim_run_dir
from dpresearch.run.lifeline import launcher_environment

def worker(run_dir, context):
    forkserver.adopt(context)
    from dpresearch.run import lifeline
    lifeline.bind_to_launcher()
    lifeline.guard_run_dir(run_dir)
    while True:
        lifeline.check_launcher()
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write("line\\n")
        time.sleep(0.01)

if __name__ == "__main__":
    run_dir = sys.argv[1]
    claim = claim_run_dir(run_dir)
    os.environ.update(launcher_environment())
    method, context = forkserver.choose("forkserver")
    assert method == "forkserver", method
    proc = multiprocessing.get_context("forkserver").Process(target=worker, args=(run_dir, context))
    proc.start()
    print(context.server_pid, proc.pid, flush=True)
    for line in sys.stdin:  # "release": drop the lock, staying alive
        claim.release()
        print("released", flush=True)
    time.sleep(3600)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _start(tmp_path: Path) -> tuple[subprocess.Popen, int, int]:
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(LAUNCHER))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(run_dir)],
        cwd=tmp_path,
        env=cli_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    server, worker = map(int, proc.stdout.readline().split())
    deadline = time.monotonic() + load_scaled(60)
    while not (run_dir / "metrics.jsonl").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the worker never wrote"
        time.sleep(0.05)
    return proc, server, worker


def _lines(tmp_path: Path) -> int:
    return len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines())


def _gone_within(pids: list[int], seconds: float) -> float:
    start = time.monotonic()
    while any(_running(p) for p in pids):
        took = time.monotonic() - start
        assert took < seconds, (
            f"still running {took:.1f} s later: {[p for p in pids if _running(p)]}"
        )
        time.sleep(0.01)
    return time.monotonic() - start


def test_the_fork_server_and_its_worker_die_with_the_launcher(tmp_path):
    proc, server, worker = _start(tmp_path)
    try:
        assert _running(server) and _running(worker)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        took = _gone_within([server, worker], load_scaled(BOUND_S))
        print(f"fork server and worker gone {took:.2f} s after the launcher's SIGKILL")
        written = _lines(tmp_path)
        time.sleep(0.3)
        assert _lines(tmp_path) == written
    finally:
        for pid in (server, worker):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_worker_writes_nothing_once_its_launchers_lock_is_gone(tmp_path):
    """The launcher alive but the lock released (as the kernel releases it a moment before it
    reports the launcher's death): the worker's next check ends it."""
    proc, server, worker = _start(tmp_path)
    try:
        proc.stdin.write("release\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "released"
        written = _lines(tmp_path)
        _gone_within([worker], load_scaled(BOUND_S))
        assert _lines(tmp_path) <= written + 1  # at most the line being written when released
        assert _running(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
