"""The optimizer step alone: K workers' optimizers stepping on the stacked rows (one call per
parameter group, `stacked_step.step_together`) against K per-worker `opt.step()` calls
(issue 42, items 2-3).

K = `--workers` replicas (`Replicas`, flat `[K, D]` rows) of a GPT (`--model`, a conf/model
preset; default gpt, 1.8 M parameters) with one optimizer each (`--optimizers`: adamw —
nanoGPT's AdamW with its decay / no-decay groups, `optimizer=adamw_lm` —, muon — MuonAdamW,
`optimizer=muon`), seeded gradients written into the rows. Sides, alternating in rounds (the
order reversed every other round): `stacked` and `per_worker`, each `--steps` steps after
`--warmup`, both from the same state. Prints the ratio per_worker ÷ stacked of the time per step,
median [range] over rounds, and the load. `--clock cpu` (default on a CPU) reads this thread's
CPU time; on a GPU the wall clock after a synchronize.

    python experiments/bench/stacked_optimizer.py [--model gpt] [--workers 8] [--rounds 5]
        [--steps 10] [--warmup 2] [--optimizers adamw muon] [--device cpu|cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_timing as bt  # noqa: E402

OPTIMIZERS = {"adamw": "adamw_lm", "muon": "muon"}
SIDES = ("stacked", "per_worker")


def build(args, name: str):
    """The replicas and their optimizers (the same seeded start for every side)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from dpresearch.optim import make_optimizer
    from dpresearch.replicas import Replicas

    conf = REPO / "dpresearch" / "conf"
    node = OmegaConf.load(conf / "model" / f"{args.model}.yaml")
    torch.manual_seed(0)
    model = instantiate(node, num_classes=65, input_shape=(int(node.block_size),))
    device = torch.device(args.device)
    replicas = Replicas(model, args.workers, device)
    cfg = OmegaConf.load(conf / "optimizer" / f"{OPTIMIZERS[name]}.yaml")
    return replicas, [make_optimizer(cfg, m) for m in replicas.models]


def time_side(args, name: str, side: str) -> float:
    """Median seconds per step of one side (`--steps` steps after `--warmup`)."""
    from dpresearch.stacked_step import FlatRows, step_together

    replicas, optimizers = build(args, name)
    rows = FlatRows(replicas.params, replicas.grads)
    generator = torch.Generator().manual_seed(1)
    grads = torch.randn(replicas.grads.shape, generator=generator).to(replicas.grads.device)
    times = []
    for i in range(args.warmup + args.steps):
        replicas.grads.copy_(grads)
        sync(args)
        start = args.read()
        if side == "stacked":
            step_together(optimizers, rows)
        else:
            for opt in optimizers:
                opt.step()
        sync(args)
        if i >= args.warmup:
            times.append(args.read() - start)
    if side == "stacked":
        assert rows.spans, "the stacked side did not step on the rows"
    return statistics.median(times)


def sync(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--device", default="cpu", choices=["cuda", "cpu"])
    parser.add_argument("--clock", choices=["cpu", "wall"], default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not bt.device_clock(args, "stacked_optimizer"):
        return 0
    clock = args.clock
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "read")}
    results = bt.Results(
        args.json or bt.default_json("stacked_optimizer"),
        "stacked_optimizer",
        settings | {"device_name": name, "clock": clock},
    )
    print(
        f"optimizer step, model={args.model}, K={args.workers} on {name}, {clock} clock; "
        f"{bt.load()}",
        flush=True,
    )
    summary = {}
    for opt in args.optimizers:
        steps: dict[str, list[float]] = {s: [] for s in SIDES}
        for r in range(args.rounds):
            for side in SIDES if r % 2 == 0 else reversed(SIDES):
                steps[side].append(time_side(args, opt, side))
            results.add(optimizer=opt, round=r, step_s={s: steps[s][-1] for s in SIDES})
        ratio = [p / s for p, s in zip(steps["per_worker"], steps["stacked"], strict=True)]
        summary[opt] = ratio
        print(
            f"| {opt} | stacked {statistics.median(steps['stacked']) * 1e3:.2f} ms "
            f"| per worker {statistics.median(steps['per_worker']) * 1e3:.2f} ms "
            f"| per_worker ÷ stacked {statistics.median(ratio):.2f} {bt.fmt_range(ratio)} |",
            flush=True,
        )
    print(f"{bt.load()} at the end")
    results.finish(summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
