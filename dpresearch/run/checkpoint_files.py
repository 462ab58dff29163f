"""Checkpoint files: atomic writes, the `latest` pointer, keeping the last N, finding what to
resume, and the checkpoint interval.

Layout inside a run directory::

    checkpoints/step_<N>.pt   one file per checkpoint: the state of every process of the run
    checkpoints/latest        text: the file name of the newest *complete* checkpoint

A checkpoint is written to a temporary file in the same directory, flushed and fsynced, and
renamed into place (`os.replace`, atomic on POSIX); only then is `latest` rewritten the same
way, so `latest` never names a partial file and a crash at any moment leaves the previous
checkpoint intact. Under real processes rank 0 gathers every rank's state (a collective) and is
the only writer, so a file that exists holds every rank (see `checkpoint_state.Checkpoints`). Older
checkpoints beyond `keep` are deleted after the pointer moved.

What a checkpoint holds is the run's business (`checkpoint_state.Checkpoints`); this module
only moves files.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from dpresearch.run.io_errors import writing

CHECKPOINTS = "checkpoints"
LATEST = "latest"
# 2: each process's state by part (`Run.STATEFUL`); 3: plain data only (tensors, dicts, lists,
# numbers, strings), read with weights_only=True.
FORMAT = 3
_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")
_INTERVAL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ep|epoch|epochs|steps?)?\s*$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be found or used; the message is one line naming the fix."""


def checkpoint_interval(value: Any, steps_per_epoch: int) -> int:
    """`train.checkpoint_every` in steps: an integer (steps), `"<n>ep"` (epochs; may be
    fractional, at least one step) or `"<n>steps"`; 0, null or "" mean off (returns 0).
    Raises `CheckpointError` for anything else, negative values included."""
    if value is None:
        return 0
    text = str(value).strip().lower()
    if text in ("", "0", "off", "none", "null"):
        return 0
    match = _INTERVAL.match(text)
    if match is None:
        raise CheckpointError(
            f"train.checkpoint_every={value}: use a number of steps (e.g. 500), epochs "
            "(e.g. 1ep) or 0 (off)"
        )
    amount, unit = float(match.group(1)), match.group(2) or "steps"
    if unit.startswith("ep"):
        return max(1, round(amount * steps_per_epoch)) if amount > 0 else 0
    if amount != int(amount):
        raise CheckpointError(f"train.checkpoint_every={value}: a number of steps is whole")
    return int(amount)


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call `write` on a temporary file in `path`'s directory, flush, fsync, rename it to
    `path` and fsync the directory: `path` is either absent, the old file, or the complete new
    one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_save(obj: Any, path: Path) -> None:
    """`torch.save(obj)` to `path` atomically (see `_atomic_write`)."""
    _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (see `_atomic_write`)."""
    _atomic_write(path, lambda f: f.write(text.encode()))


def write_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write `state` as checkpoint `step` of `run_dir`, point `latest` at it, delete all but
    the newest `keep` (at least 1); returns the file's path."""
    from dpresearch.run.lifeline import check_launcher

    check_launcher()  # a worker whose launcher (holding the run's lock) died writes nothing
    folder = checkpoint_dir(run_dir)
    path = folder / f"step_{step}.pt"
    # A full disk or an I/O error: `RunIOError`, with no temporary file left and `latest`
    # still naming the previous checkpoint (the atomic write).
    needed = check_plain(state)
    previous = latest_checkpoint(run_dir)  # the same run: about the same size
    with contextlib.suppress(OSError):
        needed = max(needed, previous.stat().st_size) if previous is not None else needed
    with writing(path, needed):
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(".*.tmp"):  # left by a writer killed mid-write (we hold it)
            with contextlib.suppress(OSError):
                stale.unlink()
        atomic_save(state, path)
    with writing(folder / LATEST):
        atomic_write_text(folder / LATEST, path.name + "\n")
    for old in checkpoint_files(folder)[: -max(1, keep)]:
        if old != path:
            with contextlib.suppress(OSError):
                old.unlink()
    return path


def checkpoint_files(folder: Path) -> list[Path]:
    """The `step_<N>.pt` files in `folder`, oldest (smallest N) first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_FILE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint `latest` names in `run_dir`, or None."""
    pointer = checkpoint_dir(run_dir) / LATEST
    try:
        name = pointer.read_text().strip()
    except OSError:
        return None
    path = pointer.parent / name
    return path if name and _STEP_FILE.match(name) and path.is_file() else None


def find_resume(resume: str | None, run_dir: Path | None) -> Path | None:
    """The checkpoint `train.resume` names: None → None; "auto" → the latest complete one in
    `run_dir` (None if there is none: start fresh); a checkpoint file → it; a run directory (or
    its `checkpoints/`) → its latest. Raises `CheckpointError` for a path holding none."""
    if resume is None or str(resume).strip() == "":
        return None
    if str(resume) == "auto":
        return latest_checkpoint(run_dir) if run_dir is not None else None
    path = Path(str(resume)).expanduser()
    if path.is_file():
        return path.resolve()
    if not path.exists():
        raise CheckpointError(
            f"train.resume={resume}: no such file or directory; pass auto, a checkpoint file "
            "or a run directory holding checkpoints/"
        )
    if path.name == CHECKPOINTS:
        path = path.parent
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(
            f"train.resume={resume}: no complete checkpoint there (checkpoints/latest); "
            "pass a checkpoint file, or train.resume=auto to start fresh where there is none"
        )
    return found.resolve()


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint file belongs to (`<run>/checkpoints/step_N.pt`), or
    None for a file kept elsewhere."""
    checkpoint = Path(checkpoint).resolve()
    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else None


def load_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint file (tensors onto the CPU; `mmap`: memory-mapped, read from disk only
    where touched) without running anything it names (see `_safe_load`). Raises
    `CheckpointError` (one line) for a file that is not one of ours."""
    return _checked(_safe_load(path, mmap=mmap), path)


def load_model_file(path: Path) -> dict[str, torch.Tensor]:
    """A model's state dict saved as a file of its own (a run's `model_final.pt`), read as
    `load_checkpoint` reads (nothing it names is run). Raises `CheckpointError` for a file that
    is not a mapping of names to tensors."""
    state = _safe_load(path)
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()
    ):
        raise CheckpointError(f"{path} is not a model's state dict (names mapped to tensors)")
    return state


def read_header(path: Path, fix: str | None = None) -> dict[str, Any]:
    """A checkpoint's own facts (step, workers, processes, algorithm, ...) without reading its
    tensors (memory-mapped) or running anything. Raises `CheckpointError` for a file that is
    not one of ours (`fix`: what its line suggests for an unreadable file)."""
    state = _checked(_safe_load(path, mmap=True, fix=fix), path)
    return {k: v for k, v in state.items() if k not in ("states", "loop")}


RESUME_FIX = "pass another checkpoint, or train.resume=auto to start fresh where there is none"


def _safe_load(path: Path, mmap: bool = False, fix: str | None = None) -> Any:
    """`torch.load(weights_only=True)`: the file may rebuild tensors and plain containers
    only. A pickle that names any other callable (the way a planted payload runs code) is
    refused before that name is imported, let alone called."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        names = _foreign_globals(path)
        raise CheckpointError(
            f"{path} is not a dpresearch checkpoint (format {FORMAT}): it asks to import "
            f"{names}; refused without loading it (only tensors and plain data are read)"
        ) from None
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(exc).__name__}: {_first_line(exc)}); "
            f"{fix or RESUME_FIX}"
        ) from None


def _foreign_globals(path: Path) -> str:
    """The callables a refused file names (read by scanning its opcodes, nothing loaded)."""
    try:
        names = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:
        return "something other than tensors"
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _checked(state: Any, path: Path) -> dict[str, Any]:
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointError(f"{path} is not a dpresearch checkpoint (format {FORMAT})")
    if state["format"] != FORMAT:
        raise CheckpointError(
            f"{path} is a dpresearch checkpoint of format {state['format']}, this version reads "
            f"format {FORMAT}; resume it with the dpresearch version that wrote it"
        )
    return state


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


# What a checkpoint may hold: the types `torch.load(weights_only=True)` rebuilds without
# importing anything of ours (numpy arrays and our own classes are converted by their owners).
PLAIN = (str, int, float, bool, type(None), bytes, torch.dtype, torch.device, torch.Size)


def check_plain(obj: Any, where: str = "checkpoint") -> int:
    """The bytes of the tensors inside `obj` (dicts, lists, tuples); raises `TypeError`
    naming the first value that is not a tensor or plain data, so a state that the loader
    would refuse is caught when it is written, not when someone resumes it."""
    kind = type(obj)
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if kind in PLAIN:
        return 0
    if kind in (dict, OrderedDict):
        total = 0
        for key, value in obj.items():
            if type(key) not in PLAIN and type(key) is not tuple:
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}, not plain data")
            total += check_plain(value, f"{where}[{key!r}]")
        return total
    if kind in (list, tuple):
        return sum(check_plain(value, f"{where}[{i}]") for i, value in enumerate(obj))
    raise TypeError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}: a checkpoint holds tensors and "
        "plain data only (dict, list, tuple, str, numbers, None); convert it in its state_dict"
    )


def incompatibility(header: dict[str, Any], path: Path, run: dict[str, Any]) -> str | None:
    """Why the checkpoint at `path` (its `header`) cannot continue a run with the facts `run`
    (workers, processes, algorithm, num_params: those given), or None."""
    for key, value in run.items():
        if header.get(key) != value:
            return (
                f"checkpoint {path} was written with {key}={header.get(key)}, this run has "
                f"{key}={value}; resume with the run's own configuration"
            )
    return None


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor inside (dicts, lists, tuples) moved to the CPU."""
    if torch.is_tensor(obj):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    return obj
