"""Trainer options: memory format, mixed precision, lr scaling, weight-decay groups, non-IID."""

from __future__ import annotations

import pytest
import torch
from helpers import SHARED, compose_config, run_cli

from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.config.validate import ConfigError, validate
from dpresearch.optim import make_optimizer
from dpresearch.run.trainer import Trainer
from dpresearch.train import train

SUBSET = SHARED / "data" / "cifar10-subset"
needs_subset = pytest.mark.skipif(not SUBSET.is_dir(), reason=f"no CIFAR subset at {SUBSET}")
RESNET = [
    "data=cifar10",
    f"data.root={SUBSET}",
    "model=resnet20",
    "train.steps=3",
    "train.progress=false",
    "workers=2",
    "train.batch_size=8",
    "data.subset=256",
]


def trainer_for(*overrides: str, test_images: int | None = None) -> Trainer:
    """A simulated trainer for `overrides`; `test_images`: evaluate on that many test images
    only (a ResNet's evaluation of the whole test set costs more than the steps tested)."""
    cfg = compose_config(*overrides)
    comm = SimulatedCommunicator(cfg.workers, NetworkModel.preset("10gbe"))
    trainer = Trainer(cfg, comm, torch.device("cpu"), None)
    if test_images is not None:
        data = trainer.data
        data.test_inputs = data.test_inputs[:test_images]
        data.test_targets = data.test_targets[:test_images]
    return trainer


@needs_subset
def test_channels_last_weights_are_flat_row_views_with_the_same_gradients():
    """NHWC weights live inside the flat row; one backward gives the NCHW gradients (to float
    noise of the different convolution kernels: training then amplifies it like any noise)."""
    import torch.nn.functional as F

    plain = trainer_for(*RESNET, test_images=64)
    nhwc = trainer_for(*RESNET, "train.channels_last=true", test_images=64)
    conv = next(p for p in nhwc.replicas.models[0].parameters() if p.dim() == 4)
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    row = nhwc.replicas.params[0]
    assert row.data_ptr() <= conv.data_ptr() < row.data_ptr() + row.numel() * row.element_size()
    x, y = plain.data.train_batch(torch.arange(8), torch.Generator().manual_seed(0))
    for trainer, inputs in ((plain, x), (nhwc, x.contiguous(memory_format=torch.channels_last))):
        trainer.replicas.zero_grad()
        F.cross_entropy(trainer.replicas.models[0](inputs), y).backward()
    pairs = zip(
        plain.replicas.models[0].parameters(), nhwc.replicas.models[0].parameters(), strict=True
    )
    for a, b in pairs:
        assert (a.grad - b.grad).abs().max() <= 1e-4 * a.grad.abs().max() + 1e-8
    summary = nhwc.run()
    params, buffers = nhwc.algorithm.consensus()
    loaded = nhwc.replicas.load_into(plain.eval_model, params, buffers)
    assert torch.equal(loaded.state_dict()["fc.weight"], nhwc.eval_model.state_dict()["fc.weight"])
    assert torch.isfinite(torch.tensor(summary["train/loss"]))


@needs_subset
def test_bf16_autocast_runs_and_fp16_needs_a_gpu():
    summary = trainer_for(*RESNET, "train.autocast=bf16", test_images=64).run()
    assert torch.isfinite(torch.tensor(summary["train/loss"]))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="bf16"):
            validate(compose_config("train.autocast=fp16"))


def test_linear_lr_scaling_multiplies_by_workers():
    t = trainer_for("workers=4", "train.lr_scaling=linear", "optimizer.lr=0.05", "train.steps=1")
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.2)


def test_weight_decay_excluded_from_bn_and_bias():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    cfg = compose_config(
        "optimizer.weight_decay=1e-4", "optimizer.exclude_bn_bias_from_weight_decay=true"
    ).optimizer
    opt = make_optimizer(cfg, model)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 1e-4 and len(decay["params"]) == 1
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3


def test_dirichlet_partition_runs_through_the_trainer():
    t = trainer_for(
        "data.partition=dirichlet", "data.alpha=0.1", "train.steps=4", "train.progress=false"
    )
    t.run()
    counts = [
        torch.bincount(t.data.train_targets[t.partitioner.epoch_indices(w, 0)], minlength=10)
        for w in range(4)
    ]
    # Strong label skew: some worker holds (almost) none of some class.
    assert min(int(c.min()) for c in counts) <= 2


def test_missing_dataset_is_one_line_before_workers_start(tmp_path):
    out = run_cli(
        ["data=cifar10", f"data.root={tmp_path / 'nowhere'}", "backend=gloo"],
        cwd=tmp_path,
        timeout=60,
    )
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    assert "data.download=true" in lines[0]


def test_train_returns_summary_with_bytes_per_epoch(tmp_path):
    cfg = compose_config("train.epochs=1", "train.progress=false")
    summary = train(cfg, tmp_path)
    assert summary["comm/bytes_per_epoch"] == summary["num_params"] * 4 * summary["steps_per_epoch"]
