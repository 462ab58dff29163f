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
# The reducer's aggregate against the same sums written here in another order (issue 33,
# class b): in float64, where the reordering is ~1e-16 per step, to 1e-9 after tens of steps;
# a fixed float32 tolerance would be a CPU-dependent rounding budget.
F64, TOL64 = torch.float64, 1e-9


pytestmark = pytest.mark.usefixtures("one_thread")


def ulp(x: torch.Tensor) -> torch.Tensor:
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, math.inf)) - x


def single(compressor, numel: int = 2000, **ef) -> CompressedReducer:
    """A reducer of one worker (K = 1) over one chunk of `numel` entries with memory `ef`."""
    memory = ErrorFeedback(**ef)
    return CompressedReducer(compressor, SimulatedCommunicator(1, NET), [(0, (numel,))], memory)


def ef_step(reducer: CompressedReducer, g: torch.Tensor, step: int) -> torch.Tensor:
    """One aggregate of the single worker: the output is D(C(p))."""
    out = g.unsqueeze(0).clone()
    reducer.reduce(out, step)
    return out[0]


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
    ef = single(make(), mode="ef14")
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        g = torch.randn(2000, generator=gen)
        e_old = ef.memory.memory[0].clone()
        p = g + e_old
        decoded = ef_step(ef, g, step)
        e_new = ef.memory.memory[0]
        recovered = decoded + e_new
        if bitwise:
            assert torch.equal(recovered, p)
        else:
            bound = ulp(torch.maximum(torch.maximum(p.abs(), decoded.abs()), e_new.abs()))
            assert torch.all((recovered - p).abs() <= bound)


def test_ef14_transmits_everything_eventually():
    """Σ_t aggregate_t + mean_w e_w = Σ_t mean_w g_w (the memory holds what is not yet sent);
    float64 (F64)."""
    k, d, steps = 3, 500, 30
    comm = SimulatedCommunicator(k, NET)
    reducer = CompressedReducer(
        TopK(ratio=0.02, seed=1), comm, [(0, (d,))], ErrorFeedback(), dtype=F64
    )
    gen = torch.Generator().manual_seed(1)
    sent, true = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    for step in range(steps):
        g = torch.randn(k, d, generator=gen, dtype=F64)
        true += g.double().mean(0)
        reducer.reduce(g, step)
        sent += g[0].double()
    memory = reducer.memory.memory  # [K, d]: each worker's e_w
    assert memory.dtype == F64
    assert torch.allclose(sent + memory.mean(0), true, atol=TOL64, rtol=0)


def test_ef21_estimate_is_mean_of_worker_states_and_converges():
    """Float64 (F64): the estimate is kept as a running sum, the states' mean recomputed."""
    k, d = 4, 300
    comm = SimulatedCommunicator(k, NET)
    memory = ErrorFeedback(mode="ef21")
    reducer = CompressedReducer(TopK(ratio=0.1, seed=2), comm, [(0, (d,))], memory, dtype=F64)
    fixed = torch.randn(k, d, generator=torch.Generator().manual_seed(3), dtype=F64)
    for step in range(120):
        g = fixed.clone()
        reducer.reduce(g, step)
        states = memory.memory  # [K, d]: h_w
        assert torch.allclose(g[0], states.mean(0), atol=TOL64, rtol=0)
    # h_w ← h_w + top_k(g_w − h_w) contracts to g_w: the estimate converges to the mean (a
    # convergence tolerance, not a rounding one)
    assert torch.allclose(g[0], fixed.mean(0), atol=1e-5)


def test_dgc_momentum_correction_with_identity_is_heavy_ball():
    k, d, m = 2, 50, 0.9
    comm = SimulatedCommunicator(k, NET)
    memory = ErrorFeedback(mode="ef14", momentum=m)
    reducer = CompressedReducer(Identity(), comm, [(0, (d,))], memory, dtype=F64)
    gen = torch.Generator().manual_seed(4)
    buf = torch.zeros(d, dtype=F64)
    for step in range(10):
        g = torch.randn(k, d, generator=gen, dtype=F64)
        buf = m * buf + g.mean(0)
        reducer.reduce(g, step)
        assert torch.allclose(g[0], buf, atol=TOL64, rtol=0)  # float64 (F64)


def test_dgc_momentum_masking_clears_sent_coordinates():
    ef = single(TopK(ratio=0.05), mode="ef14", momentum=0.9, momentum_masking=True)
    g = torch.randn(2000)
    decoded = ef_step(ef, g, 0)
    velocity = ef.memory.velocity[0]
    sent = decoded != 0
    assert sent.sum() == 100
    assert torch.all(velocity[sent] == 0) and torch.equal(velocity[~sent], g[~sent])
    assert torch.all(ef.memory.memory[0][sent] == 0)


def test_warm_up_is_dense_and_leaves_memory_untouched():
    k, d = 2, 400
    comm = SimulatedCommunicator(k, NET)
    memory = ErrorFeedback(start_after_steps=3)
    reducer = CompressedReducer(TopK(ratio=0.01), comm, [(0, (d,))], memory)
    for step in range(4):
        g = torch.randn(k, d)
        mean = g.sum(0) / k
        before = comm.ledger.bytes_sent
        reducer.reduce(g, step)
        if step < 3:
            assert torch.equal(g[0], mean) and comm.ledger.bytes_sent - before == 4 * d
            assert not memory.memory.any()  # untouched: still all zeros
        else:
            assert comm.ledger.bytes_sent - before == 8 * 4
            assert int((g[0] != 0).sum()) <= 8


def test_none_mode_with_momentum_is_local_momentum_before_compression():
    from dpresearch.compress import MajorityVote

    ef = single(MajorityVote(), 3, mode="none", momentum=0.5)
    g1, g2 = torch.tensor([1.0, -1.0, 0.1]), torch.tensor([-0.4, 0.1, -0.3])
    ef_step(ef, g1, 0)
    out = ef_step(ef, g2, 1)
    assert out.tolist() == [1.0, -1.0, -1.0]  # sign(0.5·g1 + g2) = sign([0.1, -0.4, -0.25])


def test_memory_is_kept_per_chunk_when_buckets_are_regrouped():
    """The memory is addressed by the model's flat columns, not by buckets: when DDP regroups
    its buckets (the DDP hook passes a bucket's columns as an index), each parameter's entries
    carry over."""
    ef = single(TopK(ratio=0.2), 15)
    ef_step(ef, torch.randn(15), 0)
    memory = ef.memory.memory.clone()
    zero = torch.zeros(1, 5)
    # The same tensors now arrive one per bucket: b alone, then a alone.
    b_alone = torch.arange(10, 15)
    p = ef.memory.compensate(zero, 1, cols=b_alone)
    assert torch.equal(p, memory[:, 10:])
    ef.memory.update(p, zero, cols=b_alone)
    a_alone = torch.arange(0, 10)
    p = ef.memory.compensate(torch.zeros(1, 10), 1, cols=a_alone)
    assert torch.equal(p, memory[:, :10])
    ef.memory.update(p, torch.zeros(1, 10), cols=a_alone)
    assert torch.equal(ef.memory.memory, memory)


def test_state_dict_resumes_exactly():
    k, layout = 2, [(0, (20, 10)), (200, (20,))]
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(k, 220, generator=gen) for _ in range(6)]

    def make():
        compressor = PowerSGD(rank=2, min_compression_rate=1.0)
        return CompressedReducer(compressor, SimulatedCommunicator(k, NET), layout, ErrorFeedback())

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
    memory = ErrorFeedback(mode="ef21", start_after_steps=2)
    reducer = CompressedReducer(TopK(ratio=0.05), comm, [(0, (d,))], memory, dtype=F64)
    fixed = torch.randn(k, d, generator=torch.Generator().manual_seed(6), dtype=F64)
    for step in range(4):
        g = fixed.clone()
        reducer.reduce(g, step)
        # dense steps set h_w = g_w; afterwards C(g_w − h_w) = 0 keeps the estimate exact
        # (float64, F64: the reducer's mean and torch's add in other orders)
        assert torch.allclose(g[0], fixed.mean(0), atol=TOL64, rtol=0)
