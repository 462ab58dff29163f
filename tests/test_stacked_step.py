"""`stacked_step`: K workers' Adam, AdamW and MuonAdamW steps as one functional call per group
over the flat rows, against each optimizer's own `step()`.

Adam and AdamW (and MuonAdamW's AdamW groups): bit for bit, parameters, `exp_avg`,
`exp_avg_sq` and every parameter's `step` counter, from the first step (state created) on,
with two interleaved groups, channels-last convolutions, float64 and float32, through a
state-dict round trip, an in-place average of the state, a reset of some parameters' state
(then, its counters differing from the others', that group goes per optimizer) and of all
of it. MuonAdamW's Muon groups: the batched
Newton–Schulz (`muon.newton_schulz`) against torch's per-matrix one — in float64 and float32
against the same sequence per matrix, in bfloat16 (what the step uses) against torch's own
function — and the whole step against each worker's own, to the bound stated below.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import SHARED, compose_config, final_state64, max_diff, same
from omegaconf import OmegaConf
from torch.optim._muon import _zeropower_via_newtonschulz

from dpresearch.algorithms.local_sgd import average_optimizer_state
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.models.gpt import GPT
from dpresearch.models.resnet_cifar import ResNetCifar
from dpresearch.muon import newton_schulz
from dpresearch.optim import make_optimizer
from dpresearch.replicas import Replicas
from dpresearch.stacked_step import FlatRows, stackable, step_together

K = 4
WORKS = SHARED / "data" / "shakespeare" / "works"
NS = (3.4445, -4.775, 2.0315)
ADAM = {
    "adamw": {"_target_": "torch.optim.AdamW", "lr": 0.01, "weight_decay": 0.1,
              "exclude_bn_bias_from_weight_decay": True},
    "adam": {"_target_": "torch.optim.Adam", "lr": 0.01, "weight_decay": 1e-3,
             "betas": [0.8, 0.99]},
}  # fmt: skip
MUON = {
    "_target_": "dpresearch.muon.MuonAdamW",
    "lr": 0.02,
    "weight_decay": 0.01,
    "adamw_lr": 0.001,
    "adamw_weight_decay": 0.1,
    "exclude_bn_bias_from_weight_decay": True,
}


def build(node: dict, model: str, dtype: torch.dtype) -> tuple[Replicas, list]:
    torch.manual_seed(0)
    if model == "gpt":
        net = GPT(11, (8,), n_layer=2, n_head=2, n_embd=16, bias=True)
    else:
        net = ResNetCifar(10, (3, 8, 8), depth=8, width=4)
    reps = Replicas(net.to(dtype), K, torch.device("cpu"), channels_last=model == "resnet")
    return reps, [make_optimizer(OmegaConf.create(node), m) for m in reps.models]


def states_equal(opts_a: list, opts_b: list, exact: bool = True) -> None:
    for oa, ob in zip(opts_a, opts_b, strict=True):
        for ga, gb in zip(oa.param_groups, ob.param_groups, strict=True):
            for p_a, p_b in zip(ga["params"], gb["params"], strict=True):
                sa, sb = oa.state.get(p_a, {}), ob.state.get(p_b, {})
                assert sa.keys() == sb.keys()
                for key in sa:
                    assert torch.equal(sa[key], sb[key]), key
                    assert sa[key].stride() == sb[key].stride(), key


def stepped_alike(a, opts_a, b, opts_b, rows: FlatRows, seed: int, on_rows: bool) -> None:
    """Seeded gradients into both replicas; `opts_a` each step alone, `opts_b` on the rows
    (which must take it, or decline it when `on_rows` is False: then `step_together`); the
    parameters and every state entry bit for bit the same."""
    grads = torch.randn(a.grads.shape, generator=torch.Generator().manual_seed(seed))
    a.grads.copy_(grads.to(a.grads.dtype))
    b.grads.copy_(grads.to(b.grads.dtype))
    for opt in opts_a:
        opt.step()
    assert rows.step(opts_b) is on_rows, seed
    if not on_rows:
        step_together(opts_b, rows)
    assert torch.equal(a.params, b.params), seed
    states_equal(opts_a, opts_b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("model", ["gpt", "resnet"])
@pytest.mark.parametrize("name", list(ADAM))
def test_adam_on_the_rows_is_bit_identical_to_each_step(name, model, dtype):
    node = ADAM[name]
    (a, opts_a), (b, opts_b) = build(node, model, dtype), build(node, model, dtype)
    assert stackable(opts_b) is type(opts_b[0])
    rows = FlatRows(b.params, b.grads)
    comm = SimulatedCommunicator(K, NetworkModel.preset("1gbe"))

    def step_both(seed: int, on_rows: bool = True) -> None:
        stepped_alike(a, opts_a, b, opts_b, rows, seed, on_rows)

    for step in range(3):
        step_both(step)
    # the rows are the state: one packed tensor per group and key, counters one tensor
    group_count = len(opts_b[0].param_groups)
    assert len(rows.spans) == group_count
    for opt in opts_b:
        for group, span in zip(opt.param_groups, rows.spans, strict=True):
            for p in group["params"]:
                state = opt.state[p]
                for key in ("exp_avg", "exp_avg_sq"):
                    assert state[key].untyped_storage().data_ptr() == (
                        span.state[key].untyped_storage().data_ptr()
                    )
                assert state["step"].untyped_storage().data_ptr() == (
                    span.steps.untyped_storage().data_ptr()
                )
                assert float(state["step"]) == 3.0
    for oa, ob in zip(opts_a, opts_b, strict=True):  # a resumed run: state read from a file
        ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    step_both(3)
    for opts in (opts_a, opts_b):
        average_optimizer_state(opts, comm)
    step_both(4)
    for opts in (opts_a, opts_b):  # a fragment's reset: some parameters lose their state
        for opt in opts:
            opt.state.pop(opt.param_groups[0]["params"][0], None)
    step_both(5, on_rows=False)
    step_both(6, on_rows=False)  # counters 2 and 7 in one group: still one by one
    for opts in (opts_a, opts_b):  # inner_state=reset of the whole model
        for opt in opts:
            opt.state.clear()
    step_both(7)
    step_both(8)


@pytest.mark.parametrize("target", ["torch.optim.AdamW", "torch.optim.SGD"])
def test_multi_tensor_kernels_on_whole_runs_are_each_step(target):
    """The accelerator's path on a CPU: optimizers asking for torch's multi-tensor (`foreach`)
    kernels, the rows not cut into pieces (as on a GPU) — the stacked call on whole runs is
    bit for bit each optimizer's own multi-tensor step, state included."""
    node = {
        "_target_": target,
        "lr": 0.01,
        "weight_decay": 0.1,
        "foreach": True,
        "exclude_bn_bias_from_weight_decay": True,
    }
    if target.endswith("SGD"):
        node |= {"momentum": 0.9, "nesterov": True}
    (a, opts_a), (b, opts_b) = build(node, "gpt", torch.float32), build(node, "gpt", torch.float32)
    rows = FlatRows(b.params, b.grads)
    rows._piece = 0  # whole runs, as on an accelerator
    for step in range(3):
        grads = torch.randn(a.grads.shape, generator=torch.Generator().manual_seed(step))
        a.grads.copy_(grads)
        b.grads.copy_(grads)
        for opt in opts_a:
            opt.step()
        assert rows.step(opts_b)
        assert rows.foreach(opts_b[0].param_groups[0])
        assert torch.equal(a.params, b.params), step
        states_equal(opts_a, opts_b)
    assert max(len(span.runs) for span in rows.spans) < len(opts_b[0].param_groups[0]["params"])


def test_adam_with_unequal_counters_steps_one_by_one():
    """Where one parameter's counter differs from the others' (its state reset earlier), the
    group cannot share a bias correction: the rows decline and each optimizer steps alone."""
    (a, opts_a), (b, opts_b) = (
        build(ADAM["adamw"], "gpt", torch.float64),
        build(ADAM["adamw"], "gpt", torch.float64),
    )
    rows = FlatRows(b.params, b.grads)
    a.grads.fill_(0.1)
    b.grads.fill_(0.1)
    for opt in opts_a:
        opt.step()
    step_together(opts_b, rows)
    for opts in (opts_a, opts_b):
        for opt in opts:
            opt.state.pop(opt.param_groups[0]["params"][0])
    for opt in opts_a:
        opt.step()
    step_together(opts_b, rows)
    assert not rows.step(opts_b)  # counters 1 and 2 in one group
    for opt in opts_a:
        opt.step()
    step_together(opts_b, rows)
    assert torch.equal(a.params, b.params)
    states_equal(opts_a, opts_b)


def test_counters_advanced_by_a_step_one_by_one_are_followed():
    """A step taken per optimizer (one group's state partly reset) advances the other group's
    bound counters in place; once the rows take the step again, that group's bias correction
    follows its counters (not a count of the rows' own steps): bit for bit each step."""
    (a, opts_a), (b, opts_b) = (
        build(ADAM["adamw"], "gpt", torch.float64),
        build(ADAM["adamw"], "gpt", torch.float64),
    )
    rows = FlatRows(b.params, b.grads)

    def step_both(seed: int, on_rows: bool) -> None:
        stepped_alike(a, opts_a, b, opts_b, rows, seed, on_rows)

    step_both(0, True)
    step_both(1, True)
    for opts in (opts_a, opts_b):  # group 0 partly reset: this step one by one
        for opt in opts:
            opt.state.pop(opt.param_groups[0]["params"][0])
    step_both(2, False)
    for opts in (opts_a, opts_b):  # group 0 wholly reset; group 1's counters stand at 3
        for opt in opts:
            for p in opt.param_groups[0]["params"]:
                opt.state.pop(p)
    step_both(3, True)
    step_both(4, True)


def test_workers_with_other_hyper_parameters_step_one_by_one():
    _, opts = build(ADAM["adamw"], "gpt", torch.float32)
    assert stackable(opts) is torch.optim.AdamW
    opts[1].param_groups[1]["eps"] = 1e-6
    assert stackable(opts) is None
    opts[1].param_groups[1]["eps"] = opts[0].param_groups[1]["eps"]
    opts[2].param_groups[0]["amsgrad"] = True
    assert stackable(opts) is None


# -- Muon -----------------------------------------------------------------------------------------


def newton_schulz_per_matrix(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """torch's `_zeropower_via_newtonschulz` line by line, in `g`'s dtype (torch's casts to
    bfloat16 first)."""
    a, b, c = NS
    x = g.T if g.size(0) > g.size(1) else g
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.size(0) > g.size(1) else x


# The batched iterations against the per-matrix ones: the same products, which a batched kernel
# may sum in another order, so the bound allows rounding of the dtype grown over five
# iterations (n·ε·10 for n ≤ 256 inner terms); measured on these sizes (and 5 seeds × 5 shapes
# up to 192 × 64): equal bit for bit in float64 and float32.
BOUNDS = {dtype: 256 * torch.finfo(dtype).eps * 10 for dtype in (torch.float64, torch.float32)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(16, 32), (48, 16), (64, 64)])
def test_batched_newton_schulz_equals_the_per_matrix_iterations(shape, dtype):
    g = torch.randn(8, *shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    batched = newton_schulz(g, NS, 5, 1e-7)
    reference = torch.stack([newton_schulz_per_matrix(m) for m in g])
    assert batched.dtype == dtype and batched.shape == g.shape
    assert (batched - reference).abs().max() <= BOUNDS[dtype]
    # not a vacuous bound: the result is near-orthogonal, entries of order 1/√n
    assert reference.abs().max() > 0.1


# In bfloat16 (what Muon runs) the batched kernel rounds some sums differently from torch's
# per-matrix `addmm` (measured over 5 seeds × 5 shapes: 199 of 200 matrices bit for bit, the
# other within 0.0059 = 1.5 bfloat16 ulps of its entries ≤ 1): the stated bound, 4 ulps at 1.
BF16_BOUND = 2**-6


@pytest.mark.parametrize("shape", [(16, 32), (48, 16), (64, 64), (64, 256)])
def test_batched_newton_schulz_in_bfloat16_is_torchs_within_its_rounding(shape):
    g = torch.randn(8, *shape, generator=torch.Generator().manual_seed(2))
    batched = newton_schulz(g.bfloat16(), NS, 5, 1e-7)
    torchs = torch.stack([_zeropower_via_newtonschulz(m, NS, 5, 1e-7) for m in g])
    assert batched.dtype == torch.bfloat16
    assert (batched.float() - torchs.float()).abs().max() <= BF16_BOUND


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_muon_adamw_on_the_rows_equals_each_step(dtype):
    """MuonAdamW over K GPT workers: its AdamW groups bit for bit each worker's own step; its
    Muon groups (momentum buffers bit for bit until the first orthogonalised update feeds back
    through the parameters) within lr·√max(1, m/n)·2⁻⁶ per step per entry (the bfloat16 bound
    above, scaled by the step) of each worker's own step, through a state-dict round trip."""
    (a, opts_a), (b, opts_b) = build(MUON, "gpt", dtype), build(MUON, "gpt", dtype)
    assert stackable(opts_b) is type(opts_b[0])
    rows = FlatRows(b.params, b.grads)
    muon = {id(p) for opt in opts_b for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    drift = 0.0
    for step in range(4):
        grads = torch.randn(a.grads.shape, generator=torch.Generator().manual_seed(step))
        a.grads.copy_(grads.to(dtype))
        b.grads.copy_(grads.to(dtype))
        for opt in opts_a:
            opt.step()
        assert rows.step(opts_b), step
        adj = max(
            max(1.0, p.shape[0] / p.shape[1]) ** 0.5
            for p in b.models[0].parameters()
            if id(p) in muon
        )
        drift += MUON["lr"] * adj * BF16_BOUND
        for oa, ob in zip(opts_a, opts_b, strict=True):
            for ga, gb in zip(oa.param_groups, ob.param_groups, strict=True):
                for p_a, p_b in zip(ga["params"], gb["params"], strict=True):
                    if gb["use_muon"]:
                        assert (p_a - p_b).abs().max() <= drift, (step, p_b.shape)
                        buf_a = oa.state[p_a]["momentum_buffer"]
                        buf_b = ob.state[p_b]["momentum_buffer"]
                        assert torch.equal(buf_a, buf_b)  # gradients are given, not computed
                    else:
                        assert torch.equal(p_a, p_b), step
                        for key, value in oa.state[p_a].items():
                            assert torch.equal(value, ob.state[p_b][key]), key
        if step == 1:
            for oa, ob in zip(opts_a, opts_b, strict=True):
                ob.load_state_dict(copy.deepcopy(oa.state_dict()))
            b.params.copy_(a.params)  # the stated drift starts afresh from the file
            drift = 0.0
    assert drift > 0


# -- per algorithm family, through the trainer ----------------------------------------------------

LM = [
    "data=shakespeare",
    f"data.root={WORKS}",
    "model=gpt_tiny",
    "model.block_size=16",
    "data.eval_tokens=256",
    "data.sample_tokens=0",
    "train.progress=false",
    "train.batch_size=4",
    "train.steps=12",
    "train.log_every=4",
    "train.eval_every=12",
    "workers=4",
]
FAMILIES = {
    "sync_adamw": ["optimizer=adamw", "optimizer.lr=0.003"],
    "sync_adam": ["optimizer=adam", "optimizer.lr=0.003", "optimizer.weight_decay=0.01"],
    # DiLoCo: inner AdamW, outer SGD with Nesterov momentum (one call on the anchor's row)
    "diloco": ["optimizer=adamw", "optimizer.lr=0.003", "algorithm=local_sgd",
               "algorithm.period=4", "outer=nesterov"],
    "diloco_reset_streaming": ["optimizer=adamw", "optimizer.lr=0.003", "algorithm=local_sgd",
                               "algorithm.period=4", "outer=nesterov", "outer.fragments=2",
                               "outer.inner_state=reset"],
    "muon": ["optimizer=muon", "algorithm=local_sgd", "algorithm.period=3"],
}  # fmt: skip


@pytest.mark.skipif(not WORKS.is_dir(), reason=f"no corpus at {WORKS}")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_trained_with_stacked_steps_equals_per_worker_steps(family, monkeypatch):
    """K = 4 GPT workers trained in float64 with the optimizers stepping on the rows equal the
    same run with every optimizer stepping alone (`stackable` refused): bit for bit for
    Adam/AdamW (inner and DiLoCo's outer Nesterov, Streaming DiLoCo's per-fragment resets),
    for MuonAdamW within the bfloat16 Newton–Schulz bound per step (`BF16_BOUND`; the batched
    and per-matrix orthogonalisations round differently, and training feeds that back)."""
    import dpresearch.stacked_step as stacked

    cfg = compose_config(*LM, *FAMILIES[family])
    took = []
    step = stacked.FlatRows.step
    monkeypatch.setattr(
        stacked.FlatRows, "step", lambda self, o: took.append(step(self, o)) or took[-1]
    )
    on_rows, _ = final_state64(cfg)
    assert any(took), "the rows were never used"
    monkeypatch.setattr(stacked, "stackable", lambda optimizers: None)
    took.clear()
    alone, _ = final_state64(cfg)
    assert not took
    if family != "muon":
        assert same(on_rows, alone)
    else:
        bound = 12 * 0.02 * 2 * BF16_BOUND  # steps · lr · the largest √max(1, m/n) · bound
        assert max_diff(on_rows, alone) <= bound  # bit for bit in the runs seen so far


@pytest.mark.parametrize("fn", ["original", None, "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (48, 48), (7, 3, 3, 3)])
def test_own_muon_lr_and_step_dtype_are_torchs_to_the_bit(fn, shape):
    """`muon.adjusted_lr` and `stacked_step.step_dtype` stand for torch's private
    `_adjust_lr` and `_get_scalar_dtype` (the module imports neither): the same float, bit for
    bit, and the same dtype under either default dtype."""
    import ast
    import inspect

    from torch.optim._muon import _adjust_lr
    from torch.optim.optimizer import _get_scalar_dtype

    import dpresearch.stacked_step as module
    from dpresearch.muon import adjusted_lr
    from dpresearch.stacked_step import step_dtype

    for lr in (0.02, 1e-3, 0.7):
        assert adjusted_lr(lr, fn, shape) == _adjust_lr(lr, fn, torch.Size(shape))
    default = torch.get_default_dtype()
    try:
        for dtype in (torch.float64, torch.float32):
            torch.set_default_dtype(dtype)
            assert step_dtype() == _get_scalar_dtype()
    finally:
        torch.set_default_dtype(default)
    imported = [
        alias.name
        for node in ast.walk(ast.parse(inspect.getsource(module)))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch")
        for alias in node.names
    ]
    assert not [name for name in imported if name.startswith("_")], imported
