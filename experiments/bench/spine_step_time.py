"""Benchmark: per-step time of the spine against plain torch (issue 2).

1. `sync` on gloo with 2 processes vs. torch DistributedDataParallel with 2 processes, same
   model, data, batch and threads (target ratio ≤ 1.03).
2. K=4 simulated workers in one process vs. one plain process stepping the global batch
   (4 × the per-worker batch; target ratio ≤ 1.10).

Rounds alternate ours / reference so machine noise hits both alike; each round reports the
median step time over its timed steps, and the table gives the median over rounds and the
ratio. Usage:

    python experiments/bench/spine_step_time.py [--rounds 3] [--steps 60] [--models mlp resnet20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
SUBSET = REPO.parent / "shared" / "data" / "cifar10-subset"
WARMUP = 10

MODELS = {
    "mlp": (
        [
            "data=synthetic",
            "data.num_train=16384",
            "data.num_features=256",
            "model=mlp",
            "model.hidden=[1024,1024]",
        ],
        128,
    ),
    "resnet20": (["data=cifar10", f"data.root={SUBSET}", "model=resnet20"], 32),
}


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import dpresearch.train  # noqa: F401 - registers the schema

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def ours(model: str, backend: str, workers: int, steps: int) -> float:
    """Median seconds per step of dpresearch, from the wall clock it logs every 10 steps
    (the final step, which also evaluates, is left out)."""
    from dpresearch.train import train

    overrides, batch = MODELS[model]
    threads = ["backend.threads=1"] if backend != "simulated" else []
    total = WARMUP + steps + 1
    cfg = compose(
        *overrides,
        f"backend={backend}",
        f"workers={workers}",
        f"train.batch_size={batch}",
        f"train.steps={total}",
        "train.log_every=10",
        "train.progress=false",
        "train.eval_every=100000",
        "train.save_model=false",
        *threads,
    )
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, Path(tmp))
        walls = [json.loads(ln)["time/wall_s"] for ln in (Path(tmp) / "metrics.jsonl").open()]
    walls = walls[:-1]  # drop the final (evaluating) step
    deltas = [(b - a) / 10 for a, b in zip(walls[:-1], walls[1:], strict=True)]
    return statistics.median(deltas)


def _build(model: str, cfg_overrides: list[str]):
    from hydra.utils import instantiate

    cfg = compose(*cfg_overrides)
    data = instantiate(cfg.data, device="cpu")
    torch.manual_seed(0)
    net = instantiate(cfg.model, num_classes=data.num_classes, input_shape=data.input_shape)
    return data, net


def _timed_loop(net, data, batch: int, steps: int, step_fn) -> float:
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(WARMUP + steps):
        idx = torch.randint(data.num_train, (batch,), generator=gen)
        x, y = data.train_batch(idx, gen)
        start = time.perf_counter()
        step_fn(x, y)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ddp_worker(rank: int, model: str, steps: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    data, net = _build(model, MODELS[model][0])
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def step(x, y):
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    median = _timed_loop(net, data, MODELS[model][1], steps, step)
    if rank == 0:
        Path(out).write_text(str(median))
    dist.barrier()
    dist.destroy_process_group()


def ddp(model: str, steps: int) -> float:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "median")
        torch.multiprocessing.spawn(_ddp_worker, args=(model, steps, port, out), nprocs=2)
        return float(Path(out).read_text())


def plain_global_batch(model: str, steps: int) -> float:
    """One process, one model, the global batch (4 × per-worker batch) per step."""
    data, net = _build(model, MODELS[model][0])
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step(x, y):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()

    return _timed_loop(net, data, 4 * MODELS[model][1], steps, step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    if not SUBSET.is_dir():
        args.models = [m for m in args.models if m != "resnet20"]
        print(f"(no CIFAR subset at {SUBSET}: resnet20 skipped)", file=sys.stderr)
    rows = []
    for model in args.models:
        pairs = {"gloo2": ([], []), "sim4": ([], [])}
        for _ in range(args.rounds):
            pairs["gloo2"][0].append(ours(model, "gloo", 2, args.steps))
            pairs["gloo2"][1].append(ddp(model, args.steps))
            pairs["sim4"][0].append(ours(model, "simulated", 4, args.steps))
            pairs["sim4"][1].append(plain_global_batch(model, args.steps))
        for name, (a, b) in pairs.items():
            rows.append((model, name, statistics.median(a), statistics.median(b)))
    print(f"\n{'model':10} {'comparison':44} {'ours ms':>9} {'ref ms':>9} {'ratio':>7} target")
    labels = {
        "gloo2": ("sync, gloo ×2 processes vs torch DDP", 1.03),
        "sim4": ("simulated K=4 vs one process, global batch", 1.10),
    }
    for model, name, a, b in rows:
        label, target = labels[name]
        print(f"{model:10} {label:44} {a * 1e3:9.2f} {b * 1e3:9.2f} {a / b:7.3f} ≤ {target}")


if __name__ == "__main__":
    main()
