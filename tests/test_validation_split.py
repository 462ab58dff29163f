"""The validation split: held out of the training set, the same in every seed, never trained
on, evaluated beside the test set (what a study selects its learning rate on)."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL, compose_config

from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.config.preflight import preflight
from dpresearch.config.validate import ConfigError
from dpresearch.data.synthetic import make_synthetic
from dpresearch.run.trainer import Trainer


def data():
    return make_synthetic(num_train=1000, num_test=100, num_features=8, num_classes=4, seed=3)


def rows(x: torch.Tensor) -> set[tuple[float, ...]]:
    return {tuple(r.tolist()) for r in x}


@pytest.mark.parametrize("size, count", [(0.1, 100), (37, 37), (0.5, 500)])
def test_hold_out_moves_a_disjoint_fixed_draw_out_of_training(size, count):
    whole = data()
    split = whole.hold_out(size)
    assert split.val_targets.numel() == count and split.num_train == 1000 - count
    assert whole.val_targets is None and whole.num_train == 1000  # the original stays whole
    assert not rows(split.val_inputs) & rows(split.train_inputs)
    assert rows(split.val_inputs) | rows(split.train_inputs) == rows(whole.train_inputs)
    again = data().hold_out(size)
    assert torch.equal(again.val_inputs, split.val_inputs)  # the same examples every time
    # not simply the last or first examples of the file
    assert not torch.equal(split.val_targets, whole.train_targets[-count:])
    assert not torch.equal(split.val_targets, whole.train_targets[:count])


def test_no_split_when_size_is_zero():
    whole = data()
    assert whole.hold_out(0) is whole and whole.val_inputs is None


@pytest.mark.parametrize("size", [-1, 1000, 1.5, 0.9999])
def test_impossible_sizes_are_one_config_error(size):
    cfg = compose_config(*SMALL, f"train.val_size={size}")
    with pytest.raises(ConfigError, match=r"train\.val_size|batch_size"):
        preflight(cfg)


def test_trainer_logs_validation_metrics_and_trains_on_the_rest():
    cfg = compose_config(*SMALL, "train.val_size=0.25", "train.steps=4", "seed=5", "data.seed=1")
    trainer = Trainer(
        cfg,
        SimulatedCommunicator(cfg.workers, NetworkModel.preset("10gbe")),
        torch.device("cpu"),
        None,
    )
    assert trainer.data.num_train == 768 and trainer.data.val_targets.numel() == 256
    assert trainer.partitioner.samples_per_worker * cfg.workers <= 768
    summary = trainer.run()
    assert 0.0 <= summary["val/acc"] <= 1.0 and summary["val/loss"] > 0
    assert "test/acc" in summary
    # the held-out examples are the same whatever the run's seed
    other = compose_config(*SMALL, "train.val_size=0.25", "train.steps=1", "seed=9", "data.seed=1")
    t2 = Trainer(
        other,
        SimulatedCommunicator(other.workers, NetworkModel.preset("10gbe")),
        torch.device("cpu"),
        None,
    )
    assert torch.equal(t2.data.val_inputs, trainer.data.val_inputs)
