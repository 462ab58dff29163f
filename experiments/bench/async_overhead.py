"""Benchmark: the asynchronous simulator's overhead (issue 8).

64 simulated workers of logistic regression (`model=logreg` on seeded synthetic inputs of
`--features` features, 10 classes, per-worker batch `--batch`), exponential speeds, 10,000
pushes through the ordinary training loop (`algorithm=async_sgd`, logging every 100 steps, one
evaluation at the end), one push computed at a time (`train.batched_workers=false`; the
simulator against a minimal loop, computing ahead included: `async_vs_minimal.py`). Inside
that run the benchmark times, by wrapping them, the forward passes (model and loss), the
backward passes, the server optimizer's steps and the batch gathers, and reports

    outside = 1 − (forward + backward + optimizer) / run          (the issue's figure, ≤ 10%)
    simulator = 1 − (forward + backward + optimizer + data) / run

the second leaving out the batch gather every training loop pays (for logistic regression on
wide inputs it costs a good fraction of a forward/backward). The same updates also run in a
plain torch loop (one model, `optimizer.zero_grad/step`) for reference. Times are the
process's CPU seconds (`time.thread_time`, one torch thread): a shared machine's other load
inflates them far less than wall-clock time. Each share is the median over rounds of that
round's share (a round's parts belong together); the µs figures are medians of each part.
Usage:

    python experiments/bench/async_overhead.py [--rounds 3] [--updates 10000] [--workers 64]
        [--features 3072] [--batch 64] [--threads 1] [--out async_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dpresearch import CONF_DIR

REPO = Path(__file__).resolve().parents[2]


def compose(args, *extra: str, algorithm: str = "async_sgd"):
    """The benchmark's run (`args`: workers, features, batch, updates) of `algorithm`, with
    `extra` overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import dpresearch.train  # noqa: F401 - registers the schema

    overrides = [
        f"algorithm={algorithm}",
        f"workers={args.workers}",
        "model=logreg",
        f"data.num_features={args.features}",
        f"data.num_train={args.workers * args.batch * 16}",
        "data.num_test=1024",
        f"train.batch_size={args.batch}",
        f"train.steps={args.updates}",
        "train.log_every=100",
        f"train.eval_every={10 * args.updates}",
        "train.progress=false",
        "async.speed=exponential",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


class Stopwatch:
    """Accumulates the CPU time spent inside the functions it wraps."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start

        return timed


def simulated(args) -> dict[str, float]:
    """CPU seconds of `Trainer.run()` (the loop, not the set-up) and of its forward,
    backward, server-optimizer and batch-gather parts."""
    from dpresearch.comm.simulated import SimulatedCommunicator
    from dpresearch.run.build import network_model
    from dpresearch.run.trainer import Trainer

    # one push computed at a time: the breakdown wraps each replica's forward (computing ahead
    # in batched calls is `async_vs_minimal.py`'s side "ahead")
    cfg = compose(args, "train.batched_workers=false")
    comm = SimulatedCommunicator(cfg.workers, network_model(cfg))
    trainer = Trainer(cfg, comm, torch.device("cpu"), None)
    core, data = Stopwatch(), Stopwatch()
    for model in trainer.replicas.models:
        model.forward = core.wrap(model.forward)
    optimizer = trainer.algorithm.server.optimizer
    optimizer.step = core.wrap(optimizer.step)
    trainer.compute.next_batch = data.wrap(trainer.compute.next_batch)
    backward = torch.Tensor.backward
    trainer.compute.data.loss = core.wrap(trainer.compute.data.loss)  # the data set's loss
    torch.Tensor.backward = core.wrap(backward)
    try:
        start = time.thread_time()
        trainer.run()
        run = time.thread_time() - start
    finally:
        torch.Tensor.backward = backward
    return {"run_s": run, "core_s": core.seconds, "data_s": data.seconds}


def plain(args) -> dict[str, float]:
    """CPU seconds of data gathering and of forward + backward + optimizer in a plain loop doing
    the same updates (worker w's batches in turn, as the pushes arrive)."""
    from hydra.utils import instantiate

    from dpresearch.optim import make_optimizer

    cfg = compose(args)
    data = instantiate(cfg.data, device="cpu")
    partitioner = data.make_partitioner(cfg.workers, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, num_classes=data.num_classes, input_shape=data.input_shape)
    optimizer = make_optimizer(cfg.optimizer, model)
    generator = torch.Generator().manual_seed(0)
    indices = partitioner.epoch_indices(0, 0)
    per_epoch = len(indices) // args.batch
    gather = step = 0.0
    for n in range(args.updates):
        t0 = time.thread_time()
        pos = n % per_epoch
        x, y = data.train_batch(indices[pos * args.batch : (pos + 1) * args.batch], generator)
        t1 = time.thread_time()
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        t2 = time.thread_time()
        gather += t1 - t0
        step += t2 - t1
    return {"data_s": gather, "core_s": step}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--features", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("async_overhead.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    rounds: dict[str, list[float]] = {}
    for r in range(args.rounds):
        ours = simulated(args)
        reference = plain(args)
        ours["outside_fraction"] = 1 - ours["core_s"] / ours["run_s"]
        ours["simulator_fraction"] = 1 - (ours["core_s"] + ours["data_s"]) / ours["run_s"]
        for key, value in [*ours.items(), *(("plain_" + k, v) for k, v in reference.items())]:
            rounds.setdefault(key, []).append(value)
        print(
            f"round {r}: run {ours['run_s']:.2f}s, of which forward/backward/optimizer "
            f"{ours['core_s']:.2f}s and data {ours['data_s']:.2f}s "
            f"({ours['outside_fraction']:.1%} outside fwd/bwd/opt, "
            f"{ours['simulator_fraction']:.1%} outside those and data); plain loop: "
            f"forward/backward/optimizer {reference['core_s']:.2f}s, data "
            f"{reference['data_s']:.2f}s",
            flush=True,
        )
    med = {key: statistics.median(values) for key, values in rounds.items()}
    run, core, data = med["run_s"], med["core_s"], med["data_s"]
    us = 1e6 / args.updates
    result = {
        "workers": args.workers,
        "updates": args.updates,
        "features": args.features,
        "batch": args.batch,
        "threads": args.threads,
        **med,
        "core_us_per_push": core * us,
        "data_us_per_push": data * us,
        "other_us_per_push": (run - core - data) * us,
        "plain_us_per_update": (med["plain_core_s"] + med["plain_data_s"]) * us,
        "target_outside_fraction": 0.10,
        "rounds": rounds,
    }
    print()
    print(
        "| CPU µs per push | fwd+bwd+opt | data | rest (simulator, trainer) | outside "
        "fwd/bwd/opt (target ≤ 10%) | outside fwd/bwd/opt and data | plain loop µs/update |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {run * us:.0f} | {core * us:.0f} | {data * us:.0f} | "
        f"{result['other_us_per_push']:.0f} | {result['outside_fraction']:.1%} | "
        f"{result['simulator_fraction']:.1%} | {result['plain_us_per_update']:.0f} |"
    )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
