"""How many intra-op threads a run's processes use (`backend.threads`; null: chosen here).

A parallel torch operation waits for its slowest thread, and on a machine shared with other
processes a thread the scheduler has parked stalls the operation for a scheduler tick: with
two threads per process on a busy 2-core machine, simulated CHOCO on the MLP ran 20–100× slower
than with one (issue 16). A second thread gains only where one worker's operations are large,
and only on cores nobody else is using. So, unless `backend.threads` says otherwise:

- the processes of one run on one machine, and the concurrent jobs of a parallel sweep or
  study (`DPRESEARCH_JOBS`, set by the study harness; Hydra's joblib launcher's `n_jobs`),
  divide the cores among themselves: each process gets at most cores ÷ (processes × jobs);
- a simulated run on the CPU takes 1 thread, unless one worker's forward pass is at least
  `MIN_MACS_FOR_THREADS` multiply-adds (the model at the per-worker batch, counted once on
  the meta device, `dpresearch/models/workload.py`) — then as many threads as there were
  idle cores at its start (sampled from /proc/stat over `IDLE_WINDOW_S`), within its share;
- a run on a GPU: 1 (the host only launches kernels).

The choice is printed at the start (`threads: ...`). Matrix products round differently with
different thread counts: a run that must be bit-identical to another fixes `backend.threads`.
"""

from __future__ import annotations

import os
import time
from typing import Any

JOBS_ENV = "DPRESEARCH_JOBS"
# One worker's forward pass (at its batch size) from which a second thread gains on an idle
# core (measured with experiments/bench/threads_under_load.py --idle, see the bench README).
MIN_MACS_FOR_THREADS = 1e8
IDLE_WINDOW_S = 0.2


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def concurrent_jobs() -> int:
    """How many jobs of a sweep or study run at once beside this one (itself included):
    `DPRESEARCH_JOBS`, else the `n_jobs` of Hydra's joblib launcher inside a parallel
    multirun, else 1."""
    value = os.environ.get(JOBS_ENV)
    if value:
        return max(1, int(value))
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return 1
        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return 1
        jobs = hc.launcher.get("n_jobs")
    except Exception:
        return 1
    if jobs is None:
        return 1
    jobs = int(jobs)
    return usable_cores() if jobs < 0 else max(1, jobs)


def idle_cores(window_s: float = IDLE_WINDOW_S) -> float | None:
    """Cores left idle by everything on the machine over the next `window_s` seconds (from
    /proc/stat; None where it cannot be read)."""

    def sample() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])

    before = sample()
    if before is None:
        return None
    time.sleep(window_s)
    after = sample()
    if after is None or after[1] <= before[1]:
        return None
    share = (after[0] - before[0]) / (after[1] - before[1])
    return share * (os.cpu_count() or 1)


def share_per_process(local_processes: int = 1) -> int:
    """The cores one process may use: usable cores ÷ (local processes × concurrent jobs)."""
    return max(1, usable_cores() // (max(1, local_processes) * concurrent_jobs()))


def choose(
    cfg: Any, device_type: str, worker_forward_macs: float | None, local_processes: int = 1
) -> tuple[int, str]:
    """(threads, why) for one process of the run `cfg` on `device_type`, whose one worker's
    forward pass is `worker_forward_macs` multiply-adds (None: unknown). See the module
    docstring for the rule."""
    from dpresearch.models.workload import describe_macs

    if cfg.backend.threads:
        return int(cfg.backend.threads), "backend.threads"
    share = share_per_process(local_processes)
    jobs = concurrent_jobs()
    split = f"{usable_cores()} cores ÷ {local_processes * jobs} processes" if share > 1 else ""
    if cfg.backend.name != "simulated":
        return share, split or "one core per process"
    if device_type != "cpu":
        return 1, "a GPU run: the host only launches kernels"
    if worker_forward_macs is None or worker_forward_macs < MIN_MACS_FOR_THREADS:
        size = "uncounted" if worker_forward_macs is None else describe_macs(worker_forward_macs)
        return 1, (
            f"a worker's forward is {size} multiply-adds, below the "
            f"{describe_macs(MIN_MACS_FOR_THREADS)} from which a second thread gains"
        )
    if share == 1:
        return 1, f"one core for this process ({usable_cores()} cores, {jobs} jobs)"
    idle = idle_cores()
    if idle is None:
        return share, f"{split}; idle cores unknown"
    threads = max(1, min(share, int(idle + 0.5)))
    return threads, f"{split}; {idle:.1f} cores idle at the start"


def describe(threads: int, why: str) -> str:
    """The line printed at the start of a run."""
    return f"threads: {threads} ({why}; backend.threads=N to set)"


def for_simulated(cfg: Any, dataset: Any, device_type: str) -> tuple[int, str]:
    """`choose` for a simulated run of `cfg` on `dataset` (its model counted at the
    per-worker batch)."""
    from dpresearch.models.workload import forward_macs

    macs = forward_macs(
        cfg.model, dataset.input_shape, dataset.num_classes, dataset.tokens_per_example is not None
    )
    return choose(cfg, device_type, macs * cfg.train.batch_size if macs else None)
