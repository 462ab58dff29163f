"""Check a data set's files against known MD5s once, and remember that they passed.

`verify_files(folder, official, what)` checks each file of `official` (name → MD5 of the
official release) that exists in `folder` (a missing one is the reader's to report) against,
per file, the first reference that lists it:

1. an `MD5SUMS` file shipped with the data (`md5sum` format, in `folder` or its parent; names
   bare or relative to the MD5SUMS file's directory) — for subsets and variants;
2. the marker of an earlier verification (below) — e.g. written right after a download whose
   archive checksum was verified, so a mirror's archive needs no per-file list;
3. `official`.

A file that does not match raises `ValueError` with one line naming it. When all pass, a
marker (`.dpresearch-verified.json`: each file's size, mtime and MD5, and those of the
MD5SUMS used) is written into `folder` — or, if `folder` is read-only by its mode (a shared
copy), into the user's cache (`$XDG_CACHE_HOME/dpresearch/verified/`). The next load finds the
files as the marker recorded them and reads no byte; any change to a file's size or mtime
makes it hash the files again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

MARKER = ".dpresearch-verified.json"
SUMS = "MD5SUMS"
CHUNK_BYTES = 1 << 20


def md5_of(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _signature(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _read_sums(folder: Path) -> tuple[dict[str, str], list[Path]]:
    """name → MD5 from the MD5SUMS files in `folder` and its parent; and those files."""
    sums: dict[str, str] = {}
    used = []
    for sums_file in (folder.parent / SUMS, folder / SUMS):
        if not sums_file.is_file():
            continue
        used.append(sums_file)
        for line in sums_file.read_text(errors="replace").splitlines():
            parts = line.strip().split(maxsplit=1)
            if len(parts) != 2 or len(parts[0]) != 32:
                continue
            name = parts[1].lstrip("*").removeprefix("./")
            target = (sums_file.parent / name).resolve()
            if target.parent == folder.resolve():
                sums[target.name] = parts[0].lower()
            elif "/" not in name:
                sums.setdefault(name, parts[0].lower())
    return sums, used


def _marker_path(folder: Path) -> Path:
    if folder.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        return folder / MARKER
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha1(str(folder.resolve()).encode(), usedforsecurity=False).hexdigest()
    return cache / "dpresearch" / "verified" / f"{key}.json"


def _read_marker(path: Path) -> dict:
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def write_marker(folder: Path, names: Iterable[str], md5s: Mapping[str, str] | None = None) -> None:
    """Record `names` in `folder` as verified (hashing them unless `md5s` gives their MD5s).
    Best effort: a marker that cannot be written only means hashing again next time."""
    _, sums_files = _read_sums(folder)
    files = {}
    for name in names:
        path = folder / name
        if path.is_file():
            md5 = (md5s or {}).get(name) or md5_of(path)
            files[name] = {"signature": _signature(path), "md5": md5}
    record = {
        "files": files,
        "sums": {str(p): _signature(p) for p in sums_files},
    }
    target = _marker_path(folder)
    with contextlib.suppress(OSError):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, target)


def verify_files(folder: Path, official: Mapping[str, str], what: str) -> None:
    """Raise `ValueError` (one line) if a file of `official` in `folder` has an MD5 its
    reference does not list; see the module docstring."""
    folder = Path(folder)
    names = [n for n in official if (folder / n).is_file()]
    marker = _read_marker(_marker_path(folder))
    sums, sums_files = _read_sums(folder)
    recorded = marker.get("files", {})
    sums_unchanged = marker.get("sums", {}) == {str(p): _signature(p) for p in sums_files}
    if sums_unchanged and all(
        n in recorded and recorded[n].get("signature") == _signature(folder / n) for n in names
    ):
        return
    md5s = {}
    for name in names:
        path = folder / name
        if name in sums:
            expected, source = sums[name], f"the MD5SUMS beside {folder}"
        elif name in recorded:
            expected, source = recorded[name].get("md5"), "its verified download"
        else:
            expected, source = official[name], f"the official {what} release"
        md5s[name] = md5_of(path)
        if md5s[name] != expected:
            raise ValueError(
                f"{what} file {path} is corrupt or changed: MD5 {md5s[name]}, expected "
                f"{expected} ({source}); delete {folder} and pass data.download=true to fetch "
                "it again (a deliberate variant: add an MD5SUMS, or pass data.verify=false)"
            )
    write_marker(folder, names, md5s)
