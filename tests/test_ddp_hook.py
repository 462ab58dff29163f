"""The DDP communication hook: torch DDP + hook on 2 gloo ranks reproduces the reducer on 2
simulated workers (same compressor, same error feedback, same seeds)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import TOL64, free_port, spawn_sequence
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.compress import (
    QSGD,
    CompressedReducer,
    ErrorFeedback,
    MajorityVote,
    PowerSGD,
    RandomK,
    TopK,
    make_comm_hook,
    param_layout,
)
from dpresearch.launch.processes import leave_together
from dpresearch.replicas import Replicas

NET = NetworkModel.preset("10gbe")
WORLD, STEPS, LR, SEED = 2, 5, 0.1, 3
# DDP (per-tensor SGD, its buckets) and the reducer on flat rows are different computations of
# the same training (issue 33, class b): in float32 their rounding differs by CPU, so both run
# in float64 and agree to 1e-9 (`helpers.TOL64`). QSGD asks torch for float32 norms of its
# buckets (dpresearch/compress/qsgd.py: vector_norm with dtype=float32), which torch refuses
# for float64 rows: its case stays in float32 at 1e-6, a CPU-dependent budget, until then.
FLOAT32_ONLY = {"qsgd_ef14": 1e-6}


def dtype_of(name: str) -> torch.dtype:
    return torch.float32 if name in FLOAT32_ONLY else torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


# name: (compressor factory, error-feedback kwargs or None)
CASES = {
    "topk_ef14": (lambda: TopK(ratio=0.1, seed=SEED), {"mode": "ef14"}),
    "qsgd_ef14": (lambda: QSGD(levels=3, bucket_size=32, seed=SEED), {"mode": "ef14"}),
    "powersgd_ef14": (
        lambda: PowerSGD(rank=1, min_compression_rate=1.0, seed=SEED),
        {"mode": "ef14"},
    ),
    "randomk": (lambda: RandomK(ratio=0.2, seed=SEED), None),
    "signum": (lambda: MajorityVote(seed=SEED), {"mode": "none", "momentum": 0.5}),
}


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)


def batch(worker: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(100 * step + worker)
    return torch.randn(16, 8, generator=gen, dtype=dtype), torch.randint(0, 4, (16,), generator=gen)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: every case with a fresh DDP model and the compressed hook."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for name, (factory, ef) in CASES.items():
            ddp = DistributedDataParallel(make_model(dtype_of(name)))
            state, hook = make_comm_hook(factory(), ddp, error_feedback=ef)
            ddp.register_comm_hook(state, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=LR)
            for step in range(STEPS):
                x, y = batch(rank, step, dtype_of(name))
                opt.zero_grad()
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
            results[name] = (flat_params(ddp.module), state.comm.ledger.bytes_sent, state.step)
            del ddp, state, hook, opt  # the reducer goes while the group is alive
            gc.collect()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        leave_together()


def simulated(name: str) -> tuple[torch.Tensor, int]:
    """The same training on 2 simulated workers with `CompressedReducer` (per-tensor chunks)."""
    factory, ef = CASES[name]
    model = make_model(dtype_of(name))
    replicas = Replicas(model, WORLD, torch.device("cpu"))
    comm = SimulatedCommunicator(WORLD, NET)
    memory = None if ef is None else ErrorFeedback(**ef)
    reducer = CompressedReducer(
        factory(), comm, param_layout(model), memory, granularity="tensor", dtype=dtype_of(name)
    )
    for step in range(STEPS):
        replicas.zero_grad()
        for w, replica in enumerate(replicas.models):
            x, y = batch(w, step, dtype_of(name))
            F.cross_entropy(replica(x), y).backward()
        reducer.reduce(replicas.grads, step)
        with torch.no_grad():
            replicas.params.sub_(LR * replicas.grads)
    return replicas.params[0].clone(), comm.ledger.bytes_sent


def test_hook_rejects_model_granularity():
    with pytest.raises(ValueError, match="one bucket at a time"):
        make_comm_hook(TopK(), nn.Linear(2, 2), granularity="model")


@pytest.mark.distributed
def test_ddp_hook_matches_simulated_reducer(tmp_path):
    spawn_sequence(WORLD, [(ddp_worker, (WORLD, free_port(), str(tmp_path)))])
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for name in CASES:
        start = flat_params(make_model(dtype_of(name)))
        params, nbytes = simulated(name)
        assert not torch.equal(params, start), name  # training moved the parameters
        for rank in ranks:
            ddp_params, ddp_bytes, steps = rank[name]
            assert steps == STEPS
            assert ddp_bytes == nbytes, name
            assert ddp_params.dtype == dtype_of(name)
            assert (ddp_params - params).abs().max() <= FLOAT32_ONLY.get(name, TOL64), name
