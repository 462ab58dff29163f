"""Cost of a checkpoint (issue 9): ResNet-18, K = 4 simulated workers, sync + top-k + EF14,
momentum SGD, on the CIFAR-10 subset.

1. Writing one checkpoint (`Trainer.checkpoint`: every replica, optimizer, EF memory, cursor,
   RNG stream and the ledger, to a temporary file, fsync, rename, the `latest` pointer,
   pruning) against `torch.save` of the same tensors (the `[K, D]` parameter and buffer
   rows, every momentum buffer, every EF memory) to a plain file in the same directory, made
   as durable (flush + `os.fsync`), and against one memory pass (`copy_` of those tensors).
   Target (issue 16): ≤ 1.5 × `torch.save` + fsync. The two writes alternate, `--repeats`
   times each; the ratio is the median over rounds of the per-round ratio, with its range.
   Each file is deleted before the next write, so neither benefits from the other's page
   cache. The file must load with `torch.load(weights_only=True)` (checked once).
2. The steady-state overhead of `train.checkpoint_every=1ep`: one checkpoint ÷ one epoch,
   the epoch's time estimated as the median measured step time (the trainer's own loop, after
   `--warmup` steps) × steps per epoch of the subset at `--batch`. Target: ≤ 2 %.

Prints both ratios from the same run and writes JSON (`--json PATH`; default
`runs/bench/checkpoint_cost-<time>.json`).

    python experiments/bench/checkpoint_cost.py [--repeats 5] [--steps 4] [--batch 32]
        [--workers 4] [--model resnet18]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

SUBSET = REPO.parent / "shared" / "data" / "cifar10-subset"


def build(args: argparse.Namespace, run_dir: Path):
    from conftest import compose_config

    from dpresearch.comm.simulated import SimulatedCommunicator
    from dpresearch.run.build import network_model
    from dpresearch.run.trainer import Trainer

    cfg = compose_config(
        "experiment=powersgd_resnet18_cifar10",
        f"data.root={args.root}",
        f"workers={args.workers}",
        f"model={args.model}",
        "compressor=topk",
        "compressor.ratio=0.01",
        "error_feedback=ef14",
        f"train.batch_size={args.batch}",
        f"train.steps={args.warmup + args.steps}",
        "train.log_every=1",
        f"train.eval_every={args.warmup + args.steps}",
        "train.progress=false",
        "train.save_model=false",
        "train.lr_scaling=none",
        "train.checkpoint_keep=1",
    )
    comm = SimulatedCommunicator(cfg.workers, network_model(cfg))
    return Trainer(cfg, comm, torch.device("cpu"), run_dir)


def same_tensors(trainer) -> dict:
    """The checkpoint's tensors, as a user would `torch.save` them."""
    momentum = [s["momentum_buffer"] for opt in trainer.optimizers for s in opt.state.values() if s]
    ef = trainer.algorithm.state_dict()
    return {
        "params": trainer.replicas.params,
        "buffers": trainer.replicas.buffers,
        "momentum": momentum,
        "ef": ef,
    }


def tensors_of(obj) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in tensors_of(v)]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed training steps")
    parser.add_argument("--batch", type=int, default=32, help="per worker")
    parser.add_argument("--root", type=Path, default=SUBSET)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--model", default="resnet18", help="smoke runs: resnet20")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not (args.root / "cifar-10-batches-py").is_dir():
        print(f"skipped: no CIFAR-10 subset at {args.root}")
        return 0

    with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=REPO / "runs") as tmp:
        run_dir = Path(tmp) / "run"
        trainer = build(args, run_dir)
        # Train (momentum and EF memories filled); the step time is the trainer's own step
        # regions (compute + exposed comm) between consecutive logged steps.
        trainer.run()
        lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        inside = [m["time/compute_s"] + m["time/comm_s"] for m in lines]
        step_s = [b - a for a, b in zip(inside, inside[1:], strict=False)][args.warmup - 1 :]
        state = same_tensors(trainer)
        tensors = tensors_of(state)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        plain = Path(tmp) / "plain.pt"
        ckpt_s, save_s, copy_s = [], [], []
        scratch = [torch.empty_like(t) for t in tensors]
        for r in range(args.repeats):
            order = ("ckpt", "save") if r % 2 == 0 else ("save", "ckpt")
            for which in order:
                begin = time.perf_counter()
                if which == "ckpt":
                    path = trainer.checkpoint(1000 + r)
                    ckpt_s.append(time.perf_counter() - begin)
                    ckpt_bytes = path.stat().st_size
                    if r == 0:
                        torch.load(path, weights_only=True)  # plain data only
                    path.unlink()
                else:
                    with open(plain, "wb") as f:
                        torch.save(state, f)
                        f.flush()
                        os.fsync(f.fileno())
                    save_s.append(time.perf_counter() - begin)
                    save_bytes = plain.stat().st_size
                    plain.unlink()
            begin = time.perf_counter()
            for dst, src in zip(scratch, tensors, strict=True):
                dst.copy_(src)
            copy_s.append(time.perf_counter() - begin)

    ckpt, save, copy = (statistics.median(v) for v in (ckpt_s, save_s, copy_s))
    ratios = [c / s for c, s in zip(ckpt_s, save_s, strict=True)]
    step = statistics.median(step_s)
    per_epoch = trainer.steps_per_epoch
    epoch_s = step * per_epoch
    result = {
        "model": args.model,
        "workers": args.workers,
        "state_bytes": nbytes,
        "checkpoint_file_bytes": ckpt_bytes,
        "torch_save_file_bytes": save_bytes,
        "checkpoint_s": ckpt,
        "torch_save_s": save,
        "copy_pass_s": copy,
        "checkpoint_over_torch_save_fsync": statistics.median(ratios),
        "ratio_runs": ratios,
        "load": os.getloadavg(),
        "checkpoint_memory_passes": ckpt / copy,
        "torch_save_memory_passes": save / copy,
        "checkpoint_runs_s": ckpt_s,
        "torch_save_runs_s": save_s,
        "step_s_median": step,
        "step_runs_s": step_s,
        "steps_per_epoch": per_epoch,
        "epoch_s_estimated": epoch_s,
        "checkpoint_per_epoch_overhead": ckpt / epoch_s,
        "batch_per_worker": args.batch,
        "threads": torch.get_num_threads(),
    }
    print(
        f"state: {nbytes / 1e6:.0f} MB in {len(tensors)} tensors ({args.model}, "
        f"K={args.workers}, EF, momentum)"
    )
    print(
        f"checkpoint {ckpt:.3f} s (file {ckpt_bytes / 1e6:.0f} MB) vs torch.save + fsync "
        f"{save:.3f} s (file {save_bytes / 1e6:.0f} MB): {statistics.median(ratios):.2f}x "
        f"[{min(ratios):.2f}–{max(ratios):.2f}] (target <= 1.5); "
        f"{ckpt / copy:.1f} memory passes (torch.save {save / copy:.1f}); "
        f"load {' '.join(f'{v:.2f}' for v in os.getloadavg())}"
    )
    print(
        f"step {step:.2f} s x {per_epoch} steps/epoch = {epoch_s:.0f} s per epoch; one "
        f"checkpoint per epoch: {100 * ckpt / epoch_s:.2f}% (target <= 2%)"
    )
    out = (
        args.json
        or REPO / "runs" / "bench" / f"checkpoint_cost-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
