"""Benchmark: per-step time of each compressor against identity, gloo × 2 processes (issue 4).

Two gloo processes on this machine (loopback, no shaping; one thread each) train every
compressor in turn on the same model and data: ResNet-20 on the CIFAR-10 subset (batch 32 per
worker) and an MLP on synthetic data (256-1024-1024-10, batch 128). The pair is started once
per benchmark — one process group, the data set loaded once — and each run is the ordinary
`Trainer` loop on a `DistributedCommunicator`, exactly what `python -m dpresearch.train
backend=gloo workers=2 backend.threads=1` runs in each worker.

Per run, step time = (wall clock at step N − at step `--warmup`) / (N − warmup), from the
`time/wall_s` that rank 0 logs every 5 steps (the final evaluation is logged after the clock
is read). Rounds alternate the order of the compressors (forward, reversed, ...) so drift on a
shared machine hits all alike. The table gives, per compressor, the median step time over
rounds and the median over rounds of its ratio to identity's step time in the same round (the
range in brackets). `comm` is the time rank 0 spent inside the recorded collectives
(`time/comm_s`): on loopback mostly the wait for the slower rank, not transfer. Usage:

    python experiments/bench/compressor_step_time.py [--rounds 5] [--steps 30] [--warmup 5]
        [--models resnet20 mlp] [--compressors identity fp16 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from bench_cases import COMPRESSORS, DEFAULT_COMPRESSORS, MODELS, REPO, SUBSET  # noqa: E402

LOG_EVERY = 5


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import dpresearch.train  # noqa: F401 - registers the schema

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def run_stats(metrics: Path, warmup: int) -> dict[str, float]:
    """Per-step wall time, measured comm and bytes between step `warmup` and the last step."""
    rows = {row["step"]: row for row in map(json.loads, metrics.open())}
    first, last = rows[warmup], rows[max(rows)]
    n = last["step"] - warmup
    return {
        key: (last[metric] - first[metric]) / n
        for key, metric in (
            ("step", "time/wall_s"),
            ("comm", "time/comm_s"),
            ("bytes", "comm/bytes"),
        )
    }


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    import torch.distributed as dist

    from dpresearch.comm.distributed import DistributedCommunicator
    from dpresearch.launch import network_model
    from dpresearch.trainer import Trainer
    from dpresearch.validate import prepare_data, validate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results: list[dict] = []
    try:
        for model in args.models:
            base = [
                *MODELS[model],
                "backend=gloo",
                "workers=2",
                "backend.threads=1",
                f"train.steps={args.steps}",
                f"train.log_every={LOG_EVERY}",
                "train.progress=false",
                "train.eval_every=100000",
                "train.save_model=false",
            ]
            dataset = prepare_data(compose(*base))
            for r in range(args.rounds):
                order = args.compressors if r % 2 == 0 else args.compressors[::-1]
                for name in order:
                    cfg = compose(*base, *COMPRESSORS[name])
                    validate(cfg)
                    comm = DistributedCommunicator(network_model(cfg))
                    with tempfile.TemporaryDirectory() as tmp:
                        run_dir = Path(tmp) if rank == 0 else None
                        Trainer(cfg, comm, torch.device("cpu"), run_dir, dataset).run()
                        if rank == 0:
                            stats = run_stats(Path(tmp) / "metrics.jsonl", args.warmup)
                            results.append({"model": model, "round": r, "name": name, **stats})
                    dist.barrier()
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def table(results: list[dict], models: Sequence[str], compressors: Sequence[str]) -> None:
    print(
        f"\n{'model':9} {'compressor':17} {'KB/step':>8} {'step ms':>8} {'× identity':>10} "
        f"{'(range)':>13} {'comm ms':>8}"
    )
    for model in models:
        runs = [r for r in results if r["model"] == model]
        base = {r["round"]: r["step"] for r in runs if r["name"] == "identity"}
        for name in compressors:
            mine = [r for r in runs if r["name"] == name]
            step = statistics.median(r["step"] for r in mine)
            ratios = [r["step"] / base[r["round"]] for r in mine] if base else [float("nan")]
            print(
                f"{model:9} {name:17} {mine[0]['bytes'] / 1e3:8.1f} {step * 1e3:8.1f} "
                f"{statistics.median(ratios):10.3f} "
                f"{f'[{min(ratios):.2f}–{max(ratios):.2f}]':>13} "
                f"{statistics.median(r['comm'] for r in mine) * 1e3:8.2f}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--compressors", nargs="+", default=DEFAULT_COMPRESSORS, choices=list(COMPRESSORS)
    )
    args = parser.parse_args(argv)
    if args.warmup % LOG_EVERY or args.steps % LOG_EVERY or not 0 < args.warmup < args.steps:
        parser.error(f"--warmup and --steps: multiples of {LOG_EVERY}, 0 < warmup < steps")
    if "identity" not in args.compressors:
        args.compressors = ["identity", *args.compressors]
    if "resnet20" in args.models and not SUBSET.is_dir():
        args.models = [m for m in args.models if m != "resnet20"]
        print(f"(no CIFAR subset at {SUBSET}: resnet20 skipped)", file=sys.stderr)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        torch.multiprocessing.spawn(_worker, args=(args, port, out), nprocs=2)
        results = json.loads(Path(out).read_text())
    print(
        f"gloo × 2 processes on loopback, 1 thread each; {args.steps - args.warmup} timed steps "
        f"after {args.warmup} per run, {args.rounds} alternating rounds"
    )
    table(results, args.models, args.compressors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
