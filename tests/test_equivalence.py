"""The framework's central correctness tests (issue 2, acceptance A and B).

The same seed must give the same parameters whether K workers are simulated in one process,
run as K gloo processes, or trained by torch DDP; and, without BatchNorm, the same as
single-process SGD on the global batch.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    STEPS,
    TOL,
    TOL64,
    free_port,
    max_diff,
    run_ddp,
    run_ddp_many,
    run_ours,
    run_ours64,
    run_single_process,
)

from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.run.trainer import Trainer

# Simulated workers, torch DDP and single-process SGD are different computations of the same
# SGD (a sum of K gradients in worker order, DDP's bucketed allreduce, one gradient of the
# concatenated batch): in float32 they differ by rounding that depends on the CPU's kernels
# (issue 33), so they are compared in float64 (`helpers.run_ours64`, the references' `dtype`),
# to 1e-9. Only the gloo side runs the CLI, which has no float64 switch: see there.
F64 = torch.float64


@pytest.fixture(scope="module")
def ddp_two_ranks(tmp_path_factory) -> dict[str, dict]:
    """The 2-rank torch DDP references of this module, run on the same two processes."""
    folder = tmp_path_factory.mktemp("ddp")
    variants = {"plain": {"dtype": F64}, "batch_norm": {"batch_norm": True, "dtype": F64}}
    return run_ddp_many(2, variants, str(folder))


@pytest.mark.distributed
@pytest.mark.parametrize("k", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sync_simulated_gloo_ddp_and_single_process_agree(small_config, tmp_path, k, request):
    """k = 4 is slow (8 more processes); the default suite holds k = 4 through
    `test_sync_with_four_workers_equals_single_process_sgd` and the identity case of
    `test_every_compressor_simulated_equals_gloo_in_one_process_group` (4 gloo ranks)."""
    simulated = run_ours(small_config, tmp_path, "sim", f"workers={k}")
    gloo = run_ours(small_config, tmp_path, "gloo", f"workers={k}", "backend=gloo")
    initial = run_ours(small_config, tmp_path, "init", f"workers={k}", "train.steps=1")
    assert max_diff(simulated, initial) > 1e-3  # the runs really trained
    # float32, the CLI on both sides: the same computation, the gradients' mean by gloo's
    # allreduce against the simulated sum in worker order. For k = 2 a sum of two is the same
    # in any order (class a: the same computation, TOL a margin only); for k = 4 the ring adds
    # in its own order (class b), so TOL is a float32 rounding budget there, CPU-dependent
    # until the CLI has a float64 switch.
    assert max_diff(simulated, gloo) <= TOL
    simulated, _ = run_ours64(small_config, f"workers={k}")
    if k == 2:
        ddp = request.getfixturevalue("ddp_two_ranks")["plain"]
    else:
        ddp = run_ddp(k, str(tmp_path / "ddp.pt"), free_port(), dtype=F64)
    single = run_single_process(k, F64)
    assert all(v.dtype == F64 for v in ddp.values() if v.is_floating_point())
    assert max_diff(simulated, ddp) <= TOL64
    assert max_diff(simulated, single) <= TOL64


def test_sync_with_four_workers_equals_single_process_sgd(small_config, tmp_path):
    """Four simulated workers (each its DistributedSampler shard) = plain SGD on the global
    batch (no processes started). Float64 (F64)."""
    simulated, _ = run_ours64(small_config, "workers=4")
    initial, _ = run_ours64(small_config, "workers=4", "train.steps=1")
    assert max_diff(simulated, initial) > 1e-3
    assert max_diff(simulated, run_single_process(4, F64)) <= TOL64


@pytest.mark.distributed
def test_sync_with_batchnorm_matches_ddp_buffer_broadcast(small_config, tmp_path, ddp_two_ranks):
    """BatchNorm buffers follow DDP's default: worker 0's statistics are broadcast. Float64
    (F64)."""
    ours, _ = run_ours64(small_config, "workers=2", "model.batch_norm=true")
    ddp = ddp_two_ranks["batch_norm"]
    assert any("running_mean" in key for key in ours)
    assert max_diff(ours, ddp) <= TOL64


def test_local_sgd_period_one_equals_sync(small_config):
    """Averaging the models after each step against averaging the gradients: different
    computations of the same update, so float64 (F64)."""
    sync, _ = run_ours64(small_config, "workers=4")
    local, _ = run_ours64(small_config, "workers=4", "algorithm=local_sgd", "algorithm.period=1")
    assert max_diff(sync, local) <= TOL64


def test_local_sgd_huge_period_keeps_replicas_apart(small_config):
    cfg = small_config(
        "workers=4", "algorithm=local_sgd", "algorithm.period=1000000", f"train.steps={STEPS}"
    )
    trainer = Trainer(
        cfg, SimulatedCommunicator(4, NetworkModel.preset("10gbe")), torch.device("cpu"), None
    )
    trainer.run()
    params = trainer.replicas.params
    for i in range(1, 4):
        assert (params[0] - params[i]).abs().max() > 1e-3
    assert trainer.comm.ledger.bytes_sent == 0  # independent workers send nothing


def test_local_sgd_averages_every_period(small_config):
    cfg = small_config("workers=4", "algorithm=local_sgd", "algorithm.period=5", "train.steps=10")
    trainer = Trainer(
        cfg, SimulatedCommunicator(4, NetworkModel.preset("10gbe")), torch.device("cpu"), None
    )
    trainer.run()
    params = trainer.replicas.params
    assert torch.equal(params[0], params[3])  # step 10 ended with an average
    assert trainer.comm.ledger.op_counts["allreduce"] == 2
    assert trainer.comm.ledger.bytes_sent == 2 * params.shape[1] * 4


def test_post_local_sgd_averages_every_step_until_the_switch(small_config):
    """Post-local SGD (Lin et al. 2020): every step for `sync_epochs`, then every `period`
    steps counted from the switch; before the switch it is period-1 local SGD."""
    cfg = small_config(
        "workers=4",
        "algorithm=local_sgd",
        "algorithm.period=4",
        "algorithm.sync_epochs=0.25",
        "train.steps=14",
    )
    trainer = Trainer(
        cfg, SimulatedCommunicator(4, NetworkModel.preset("10gbe")), torch.device("cpu"), None
    )
    switch = round(0.25 * trainer.steps_per_epoch)
    assert trainer.algorithm.sync_steps == switch == 2  # 1024 examples / (4 × 32) = 8 steps
    averaged = [s for s in range(14) if trainer.algorithm.averages_after(s)]
    assert averaged == [0, 1, 5, 9, 13]
    trainer.run()
    assert trainer.comm.ledger.op_counts["allreduce"] == len(averaged)
    assert torch.equal(trainer.replicas.params[0], trainer.replicas.params[3])


@pytest.mark.slow  # local SGD on gloo in the default suite: test_outer's DiLoCo bases
@pytest.mark.distributed
def test_local_sgd_simulated_equals_gloo_with_odd_workers(small_config, tmp_path):
    args = (
        "workers=3",
        "algorithm=local_sgd",
        "algorithm.period=4",
        "algorithm.average_optimizer_state=true",
        "optimizer.momentum=0.9",
    )
    simulated = run_ours(small_config, tmp_path, "sim", *args)
    gloo = run_ours(small_config, tmp_path, "gloo", *args, "backend=gloo")
    # float32 (the CLI has no float64 switch): gloo's ring of 3 adds in its own order (class
    # b of issue 33), so TOL is a float32 rounding budget here, CPU-dependent
    assert max_diff(simulated, gloo) <= TOL


def test_same_seed_same_metrics_bit_for_bit(small_config, tmp_path):
    import json

    def metrics(name: str) -> list[dict]:
        run_ours(
            small_config,
            tmp_path,
            name,
            "workers=3",
            "model.batch_norm=true",
            "optimizer.momentum=0.9",
        )
        rows = [
            json.loads(ln) for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]

    first, second = metrics("a"), metrics("b")
    assert first == second and len(first) >= 4
    assert (
        max_diff(
            torch.load(tmp_path / "a" / "model_final.pt"),
            torch.load(tmp_path / "b" / "model_final.pt"),
        )
        == 0.0
    )
