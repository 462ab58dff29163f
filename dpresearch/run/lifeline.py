"""A worker process never outlives the process that launched it, nor writes after its lock.

The launcher (`launch.launch_local`, or torchrun's agent) holds the run directory's lock for
its workers; once it is gone, whatever killed it, the lock is free and the directory may be
another process's. A worker left running would go on training and writing into it, and torch's
elastic workers would then wait forever for a launcher that will never read their results. So
every worker is bound to its launcher — the launcher itself, not its parent: a forked worker's
parent is the fork server (`dpresearch/launch/forkserver.py`), which must not decide when it dies:

- `bind_to_launcher` opens a pidfd on the launcher (`pidfd_open`: the launcher named by pid and
  start time in `LAUNCHER_ENV`, so a reused pid is never mistaken for it) and a daemon thread
  waits on it: the moment the launcher has exited, the thread SIGKILLs this process. Its poll
  releases the GIL, and torch's ops release it too, so the thread runs within milliseconds;
  without pidfds (old kernels, off Linux) the thread polls the launcher twice a second;
- on Linux the kernel is also asked for SIGKILL at the parent's death (`PR_SET_PDEATHSIG`;
  torch's spawn asks for SIGINT, which a background job ignores and which the training loop
  would take for a stop request: a checkpoint written into a directory whose lock is gone).
  For a spawned worker the parent is the launcher; for a forked one it is the fork server,
  which is itself bound to the launcher (`dpresearch/launch/forkserver_binding.py`, imported
  by the server at its start) and so dies with it;
- `check_launcher()`, called by the writer before every write into the run directory, ends the
  process if the launcher is gone or if the run directory's lock (`guard_run_dir`) is no longer
  held by the launcher (or by this process, a torchrun rank 0 that claimed it itself): the
  kernel drops the lock a moment before it reports the launcher's exit, so the lock itself is
  checked, not only the launcher.

SIGKILL, not a clean stop: the run is left as a kill -9 leaves it (its last checkpoint and the
`metrics.jsonl` lines after it, which `train.resume=auto` cuts back), and nothing is written
after the lock was released.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import sys
import threading
from pathlib import Path

LAUNCHER_ENV = "DPRESEARCH_LAUNCHER_PID"  # "<pid>:<start time>" of the launcher
PR_SET_PDEATHSIG = 1
POLL_S = 0.5
LOCK_NAME = ".lock"  # (launch.run_dir's; not imported: this module stays free of the config)

_launcher: int | None = None
_started: str | None = None  # the launcher's start time (/proc), None where unknown
_pidfd: int | None = None
_lock: Path | None = None  # the run directory's lock file the launcher holds
_binding = 0  # which binding the lifeline thread serves (a re-bound process starts another)


def launcher_environment() -> dict[str, str]:
    """What a launcher puts in its workers' environment (its own pid and start time)."""
    return {LAUNCHER_ENV: f"{os.getpid()}:{_start_time(os.getpid()) or ''}"}


def bind_to_launcher(launcher: int | None = None, kernel: bool = True) -> None:
    """Die with `launcher` (default: the one in `LAUNCHER_ENV`, else this process's parent);
    ends this process at once if the launcher is already gone. `kernel`: also ask for SIGKILL
    at the parent's death (the fork server does not: the kernel ties that to the *thread* that
    started it, and the server outlives the launch that started it)."""
    global _launcher, _started, _pidfd, _binding
    started = None
    if launcher is None:
        pid, _, started = os.environ.get(LAUNCHER_ENV, "").partition(":")
        launcher = int(pid) if pid.isdigit() else os.getppid()
    parent = os.getppid()
    if _pidfd is not None:  # inherited (a worker forked from a bound server): not ours
        with contextlib.suppress(OSError):
            os.close(_pidfd)
        _pidfd = None
    _launcher, _started = launcher, started or _start_time(launcher)
    if kernel:
        _ask_kernel()
    _pidfd = _open_pidfd(launcher)
    if _pidfd is not None and not _same_launcher(parent):
        os.close(_pidfd)
        _pidfd = None
        _die()  # the pid is no longer (or was never) the launcher's: it is gone
    _binding += 1
    threading.Thread(
        target=_watch, args=(_pidfd, _binding), name="dpresearch-lifeline", daemon=True
    ).start()
    check_launcher()


def guard_run_dir(run_dir: str | os.PathLike[str]) -> None:
    """In a bound process: from now on `check_launcher` also checks that `run_dir`'s lock is
    still held by the launcher (or this process). No-op where unbound or unlocked."""
    global _lock
    lock = Path(run_dir) / LOCK_NAME
    if _launcher is not None and lock.is_file():
        _lock = lock


def check_launcher() -> None:
    """End this process (SIGKILL) if it was bound to a launcher that is gone, or the run
    directory's lock is no longer its launcher's."""
    if _launcher is None:
        return
    if not _launcher_alive() or (_lock is not None and not _lock_held(_lock)):
        _die()


def _launcher_alive() -> bool:
    if _pidfd is not None:
        try:
            return not select.select([_pidfd], [], [], 0)[0]  # readable: the process exited
        except (OSError, ValueError):
            return False
    started = _start_time(_launcher)
    if started is None:  # no procfs: existence is all we can tell
        try:
            os.kill(_launcher, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return os.getppid() != 1
    return started == _started and _state(_launcher) not in ("Z", "X")


def _lock_held(lock: Path) -> bool:
    """Someone holds `lock` (a shared lock cannot be had) and the file names the launcher or
    this process as the holder."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # released (a clean release deletes the file)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").split()
            return len(holder) >= 2 and holder[1] in (str(_launcher), str(os.getpid()))
        return False  # free: whoever held it is gone (this process dies holding it a moment)
    finally:
        os.close(fd)


def _open_pidfd(pid: int) -> int | None:
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        _die()
    except OSError:  # (a kernel without pidfds, a sandbox refusing them)
        return None
    return None


def _same_launcher(parent: int) -> bool:
    """The process behind the pidfd just opened is the launcher: its start time is the one
    its environment named, or (none named) it is still this process's parent."""
    if _started is not None:
        return _start_time(_launcher) == _started
    return os.getppid() == parent == _launcher


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _state(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[0] if fields else None


def _ask_kernel() -> bool:
    """SIGKILL at the parent's death (Linux); False where the kernel cannot do it."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    return False


def _watch(pidfd: int | None, binding: int) -> None:
    """The lifeline thread: wait for the launcher's exit (pidfd) or poll for it; then die."""
    while binding == _binding:
        if pidfd is not None:
            try:
                select.select([pidfd], [], [])
            except InterruptedError:
                continue
            except (OSError, ValueError):  # (closed by a re-binding)
                pidfd = None
                continue
        else:
            threading.Event().wait(POLL_S)
        if binding == _binding and not _launcher_alive():
            _die()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
