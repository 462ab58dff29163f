"""Per-worker dropout streams (`model.dropout_stream`, `models/dropout.py`; issue 31, item 1).

Under the `worker` stream (the default) worker w's masks for its n-th batch come from a
generator seeded with `dropout_seed(seed, w, n)`, drawn site by site in forward order: the
masks are checked here against that rule re-stated by hand (the loop and the stacked rows
alike), their statistics and scale against the binomial and torch's dropout, and `global`
against torch's own fused path. Whole runs: stacked ≡ loop in float64 and simulated ≡ gloo
with dropout in `tests/test_lm_workload.py` (its `dropout` case, kill/resume too)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dpresearch.models import dropout as stream
from dpresearch.models import gpt as gpt_model
from dpresearch.models.dropout import drawing_from, stream_dropout
from dpresearch.models.gpt import GPT
from dpresearch.replicas import Replicas
from dpresearch.run.compute import dropout_seed, worker_seed
from dpresearch.run.stacked import StackedWorkers, unsupported

P = 0.1
VOCAB, T, B, ROWS = 17, 8, 3, 3


def small(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, (T,), n_layer=2, n_head=2, n_embd=16, bias=True, dropout=P, **kw).double()


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(VOCAB, (ROWS, B, T + 1), generator=torch.Generator().manual_seed(4))
    return ids[..., :-1], ids[..., 1:]


def generators() -> list[torch.Generator]:
    return [torch.Generator().manual_seed(100 + w) for w in range(ROWS)]


def recorded(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Every `stream_dropout` call's input, output and generator count, in call order."""
    calls = []

    def recording(x, p, gens):
        out = stream_dropout(x, p, gens)
        calls.append((x.detach(), out.detach(), 1 if gens is None else len(gens)))
        return out

    monkeypatch.setattr(stream, "stream_dropout", recording)
    monkeypatch.setattr(gpt_model, "stream_dropout", recording)
    return calls


def expected_masks(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """The rule by hand: one generator, one uniform draw per site in forward order, kept
    where the draw is >= p."""
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(shape, generator=g, dtype=torch.float32) >= P for shape in shapes]


def forward_order_shapes(n_layer: int = 2, heads: int = 2, width: int = 16):
    """A worker's dropout sites in forward order: the embedding, then per block the attention
    probabilities, the attention output and the MLP output."""
    block = [(B, heads, T, T), (B, T, width), (B, T, width)]
    return [(B, T, width), *(block * n_layer)]


def check_masks(x: torch.Tensor, out: torch.Tensor, keep: torch.Tensor) -> None:
    # where the input is exactly 0 (attention to future positions) the mask cannot be read off
    known = x != 0
    assert known.float().mean() > 0.4
    assert torch.equal((out != 0)[known], keep.reshape(x.shape)[known])


def test_loop_and_stacked_rows_draw_each_workers_masks_in_forward_order(monkeypatch, one_thread):
    """Each worker's masks are its own generator's uniforms, site by site in forward order —
    in the loop (one generator per forward) and in the stacked forward (row i's part of every
    site from generator i) — and the stacked gradients are the loop's (TOL64: the stacked
    kernels round a few float64 ulps otherwise, `tests/test_stacked.py`)."""
    from helpers import TOL64

    model = small()
    assert unsupported(model) is None
    x, y = tokens()
    loop, stacked = (Replicas(model, ROWS, torch.device("cpu")) for _ in range(2))
    noise = (
        torch.randn(
            loop.params.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64
        )
        * 1e-2
    )
    with torch.no_grad():
        for reps in (loop, stacked):
            reps.params.add_(noise)
    calls = recorded(monkeypatch)
    shapes = forward_order_shapes()
    for w, g in enumerate(generators()):
        start = len(calls)
        with drawing_from([g]):
            lm_loss(loop.models[w](x[w]), y[w]).backward()
        sites = calls[start:]
        assert [tuple(c[0].shape) for c in sites] == shapes
        for (xi, out, count), keep in zip(sites, expected_masks(100 + w, shapes), strict=True):
            assert count == 1
            check_masks(xi, out, keep)
    start = len(calls)
    with drawing_from(generators()):
        StackedWorkers(stacked, lm_loss).run(list(range(ROWS)), x, y)
    sites = calls[start:]
    assert len(sites) == len(shapes) and all(c[2] == ROWS for c in sites)
    for w in range(ROWS):
        for (xi, out, _), keep in zip(sites, expected_masks(100 + w, shapes), strict=True):
            rows = xi.shape[0] // ROWS
            check_masks(xi[w * rows : (w + 1) * rows], out[w * rows : (w + 1) * rows], keep)
    scale = loop.grads.abs().max().item()
    assert (loop.grads - stacked.grads).abs().max().item() <= TOL64 * scale
    # ... and swapping two rows' generators moves the gradients by far more than that
    swapped = Replicas(model, ROWS, torch.device("cpu"))
    with torch.no_grad():
        swapped.params.add_(noise)
    with drawing_from(generators()[::-1]):
        StackedWorkers(swapped, lm_loss).run(list(range(ROWS)), x, y)
    assert (loop.grads - swapped.grads).abs().max().item() > 1e-3 * scale


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_mask_statistics_and_scale(p):
    """The kept fraction is within 4 binomial standard deviations of 1 − p, and each kept
    entry is x·(1/(1−p)) exactly, the scale torch's own dropout applies."""
    n = 200_000
    x = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) + 0.5
    out = stream_dropout(x, p, [torch.Generator().manual_seed(3)])
    kept = out != 0
    sd = math.sqrt(n * p * (1 - p))
    assert abs(kept.sum().item() - n * (1 - p)) <= 4 * sd
    assert torch.equal(out[kept], x[kept] * (1.0 / (1.0 - p)))
    reference = F.dropout(x, p, True)
    assert torch.equal(reference[reference != 0], x[reference != 0] * (1.0 / (1.0 - p)))
    # two rows: each row's half drawn from its own generator, as if alone
    halves = stream_dropout(x.view(2, -1), p, [torch.Generator().manual_seed(s) for s in (3, 4)])
    alone = stream_dropout(x.view(2, -1)[1], p, [torch.Generator().manual_seed(4)])
    assert torch.equal(halves[1], alone)
    assert torch.equal(halves[0], out.view(2, -1)[0])


def by_hand_global(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """nanoGPT's forward with torch's dropout (`F.dropout`, the fused attention's
    `dropout_p`) on the global generator, written out from the module's weights."""
    tr, p = model.transformer, model.transformer.drop.p
    pos = torch.arange(idx.shape[1])
    h = F.dropout(F.embedding(idx, tr.wte.weight) + F.embedding(pos, tr.wpe.weight), p, True)
    for block in tr.h:
        a = block.attn
        b_, t_, c_ = h.shape
        z = F.layer_norm(h, (c_,), block.ln_1.weight, block.ln_1.bias)
        q, k, v = F.linear(z, a.c_attn.weight, a.c_attn.bias).split(c_, dim=2)
        q, k, v = (u.view(b_, t_, a.n_head, -1).transpose(1, 2) for u in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = F.linear(y.transpose(1, 2).reshape(b_, t_, c_), a.c_proj.weight, a.c_proj.bias)
        h = h + F.dropout(y, p, True)
        m = block.mlp
        z = F.layer_norm(h, (c_,), block.ln_2.weight, block.ln_2.bias)
        z = F.linear(
            F.gelu(F.linear(z, m.c_fc.weight, m.c_fc.bias)), m.c_proj.weight, m.c_proj.bias
        )
        h = h + F.dropout(z, p, True)
    z = F.layer_norm(h, (h.shape[-1],), tr.ln_f.weight, tr.ln_f.bias)
    return F.linear(z, model.lm_head.weight)


def test_global_stream_is_torchs_dropout_on_the_global_generator():
    """`global` draws as before the option existed (nanoGPT's way): from the same global
    seed, the logits of torch's dropout and fused attention dropout written out by hand."""
    model = small(dropout_stream="global").train()
    idx = tokens()[0][0]
    torch.manual_seed(7)
    ours = model(idx)
    torch.manual_seed(7)
    theirs = by_hand_global(model, idx)
    assert torch.equal(ours, theirs)
    torch.manual_seed(8)
    assert not torch.equal(model(idx), theirs)  # it draws: another seed, other logits
    reason = unsupported(model)
    assert reason is not None and "model.dropout_stream=worker runs stacked" in reason


def test_without_dropout_both_streams_compute_the_same_forward():
    """p = 0, or evaluation: no mask is drawn, the fused attention runs, the two streams give
    the same logits bit for bit and leave torch's generator alone."""
    idx = tokens()[0][0]
    for p, train in ((0.0, True), (P, False)):
        models = []
        for name in stream.STREAMS:
            torch.manual_seed(0)
            models.append(
                GPT(VOCAB, (T,), n_layer=2, n_head=2, n_embd=16, dropout=p, dropout_stream=name)
                .double()
                .train(train)
            )
        state = torch.get_rng_state()
        assert torch.equal(models[0](idx), models[1](idx))
        assert torch.equal(torch.get_rng_state(), state)
    none = GPT(VOCAB, (T,), n_layer=1, n_head=2, n_embd=16, dropout=0.0)
    assert not stream.draws_worker_stream(none)
    assert stream.draws_worker_stream(small())
    assert not stream.draws_worker_stream(small(dropout_stream="global"))


def test_the_worker_stream_without_installed_generators_draws_from_torchs():
    """A model used outside a run's compute draws its masks from torch's global generator by
    the same rule (the same seed, the same logits)."""
    model = small().train()
    idx = tokens()[0][0]
    torch.manual_seed(5)
    first = model(idx)
    torch.manual_seed(5)
    assert torch.equal(model(idx), first)
    with drawing_from([torch.Generator().manual_seed(5)]):
        assert torch.equal(model(idx), first)  # the global generator seeded 5 draws the same


def test_dropout_seeds_differ_by_worker_and_batch_and_from_augmentation():
    seeds = {dropout_seed(0, w, n) for w in range(8) for n in range(64)}
    assert len(seeds) == 8 * 64
    assert not seeds & {worker_seed(0, w) for w in range(-1, 8)}
    assert dropout_seed(1, 0, 0) != dropout_seed(0, 0, 0)
