"""K simulated workers vs a torch.func vmap ensemble written here (issue 16, CPU row).

Our side: the ordinary training loop (`Trainer`) with K simulated workers in this process,
each on its own batch and its own model — `algorithm=local_sgd` with a period longer than the
run, so the K models train independently, as an ensemble does — plain SGD, at the default
settings (`train.batched_workers=auto`; `--modes` adds `false`/`true` for comparison). Its step
is the trainer's step region (`time/compute_s + time/comm_s`: batch, forward, backward,
optimizer), read from metrics.jsonl logged every `--block` steps.

The reference: an independent ensemble of K models as stacked parameters `[K, *shape]`,
`vmap(grad(loss))` over the K batches gathered from the same data set and the same
per-worker index sequences, and one SGD update of the stacked parameters — timed around the
same work. `--floor` adds the same ensemble delivering its gradients into one flat `[K, D]`
buffer (a `torch._foreach_copy_` of vmap's outputs into its rows, the SGD update read from
there): what any implementation pays whose gradients must sit where a collective or a codec
reads them — vmap's outputs are fresh tensors that no kernel can be told to write into a given
buffer, and `Replicas` keeps every worker's gradient in a row of `replicas.grads`, as DDP
keeps them in its buckets. Ours ÷ floor is then our own overhead beyond that copy.

Both sides are timed with one clock (`--clock`): `cpu` (default) is this thread's CPU time
(`time.thread_time`, put in place of the trainer's `perf_counter` for the run), which other
jobs on a shared machine inflate far less than wall time; `wall` is what a user waits.
Rounds alternate which side runs first; the figure is the median over rounds of the per-round
ratio ours/ensemble with its range (target ≤ 1.05), one thread (`--threads`), the load printed.

    python experiments/bench/batched_vs_ensemble.py [--models mlp logreg] [--workers 16 64]
        [--rounds 5] [--block 10] [--warmup 5] [--modes auto] [--clock cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_timing as bt  # noqa: E402
from bench_cases import compose as compose_run  # noqa: E402

MODELS = {
    # name: (overrides, per-worker batch)
    "mlp": ["model=mlp", "model.hidden=[256,256]", "data.num_features=256"],
    "logreg": ["model=logreg", "data.num_features=3072"],
}
BATCH = {"mlp": 32, "logreg": 64}
LR = 0.05


def compose(model: str, workers: int, steps: int, block: int, mode: str, batch: int):
    return compose_run(
        *MODELS[model],
        f"workers={workers}",
        f"data.num_train={workers * batch * 8}",
        "data.num_test=256",
        f"train.batch_size={batch}",
        f"train.steps={steps}",
        f"train.log_every={block}",
        f"train.eval_every={10 * steps}",
        "train.progress=false",
        "train.save_model=false",
        f"train.batched_workers={mode}",
        f"optimizer.lr={LR}",
        "algorithm=local_sgd",
        f"algorithm.period={steps + 1}",
    )


def ours(model: str, workers: int, mode: str, args) -> tuple[list[float], str]:
    """Median-free block times of our trainer (after warm-up) and the mode it took."""
    from dpresearch.comm.simulated import SimulatedCommunicator
    from dpresearch.run.build import network_model
    from dpresearch.run.trainer import Trainer

    steps = bt.logged_steps(args.warmup, args.block, args.blocks)
    cfg = compose(model, workers, steps, args.block, mode, BATCH[model])
    with tempfile.TemporaryDirectory(prefix="bench-ens-") as tmp:
        comm = SimulatedCommunicator(cfg.workers, network_model(cfg))
        trainer = Trainer(cfg, comm, torch.device("cpu"), Path(tmp))
        with bt.loop_clock(bt.CLOCKS[args.clock]):
            trainer.run()
        times = bt.logged_block_times(Path(tmp) / "metrics.jsonl", args.block, args.warmup)
    return times, trainer.compute.mode


def ensemble(model: str, workers: int, args, buffer: bool = False) -> list[float]:
    """Block times of the vmap ensemble doing the same steps (after warm-up); `buffer`: its
    gradients copied into the rows of one flat `[K, D]` buffer and the update read from there."""
    from hydra.utils import instantiate
    from torch.func import functional_call, grad, stack_module_state, vmap

    batch = BATCH[model]
    cfg = compose(model, workers, 1, args.block, "false", batch)
    data = instantiate(cfg.data, device="cpu")
    partitioner = data.make_partitioner(workers, cfg.seed)
    torch.manual_seed(cfg.seed)
    nets = [
        instantiate(cfg.model, num_classes=data.num_classes, input_shape=data.input_shape)
        for _ in range(workers)
    ]
    params, buffers = stack_module_state(nets)
    params = {k: v.detach() for k, v in params.items()}
    template = nets[0]

    def loss_of(p, b, x, y):
        return F.cross_entropy(functional_call(template, (p, b), (x,)), y)

    grads_of = vmap(grad(loss_of))
    names = list(params)
    flat = torch.zeros(workers, sum(params[n][0].numel() for n in names))
    rows, start = {}, 0
    for n in names:
        size = params[n][0].numel()
        rows[n] = flat[:, start : start + size].view_as(params[n])
        start += size
    per_epoch = partitioner.samples_per_worker // batch
    orders = [partitioner.epoch_indices(w, 0)[: per_epoch * batch] for w in range(workers)]
    cuts = [o.split(batch) for o in orders]
    times = []
    clock = bt.CLOCKS[args.clock]
    for i in range(args.warmup + args.block * args.blocks):
        start = clock()
        pos = i % per_epoch
        index = torch.cat([cuts[w][pos] for w in range(workers)])
        x = data.train_inputs.index_select(0, index).view(workers, batch, -1)
        y = data.train_targets.index_select(0, index).view(workers, batch)
        grads = grads_of(params, buffers, x, y)
        if buffer:
            torch._foreach_copy_([rows[n] for n in names], [grads[n] for n in names])
            grads = rows
        with torch.no_grad():
            for name, p in params.items():
                p.sub_(grads[name], alpha=LR)
        if i >= args.warmup:
            times.append(clock() - start)
    return [statistics.fmean(times[j : j + args.block]) for j in range(0, len(times), args.block)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "logreg"], choices=list(MODELS))
    parser.add_argument("--workers", nargs="+", type=int, default=[16, 64])
    parser.add_argument(
        "--modes", nargs="+", default=["auto"], choices=["auto", "true", "false", "stacked", "vmap"]
    )
    parser.add_argument(
        "--floor", action="store_true", help="also the ensemble with its gradients in a buffer"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=list(bt.CLOCKS), default="cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = bt.Results(
        args.json or bt.default_json("batched_vs_ensemble"),
        "batched_vs_ensemble",
        vars(args) | {"json": None},
    )
    print(f"{bt.load()}; {args.threads} thread(s); {args.clock} time", flush=True)
    rows = []
    for model in args.models:
        for k in args.workers:
            columns = [*args.modes, *(["floor"] if args.floor else [])]
            ratios: dict[str, list[float]] = {m: [] for m in columns}
            over_floor: dict[str, list[float]] = {m: [] for m in args.modes}
            took: dict[str, str] = {"floor": "ensemble + flat gradient buffer"}
            sides = ["ours", "ensemble", *(["floor"] if args.floor else [])]
            for r in range(args.rounds):
                order = sides if r % 2 == 0 else sides[::-1]
                step: dict[str, float] = {}
                for side in order:
                    if side in ("ensemble", "floor"):
                        times = ensemble(model, k, args, buffer=side == "floor")
                        step[side] = statistics.median(times)
                        continue
                    for mode in args.modes:
                        times, took[mode] = ours(model, k, mode, args)
                        step[mode] = statistics.median(times)
                for column in columns:
                    ratios[column].append(step[column] / step["ensemble"])
                    if args.floor and column != "floor":
                        over_floor[column].append(step[column] / step["floor"])
                results.add(model=model, workers=k, round=r, step_s=step, load=bt.load())
                print(
                    f"{model} K={k} round {r}: "
                    + ", ".join(f"{m} {1e3 * s:.2f} ms" for m, s in step.items())
                    + f" ({bt.load()})",
                    flush=True,
                )
            for column in columns:
                rows.append(
                    (model, k, column, took[column], ratios[column], over_floor.get(column, []))
                )
    print()
    print("| model | K | side | took | ÷ ensemble (median [range]) | ÷ floor | target |")
    print("|---|---|---|---|---|---|---|")
    for model, k, mode, took_mode, values, floor in rows:
        beyond = f"{statistics.median(floor):.3f} {bt.fmt_range(floor)}" if floor else "–"
        print(
            f"| {model} | {k} | {mode} | {took_mode.split(' (')[0]} | "
            f"{statistics.median(values):.3f} {bt.fmt_range(values)} | {beyond} | "
            "≤ 1.05 |"
        )
    results.write(
        summary=[
            {"model": m, "workers": k, "mode": mode, "ratios": v, "over_floor": f}
            for m, k, mode, _, v, f in rows
        ],
        end_load=bt.load(),
    )
    print(f"wrote {results.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
