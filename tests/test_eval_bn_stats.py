"""`train.eval_bn_stats` (issue 40, item 4): the BatchNorm running statistics the evaluated
model carries — the algorithm's consensus (sync: worker 0's), the mean of every worker's, or
recomputed on one training batch. The training trajectory does not depend on it."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL, build_trainer, compose_config, train, train_on_gloo

from dpresearch.run.build import build_communicator
from dpresearch.run.evaluation import recompute_bn

# sync on 4 workers with a BatchNorm MLP, float64 in this process (one thread)
RUN = [
    *SMALL,
    "workers=4",
    "train.batch_size=8",
    "train.steps=12",
    "model.batch_norm=true",
    "backend.threads=1",
    "optimizer.lr=0.1",
    "train.save_model=false",
]
AVERAGE = ["algorithm.buffers=local", "train.eval_bn_stats=average"]


def trained(*overrides: str):
    """The float64 trainer of RUN + overrides after its run (its final evaluation done)."""
    cfg = compose_config(*RUN, *overrides)
    torch.set_num_threads(1)
    trainer = build_trainer(cfg, build_communicator(cfg), torch.float64)
    trainer.run()
    return trainer


def float_buffers(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([b.flatten() for b in model.buffers() if b.is_floating_point()])


def bn_layer(model: torch.nn.Module) -> torch.nn.BatchNorm1d:
    (bn,) = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    return bn


def test_average_is_the_mean_of_the_workers_buffers_and_changes_nothing_else():
    fair = trained(*AVERAGE)
    rows = fair.replicas.buffers
    assert rows.shape[0] == 4 and (rows - rows[0]).abs().max() > 1e-3  # workers' own stats
    # float64: a mean of 4 values reordered differs by ~1e-16, far below 1e-12
    assert (float_buffers(fair.eval_model) - rows.mean(0)).abs().max() < 1e-12
    worker0 = trained()  # the default: sync broadcasts worker 0's buffers, evaluates with them
    assert torch.equal(worker0.replicas.params, fair.replicas.params)  # same trajectory
    gap = (float_buffers(worker0.eval_model) - float_buffers(fair.eval_model)).abs().max()
    assert gap > 1e-3


def test_recompute_matches_a_hand_computation():
    trainer = trained(
        "algorithm.buffers=local", "train.eval_bn_stats=recompute", "train.eval_batch_size=100"
    )
    model = trainer.eval_model
    linear = model.net[1]
    assert isinstance(linear, torch.nn.Linear)
    # the first eval_batch_size training rows, as the test-time transform gives them (a float32
    # cast, then float64 in these runs)
    x = trainer.data.train_inputs[:100].float().double()
    h = x @ linear.weight.T + linear.bias
    bn = bn_layer(model)
    assert (bn.running_mean - h.mean(0)).abs().max() < 1e-12
    assert (bn.running_var - h.var(0, unbiased=True)).abs().max() < 1e-12
    assert bn.momentum == 0.1  # restored after the recomputation
    # the worker statistics would have given other values
    assert (bn.running_mean - trainer.replicas.buffers.mean(0)[: h.shape[1]]).abs().max() > 1e-3


def test_recompute_bn_on_a_tiny_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).double()
    model[1].running_mean.fill_(5.0)
    x = torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 2.0], [4.0, 0.5, -2.0]], dtype=torch.float64)
    out = recompute_bn(model, x)
    h = x @ model[0].weight.T + model[0].bias
    n = x.shape[0]
    mean = h.sum(0) / n
    var = ((h - mean) ** 2).sum(0) / (n - 1)
    assert torch.allclose(model[1].running_mean, mean, rtol=0, atol=1e-14)
    assert torch.allclose(model[1].running_var, var, rtol=0, atol=1e-14)
    assert out is model and not model.training


@pytest.mark.distributed
def test_average_simulated_equals_gloo(tmp_path):
    """2 simulated workers and 2 gloo processes evaluate with the same averaged statistics:
    the saved model (the evaluated one) is the same, and its buffers differ from worker 0's."""
    args = [*RUN, "workers=2", "train.save_model=true", *AVERAGE]
    (real,) = train_on_gloo(2, [(compose_config(*args, "backend=gloo"), tmp_path / "gloo")])
    train(compose_config(*args), tmp_path / "sim")
    want = torch.load(tmp_path / "sim" / "model_final.pt")
    assert real.keys() == want.keys()
    # with 2 workers every mean is of two values, the same in any order: exact
    assert all(torch.equal(real[k], want[k]) for k in want)
    train(compose_config(*RUN, "workers=2", "train.save_model=true"), tmp_path / "worker0")
    worker0 = torch.load(tmp_path / "worker0" / "model_final.pt")
    means = [k for k in want if k.endswith("running_mean")]
    assert means and all(not torch.equal(worker0[k], want[k]) for k in means)
