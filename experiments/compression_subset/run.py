"""Compressor comparison on real images: ResNet-20 on the CIFAR-10 subset (issue 4, E).

K=4 simulated synchronous workers × 32 images, Nesterov SGD, cosine schedule
(`experiment=resnet20_cifar10_subset`), the same epochs for every compressor. Runs each case
(skipping finished ones), then writes `results.md` and two plots into the output folder.

    python experiments/compression_subset/run.py [--epochs 10] [--out runs/compression_subset]

Bytes: `MB/epoch` is `comm/bytes_per_epoch`, the algorithm's counter (`comm/bytes`): the
compressed gradient payload one worker sends. BatchNorm buffer broadcasts are counted apart
(`comm/bytes_buffers`) and not in it; `modeled s/epoch` (`comm/modeled_s`) prices both, since
the broadcast is real traffic of every step.

The subset holds 5085 training / 1017 test images: the numbers are NOT comparable to published
full-CIFAR-10 results (see published_grace.csv for those, from a different setup).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUBSET = REPO.parent / "shared" / "data" / "cifar10-subset"

NO_MOMENTUM = ["optimizer.momentum=0.0", "optimizer.nesterov=false"]

# name: (compressor overrides, error feedback)
CASES: dict[str, tuple[list[str], str]] = {
    "identity (SGD)": (["compressor=identity"], "none"),
    "top-k 1% + EF": (["compressor=topk", "compressor.ratio=0.01"], "ef14"),
    "top-k 1%, no EF": (["compressor=topk", "compressor.ratio=0.01"], "none"),
    "random-k 1% + EF": (["compressor=randomk", "compressor.ratio=0.01"], "ef14"),
    "random-k 1%, no EF": (["compressor=randomk", "compressor.ratio=0.01"], "none"),
    "QSGD s=7": (["compressor=qsgd"], "none"),
    "scaled sign + EF (EF-signSGD)": (["compressor=sign"], "ef14"),
    "scaled sign, no EF": (["compressor=sign"], "none"),
    "majority vote (signSGD), same lr 0.1": (["compressor=signum"], "none"),
    # Signum (Bernstein et al. 2018): ±1 per coordinate needs a ~1000× smaller lr; momentum is
    # applied locally before the vote (error_feedback.momentum), optimizer momentum off.
    "Signum (lr 1e-4, local momentum 0.9)": (
        ["compressor=signum", *NO_MOMENTUM, "optimizer.lr=1e-4", "error_feedback.momentum=0.9"],
        "none",
    ),
    "PowerSGD rank 2 + EF": (["compressor=powersgd", "compressor.rank=2"], "ef14"),
    # Diagnostics: error feedback under heavy Nesterov momentum sends bursty residuals that the
    # momentum amplifies; DGC's momentum correction (velocity kept and sparsified locally,
    # optimizer momentum off) and plain SGD show EF's effect without that interaction.
    "top-k 1% + EF, DGC momentum correction": (
        ["compressor=topk", "compressor.ratio=0.01", *NO_MOMENTUM, "error_feedback.momentum=0.9"],
        "ef14",
    ),
    "top-k 1% + EF, SGD without momentum": (
        ["compressor=topk", "compressor.ratio=0.01", *NO_MOMENTUM],
        "ef14",
    ),
    "random-k 1% + EF, SGD without momentum": (
        ["compressor=randomk", "compressor.ratio=0.01", *NO_MOMENTUM],
        "ef14",
    ),
    "random-k 1%, no EF, SGD without momentum": (
        ["compressor=randomk", "compressor.ratio=0.01", *NO_MOMENTUM],
        "none",
    ),
    "top-k 1%, no EF, SGD without momentum": (
        ["compressor=topk", "compressor.ratio=0.01", *NO_MOMENTUM],
        "none",
    ),
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def run_case(name: str, epochs: float, out: Path) -> Path:
    run_dir = out / slug(name)
    if (run_dir / "summary.json").exists():
        return run_dir
    overrides, ef = CASES[name]
    cmd = [
        sys.executable,
        "-m",
        "dpresearch.train",
        "experiment=resnet20_cifar10_subset",
        f"data.root={SUBSET}",
        f"train.epochs={epochs}",
        *overrides,
        f"error_feedback={ef}",
        "train.progress=false",
        f"hydra.run.dir={run_dir}",
    ]
    print(f"== {name}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
    return run_dir


def report(runs: dict[str, Path], out: Path) -> str:
    from dpresearch.analysis import load_summaries, markdown_table, plot_curves

    df = load_summaries(list(runs.values()))
    df.insert(0, "case", list(runs))
    dense = df.loc[df["case"] == "identity (SGD)", "comm/bytes_per_epoch"]
    base = float(dense.iloc[0]) if len(dense) else float("nan")
    df["MB/epoch"] = df["comm/bytes_per_epoch"] / 1e6
    df["reduction"] = base / df["comm/bytes_per_epoch"]
    df["modeled s/epoch (10GbE)"] = df["comm/modeled_s"] / df["epoch"]
    table = markdown_table(
        df,
        [
            "case",
            "test/acc",
            "best/test_acc",
            "MB/epoch",
            "reduction",
            "modeled s/epoch (10GbE)",
            "time/wall_s",
        ],
        {
            "test/acc": ".3f",
            "best/test_acc": ".3f",
            "MB/epoch": ".2f",
            "reduction": ".0f",
            "modeled s/epoch (10GbE)": ".4f",
            "time/wall_s": ".0f",
        },
    )
    labelled = dict(zip(df["case"], df["run"], strict=True))
    plot_curves(labelled, "epoch", "test/acc", out / "acc_vs_epoch.png")
    plot_curves(labelled, "comm/bytes", "test/acc", out / "acc_vs_bytes.png", logx=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=float, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "compression_subset")
    parser.add_argument("--only", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    if not SUBSET.is_dir():
        raise SystemExit(f"the CIFAR-10 subset is not at {SUBSET}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {name: run_case(name, args.epochs, args.out) for name in args.only}
    table = report(runs, args.out)
    header = (
        f"ResNet-20, CIFAR-10 subset (5085 train / 1017 test images), K=4 simulated sync "
        f"workers × 32, {args.epochs:g} epochs. NOT full CIFAR-10.\n"
        "MB/epoch: `comm/bytes` (the algorithm's gradient payload per worker, BatchNorm buffer "
        "broadcasts excluded); modeled s/epoch: `comm/modeled_s` (gradients and buffers).\n\n"
    )
    (args.out / "results.md").write_text(header + table + "\n")
    print(header + table)


if __name__ == "__main__":
    main()
