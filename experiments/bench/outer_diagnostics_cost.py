"""Cost of the outer diagnostics (issue 41, item 6): DiLoCo, K = 8 simulated workers of the
MLP (256→1024→1024→10, batch 128), H = `--period` (20) inner steps, outer Nesterov.

The share is  diagnostics ÷ round,  the diagnostics being one sync point's work
(`OuterDiagnostics.observe` on the run's `[K, D]` pseudo-gradient rows: the metrics allgather
and the float64 Gram) plus one metrics row's (`OuterDiagnostics.metrics`, the outer momentum's
norm), and the round H × the trainer's step region (`time/compute_s + time/comm_s` from
metrics.jsonl: batch, forward, backward, optimizer, and at each H-th step the outer step).
Both are timed with one clock (`--clock cpu`: this thread's CPU time, which other jobs on a
shared machine inflate far less than wall time; `wall`). Each round trains a fresh run, then
times the diagnostics `--calls` times on its final rows; rounds alternate which comes first;
the figure is the median over rounds of the per-round share, with its range.

    python experiments/bench/outer_diagnostics_cost.py [--rounds 5] [--workers 8]
        [--period 20] [--calls 5] [--clock cpu]

Target: ≤ 2 % of a round.
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
        "algorithm=local_sgd",
        f"algorithm.period={args.period}",
        "outer=nesterov",
        f"workers={args.workers}",
        *bt.timed_run(args.period, args.period, args.blocks),
        "data.num_test=256",
    )


def one_round(args, diagnostics_first: bool) -> dict[str, float]:
    from dpresearch.algorithms.diagnostics import outer_momentum_norm

    clock = bt.CLOCKS[args.clock]

    def time_diagnostics(trainer) -> float:
        outer = trainer.algorithm
        delta = outer.anchor.params[0] - outer.base.model_rows()
        outer.diagnostics.observe(0, delta, outer.comm)  # warm
        start = clock()
        for _ in range(args.calls):
            outer.diagnostics.observe(0, delta, outer.comm)
            outer.diagnostics.metrics()
            outer_momentum_norm(outer.outer)
        return (clock() - start) / args.calls

    step, diag_s = bt.time_beside_run(
        compose(args), args.period, args.period, time_diagnostics, diagnostics_first, clock
    )
    round_s = args.period * step
    return {"step_s": step, "round_s": round_s, "diagnostics_s": diag_s, "share": diag_s / round_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--period", type=int, default=20, help="H: inner steps per round")
    parser.add_argument("--blocks", type=int, default=2, help="timed rounds per run")
    parser.add_argument("--calls", type=int, default=5, help="diagnostics calls per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=list(bt.CLOCKS), default="cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    name = "outer_diagnostics_cost"
    results = bt.Results(args.json or bt.default_json(name), name, vars(args) | {"json": None})
    print(f"{bt.load()}; {args.threads} thread(s); {args.clock} time")
    rounds = []
    for r in range(args.rounds):
        row = one_round(args, diagnostics_first=r % 2 == 1)
        rounds.append(row)
        results.add(round=r, **row)
        print(
            f"round {r}: step {1e3 * row['step_s']:.1f} ms, round {1e3 * row['round_s']:.0f} ms, "
            f"diagnostics {1e3 * row['diagnostics_s']:.2f} ms ({row['share']:.2%})",
            flush=True,
        )
    shares = [r["share"] for r in rounds]
    print(
        f"outer diagnostics, DiLoCo K={args.workers} H={args.period} MLP: "
        f"{statistics.median(shares):.2%} {bt.fmt_range([100 * s for s in shares], 2)}% of a "
        f"round (target <= 2%); {bt.load()}"
    )
    results.write(share_median=statistics.median(shares))
    print(f"wrote {results.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
