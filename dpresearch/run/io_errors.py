"""A run's write failures — a full disk, a quota, an I/O error, a read-only file system — end
it cleanly, in one line, not in a traceback.

Every write into the run directory while a run trains (a metrics line, a checkpoint, the
summary, the final model) goes through `writing(path, needed)`, which turns the operating
system's failure (an `OSError`, or torch's `RuntimeError` around one) into `RunIOError`: the
path, the bytes the write needed and the bytes free there. The writer's loop ends the run at
the next step boundary, every process together; the summary (if it still fits) says
`status: failed_io` with the last good checkpoint, and the entry point prints one line
(`RunIOError.line`) and exits `IO_EXIT`. A checkpoint that could not be written leaves no
temporary file and `latest` naming the previous one (an atomic write), so once there is room
`train.resume=auto` continues from there.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

# What a write can fail with that is the machine's, not the program's.
IO_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for its file system",
    errno.EROFS: "read-only file system",
    errno.EIO: "input/output error",
}
IO_EXIT = 74  # sysexits.h EX_IOERR
# Below this, a run is refused before it starts (its config, log and first metrics need room).
MIN_FREE_BYTES = 256_000


class RunIOError(Exception):
    """A write into the run directory failed; `line()` is what the user reads."""

    def __init__(self, path: Path, reason: str, needed: int | None, free: int | None) -> None:
        super().__init__(f"{reason} writing {path}")
        self.path, self.reason, self.needed, self.free = Path(path), reason, needed, free

    def describe(self) -> str:
        """`<reason> writing <path> (needs about X MB, Y MB free there)`."""
        room = []
        if self.needed:
            room.append(f"needs about {_mb(self.needed)}")
        if self.free is not None:
            room.append(f"{_mb(self.free)} free there")
        return f"{self.reason} writing {self.path}" + (f" ({', '.join(room)})" if room else "")


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.3g} MB" if nbytes >= 100_000 else f"{nbytes / 1e3:.3g} kB"


def io_reason(exc: BaseException) -> str | None:
    """The machine's reason behind `exc` (itself or what it was raised from or during), or
    None for an error that is not a failed write."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in IO_ERRNOS:
            return IO_ERRNOS[exc.errno]
        exc = exc.__cause__ or exc.__context__
    return None


def free_bytes(path: Path) -> int | None:
    """Bytes free to this user on `path`'s file system (its nearest existing folder)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


@contextlib.contextmanager
def writing(path: Path, needed: int | None = None) -> Iterator[None]:
    """Raise `RunIOError` for a write to `path` that the machine refused (see `io_reason`);
    `needed`: the bytes the write needs (for the message)."""
    try:
        yield
    except RunIOError:
        raise
    except Exception as exc:
        reason = io_reason(exc)
        if reason is None:
            raise
        raise RunIOError(Path(path), reason, needed, free_bytes(Path(path).parent)) from exc
