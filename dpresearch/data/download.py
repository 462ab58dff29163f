"""Download and extract a data-set archive, all or nothing.

Contract of `ensure_extracted(root, archive)`: afterwards `<root>/<archive.folder>` exists and holds
the archive's extracted contents; it returns that path. If the folder is already there nothing is
downloaded. Otherwise the archive is streamed into a temporary directory inside `root`, its MD5 is
checked, its members are checked to stay inside the extraction directory (no absolute paths, no
`..`, no links or device files), it is extracted there, its files are recorded as verified
(`verify.write_marker`: the archive's checksum vouches for them), and the folder is moved into
place with one `os.replace`. Any failure — network error, short read, a download still running
at its overall deadline (`deadline_s`), wrong checksum, unsafe member, Ctrl-C, SIGTERM — removes
the temporary directory and any directory it created, so the file system is left as it was: no
archive, no partial folder, no new `root`. (A process killed with SIGKILL can leave a
`.<folder>.tmp-*` directory behind; it is never read and can be deleted.)
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import signal
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from dpresearch.data.verify import write_marker

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Archive:
    """Where a data set's archive lives (`url`), its MD5, the top-level folder it holds, and
    the MD5 of each file of that folder in the official release (`files`)."""

    name: str
    url: str
    md5: str
    folder: str
    files: dict[str, str] = field(default_factory=dict, hash=False)


# Per-file MD5s as published with the archives (the same values torchvision checks).
CIFAR10_ARCHIVE = Archive(
    name="CIFAR-10",
    url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    md5="c58f30108f718f92721af3b95e74349a",
    folder="cifar-10-batches-py",
    files={
        "data_batch_1": "c99cafc152244af753f735de768cd75f",
        "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
        "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
        "data_batch_4": "634d18415352ddfa80567beed471001a",
        "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
        "test_batch": "40351d587109b95175f43aff81a1287e",
        "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
    },
)
CIFAR100_ARCHIVE = Archive(
    name="CIFAR-100",
    url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    md5="eb9058c3a382ffc7106e4002c42a8d85",
    folder="cifar-100-python",
    files={
        "train": "16019d7e3df5f24257cddd939b257f8d",
        "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
        "meta": "7973b15100ade9c7d40fb424638fde48",
    },
)


class DownloadInterrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) arrived during a download; what it had written is removed."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} during the download")
        self.signum = signum


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM raises (as SIGINT does) for the duration, so cleanup runs; the previous handlers
    are restored after. Only the main thread can handle signals: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise DownloadInterrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _missing_ancestors(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def ensure_extracted(
    root: str | os.PathLike[str],
    archive: Archive,
    url: str | None = None,
    md5: str | None = None,
    timeout_s: float = 60.0,
    deadline_s: float | None = None,
) -> Path:
    """`<root>/<archive.folder>`, downloading and extracting the archive first if it is absent.

    `url` / `md5` override the archive's (for mirrors, and for tests with a local server);
    `timeout_s` bounds each network read, `deadline_s` the whole download (None: no bound)."""
    root = Path(root).expanduser()
    target = root / archive.folder
    if target.is_dir():
        return target
    url = url or archive.url
    md5 = (md5 or archive.md5).lower()
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    created = _missing_ancestors(root)
    staging = None
    done = False
    try:
        with _signals_raise():
            root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{archive.folder}.tmp-", dir=root))
            tarball = staging / "archive.tar.gz"
            log.info("downloading %s from %s", archive.name, url)
            digest = fetch(url, tarball, timeout_s, archive.name, deadline)
            if digest != md5:
                raise ValueError(
                    f"{archive.name} archive from {url} has MD5 {digest}, expected {md5}: the "
                    "download is corrupt or the URL serves another file; retry, or download and "
                    f"extract it yourself under {root}"
                )
            extracted = staging / "extracted"
            safe_extract(tarball, extracted, archive.name)
            if not (extracted / archive.folder).is_dir():
                raise ValueError(
                    f"{archive.name} archive from {url} holds no {archive.folder}/ folder: the "
                    "URL serves another file; check the URL"
                )
            write_marker(extracted / archive.folder, archive.files)
            try:
                os.replace(extracted / archive.folder, target)
            except OSError:
                # Another process (another rank on this machine) finished first: its copy is as
                # good.
                if not target.is_dir():
                    raise
            done = True
        log.info("%s extracted to %s", archive.name, target)
        return target
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if not done:
            for path in created:  # deepest first; only if still empty
                try:
                    path.rmdir()
                except OSError:
                    break


class DeadlineExceeded(OSError):
    """The download was still running at its overall deadline."""


def fetch(url: str, dest: Path, timeout_s: float, what: str, deadline: float | None = None) -> str:
    """Stream `url` into `dest`; returns the MD5 hex digest of what was written.

    `timeout_s` bounds each network wait; `deadline` (a `time.monotonic()` instant) the whole
    transfer: each read returns what has arrived (`read1`), so a server that drips bytes is
    stopped at the deadline rather than kept alive by each byte."""
    digest = hashlib.md5(usedforsecurity=False)

    def wait_s() -> float:
        if deadline is None:
            return timeout_s
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("not finished by its deadline, data.download_timeout_s")
        return min(timeout_s, left)

    try:
        with urllib.request.urlopen(url, timeout=wait_s()) as response, open(dest, "wb") as out:
            expected = response.headers.get("Content-Length")
            size = 0
            while True:
                wait_s()
                chunk = response.read1(CHUNK_BYTES)
                if not chunk:
                    break
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as err:
        # HTTPError's str carries the status code; other URLErrors wrap the socket error.
        detail = err if isinstance(err, urllib.error.HTTPError) else getattr(err, "reason", err)
        reason = (str(detail) or type(err).__name__).splitlines()[0]
        raise ConnectionError(
            f"could not download {what} from {url} ({reason}); check the network or the URL, "
            "or download and extract the archive yourself"
        ) from err
    if expected is not None and size != int(expected):
        raise ConnectionError(
            f"download of {what} from {url} stopped after {size} of {expected} bytes "
            "(connection dropped); retry"
        )
    return digest.hexdigest()


def safe_extract(tarball: Path, dest: Path, what: str) -> None:
    """Extract `tarball` into `dest`, refusing any member that could land outside `dest`
    (absolute path, `..`) or that is not a plain file or directory (links, devices)."""
    dest.mkdir()
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            members = tar.getmembers()
            for member in members:
                path = PurePosixPath(member.name)
                regular = member.isfile() or member.isdir()
                if path.is_absolute() or ".." in path.parts or not regular:
                    raise ValueError(
                        f"{what} archive holds an unsafe member {member.name!r} (absolute path, "
                        "'..', link or device); refusing to extract it — check the URL"
                    )
            # The "data" filter (Python 3.12, backported to 3.10.12/3.11.4) re-checks the same
            # and also drops setuid bits; older Pythons rely on the checks above.
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, members=members, filter="data")
            else:
                tar.extractall(dest, members=members)
    except (tarfile.TarError, EOFError, OSError) as err:
        raise ValueError(
            f"{what} archive could not be extracted ({err}); the download is corrupt, retry"
        ) from err
