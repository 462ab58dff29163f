"""Benchmark: the asynchronous simulator against a minimal event-driven delayed-SGD loop
(issue 16, item 4).

64 simulated workers of logistic regression (`model=logreg` on seeded synthetic inputs of
`--features` features, 10 classes, per-worker batch `--batch`), exponential compute times,
`--updates` pushes. Three sides, each timed over its training loop alone (set-up excluded):

- `ahead`: our training loop (`algorithm=async_sgd`, logging every 100 steps, one evaluation at
  the end) with `train.batched_workers=true`: the gradients of the workers in flight computed
  ahead in batched calls, pushes applied one at a time in event order;
- `one`: the same run with `train.batched_workers=false` (one push computed at a time);
- `minimal`: a delayed-SGD loop written here — a heap of arrivals, one parameter copy per
  worker (its pull), per push: gather the worker's next batch, forward/backward at its copy,
  the server's torch optimizer step, copy the server's parameters into the worker's row, draw
  its next arrival. No logging, no statistics, no protocol, no checkpoints.
- `ideal` (`--sides ... ideal`): the floor of computing ahead — the minimal loop, computing ahead
  exactly as ours does (when a worker not yet computed is named, every such worker in flight
  at once) with logistic regression's gradient written out in closed form over the stacked
  rows, in the fastest form measured on a CPU (one gather; class-major logits W·xᵀ + b by
  `baddbmm`; softmax over classes; the weight gradient (p − onehot)·x / B by one `bmm` into
  the gradient rows: no autograd, no vmap, no transposed operand). Where it is not ≤ 0.8 of
  the minimal loop, no implementation of computing ahead on this machine is.

Rounds alternate the order of the sides; per round each side's time ÷ the minimal loop's;
printed: median and range over rounds, the load before → after. `--clock cpu` times the
process's CPU seconds (`time.thread_time`; a loaded machine's other jobs inflate it far less
than wall time), `--clock wall` wall seconds. Target: ahead ÷ minimal ≤ 0.8.
Usage:

    python experiments/bench/async_vs_minimal.py [--rounds 5] [--updates 10000] [--workers 64]
        [--features 3072] [--batch 64] [--clock cpu|wall] [--sides ahead one minimal]
        [--out PATH]
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_overhead import compose
from bench_timing import default_json

CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def ours(args, batched: str) -> float:
    """Seconds of `Trainer.run()` (the loop, not the set-up) with `train.batched_workers`."""
    from dpresearch.comm.simulated import SimulatedCommunicator
    from dpresearch.run.build import network_model
    from dpresearch.run.trainer import Trainer

    cfg = compose(args, f"train.batched_workers={batched}", "backend.threads=1")
    trainer = Trainer(
        cfg, SimulatedCommunicator(cfg.workers, network_model(cfg)), torch.device("cpu"), None
    )
    ahead = trainer.algorithm.describe()["async"].get("compute_ahead")
    assert ahead == (batched == "true"), ahead
    clock = CLOCKS[args.clock]
    start = clock()
    trainer.run()
    return clock() - start


def reference(args) -> tuple:
    """The hand-written loops' set-up (untimed): training inputs and targets, each worker's
    batches of indices (its shard's first epoch, cycled), the server's optimizer, weight and
    bias (the run's model and optimizer from the same seed), the arrival draws and the heap of
    first arrivals (exponential compute times of mean 1)."""
    from hydra.utils import instantiate

    from dpresearch.optim import make_optimizer

    cfg = compose(args)
    k, b = args.workers, args.batch
    data = instantiate(cfg.data, device="cpu")
    partitioner = data.make_partitioner(k, cfg.seed)
    torch.manual_seed(cfg.seed)
    server = instantiate(cfg.model, num_classes=data.num_classes, input_shape=data.input_shape)
    optimizer = make_optimizer(cfg.optimizer, server)
    shards = [partitioner.epoch_indices(w, 0) for w in range(k)]
    batches = [s[: len(s) // b * b].split(b) for s in shards]
    draws = random.Random(cfg.seed)
    heap = [(draws.expovariate(1.0), w) for w in range(k)]
    heapq.heapify(heap)
    return (
        data.train_inputs,
        data.train_targets,
        batches,
        optimizer,
        server.linear.weight,
        server.linear.bias,
        draws,
        heap,
    )


def minimal(args) -> tuple[float, Tensor]:
    """Seconds of a minimal event-driven delayed-SGD loop doing the same number of pushes on
    the same data, model and server optimizer (see the module docstring), and the server's
    final weight."""
    inputs, targets, batches, optimizer, weight, bias, draws, heap = reference(args)
    k = args.workers
    # each worker's pull
    rows_w = [weight.detach().clone().requires_grad_() for _ in range(k)]
    rows_b = [bias.detach().clone().requires_grad_() for _ in range(k)]
    cursors = [0] * k
    clock = CLOCKS[args.clock]
    start = clock()
    for _ in range(args.updates):
        now, w = heapq.heappop(heap)
        index = batches[w][cursors[w] % len(batches[w])]
        cursors[w] += 1
        x, y = inputs.index_select(0, index), targets.index_select(0, index)
        ww, bw = rows_w[w], rows_b[w]
        loss = F.cross_entropy(F.linear(x, ww, bw), y)
        weight.grad, bias.grad = torch.autograd.grad(loss, (ww, bw))
        optimizer.step()
        with torch.no_grad():
            ww.copy_(weight)
            bw.copy_(bias)
        heapq.heappush(heap, (now + draws.expovariate(1.0), w))
    return clock() - start, weight.detach()


def ideal(args) -> tuple[float, Tensor]:
    """Seconds of the minimal loop computing ahead with a closed-form batched gradient (the
    floor of computing ahead; see the module docstring), and the server's final weight: the
    same events and updates as `minimal`.

    The fastest form measured on a CPU: logits transposed, `[S, C, B]` = W·xᵀ + b (a product
    with 10 outputs is ~1.6x faster that way round than x·Wᵀ), softmax over classes in that
    layout, and the weight gradient `[S, C, D]` = (p − onehot)·x / B written in place into
    the rows' gradient rows (`bmm(out=)` where the rows are consecutive) — no transposed
    operand, no autograd, no vmap."""
    inputs, targets, batches, optimizer, weight, bias, draws, heap = reference(args)
    k, b = args.workers, args.batch
    c, d = weight.shape
    with torch.no_grad():
        rows_w, rows_b = weight.expand(k, -1, -1).clone(), bias.expand(k, -1).clone()
    grads_w, grads_b = torch.empty_like(rows_w), torch.empty_like(rows_b)
    cursors, held = [0] * k, [False] * k
    # position of (row s, class y, example j) in a flat [S, C, B] block: s·C·B + y·B + j
    strides = (torch.arange(k) * c * b).repeat_interleave(b), torch.arange(b).repeat(k)
    clock = CLOCKS[args.clock]
    start = clock()
    with torch.no_grad():
        for _ in range(args.updates):
            now, w = heapq.heappop(heap)
            if not held[w]:
                rows = sorted([w, *(v for _, v in heap if not held[v])])
                index = []
                for v in rows:
                    index.append(batches[v][cursors[v] % len(batches[v])])
                    cursors[v] += 1
                    held[v] = True
                s = len(rows)
                flat = torch.cat(index)
                x = inputs.index_select(0, flat).view(s, b, d)
                y = targets.index_select(0, flat)
                r = torch.tensor(rows)
                w_rows, b_rows = rows_w.index_select(0, r), rows_b.index_select(0, r)
                p = torch.baddbmm(b_rows.unsqueeze(2), w_rows, x.transpose(1, 2)).softmax(1)
                at = strides[0][: s * b] + y * b + strides[1][: s * b]
                p.view(-1).index_add_(0, at, torch.full((s * b,), -1.0)).div_(b)
                if rows[-1] - rows[0] + 1 == s:  # consecutive rows: straight into theirs
                    torch.bmm(p, x, out=grads_w[rows[0] : rows[-1] + 1])
                    torch.sum(p, 2, out=grads_b[rows[0] : rows[-1] + 1])
                else:
                    grads_w.index_copy_(0, r, torch.bmm(p, x))
                    grads_b.index_copy_(0, r, p.sum(2))
            held[w] = False
            weight.grad, bias.grad = grads_w[w], grads_b[w]
            optimizer.step()
            rows_w[w].copy_(weight)
            rows_b[w].copy_(bias)
            heapq.heappush(heap, (now + draws.expovariate(1.0), w))
    return clock() - start, weight.detach()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--features", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu")
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=["ahead", "one", "minimal", "ideal"],
        default=["ahead", "one", "minimal"],
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results file (default: runs/bench/<script>-<time>.json)",
    )
    args = parser.parse_args(argv)
    args.out = args.out or default_json("async_vs_minimal")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if "minimal" not in args.sides:
        parser.error("--sides must include minimal (the reference)")
    run = {
        "ahead": lambda: ours(args, "true"),
        "one": lambda: ours(args, "false"),
        "minimal": lambda: minimal(args)[0],
        "ideal": lambda: ideal(args)[0],
    }
    load_before = os.getloadavg()[0]
    seconds: dict[str, list[float]] = {side: [] for side in args.sides}
    for r in range(args.rounds):
        order = args.sides[r % len(args.sides) :] + args.sides[: r % len(args.sides)]
        for side in order:
            seconds[side].append(run[side]())
        per_push = {s: 1e6 * seconds[s][-1] / args.updates for s in args.sides}
        print(
            f"round {r} ({', '.join(order)}): "
            + ", ".join(f"{s} {us:.0f} µs/push" for s, us in per_push.items())
            + " | "
            + ", ".join(
                f"{s}/minimal {per_push[s] / per_push['minimal']:.3f}"
                for s in args.sides
                if s != "minimal"
            ),
            flush=True,
        )
    load_after = os.getloadavg()[0]
    ratios = {
        s: [a / m for a, m in zip(seconds[s], seconds["minimal"], strict=True)]
        for s in args.sides
        if s != "minimal"
    }
    result = {
        "workers": args.workers, "updates": args.updates, "features": args.features,
        "batch": args.batch, "clock": args.clock, "rounds": args.rounds,
        "us_per_push": {s: 1e6 * statistics.median(v) / args.updates for s, v in seconds.items()},
        "ratio_median": {s: statistics.median(v) for s, v in ratios.items()},
        "ratio_range": {s: [min(v), max(v)] for s, v in ratios.items()},
        "seconds": seconds, "load": [load_before, load_after], "target_ahead": 0.8,
    }  # fmt: skip
    print(
        f"\n{args.workers} workers, logistic regression ({args.features} features, batch "
        f"{args.batch}), {args.updates} pushes, {args.rounds} rounds, {args.clock} clock, "
        f"load {load_before:.1f} → {load_after:.1f}"
    )
    print("| side | µs/push (median) | ÷ minimal loop: median [range] | target |")
    print("|---|---|---|---|")
    for side in args.sides:
        us = result["us_per_push"][side]
        if side == "minimal":
            print(f"| minimal | {us:.0f} | 1 | |")
            continue
        lo, hi = result["ratio_range"][side]
        target = "≤ 0.8" if side == "ahead" else ""
        print(
            f"| {side} | {us:.0f} | {result['ratio_median'][side]:.3f} [{lo:.3f}–{hi:.3f}] "
            f"| {target} |"
        )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
