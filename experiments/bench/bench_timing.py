"""How the benchmarks time things, in one place, so both sides of a comparison are timed alike.

- A *step* is what the trainer's step region holds (`dpresearch/run/timing.py`): producing the
  batch, forward, backward, communication, optimizer — not logging, evaluation or the
  schedule. Our side reads it from the logged `time/compute_s + time/comm_s`; a reference loop
  times the same work with `perf_counter` around it.
- Steps are grouped in *blocks* (our side logs once per block); a block's figure is its mean
  step time, and a run's figure is the median over its blocks after warm-up.
- Rounds alternate which side runs first (A B, B A, ...) so drift on a shared machine hits both
  alike; a comparison reports the median over rounds of the per-round ratio and its range.
- Threads are pinned and equal on both sides (`pin_threads`).
- Results are printed as each measurement finishes and rewritten to a JSON file after each, so
  an interrupted run keeps what it measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

REPO = Path(__file__).resolve().parents[2]
STEP_KEYS = ("time/compute_s", "time/comm_s")
T = TypeVar("T")


# `cpu`: this thread's CPU time, which other jobs on a shared machine inflate far less than
# wall time; `wall`: what a user waits.
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}


@contextlib.contextmanager
def loop_clock(read: Callable[[], float]) -> Iterator[None]:
    """The trainer's loop clock (`dpresearch.run.timing`, normally `perf_counter`) reads `read`
    for the duration, so its logged step regions are in that clock's seconds."""
    import dpresearch.run.timing as loop_timing

    class Clock:
        perf_counter = staticmethod(read)

    saved, loop_timing.time = loop_timing.time, Clock  # type: ignore[assignment]
    try:
        yield
    finally:
        loop_timing.time = saved


def load() -> str:
    """The 1-, 5- and 15-minute load averages and the CPU count, for the record."""
    return f"load {' '.join(f'{v:.2f}' for v in os.getloadavg())} on {os.cpu_count()} CPUs"


def pin_threads(threads: int) -> None:
    """Fix this process's intra-op threads (and OpenMP's, for children started after)."""
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def device_clock(args: Any, script: str) -> bool:
    """For a benchmark with `--device` and `--clock`: False, having printed one `skipped:` line,
    where `--device cuda` finds no GPU; else `args.clock` resolved (default: the wall clock on
    a GPU, this thread's CPU time on a CPU), `args.read` its reader, one intra-op thread."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{script}: skipped: no CUDA GPU is visible (use --device cpu)")
        return False
    args.clock = args.clock or ("wall" if args.device == "cuda" else "cpu")
    args.read = CLOCKS[args.clock]
    pin_threads(1)
    return True


def logged_block_times(metrics: Path, block: int, warmup: int) -> list[float]:
    """Mean step time of each block of `block` steps after the first `warmup` steps, from a
    run's metrics.jsonl logged every `block` steps (step regions only: compute + exposed
    comm)."""
    rows = {r["step"]: r for r in map(json.loads, metrics.open())}
    marks = [s for s in sorted(rows) if s % block == 0 and s >= warmup]
    spent = [sum(rows[s][k] for k in STEP_KEYS) for s in marks]
    return [(b - a) / block for a, b in zip(spent, spent[1:], strict=False)]


def logged_steps(warmup: int, block: int, blocks: int) -> int:
    """Steps a run logged every `block` steps needs for `blocks` whole blocks after `warmup`
    steps (`logged_block_times` starts at the first logged step at or after `warmup`)."""
    return -(-warmup // block) * block + block * blocks


def timed_run(warmup: int, block: int, blocks: int) -> list[str]:
    """The overrides of a run that `logged_block_times` reads: `logged_steps` steps, logged
    once a block, no evaluation before the end, no progress lines, no model saved."""
    steps = logged_steps(warmup, block, blocks)
    return [
        f"train.steps={steps}",
        f"train.log_every={block}",
        f"train.eval_every={100 * steps}",
        "train.progress=false",
        "train.save_model=false",
    ]


def simulated_trainer(
    cfg: Any,
    run_dir: Path | None,
    device: str = "cpu",
    data: Any = None,
    evaluate: Callable[[], dict[str, float]] | None = None,
) -> Any:
    """The trainer of a simulated run of `cfg` (its communicator over `cfg.workers` on the
    run's network model) on `device`, writing to `run_dir` (None: nothing); `data`: the data
    set already loaded (None: the trainer loads it); `evaluate`: replaces the evaluation (a
    timed loop then holds training alone)."""
    from dpresearch.comm.simulated import SimulatedCommunicator
    from dpresearch.run.build import network_model
    from dpresearch.run.trainer import Trainer

    comm = SimulatedCommunicator(cfg.workers, network_model(cfg))
    trainer = Trainer(cfg, comm, torch.device(device), run_dir, data)
    if evaluate is not None:
        trainer.metrics.evaluate = evaluate
    return trainer


def time_beside_run(
    cfg: Any,
    block: int,
    warmup: int,
    probe: Callable[[Any], T],
    probe_first: bool,
    clock: Callable[[], float],
) -> tuple[float, T]:
    """Train a fresh simulated run of `cfg` on the CPU (its trainer's loop timed by `clock`,
    files in a temporary directory) and call `probe(trainer)` before the run (`probe_first`)
    or after it; returns (the run's median step time over its blocks, `logged_block_times`,
    and what `probe` returned)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        trainer = simulated_trainer(cfg, Path(tmp))
        if probe_first:
            probed = probe(trainer)
        with loop_clock(clock):
            trainer.run()
        steps = logged_block_times(Path(tmp) / "metrics.jsonl", block, warmup)
        if not probe_first:
            probed = probe(trainer)
    return statistics.median(steps), probed


def timed_block_times(
    step: Callable[[], None], block: int, warmup: int, steps: int, sync: Callable[[], None]
) -> list[float]:
    """Run `step` warmup + steps times; mean step time of each block of `block` timed steps.
    `step` must hold everything the trainer's step region holds (batch included)."""
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return [statistics.fmean(times[i : i + block]) for i in range(0, len(times), block)]


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt_range(values: Sequence[float], digits: int = 3) -> str:
    return f"[{min(values):.{digits}f}–{max(values):.{digits}f}]"


class Results:
    """Measurements of one benchmark run, rewritten to `path` after every `add`."""

    def __init__(self, path: Path, bench: str, settings: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "bench": bench,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "host": {
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
            },
            "settings": settings,
            "measurements": [],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    @classmethod
    def resume(cls, path: Path) -> Results:
        """The results file another process of the same run created, to add to."""
        results = cls.__new__(cls)
        results.path, results.data = path, json.loads(path.read_text())
        return results

    def add(self, **record: Any) -> None:
        self.data["measurements"].append(record)
        self.write()

    def finish(self, **extra: Any) -> None:
        """The last `write` (`extra` and the time it finished), and a line naming the file."""
        self.write(**extra, finished=time.strftime("%Y-%m-%dT%H:%M:%S"))
        print(f"wrote {self.path}")

    def write(self, **extra: Any) -> None:
        self.data.update(extra)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def default_json(name: str) -> Path:
    """runs/bench/<name>-<time>.json under the repository (git-ignored)."""
    return REPO / "runs" / "bench" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
