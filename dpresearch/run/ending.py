"""The last line a run prints, and the command that continues an interrupted one.

Every run ends with one line saying how it ended, how far it got, how long it took and where
its results are (`final_line`). An interrupted run's line carries the exact command that
continues it (`resume_command`): the way the user started it (`<python> -m dpresearch.train`
naming the interpreter that ran, e.g. `.venv/bin/python`; `dpresearch train`;
`dpresearch-train`), their flags and this run's overrides, with the run directory pinned and
`train.resume=auto` — typing `train.resume=auto` alone would start a fresh run in a new
directory. The entry point records how it was invoked (`remember_invocation`);
the record travels in the environment, so sweep jobs in a process pool see it too.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

INVOCATION_ENV = "DPRESEARCH_INVOCATION"
# Hydra overrides that place or launch a sweep: a resumed single run takes none of them.
SWEEP_ONLY = (
    "hydra.run",
    "hydra.sweep",
    "hydra/launcher",
    "hydra.launcher",
    "hydra/sweeper",
    "hydra.sweeper",
    "hydra.mode",
)
MODE_FLAGS = ("-m", "--multirun", "--run", "-r")


def program(argv0: str) -> list[str]:
    """How the user started the entry point: a console script by its name (`dpresearch
    train` through the `dpresearch` command), else `python -m dpresearch.train`."""
    words = argv0.split()
    if words and Path(words[0]).name.startswith("dpresearch") and not argv0.endswith(".py"):
        return [Path(words[0]).name, *words[1:]]
    return [interpreter(), "-m", "dpresearch.train"]


def interpreter(executable: str | None = None) -> str:
    """The Python that runs this process (`sys.executable`) as the user can type it again: its
    bare name when the shell finds that very file on PATH (`python3`), else its path relative
    to the working directory when it lies below it (`.venv/bin/python` from the checkout),
    else its absolute path. Never a `python` that would be another environment's."""
    executable = executable or sys.executable or "python3"
    path = os.path.abspath(executable)  # (not resolved: a venv's python is a symlink)
    found = shutil.which(Path(path).name)
    if found and os.path.abspath(found) == path:
        return Path(path).name
    cwd = os.path.abspath(os.getcwd())
    if path.startswith(cwd + os.sep):
        return os.path.relpath(path, cwd)
    return path


def remember_invocation(argv0: str, args: Sequence[str]) -> None:
    """Record the program and the user's arguments for `resume_command` (this process and the
    processes it starts)."""
    os.environ[INVOCATION_ENV] = json.dumps([program(argv0), list(args)])


def _key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def resume_command(run_dir: Path, task_overrides: Sequence[str]) -> str:
    """The command that continues the run in `run_dir`: the recorded program, the user's flags
    (without -m) and hydra overrides (without sweep placement), this run's task overrides
    (for a sweep point: its own values) without `train.resume`, then
    `hydra.run.dir=<run_dir> train.resume=auto`."""
    try:
        prog, args = json.loads(os.environ[INVOCATION_ENV])
    except (KeyError, ValueError):
        prog, args = program(""), []
    flags, hydra = [], []
    rest = iter(args)
    for arg in rest:
        if arg in MODE_FLAGS:
            continue
        if arg.startswith("-"):
            flags.append(arg)
            if "=" not in arg and arg in (
                "-cd",
                "--config-dir",
                "-cn",
                "--config-name",
                "-cp",
                "--config-path",
            ):
                flags.append(next(rest, ""))
            continue
        if _key(arg).startswith("hydra") and not _key(arg).startswith(SWEEP_ONLY):
            hydra.append(arg)
    task = [o for o in task_overrides if _key(o) != "train.resume"]
    words = [*prog, *flags, *hydra, *task, f"hydra.run.dir={run_dir}", "train.resume=auto"]
    return shlex.join(words)


def shown(path: Path | str) -> str:
    """`path` relative to the working directory when it lies below it, else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def final_line(summary: dict[str, Any], run_dir: Path | None, seconds: float) -> str:
    """One line for a finished run: status, steps, wall time, (a language model: its test bits
    per character beside the corpus's unigram entropy) where the results are."""
    done = summary.get("step", summary.get("total_steps"))
    total = summary.get("total_steps", done)
    where = f"; results in {shown(run_dir)}" if run_dir is not None else ""
    bpc = ""
    if "test/bpc" in summary and "data/unigram_bits_per_char" in summary:
        bpc = (
            f"; test/bpc {summary['test/bpc']:.3f} (unigram entropy "
            f"{summary['data/unigram_bits_per_char']:.2f} bits per character)"
        )
    status = summary.get("status", "finished")
    return f"{status}: {done}/{total} steps in {seconds:.1f} s{bpc}{where}"


def interrupted_line(
    summary: dict[str, Any], run_dir: Path | None, seconds: float, command: str
) -> str:
    """The one line of an interrupted run: where it stopped, its checkpoint, how to go on."""
    step, total = summary["interrupted_at_step"], summary.get("total_steps", "?")
    checkpoint = summary.get("checkpoint")
    if checkpoint is None:
        return (
            f"interrupted at step {step}/{total} after {seconds:.1f} s: no checkpoint (this "
            "algorithm cannot checkpoint); run it again from the start"
            + (f"; partial results in {shown(run_dir)}" if run_dir is not None else "")
        )
    return (
        f"interrupted at step {step}/{total} after {seconds:.1f} s: checkpoint {checkpoint}; "
        f"resume with: {command}"
    )
