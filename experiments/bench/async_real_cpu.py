"""Benchmark: CPU time per push of the real asynchronous mode, before vs after a change, both
sides running at once (issue 17, acceptance E's cause, measurable on a loaded machine).

`async_real_pushes.py` measures what E asks (pushes/s), but on a shared machine the load decides
its ratios. What a push costs in CPU is much steadier, and measured with both sides running at
the same time both see the same machine. Each side runs the benchmark's job (4 gloo workers + a
server, MLP, no injected delay; `async_real_pushes.run_args`) for a long time; once both are
past `--warmup` pushes, `--windows` windows of `--seconds` each read every rank's CPU time
(user + system, `/proc/<pid>/stat`; Linux) and the pushes the side logged meanwhile. Reported per
side: the median over windows of the server's CPU ms per push and all ranks' CPU ms per push,
and the ratios after/before. On 2 cores the job is CPU-bound and the server, which handles
every push, is its serial part: its CPU per push bounds the rate (1 / server CPU per push).

    python experiments/bench/async_real_cpu.py --before /tmp/before [--windows 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_real_pushes import REPO, load, run_args


def descendants(pid: int) -> list[int]:
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        out += [int(child), *descendants(int(child))]
    return out


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def logged_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return json.loads(lines[-1])["step"] if lines else 0


def ranks(job: subprocess.Popen) -> list[int]:
    """The job's 5 training processes (leaves of its process tree, the resource tracker
    aside), the server (the busiest) first."""
    pids = [
        p
        for p in descendants(job.pid)
        if not Path(f"/proc/{p}/task/{p}/children").read_text().split()
        and "resource_tracker" not in Path(f"/proc/{p}/cmdline").read_text()
    ]
    start = {p: cpu_ticks(p) for p in pids}
    time.sleep(2)
    pids.sort(key=lambda p: start[p] - cpu_ticks(p))
    if len(pids) != 5:
        raise RuntimeError(f"expected 5 training processes, found {len(pids)}")
    return pids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, default=REPO)
    parser.add_argument("--windows", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=int, default=800)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    args.steps, args.log_every = 10**8, 50  # (runs until stopped)
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    print(f"before: {sides['before']}\nafter: {sides['after']}\nload at start: {load()}")
    tick = os.sysconf("SC_CLK_TCK")
    jobs: dict[str, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="async-real-cpu-") as tmp:
        dirs = {name: Path(tmp) / name for name in sides}
        try:
            for name, side in sides.items():
                env = dict(
                    os.environ, PYTHONPATH=str(side), WANDB_MODE="disabled", OMP_NUM_THREADS="1"
                )
                command = [
                    sys.executable,
                    "-m",
                    "dpresearch.train",
                    *run_args(args),
                    f"hydra.run.dir={dirs[name]}",
                ]
                with open(Path(tmp) / f"{name}.err", "w") as err:
                    jobs[name] = subprocess.Popen(
                        command, cwd=tmp, env=env, stderr=err, stdout=subprocess.DEVNULL
                    )
            while min(logged_step(d) for d in dirs.values()) < args.warmup:
                for name, job in jobs.items():
                    if job.poll() is not None:
                        log = (Path(tmp) / f"{name}.err").read_text()[-3000:]
                        raise RuntimeError(f"{name}: the run failed\n{log}")
                time.sleep(0.5)
            pids = {name: ranks(job) for name, job in jobs.items()}
            per: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
            for _ in range(args.windows):
                steps0 = {n: logged_step(dirs[n]) for n in sides}
                cpu0 = {n: [cpu_ticks(p) for p in pids[n]] for n in sides}
                time.sleep(args.seconds)
                for n in sides:
                    pushes = logged_step(dirs[n]) - steps0[n]
                    used = [cpu_ticks(p) - c for p, c in zip(pids[n], cpu0[n], strict=True)]
                    if pushes > 0:
                        ms = 1e3 / tick / pushes
                        per[n].append((used[0] * ms, sum(used) * ms))
        finally:
            for job in jobs.values():
                job.terminate()
            for job in jobs.values():
                job.wait()
    for n in sides:
        if not per[n]:
            raise RuntimeError(f"{n}: no push logged in any window; raise --seconds")
    med = {
        n: (statistics.median(s for s, _ in per[n]), statistics.median(a for _, a in per[n]))
        for n in sides
    }
    for n in sides:
        print(
            f"{n}: server {med[n][0]:.3f} ms CPU per push, all ranks {med[n][1]:.3f} "
            f"({len(per[n])} windows)"
        )
    print(
        f"after / before: server CPU per push {med['after'][0] / med['before'][0]:.3f}, all "
        f"ranks {med['after'][1] / med['before'][1]:.3f}; load at end {load()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
