"""Benchmark: pushes per second of the real asynchronous mode, before vs after a change
(issue 17, acceptance E: after ≥ 0.95 × before).

Each side is a checkout of the package (`--before`, `--after`: directories holding
`dpresearch/`; `--after` defaults to this one). One run of a side is

    python -m dpresearch.train algorithm=async_sgd backend=gloo workers=4 backend.threads=1
        model=mlp (synthetic data) train.steps=N train.log_every=L ...

with `PYTHONPATH` pointing at that checkout: a server process and 4 worker processes exchanging
pushes and pulls as fast as they can (no injected delay). Its rate is read back from its own
`metrics.jsonl`: pushes (steps) between the first logged row after `--warmup` steps and the
last, divided by the `time/wall_s` between them — the steady state, without start-up,
evaluation or the end. Rounds run both sides back to back, the order alternating, so a shared
machine's drifting load hits both alike; the ratio after/before is taken per round and
reported as the median with its range, with the load average before and after.

The "before" side is the code before issue 17's change, e.g. a worktree of its parent commit:

    git worktree add /tmp/before 8f32fc6          # the commit before the real mode moved
    python experiments/bench/async_real_pushes.py --before /tmp/before [--rounds 5]
    git worktree remove /tmp/before

`--smoke` runs one tiny round (what the test suite checks runs).
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

REPO = Path(__file__).resolve().parents[2]


def run_args(args: argparse.Namespace) -> list[str]:
    return [
        "algorithm=async_sgd", "backend=gloo", "workers=4", "backend.threads=1",
        "model=mlp", f"model.hidden=[{args.hidden}]", f"data.num_features={args.features}",
        "data.num_train=8192", "data.num_test=256", f"train.batch_size={args.batch}",
        f"train.steps={args.steps}", f"train.log_every={args.log_every}",
        f"train.eval_every={10 * args.steps}", "train.progress=false",
        "train.save_model=false", "backend.heartbeat_s=null",
    ]  # fmt: skip


def pushes_per_second(metrics: Path, warmup: int) -> float:
    """Steady-state pushes per second of one run, from its metrics rows."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= warmup]
    if len(rows) < 2:
        raise RuntimeError(f"{metrics}: too few rows after step {warmup}")
    first, last = rows[0], rows[-1]
    return (last["step"] - first["step"]) / (last["time/wall_s"] - first["time/wall_s"])


def one_run(side: Path, args: argparse.Namespace, scratch: Path, name: str) -> float:
    run_dir = scratch / name
    env = dict(os.environ, PYTHONPATH=str(side), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "dpresearch.train", *run_args(args), f"hydra.run.dir={run_dir}"],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{side}: the run failed\n{out.stderr[-3000:]}")
    return pushes_per_second(run_dir / "metrics.jsonl", args.warmup)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=False, default=None)
    parser.add_argument("--after", type=Path, default=REPO)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--smoke", action="store_true", help="one tiny round, after vs after")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.warmup, args.log_every = 1, 60, 20, 10
        args.hidden = args.features = 16
    before = args.before or args.after  # (without a "before": both sides the same code)
    sides = {"before": before.resolve(), "after": args.after.resolve()}
    print(f"before: {sides['before']}\nafter: {sides['after']}\nload at start: {load()}")
    rates: dict[str, list[float]] = {"before": [], "after": []}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="async-real-bench-") as tmp:
        for r in range(args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            got = {}
            for name in order:
                got[name] = one_run(sides[name], args, Path(tmp), f"r{r}-{name}")
                rates[name].append(got[name])
            ratios.append(got["after"] / got["before"])
            print(
                f"round {r}: before {got['before']:.0f} /s, after {got['after']:.0f} /s, "
                f"ratio {ratios[-1]:.3f} (load {load()})",
                flush=True,
            )
    result = {
        "before_pushes_per_s": statistics.median(rates["before"]),
        "after_pushes_per_s": statistics.median(rates["after"]),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds": args.rounds,
        "load_at_end": load(),
    }
    print(
        f"after / before: median {result['ratio_median']:.3f} "
        f"(range {result['ratio_min']:.3f}–{result['ratio_max']:.3f}, {args.rounds} rounds); "
        f"target ≥ 0.95; load at end {result['load_at_end']}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    start = time.monotonic()
    code = main()
    print(f"took {time.monotonic() - start:.0f} s")
    sys.exit(code)
