"""The GPT language model: shapes, causality, weight tying, nanoGPT's parameter counts and
initialisation, a float64 forward pass against a hand-written reference, one-line errors, and
deterministic sampling."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from dpresearch import CONF_DIR
from dpresearch.data.text import TextDataset
from dpresearch.models.gpt import GPT

CONF = CONF_DIR / "model"


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    options = dict(n_layer=2, n_head=2, n_embd=16, block_size=12) | kw
    return GPT(11, (8,), **options)


def test_forward_maps_token_ids_to_logits_at_every_position():
    model = tiny()
    idx = torch.randint(0, 11, (3, 8))
    logits = model(idx)
    assert logits.shape == (3, 8, 11) and logits.dtype == torch.float32
    assert model(idx[:, :5]).shape == (3, 5, 11)  # shorter than block_size: fine


def test_changing_a_token_changes_no_earlier_logit():
    model = tiny().eval()
    idx = torch.randint(0, 11, (2, 8))
    for t in (0, 3, 7):
        other = idx.clone()
        other[:, t] = (other[:, t] + 1) % 11
        a, b = model(idx), model(other)
        # the same computation on the same inputs for positions before t (issue 33, class a:
        # each row of a matmul or LayerNorm is reduced on its own, masked scores weigh 0), so
        # exact on any CPU; 1e-6 is a margin, not a rounding budget
        torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(a[:, t], b[:, t])


def test_output_head_is_the_token_embedding_and_stays_tied_when_copied():
    model = tiny()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert sum(p is model.lm_head.weight for p in model.parameters()) == 1
    clone = copy.deepcopy(model)
    assert clone.lm_head.weight is clone.transformer.wte.weight


@pytest.mark.parametrize(
    ("name", "vocab", "total", "non_embedding"),
    [
        ("gpt", 84, 1_811_904, 1_787_328),
        ("gpt_tiny", 84, 108_096, 104_000),
        # nanoGPT's shakespeare-char run prints "number of parameters: 10.65M"
        ("gpt_nanogpt", 65, 10_745_088, 10_646_784),
    ],
)
def test_preset_parameter_counts(name, vocab, total, non_embedding):
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    model = instantiate(cfg, num_classes=vocab, input_shape=(cfg.block_size,))
    print(f"{name}: {model.num_params(False):,} parameters, {model.num_params():,} nanoGPT's count")
    assert model.num_params(non_embedding=False) == total
    assert model.num_params() == non_embedding
    # one block: qkv + projection + 4x MLP = 12 n_embd^2 weights and two LayerNorm gains
    n = cfg.n_embd
    blocks = cfg.n_layer * (12 * n * n + 2 * n)
    assert total == blocks + vocab * n + cfg.block_size * n + n


def test_initialisation_is_nanogpts():
    model = GPT(11, (8,), n_layer=4, n_head=2, n_embd=64, block_size=8, bias=True)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            assert p.std().item() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.1), name
        elif name.endswith(("c_attn.weight", "c_fc.weight", "wte.weight", "wpe.weight")):
            assert p.std().item() == pytest.approx(0.02, rel=0.1), name
        elif name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        else:  # LayerNorm gains
            assert torch.all(p == 1), name


def reference_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The GPT forward pass written out: explicit causal softmax attention per head."""
    tr = model.transformer
    n_embd = tr.wte.weight.shape[1]
    n_head = tr.h[0].attn.n_head
    d = n_embd // n_head
    T = idx.shape[1]

    def linear(x, layer):
        y = x @ layer.weight.T
        return y if layer.bias is None else y + layer.bias

    def norm(x, ln):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        y = (x - mean) / torch.sqrt(var + 1e-5) * ln.weight
        return y if ln.bias is None else y + ln.bias

    mask = torch.ones(T, T, dtype=torch.bool).tril()
    x = tr.wte.weight[idx] + tr.wpe.weight[:T]
    for block in tr.h:
        q, k, v = linear(norm(x, block.ln_1), block.attn.c_attn).split(n_embd, dim=-1)
        heads = []
        for h in range(n_head):
            qh, kh, vh = (t[..., h * d : (h + 1) * d] for t in (q, k, v))
            scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(d)
            scores = scores.masked_fill(~mask, float("-inf"))
            heads.append(torch.softmax(scores, dim=-1) @ vh)
        x = x + linear(torch.cat(heads, dim=-1), block.attn.c_proj)
        hidden = linear(norm(x, block.ln_2), block.mlp.c_fc)
        hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))
        x = x + linear(hidden, block.mlp.c_proj)
    return norm(x, tr.ln_f) @ tr.wte.weight.T


@pytest.mark.parametrize("bias", [False, True])
def test_float64_forward_matches_the_written_out_attention(bias):
    model = tiny(bias=bias, n_head=4).double().eval()
    with torch.no_grad():
        for p in model.parameters():  # non-trivial gains and biases too
            p.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(0, 11, (3, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), reference_logits(model, idx), rtol=0, atol=1e-10)


def test_dropout_only_in_training_mode():
    model = tiny(dropout=0.5)
    idx = torch.randint(0, 11, (2, 8))
    assert not torch.equal(model(idx), model(idx))
    model.eval()
    assert torch.equal(model(idx), model(idx))


@pytest.mark.parametrize(
    ("kw", "input_shape", "match"),
    [
        (
            dict(n_embd=30, n_head=4),
            (8,),
            r"^model.n_embd=30 must be a multiple of model.n_head=4$",
        ),
        (
            dict(block_size=4),
            (8,),
            r"^model.block_size=4 is shorter than the data's windows of 8; "
            r"raise model.block_size or lower data.block_size$",
        ),
        (
            dict(),
            (3, 32, 32),
            r"^model GPT takes windows of token ids, not inputs of shape \[3, 32, 32\]",
        ),
        (dict(n_layer=0), (8,), r"^model.n_layer=0: must be an integer >= 1$"),
    ],
)
def test_bad_sizes_are_one_line(kw, input_shape, match):
    options = dict(n_layer=1, n_head=2, n_embd=8, block_size=8) | kw
    with pytest.raises(ValueError, match=match) as info:
        GPT(11, input_shape, **options)
    assert "\n" not in str(info.value)


def test_float_input_says_the_model_takes_token_ids():
    with pytest.raises(TypeError, match=r"^model.GPT takes integer token ids") as info:
        tiny()(torch.randn(2, 8))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"^model.block_size=12 is shorter"):
        tiny()(torch.zeros(1, 13, dtype=torch.long))


def test_generate_is_deterministic_per_generator_and_crops_the_context():
    model = tiny(dropout=0.1).train()
    prompt = torch.randint(0, 11, (2, 3))

    def sample(seed, **kw):
        return model.generate(prompt, 20, generator=torch.Generator().manual_seed(seed), **kw)

    a, b = sample(1), sample(1)
    assert a.shape == (2, 23) and torch.equal(a, b)  # 23 > block_size 12: cropped
    assert torch.equal(a[:, :3], prompt)
    assert not torch.equal(a, sample(2))
    assert model.training  # its mode is restored
    assert int(a.min()) >= 0 and int(a.max()) < 11
    greedy = sample(3, top_k=1)
    model.eval()
    with torch.no_grad():
        first = model(prompt)[:, -1].argmax(-1)
    assert torch.equal(greedy[:, 3], first)


def test_a_text_sample_is_generate_from_the_test_splits_first_window(tmp_path):
    """`TextDataset.sample` (the run's sample.txt) draws the tokens `GPT.generate` draws from
    the same generator state: one sampling loop, prompted by the test split's first window."""
    (tmp_path / "c.txt").write_text("the quick brown fox jumps over the lazy dog. " * 50)
    data = TextDataset.load(tmp_path / "c.txt", block_size=8, eval_tokens=64, sample_tokens=30)
    torch.manual_seed(0)
    model = GPT(data.vocab.size, (8,), n_layer=1, n_head=2, n_embd=16, block_size=8)
    text = data.sample(model, torch.Generator().manual_seed(3))
    prompt = data.test_inputs[:8].long()[None]
    ids = model.generate(prompt, 30, generator=torch.Generator().manual_seed(3))[0].tolist()
    assert len(ids) == 38
    assert text == (
        f"{data.vocab.decode(ids[:8])}\n---- generated: ----\n{data.vocab.decode(ids[8:])}\n"
    )
