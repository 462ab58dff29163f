"""Local worker processes forked from a server that imported torch and the worker's code once.

Spawning a worker starts a new interpreter that imports torch, Hydra and dpresearch again:
seconds of CPU per process, which on a small machine dominate short runs, sweeps of them and
the test suite. multiprocessing's fork server imports them once, in a server process, and forks
each worker from it; the server lives as long as this process, so later launches (sweep points
run one after another, tests) start their workers in a fraction of a second.

A forked worker starts with the environment, working directory and standard streams the server
had when it started, where a spawned one inherits the launcher's current ones. The launcher's
environment and directory travel to the worker in a `LaunchContext`, which the worker adopts
(`adopt`), keeping what torch's agent set for it; standard streams cannot travel, so a launch
whose streams are no longer the server's (output redirected since) spawns instead, as does
`backend.start_method=spawn`.

A worker dies with its launcher (`dpresearch.run.lifeline`), bound to the launcher itself,
not to the server (its parent); the server dies with the launcher too: it imports
`forkserver_binding` first, which binds it to the launcher that started it. (The launcher also
holds the only write end of the server's "alive" pipe: multiprocessing hands a copy to every
forked child, which `adopt` closes — or a worker would keep the server alive.)
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing
import os
import signal
from multiprocessing import forkserver

# What a worker imports, imported once by the server (each a module path).
PRELOAD = [
    "dpresearch.launch.forkserver_binding",  # first: the server dies with its launcher
    "dpresearch.launch.processes",
    "dpresearch.run.trainer",
    "dpresearch.comm.distributed",
]


@dataclasses.dataclass(frozen=True)
class LaunchContext:
    """What a worker takes over from its launcher: its environment and working directory, and
    (forked workers) the server's environment, to tell what torch's agent added."""

    env: dict[str, str]
    cwd: str
    server_env: dict[str, str] | None = None  # None: a spawned worker, already the launcher's
    server_pid: int | None = None  # the fork server (a forked worker's parent)


# The fork server this process started: (pid, its environment, its standard streams).
_server: tuple[int, dict[str, str], tuple] | None = None


def _streams() -> tuple:
    return tuple((s.st_dev, s.st_ino) for s in (os.fstat(1), os.fstat(2)))


def choose(requested: str) -> tuple[str, LaunchContext]:
    """The start method of this launch (`requested`, or spawn where forking cannot reproduce
    what a spawned worker would see) and the context its workers adopt."""
    context = LaunchContext(dict(os.environ), os.getcwd())
    if requested != "forkserver" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn", context
    server_env = _running_server()
    if server_env is None:
        return "spawn", context
    pid = forkserver._forkserver._forkserver_pid
    return "forkserver", dataclasses.replace(context, server_env=server_env, server_pid=pid)


def _running_server() -> dict[str, str] | None:
    """Start (or restart) this process's fork server; its environment, or None where its
    environment is unknown (started by someone else) or its streams are not this launch's."""
    global _server
    try:
        streams = _streams()
    except OSError:  # a closed standard stream: nothing to compare
        return None
    server = forkserver._forkserver  # (the module keeps one server per process)
    if _server is None and server._forkserver_pid is not None:
        return None  # another part of this process started it, with its own environment
    if _server is None:
        multiprocessing.set_forkserver_preload(PRELOAD)
        atexit.register(_stop)
    server.ensure_running()  # starts it, or restarts it if it died
    if _server is None or _server[0] != server._forkserver_pid:
        _server = (server._forkserver_pid, dict(os.environ), streams)
    return _server[1] if _server[2] == streams else None


def _stop() -> None:
    """At exit: end the server and wait for it, so that it does not outlive this process
    (holding its output pipes open) and its CPU time counts as this process's children's.
    SIGKILL, not its own exit on the closed "alive" pipe: it holds nothing to save, and a clean
    exit finalizes an interpreter with torch loaded, which kept a stopped job waiting ~1.4 s at
    a load of 7 (more under load) before this process could end."""
    server = forkserver._forkserver
    with contextlib.suppress(Exception):  # (a private method of the server: best effort)
        if server._forkserver_pid is not None:
            os.kill(server._forkserver_pid, signal.SIGKILL)
        server._stop()


def adopt(context: LaunchContext | None) -> None:
    """In a worker: take over the launcher's environment (plus what torch's agent set for this
    worker: rank, world size, rendezvous) and working directory; a forked one also lets go of
    the server's "alive" pipe (the server must not outlive the launcher for its workers' sake)."""
    if context is None or context.server_env is None:
        return
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:  # the launcher's end of the server's pipe
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    agent = {k: v for k, v in os.environ.items() if context.server_env.get(k) != v}
    os.environ.clear()
    os.environ.update(context.env)
    os.environ.update(agent)
    os.chdir(context.cwd)
