"""Optimizers and schedule for language models: AdamW with nanoGPT's decay rule, Muon on the
hidden matrices with AdamW on the rest (`muon.MuonAdamW`) against a written-out restatement,
its checkpoint round trip and lr schedule, and warm-up counted in steps."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from dpresearch import CONF_DIR
from dpresearch.models.gpt import GPT
from dpresearch.muon import MuonAdamW, split_param_groups
from dpresearch.optim import build_optimizer, make_optimizer, set_lr
from dpresearch.schedules import Constant, Cosine

VOCAB, T = 13, 8
MUON = OmegaConf.load(CONF_DIR / "optimizer" / "muon.yaml")
EMBEDDINGS = {"transformer.wte.weight", "transformer.wpe.weight"}


def tiny_gpt(seed: int = 0, dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(seed)
    # n_embd 24 vs 96-wide MLP: both wide and tall matrices
    return GPT(VOCAB, (T,), n_layer=2, n_head=2, n_embd=24, block_size=T, bias=True).to(dtype)


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (4, T), generator=g), torch.randint(0, VOCAB, (4, T), generator=g))
        for _ in range(n)
    ]


def backward(model: GPT, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()


def muon_names(opt: torch.optim.Optimizer, model: GPT) -> set[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for g in opt.param_groups if g["use_muon"] for p in g["params"]}


def test_muon_takes_exactly_the_non_embedding_matrices():
    model = tiny_gpt()
    opt = make_optimizer(MUON, model)
    expected = {n for n, p in model.named_parameters() if p.dim() == 2} - EMBEDDINGS
    assert muon_names(opt, model) == expected
    assert all(n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) for n in expected)
    # every parameter once; the tied head is the token embedding, on AdamW
    grouped = [p for g in opt.param_groups for p in g["params"]]
    assert len(grouped) == len({id(p) for p in grouped}) == len(list(model.parameters()))
    head = model.lm_head.weight
    assert any(p is head for g in opt.param_groups if not g["use_muon"] for p in g["params"])
    # groups: Muon (its decay), AdamW >= 2-D (its decay), AdamW gains and biases (none)
    summary = [(g["use_muon"], g["lr"], g["weight_decay"]) for g in opt.param_groups]
    assert summary == [(True, 0.02, 0.0), (False, 0.001, 0.1), (False, 0.001, 0.0)]
    assert {
        n for n, p in model.named_parameters() if any(p is q for q in opt.param_groups[1]["params"])
    } == EMBEDDINGS
    assert all(p.dim() == 1 for p in opt.param_groups[2]["params"])


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic Newton–Schulz iteration with torch's coefficients, in bfloat16
    as torch's Muon runs it; `addmm` because its single rounding is part of what bfloat16
    computes (separate products would round differently)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = g.shape[0] > g.shape[1]
    x = g.bfloat16()
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b·G + c·G²
        x = torch.addmm(x, poly, x, beta=a)  # a·X + (b·G + c·G²)·X
    return x.T if tall else x


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_muon_adamw_equals_muon_written_out_plus_torch_adamw(adjust):
    """float64, three steps: MuonAdamW on a GPT = the Muon update written out on the hidden
    matrices + torch.optim.AdamW (nanoGPT's two groups) on the rest."""
    node = OmegaConf.merge(MUON, {"weight_decay": 0.05, "adjust_lr_fn": adjust})
    model = tiny_gpt(dtype=torch.float64)
    ref = copy.deepcopy(model)
    opt = make_optimizer(node, model)
    named = dict(ref.named_parameters())
    hidden = [named[n] for n in sorted(muon_names(opt, model))]
    others = [p for p in named.values() if all(p is not h for h in hidden)]
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in others if p.dim() >= 2]},
            {"params": [p for p in others if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=node.adamw_lr,
        betas=tuple(node.adamw_betas),
        eps=node.adamw_eps,
        weight_decay=node.adamw_weight_decay,
    )
    buffers = {id(p): torch.zeros_like(p) for p in hidden}
    lr, mu, wd = node.lr, node.momentum, node.weight_decay
    for x, y in batches(3):
        backward(model, x, y)
        backward(ref, x, y)
        opt.step()
        with torch.no_grad():
            for p in hidden:
                buf = buffers[id(p)]
                buf.lerp_(p.grad, 1 - mu)  # m ← μ·m + (1−μ)·g
                update = newton_schulz(p.grad.lerp(buf, mu))  # Nesterov: (1−μ)·g + μ·m
                rows, cols = p.shape
                scale = (
                    math.sqrt(max(1, rows / cols))
                    if adjust == "original"
                    else (0.2 * math.sqrt(max(rows, cols)))
                )
                p.mul_(1 - lr * wd)
                p.sub_(lr * scale * update.double())
        adamw.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert (p - q).abs().max().item() <= 1e-6, name


def checkpoint(obj: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_state_dict_round_trip_continues_bit_identically():
    model = tiny_gpt()
    opt = make_optimizer(MUON, model)
    data = batches(5)
    for x, y in data[:2]:
        backward(model, x, y)
        opt.step()
    assert all(len(opt.state[p]) > 0 for p in model.parameters())
    saved_model, saved_opt = checkpoint(model.state_dict()), checkpoint(opt.state_dict())
    fresh = tiny_gpt(seed=7)
    fresh.load_state_dict(saved_model)
    fresh_opt = make_optimizer(MUON, fresh)
    fresh_opt.load_state_dict(saved_opt)
    for x, y in data[2:]:
        for m, o in ((model, opt), (fresh, fresh_opt)):
            backward(m, x, y)
            o.step()
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(value, fresh_opt.state[q][key]), key


def test_set_lr_rescales_muon_and_adamw_groups_alike():
    model = tiny_gpt()
    opt = make_optimizer(MUON, model, lr_scale=2.0)  # linear scaling: both lrs
    bases = [g["lr"] for g in opt.param_groups]
    assert bases == [0.04, 0.002, 0.002]
    schedule = Cosine(final=0.1, warmup_steps=10, steps_per_epoch=4, total_steps=100)
    for step in (0, 5, 10, 60):
        set_lr(opt, bases, schedule(step))
        for group, base in zip(opt.param_groups, bases, strict=True):
            assert group["lr"] == base * schedule(step)
    assert opt.param_groups[0]["lr"] / opt.param_groups[1]["lr"] == pytest.approx(20.0)


def test_muon_needs_the_model_and_tagged_groups():
    model = tiny_gpt()
    params = list(model.parameters())
    with pytest.raises(ValueError, match="MuonAdamW needs the model"):
        build_optimizer(MUON, params)
    with pytest.raises(ValueError, match="every parameter group needs use_muon"):
        MuonAdamW(params)
    with pytest.raises(ValueError, match="Muon takes 2-D matrices only"):
        MuonAdamW([{"params": params, "use_muon": True}])
    with pytest.raises(ValueError, match="adjust_lr_fn=rms"):
        MuonAdamW(split_param_groups([{"params": params}], model), adjust_lr_fn="rms")


def test_adamw_lm_decays_matrices_and_embeddings_only():
    model = tiny_gpt()
    opt = make_optimizer(OmegaConf.load(CONF_DIR / "optimizer" / "adamw_lm.yaml"), model)
    assert type(opt) is torch.optim.AdamW
    decay, no_decay = opt.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"], decay["betas"]) == (
        0.1,
        0.0,
        (0.9, 0.99),
    )
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in decay["params"]} == {
        n for n, p in model.named_parameters() if p.dim() >= 2
    }
    assert all("ln_" in names[id(p)] or "bias" in names[id(p)] for p in no_decay["params"])


def test_warmup_in_steps_then_cosine_to_a_tenth():
    s = Cosine(final=0.1, warmup_steps=100, steps_per_epoch=7, total_steps=1000)
    assert s(0) == 0.0
    assert s(50) == pytest.approx(0.5)
    assert s(100) == pytest.approx(1.0)
    assert s(550) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s(1000) == pytest.approx(0.1)
    assert Constant(warmup_steps=4, warmup_from=0.5, steps_per_epoch=3, total_steps=9)(2) == (
        pytest.approx(0.75)
    )


def test_warmup_cosine_yaml_is_nanogpts_lr_after_warmup():
    node = OmegaConf.load(CONF_DIR / "schedule" / "warmup_cosine.yaml")
    schedule = instantiate(node, steps_per_epoch=37, total_steps=5000)
    lr, min_lr, warmup, decay_iters = 1e-3, 1e-4, 100, 5000

    def nanogpt(it: int) -> float:  # train.py's get_lr past the warm-up
        ratio = (it - warmup) / (decay_iters - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)

    for it in (100, 101, 1000, 2550, 4999, 5000):
        assert lr * schedule(it) == pytest.approx(nanogpt(it), rel=1e-9)
    assert lr * schedule(50) == pytest.approx(lr * 0.5)


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_warmup_steps_must_be_a_count(bad):
    with pytest.raises(ValueError, match=r"^schedule.warmup_steps=.*: must be an integer >= 0"):
        Cosine(warmup_steps=bad, steps_per_epoch=1, total_steps=10)


def test_warmup_steps_and_epochs_are_exclusive():
    with pytest.raises(ValueError) as info:
        Cosine(warmup_steps=10, warmup_epochs=1, steps_per_epoch=5, total_steps=50)
    assert str(info.value) == (
        "schedule.warmup_steps and schedule.warmup_epochs are both set; use one"
    )
    # warmup_steps 0 (or null) leaves warmup_epochs as it was
    assert Cosine(warmup_steps=0, warmup_epochs=1, steps_per_epoch=5, total_steps=50)(0) == 0.0
