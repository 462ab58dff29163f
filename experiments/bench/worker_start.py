"""Start-up of a local gloo run's worker processes: forked from the fork server vs spawned.

`backend.start_method=forkserver` (the default) forks each local worker from a server process
that imported torch and the worker's code once (`dpresearch/launch/forkserver.py`); `spawn`
starts a new interpreter per worker, which imports them again. This times whole launches of a
tiny gloo run (`launch_local`: rendezvous, the run built, a few steps, shutdown) in one process,
as a sweep run in one process or the test suite launches them one after another.

Rounds alternate which method goes first. The first launch with the fork server also starts
the server; it is reported apart (`first`), as a single command-line run pays it. Per round:
spawn ÷ forkserver of the launch wall times; printed: each method's median launch time and the
median ratio with its range, and the load average before → after (a shared machine inflates
both sides; the ratio is what to compare).

    python experiments/bench/worker_start.py [--rounds 5] [--workers 2] [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_timing import load

from dpresearch import CONF_DIR

METHODS = ("forkserver", "spawn")


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import dpresearch.train  # noqa: F401 - registers the schema

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def launch_seconds(method: str, args: argparse.Namespace) -> float:
    """Wall seconds of one whole local launch of the tiny run with `method`."""
    from dpresearch.launch.processes import launch_local

    cfg = compose(
        "backend=gloo",
        f"backend.start_method={method}",
        "backend.threads=1",
        f"workers={args.workers}",
        f"train.steps={args.steps}",
        f"train.log_every={args.steps}",
        "train.progress=false",
        "train.save_model=false",
        "data.num_train=256",
        "data.num_test=64",
        "data.num_features=16",
        "model.hidden=[16]",
    )
    start = time.perf_counter()
    summary = launch_local(cfg, None)
    seconds = time.perf_counter() - start
    assert summary["total_steps"] == args.steps, summary
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    before = load()
    first = launch_seconds("forkserver", args)  # starts the fork server
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    ratios = []
    for r in range(args.rounds):
        order = METHODS if r % 2 == 0 else METHODS[::-1]
        got = {m: launch_seconds(m, args) for m in order}
        for m in METHODS:
            times[m].append(got[m])
        ratios.append(got["spawn"] / got["forkserver"])
        print(f"round {r}: " + ", ".join(f"{m} {got[m]:.2f} s" for m in order), flush=True)
    print(f"{args.workers} gloo workers, {args.steps} steps, {args.rounds} rounds")
    print(f"first forkserver launch (server start included): {first:.2f} s")
    for m in METHODS:
        print(f"{m}: median launch {statistics.median(times[m]):.2f} s")
    print(
        f"spawn / forkserver: median {statistics.median(ratios):.2f} "
        f"(range {min(ratios):.2f}-{max(ratios):.2f})"
    )
    print(f"{before} -> {load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
