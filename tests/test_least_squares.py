"""Least squares through the trainer (the asynchronous study's part a): the data set's loss is
½·mean((a·x − b)²), every worker samples all rows, and one SGD step from x₀ = 0 moves x by
exactly η·A_Bᵀb_B/B — the closed form, computed here independently of the trainer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import compose_config

from dpresearch.data.least_squares import make_least_squares
from dpresearch.data.partition import SharedPartitioner
from dpresearch.train import train

SMALL_LS = [
    "data=least_squares",
    "data.num_train=600",
    "data.dim=20",
    "model=linear",
    "train.batch_size=50",
    "train.progress=false",
]


def test_problem_matches_its_definition():
    data = make_least_squares(num_train=300, dim=10, noise=0.01, seed=3)
    rng = np.random.default_rng(3)
    a = rng.uniform(size=(300, 10)) / np.sqrt(10)
    b = a @ rng.normal(size=10) + 0.01 * rng.normal(size=300)
    assert torch.allclose(data.train_inputs, torch.from_numpy(a).float())
    assert torch.equal(data.test_targets, data.train_targets)  # f on all rows is the test loss
    # the loss against its formula in float64 (issue 33: a float32 mean of 300 terms is off by
    # up to 300·u in a CPU-dependent summation order; in float64 1e-12 is far above it)
    x = torch.randn(10, 1, dtype=torch.float64)
    out, targets = data.train_inputs.double() @ x, data.train_targets.double()
    expected = 0.5 * ((out.squeeze(1) - targets) ** 2).mean()
    assert data.loss(out, targets) == pytest.approx(float(expected), rel=1e-12)
    x_opt = np.linalg.lstsq(a, b, rcond=None)[0]
    assert data.optimum == pytest.approx(0.5 * np.mean((a @ x_opt - b) ** 2), rel=1e-9)
    assert not data.classification


def test_shared_partition_gives_every_worker_all_rows():
    part = SharedPartitioner(100, 4, seed=1)
    orders = [part.epoch_indices(w, 0) for w in range(4)]
    assert all(sorted(o.tolist()) == list(range(100)) for o in orders)
    assert not torch.equal(orders[0], orders[1])  # each worker its own order
    assert torch.equal(part.epoch_indices(2, 5), SharedPartitioner(100, 4, 1).epoch_indices(2, 5))
    assert part.samples_per_worker == 100


def test_one_sgd_step_is_the_closed_form(tmp_path):
    lr = 0.3
    summary = train(
        compose_config(
            *SMALL_LS,
            "workers=1",
            "train.steps=1",
            "train.log_every=1",
            f"optimizer.lr={lr}",
            "train.save_model=false",
        ),
        tmp_path / "run",
    )
    data = make_least_squares(num_train=600, dim=20, seed_draws=5)  # as data=least_squares
    rows = SharedPartitioner(600, 1, seed=0).epoch_indices(0, 0)[:50]
    a, b = data.train_inputs[rows].double(), data.train_targets[rows].double()
    x1 = lr * a.T @ b / 50  # x₀ = 0: gradient Aᵀ(A·0 − b)/B
    full_a, full_b = data.train_inputs.double(), data.train_targets.double()
    f1 = 0.5 * ((full_a @ x1 - full_b) ** 2).mean()
    assert summary["test/loss"] == pytest.approx(float(f1), rel=1e-5)
    assert summary["val/loss"] == summary["test/loss"]  # both are f on all rows
    assert summary["train/loss"] == pytest.approx(float(0.5 * (b**2).mean()), rel=1e-5)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert not any(k.endswith("/acc") for row in logged for k in row)  # no accuracy for a loss
    assert "best/test_acc" not in summary and summary["data/classes"] == 1
