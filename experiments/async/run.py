"""The asynchronous-training study (issue 8, F): does asynchrony beat a barrier, and which
learning-rate rule fixes the staleness?

(a) Least squares as in Mishchenko et al. 2022 (`least_squares.py`): minibatch SGD vs
    asynchronous SGD with a constant and with the delay-adaptive lr, M = 40 workers with
    exponential compute times, without and with one 100× straggler; loss against simulated
    time. Each method at every lr of its grid (seed 0), the lowest final f − f* selected, the
    selected lr rerun with seeds 1 and 2.
(b) ResNet-20 on the CIFAR-10 subset, K = 8 workers, exponential compute times (mean
    `--compute-s`) and worker 0 four times slower, pushes and pulls priced on 1 GbE:
    synchronous SGD (protocol=sync, the same clock) vs asgd vs ssp (s = 4) vs asgd with the
    inverse lr η/τ; each method at every lr of its three-point grid (CIFAR_METHODS), the
    lowest final training loss selected (the test set never chooses).
    One seed, `--epochs` epochs (default 4: this is a shared 2-core CPU machine), so the
    accuracies are far from converged.

    python experiments/async/run.py [--part a|b|all] [--epochs 4] [--budget 800]
        [--out runs/async_study] [--results experiments/async/results]

Runs are resumable: a finished run (a JSON trace, a run directory with summary.json) is kept.
The report (results.md, PNG plots) is written from whatever has finished (`--report-only`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SUBSET = REPO.parent / "shared" / "data" / "cifar10-subset"
sys.path.insert(0, str(HERE))

# -- (b) ResNet-20 ---------------------------------------------------------------------------------
WORKERS = 8
# lr grids, three points per method (a 4-epoch run takes 4 to 12 minutes on the shared 2-core
# machine). The asynchronous grids are centred on η/8 of sync's (one push carries 1/8 of a
# synchronous update's gradients); for the inverse rule η/τ with τ ≈ K − 1 = 7 lands at about
# the same effective step as sync's η.
CIFAR_METHODS: dict[str, tuple[list[str], list[float]]] = {
    "sync (barrier)": (["protocol=sync"], [0.05, 0.1, 0.2]),
    "asgd": (["protocol=asgd"], [0.0125, 0.025, 0.05]),
    "ssp (s = 4)": (["protocol=ssp", "protocol.max_staleness=4"], [0.0125, 0.025, 0.05]),
    "asgd + inverse lr (η/τ)": (
        ["protocol=asgd", "async.lr_policy=inverse"],
        [0.05, 0.1, 0.2],
    ),
}


def slug(text: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in text.lower()).strip("_")


def cifar_run(method: str, lr: float, args) -> Path:
    """One ResNet-20 run unless its directory already holds a summary."""
    run_dir = args.out / "cifar" / f"{slug(method)}__lr{lr:g}"
    if (run_dir / "summary.json").exists():
        return run_dir
    overrides, _ = CIFAR_METHODS[method]
    cmd = [
        sys.executable, "-m", "dpresearch.train", "experiment=resnet20_cifar10_subset",
        f"data.root={SUBSET}", f"workers={WORKERS}", "algorithm=async_sgd",
        "async.speed=exponential", f"async.compute_s={args.compute_s}",
        "async.slow_workers=[0]", "async.slowdown=4", "network=1gbe", "backend.threads=1",
        f"train.epochs={args.epochs}", f"optimizer.lr={lr}", "train.progress=false",
        "train.log_every=10", *overrides, f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    print(f"== (b) {method} | lr {lr:g}", flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
    return run_dir


def final_train_loss(run_dir: Path) -> float:
    loss = json.loads((run_dir / "summary.json").read_text())["train/loss"]
    return loss if loss == loss else float("inf")  # NaN (diverged) never wins


def part_b(args) -> dict[str, tuple[float, dict[float, Path]]]:
    if not SUBSET.is_dir():
        raise SystemExit(f"the CIFAR-10 subset is not at {SUBSET}")
    out = {}
    for method, (_, lrs) in CIFAR_METHODS.items():
        runs = {lr: cifar_run(method, lr, args) for lr in lrs}
        out[method] = (min(runs, key=lambda lr: final_train_loss(runs[lr])), runs)
    return out


def finished_b(args) -> dict[str, tuple[float, dict[float, Path]]]:
    """The (b) runs already on disk, selected as `part_b` does."""
    out = {}
    for method, (_, lrs) in CIFAR_METHODS.items():
        runs = {
            lr: args.out / "cifar" / f"{slug(method)}__lr{lr:g}"
            for lr in lrs
            if (args.out / "cifar" / f"{slug(method)}__lr{lr:g}" / "summary.json").exists()
        }
        if runs:
            out[method] = (min(runs, key=lambda lr: final_train_loss(runs[lr])), runs)
    return out


# -- (a) least squares ---------------------------------------------------------------------------
def trace_path(args, case: str, method: str, lr: float, seed: int) -> Path:
    return args.out / "least_squares" / f"{slug(case)}__{slug(method)}__lr{lr:g}__s{seed}.json"


def ls_run(problem, case: str, method: str, lr: float, seed: int, args) -> dict:
    import least_squares as ls

    path = trace_path(args, case, method, lr, seed)
    if path.exists():
        return json.loads(path.read_text())
    trace = ls.simulate(problem, method, lr, case, args.budget, seed=seed)
    record = {"case": case, "method": method, "lr": lr, "seed": seed, **trace.__dict__}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    print(f"  (a) {case} | {method} | lr {lr:g} | seed {seed}: f−f* {trace.final:.3e}", flush=True)
    return record


def part_a(args) -> dict:
    """{case: {method: {"lr": best, "grid": {lr: record}, "seeds": [records]}}}"""
    import least_squares as ls

    problem = ls.make_problem()
    out: dict = {}
    for case in ls.CASES:
        out[case] = {}
        for method, grid in ls.GRIDS.items():
            records = {lr: ls_run(problem, case, method, lr, 0, args) for lr in grid}
            best = min(grid, key=lambda lr: records[lr]["gap"][-1])
            seeds = [records[best]] + [
                ls_run(problem, case, method, best, s, args) for s in range(1, args.seeds)
            ]
            out[case][method] = {"lr": best, "grid": records, "seeds": seeds}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["a", "b", "all"], default="all")
    parser.add_argument("--epochs", type=float, default=4)
    parser.add_argument("--compute-s", type=float, default=0.1)
    parser.add_argument("--budget", type=float, default=800.0, help="(a) simulated seconds")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "async_study")
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    least = cifar = None
    if args.part in ("a", "all"):
        least = part_a(args) if not args.report_only else part_a_done(args)
    if args.part in ("b", "all"):
        cifar = part_b(args) if not args.report_only else finished_b(args)
    from report import write_report

    write_report(args, least, cifar)


def part_a_done(args) -> dict | None:
    """Part (a) from the traces on disk (every grid point must be there)."""
    import least_squares as ls

    if not (args.out / "least_squares").is_dir():
        return None
    return (
        part_a(args)
        if all(
            trace_path(args, c, m, lr, 0).exists()
            for c in ls.CASES
            for m, g in ls.GRIDS.items()
            for lr in g
        )
        else None
    )


if __name__ == "__main__":
    main()
