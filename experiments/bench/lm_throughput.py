"""Language-model throughput: K simulated workers and our one-worker loop against a minimal
hand-written AdamW loop of the same GPT (issue 29, item 5).

The character-level GPT (`--model`: a `conf/model` preset, e.g. gpt for the CPU study size,
gpt_nanogpt for nanoGPT's shakespeare-char size) on the shared Shakespeare corpus, AdamW,
synchronous workers. Sides, alternating in rounds (every side once per round, the order
reversed every other round):

- `simulated`: the training loop with K = `--workers` simulated workers × `--batch` windows;
- `ours`: the training loop with one worker × `--batch` windows;
- `minimal`: a hand-written loop, written here — random windows gathered from the token stream,
  forward, cross-entropy, backward, `torch.optim.AdamW` step — at `--batch` windows;
- `minimal_global`: the same at the global batch K × `--batch`.

Ratios of time per token, per round (median [range]): simulated ÷ minimal_global (goal ≤ 1.3
on a CPU: what simulating K workers costs over one process at the global batch) and ours ÷
minimal (goal ≤ 1.1: what the framework adds to a minimal loop). Our steps are the trainer's
step regions (compute + exposed communication, median block after warm-up); the minimal loop is
timed around the same work. `--clock cpu` (default on a CPU) reads this thread's CPU time,
which other jobs inflate far less than wall time; on a GPU the wall clock, with a host read of
the loss every step as our loop makes. Without a GPU, `--device cuda` prints one `skipped:`
line and exits 0.

    python experiments/bench/lm_throughput.py [--model gpt] [--workers 8] [--batch 16]
        [--rounds 5] [--block 10] [--blocks 3] [--warmup 5] [--device cpu|cuda]
        [--autocast bf16] [--sides simulated ours minimal minimal_global]
        [--algorithm sync|diloco|sparseloco] [--period 50]

`--algorithm diloco|sparseloco` makes the simulated side that method with outer steps every
`--period` steps (the minimal loop stays plain AdamW: the ratio is what simulating the method's
K workers costs over one process's AdamW); choose `--block` a multiple of the period so that
every timed block holds its share of outer steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_timing as bt  # noqa: E402
from bench_cases import compose as compose_run  # noqa: E402

# The corpus: DPRESEARCH_SHAKESPEARE where set (as conf/data/shakespeare.yaml reads it).
CORPUS = Path(
    os.environ.get(
        "DPRESEARCH_SHAKESPEARE", REPO.parent / "shared" / "data" / "shakespeare" / "works"
    )
)
SIDES = ("simulated", "ours", "minimal", "minimal_global")
# The simulated side's method (`--algorithm`; `--period` H): synchronous AdamW, DiLoCo (inner
# AdamW, outer Nesterov every H steps), SparseLoCo (its outer step, compressed, every H steps).
ALGORITHMS = {
    "sync": [],
    "diloco": ["algorithm=local_sgd", "algorithm.period={H}", "outer=nesterov"],
    "sparseloco": ["algorithm=local_sgd", "algorithm.period={H}", "outer=sparseloco"],
}


def compose(args, workers: int):
    overrides = [
        "data=shakespeare",
        f"data.root={CORPUS}",
        f"model={args.model}",
        "optimizer=adamw_lm",
        "train.grad_clip=null",  # as the shipped figures ran (before the LM data clipped)
        f"workers={workers}",
        f"train.batch_size={args.batch}",
        *bt.timed_run(args.warmup, args.block, args.blocks),
        "data.sample_tokens=0",
        f"train.device={args.device}",
        f"train.batched_workers={args.batched}",
        *([f"train.autocast={args.autocast}"] if args.autocast else []),
        "backend.threads=1",
        *([f"model.dropout={args.dropout}"] if args.dropout is not None else []),
        *(o.format(H=args.period) for o in ALGORITHMS[args.algorithm]),
    ]
    return compose_run(*overrides)


def ours(args, data, workers: int) -> tuple[float, str]:
    """Median step time of the training loop with `workers` simulated workers."""
    cfg = compose(args, workers)
    with tempfile.TemporaryDirectory(prefix="bench-lm-") as tmp, bt.loop_clock(args.read):
        trainer = bt.simulated_trainer(
            cfg, Path(tmp), device=args.device, data=data, evaluate=lambda: {"test/loss": 0.0}
        )
        trainer.run()
        times = bt.logged_block_times(Path(tmp) / "metrics.jsonl", args.block, args.warmup)
    return statistics.median(times), trainer.compute.mode


def minimal(args, data, batch: int) -> float:
    """Median step time of a hand-written AdamW loop of the same GPT at `batch` windows."""
    from hydra.utils import instantiate

    cfg = compose(args, 1)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = instantiate(cfg.model, num_classes=data.num_classes, input_shape=data.input_shape)
    model = model.to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.99),
        weight_decay=0.1,
    )
    stream = data.train_inputs.to(device)
    offsets = torch.arange(data.block_size + 1, device=device)
    generator = torch.Generator().manual_seed(1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast or "")
    high = stream.shape[0] - data.block_size - 1

    def step() -> None:
        starts = torch.randint(high, (batch,), generator=generator).to(device)
        w = stream[starts[:, None] + offsets].long()
        x, y = w[:, :-1], w[:, 1:]
        with torch.autocast(device.type, dtype=dtype) if dtype else torch.enable_grad():
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
        bool(loss.isfinite())  # the host read our loop makes every step

    times = []
    for i in range(args.warmup + args.block * args.blocks):
        start = args.read()
        step()
        if i >= args.warmup:
            times.append(args.read() - start)
    blocks = [statistics.fmean(times[j : j + args.block]) for j in range(0, len(times), args.block)]
    return statistics.median(blocks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cuda", "cpu"])
    parser.add_argument("--clock", choices=["cpu", "wall"], default=None)
    parser.add_argument("--autocast", choices=["bf16", "fp16"], default=None)
    parser.add_argument(
        "--batched", default="auto", choices=["auto", "true", "false", "stacked", "vmap"]
    )
    parser.add_argument(
        "--dropout", type=float, default=None, help="model.dropout (stacked: on the worker stream)"
    )
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument(
        "--algorithm",
        default="sync",
        choices=list(ALGORITHMS),
        help="the simulated side's method (the minimal loop: plain AdamW)",
    )
    parser.add_argument("--period", type=int, default=50, help="H of diloco / sparseloco")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not bt.device_clock(args, "lm_throughput"):
        return 0
    clock = args.clock
    from dpresearch.data.text import TextDataset

    cfg = compose(args, 1)
    data = TextDataset.load(
        CORPUS,
        block_size=int(cfg.data.block_size),
        val_works=list(cfg.data.val_works),
        test_works=list(cfg.data.test_works),
    )
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "read")}
    results = bt.Results(
        args.json or bt.default_json("lm_throughput"),
        "lm_throughput",
        settings | {"device_name": name, "clock": clock},
    )
    tokens = {
        "simulated": args.workers * args.batch,
        "ours": args.batch,
        "minimal": args.batch,
        "minimal_global": args.workers * args.batch,
    }
    tokens = {s: n * data.block_size for s, n in tokens.items()}
    print(
        f"GPT model={args.model}, {args.algorithm}, K={args.workers} × {args.batch} windows of "
        f"{data.block_size} on {name}, {clock} clock; {bt.load()}",
        flush=True,
    )
    steps: dict[str, list[float]] = {s: [] for s in args.sides}
    took = ""
    for r in range(args.rounds):
        for side in args.sides if r % 2 == 0 else list(reversed(args.sides)):
            if side == "simulated":
                step, took = ours(args, data, args.workers)
            elif side == "ours":
                step, _ = ours(args, data, 1)
            else:
                step = minimal(args, data, tokens[side] // data.block_size)
            steps[side].append(step)
        print(
            f"round {r}: "
            + ", ".join(f"{s} {tokens[s] / steps[s][-1]:.0f} tokens/s" for s in args.sides),
            flush=True,
        )
        results.add(round=r, step_s={s: steps[s][-1] for s in args.sides})
    print(f"\n{bt.load()} at the end")
    print("| side | tokens/s (median) | ratio of time per token, median [range] | goal |")
    print("|---|---|---|---|")
    for side in args.sides:
        print(f"| {side} | {tokens[side] / statistics.median(steps[side]):.0f} | | |")
    summary = {}
    for a, b, goal in (("simulated", "minimal_global", "≤ 1.3"), ("ours", "minimal", "≤ 1.1")):
        if {a, b} <= set(args.sides):
            ratio = [
                (x / tokens[a]) / (y / tokens[b]) for x, y in zip(steps[a], steps[b], strict=True)
            ]
            summary[f"{a}_over_{b}"] = ratio
            print(
                f"| {a} ÷ {b} | | {statistics.median(ratio):.3f} {bt.fmt_range(ratio)} | {goal} |"
            )
    print(f"simulated side: {took}")
    results.finish(summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
