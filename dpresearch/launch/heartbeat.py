"""Liveness of the worker processes this machine's launcher started.

Each worker process runs a daemon thread (`Heartbeat`) that rewrites its file
`<directory>/worker-<rank>` (holding its pid) every quarter of `heartbeat_s`, and deletes it when
the worker's work ends, however it ends short of being killed. The launcher runs a
`Watchdog` thread that reads those files: a worker whose file has not changed for `heartbeat_s`
is stopped (SIGSTOP), frozen, or starved so badly it cannot run a thread; the watchdog kills it
with SIGKILL (the one signal a stopped process obeys), and the launcher then stops the job as for
any failed worker. Collectives alone would wait `backend.timeout_s` (600 s by default) and the
elastic agent another 30 s for the stopped process to obey SIGTERM.

A worker counts only once it has written its first beat, so a slow start is never judged; a
worker that has died (its file left behind by SIGKILL) is the launcher's ordinary failure, not
a frozen one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "worker-"


def beat_interval(heartbeat_s: float) -> float:
    return min(max(heartbeat_s / 4, 0.2), 10.0)


class Heartbeat:
    """This process's heartbeat as worker `rank` (a context manager: beats while inside)."""

    def __init__(self, directory: Path, rank: int, heartbeat_s: float) -> None:
        self.path = Path(directory) / f"{PREFIX}{rank}"
        self.interval = beat_interval(heartbeat_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="dpresearch-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def _beat(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        while True:
            try:
                tmp.write_text(str(os.getpid()))
                os.replace(tmp, self.path)  # a fresh mtime, and never a half-written pid
            except OSError:
                return  # the launcher removed the directory: the job is over
            if self._stop.wait(self.interval):
                return


def _stopped_or_running(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child the launcher has yet to reap)."""
    if not Path("/proc/self/stat").exists():  # no procfs: existence is all we can tell
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def silent_deaths(directory: Path) -> list[tuple[int, int]]:
    """(rank, pid) of every worker whose heartbeat file is left behind by a process that is
    gone, the first to stop beating first: a worker that raised or returned removed its file on
    the way out (`Heartbeat.__exit__`), so one left by a dead process died without unwinding —
    killed by a signal (SIGKILL) or crashed."""
    found = []
    for path in Path(directory).glob(f"{PREFIX}*"):
        try:
            pid, when = int(path.read_text()), path.stat().st_mtime_ns
        except (OSError, ValueError):
            continue
        if not _stopped_or_running(pid):
            found.append((when, int(path.name[len(PREFIX) :]), pid))
    return [(rank, pid) for _, rank, pid in sorted(found)]


@dataclass(frozen=True)
class Frozen:
    """A worker the watchdog found silent (and killed)."""

    rank: int
    pid: int
    silent_s: float

    def message(self, heartbeat_s: float, who: str = "worker") -> str:
        """One line; `who` names what a rank is (`worker`, or `rank` where ranks are not
        workers, e.g. beside a parameter server)."""
        return (
            f"{who} {self.rank} (pid {self.pid}) showed no sign of life for "
            f"{self.silent_s:.0f} s (stopped or frozen; backend.heartbeat_s={heartbeat_s:g}); "
            "it was killed and the job stopped"
        )


class Watchdog:
    """Watches `directory`'s heartbeat files from a daemon thread; `frozen` is set (and the
    worker killed) when one goes silent for `heartbeat_s`. `stop()` ends the thread."""

    def __init__(self, directory: Path, heartbeat_s: float) -> None:
        self.directory, self.heartbeat_s = Path(directory), heartbeat_s
        self.frozen: Frozen | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dpresearch-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(beat_interval(self.heartbeat_s) / 2):
            for path in self.directory.glob(f"{PREFIX}*"):
                if path.suffix == ".tmp":
                    continue
                try:
                    silent_s = time.time() - path.stat().st_mtime
                    pid = int(path.read_text())
                except (OSError, ValueError):
                    continue
                if silent_s > self.heartbeat_s and _stopped_or_running(pid):
                    self.frozen = Frozen(int(path.name[len(PREFIX) :]), pid, silent_s)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    return
