"""Benchmark: per-step time of the spine against plain torch (issue 2; measured as issue 11 asks).

1. `sync` on gloo with 2 processes vs. torch DistributedDataParallel with 2 processes, same
   model, data pipeline, optimizer, batch and threads (target ratio ≤ 1.03).
2. K=4 simulated workers in one process vs. one plain process stepping the global batch
   (4 × the per-worker batch; target ratio ≤ 1.10).

Both sides are timed alike (see `bench_timing.py`). A step is producing the batch (index
gather, augmentation), forward, backward, communication and the optimizer step, on both sides.
Ours is the trainer itself (`Trainer.run`, the loop the CLI runs, on the communicator the CLI
builds) and its figure is the step regions it logs (`time/compute_s + time/comm_s`: not the
logging and evaluation between steps); the reference loop is timed around the same work.

Both sides live in the same processes and take turns in blocks of `--block` steps, the order
alternating every round (ours, ref; ref, ours; ...): a shared machine's load, which drifts over
seconds to minutes, then hits both sides of a round alike. One block of each side per round;
the first `--warmup` steps of each side are not timed. The table gives each side's median
block time (mean step time of a block) over rounds and the median over rounds of the per-round
ratio, with its range. Every process runs `--threads` intra-op threads (default 1: on a shared
2-core machine more threads measure contention, not the code). Rounds are printed as they
finish and the results rewritten to the JSON file (`--json`) after each. The trainer evaluates
at the end of each block on an 8-image test split (outside the timed step regions). Usage:

    python experiments/bench/spine_step_time.py [--rounds 8] [--block 10] [--warmup 10]
        [--models mlp resnet20] [--comparisons gloo2 sim4] [--threads 1] [--json PATH]
        [--batched-workers auto|false|stacked|vmap]
"""

from __future__ import annotations

import argparse
import copy
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dpresearch import CONF_DIR

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from bench_cases import MODELS, SUBSET
from bench_timing import (
    Results,
    default_json,
    fmt_range,
    pin_threads,
    spread,
    timed_block_times,
)

COMPARISONS = {
    "gloo2": ("sync, gloo ×2 processes vs torch DDP", 1.03),
    "sim4": ("simulated K=4 vs one process, global batch", 1.10),
}
TEST_IMAGES = 8


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import dpresearch.train  # noqa: F401 - registers the schema

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def batch_size(model: str) -> int:
    return next(int(o.split("=")[1]) for o in MODELS[model] if o.startswith("train.batch_size="))


class Sides:
    """Our trainer and the reference loop for one comparison, in this process; each call of
    `ours()` / `ref()` runs one block and returns its mean step time."""

    def __init__(self, model: str, name: str, args: argparse.Namespace) -> None:
        from hydra.utils import instantiate

        from dpresearch.config.validate import prepare_data, validate
        from dpresearch.optim import make_optimizer
        from dpresearch.run.build import network_model
        from dpresearch.run.trainer import Trainer

        backend, workers = ("gloo", 2) if name == "gloo2" else ("simulated", 4)
        cfg = compose(
            *MODELS[model],
            f"backend={backend}",
            f"workers={workers}",
            f"backend.threads={args.threads}",
            f"train.steps={args.block}",
            f"train.log_every={args.block}",
            "train.progress=false",
            "train.save_model=false",
            f"train.batched_workers={args.batched_workers}",
        )
        validate(cfg)
        data = copy.copy(prepare_data(cfg))
        data.test_inputs = data.test_inputs[:TEST_IMAGES]
        data.test_targets = data.test_targets[:TEST_IMAGES]
        if name == "gloo2":
            from dpresearch.comm.distributed import DistributedCommunicator

            comm = DistributedCommunicator(network_model(cfg))
        else:
            from dpresearch.comm.simulated import SimulatedCommunicator

            comm = SimulatedCommunicator(workers, network_model(cfg))
        self.trainer = Trainer(cfg, comm, torch.device("cpu"), None, data)
        self.block = args.block

        torch.manual_seed(0)
        net = instantiate(cfg.model, num_classes=data.num_classes, input_shape=data.input_shape)
        if name == "gloo2":
            net = torch.nn.parallel.DistributedDataParallel(net)
        opt = make_optimizer(cfg.optimizer, net)
        batch = batch_size(model) * (1 if name == "gloo2" else 4)
        gen = torch.Generator().manual_seed(0)

        def step() -> None:
            x, y = data.train_batch(self._indices.pop(), gen)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()

        def fresh_indices() -> list[torch.Tensor]:
            return [torch.randint(data.num_train, (batch,), generator=gen) for _ in range(64)]

        self._step: Callable[[], None] = step
        self._fresh = fresh_indices
        self._indices: list[torch.Tensor] = []

    def ours(self) -> float:
        summary = self.trainer.run()
        return (summary["time/compute_s"] + summary["time/comm_s"]) / self.block

    def ref(self) -> float:
        if len(self._indices) < self.block:
            self._indices = self._fresh()  # index generation outside the timed steps
        return timed_block_times(self._step, self.block, 0, self.block, lambda: None)[0]


def measure(
    model: str, name: str, args: argparse.Namespace, report: Callable[[dict], None] | None
) -> None:
    """Warm both sides up, then `args.rounds` rounds of one block each, alternating order;
    `report` (rank 0 only) receives each round."""
    sides = Sides(model, name, args)
    for _ in range(args.warmup // args.block):
        sides.ours()
        sides.ref()
    for r in range(args.rounds):
        got = {}
        for side in ("ours", "ref") if r % 2 == 0 else ("ref", "ours"):
            got[side] = getattr(sides, side)()
        if report is not None:
            report({"model": model, "comparison": name, "round": r, **got})


def _gloo_worker(rank: int, args: argparse.Namespace, port: int) -> None:
    pin_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        reporter = Reporter(args) if rank == 0 else None
        for model in args.models:
            measure(model, "gloo2", args, reporter)
            dist.barrier()
        dist.barrier()
    finally:
        dist.destroy_process_group()


class Reporter:
    """Prints each round and adds it to the run's JSON file (created by `main`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.results = Results.resume(Path(args.json))
        self.rounds = args.rounds

    def __call__(self, record: dict) -> None:
        self.results.add(**record)
        print(
            f"[{record['model']} {record['comparison']} round {record['round'] + 1}/"
            f"{self.rounds}] ours {record['ours'] * 1e3:.2f} ms, ref {record['ref'] * 1e3:.2f} "
            f"ms, ratio {record['ours'] / record['ref']:.3f}",
            flush=True,
        )


def table(measurements: list[dict]) -> list[dict]:
    rows = []
    keys = dict.fromkeys((m["model"], m["comparison"]) for m in measurements)
    for model, name in keys:
        mine = [m for m in measurements if (m["model"], m["comparison"]) == (model, name)]
        ratios = [m["ours"] / m["ref"] for m in mine]
        rows.append(
            {
                "model": model,
                "comparison": name,
                "ours_ms": statistics.median(m["ours"] for m in mine) * 1e3,
                "ref_ms": statistics.median(m["ref"] for m in mine) * 1e3,
                "ratio": spread(ratios),
                "rounds": len(mine),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=10, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per side")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--comparisons", nargs="+", default=list(COMPARISONS), choices=list(COMPARISONS)
    )
    parser.add_argument("--json", type=Path, default=None, help="results file")
    parser.add_argument(
        "--batched-workers",
        default="auto",
        choices=["auto", "false", "stacked", "vmap", "true"],
        help="train.batched_workers of the simulated side",
    )
    args = parser.parse_args(argv)
    if args.warmup % args.block or args.rounds < 2:
        parser.error("--warmup: a multiple of --block; --rounds ≥ 2")
    if not SUBSET.is_dir():
        args.models = [m for m in args.models if m != "resnet20"]
        print(f"(no CIFAR subset at {SUBSET}: resnet20 skipped)", file=sys.stderr)
    args.json = str(args.json or default_json("spine_step_time"))
    Results(Path(args.json), "spine_step_time", vars(args))
    print(
        f"{args.rounds} rounds × one block of {args.block} steps per side after {args.warmup} "
        f"warm-up steps, {args.threads} thread(s) per process; results: {args.json}",
        flush=True,
    )
    start = time.monotonic()
    if "gloo2" in args.comparisons:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(_gloo_worker, args=(args, port), nprocs=2)
    if "sim4" in args.comparisons:
        pin_threads(args.threads)
        reporter = Reporter(args)
        for model in args.models:
            measure(model, "sim4", args, reporter)
    results = Results.resume(Path(args.json))
    rows = table(results.data["measurements"])
    results.write(summary=rows, seconds=time.monotonic() - start)
    print(
        f"\n{'model':9} {'comparison':44} {'ours ms':>8} {'ref ms':>8} {'ratio':>6} "
        f"{'(range over rounds)':>19} target"
    )
    for row in rows:
        label, target = COMPARISONS[row["comparison"]]
        ratio = row["ratio"]
        print(
            f"{row['model']:9} {label:44} {row['ours_ms']:8.2f} {row['ref_ms']:8.2f} "
            f"{ratio['median']:6.3f} {fmt_range([ratio['min'], ratio['max']]):>19} ≤ {target}"
        )
    print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
