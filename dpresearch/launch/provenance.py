"""`provenance.json`: what produced a run, written into its directory when the run starts.

Holds the code (git commit of the dpresearch checkout and whether it had uncommitted changes;
null for an installed wheel or outside a git checkout), the versions of Python and the packages
that shape results, the host, the command line (the one that started the process, and for a
sweep point the overrides that made this point), the working directory and the start time
(UTC).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from dpresearch import SOURCE_ROOT, __version__

PACKAGES = ("dpresearch", "torch", "numpy", "hydra-core", "omegaconf", "wandb", "torchvision")
# The command line of the process the user started; set by the entry point, inherited by
# parallel sweep workers, whose own argv is their pool's.
COMMAND_ENV = "DPRESEARCH_COMMAND"


def remember_command(argv: Sequence[str]) -> None:
    """Record the user's command line for this process and the processes it starts."""
    os.environ[COMMAND_ENV] = shlex.join(argv)


def _git(*args: str) -> str | None:
    if SOURCE_ROOT is None:  # an installed wheel: no checkout to describe
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(SOURCE_ROOT), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def collect(overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The provenance record of a run started now with `overrides`."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        if name == "dpresearch":  # the code that runs (an editable install's metadata may lag)
            versions[name] = __version__
            continue
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "git": {
            "commit": commit,
            "dirty": bool(status) if commit else None,
            "repo": str(SOURCE_ROOT) if SOURCE_ROOT else None,
        },
        "versions": versions,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "command": os.environ.get(COMMAND_ENV) or shlex.join([sys.executable, *sys.argv]),
        "overrides": list(overrides),
        "cwd": os.getcwd(),
        "pid": os.getpid(),
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_provenance(run_dir: Path, overrides: Sequence[str] = ()) -> Path:
    """Write `run_dir/provenance.json`; returns its path."""
    from dpresearch.run.io_errors import writing

    path = Path(run_dir) / "provenance.json"
    with writing(path):
        path.write_text(json.dumps(collect(overrides), indent=2) + "\n")
    return path
