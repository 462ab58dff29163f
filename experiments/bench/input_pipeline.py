"""Benchmark: the input pipeline's share of a training step, measured inside the loop (issue 3;
measured as issue 11 asks).

One loop per model, as the trainer runs it on one worker: each iteration (a) produces the
training batch — index gather from the uint8 tensors, random crop + flip, normalisation — then
(b) runs forward, backward and the SGD step on it. Both are timed in the same iterations, so
caches, allocator and CPU state are what training sees (timing the pipeline alone in a tight
loop at batch 128 understates its share at batch 32 by up to ~6×). Per round: share =
Σ pipeline / Σ (pipeline + model step) over `--steps` iterations after `--warmup`; the table
gives the median share over `--rounds` rounds and its range, and the pipeline's median time
alone in a tight loop for comparison. Target: share ≤ 5%. One thread by default (the
per-process setting of multi-process training on this machine). Results are printed per round
and written as JSON (`--json`).

    python experiments/bench/input_pipeline.py [--root ../shared/data/cifar10-subset]
        [--batch 32] [--models resnet20 resnet18] [--device cpu|cuda] [--threads 1]
        [--rounds 5] [--steps 20] [--json runs/bench/input_pipeline.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from bench_timing import REPO, Results, default_json, fmt_range, pin_threads

from dpresearch.data.cifar import CIFAR10
from dpresearch.models.resnet18 import ResNet18
from dpresearch.models.resnet_cifar import ResNetCifar

MODELS = {
    "resnet20": lambda: ResNetCifar(num_classes=10, input_shape=(3, 32, 32), depth=20),
    "resnet18": lambda: ResNet18(num_classes=10, input_shape=(3, 32, 32)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(REPO.parent / "shared/data/cifar10-subset"))
    parser.add_argument("--batch", type=int, default=32, help="per-worker batch")
    parser.add_argument("--models", nargs="+", default=["resnet20", "resnet18"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed iterations per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    pin_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    data = CIFAR10.load(args.root, device=str(device))
    gen = torch.Generator().manual_seed(0)
    path = args.json or default_json("input_pipeline")
    results = Results(path, "input_pipeline", {k: str(v) for k, v in vars(args).items()})

    def batch():
        idx = torch.randint(data.num_train, (args.batch,), generator=gen)
        return data.train_batch(idx, gen)

    print(
        f"device {device}, batch {args.batch}, {args.threads} thread(s); {args.rounds} rounds × "
        f"{args.steps} iterations after {args.warmup}; results: {path}",
        flush=True,
    )
    rows = []
    for name in args.models:
        model = MODELS[name]().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        shares, pipe_times, model_times = [], [], []
        for r in range(args.rounds):
            pipe = step = 0.0
            for i in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                x, y = batch()
                sync()
                t1 = time.perf_counter()
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                sync()
                t2 = time.perf_counter()
                if i >= args.warmup:
                    pipe, step = pipe + t1 - t0, step + t2 - t1
            shares.append(pipe / (pipe + step))
            pipe_times.append(pipe / args.steps)
            model_times.append(step / args.steps)
            results.add(model=name, round=r, pipeline_s=pipe_times[-1], step_s=model_times[-1])
            print(
                f"[{name} round {r + 1}/{args.rounds}] pipeline {pipe_times[-1] * 1e3:.2f} ms, "
                f"fwd+bwd+step {model_times[-1] * 1e3:.1f} ms, share {shares[-1]:.2%}",
                flush=True,
            )
        isolated = []
        for i in range(args.warmup + 5 * args.steps):
            t0 = time.perf_counter()
            batch()
            sync()
            if i >= args.warmup:
                isolated.append(time.perf_counter() - t0)
        rows.append(
            {
                "model": name,
                "pipeline_ms": statistics.median(pipe_times) * 1e3,
                "step_ms": statistics.median(model_times) * 1e3,
                "share": statistics.median(shares),
                "share_range": [min(shares), max(shares)],
                "isolated_pipeline_ms": statistics.median(isolated) * 1e3,
            }
        )
        results.write(summary=rows)
    print(
        f"\n{'model':10} {'pipeline ms':>12} {'fwd+bwd+step':>13} {'share':>7} "
        f"{'(range)':>15} {'isolated ms':>12}  target share ≤ 5%"
    )
    for row in rows:
        print(
            f"{row['model']:10} {row['pipeline_ms']:12.2f} {row['step_ms']:13.1f} "
            f"{row['share']:7.2%} {fmt_range([s * 100 for s in row['share_range']], 2):>15} "
            f"{row['isolated_pipeline_ms']:12.2f}"
        )
    print(f"(range in %) results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
