"""Gossip vs allreduce on real images: ResNet-20 on the CIFAR-10 subset, K = 8 (issue 7, F).

Methods: synchronous allreduce, D-PSGD on a ring and on the exponential graph, CHOCO-SGD on a
ring with scaled sign and with top-k 1%, and SGP on the one-peer exponential graph; data split
IID and by Dirichlet label skew (α = 0.1). K = 8 simulated workers × 32 images, Nesterov SGD,
cosine schedule (`experiment=resnet20_cifar10_subset`), the same epochs for every method.

Protocol (stated in results.md): each method runs at each (lr, γ) setting of its list in CASES
on the IID split; the setting with the lowest final training loss is selected — the test set
never chooses — and then run on the Dirichlet split. D-PSGD on the exponential graph and SGP
reuse the lr D-PSGD on the ring selected (a CPU budget, stated). One seed.

    python experiments/gossip_subset/run.py [--epochs 6] [--jobs 2] [--out runs/gossip_subset]

Runs are resumable (a finished run directory is skipped). The subset holds 5085 training /
1017 test images: NOT comparable to published full-CIFAR-10 numbers, which `published.csv`
lists beside ours for orientation only.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SUBSET = REPO.parent / "shared" / "data" / "cifar10-subset"
WORKERS = 8

# name: (overrides, the (lr, γ) settings tried on the IID split — or the name of the method
# whose selected lr this one reuses)
LRS = (0.1, 0.2)
CASES: dict[str, tuple[list[str], list[tuple[float, float | None]] | str]] = {
    "allreduce (sync)": (["algorithm=sync"], [(lr, None) for lr in LRS]),
    "D-PSGD ring": (["algorithm=dpsgd", "topology=ring"], [(lr, None) for lr in LRS]),
    # γ: the offline tuner (`python -m dpresearch.tune_gamma workers=8 compressor=...
    # steps=300`) picks 0.04 for top-1% (ChocoSGD's own value) and 1.0 for scaled sign on
    # random vectors; ChocoSGD trained ResNet-20 with sign at 0.45, so sign tries both.
    "CHOCO sign (ring)": (
        ["algorithm=choco", "topology=ring", "compressor=sign"],
        [(0.1, 0.45), (0.2, 0.45), (0.1, 1.0)],
    ),
    "CHOCO top-k 1% (ring)": (
        ["algorithm=choco", "topology=ring", "compressor=topk", "compressor.ratio=0.01"],
        [(lr, 0.04) for lr in LRS],
    ),
    # Exact gossip on better-connected graphs: the lr D-PSGD on the ring selected (CPU budget).
    "D-PSGD exponential": (["algorithm=dpsgd", "topology=exponential"], "D-PSGD ring"),
    "SGP (one-peer exp.)": (["algorithm=sgp", "topology=one_peer_exponential"], "D-PSGD ring"),
}
PARTITIONS = {"iid": [], "dirichlet 0.1": ["data.partition=dirichlet", "data.alpha=0.1"]}


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text.lower()).strip("_")


def run(case: str, partition: str, lr: float, gamma: float | None, args) -> Path:
    """Run one setting unless its directory already holds a summary; return the directory."""
    tag = f"{slug(case)}__{slug(partition)}__lr{lr:g}" + (f"__g{gamma:g}" if gamma else "")
    run_dir = args.out / tag
    if (run_dir / "summary.json").exists():
        return run_dir
    overrides, _ = CASES[case]
    cmd = [
        sys.executable,
        "-m",
        "dpresearch.train",
        "experiment=resnet20_cifar10_subset",
        f"data.root={SUBSET}",
        f"workers={WORKERS}",
        f"train.epochs={args.epochs}",
        f"train.eval_every={args.eval_every}",
        f"optimizer.lr={lr}",
        "network=1gbe",
        "backend.threads=1",
        *overrides,
        *([f"algorithm.gamma={gamma}"] if gamma else []),
        *PARTITIONS[partition],
        "train.progress=false",
        f"hydra.run.dir={run_dir}",
    ]
    print(f"== {case} | {partition} | lr {lr:g}" + (f" | γ {gamma:g}" if gamma else ""), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return run_dir


def final_train_loss(run_dir: Path) -> float:
    import json

    loss = json.loads((run_dir / "summary.json").read_text())["train/loss"]
    return loss if loss == loss else float("inf")  # NaN (diverged) never wins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=float, default=6)
    parser.add_argument("--eval-every", type=int, default=38, help="steps (19 per epoch)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gossip_subset")
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--only", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--jobs", type=int, default=3, help="runs at once (1 thread each)")
    args = parser.parse_args()
    if not SUBSET.is_dir():
        raise SystemExit(f"the CIFAR-10 subset is not at {SUBSET}")
    args.out.mkdir(parents=True, exist_ok=True)

    # All IID grids are queued first; a method's Dirichlet run (and the methods reusing its
    # lr) are queued as soon as its grid has finished.
    tuned = [c for c in args.only if not isinstance(CASES[c][1], str)]
    grid: dict[str, dict[tuple[float, float | None], Path]] = {}
    selected: dict[tuple[str, str], Path] = {}
    later: list[tuple[tuple[str, str], Future]] = []
    with ThreadPoolExecutor(args.jobs) as pool:
        queued = {
            case: {s: pool.submit(run, case, "iid", *s, args) for s in CASES[case][1]}
            for case in tuned
        }
        for case in tuned:
            runs = {setting: future.result() for setting, future in queued[case].items()}
            best = min(runs, key=lambda setting: final_train_loss(runs[setting]))
            grid[case] = runs
            selected[(case, "iid")] = runs[best]
            later.append(
                ((case, "dirichlet 0.1"), pool.submit(run, case, "dirichlet 0.1", *best, args))
            )
            for other in args.only:
                if CASES[other][1] == case:
                    grid[other] = {}
                    for part in PARTITIONS:
                        future = pool.submit(run, other, part, best[0], None, args)
                        later.append(((other, part), future))
        for key, future in later:
            selected[key] = future.result()
    from report import write_report

    write_report(selected, grid, args, published=load_published())


def load_published() -> list[dict[str, str]]:
    path = HERE / "published.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
