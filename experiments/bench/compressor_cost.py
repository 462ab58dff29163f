"""Compress + decompress cost of every compressor, in memory passes.

One pass = one `copy_` of the same fp32 vector, timed in the same run; each figure is the
median over `--repeats` timings. The default vector has 11,173,962 entries (ResNet-18),
compressed as one chunk of one worker, through the compressor's codec (built once). PowerSGD is
timed through its own protocol with a one-worker communicator (its collectives are then
no-ops). Threads default to 1: on a shared machine, a multi-threaded op waits for its slowest
thread and the ratios measure contention instead of the kernels.

    python experiments/bench/compressor_cost.py [--numel N] [--repeats R] [--threads T]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.compress import (
    BF16,
    FP16,
    QSGD,
    Chunk,
    Identity,
    MajorityVote,
    PowerSGD,
    RandomK,
    ScaledSign,
    SingleRoundCompressor,
    TernGrad,
    TopK,
)

RESNET18 = 11_173_962

# name, compressor, target (passes) from the design brief, or None
CASES: list[tuple[str, Callable[[], object], float | None]] = [
    ("identity", lambda: Identity(), None),
    ("fp16", lambda: FP16(), 3),
    ("bf16", lambda: BF16(), 3),
    ("topk exact 1%", lambda: TopK(ratio=0.01, selection="exact"), None),
    ("topk sampled 1%", lambda: TopK(ratio=0.01, selection="sampled"), 10),
    ("randomk 1%", lambda: RandomK(ratio=0.01), 3),
    ("qsgd s=7 B=512", lambda: QSGD(levels=7, bucket_size=512), 10),
    ("qsgd s=127 B=512", lambda: QSGD(levels=127, bucket_size=512), None),
    ("terngrad", lambda: TernGrad(), None),
    ("sign (scaled)", lambda: ScaledSign(), 3),
    ("signum (vote)", lambda: MajorityVote(), None),
    ("powersgd r=2", lambda: PowerSGD(rank=2), None),
]


class Roundtrip:
    """Encode + decode of one chunk of one worker through the compressor's codec (built once);
    PowerSGD through its own protocol with a one-worker communicator (collectives: no-ops)."""

    def __init__(self, compressor, numel: int) -> None:
        chunk = Chunk("model", 0, numel)
        self.comm = SimulatedCommunicator(1, NetworkModel.preset("10gbe"))
        if isinstance(compressor, SingleRoundCompressor):
            self.codec = compressor.codec([chunk])
        else:
            self.codec = None
            self.aggregation = compressor.aggregation([chunk], [0], torch.float32, "cpu")

    def __call__(self, x: torch.Tensor, out: torch.Tensor, step: int) -> None:
        if self.codec is not None:
            self.codec.decode(self.codec.encode(x.unsqueeze(0), step), step, out.unsqueeze(0))
        else:
            self.aggregation.run(x.unsqueeze(0), self.comm, step, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=RESNET18)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.numel)
    out = torch.empty_like(x)
    copy_times = []

    def timed(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    print(f"numel={args.numel}  threads={args.threads}  repeats={args.repeats}")
    header = f"{'compressor':18s} {'wire bytes':>12s} {'×fp32':>7s} {'passes':>7s} {'target':>7s}"
    print(header)
    print("-" * len(header))
    for name, make, target in CASES:
        compressor = make()
        roundtrip = Roundtrip(compressor, args.numel)
        roundtrip(x, out, 0)  # warm-up: scratch buffers, allocator
        times = []
        for step in range(args.repeats):
            copy_times.append(timed(lambda: out.copy_(x)))
            times.append(timed(lambda r=roundtrip, s=step: r(x, out, s + 1)))
        passes = statistics.median(times) / statistics.median(copy_times)
        nbytes = compressor.payload_bytes(args.numel)
        ratio = nbytes / (4 * args.numel)
        mark = "" if target is None else f"≤{target:g}" + (" ok" if passes <= target else " !!")
        print(f"{name:18s} {nbytes:12d} {ratio:7.4f} {passes:7.2f} {mark:>7s}")
    print(f"one copy_ = {statistics.median(copy_times) * 1e3:.2f} ms (median)")


if __name__ == "__main__":
    main()
