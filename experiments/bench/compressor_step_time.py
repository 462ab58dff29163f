"""Benchmark: per-step time of each compressor against identity, gloo × 2 processes (issue 4).

Two gloo processes on this machine (loopback, no shaping; one thread each) train every
compressor in turn on the same model and data: ResNet-20 on the CIFAR-10 subset (batch 32 per
worker) and an MLP on synthetic data (256-1024-1024-10, batch 128). The pair is started once
per benchmark — one process group, the data set loaded once — and each run is the ordinary
`Trainer` loop on a `DistributedCommunicator`, exactly what `python -m dpresearch.train
backend=gloo workers=2 backend.threads=1` runs in each worker.

Every row is timed the same way (see `bench_timing.py`): a step is the trainer's step region
(batch, forward, backward, compression, communication, optimizer; not logging), read from the
`time/compute_s + time/comm_s` rank 0 logs every 5 steps; a run's step time is the median
over those 5-step blocks after `--warmup` steps. Rounds alternate the order of the compressors
(forward, reversed, ...) so drift on a shared machine hits all alike. The table gives, per
compressor, the median step time over rounds and the median over rounds of its ratio to
identity's step time in the same round (the range in brackets). `exposed` is the
communication the step waited for (`time/comm_s`; on loopback mostly the wait for the slower
rank, not transfer) and `overlap` the communication hidden behind backward
(`time/comm_overlapped_s`), per step: identity without error feedback overlaps its bucketed
allreduce with backward as in training (`--no-overlap` turns that off for every row), the
compressors cannot. Each run is printed when it finishes and the results are rewritten to the
JSON file (`--json`) after each. Usage:

    python experiments/bench/compressor_step_time.py [--rounds 5] [--steps 30] [--warmup 5]
        [--models resnet20 mlp] [--compressors identity fp16 ...] [--no-overlap]
        [--json runs/bench/compressor_step_time.json]
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

from dpresearch import CONF_DIR

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from bench_cases import COMPRESSORS, DEFAULT_COMPRESSORS, MODELS, SUBSET
from bench_timing import Results, default_json, logged_block_times

LOG_EVERY = 5


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import dpresearch.train  # noqa: F401 - registers the schema

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def run_stats(metrics: Path, warmup: int) -> dict[str, float]:
    """Median step time over 5-step blocks, and per-step exposed and overlapped comm and
    bytes (algorithm, buffers) between step `warmup` and the last step."""
    rows = {row["step"]: row for row in map(json.loads, metrics.open())}
    first, last = rows[warmup], rows[max(rows)]
    n = last["step"] - warmup
    stats = {
        key: (last.get(metric, 0) - first.get(metric, 0)) / n
        for key, metric in (
            ("comm", "time/comm_s"),
            ("overlap", "time/comm_overlapped_s"),
            ("bytes", "comm/bytes"),
            ("bytes_buffers", "comm/bytes_buffers"),
        )
    }
    stats["step"] = statistics.median(logged_block_times(metrics, LOG_EVERY, warmup))
    return stats


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    import torch.distributed as dist

    from dpresearch.comm.distributed import DistributedCommunicator
    from dpresearch.config.validate import prepare_data, validate
    from dpresearch.run.build import network_model
    from dpresearch.run.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = Results(Path(out), "compressor_step_time", vars(args)) if rank == 0 else None
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
                f"algorithm.overlap={args.overlap}",
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
                        if results is not None:
                            stats = run_stats(Path(tmp) / "metrics.jsonl", args.warmup)
                            results.add(model=model, round=r, name=name, **stats)
                            print(
                                f"[{model} round {r + 1}/{args.rounds}] {name}: step "
                                f"{stats['step'] * 1e3:.1f} ms, exposed comm "
                                f"{stats['comm'] * 1e3:.2f} ms, overlapped "
                                f"{stats['overlap'] * 1e3:.2f} ms",
                                flush=True,
                            )
                    dist.barrier()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def table(results: list[dict], models: Sequence[str], compressors: Sequence[str]) -> None:
    print(
        f"\n{'model':9} {'compressor':17} {'KB/step':>8} {'step ms':>8} {'× identity':>10} "
        f"{'(range)':>13} {'exposed':>8} {'overlap':>8}"
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
                f"{statistics.median(r['comm'] for r in mine) * 1e3:8.2f} "
                f"{statistics.median(r['overlap'] for r in mine) * 1e3:8.2f}"
            )
    print(
        "KB/step: comm/bytes (the algorithm's payload; the BatchNorm broadcast is apart); "
        "exposed, overlap: ms of communication per step waited for / hidden behind backward"
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
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", type=Path, default=None, help="results file")
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
    out = args.json or default_json("compressor_step_time")
    args.json = str(out)
    print(f"results: {out}", flush=True)
    torch.multiprocessing.spawn(_worker, args=(args, port, str(out)), nprocs=2)
    results = json.loads(Path(out).read_text())["measurements"]
    print(
        f"gloo × 2 processes on loopback, 1 thread each; {args.steps - args.warmup} timed steps "
        f"after {args.warmup} per run, {args.rounds} alternating rounds"
    )
    table(results, args.models, args.compressors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
