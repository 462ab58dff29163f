"""What a run prints, labelled and kept: `job_output` tees this process's stdout and stderr.

Inside `job_output(log_path, label)` every line this process prints to stdout or stderr also
goes to `log_path` (Hydra's `train.log` in the run directory, next to the records Hydra's own
logging writes there), and on the terminal each line starts with `label` (e.g. `[3] `, so the
interleaved output of parallel sweep jobs can be told apart). Worker processes started inside
it do the same (`worker_output`): the settings travel in the environment they inherit.

`torch_logs_to_file()` (around a launch of local worker processes) sends torch's own log
records — the elastic agent's, which print a failed worker's whole traceback, ~50 lines,
before our one line says what happened — to that log file instead of the console;
`log_only(text)` does the same for a text of ours (torch's report of a worker a signal killed).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

LOG_ENV = "DPRESEARCH_LOG_FILE"
LABEL_ENV = "DPRESEARCH_OUTPUT_LABEL"


class LineTee(io.TextIOBase):
    """A text stream writing through to `stream` with `label` before each line, and to `log`
    unlabelled."""

    def __init__(self, stream: TextIO, label: str = "", log: TextIO | None = None) -> None:
        self.stream, self.label, self.log = stream, label, log
        self._line_start = True

    def write(self, text: str) -> int:
        if self.label:
            pieces = []
            for piece in text.splitlines(keepends=True):
                if self._line_start:
                    pieces.append(self.label)
                pieces.append(piece)
                self._line_start = piece.endswith(("\n", "\r"))
            self.stream.write("".join(pieces))
        else:
            self.stream.write(text)
        if self.log is not None:
            try:
                self.log.write(text)
            except OSError as exc:
                self._drop_log(exc)
        return len(text)

    def _drop_log(self, exc: OSError) -> None:
        """The log file refused a write (a full disk): the terminal keeps the output and the
        log stops here, silently — the run's own writes into the same directory fail too, and
        their one `error:` line is the report."""
        self.log = None

    def flush(self) -> None:
        self.stream.flush()
        if self.log is not None:
            try:
                self.log.flush()
            except OSError as exc:
                self._drop_log(exc)

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")


@contextlib.contextmanager
def job_output(log_path: Path | None, label: str = "") -> Iterator[None]:
    """Tee stdout/stderr to `log_path` (None: no copy) with `label`ed terminal lines, here and
    in the worker processes started inside (through the environment)."""
    saved_env = {k: os.environ.get(k) for k in (LOG_ENV, LABEL_ENV)}
    if log_path is not None:
        os.environ[LOG_ENV] = str(log_path)
    if label:
        os.environ[LABEL_ENV] = label
    try:
        with _tee(log_path, label):
            yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# The loggers torch gives console handlers of their own (stderr; they do not propagate to Hydra's).
TORCH_LOGGERS = ("torch", "torch.distributed")


@contextlib.contextmanager
def torch_logs_to_file() -> Iterator[None]:
    """For the duration: torch's console log handlers (`TORCH_LOGGERS`) replaced by ones writing
    to the job's log file (`LOG_ENV`, set by `job_output`), in the same format. Without a log
    file nothing changes."""
    log = os.environ.get(LOG_ENV)
    swapped: list[tuple[logging.Logger, logging.Handler, logging.Handler]] = []
    try:
        for name in TORCH_LOGGERS if log else ():
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                if type(handler) is not logging.StreamHandler:
                    continue
                try:
                    to_file = logging.FileHandler(log, encoding="utf-8")
                except OSError:  # (the log file cannot be written: the console keeps them)
                    continue
                to_file.setFormatter(handler.formatter)
                to_file.setLevel(handler.level)
                logger.removeHandler(handler)
                logger.addHandler(to_file)
                swapped.append((logger, handler, to_file))
        yield
    finally:
        for logger, handler, to_file in reversed(swapped):
            logger.removeHandler(to_file)
            to_file.close()
            logger.addHandler(handler)


def log_only(text: str) -> bool:
    """Append `text` to the job's log file (`LOG_ENV`) and not to the console: what a reader
    may want later but not on the terminal (torch's report of a worker killed by a signal).
    Without a log file (or when it cannot be written) it goes to stderr; returns whether the
    log file took it."""
    log = os.environ.get(LOG_ENV)
    if log:
        sys.stdout.flush()
        sys.stderr.flush()  # (the tee's lines first, in order)
        try:
            with open(log, "a", encoding="utf-8") as f:
                f.write(text if text.endswith("\n") else text + "\n")
            return True
        except OSError:
            pass
    print(text, file=sys.stderr)
    return False


def worker_output() -> contextlib.AbstractContextManager[None]:
    """In a worker process: the tee its launcher's `job_output` asked for, if any."""
    log = os.environ.get(LOG_ENV)
    return _tee(Path(log) if log else None, os.environ.get(LABEL_ENV, ""))


@contextlib.contextmanager
def _tee(log_path: Path | None, label: str) -> Iterator[None]:
    if log_path is None and not label:
        yield
        return
    log = None
    if log_path is not None:
        with contextlib.suppress(OSError):
            log = open(log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = LineTee(out, label, log), LineTee(err, label, log)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = out, err
        if log is not None:
            with contextlib.suppress(OSError):  # (a full disk: already said)
                log.close()
