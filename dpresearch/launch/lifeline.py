"""A worker process never outlives the process that launched it.

The launcher (`launch.launch_local`, or torchrun's agent) holds the run directory's lock for
its workers; once it is gone, whatever killed it, the lock is free and the directory may be
another process's. A worker left running would go on training and writing into it, and torch's
elastic workers would then wait forever for a launcher that will never read their results. So
every worker is bound to its launcher:

- on Linux, `bind_to_launcher` asks the kernel for SIGKILL at the launcher's death
  (`prctl(PR_SET_PDEATHSIG)`; torch's spawn asks for SIGINT, which a background job ignores
  and which the training loop would take for a stop request: a checkpoint written into a
  directory whose lock is gone), then checks the launcher is still its parent (it may have
  died before the request);
- elsewhere, a daemon thread checks its parent twice a second and kills the process when the
  parent changed;
- `check_launcher()`, called by the writer before it writes into the run directory, ends the
  process if the launcher is gone (the moment between the launcher's death and the kernel's
  signal).

SIGKILL, not a clean stop: the run is left as a kill -9 leaves it (its last checkpoint and the
`metrics.jsonl` lines after it, which `train.resume=auto` cuts back), and nothing is written
after the lock was released.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

LAUNCHER_ENV = "DPRESEARCH_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1
POLL_S = 0.5

_launcher: int | None = None


def launcher_environment() -> dict[str, str]:
    """What a launcher puts in its workers' environment (its own pid)."""
    return {LAUNCHER_ENV: str(os.getpid())}


def bind_to_launcher(launcher: int | None = None) -> None:
    """Die with `launcher` (default: the pid in `LAUNCHER_ENV`, else this process's parent);
    ends this process at once if the launcher is already gone."""
    global _launcher
    if launcher is None:
        launcher = int(os.environ.get(LAUNCHER_ENV) or os.getppid())
    _launcher = launcher
    if not _ask_kernel():
        threading.Thread(target=_watch_parent, name="dpresearch-lifeline", daemon=True).start()
    check_launcher()


def check_launcher() -> None:
    """End this process (SIGKILL) if it was bound to a launcher that is gone."""
    if _launcher is not None and os.getppid() != _launcher:
        _die()


def _ask_kernel() -> bool:
    """SIGKILL at the parent's death (Linux); False where the kernel cannot do it."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    return False


def _watch_parent() -> None:  # pragma: no cover - the fallback off Linux
    while True:
        check_launcher()
        threading.Event().wait(POLL_S)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
