"""Default intra-op threads vs the best setting while other CPU-bound processes run (issue 16,
item 1).

Starts `--competitors` (2) CPU-bound processes (each a one-thread torch loop of 256×256
matrix products, like another training job), then, in alternating rounds, runs each case as a
fresh `python -m dpresearch.train` process at the default (`backend.threads` unset: what
`dpresearch/launch/threads.py` chooses; its `threads:` line is recorded) and at every fixed setting
1…cores (`backend.threads=N`; N = cores is torch's own default, what a run used before issue
16). OMP_NUM_THREADS is removed from the runs' environment, so the default is the default. A
run's step time is the median block of the trainer's step regions (`time/compute_s +
time/comm_s`, wall clock: waiting for a parked thread is what collapses) after warm-up; the
figure is, per round, default ÷ best setting, then the median over rounds and its range.
Target: ≤ 1.2. The competitors are stopped at the end (also on failure or Ctrl-C).

`--competitors 0` measures the idle machine instead (what MIN_MACS_FOR_THREADS rests on:
whether a second thread gains for each case when the cores are free).

    python experiments/bench/threads_under_load.py [--cases choco_mlp resnet20] [--rounds 5]
        [--competitors 2] [--steps 20] [--block 5] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_timing as bt  # noqa: E402
from bench_cases import MODELS, SUBSET, compose  # noqa: E402

CASES: dict[str, list[str]] = {
    # the example: simulated CHOCO on the (default) MLP
    "choco_mlp": ["algorithm=choco", "compressor=topk", "compressor.ratio=0.1", "workers=4"],
    "sync_mlp_large": [*MODELS["mlp"], "workers=4"],
    "resnet20": [*MODELS["resnet20"], "workers=4"],
}
COMPETITOR = (
    "import torch\n"
    "torch.set_num_threads(1)\n"
    "a = torch.randn(256, 256)\n"
    "while True:\n"
    "    a = torch.tanh(a @ a)\n"
)
CHOICE = re.compile(r"^threads: (\d+) \((.*)\)$", re.M)


def start_competitors(n: int) -> list[subprocess.Popen]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return [
        subprocess.Popen(
            [sys.executable, "-c", COMPETITOR],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(n)
    ]


def stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            p.terminate()
    for p in processes:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def run(case: str, threads: int | None, args, folder: Path) -> tuple[float, str]:
    """Median step time of one run of `case` at `threads` (None: the default) in a fresh
    process, and the `threads:` line it printed."""
    run_dir = folder / f"{case}-{threads or 'default'}"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        case,
        str(threads or 0),
        str(run_dir),
        "--block",
        str(args.block),
        "--blocks",
        str(args.blocks),
        "--warmup",
        str(args.warmup),
    ]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run(
        cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout
    )
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    times = bt.logged_block_times(run_dir / "metrics.jsonl", args.block, args.warmup)
    found = CHOICE.search(out.stdout)
    return statistics.median(times), found.group(0) if found else ""


def child(case: str, threads: int, run_dir: Path, args) -> None:
    """One run as `python -m dpresearch.train` would make it (the same thread choice,
    `threads.for_simulated`), without the final evaluation (the test set is not the point)."""
    import torch

    from dpresearch.comm.simulated import SimulatedCommunicator
    from dpresearch.config.preflight import preflight
    from dpresearch.launch.threads import describe, for_simulated
    from dpresearch.run.build import network_model
    from dpresearch.run.trainer import Trainer

    steps = bt.logged_steps(args.warmup, args.block, args.blocks)
    fixed = [f"backend.threads={threads}"] if threads else []
    overrides = [
        *CASES[case],
        f"train.steps={steps}",
        f"train.log_every={args.block}",
        f"train.eval_every={100 * steps}",
        "train.save_model=false",
        "train.progress=false",
        *fixed,
    ]
    cfg = compose(*overrides)
    dataset = preflight(cfg)
    n, why = for_simulated(cfg, dataset, "cpu")
    torch.set_num_threads(n)
    print(describe(n, why), flush=True)
    trainer = Trainer(
        cfg,
        SimulatedCommunicator(cfg.workers, network_model(cfg)),
        torch.device("cpu"),
        run_dir,
        dataset,
    )
    trainer.metrics.evaluate = lambda: {"test/loss": 0.0, "test/acc": 0.0}
    trainer.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", nargs="+", default=["choco_mlp", "resnet20"], choices=list(CASES)
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--competitors", type=int, default=2)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--child", nargs=3, metavar=("CASE", "THREADS", "RUN_DIR"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), Path(args.child[2]), args)
        return 0
    cases = [
        c for c in args.cases if "resnet" not in c or (SUBSET / "cifar-10-batches-py").is_dir()
    ]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    settings = [None, *range(1, (cores or 1) + 1)]
    results = bt.Results(
        args.json or bt.default_json("threads_under_load"),
        "threads_under_load",
        vars(args) | {"json": None, "cores": cores},
    )
    competitors = start_competitors(args.competitors)
    rows = []
    try:
        print(
            f"{args.competitors} CPU-bound competitors on {cores} cores; "
            f"load {' '.join(f'{v:.2f}' for v in os.getloadavg())}",
            flush=True,
        )
        (REPO / "runs").mkdir(exist_ok=True)  # git ignores it; a fresh clone has none
        with tempfile.TemporaryDirectory(prefix="bench-threads-", dir=REPO / "runs") as tmp:
            for case in cases:
                ratios, choices = [], set()
                for r in range(args.rounds):
                    order = settings[r % len(settings) :] + settings[: r % len(settings)]
                    step = {}
                    for threads in order:
                        step[threads], line = run(case, threads, args, Path(tmp))
                        if threads is None:
                            choices.add(line)
                    best = min(v for k, v in step.items() if k is not None)
                    ratios.append(step[None] / best)
                    shown = ", ".join(
                        f"{k or 'default'}: {1 / v:.3g} steps/s" for k, v in step.items()
                    )
                    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
                    print(
                        f"{case} round {r}: {shown}; default/best {ratios[-1]:.2f} (load {load})",
                        flush=True,
                    )
                    results.add(
                        case=case, round=r, load=load, step_s={str(k): v for k, v in step.items()}
                    )
                rows.append((case, ratios, sorted(choices)))
    finally:
        stop(competitors)
    print()
    print("| case | default ÷ best (median [range]) | target | default took |")
    print("|---|---|---|---|")
    for case, ratios, choices in rows:
        print(
            f"| {case} | {statistics.median(ratios):.2f} {bt.fmt_range(ratios, 2)} | ≤ 1.2 | "
            f"{'; '.join(choices)} |"
        )
    results.write(summary={case: {"ratios": r, "default": c} for case, r, c in rows})
    print(f"wrote {results.path}")
    print(json.dumps({c: statistics.median(r) for c, r, _ in rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
