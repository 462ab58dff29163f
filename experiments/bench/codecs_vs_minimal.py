"""Benchmark: our natural-compression and scaled-sign codecs and our 1-bit Adam step against
minimal implementations of the same arithmetic written here (issue 31, item 3).

K simulated workers in one process, ResNet-20's layout (D = 269,722 parameters in 59 tensors),
seeded gradients `[K, D]`; one step of each side per timing, set-up excluded:

- `natural` (`compressor=natural`, no error feedback, its default):
  ours: `CompressedReducer(Natural(), SimulatedCommunicator(K), layout).reduce(grads, step)` —
  the sync algorithm's step: encode every row (exponent codes with the worker's 23-bit draws per
  tensor, sign bits), allgather the wire rows, decode all K and average, the aggregate written
  into every row. minimal: the same draws (numpy PCG64 seeded per worker, tensor and step as
  `rng.stream_seed`), exponent codes in one pass over `[K, D]`, the signs packed with one
  `np.packbits` over the stacked rows, one byte row per worker; decode all K rows from those
  bytes, add them in worker order, divide by K, write into every row.
- `sign` (`compressor=sign error_feedback=ef14`, EF-signSGD): ours: the same reducer with
  `ScaledSign()` and `ErrorFeedback("ef14")`. minimal: p = g + e; each tensor's scale
  ‖p‖₁/d (one `abs` over `[K, D]`, one sum per tensor); the signs packed with one
  `np.packbits` over `[K, D]`; e = p − (±scale) (the sender's own values, no unpacking); the
  receivers decode the K rows from the packed bytes and scales, add them in worker order,
  divide by K, write into every row.
- `onebit` (`compressor=onebit error_feedback=ef14`, 1-bit SGD per tensor, Seide et al.):
  ours: the reducer `build_reducer` makes from the shipped `compressor/onebit.yaml` and
  `error_feedback/ef14.yaml` nodes. minimal: p = g + e; the signs packed with one
  `np.packbits` over `[K, D]`; per tensor the sum of its entries, of its negative entries and
  their count (one `sum` each per tensor); the two means (negatives', others' = (total −
  negatives')/(d − count)); e = p − the sender's own decoded values (no unpacking); the
  receivers unpack the K rows, decode them, add them in worker order, divide by K, write into
  every row. Both sides sum each tensor with torch's `sum` over its entries (the same order);
  a decoded entry picks one of its tensor's two means on the bit patterns (`high ^ (mask &
  (high ^ low))`, exact; `torch.where` is a branch per entry on the CPU, several times slower).
- `onebit_adam` (`optimizer=onebit_adam`, after the warm-up, in the compression stage): ours:
  `OnebitAdamAlgorithm.after_backward(step)` on ResNet-20 replicas (its m, v, errors taken from
  a few real warm-up steps on seeded gradients). minimal: m ← β₁m + (1−β₁)g; b = m + δ_w;
  per worker scale ‖b‖₂/√D and the signs of b (x < 0) packed with one `np.packbits` over
  `[K, K·c]`; δ_w ← b − (±scale); each server unpacks its chunk of the K messages, averages
  them in worker order, adds δ̄, compresses (scale ‖a‖₂/√n over its real entries, signs packed),
  δ̄ ← a − (±scale); everyone unpacks the K server messages; x ← x − lr·m̂/(√v̂ + ε) with
  the frozen v (its denominator formed once, as a minimal implementation would).

Both sides start from the same state; `check` compares their outputs after one step with
`torch.equal` (aggregates, memories, m, x): the same arithmetic in the same order gives the
same bits, so any difference is a bug, and the benchmark stops.

Rounds alternate which side runs first; each round times `--steps` steps of each side after
one untimed step, and its ratio is ours ÷ minimal of the median step times. Printed: the median
ratio over rounds with its range, each side's median step time, and the 1-min load average
before → after. One torch thread; `--clock cpu` (default) times this thread's CPU time
(`time.thread_time`): both sides run single-threaded here, so on a shared machine it measures
their work without the time spent waiting for a core; `--clock wall` wall time.

    python experiments/bench/codecs_vs_minimal.py [--cases natural sign onebit onebit_adam]
        [--workers 4 16] [--rounds 5] [--steps 10] [--clock cpu|wall] [--json PATH]

Targets: ours ÷ minimal ≤ 1.2 for the codecs (1-bit SGD included), ≤ 1.15 for the 1-bit
Adam step.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_timing import CLOCKS, Results, default_json, fmt_range, load, pin_threads

from dpresearch.algorithms.compressed_adam import OnebitAdam, OnebitAdamAlgorithm
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.compress import (
    CompressedReducer,
    ErrorFeedback,
    ScaledSign,
    build_reducer,
    param_layout,
)
from dpresearch.compress.layout import tensor_key
from dpresearch.compress.natural import Natural
from dpresearch.compress.rng import stream_seed
from dpresearch.compress.workspace import Workspace
from dpresearch.models.resnet_cifar import ResNetCifar
from dpresearch.replicas import Replicas

TARGETS = {"natural": 1.2, "sign": 1.2, "onebit": 1.2, "onebit_adam": 1.15}
NET = NetworkModel.preset("10gbe")
SEED = 0
CONF = Path(__file__).resolve().parents[2] / "dpresearch" / "conf"
LR, BETAS, EPS, FREEZE = 1e-3, (0.9, 0.999), 1e-8, 3


def model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return ResNetCifar(10)


def tensors(layout) -> list[tuple[int, int]]:
    """(offset, numel) of every parameter of the flat row."""
    return [(off, math.prod(shape)) for off, shape in layout]


# -- the codecs -------------------------------------------------------------------------------


def ours_codec(name: str, layout, k: int) -> CompressedReducer:
    comm = SimulatedCommunicator(k, NET)
    if name == "onebit":  # what `compressor=onebit error_feedback=ef14` builds
        compressor = OmegaConf.load(CONF / "compressor" / "onebit.yaml")
        memory = OmegaConf.load(CONF / "error_feedback" / "ef14.yaml")
        return build_reducer(compressor, memory, comm, layout, seed=SEED)
    if name == "natural":
        return CompressedReducer(Natural(seed=SEED), comm, layout)
    return CompressedReducer(ScaledSign(seed=SEED), comm, layout, ErrorFeedback(mode="ef14"))


class Scratch:
    """Buffers reused across steps, as any implementation that cares about speed keeps them (a
    fresh multi-megabyte tensor costs page faults on first touch)."""

    def __init__(self) -> None:
        self.ws = Workspace()

    def __call__(self, name: str, shape: tuple[int, ...], dtype=torch.float32) -> Tensor:
        return self.ws.get(name, shape, dtype, "cpu")


def sign_bits(bits: np.ndarray, out: Tensor) -> Tensor:
    """`out` (int32) = the fp32 sign bit (bit 31) set where `bits` (uint8 0/1) is 1."""
    return out.copy_(torch.from_numpy(bits)).bitwise_left_shift_(31)


def mean_of_rows(decoded: Tensor, out: Tensor) -> Tensor:
    """`out` = (row 0 + row 1 + … in order) / K: every worker's average of the K messages."""
    out.copy_(decoded[0])
    for row in decoded[1:]:
        out.add_(row)
    return out.div_(decoded.shape[0])


class MinimalNatural:
    """Natural compression written directly over `[K, D]` (see the module docstring)."""

    def __init__(self, layout, k: int) -> None:
        self.k, self.parts = k, tensors(layout)
        d = sum(n for _, n in self.parts)
        self.d = d
        self.draws = np.empty((k, d), dtype=np.int32)
        self.wire = torch.empty(k, d + (d + 7) // 8, dtype=torch.uint8)
        self.buf = Scratch()

    def step(self, g: Tensor, step: int) -> None:
        k, d, draws, buf = self.k, self.d, self.draws, self.buf
        for w in range(k):
            for i, (off, n) in enumerate(self.parts):
                seed = stream_seed("natural", SEED, w, tensor_key(i), step)
                words = np.random.PCG64(seed).random_raw((n + 1) // 2).view(np.uint32)[:n]
                np.right_shift(words, 9, out=draws[w, off : off + n], casting="unsafe")
        bits = g.view(torch.int32)
        code = torch.bitwise_right_shift(bits, 23, out=buf("code", (k, d), torch.int32))
        code.bitwise_and_(0xFF)
        nonfinite = torch.eq(code, 0xFF, out=buf("nonfinite", (k, d), torch.bool))
        mantissa = torch.bitwise_and(bits, 0x7FFFFF, out=buf("mantissa", (k, d), torch.int32))
        up = torch.lt(torch.from_numpy(draws), mantissa, out=buf("up", (k, d), torch.bool))
        code.add_(up).clamp_(max=254).masked_fill_(nonfinite, 0xFF)
        wire = self.wire
        wire[:, :d].copy_(code)
        negative = torch.signbit(g, out=buf("negative", (k, d), torch.bool))
        wire[:, d:] = torch.from_numpy(np.packbits(negative.numpy(), axis=1, bitorder="little"))
        # every worker receives the K rows: decode them all (sign | exponent | zero mantissa)
        received = np.unpackbits(wire[:, d:].numpy(), axis=1, count=d, bitorder="little")
        word = buf("word", (k, d), torch.int32).copy_(wire[:, :d]).bitwise_left_shift_(23)
        word.bitwise_or_(sign_bits(received, buf("signs", (k, d), torch.int32)))
        total = mean_of_rows(word.view(torch.float32), buf("total", (d,)))
        g.copy_(total.expand_as(g))


class MinimalSign:
    """Scaled sign with EF14 written directly over `[K, D]` (see the module docstring)."""

    def __init__(self, layout, k: int) -> None:
        self.k, self.parts = k, tensors(layout)
        self.d = sum(n for _, n in self.parts)
        self.sizes = torch.tensor([float(n) for _, n in self.parts])
        self.owner = torch.repeat_interleave(
            torch.arange(len(self.parts)), torch.tensor([n for _, n in self.parts])
        )
        self.memory = torch.zeros(k, self.d)
        self.buf = Scratch()

    def step(self, g: Tensor, step: int) -> None:
        k, d, buf = self.k, self.d, self.buf
        p = self.memory.add_(g)
        magnitude = torch.abs(p, out=buf("abs", (k, d)))
        l1 = torch.stack([magnitude[:, o : o + n].sum(-1) for o, n in self.parts], 1)
        scales = l1.div_(self.sizes)  # [K, T]: the message's fp32 scales
        negative = torch.signbit(p, out=buf("negative", (k, d), torch.bool))
        packed = np.packbits(negative.numpy(), axis=1, bitorder="little")  # the wire
        scale = torch.index_select(scales, 1, self.owner, out=buf("scale", (k, d)))
        p.sub_(torch.copysign(scale, p, out=buf("sent", (k, d))))  # ±scale, as sent
        # every worker receives the K messages: decode them from the bytes
        received = np.unpackbits(packed, axis=1, count=d, bitorder="little")
        signs = sign_bits(received, buf("signs", (k, d), torch.int32)).view(torch.float32)
        decoded = torch.copysign(scale, signs, out=buf("decoded", (k, d)))
        g.copy_(mean_of_rows(decoded, buf("total", (d,))).expand_as(g))


class MinimalOneBit:
    """1-bit SGD, one segment per tensor, with EF14 written directly over `[K, D]` (see the module
    docstring)."""

    def __init__(self, layout, k: int) -> None:
        self.k, self.parts = k, tensors(layout)
        self.d = sum(n for _, n in self.parts)
        self.sizes = torch.tensor([float(n) for _, n in self.parts])
        self.memory = torch.zeros(k, self.d)
        self.buf = Scratch()

    def sums(self, x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """`[K, T]`: each tensor's sum of `x` `[K, D]`."""
        return torch.stack([x[:, o : o + n].sum(-1, dtype=dtype) for o, n in self.parts], 1)

    def decode(self, mask: Tensor, low: Tensor, high: Tensor, out: Tensor) -> Tensor:
        """`out` = `low` of an entry's tensor where `mask` (int32 `[K, D]`) is −1, else `high`
        (`[K, T]` each): exactly one of the two, picked on the bit patterns."""
        low, high = low.view(torch.int32), high.view(torch.int32)
        diff, bits = low ^ high, out.view(torch.int32)
        for t, (o, n) in enumerate(self.parts):
            cols = slice(o, o + n)
            torch.bitwise_and(mask[:, cols], diff[:, t : t + 1], out=bits[:, cols])
            bits[:, cols].bitwise_xor_(high[:, t : t + 1])
        return out

    def step(self, g: Tensor, step: int) -> None:
        k, d, buf = self.k, self.d, self.buf
        p = self.memory.add_(g)
        negative = buf("negative", (k, d), torch.bool).numpy()
        np.signbit(p.numpy(), out=negative)
        packed = np.packbits(negative, axis=1, bitorder="little")  # sent, with 2 means a tensor
        bits = p.view(torch.int32)
        mask = torch.bitwise_right_shift(bits, 31, out=buf("mask", (k, d), torch.int32))  # −1: <0
        below = torch.bitwise_and(bits, mask, out=buf("below", (k, d), torch.int32))
        total, below = self.sums(p), self.sums(below.view(torch.float32))
        count = self.sums(mask, torch.int32).neg_().float()
        low = below / count.clamp(min=1.0)  # the two fp32 means per tensor
        high = (total - below) / (self.sizes - count).clamp(min=1.0)
        p.sub_(self.decode(mask, low, high, buf("sent", (k, d))))  # e = p − what was sent
        # every worker receives the K messages: decode them from the bytes
        received = np.unpackbits(packed, axis=1, count=d, bitorder="little")
        mask = buf("mask", (k, d), torch.int32).copy_(torch.from_numpy(received)).neg_()
        decoded = self.decode(mask, low, high, buf("decoded", (k, d)))
        g.copy_(mean_of_rows(decoded, buf("total", (d,))).expand_as(g))


def codec_state(side) -> list[Tensor]:
    if isinstance(side, CompressedReducer):
        memory = side.memory.memory
        return [] if memory is None else [memory]
    return [side.memory] if isinstance(side, MinimalSign | MinimalOneBit) else []


# -- 1-bit Adam -------------------------------------------------------------------------------


def ours_adam(k: int, grads: Tensor) -> OnebitAdamAlgorithm:
    """Our 1-bit Adam after FREEZE full-precision steps and one compressed step on `grads`
    (perturbed per step), so every state it keeps is non-trivial."""
    replicas = Replicas(model(), k, torch.device("cpu"))
    optimizers = [
        OnebitAdam(r.parameters(), lr=LR, betas=BETAS, eps=EPS, freeze_step=FREEZE)
        for r in replicas.models
    ]
    algo = OnebitAdamAlgorithm(replicas, SimulatedCommunicator(k, NET), optimizers)
    for step in range(FREEZE + 1):
        replicas.grads.copy_(grads).mul_(1 + 0.1 * step)
        algo.after_backward(step)
    return algo


class MinimalAdam:
    """1-bit Adam's compressed step written directly over `[K, D]` (see the module docstring),
    starting from `algo`'s state."""

    def __init__(self, algo: OnebitAdamAlgorithm) -> None:
        onebit = algo.onebit
        self.k, self.d = algo.m.shape
        self.c = onebit.chunk
        self.params, self.m = algo.replicas.params.clone(), algo.m.clone()
        self.worker_error = onebit.worker_error.clone()
        self.server_error = onebit.server_error.clone()
        real = (self.d - torch.arange(self.k) * self.c).clamp(0, self.c)
        self.valid = torch.arange(self.c) < real.unsqueeze(1)  # [K, c]
        self.root_real = real.clamp(min=1).float().sqrt()
        self.denom = (algo.v.sqrt() / math.sqrt(1 - BETAS[1] ** FREEZE)).add_(EPS)
        self.steps = FREEZE + 1  # compressed steps start after the freeze
        self.negative = torch.zeros(self.k, self.k * self.c, dtype=torch.bool)
        self.buf = Scratch()

    def step(self, g: Tensor, step: int) -> None:
        k, d, c, buf = self.k, self.d, self.c, self.buf
        beta1 = BETAS[0]
        m = self.m.lerp_(g, 1 - beta1)
        b = torch.add(m, self.worker_error, out=buf("b", (k, d)))
        scale = (torch.linalg.vector_norm(b, dim=1) / math.sqrt(d)).unsqueeze(1)
        negative = self.negative  # [K, K·c], the padding never set: +1
        torch.lt(b, 0, out=negative[:, :d])  # sign(0) = sign(−0.0) = +1
        sent = np.packbits(negative.numpy(), axis=1, bitorder="little")  # [K, K·c/8]
        signs = buf("signs", (k, k * c), torch.int32)
        own = sign_bits(negative[:, :d].numpy().view(np.uint8), signs[:, :d])
        decoded = torch.copysign(scale, own.view(torch.float32), out=buf("decoded", (k, d)))
        torch.sub(b, decoded, out=self.worker_error)
        # server j: chunk j of every worker's message, unpacked and averaged in worker order
        bits = np.unpackbits(sent, axis=1, bitorder="little")
        signs = sign_bits(bits, signs).view(torch.float32)
        received = torch.copysign(scale, signs, out=buf("received", (k, k * c)))
        a = mean_of_rows(received.view(k, k, c), buf("a", (k, c)))
        a.add_(self.server_error).mul_(self.valid)
        server_scale = (torch.linalg.vector_norm(a, dim=1) / self.root_real).unsqueeze(1)
        server_negative = torch.lt(a, 0, out=buf("server_negative", (k, c), torch.bool))
        reply = np.packbits(server_negative.numpy(), axis=1, bitorder="little")  # [K, c/8]
        signs = buf("server_signs", (k, c), torch.int32)
        sign_bits(server_negative.numpy().view(np.uint8), signs)
        server_sent = torch.copysign(server_scale, signs.view(torch.float32), out=buf("ss", (k, c)))
        torch.sub(a, server_sent, out=self.server_error).mul_(self.valid)
        # everyone: the K server messages, unpacked
        signs = sign_bits(np.unpackbits(reply, axis=1, bitorder="little"), signs)
        result = torch.copysign(server_scale, signs.view(torch.float32), out=server_sent)
        m.copy_(result.view(-1)[:d].expand_as(m))
        t = self.steps = self.steps + 1
        self.params.addcdiv_(m, self.denom, value=-LR / (1 - beta1**t))


# -- timing -----------------------------------------------------------------------------------


def median_step(
    side: tuple[Callable, Callable], grads: Tensor, first: int, steps: int, clock: str
) -> float:
    """Median time of `steps` steps; `side` = (prepare, step): `prepare(grads)` (untimed) puts
    the step's gradients where the step reads them and returns them."""
    now = CLOCKS[clock]
    prepare, step = side
    step(prepare(grads), first)  # untimed: buffers, caches
    times = []
    for i in range(steps):
        g = prepare(grads)
        start = now()
        step(g, first + 1 + i)
        times.append(now() - start)
    return statistics.median(times)


def clone(grads: Tensor) -> Tensor:
    return grads.clone()


def sides(case: str, k: int, grads: Tensor) -> tuple[tuple, tuple, Callable]:
    """(ours, minimal) as (prepare, step) pairs, and the states to compare."""
    layout = param_layout(model())
    if case == "onebit_adam":
        algo = ours_adam(k, grads)
        minimal = MinimalAdam(algo)

        def into_replicas(g: Tensor) -> Tensor:  # where backward leaves the gradients
            return algo.replicas.grads.copy_(g)

        def ours_step(g: Tensor, step: int) -> None:
            algo.after_backward(FREEZE + 1 + step)

        def states() -> list[tuple[Tensor, Tensor]]:
            return [
                (algo.replicas.params, minimal.params),
                (algo.m, minimal.m),
                (algo.onebit.worker_error, minimal.worker_error),
                (algo.onebit.server_error, minimal.server_error),
            ]

        return (into_replicas, ours_step), (clone, minimal.step), states
    reducer = ours_codec(case, layout, k)
    minimal = {"natural": MinimalNatural, "sign": MinimalSign, "onebit": MinimalOneBit}[case]
    mine = minimal(layout, k)
    return (
        (clone, reducer.reduce),
        (clone, mine.step),
        lambda: list(zip(codec_state(reducer), codec_state(mine), strict=True)),
    )


def check(case: str, k: int, grads: Tensor) -> None:
    """Both sides' outputs and states after each of two steps from the same state are
    bit-identical."""
    ours, minimal, states = sides(case, k, grads)
    for step in range(2):
        a, b = ours[0](grads), minimal[0](grads)
        ours[1](a, step)
        minimal[1](b, step)
        pairs = [(a, b), *states()]
        if not all(torch.equal(x, y) for x, y in pairs):
            worst = max((x - y).abs().max().item() for x, y in pairs)
            raise SystemExit(f"error: {case} K={k}: ours and the minimal differ ({worst:.3g})")


def compare(case: str, k: int, rounds: int, steps: int, clock: str) -> dict:
    d = sum(n for _, n in tensors(param_layout(model())))
    grads = torch.randn(k, d, generator=torch.Generator().manual_seed(SEED)) * 1e-2
    check(case, k, grads)
    ours, minimal, _ = sides(case, k, grads)
    ratios, mine, theirs = [], [], []
    before = os.getloadavg()[0]
    first = 2
    for r in range(rounds):
        order = [(ours, mine), (minimal, theirs)]
        for side, into in order if r % 2 == 0 else order[::-1]:
            into.append(median_step(side, grads, first, steps, clock))
        first += steps + 1
        ratios.append(mine[-1] / theirs[-1])
    return {
        "case": case, "workers": k, "ratio": statistics.median(ratios), "ratios": ratios,
        "ours_ms": 1e3 * statistics.median(mine), "minimal_ms": 1e3 * statistics.median(theirs),
        "load": [before, os.getloadavg()[0]], "identical": True,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    pin_threads(1)
    out = args.json or default_json("codecs_vs_minimal")
    results = Results(out, "codecs_vs_minimal", vars(args) | {"json": str(out)})
    print(
        f"ResNet-20 layout (D = 269,722), {args.rounds} alternating rounds × {args.steps} "
        f"steps, 1 thread, {args.clock} clock; ratio = ours ÷ minimal, median [range]; "
        f"{load()}"
    )
    print(
        f"{'case':12} {'K':>3} {'ratio':>6} {'range':>13} {'ours ms':>8} {'min ms':>8} "
        f"{'load':>11} target"
    )
    rows = []
    for case in args.cases:
        for k in args.workers:
            res = compare(case, k, args.rounds, args.steps, args.clock)
            results.add(**res)
            rows.append(res)
            mark = "ok" if res["ratio"] <= TARGETS[case] else "!!"
            print(
                f"{case:12} {k:3d} {res['ratio']:6.3f} {fmt_range(res['ratios'])} "
                f"{res['ours_ms']:8.2f} {res['minimal_ms']:8.2f} "
                f"{res['load'][0]:5.2f}→{res['load'][1]:<5.2f} ≤{TARGETS[case]} {mark}",
                flush=True,
            )
    print(f"written {out}")
    return rows


if __name__ == "__main__":
    main()
