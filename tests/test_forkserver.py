"""Local worker processes forked from a fork server (`dpresearch.launch.forkserver`) see what a
spawned worker would: the launcher's current environment (plus what torch's agent set for the
worker) and working directory, not the ones the server started with; where that cannot hold
(standard streams redirected since the server started), or when asked, the launch spawns."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dpresearch.launch import forkserver


def _report(rank: int, context: forkserver.LaunchContext, out: str) -> None:
    os.environ["RANK"] = str(rank)  # as torch's agent sets it before the entry point runs
    forkserver.adopt(context)
    from multiprocessing.forkserver import _forkserver

    Path(out, f"{rank}.json").write_text(
        json.dumps(
            {
                "env": dict(os.environ),
                "cwd": os.getcwd(),
                "parent": os.getppid(),
                "holds_alive_pipe": _forkserver._forkserver_alive_fd is not None,
            }
        )
    )


def test_forked_workers_take_the_launchers_environment_and_directory(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    monkeypatch.setenv("DPRESEARCH_TEST_PROBE", "at the first launch")
    monkeypatch.setenv("DPRESEARCH_TEST_GONE", "set at the first launch only")
    forkserver.choose("forkserver")  # the server runs from here on (or already ran)
    monkeypatch.chdir(second)
    monkeypatch.setenv("DPRESEARCH_TEST_PROBE", "at this launch")
    monkeypatch.delenv("DPRESEARCH_TEST_GONE")
    method, context = forkserver.choose("forkserver")
    assert method == "forkserver"
    torch.multiprocessing.start_processes(
        _report, args=(context, str(tmp_path)), nprocs=2, join=True, start_method=method
    )
    for rank in range(2):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen["cwd"] == str(second)
        assert seen["env"]["DPRESEARCH_TEST_PROBE"] == "at this launch"
        assert "DPRESEARCH_TEST_GONE" not in seen["env"]
        assert seen["env"]["RANK"] == str(rank)  # the agent's setting kept
        assert seen["env"].items() >= os.environ.items()  # the launcher's, every variable
        # forked by the server (bound to the launcher, as the worker is): no worker keeps the
        # server's "alive" pipe open
        assert seen["parent"] == context.server_pid != os.getpid()
        assert not seen["holds_alive_pipe"]


def test_spawn_when_asked_or_when_the_streams_changed(monkeypatch):
    assert forkserver.choose("spawn")[0] == "spawn"
    assert forkserver.choose("forkserver")[0] == "forkserver"
    monkeypatch.setattr(forkserver, "_streams", lambda: ("a pipe opened since",))
    method, context = forkserver.choose("forkserver")
    assert method == "spawn" and context.server_env is None
    forkserver.adopt(context)  # a spawned worker's context changes nothing
