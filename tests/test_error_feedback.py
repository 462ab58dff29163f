"""Error feedback: EF14's invariant, EF21's estimate, DGC momentum correction, warm-up, state."""

from __future__ import annotations

import math

import pytest
import torch

from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.compress import (
    FP16,
    QSGD,
    Chunk,
    CompressedReducer,
    ErrorFeedback,
    Identity,
    PowerSGD,
    RandomK,
    ScaledSign,
    TernGrad,
    TopK,
)

NET = NetworkModel.preset("10gbe")
CHUNK = Chunk("x", 0, 2000)


pytestmark = pytest.mark.usefixtures("one_thread")


def ulp(x: torch.Tensor) -> torch.Tensor:
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, math.inf)) - x


def ef_step(ef: ErrorFeedback, g: torch.Tensor, step: int) -> torch.Tensor:
    """One aggregate of a single worker (K = 1): the output is D(C(p))."""
    out = torch.empty_like(g)
    ErrorFeedback.aggregate([ef], [g], [CHUNK], SimulatedCommunicator(1, NET), step, out)
    return out


INVARIANT = {
    "identity": (lambda: Identity(), True),
    "topk": (lambda: TopK(ratio=0.05), True),
    "randomk": (lambda: RandomK(ratio=0.05), True),
    "fp16": (lambda: FP16(), False),
    "qsgd": (lambda: QSGD(levels=3, bucket_size=128), False),
    "sign": (lambda: ScaledSign(), False),
    "terngrad": (lambda: TernGrad(), False),
}


@pytest.mark.parametrize("name", sorted(INVARIANT))
def test_ef14_invariant_g_plus_e_old_equals_decoded_plus_e_new(name):
    """g + e_old = D(C(p)) + e_new. p = fl(g + e_old) is what the code forms; e_new = fl(p − D)
    rounds once, so fl(D + e_new) recovers p within 1 ulp of the largest operand — and bitwise
    where D is p or 0 entrywise (sparsifiers, identity), since then p − D is exact."""
    make, bitwise = INVARIANT[name]
    ef = ErrorFeedback(make(), mode="ef14")
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        g = torch.randn(2000, generator=gen)
        e_old = ef.memory.get([CHUNK], g).clone()
        p = g + e_old
        decoded = ef_step(ef, g, step)
        e_new = ef.memory.get([CHUNK], g)
        recovered = decoded + e_new
        if bitwise:
            assert torch.equal(recovered, p)
        else:
            bound = ulp(torch.maximum(torch.maximum(p.abs(), decoded.abs()), e_new.abs()))
            assert torch.all((recovered - p).abs() <= bound)


def test_ef14_transmits_everything_eventually():
    """Σ_t aggregate_t + mean_w e_w = Σ_t mean_w g_w (the memory holds what is not yet sent)."""
    k, d, steps = 3, 500, 30
    comm = SimulatedCommunicator(k, NET)
    workers = [ErrorFeedback(TopK(ratio=0.02, seed=1, worker=w)) for w in range(k)]
    reducer = CompressedReducer(workers, comm, [(0, (d,))])
    gen = torch.Generator().manual_seed(1)
    sent, true = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    for step in range(steps):
        g = torch.randn(k, d, generator=gen)
        true += g.double().mean(0)
        reducer.reduce(g, step)
        sent += g[0].double()
    memory = torch.stack([w.memory.get(reducer.buckets[0].chunks, g[0]) for w in workers])
    assert torch.allclose(sent + memory.double().mean(0), true, atol=1e-4)


def test_ef21_estimate_is_mean_of_worker_states_and_converges():
    k, d = 4, 300
    comm = SimulatedCommunicator(k, NET)
    workers = [ErrorFeedback(TopK(ratio=0.1, seed=2, worker=w), mode="ef21") for w in range(k)]
    reducer = CompressedReducer(workers, comm, [(0, (d,))])
    fixed = torch.randn(k, d, generator=torch.Generator().manual_seed(3))
    chunks = reducer.buckets[0].chunks
    for step in range(120):
        g = fixed.clone()
        reducer.reduce(g, step)
        states = torch.stack([w.memory.get(chunks, g[0]) for w in workers])
        assert torch.allclose(g[0], states.mean(0), atol=1e-5)
    # h_w ← h_w + top_k(g_w − h_w) contracts to g_w: the estimate converges to the mean.
    assert torch.allclose(g[0], fixed.mean(0), atol=1e-5)


def test_dgc_momentum_correction_with_identity_is_heavy_ball():
    k, d, m = 2, 50, 0.9
    comm = SimulatedCommunicator(k, NET)
    workers = [ErrorFeedback(Identity(), mode="ef14", momentum=m) for _ in range(k)]
    reducer = CompressedReducer(workers, comm, [(0, (d,))])
    gen = torch.Generator().manual_seed(4)
    buf = torch.zeros(d)
    for step in range(10):
        g = torch.randn(k, d, generator=gen)
        buf = m * buf + g.mean(0)
        reducer.reduce(g, step)
        assert torch.allclose(g[0], buf, atol=1e-5)


def test_dgc_momentum_masking_clears_sent_coordinates():
    ef = ErrorFeedback(TopK(ratio=0.05), mode="ef14", momentum=0.9, momentum_masking=True)
    g = torch.randn(2000)
    decoded = ef_step(ef, g, 0)
    velocity = ef.velocity.get([CHUNK], g)
    sent = decoded != 0
    assert sent.sum() == 100
    assert torch.all(velocity[sent] == 0) and torch.equal(velocity[~sent], g[~sent])
    assert torch.all(ef.memory.get([CHUNK], g)[sent] == 0)


def test_warm_up_is_dense_and_leaves_memory_untouched():
    k, d = 2, 400
    comm = SimulatedCommunicator(k, NET)
    workers = [ErrorFeedback(TopK(ratio=0.01), start_after_steps=3) for _ in range(k)]
    reducer = CompressedReducer(workers, comm, [(0, (d,))])
    for step in range(4):
        g = torch.randn(k, d)
        mean = g.sum(0) / k
        before = comm.ledger.bytes_sent
        reducer.reduce(g, step)
        if step < 3:
            assert torch.equal(g[0], mean) and comm.ledger.bytes_sent - before == 4 * d
            assert workers[0].memory.state_dict() == {}
        else:
            assert comm.ledger.bytes_sent - before == 8 * 4
            assert int((g[0] != 0).sum()) <= 8


def test_none_mode_with_momentum_is_local_momentum_before_compression():
    from dpresearch.compress import MajorityVote

    ef = ErrorFeedback(MajorityVote(), mode="none", momentum=0.5)
    g1, g2 = torch.tensor([1.0, -1.0, 0.1]), torch.tensor([-0.4, 0.1, -0.3])
    chunk = Chunk("x", 0, 3)
    out = torch.empty(3)
    comm = SimulatedCommunicator(1, NET)
    ErrorFeedback.aggregate([ef], [g1], [chunk], comm, 0, out)
    ErrorFeedback.aggregate([ef], [g2], [chunk], comm, 1, out)
    assert out.tolist() == [1.0, -1.0, -1.0]  # sign(0.5·g1 + g2) = sign([0.1, -0.4, -0.25])


def test_memory_is_kept_per_chunk_when_buckets_are_regrouped():
    a, b = Chunk("a", 0, 10), Chunk("b", 10, 5)
    ef = ErrorFeedback(TopK(ratio=0.2))
    comm = SimulatedCommunicator(1, NET)
    g = torch.randn(15)
    ErrorFeedback.aggregate([ef], [g], [a, b], comm, 0, torch.empty(15))
    memory = ef.memory.get([a, b], g).clone()
    # DDP rebuilds its buckets: the same tensors now arrive one per bucket.
    b_alone = Chunk("b", 0, 5)
    assert torch.equal(ef.memory.get([b_alone], g[10:]), memory[10:])
    assert torch.equal(ef.memory.get([Chunk("a", 0, 10)], g[:10]), memory[:10])


def test_state_dict_resumes_exactly():
    k, layout = 2, [(0, (20, 10)), (200, (20,))]
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(k, 220, generator=gen) for _ in range(6)]

    def make():
        comps = [ErrorFeedback(PowerSGD(rank=2, min_compression_rate=1.0)) for _ in range(k)]
        return CompressedReducer(comps, SimulatedCommunicator(k, NET), layout)

    full, first = make(), make()
    outs = []
    for step, g in enumerate(grads):
        g = g.clone()
        full.reduce(g, step)
        outs.append(g)
    for step, g in enumerate(grads[:3]):
        first.reduce(g.clone(), step)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    for step, g in enumerate(grads[3:], start=3):
        g = g.clone()
        resumed.reduce(g, step)
        assert torch.equal(g, outs[step])


def test_ef21_warm_up_initialises_the_estimate_with_full_gradients():
    k, d = 3, 200
    comm = SimulatedCommunicator(k, NET)
    workers = [ErrorFeedback(TopK(ratio=0.05), mode="ef21", start_after_steps=2) for _ in range(k)]
    reducer = CompressedReducer(workers, comm, [(0, (d,))])
    fixed = torch.randn(k, d, generator=torch.Generator().manual_seed(6))
    for step in range(4):
        g = fixed.clone()
        reducer.reduce(g, step)
        # dense steps set h_w = g_w; afterwards C(g_w − h_w) = 0 keeps the estimate exact
        assert torch.allclose(g[0], fixed.mean(0), atol=1e-6)
