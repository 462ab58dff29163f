"""Operations and Python calls per step of an algorithm's update (issue 42, item 4): what runs
between the workers' backward and the next forward, per method, counted rather than timed.

K = `--workers` simulated GPT workers (`--model`, default gpt_tiny) on the shared Shakespeare
corpus run `--steps` steps of each case; the algorithm's `after_backward` — the optimizer
steps, the method's exchange and its outer step — is wrapped so that after `--warmup` steps
torch's profiler counts the aten operations it dispatches (every other step) and cProfile the
Python function calls it makes (the steps between); with H = 3 the outer steps fall on steps
of both kinds, one step in three. Printed per case: aten ops per step, Python calls per step,
and the Python calls inside `torch.optim` (a per-worker optimizer step shows there: K passes
through the optimizer's wrapper and per-parameter loop). Counts are deterministic: no load to
record.

    python experiments/bench/step_ops.py [--workers 8] [--steps 12] [--warmup 4]
        [--cases diloco sparseloco demo sparta sync_adamw muon] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_timing as bt  # noqa: E402
from bench_cases import compose  # noqa: E402
from lm_throughput import CORPUS  # noqa: E402

ADAMW = ["optimizer=adamw_lm"]
CASES = {
    "sync_adamw": [*ADAMW],
    "diloco": [*ADAMW, "algorithm=local_sgd", "algorithm.period=3", "outer=nesterov"],
    "sparseloco": [*ADAMW, "algorithm=local_sgd", "algorithm.period=3", "outer=sparseloco"],
    "demo": ["optimizer=demo"],
    "sparta": [*ADAMW, "algorithm=sparta"],
    "muon": ["optimizer=muon"],
    "onebit_adam": ["optimizer=onebit_adam", "optimizer.freeze_step=2"],
}


def count(case: str, args) -> dict[str, float]:
    """Per measured step: aten ops, Python calls, Python calls inside torch.optim."""
    cfg = compose(
        "data=shakespeare", f"data.root={CORPUS}", f"model={args.model}",
        f"workers={args.workers}", "train.batch_size=4", f"train.steps={args.steps}",
        f"train.eval_every={100 * args.steps}", f"train.log_every={args.steps}",
        "train.progress=false", "train.save_model=false", "data.sample_tokens=0",
        "backend.threads=1", *CASES[case],
    )  # fmt: skip
    ops = calls = optim_calls = 0
    measured = 0
    with tempfile.TemporaryDirectory(prefix="bench-ops-") as tmp:
        trainer = bt.simulated_trainer(cfg, Path(tmp), evaluate=lambda: {"test/loss": 0.0})
        algorithm = trainer.built.algorithm
        inner = algorithm.after_backward

        def after_backward(step: int) -> None:
            # the two tools one step each (torch's profiler silences cProfile)
            nonlocal ops, calls, optim_calls, measured
            if step < args.warmup:
                inner(step)
            elif (step - args.warmup) % 2 == 0:
                with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
                    inner(step)
                ops += sum(1 for e in prof.events() if e.name.startswith("aten::"))
                measured += 1
            else:
                profile = cProfile.Profile()
                profile.runcall(inner, step)
                stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
                calls += sum(n for (_, n, _, _, _) in stats.values())  # (cc, nc, tt, ct, callers)
                optim_calls += sum(
                    n for (file, _, _), (_, n, _, _, _) in stats.items() if "torch/optim" in file
                )

        algorithm.after_backward = after_backward
        trainer.run()
    profiled = args.steps - args.warmup - measured
    return {
        "aten_ops": ops / measured,
        "python_calls": calls / profiled,
        "torch_optim_calls": optim_calls / profiled,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_tiny")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"model={args.model}, K={args.workers}, steps {args.warmup}..{args.steps - 1}")
    print("| case | aten ops / step | Python calls / step | of them in torch.optim |")
    print("|---|---|---|---|")
    results = {}
    for case in args.cases:
        c = results[case] = count(case, args)
        print(
            f"| {case} | {c['aten_ops']:.0f} | {c['python_calls']:.0f} "
            f"| {c['torch_optim_calls']:.0f} |",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
