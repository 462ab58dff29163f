"""Reference trainers written directly against torch, independent of dpresearch's loop:
torch DDP with DistributedSampler, and single-process SGD on the concatenated global batch."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from dpresearch.data.synthetic import make_synthetic
from dpresearch.launch.processes import leave_together
from dpresearch.models.mlp import MLP

# Must match conftest.SMALL and the overrides the tests pass.
DATA = dict(num_train=1024, num_test=256, num_features=16, num_classes=10, noise=1.0, seed=0)
SEED, LR, STEPS, BATCH = 0, 0.1, 20, 16


def _model(batch_norm: bool) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return MLP(10, (16,), hidden=[32], batch_norm=batch_norm)


def _shard_batches(world: int, rank: int, n: int):
    """DistributedSampler(shuffle, seed, drop_last) batches of BATCH, epoch after epoch."""
    sampler = DistributedSampler(
        range(n), num_replicas=world, rank=rank, shuffle=True, seed=SEED, drop_last=True
    )
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        idx = torch.tensor(list(sampler))
        for b in range(len(idx) // BATCH):
            yield idx[b * BATCH : (b + 1) * BATCH]
        epoch += 1


def ddp_worker(
    rank: int, world: int, port: int, out_path: str, batch_norm: bool, hook: dict | None = None
) -> None:
    """One rank of a torch DDP run; rank 0 saves the final state dict to `out_path`.

    hook: {"compressor": node, "error_feedback": node} registers dpresearch's compressed comm
    hook (the compressor seeded like our run: SEED; rank r draws worker r's streams)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    data = make_synthetic(**DATA)
    model = _model(batch_norm)
    ddp = DistributedDataParallel(model)
    if hook is not None:
        from dpresearch.compress import build_compressor, make_comm_hook

        state, fn = make_comm_hook(
            build_compressor(hook["compressor"], SEED), ddp, error_feedback=hook["error_feedback"]
        )
        ddp.register_comm_hook(state, fn)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    batches = _shard_batches(world, rank, DATA["num_train"])
    for _ in range(STEPS):
        x, y = data.train_batch(next(batches))
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    if rank == 0:
        torch.save(model.state_dict(), out_path)
    # The reducer's reference to the group goes first, while the group is alive, so that the
    # group's destructor runs inside `leave_together` with gloo's threads idle (see there).
    del ddp, opt
    if hook is not None:
        del state, fn
    gc.collect()
    leave_together()


def run_ddp(
    world: int, out_path: str, port: int, batch_norm: bool = False, hook: dict | None = None
) -> dict:
    from gloo_session import spawn_sequence

    spawn_sequence(world, [(ddp_worker, (world, port, out_path, batch_norm, hook))])
    return torch.load(out_path)


def run_single_process(world: int) -> dict:
    """Plain SGD on the concatenation of the `world` workers' shards of each global batch."""
    data = make_synthetic(**DATA)
    model = _model(batch_norm=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    streams = [_shard_batches(world, r, DATA["num_train"]) for r in range(world)]
    for _ in range(STEPS):
        x, y = data.train_batch(torch.cat([next(s) for s in streams]))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def run_ddp_many(world: int, variants: dict[str, dict], folder: str) -> dict[str, dict]:
    """Several DDP runs (`variants`: name -> ddp_worker's keyword arguments `batch_norm`,
    `hook`) on the same `world` processes, started once (`gloo_session`); name -> final
    state dict."""
    from gloo_session import free_ports, spawn_sequence

    ports = free_ports(len(variants))
    paths = {name: os.path.join(folder, f"ddp-{name}.pt") for name in variants}
    spawn_sequence(
        world,
        [
            (ddp_worker, (world, port, paths[name], v.get("batch_norm", False), v.get("hook")))
            for (name, v), port in zip(variants.items(), ports, strict=True)
        ],
    )
    return {name: torch.load(path) for name, path in paths.items()}
