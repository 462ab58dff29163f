"""One point of a study re-timed at the new defaults vs the old (issue 16, acceptance C), and
the images/s of a study point (the GPU row).

The point is the study's own (its common overrides, the case's, the lr and the seed, as the
study harness launches it), minus `backend.threads` (studies pinned it to 1 because the old
default collapsed on a busy machine), run as `python -m dpresearch.train` in a fresh process:

- `new`: this checkout at its defaults (`backend.threads` chosen by `dpresearch/launch/threads.py`,
  `train.batched_workers=auto`);
- `old`: either a checkout of the old code (`--old-repo PATH`, e.g. a `git worktree` of main
  before issue 16) at its defaults, or — without it — this checkout set to what the old
  defaults were: torch's own thread count (all cores) and `train.batched_workers=false`.

Rounds alternate which side runs first. A run's time is its loop's wall time
(`time/wall_s` in summary.json: training, logging and evaluation; not the process start);
the figure is old ÷ new per round, median and range, with the load printed. `--steps N` cuts
the point short (the whole point otherwise). `--device cuda` runs on the GPU (skipped without
one) and reports images/s of the point.

    python experiments/bench/study_point_time.py [--study experiments/compression_subset/study.yaml]
        [--case "top-k 1% + EF"] [--lr 0.1] [--seed 0] [--rounds 3] [--steps N]
        [--old-repo PATH] [--device cpu|cuda] [--sides old new]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_timing as bt  # noqa: E402

STUDY = REPO / "experiments" / "compression_subset" / "study.yaml"


def point_overrides(args) -> list[str]:
    from dpresearch.study.spec import load_study

    study = load_study(args.study)
    points = [p for p in study.points([args.case]) if p.seed == args.seed]
    if args.lr is not None:
        points = [p for p in points if abs(p.lr - args.lr) <= 1e-12 * max(1.0, abs(args.lr))]
    if not points:
        raise SystemExit(f"error: no point of {args.case!r} at lr {args.lr} seed {args.seed}")
    overrides = [o for o in points[0].overrides if not o.startswith("backend.threads=")]
    return [o.replace("{repo}", str(REPO)) for o in overrides]


def run(side: str, overrides: list[str], args, folder: Path) -> dict:
    """One run of the point; its summary."""
    repo = args.old_repo if side == "old" and args.old_repo else REPO
    extra = ["train.progress=false"]
    if side == "old" and not args.old_repo:
        extra += [f"backend.threads={os.cpu_count()}", "train.batched_workers=false"]
    if args.steps:  # in place of the point's epochs
        overrides = [o for o in overrides if not o.startswith("train.epochs=")]
        extra.append(f"train.steps={args.steps}")
    if args.device == "cuda":
        extra.append("train.device=cuda")
    run_dir = folder / f"{side}-{len(list(folder.iterdir()))}"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(repo)
    cmd = [sys.executable, "-m", "dpresearch.train", *overrides, *extra, f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["threads_line"] = f"threads {summary.get('intra_op_threads', 'not recorded')}"
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", type=Path, default=STUDY)
    parser.add_argument("--case", default="top-k 1% + EF")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="cut the point to N steps")
    parser.add_argument("--old-repo", type=Path, default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sides", nargs="+", choices=["old", "new"], default=["old", "new"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("study_point_time: skipped: --device cuda but no CUDA GPU is visible")
            return 0
    data = REPO.parent / "shared" / "data" / "cifar10-subset"
    if "compression_subset" in str(args.study) and not data.is_dir():
        print(f"study_point_time: skipped: no CIFAR-10 subset at {data}")
        return 0
    overrides = point_overrides(args)
    results = bt.Results(
        args.json or bt.default_json("study_point_time"),
        "study_point_time",
        {
            **vars(args),
            "study": str(args.study),
            "json": None,
            "old_repo": str(args.old_repo) if args.old_repo else None,
            "overrides": overrides,
        },
    )
    load = lambda: " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"{args.case} | lr {args.lr:g} | seed {args.seed} on {args.device}; load {load()}")
    ratios, walls = [], {s: [] for s in args.sides}
    with tempfile.TemporaryDirectory(prefix="bench-point-", dir=REPO / "runs") as tmp:
        for r in range(args.rounds):
            order = args.sides if r % 2 == 0 else list(reversed(args.sides))
            got = {}
            for side in order:
                summary = run(side, overrides, args, Path(tmp))
                wall = summary["time/wall_s"]
                walls[side].append(wall)
                got[side] = wall
                rate = summary.get("samples", 0) / wall if wall else float("nan")
                print(
                    f"round {r} {side}: {wall:.1f} s for {summary['total_steps']} steps "
                    f"({summary['total_steps'] / wall:.3g} steps/s, {rate:.0f} images/s); "
                    f"{summary['threads_line']}; "
                    f"{summary.get('workers_compute', 'one worker per process')} "
                    f"(load {load()})",
                    flush=True,
                )
                results.add(
                    round=r,
                    side=side,
                    wall_s=wall,
                    samples=summary.get("samples"),
                    steps=summary["total_steps"],
                    load=load(),
                    threads=summary["threads_line"],
                )
            if {"old", "new"} <= got.keys():
                ratios.append(got["old"] / got["new"])
    if ratios:
        print(
            f"old ÷ new wall time: {statistics.median(ratios):.2f} {bt.fmt_range(ratios, 2)} "
            f"over {len(ratios)} rounds (load at the end {load()})"
        )
    results.write(ratios=ratios, walls=walls, end_load=load())
    print(f"wrote {results.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
