"""Download and extract a data-set archive, all or nothing.

Contract of `ensure_extracted(root, archive)`: afterwards `<root>/<archive.folder>` exists and holds
the archive's extracted contents; it returns that path. If the folder is already there nothing is
downloaded. Otherwise the archive is streamed into a temporary directory inside `root`, its MD5 is
checked, its members are checked to stay inside the extraction directory (no absolute paths, no
`..`, no links or device files), it is extracted there, and the folder is moved into place with
one `os.replace`. Any failure — network error, short read, wrong checksum, unsafe member, Ctrl-C —
removes the temporary directory, so `root` is left as it was: no archive, no partial folder.
(A process killed with SIGKILL can leave a `.<folder>.tmp-*` directory behind; it is never read
and can be deleted.)
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Archive:
    """Where a data set's archive lives (`url`), its MD5, and the top-level folder it holds."""

    name: str
    url: str
    md5: str
    folder: str


CIFAR10_ARCHIVE = Archive(
    name="CIFAR-10",
    url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    md5="c58f30108f718f92721af3b95e74349a",
    folder="cifar-10-batches-py",
)
CIFAR100_ARCHIVE = Archive(
    name="CIFAR-100",
    url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    md5="eb9058c3a382ffc7106e4002c42a8d85",
    folder="cifar-100-python",
)


def ensure_extracted(
    root: str | os.PathLike[str],
    archive: Archive,
    url: str | None = None,
    md5: str | None = None,
    timeout_s: float = 60.0,
) -> Path:
    """`<root>/<archive.folder>`, downloading and extracting the archive first if it is absent.

    `url` / `md5` override the archive's (for mirrors, and for tests with a local server)."""
    root = Path(root).expanduser()
    target = root / archive.folder
    if target.is_dir():
        return target
    url = url or archive.url
    md5 = (md5 or archive.md5).lower()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{archive.folder}.tmp-", dir=root))
    try:
        tarball = staging / "archive.tar.gz"
        log.info("downloading %s from %s", archive.name, url)
        digest = fetch(url, tarball, timeout_s, archive.name)
        if digest != md5:
            raise ValueError(
                f"{archive.name} archive from {url} has MD5 {digest}, expected {md5}: the download "
                "is corrupt or the URL serves another file; retry, or download and extract it "
                f"yourself under {root}"
            )
        extracted = staging / "extracted"
        safe_extract(tarball, extracted, archive.name)
        if not (extracted / archive.folder).is_dir():
            raise ValueError(
                f"{archive.name} archive from {url} holds no {archive.folder}/ folder: the URL "
                "serves another file; check the URL"
            )
        try:
            os.replace(extracted / archive.folder, target)
        except OSError:
            # Another process (another rank on this machine) finished first: its copy is as good.
            if not target.is_dir():
                raise
        log.info("%s extracted to %s", archive.name, target)
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fetch(url: str, dest: Path, timeout_s: float, what: str) -> str:
    """Stream `url` into `dest`; returns the MD5 hex digest of what was written."""
    digest = hashlib.md5(usedforsecurity=False)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response, open(dest, "wb") as out:
            expected = response.headers.get("Content-Length")
            size = 0
            while chunk := response.read(CHUNK_BYTES):
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
