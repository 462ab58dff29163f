"""Stop requests: SIGTERM, SIGINT and SIGUSR2 end a run cleanly at the next step boundary.

`handling()` (a context manager, main thread only) replaces the handlers of SIGTERM and SIGINT
with ones that only record the signal; the training loop asks `requested()` once per step, and
all processes agree on it through one tiny collective (`loop.agree`), then finish the step, write
a final checkpoint, and end with `status: interrupted`. A second signal while the first is
being honoured ends the process at once (exit 128 + signal, no checkpoint).

The launcher of local worker processes (`launch.launch_local`) does not let torch's elastic
agent turn these signals into a kill: `forwarding()` writes the signal number into a stop file
whose path the workers inherit (`STOP_FILE_ENV`); `requested()` reads it. Ctrl-C in a terminal
also reaches the workers directly (one process group); either way they stop at the same step.
A SIGTERM that reaches such a worker directly while no stop file is written is the agent
ending the job after another worker failed: it ends the process at once.

SIGUSR2 is what SLURM sends through submitit before a time limit or a preemption (Hydra's
submitit launcher, `dpresearch/conf/hydra/launcher/slurm.yaml`). It stops the run like SIGTERM,
and then, once the final checkpoint is written and the handlers are restored, it is handed on
to the handler that was there before ours (submitit's, which requeues the job; with
`train.resume=auto` the requeued job continues from that checkpoint). Without such a handler
the run ends with exit 140 (128 + SIGUSR2).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

STOP_FILE_ENV = "DPRESEARCH_STOP_FILE"
# a scheduler's "checkpoint now" signal: honoured, then handed on to the scheduler's handler
HANDED_ON = (signal.SIGUSR2,) if hasattr(signal, "SIGUSR2") else ()
SIGNALS = (signal.SIGTERM, signal.SIGINT, *HANDED_ON)

_requested: int | None = None
_depth = 0


def requested() -> int | None:
    """The signal number that asked this run to stop (this process's, or the launcher's stop
    file), or None."""
    if _requested is not None:
        return _requested
    path = os.environ.get(STOP_FILE_ENV)
    if path and os.path.exists(path):  # (a stat per step; no exception on the common path)
        try:
            text = Path(path).read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else int(signal.SIGTERM)
    return None


def exit_now(code: int) -> None:
    """End this process with `code` once its exit handlers have run (the run directory's lock
    released, the fork server stopped, logs flushed), skipping the interpreter's teardown:
    with torch loaded that took most of a stopped gloo job's time to end on a busy machine
    (1.5-4 s of a 4.6 s stop at a load of 8)."""
    import atexit

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def reset() -> None:
    """Forget a recorded request (a new run in the same process)."""
    global _requested
    _requested = None


def _record(signum: int, frame: object) -> None:
    global _requested
    if signum == signal.SIGTERM and _from_the_agent():
        os._exit(128 + signum)
    if _requested is not None:
        print(
            f"{signal.Signals(signum).name} again: stopping now, without a checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)
    _requested = signum


def _from_the_agent() -> bool:
    """Whether a SIGTERM that reached this process directly is torch's elastic agent stopping
    the job after a failure: the local launcher (its stop file named) forwards a user's stop
    through the stop file, so a SIGTERM with no stop file written is the agent's, and waiting
    for a step boundary could only delay the end (a peer blocked on a dead worker's message
    may never reach one)."""
    path = os.environ.get(STOP_FILE_ENV)
    return bool(path) and not os.path.exists(path)


def exit_on_the_agents_sigterm() -> None:
    """In a worker of the local launcher (stop file named; main thread): end the process at once
    when the agent's SIGTERM arrives (see `_from_the_agent`), even while the main thread is
    blocked inside a collective or a receive, where no Python signal handler can run until it
    returns (a server waiting for messages from workers that are gone would otherwise wait for
    the agent's SIGKILL, 30 s later). The C-level handler writes the signal number into a wakeup
    pipe; a daemon thread reading it acts (the blocked call has released the GIL)."""
    if STOP_FILE_ENV not in os.environ or threading.current_thread() is not threading.main_thread():
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            received = os.read(read_end, 64)
            if not received:
                return
            if int(signal.SIGTERM) in received and _from_the_agent():
                os._exit(128 + int(signal.SIGTERM))

    threading.Thread(target=watch, name="agent-sigterm", daemon=True).start()


def _foreign(handler: object) -> bool:
    """A Python handler installed by someone else (a scheduler), not one of this module's."""
    return callable(handler) and getattr(handler, "__module__", None) != __name__


@contextlib.contextmanager
def _handlers(
    handler: Callable[[int, object], None], received: Callable[[], int | None]
) -> Iterator[None]:
    """`handler` for SIGNALS for the duration; on the way out the old handlers come back and,
    if `received()` names a HANDED_ON signal, the old handler of that signal is called."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        if saved[s] != signal.SIG_IGN:  # ignored (nohup, a background job): keep ignoring
            signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        signum = received()
        if signum in HANDED_ON and _foreign(saved[signum]):
            saved[signum](signum, None)


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Record SIGTERM/SIGINT/SIGUSR2 instead of dying, for the duration. Nestable (a worker process
    handles them from its start, the loop again): the outermost one starts and ends with no
    request recorded."""
    global _depth
    if _depth == 0:
        reset()
    _depth += 1
    try:
        with _handlers(_record, lambda: _requested):
            yield
    finally:
        _depth -= 1
        if _depth == 0:
            reset()


@contextlib.contextmanager
def forwarding(stop_file: Path, escalate: Callable[[int, object], None]) -> Iterator[None]:
    """The launcher's side: the first SIGTERM/SIGINT/SIGUSR2 writes its number into `stop_file` (the
    workers stop at their next step); a second one calls `escalate` (stop them now)."""
    seen: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if seen:
            escalate(signum, frame)
            return
        seen.append(signum)
        tmp = stop_file.with_suffix(".tmp")
        tmp.write_text(str(signum))
        os.replace(tmp, stop_file)

    with _handlers(forward, lambda: seen[0] if seen else None):
        yield
