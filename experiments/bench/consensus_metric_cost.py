"""Cost of the consensus-distance metric (issue 16, item 5): K = 8 simulated workers of the
MLP under D-PSGD on a ring, metric logged every `--log-every` (10) steps.

The share is  metric ÷ (log_every × step),  the metric being `Gossip.metrics()` (Ξ² =
(1/K) Σ_i ‖x_i − x̄‖² in float64, "metrics" traffic) and the step the trainer's step region
(`time/compute_s + time/comm_s` from metrics.jsonl: batch, forward, backward, exchange,
optimizer). Both are timed with one clock (`--clock cpu`: this thread's CPU time, which other
jobs on a shared machine inflate far less than wall time; `wall`). Each round trains a fresh
run, then times the metric `--calls` times on its final rows; rounds alternate which comes
first; the figure is the median over rounds of the per-round share, with its range. For
reference, the metric as it was before issue 16 (a float64 copy of the rows, the mean written
into every row, the differences materialised) is timed beside it.

    python experiments/bench/consensus_metric_cost.py [--rounds 5] [--workers 8]
        [--log-every 10] [--block 10] [--calls 5] [--clock cpu]

Target: ≤ 3 % of the step.
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
from bench_cases import MODELS  # noqa: E402
from bench_cases import compose as compose_run  # noqa: E402


def compose(args):
    return compose_run(
        *MODELS["mlp"],
        "algorithm=dpsgd",
        f"workers={args.workers}",
        *bt.timed_run(args.warmup, args.block, args.blocks),
        "data.num_test=256",
        "algorithm.eval_local_models=false",
    )


def old_metric(algorithm) -> float:
    """The consensus distance as computed before issue 16 (for reference)."""
    from dpresearch.comm.ledger import METRICS

    x = algorithm.models().double()
    mean = x.clone()
    algorithm.comm.all_reduce(mean, op="mean", record=METRICS)
    sq = (x - mean).pow(2).sum(dim=1, keepdim=True)
    algorithm.comm.all_reduce(sq, op="sum", record=METRICS)
    return sq[0, 0].item() / algorithm.comm.world_size


def one_round(args, metric_first: bool) -> dict[str, float]:
    clock = bt.CLOCKS[args.clock]

    def time_metrics(trainer) -> tuple[float, float, float, float]:
        algorithm = trainer.algorithm
        algorithm.metrics()  # warm
        start = clock()
        for _ in range(args.calls):
            new = algorithm.metrics()["gossip/consensus_distance"]
        new_s = (clock() - start) / args.calls
        start = clock()
        for _ in range(args.calls):
            old = old_metric(algorithm)
        return new_s, (clock() - start) / args.calls, new, old

    step, (new_s, old_s, new, old) = bt.time_beside_run(
        compose(args), args.block, args.warmup, time_metrics, metric_first, clock
    )
    assert abs(new - old) <= 1e-9 * max(abs(old), 1e-30), (new, old)
    return {
        "step_s": step,
        "metric_s": new_s,
        "old_metric_s": old_s,
        "share": new_s / (args.log_every * step),
        "old_share": old_s / (args.log_every * step),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--block", type=int, default=10, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5, help="metric calls per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=list(bt.CLOCKS), default="cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    name = "consensus_metric_cost"
    results = bt.Results(args.json or bt.default_json(name), name, vars(args) | {"json": None})
    print(f"{bt.load()}; {args.threads} thread(s); {args.clock} time")
    rounds = []
    for r in range(args.rounds):
        row = one_round(args, metric_first=r % 2 == 1)
        rounds.append(row)
        results.add(round=r, **row)
        print(
            f"round {r}: step {1e3 * row['step_s']:.1f} ms, metric {1e3 * row['metric_s']:.2f} "
            f"ms ({row['share']:.2%} of {args.log_every} steps), before issue 16 "
            f"{1e3 * row['old_metric_s']:.2f} ms ({row['old_share']:.2%})",
            flush=True,
        )
    shares = [r["share"] for r in rounds]
    old = [r["old_share"] for r in rounds]
    print(
        f"consensus distance at log_every={args.log_every}, K={args.workers} MLP D-PSGD: "
        f"{statistics.median(shares):.2%} {bt.fmt_range([100 * s for s in shares], 2)}% of the "
        f"step (target <= 3%); before: {statistics.median(old):.2%}"
    )
    results.write(share_median=statistics.median(shares), old_share_median=statistics.median(old))
    print(f"wrote {results.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
