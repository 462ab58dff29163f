"""`optim.step_together`: K workers' SGD steps as one multi-tensor call give exactly (bit for
bit) what each optimizer's own `step()` gives — parameters and momentum buffers, from the first
step (buffers created) on, with weight decay, Nesterov, dampening and two parameter groups —
and anything else falls back to one step per optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from dpresearch.models.mlp import MLP
from dpresearch.optim import _same_plain_sgd, make_optimizer, step_together
from dpresearch.replicas import Replicas

SETTINGS = {
    "plain": {"momentum": 0.0},
    "nesterov_wd": {"momentum": 0.9, "nesterov": True, "weight_decay": 5e-4},
    "dampening": {"momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-4},
    "two_groups": {
        "momentum": 0.9,
        "weight_decay": 5e-4,
        "exclude_bn_bias_from_weight_decay": True,
    },
}


def replicas_and_optimizers(node: dict, k: int = 4):
    torch.manual_seed(0)
    reps = Replicas(MLP(5, (6,), hidden=[7], batch_norm=True), k, torch.device("cpu"))
    cfg = OmegaConf.create(node)
    return reps, [make_optimizer(cfg, m) for m in reps.models]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_stepping_together_is_bit_identical_to_each_step(name):
    node = {"_target_": "torch.optim.SGD", "lr": 0.1, **SETTINGS[name]}
    (a, opts_a), (b, opts_b) = replicas_and_optimizers(node), replicas_and_optimizers(node)
    assert _same_plain_sgd(opts_b)
    for step in range(4):
        grads = torch.randn(a.grads.shape, generator=torch.Generator().manual_seed(step))
        a.grads.copy_(grads)
        b.grads.copy_(grads)
        for opt in opts_a:
            opt.step()
        step_together(opts_b)
        assert torch.equal(a.params, b.params), step
        for oa, ob in zip(opts_a, opts_b, strict=True):
            for sa, sb in zip(oa.state.values(), ob.state.values(), strict=True):
                assert sa.keys() == sb.keys()
                assert all(torch.equal(sa[k], sb[k]) for k in sa if torch.is_tensor(sa[k]))
    # after a round trip through state_dict (a resumed run) it goes on identically
    for oa, ob in zip(opts_a, opts_b, strict=True):
        ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # as read from a file
    for opt in opts_a:
        opt.step()
    step_together(opts_b)
    assert torch.equal(a.params, b.params)


def test_anything_else_steps_one_by_one():
    adam = {"_target_": "torch.optim.Adam", "lr": 0.01}
    (a, opts_a), (b, opts_b) = replicas_and_optimizers(adam), replicas_and_optimizers(adam)
    assert not _same_plain_sgd(opts_b)
    a.grads.fill_(0.5)
    b.grads.fill_(0.5)
    for opt in opts_a:
        opt.step()
    step_together(opts_b)
    assert torch.equal(a.params, b.params)
    sgd = {"_target_": "torch.optim.SGD", "lr": 0.1}
    _, opts = replicas_and_optimizers(sgd)
    opts[2].param_groups[0]["lr"] = 0.2  # a worker with another lr
    assert not _same_plain_sgd(opts)
    opts[2].param_groups[0]["lr"] = 0.1
    opts[1].register_step_post_hook(lambda *a: None)
    assert not _same_plain_sgd(opts)
