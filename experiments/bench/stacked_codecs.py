"""Benchmark: stacked codecs vs a per-tensor loop — top-k 1 % and scaled sign with EF14 over
ResNet-20's layout, all K simulated workers, one synchronous step (issue 16, item 3).

Both sides do the same work per step on the same gradients `[K, D]` (K simulated workers in
one process, D = ResNet-20's 269,722 parameters in 59 tensors):

- ours: `CompressedReducer(compressor, SimulatedCommunicator(K), layout, ErrorFeedback("ef14"))`
  `.reduce(grads, step)` — EF compensation, encode every worker's row, decode the own rows
  for EF, allgather, decode and average all K rows, memory update, the aggregate written into
  every row.
- the loop (GRACE's way, written here): for each worker, for each tensor: p = g + e; top-k:
  `torch.topk(|p|, k)` and gather the values (sign: ‖p‖₁/d and the sign bits, packed 8 per
  byte with numpy as the wire needs); decode the own message dense and e = p − decoded; then
  for each tensor, decode every worker's message dense and average; the aggregate written into
  every row.

Rounds alternate which side runs first; each round times `--steps` steps of each side after
one untimed step, and its ratio is ours/loop of the median step times. Printed: the median
ratio over rounds with its range, each side's median step time, the largest difference of the
two sides' aggregates on a first step (`check`: 0 — top-k selects the same entries, sign forms
the same scales), and the machine's load (1-min average before and after). Threads: 1
(`--threads`). `--clock cpu` times with this process's CPU time instead of wall time: both
sides run single-threaded in this process, so on a shared machine it measures their work
without the time spent waiting for a core.

    python experiments/bench/stacked_codecs.py [--workers 4 16] [--rounds 5] [--steps 10]
        [--compressors topk sign] [--clock wall|cpu] [--json PATH]

Target: ours ≤ 0.5 × the loop for both compressors at K = 4 and 16.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.compress import CompressedReducer, ErrorFeedback, ScaledSign, TopK, param_layout
from dpresearch.compress.topk import kept
from dpresearch.models.resnet_cifar import ResNetCifar

TARGET = 0.5
RATIO = 0.01


def resnet20_layout() -> list[tuple[int, tuple[int, ...]]]:
    return param_layout(ResNetCifar(10))


class Loop:
    """The per-tensor reference: K workers × T tensors, one compressor call each."""

    def __init__(self, name: str, layout, workers: int) -> None:
        self.name, self.k = name, workers
        self.tensors = [(off, math.prod(shape)) for off, shape in layout]
        numel = sum(n for _, n in self.tensors)
        self.memory = torch.zeros(workers, numel)

    def step(self, grads: torch.Tensor) -> None:
        messages = []
        for w in range(self.k):
            row = []
            for off, n in self.tensors:
                e = self.memory[w, off : off + n]
                p = grads[w, off : off + n] + e
                message = self.compress(p)
                e.copy_(p - self.decompress(message, n))
                row.append(message)
            messages.append(row)
        for t, (off, n) in enumerate(self.tensors):
            total = self.decompress(messages[0][t], n)
            for w in range(1, self.k):
                total.add_(self.decompress(messages[w][t], n))
            grads[:, off : off + n] = (total / self.k).expand(self.k, -1)

    def compress(self, p: torch.Tensor) -> tuple:
        if self.name == "topk":
            idx = torch.topk(p.abs(), kept(p.numel(), RATIO), sorted=False).indices
            return p[idx], idx.to(torch.int32)
        scale = p.abs().sum() / p.numel()
        bits = np.packbits(np.signbit(p.numpy()), bitorder="little")
        return scale, torch.from_numpy(bits)

    def decompress(self, message: tuple, n: int) -> torch.Tensor:
        if self.name == "topk":
            values, idx = message
            return torch.zeros(n).scatter_(0, idx.long(), values)
        scale, bits = message
        negative = torch.from_numpy(np.unpackbits(bits.numpy(), count=n, bitorder="little"))
        return torch.where(negative.bool(), -scale, scale)


def ours(name: str, layout, workers: int) -> CompressedReducer:
    compressor = TopK(ratio=RATIO) if name == "topk" else ScaledSign()
    comm = SimulatedCommunicator(workers, NetworkModel.preset("10gbe"))
    return CompressedReducer(compressor, comm, layout, ErrorFeedback(mode="ef14"))


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def median_step(
    step: Callable[[torch.Tensor], None], grads: torch.Tensor, steps: int, clock: str
) -> float:
    now = CLOCKS[clock]
    step(grads.clone())  # untimed: buffers, caches
    times = []
    for _ in range(steps):
        g = grads.clone()
        start = now()
        step(g)
        times.append(now() - start)
    return statistics.median(times)


def check(name: str, layout, workers: int, grads: torch.Tensor) -> float:
    """Max |ours − loop| of the first step's aggregate."""
    a, b = grads.clone(), grads.clone()
    reducer = ours(name, layout, workers)
    reducer.reduce(a, 0)
    Loop(name, layout, workers).step(b)
    return (a - b).abs().max().item()


def compare(name: str, workers: int, rounds: int, steps: int, clock: str = "wall") -> dict:
    layout = resnet20_layout()
    numel = sum(math.prod(s) for _, s in layout)
    grads = torch.randn(workers, numel, generator=torch.Generator().manual_seed(0))
    err = check(name, layout, workers, grads)
    reducer, loop = ours(name, layout, workers), Loop(name, layout, workers)
    counter = iter(range(10**9))

    def ours_step(g: torch.Tensor) -> None:
        reducer.reduce(g, next(counter))

    ratios, mine, theirs = [], [], []
    load = [os.getloadavg()[0]]
    for r in range(rounds):
        if r % 2 == 0:
            t_ours = median_step(ours_step, grads, steps, clock)
            t_loop = median_step(loop.step, grads, steps, clock)
        else:
            t_loop = median_step(loop.step, grads, steps, clock)
            t_ours = median_step(ours_step, grads, steps, clock)
        ratios.append(t_ours / t_loop)
        mine.append(t_ours)
        theirs.append(t_loop)
    load.append(os.getloadavg()[0])
    return {
        "compressor": name,
        "workers": workers,
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "ours_ms": 1e3 * statistics.median(mine),
        "loop_ms": 1e3 * statistics.median(theirs),
        "max_abs_diff": err,
        "load": load,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--compressors", nargs="+", default=["topk", "sign"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall (perf_counter) or cpu (this process's CPU time: steadier on a shared machine)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"ResNet-20 layout, EF14, {args.rounds} alternating rounds × {args.steps} steps, "
        f"{args.threads} thread(s), {args.clock} clock; ratio = ours / per-tensor loop "
        f"(target ≤ {TARGET}); load = 1-min load average before → after"
    )
    header = f"{'compressor':10} {'K':>3} {'ratio':>6} {'range':>13} {'ours ms':>8} {'loop ms':>8}"
    print(header + f" {'check':>9} {'load':>11}")
    results = []
    for name in args.compressors:
        for k in args.workers:
            res = compare(name, k, args.rounds, args.steps, args.clock)
            results.append(res)
            lo, hi = res["ratio_range"]
            mark = "ok" if res["ratio"] <= TARGET else "!!"
            print(
                f"{name:10} {k:3d} {res['ratio']:6.3f} [{lo:.3f}–{hi:.3f}] "
                f"{res['ours_ms']:8.2f} {res['loop_ms']:8.2f} {res['max_abs_diff']:9.1e} "
                f"{res['load'][0]:5.2f}→{res['load'][1]:<5.2f} {mark}",
                flush=True,
            )
    if args.json is not None:
        import json

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
