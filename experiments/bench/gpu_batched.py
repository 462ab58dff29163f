"""K simulated workers on one GPU: batched vs one by one vs one process on the global batch
(issue 16, GPU row).

ResNet-20 on CIFAR-10-shaped images (the CIFAR-10 subset if present, else seeded random
images of the same shape and type: the arithmetic is the same), K = `--workers` (16) workers ×
`--batch` (128) images, sync SGD (momentum 0.9), with the standard augmentation. Sides,
alternating in rounds:

- `stacked`: the training loop with `train.batched_workers=stacked` (one forward and backward
  whose layers hold the K workers' weights as one tensor — grouped convolutions, per-worker
  BatchNorm — writing the gradients into the K parameter rows; issue 31);
- `vmap`: the same with `train.batched_workers=vmap` (a `torch.func.vmap` ensemble over the
  rows, gradients copied into them; issue 16);
- `loop`: the same with `train.batched_workers=false` (the workers one after another: K
  launches of every kernel);
- `single`: one model, one process, batch K × `--batch` (2048), written here: gather,
  augmentation, forward, loss, backward, SGD step — the throughput ceiling of the arithmetic.

Our steps are the trainer's step regions (`time/compute_s + time/comm_s`, median block after
warm-up; every step reads its losses on the host for the divergence check, so the GPU has
finished the step when its region ends); the single process is timed around the same work with
a host read of its loss per step. Targets: loop ÷ stacked ≥ 5; stacked ÷ single ≤ 1.5 (vmap ÷
stacked beside them). Prints images/s of each side. `--gpt` adds the LM rows: tokens/s of K = 8
simulated workers of nanoGPT's shakespeare-char GPT (without dropout, as these rows were
first measured; with dropout the stacked GPT needs `model.dropout_stream=worker`, the default)
stacked and one by one, and a minimal AdamW loop at the global batch
(`lm_throughput.py`). Without a GPU it prints one `skipped:` line and exits 0; `--device cpu`
runs the same code on the CPU (smoke runs at tiny sizes).

    python experiments/bench/gpu_batched.py [--workers 16] [--batch 128] [--rounds 5]
        [--block 10] [--blocks 3] [--warmup 5] [--channels-last] [--autocast bf16] [--gpt]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_timing as bt  # noqa: E402
from bench_cases import SUBSET  # noqa: E402
from bench_cases import compose as compose_run  # noqa: E402


def dataset(args):
    """The CIFAR-10 subset, or seeded random images of its shape (uint8, 10 classes)."""
    from dpresearch.data.cifar import CIFAR10, CIFAR10_LAYOUT

    if (SUBSET / "cifar-10-batches-py").is_dir() and not args.random_images:
        return CIFAR10.load(SUBSET), "CIFAR-10 subset"
    g = torch.Generator().manual_seed(0)
    n = max(args.workers * args.batch * 4, 4096)
    images = lambda k: torch.randint(0, 256, (k, 3, 32, 32), generator=g, dtype=torch.uint8)
    labels = lambda k: torch.randint(0, 10, (k,), generator=g)
    data = CIFAR10(
        train_inputs=images(n),
        train_targets=labels(n),
        test_inputs=images(256),
        test_targets=labels(256),
        num_classes=10,
        mean=CIFAR10_LAYOUT.mean,
        std=CIFAR10_LAYOUT.std,
    )
    return data, f"{n} random CIFAR-shaped images"


def compose(args, mode: str):
    overrides = [
        "data=cifar10",
        f"data.root={SUBSET}",
        "model=resnet20",
        f"workers={args.workers}",
        f"train.batch_size={args.batch}",
        *bt.timed_run(args.warmup, args.block, args.blocks),
        f"train.device={args.device}",
        f"train.batched_workers={mode}",
        f"train.channels_last={str(args.channels_last).lower()}",
        *([f"train.autocast={args.autocast}"] if args.autocast else []),
        "optimizer.lr=0.1",
        "optimizer.momentum=0.9",
        "backend.threads=1",
    ]
    return compose_run(*overrides)


def ours(args, data, mode: str) -> tuple[float, str]:
    """Median step time of the training loop with `train.batched_workers=mode`."""
    cfg = compose(args, mode)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        trainer = bt.simulated_trainer(
            cfg,
            Path(tmp),
            device=args.device,
            data=data,
            evaluate=lambda: {"test/loss": 0.0, "test/acc": 0.0},
        )
        trainer.run()
        times = bt.logged_block_times(Path(tmp) / "metrics.jsonl", args.block, args.warmup)
    return statistics.median(times), trainer.compute.mode


def single(args, data) -> float:
    """Median step time of one ResNet-20 trained on batch K × batch in one process."""
    from dpresearch.models.resnet_cifar import ResNetCifar

    device = torch.device(args.device)
    data = data.to(device)
    torch.manual_seed(0)
    model = ResNetCifar(10, (3, 32, 32)).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    size = args.workers * args.batch
    order = torch.randperm(data.num_train, generator=generator).to(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast or "")
    times = []
    for i in range(args.warmup + args.block * args.blocks):
        start = time.perf_counter()
        lo = (i * size) % max(1, data.num_train - size)
        x, y = data.train_batch(order[lo : lo + size], generator)
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=dtype) if dtype else torch.enable_grad():
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
        bool(loss.isfinite())  # the host read our loop makes every step
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    blocks = [statistics.fmean(times[j : j + args.block]) for j in range(0, len(times), args.block)]
    return statistics.median(blocks)


def gpt_rows(args) -> dict:
    """The LM rows: `--gpt-model` (nanoGPT's shakespeare-char GPT) without dropout, K = 8 × 8
    windows, stacked and one by one, beside a minimal AdamW loop at the global batch
    (`lm_throughput.py`)."""
    import lm_throughput

    rows = {}
    for mode in ("stacked", "false"):
        json = args.json.with_name(f"{args.json.stem}-gpt-{mode}.json") if args.json else None
        argv = ["--model", args.gpt_model, "--dropout", "0", "--workers", "8", "--batch", "8",
                "--rounds", str(args.rounds), "--block", str(args.block), "--blocks", "2",
                "--warmup", str(args.warmup), "--device", args.device, "--batched", mode,
                "--sides", "simulated", "minimal_global",
                *(["--autocast", args.autocast] if args.autocast else []),
                *(["--json", str(json)] if json else [])]  # fmt: skip
        print(f"\nGPT, batched_workers={mode}:", flush=True)
        lm_throughput.main(argv)
        rows[mode] = argv
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--autocast", choices=["bf16", "fp16"], default=None)
    parser.add_argument("--random-images", action="store_true")
    parser.add_argument(
        "--sides",
        nargs="+",
        default=["stacked", "vmap", "loop", "single"],
        choices=["stacked", "vmap", "loop", "single"],
    )
    parser.add_argument("--gpt", action="store_true", help="also the LM rows (tokens/s)")
    parser.add_argument("--gpt-model", default="gpt_nanogpt", help="conf/model preset for --gpt")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_batched: skipped: no CUDA GPU is visible (use --device cpu for a smoke run)")
        return 0
    torch.set_num_threads(1)
    data, what = dataset(args)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    results = bt.Results(
        args.json or bt.default_json("gpu_batched"),
        "gpu_batched",
        vars(args) | {"json": None, "device_name": name, "data": what},
    )
    images = args.workers * args.batch
    print(f"ResNet-20, K={args.workers} × {args.batch} on {name} ({what}); {bt.load()}", flush=True)
    steps: dict[str, list[float]] = {s: [] for s in args.sides}
    took: dict[str, str] = {}
    for r in range(args.rounds):
        order = args.sides if r % 2 == 0 else list(reversed(args.sides))
        for side in order:
            if side == "single":
                steps[side].append(single(args, data))
            else:
                step, mode = ours(args, data, "false" if side == "loop" else side)
                steps[side].append(step)
                took[side] = mode
        print(
            f"round {r}: "
            + ", ".join(f"{s} {images / steps[s][-1]:.0f} images/s" for s in args.sides),
            flush=True,
        )
        results.add(round=r, step_s={s: steps[s][-1] for s in args.sides})
    per_round = lambda a, b: [x / y for x, y in zip(steps[a], steps[b], strict=True)]
    print()
    print("| side | images/s (median) | ratio | target |\n|---|---|---|---|")
    for side in args.sides:
        print(f"| {side} | {images / statistics.median(steps[side]):.0f} | | |")
    summary = {}
    for slow, fast, goal in (
        ("loop", "stacked", "≥ 5"),
        ("stacked", "single", "≤ 1.5"),
        ("vmap", "stacked", "–"),
        ("loop", "vmap", "–"),
    ):
        if {slow, fast} <= set(args.sides):
            ratio = per_round(slow, fast)
            summary[f"{slow}_over_{fast}"] = ratio
            print(
                f"| {slow} ÷ {fast} | | {statistics.median(ratio):.2f} "
                f"{bt.fmt_range(ratio, 2)} | {goal} |"
            )
    for side, mode in took.items():
        print(f"{side} side: {mode}")
    if args.gpt:
        summary["gpt"] = gpt_rows(args)
    results.write(summary=summary)
    print(f"wrote {results.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
