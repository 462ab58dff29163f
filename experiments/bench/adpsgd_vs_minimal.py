"""Benchmark: our AD-PSGD against a minimal hand-written AD-PSGD loop (issue 31, item 4).

`--workers` simulated workers on a ring (`algorithm=adpsgd`, random pairing, exponential
compute times) of logistic regression (`model=logreg` on seeded synthetic inputs of
`--features` features, 10 classes, per-worker batch `--batch`), `--updates` events (one
gradient, one pairwise average, one local SGD step each). Two sides, each timed over its
training loop alone (set-up excluded):

- `ours`: our training loop (`Trainer.run()`: logging every `--log-every` steps, 100 by
  default, each with the consensus distance, and one evaluation of every local model at the
  end; `--log-every` equal to `--updates` logs once, at the end — the nearest to the minimal
  loop's work, which logs nothing);
- `minimal`: AD-PSGD written here in the most direct PyTorch — the K models as rows of one
  flat `[K, D]` tensor and the reads x̂ as another, a heap of arrival times; per event: pop
  the earliest worker i, draw its partner j, gather its next batch, forward/backward of the
  linear model at its read (views of its read row), x_i, x_j ← (x_i + x_j)/2, x_i −= η·g,
  x̂_i ← x_i, push i's next arrival. No logging, statistics, messages, ledger or checkpoints.

Both do the same work: the minimal loop draws its compute times and partners from the same
seeded streams as ours (`asynchrony/speed.py`, `Pairing`: numpy PCG64 seeded by
`stream_seed(...)`, drawn here in one block per worker up front), takes the same batches
(each worker's partitioner order, epoch after epoch) and the same initial model, and does
the same float32 operations in the same order — so the two end at bit-identical parameters,
which the benchmark checks (it stops with an error otherwise).

Rounds alternate the order of the sides; per round ours ÷ minimal (the same number of
updates: the ratio per update); printed: median and range over rounds, the load before →
after. `--clock cpu` times this thread's CPU seconds (`time.thread_time`; a loaded machine's
other jobs inflate it far less than wall time), `--clock wall` wall seconds. One torch thread.
Target: ours ÷ minimal ≤ 1.15.
Usage:

    python experiments/bench/adpsgd_vs_minimal.py [--rounds 5] [--updates 10000] [--workers 16]
        [--features 3072] [--batch 64] [--log-every 100] [--clock cpu|wall]
        [--out runs/bench/adpsgd_vs_minimal.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_overhead import compose

CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
TARGET = 1.15


def config(args):
    return compose(
        args, "backend.threads=1", f"train.log_every={args.log_every}", algorithm="adpsgd"
    )


def ours(args) -> tuple[float, Tensor]:
    """Seconds of `Trainer.run()` (the loop, not the set-up) and the K final models' rows."""
    from dpresearch.comm.simulated import SimulatedCommunicator
    from dpresearch.run.build import network_model
    from dpresearch.run.trainer import Trainer

    cfg = config(args)
    trainer = Trainer(
        cfg, SimulatedCommunicator(cfg.workers, network_model(cfg)), torch.device("cpu"), None
    )
    clock = CLOCKS[args.clock]
    start = clock()
    trainer.run()
    return clock() - start, trainer.replicas.params.detach().clone()


def reference(args) -> dict:
    """The minimal loop's inputs (untimed), built as the run builds them from its config: the
    data and partitioner (the run's seed before each, as `run/build.py`), the initial model
    as one flat row (weight then bias, the replicas' layout), each worker's neighbours (the
    topology's order), the lr, the mean compute time, the pair's transfer time (α + D/B), and
    each worker's draws: compute times (Exp(1)) and partner uniforms, one per event at most."""
    from hydra.utils import instantiate

    from dpresearch.algorithms.gossip import build_topology
    from dpresearch.asynchrony.clock import transfer_seconds
    from dpresearch.compress.rng import stream_seed
    from dpresearch.run.build import network_model

    cfg = config(args)
    k, seed = cfg.workers, cfg.seed
    torch.manual_seed(seed)
    data = instantiate(cfg.data, device="cpu")
    partitioner = data.make_partitioner(k, seed)
    torch.manual_seed(seed)
    model = instantiate(cfg.model, num_classes=data.num_classes, input_shape=data.input_shape)
    row = torch.cat([model.linear.weight.detach().flatten(), model.linear.bias.detach()])
    draws = args.updates + 1  # a worker starts at most once per event, and once at the start

    def stream(*parts, fill) -> list[float]:
        return fill(np.random.Generator(np.random.PCG64(stream_seed(*parts))), draws).tolist()

    return {
        "inputs": data.train_inputs.flatten(1), "targets": data.train_targets,
        "partitioner": partitioner,
        "worker_steps": partitioner.samples_per_worker // args.batch,
        "row": row, "shape": tuple(model.linear.weight.shape),
        "peers": [list(p) for p in build_topology(cfg.topology, k).out_peers(0)],
        "lr": float(cfg.optimizer.lr), "compute_s": float(cfg["async"].compute_s),
        "transfer_s": transfer_seconds(network_model(cfg), row.numel() * row.element_size()),
        "times": [stream("async.speed", "exponential", seed, w,
                         fill=lambda g, n: g.standard_exponential(n)) for w in range(k)],
        "partners": [stream("adpsgd.pair", seed, w, fill=lambda g, n: g.random(n))
                     for w in range(k)],
    }  # fmt: skip


def minimal(args) -> tuple[float, Tensor]:
    """Seconds of the minimal AD-PSGD loop (see the module docstring) and its K final rows."""
    ref = reference(args)
    k, b = args.workers, args.batch
    inputs, targets, partitioner = ref["inputs"], ref["targets"], ref["partitioner"]
    ws, peers, lr = ref["worker_steps"], ref["peers"], ref["lr"]
    compute_s, transfer_s, times, partners = (
        ref["compute_s"],
        ref["transfer_s"],
        ref["times"],
        ref["partners"],
    )
    c, d = ref["shape"]
    x = ref["row"].expand(k, -1).clone()  # x_i: each worker's model
    read = x.clone()  # x̂_i: what worker i computes its gradient on
    # each read row's weight and bias, as leaves autograd differentiates
    weights = [read[w, : c * d].view(c, d).requires_grad_() for w in range(k)]
    biases = [read[w, c * d :].requires_grad_() for w in range(k)]
    batches: list[list[Tensor]] = [[] for _ in range(k)]
    cursor, drawn, paired = [0] * k, [1] * k, [0] * k
    heap = [(compute_s * times[w][0] + transfer_s, w) for w in range(k)]
    heapq.heapify(heap)
    clock = CLOCKS[args.clock]
    start = clock()
    for _ in range(args.updates):
        now, i = heapq.heappop(heap)
        near = peers[i]
        j = near[int(partners[i][paired[i]] * len(near))]
        paired[i] += 1
        if cursor[i] == len(batches[i]):  # the worker's next epoch of batches
            order = partitioner.epoch_indices(i, cursor[i] // ws)
            batches[i].extend(order[: ws * b].split(b))
        index = batches[i][cursor[i]]
        cursor[i] += 1
        loss = F.cross_entropy(
            F.linear(inputs.index_select(0, index), weights[i], biases[i]),
            targets.index_select(0, index),
        )
        grad_w, grad_b = torch.autograd.grad(loss, (weights[i], biases[i]))
        with torch.no_grad():
            xi = x[i]
            xi.add_(x[j]).mul_(0.5)
            x[j].copy_(xi)
            xi[: c * d].view(c, d).add_(grad_w, alpha=-lr)
            xi[c * d :].add_(grad_b, alpha=-lr)
            read[i].copy_(xi)
        heapq.heappush(heap, (now + compute_s * times[i][drawn[i]] + transfer_s, i))
        drawn[i] += 1
    return clock() - start, x


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--features", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/adpsgd_vs_minimal.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sides = ["ours", "minimal"]
    run = {"ours": lambda: ours(args), "minimal": lambda: minimal(args)}
    load_before = os.getloadavg()[0]
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    final: dict[str, Tensor] = {}
    for r in range(args.rounds):
        order = sides[r % 2 :] + sides[: r % 2]
        for side in order:
            s, rows = run[side]()
            seconds[side].append(s)
            final.setdefault(side, rows)
        us = {s: 1e6 * seconds[s][-1] / args.updates for s in sides}
        print(
            f"round {r} ({', '.join(order)}): ours {us['ours']:.0f} µs/update, minimal "
            f"{us['minimal']:.0f} µs/update | ours/minimal {us['ours'] / us['minimal']:.3f}",
            flush=True,
        )
    load_after = os.getloadavg()[0]
    # the same float32 operations in the same order: the same bits, or it is not the same work
    diff = (final["ours"] - final["minimal"]).abs().max().item()
    if diff != 0.0:
        raise SystemExit(
            f"error: ours and the minimal loop end {diff:.3g} apart (max |Δ|): "
            "they did different work"
        )
    ratios = [a / m for a, m in zip(seconds["ours"], seconds["minimal"], strict=True)]
    result = {
        "workers": args.workers, "updates": args.updates, "features": args.features,
        "batch": args.batch, "clock": args.clock, "rounds": args.rounds,
        "log_every": args.log_every,
        "us_per_update": {s: 1e6 * statistics.median(v) / args.updates
                          for s, v in seconds.items()},
        "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
        "final_max_abs_diff": diff, "seconds": seconds, "load": [load_before, load_after],
        "target": TARGET,
    }  # fmt: skip
    print(
        f"\n{args.workers} workers on a ring, logistic regression ({args.features} "
        f"features, batch {args.batch}), {args.updates} updates (ours logging every "
        f"{args.log_every}), {args.rounds} rounds, "
        f"{args.clock} clock, load {load_before:.1f} → {load_after:.1f}; final parameters: "
        "identical"
    )
    print("| side | µs/update (median) | ÷ minimal loop: median [range] | target |")
    print("|---|---|---|---|")
    lo, hi = result["ratio_range"]
    print(
        f"| ours | {result['us_per_update']['ours']:.0f} | {result['ratio_median']:.3f} "
        f"[{lo:.3f}–{hi:.3f}] | ≤ {TARGET} |"
    )
    print(f"| minimal | {result['us_per_update']['minimal']:.0f} | 1 | |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
