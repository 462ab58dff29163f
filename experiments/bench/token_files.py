"""Token files of any size (issue 42, item 1): memory-mapped `train.bin` against the ids held in
memory — peak RSS, start-up, and training throughput.

1. **RSS and start-up.** A generated nanoGPT folder (`train.bin` of `--gb` GB of random uint16
   GPT-2 ids, a small `val.bin`) is written into a temporary directory (deleted after), and
   `python -m dpresearch.train data=text data.root=<dir> model=<--model> train.steps=<--steps>`
   runs on it as a new process, `--repeats` times; its peak RSS is the child's `ru_maxrss`
   (`os.wait4`), its start-up the wall time until its first training step is logged
   (`train.log_every=1`: metrics.jsonl's first line), its whole wall time beside it. Rows: a
   tiny file (the interpreter, torch and the model: the baseline), the big file mapped, the
   small file (`--small-mb`) mapped and read whole (`data.memmap=false`), and the big file
   mapped by `--gloo` gloo worker processes (the largest process's peak: no worker copies the
   corpus). RSS beyond the tiny file's is what the corpus costs; the goal is the model's state
   + 1 GB at any size.
2. **Throughput.** The training loop (`Trainer`, in this process, one thread, this thread's
   CPU time as the loop clock) on a `--small-mb` file of ids below `--tp-vocab` (256: with
   GPT-2's vocabulary the output layer dwarfs the gather and the ratio says nothing) mapped
   and read whole, `--workers` simulated workers × `--batch` windows, sides alternating in
   `--rounds` rounds; per round mapped ÷ in memory of time per token (median [range]); goal ≤
   1.05. The gather alone (`train_batch` of the K × B windows, the step's share the maps
   change) is timed beside it.

Batches are kept small (`train.batch_size=8`, `train.eval_batch_size=16`, `data.eval_tokens`):
with GPT-2's 50,257 entries the logits of the default batches (32 windows of 64; evaluation's
1000) and their gradients take GBs — the model's activations, not the corpus's.

    python experiments/bench/token_files.py [--gb 2] [--small-mb 64] [--model gpt_tiny]
        [--vocab 50257] [--steps 3] [--repeats 1] [--gloo 2] [--rows tiny big small
        small_memory gloo] [--rounds 5] [--workers 4]
        [--batch 8] [--tp-steps 40] [--tp-vocab 256] [--clock cpu|wall] [--dir DIR]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_timing as bt  # noqa: E402
from bench_cases import compose as compose_run  # noqa: E402

VOCAB = 50257  # GPT-2's ids, as nanoGPT's OpenWebText folder holds them
CHUNK = 1 << 24  # ids written per chunk (32 MB)
SMALL_EVAL = ["train.eval_batch_size=16", "data.eval_tokens=1024", "data.sample_tokens=0"]
# The command-line runs' batch: 8 windows a worker. (At the default 32, GPT-2's vocabulary makes
# the logits and their gradients alone some GB: the model's activations, not the corpus.)
CLI_BATCH = "train.batch_size=8"
ROWS = ("tiny", "big", "small", "small_memory", "gloo")


def write_folder(folder: Path, tokens: int, vocab: int, seed: int = 0) -> Path:
    """A nanoGPT folder: `tokens` random ids below `vocab` in train.bin, 2^20 in val.bin."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    block = rng.integers(0, vocab, min(tokens, CHUNK), dtype=np.uint16)
    with open(folder / "train.bin", "wb") as f:
        for at in range(0, tokens, CHUNK):
            # (a shifted copy per chunk: generating GBs of random ids would take minutes)
            ((block[: min(CHUNK, tokens - at)].astype(np.int64) + at) % vocab).astype(
                np.uint16
            ).tofile(f)
    block[: 1 << 20].tofile(folder / "val.bin")
    return folder


def measure(command: list[str], cwd: Path, metrics: Path) -> dict[str, float]:
    """Run `command`; its peak RSS (MB; the largest of it and its descendants), wall seconds
    until `metrics` has a line, and wall seconds to its end."""
    err_file = metrics.parent.parent / f"{metrics.parent.name}.stderr"
    start = time.perf_counter()
    with open(err_file, "w") as err:
        proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err)
    first = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if first is None and metrics.is_file() and metrics.stat().st_size:
            first = time.perf_counter() - start
        time.sleep(0.02)
    total = time.perf_counter() - start
    proc.returncode = code = os.waitstatus_to_exitcode(status)  # (reaped: Popen must not wait)
    if code:
        raise RuntimeError(f"{' '.join(command)} failed ({code}): {err_file.read_text()[-2000:]}")
    return {"rss_mb": usage.ru_maxrss / 1024, "first_step_s": first or total, "total_s": total}


def cli_row(name: str, folder: Path, work: Path, args, *extra: str) -> dict[str, float]:
    runs = []
    for i in range(args.repeats):
        run_dir = work / f"run-{name.split()[0]}-{len(list(work.iterdir()))}-{i}"
        command = [
            sys.executable,
            "-m",
            "dpresearch.train",
            "data=text",
            f"data.root={folder}",
            f"data.vocab_size={args.vocab}",
            f"model={args.model}",
            f"train.steps={args.steps}",
            "train.log_every=1",
            "train.progress=false",
            "train.save_model=false",
            "backend.threads=1",
            f"hydra.run.dir={run_dir}",
            CLI_BATCH,
            *SMALL_EVAL,
            *extra,
        ]
        runs.append(measure(command, work, run_dir / "metrics.jsonl"))
        shutil.rmtree(run_dir, ignore_errors=True)
    row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(
        f"| {name} | {row['rss_mb']:.0f} | {row['first_step_s']:.1f} | {row['total_s']:.1f} |",
        flush=True,
    )
    return row


def model_state_mb(model: str, vocab: int) -> float:
    """The model's parameters + gradients + AdamW's two moments, MB (fp32), one worker."""
    from hydra.utils import instantiate

    cfg = compose_run("data=text", "data.root=.", f"model={model}")
    net = instantiate(cfg.model, num_classes=vocab, input_shape=(int(cfg.data.block_size),))
    return 4 * 4 * sum(p.numel() for p in net.parameters()) / 2**20


def throughput(args, small: Path) -> dict[str, list[float]]:
    """Per round: time per token of the loop on `small` mapped and in memory, and of the
    gather alone, alternating sides."""
    from dpresearch.data.text import TextDataset

    block, warmup = 10, 10
    cfg = compose_run(
        "data=text",
        f"data.root={small}",
        f"data.vocab_size={args.tp_vocab}",
        f"model={args.model}",
        f"workers={args.workers}",
        f"train.batch_size={args.batch}",
        *bt.timed_run(warmup, block, max(1, args.tp_steps // block)),
        "backend.threads=1",
        *SMALL_EVAL,
    )
    kw = {"block_size": int(cfg.data.block_size), "vocab_size": args.tp_vocab, "eval_tokens": 1024}
    data = {
        "mapped": TextDataset.load(small, **kw),
        "memory": TextDataset.load(small, memmap=False, **kw),
    }
    tokens = args.workers * args.batch * int(cfg.data.block_size)

    def loop(side: str) -> float:
        with tempfile.TemporaryDirectory(prefix="bench-tokens-") as tmp, bt.loop_clock(args.read):
            trainer = bt.simulated_trainer(
                cfg, Path(tmp), data=data[side], evaluate=lambda: {"test/loss": 0.0}
            )
            trainer.run()
            return statistics.median(
                bt.logged_block_times(Path(tmp) / "metrics.jsonl", block, warmup)
            )

    def gather(side: str) -> float:
        d = data[side]
        part = d.make_partitioner(args.workers, 0)
        index = torch.cat([part.epoch_indices(w, 0)[: args.batch] for w in range(args.workers)])
        times = []
        for _ in range(200):
            start = args.read()
            d.train_batch(index)
            times.append(args.read() - start)
        return statistics.median(times)

    got: dict[str, list[float]] = {
        "mapped": [],
        "memory": [],
        "gather_mapped": [],
        "gather_memory": [],
    }
    for r in range(args.rounds):
        order = ("mapped", "memory") if r % 2 == 0 else ("memory", "mapped")
        for side in order:
            got[side].append(loop(side))
            got[f"gather_{side}"].append(gather(side))
        ratio = got["mapped"][-1] / got["memory"][-1]
        print(
            f"round {r}: mapped {tokens / got['mapped'][-1]:.0f} tokens/s, in memory "
            f"{tokens / got['memory'][-1]:.0f} tokens/s, mapped ÷ memory of time per token "
            f"{ratio:.3f}; gather {1e6 * got['gather_mapped'][-1]:.0f} vs "
            f"{1e6 * got['gather_memory'][-1]:.0f} µs",
            flush=True,
        )
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="size of the big train.bin")
    parser.add_argument("--small-mb", type=float, default=64.0)
    parser.add_argument("--model", default="gpt_tiny")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="ids drawn below it")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gloo", type=int, default=2, help="gloo workers on the big file")
    parser.add_argument(
        "--rows",
        nargs="*",
        default=list(ROWS),
        choices=ROWS,
        help="the command-line runs to measure",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tp-steps", type=int, default=40, help="timed steps per loop run")
    parser.add_argument(
        "--tp-vocab",
        type=int,
        default=256,
        help="ids of the throughput file (a small vocabulary: the gather's "
        "share of a step at its largest)",
    )
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--dir", type=Path, default=None, help="where the temporary folder goes")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.read = bt.CLOCKS[args.clock]
    bt.pin_threads(1)
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "read", "dir")}
    results = bt.Results(args.json or bt.default_json("token_files"), "token_files", settings)
    before = bt.load()
    state = model_state_mb(args.model, args.vocab)
    print(
        f"token files: {args.gb:g} GB train.bin, model={args.model} (state {state:.0f} MB: "
        f"parameters, gradients, AdamW), {before}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-token-files-", dir=args.dir) as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        big = write_folder(work / "big", int(args.gb * 2**30) // 2, args.vocab)
        small = write_folder(work / "small", int(args.small_mb * 2**20) // 2, args.vocab, 1)
        tiny = write_folder(work / "tiny", 1 << 20, args.vocab, 2)
        print(f"wrote the files in {time.perf_counter() - start:.1f} s", flush=True)
        print("| run | peak RSS (MB) | start-up to step 1 (s) | wall (s) |\n|---|---|---|---|")
        cases = {  # row: (label, folder, overrides)
            "tiny": ("tiny (2 MB)", tiny, ()),
            "big": (f"{args.gb:g} GB mapped", big, ()),
            "small": (f"{args.small_mb:g} MB mapped", small, ()),
            "small_memory": (f"{args.small_mb:g} MB in memory", small, ("data.memmap=false",)),
            "gloo": (f"{args.gb:g} GB mapped, gloo × {args.gloo}", big,
                     ("backend=gloo", f"workers={args.gloo}")),
        }  # fmt: skip
        rows = {}
        for row in args.rows:
            label, folder, extra = cases[row]
            rows[label] = cli_row(label, folder, work, args, *extra)
            results.write(rss=rows)
        base = rows.get("tiny (2 MB)", {}).get("rss_mb")
        for name, row in rows.items():
            if base is not None:
                print(f"{name}: RSS beyond the tiny file's {row['rss_mb'] - base:+.0f} MB")
        if args.rounds:
            tp = int(args.small_mb * 2**20) // 2
            got = throughput(args, write_folder(work / "throughput", tp, args.tp_vocab, 3))
        else:
            got = {}
    if got:
        ratio = [a / b for a, b in zip(got["mapped"], got["memory"], strict=True)]
        gather = [a / b for a, b in zip(got["gather_mapped"], got["gather_memory"], strict=True)]
        print(
            f"mapped ÷ in memory, time per token: {statistics.median(ratio):.3f} "
            f"{bt.fmt_range(ratio)} (goal ≤ 1.05); the gather alone: "
            f"{statistics.median(gather):.2f} {bt.fmt_range(gather, 2)} "
            f"({1e6 * statistics.median(got['gather_mapped']):.0f} vs "
            f"{1e6 * statistics.median(got['gather_memory']):.0f} µs)"
        )
        results.write(throughput=got, ratio=ratio, gather_ratio=gather)
    print(f"{before} -> {bt.load()}")
    results.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
