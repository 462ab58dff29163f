"""`stacked_step.step_together`: K workers' SGD steps as one multi-tensor call give exactly (bit for
bit) what each optimizer's own `step()` gives — parameters and momentum buffers, from the first
step (buffers created) on, with weight decay, Nesterov, dampening and two parameter groups —
and anything else falls back to one step per optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from dpresearch.models.mlp import MLP
from dpresearch.optim import make_optimizer
from dpresearch.replicas import Replicas
from dpresearch.stacked_step import stackable, step_together

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
    assert stackable(opts_b)
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
    rmsprop = {"_target_": "torch.optim.RMSprop", "lr": 0.01}
    (a, opts_a), (b, opts_b) = replicas_and_optimizers(rmsprop), replicas_and_optimizers(rmsprop)
    assert not stackable(opts_b)
    a.grads.fill_(0.5)
    b.grads.fill_(0.5)
    for opt in opts_a:
        opt.step()
    step_together(opts_b)
    assert torch.equal(a.params, b.params)
    sgd = {"_target_": "torch.optim.SGD", "lr": 0.1}
    _, opts = replicas_and_optimizers(sgd)
    opts[2].param_groups[0]["lr"] = 0.2  # a worker with another lr
    assert not stackable(opts)
    opts[2].param_groups[0]["lr"] = 0.1
    opts[1].register_step_post_hook(lambda *a: None)
    assert not stackable(opts)
    # one optimizer alone too, and torch's global hooks (which its own step would call)
    assert stackable(opts[:1]) and not stackable(opts[1:2])
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda *a: None)
    try:
        assert not stackable(opts[:1])
    finally:
        handle.remove()
    assert stackable(opts[:1])


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("channels_last", [False, True])
def test_stepping_on_the_flat_rows_is_bit_identical_to_each_step(name, channels_last):
    """`FlatRows`: one SGD call on `replicas.params`/`.grads` — parameters and momentum buffers
    bit for bit each optimizer's own step, from the first step (buffers created) on; through a
    state-dict round trip (buffers copied back into flat rows), a reset of some parameters'
    buffers (that step per tensor) and an in-place average of the buffers. Two parameter
    groups (interleaved in the rows) step as one call each on their column runs."""
    from dpresearch.algorithms.local_sgd import average_optimizer_state
    from dpresearch.comm.network import NetworkModel
    from dpresearch.comm.simulated import SimulatedCommunicator
    from dpresearch.models.resnet_cifar import ResNetCifar
    from dpresearch.stacked_step import FlatRows

    node = {"_target_": "torch.optim.SGD", "lr": 0.1, **SETTINGS[name]}

    def build():
        torch.manual_seed(0)
        model = (
            ResNetCifar(10, (3, 8, 8), depth=8, width=4)
            if channels_last
            else MLP(5, (6,), hidden=[7], batch_norm=True)
        )
        reps = Replicas(model, 4, torch.device("cpu"), channels_last=channels_last)
        return reps, [make_optimizer(OmegaConf.create(node), m) for m in reps.models]

    (a, opts_a), (b, opts_b) = build(), build()
    rows = FlatRows(b.params, b.grads)
    flat = True
    momentum = SETTINGS[name]["momentum"] != 0

    def step_both(seed):
        grads = torch.randn(a.grads.shape, generator=torch.Generator().manual_seed(seed))
        a.grads.copy_(grads)
        b.grads.copy_(grads)
        for opt in opts_a:
            opt.step()
        took = rows.step(opts_b)
        assert took is (flat and not partial), seed
        if not took:
            step_together(opts_b)
        assert torch.equal(a.params, b.params), seed
        for oa, ob in zip(opts_a, opts_b, strict=True):
            for p_a, p_b in zip(
                oa.param_groups[0]["params"], ob.param_groups[0]["params"], strict=True
            ):
                sa, sb = oa.state.get(p_a, {}), ob.state.get(p_b, {})
                assert sa.keys() == sb.keys()
                assert all(torch.equal(sa[k], sb[k]) for k in sa if torch.is_tensor(sa[k]))

    partial = False
    for step in range(3):
        step_both(step)
    if flat and momentum:  # the buffers are views of one packed buffer per group
        assert rows.momentum is not None
        packed = {s.state["momentum_buffer"].untyped_storage().data_ptr() for s in rows.spans}
        assert len(packed) == len(opts_b[1].param_groups)
        assert all(
            s["momentum_buffer"].untyped_storage().data_ptr() in packed
            for s in opts_b[1].state.values()
        )
    for oa, ob in zip(opts_a, opts_b, strict=True):  # a resumed run: state read from a file
        ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    step_both(3)
    comm = SimulatedCommunicator(4, NetworkModel.preset("1gbe"))
    for opts in (opts_a, opts_b):
        average_optimizer_state(opts, comm)
    step_both(4)
    if momentum:  # a fragment's reset: some parameters lose their buffer
        for opts in (opts_a, opts_b):
            for opt in opts:
                opt.state.pop(opt.param_groups[0]["params"][0], None)
        partial = True
        step_both(5)
        partial = False
    step_both(6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_one_optimizer_stepping_alone_is_bit_identical_to_its_step(name, dtype):
    """An asynchronous event's update (`Algorithm.step_optimizer`): one worker's optimizer
    through `step_together([opt], FlatRows.of_row(...))` — one functional SGD call on its row
    (one call per group: two interleaved groups too) — gives bit for bit its own
    `step()`: parameters and momentum buffers, from the first step (buffers created) on,
    through a state-dict round trip, with the other rows untouched; and without rows too."""
    from dpresearch.stacked_step import FlatRows

    node = {"_target_": "torch.optim.SGD", "lr": 0.1, **SETTINGS[name]}

    def build():
        torch.manual_seed(0)
        reps = Replicas(MLP(5, (6,), hidden=[7], batch_norm=True).to(dtype), 4, torch.device("cpu"))
        return reps, [make_optimizer(OmegaConf.create(node), m) for m in reps.models]

    (a, opts_a), (b, opts_b), (c, opts_c) = build(), build(), build()
    assert b.params.dtype == dtype
    rows = {w: FlatRows.of_row(b.params, b.grads, w) for w in range(4)}
    for event, w in enumerate([2, 0, 2, 3, 2, 1, 0]):
        grads = torch.randn(a.grads.shape, generator=torch.Generator().manual_seed(event))
        for reps in (a, b, c):
            reps.grads.copy_(grads.to(dtype))
        if event == 4:  # a resumed run: state read from a file
            for oa, ob in zip(opts_a, opts_b, strict=True):
                ob.load_state_dict(copy.deepcopy(oa.state_dict()))
        opts_a[w].step()
        step_together([opts_b[w]], rows[w])
        step_together([opts_c[w]])
        assert rows[w].spans  # the row path took it
        for reps, opts in ((b, opts_b), (c, opts_c)):
            assert torch.equal(a.params, reps.params), (event, w)
            for oa, ob in zip(opts_a, opts, strict=True):
                for p_a, p_b in zip(
                    oa.param_groups[0]["params"], ob.param_groups[0]["params"], strict=True
                ):
                    sa, sb = oa.state.get(p_a, {}), ob.state.get(p_b, {})
                    assert sa.keys() == sb.keys()
                    assert all(torch.equal(sa[k], sb[k]) for k in sa if torch.is_tensor(sa[k]))
    assert not torch.equal(a.params[0], a.params[1])  # the rows stepped apart
