"""One run, one directory: claiming a run directory before anything is written into it.

`claim_run_dir(path)` creates `path` if needed, takes an exclusive lock on `path/.lock`
(`flock`, held by this process; the kernel drops it when the process ends, however it ends) and
refuses a directory that already holds a run's outputs, so two runs never write into one
directory and a re-run never appends to another run's `metrics.jsonl`. The lock file records the
holder's pid and host; a clean release deletes it, a killed holder leaves an unlocked file that
the next claim takes over. A resumed run (`train.resume`) claims with `resume=True`, which
accepts the run's own outputs but not a live writer.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import socket
import threading
from pathlib import Path

from dpresearch.errors import ConfigError

LOCK_NAME = ".lock"
# A run directory holding any of these belongs to a run that has started.
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "model_final.pt")


def holds_run(path: Path) -> str | None:
    """The first of the run outputs present in `path`, or None."""
    return next((name for name in RUN_OUTPUTS if (path / name).exists()), None)


class RunDirClaim:
    """This process's exclusive claim on one run directory (a context manager; reentrant)."""

    def __init__(self, path: Path, fd: int, created: list[Path] | None = None) -> None:
        self.path, self._fd, self._holds = path, fd, 1
        self.created = created or []  # the folders the claim made, deepest first

    def __enter__(self) -> RunDirClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Drop one hold; the last one deletes the lock file and unlocks."""
        with _LOCK:
            self._holds -= 1
            if self._holds > 0 or self._fd < 0:
                return
            _HELD.pop(self.path, None)
            with contextlib.suppress(OSError):
                os.unlink(self.path / LOCK_NAME)
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1

    def abandon(self) -> None:
        """Release, and remove the folders the claim created (a run refused after its claim
        leaves no directory behind)."""
        self.release()
        if self._fd < 0:
            for folder in self.created:
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only if empty: never anything a run wrote


_HELD: dict[Path, RunDirClaim] = {}
_LOCK = threading.RLock()


@atexit.register
def _release_all() -> None:
    """A clean exit leaves no lock files (a killed process leaves an unlocked one)."""
    for claim in list(_HELD.values()):
        claim._holds = 1
        claim.release()


def claim_run_dir(
    path: str | os.PathLike[str], resume: bool = False, what: str = ""
) -> RunDirClaim:
    """Claim `path` for one run, or raise `ConfigError` naming the fix.

    `what` names the setting that chose the directory in messages (default
    `hydra.run.dir=<path>`). A directory this process already holds is returned again (one more
    hold; `release` as often as claimed). Creating the directory is the only side effect of a
    refusal, and only when it is the lock that refuses (the directory then exists anyway)."""
    path = Path(path).resolve()
    what = what or f"hydra.run.dir={path}"
    with _LOCK:
        held = _HELD.get(path)
        if held is not None:
            held._holds += 1
            return held
        existed = path.is_dir()
        created = [p for p in (path, *path.parents) if not p.exists()]
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = _open_lock(path)
        except OSError as exc:
            raise ConfigError(
                f"{what} cannot be written ({exc.strerror or exc}); pass a writable "
                "hydra.run.dir (or hydra.sweep.dir for -m)"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(
                f"{what} is being written by another run ({holder}); pass a new directory"
            ) from None
        if not _still_linked(fd, path):  # a releasing holder deleted the file we opened
            os.close(fd)
            return claim_run_dir(path, resume, what)
        outputs = holds_run(path) if existed and not resume else None
        if outputs is not None:
            with contextlib.suppress(OSError):
                os.unlink(path / LOCK_NAME)  # while still locked: never another claimant's file
            os.close(fd)
            raise ConfigError(
                f"{what} already holds another run ({outputs}); pass a new directory (or leave "
                "it out for a fresh one), or train.resume=auto to continue that run"
            )
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        claim = RunDirClaim(path, fd, created)
        _HELD[path] = claim
        return claim


def _open_lock(path: Path) -> int:
    return os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"


def _still_linked(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path / LOCK_NAME).st_ino
    except OSError:
        return False
