"""Conventions as options (issue 32, item 4; docs/CONVENTIONS.md): where a paper or its
anchor's reference code differs from our default, theirs is a named option, and each option is
checked here against the anchor's rule written out in the test (float64), not against our code.

- SlowMo's inner optimizer state at an outer step (`outer.inner_state`: keep | reset | average)
  against SlowMo's Algorithm 1 over Nesterov-SGD workers, written by hand for a linear model;
- FetchSGD's error sketch after a step (`compressor.sketch_update`: subtract | zero) against
  the paper's and the authors' rule, the count sketch as an explicit matrix;
- the byte ledger of natural compression (`compressor.bits_per_value`: 9 | 8) and of threshold
  sparsification (`compressor.index_bytes`: 4 | 8), counted by hand;
- 1-bit SGD's negative group (`compressor.sign_rule`: signbit | less_than) on −0.0 entries.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import SYNTHETIC_SMALL, run_main
from torch import nn

from dpresearch.algorithms.local_sgd import LocalSGD
from dpresearch.algorithms.outer import OuterOptimizer
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.compress import Chunk, Natural, OneBit, Sketch, Threshold, check_pairing
from dpresearch.compress.sketch import CountSketch
from dpresearch.replicas import Replicas

F64 = torch.float64
NET = NetworkModel.preset("10gbe")

pytestmark = pytest.mark.usefixtures("one_thread")


# -- SlowMo: the inner optimizers' momentum at an outer step ---------------------------------------
K, H, ROUNDS = 2, 2, 2  # workers, inner steps per outer step, outer steps
GAMMA, MU = 0.1, 0.9  # inner Nesterov SGD
ALPHA, BETA = 1.0, 0.5  # SlowMo's slow lr and slow momentum
N_IN = 3


def batch(w: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker w's data at step t: 4 samples of a 3-input regression."""
    g = torch.Generator().manual_seed(100 * w + t)
    return torch.randn(4, N_IN, generator=g, dtype=F64), torch.randn(4, 1, generator=g, dtype=F64)


def slowmo_by_hand(theta0: torch.Tensor, inner_state: str) -> list[torch.Tensor]:
    """SlowMo (Wang et al. 2020, Algorithm 1) over K workers of Nesterov SGD on the loss
    ½·mean‖Xw + b − y‖², the linear model's parameters θ = (w, b) as one vector; at every outer
    step the workers' momentum buffers are kept, set to 0 ("reset", the paper's CIFAR-10 /
    ImageNet choice) or replaced by their mean ("average"). Returns the workers' parameters
    `[K, 4]` after each outer step."""
    theta, u = theta0.clone(), torch.zeros_like(theta0)
    x = [theta.clone() for _ in range(K)]
    m = [torch.zeros_like(theta) for _ in range(K)]
    after = []
    for t in range(H * ROUNDS):
        for w in range(K):
            a, y = batch(w, t)
            design = torch.cat([a, torch.ones(a.shape[0], 1, dtype=F64)], dim=1)  # [n, 4]
            grad = design.T @ (design @ x[w] - y[:, 0]) / a.shape[0]
            m[w] = MU * m[w] + grad
            x[w] = x[w] - GAMMA * (grad + MU * m[w])  # Nesterov
        if (t + 1) % H == 0:
            mean = sum(x) / K
            u = BETA * u + (theta - mean) / GAMMA
            theta = theta - ALPHA * GAMMA * u
            x = [theta.clone() for _ in range(K)]
            if inner_state == "reset":
                m = [torch.zeros_like(theta) for _ in range(K)]
            elif inner_state == "average":
                m = [sum(m) / K for _ in range(K)]
            after.append(torch.stack(x))
    return after


def momentum_rows(optimizers: list[torch.optim.Optimizer]) -> torch.Tensor:
    """Every worker's momentum buffer as one row (a parameter without state: zeros, which is
    what torch's SGD steps from: its first buffer is the gradient, β·0 + g)."""
    rows = []
    for opt in optimizers:
        parts = []
        for p in opt.param_groups[0]["params"]:
            buf = opt.state.get(p, {}).get("momentum_buffer")
            parts.append((torch.zeros_like(p) if buf is None else buf).reshape(-1))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


@pytest.mark.parametrize("inner_state", ["keep", "reset", "average"])
def test_slowmo_inner_state_is_the_papers_rule_over_two_outer_rounds(inner_state):
    torch.manual_seed(0)
    model = nn.Linear(N_IN, 1).to(F64)
    theta0 = torch.cat([model.weight.detach().reshape(-1), model.bias.detach()])
    replicas = Replicas(model, K, torch.device("cpu"))
    comm = SimulatedCommunicator(K, NET)
    optimizers = [
        torch.optim.SGD(m.parameters(), lr=GAMMA, momentum=MU, nesterov=True)
        for m in replicas.models
    ]
    base = LocalSGD(replicas, comm, optimizers, period=H)
    outer = OuterOptimizer(
        replicas,
        comm,
        optimizers,
        base,
        optimizer={"_target_": "torch.optim.SGD", "lr": ALPHA, "momentum": BETA},
        scale_by_inner_lr=True,
        inner_state=inner_state,
    )
    expected = slowmo_by_hand(theta0, inner_state)
    for t in range(H * ROUNDS):
        replicas.zero_grad()
        for w, m in enumerate(replicas.models):
            a, y = batch(w, t)
            (0.5 * ((m(a) - y) ** 2).sum(1).mean()).backward()
        outer.after_backward(t)
        if (t + 1) % H == 0:
            r = (t + 1) // H - 1
            assert (replicas.params - expected[r]).abs().max() <= 1e-12, (inner_state, r)
            buffers = momentum_rows(optimizers)
            if inner_state == "reset":
                assert torch.equal(buffers, torch.zeros_like(buffers))
            else:
                assert buffers.abs().max() > 0
            if inner_state == "average":
                assert torch.equal(buffers[0], buffers[1])
    assert outer.merges == ROUNDS


# -- FetchSGD: what leaves the error sketch --------------------------------------------------------
D_SKETCH, ROWS, RATIO, WIDTH, RHO = 60, 3, 0.1, 10.0, 0.9


def sketch_matrix(table: CountSketch) -> torch.Tensor:
    """The count sketch as the linear map it is: A `[rows·columns, d]`, A[cell_j(i), i] = s_j(i)
    — S(x) = A·x (the hash and sign tables are the run's random draw, read from `table`)."""
    a = torch.zeros(table.size, table.numel, dtype=F64)
    for j in range(table.rows):
        for i in range(table.numel):
            a[int(table.cells[j, i]), i] += float(table.signs[j, i])
    return a


def fetchsgd_by_hand(xs: list[torch.Tensor], table: CountSketch, k: int, rule: str) -> list:
    """FetchSGD's aggregator (Rothchild et al. 2020, Algorithm 1) on K workers' vectors per step,
    the sketch S = A·x: S_u ← ρ·S_u + mean_w A·x_w; S_e ← S_e + S_u; Δ = the k largest
    |estimates| of S_e (estimate i: the median over rows j of s_j(i)·S_e[cell_j(i)]);
    "subtract" (the paper): S_e ← S_e − A·Δ; "zero" (the authors' code): S_e and S_u ← 0 where
    A·Δ ≠ 0. Returns Δ of every step."""
    a = sketch_matrix(table)
    s_u = torch.zeros(table.size, dtype=F64)
    s_e = torch.zeros(table.size, dtype=F64)
    deltas = []
    for x in xs:
        s_u = RHO * s_u + (a @ x.T).mean(1)
        s_e = s_e + s_u
        estimates = torch.empty(table.numel, dtype=F64)
        for i in range(table.numel):
            looked = sorted(
                float(table.signs[j, i]) * float(s_e[int(table.cells[j, i])])
                for j in range(table.rows)
            )
            estimates[i] = looked[len(looked) // 2]  # an odd number of rows: the middle one
        order = sorted(range(table.numel), key=lambda i: -abs(float(estimates[i])))
        top = order[:k]
        # no tie at the k-th place (entries sharing all their cells tie; top-k's choice among
        # them is no convention of either rule): the data below is chosen so
        assert abs(estimates[order[k - 1]]) - abs(estimates[order[k]]) > 1e-9
        delta = torch.zeros(table.numel, dtype=F64)
        delta[top] = estimates[top]
        sketched = a @ delta
        if rule == "subtract":
            s_e = s_e - sketched
        else:
            s_e[sketched != 0] = 0.0
            s_u[sketched != 0] = 0.0
        deltas.append(delta)
    return deltas


@pytest.mark.parametrize("rule", ["subtract", "zero"])
def test_fetchsgd_sketch_update_is_the_papers_or_the_authors_rule(rule):
    c = Sketch(ratio=RATIO, rows=ROWS, width=WIDTH, momentum=RHO, seed=5, sketch_update=rule)
    chunk = Chunk("model", 0, D_SKETCH, None)
    aggregation = c.aggregation([chunk], range(K), F64, "cpu")
    comm = SimulatedCommunicator(K, NET)
    g = torch.Generator().manual_seed(9)  # no tie at the k-th place (see above)
    xs = [torch.randn(K, D_SKETCH, generator=g, dtype=F64) for _ in range(4)]
    k = round(RATIO * D_SKETCH)
    table = CountSketch(D_SKETCH, ROWS, c.columns(D_SKETCH), 5, "model", F64)
    expected = fetchsgd_by_hand(xs, table, k, rule)
    for step, (x, want) in enumerate(zip(xs, expected, strict=True)):
        out = torch.empty(D_SKETCH, dtype=F64)
        aggregation.run(x, comm, step, out)
        assert torch.equal(out != 0, want != 0), (rule, step)  # the same k entries
        assert (out - want).abs().max() <= 1e-12, (rule, step)
    assert int((out != 0).sum()) == k


def test_the_two_fetchsgd_rules_differ():
    """The option is not a no-op: after a few steps the recovered updates part ways."""
    g = torch.Generator().manual_seed(9)  # no tie at the k-th place (see above)
    xs = [torch.randn(K, D_SKETCH, generator=g, dtype=F64) for _ in range(4)]
    outs = {}
    for rule in ("subtract", "zero"):
        c = Sketch(ratio=RATIO, rows=ROWS, width=WIDTH, momentum=RHO, seed=5, sketch_update=rule)
        aggregation = c.aggregation([Chunk("model", 0, D_SKETCH, None)], range(K), F64, "cpu")
        comm, out = SimulatedCommunicator(K, NET), torch.empty(D_SKETCH, dtype=F64)
        for step, x in enumerate(xs):
            aggregation.run(x, comm, step, out)
        outs[rule] = out.clone()
    assert not torch.equal(outs["subtract"], outs["zero"])


# -- the byte ledger: natural compression and threshold sparsification -----------------------------
SIZES = [37, 8, 100]  # chunk sizes: one not a multiple of 8
CHUNKS = [Chunk(f"c{i}", sum(SIZES[:i]), n, (n,)) for i, n in enumerate(SIZES)]


def run_once(compressor, x: torch.Tensor) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """(aggregate, bytes each worker was charged, sent rows) of one synchronous round."""
    comm = SimulatedCommunicator(K, NET)
    aggregation = compressor.aggregation(CHUNKS, range(K), torch.float32, "cpu")
    out, sent = torch.empty(x.shape[1]), torch.empty_like(x)
    aggregation.run(x, comm, 3, out, sent)
    return out, list(comm.ledger.bytes_by_worker), sent


def test_natural_bits_per_value_counts_9_or_8_bits_and_sends_the_same_values():
    x = torch.randn(K, sum(SIZES), generator=torch.Generator().manual_seed(1))
    out9, bytes9, sent9 = run_once(Natural(seed=2), x)
    out8, bytes8, sent8 = run_once(Natural(seed=2, bits_per_value=8), x)
    # the paper: a sign bit and an 8-bit exponent per value, signs packed per chunk
    assert bytes9 == [sum(n + math.ceil(n / 8) for n in SIZES)] * K
    # GRACE: one int8 per value
    assert bytes8 == [sum(SIZES)] * K
    assert Natural(bits_per_value=8).payload_bytes(800) == 800
    assert Natural().payload_bytes(800) == 900
    assert torch.equal(out8, out9) and torch.equal(sent8, sent9)  # only the ledger differs


def test_natural_at_8_bits_refuses_gossip_and_pushes_in_one_line():
    with pytest.raises(ValueError, match="set compressor.bits_per_value=9"):
        check_pairing(Natural(bits_per_value=8), None, use="gossip")
    with pytest.raises(ValueError, match="set compressor.bits_per_value=9"):
        check_pairing(Natural(bits_per_value=8), None, use="push")
    check_pairing(Natural(bits_per_value=8), None, use="sync")


def test_threshold_index_bytes_counts_int32_or_int64_indices_and_sends_the_same_values():
    v = 1.0
    x = torch.randn(K, sum(SIZES), generator=torch.Generator().manual_seed(4))
    kept = int((x.abs() >= v).sum(1).max())  # the padded row: the largest count
    assert kept > 0
    out4, bytes4, sent4 = run_once(Threshold(threshold=v), x)
    out8, bytes8, sent8 = run_once(Threshold(threshold=v, index_bytes=8), x)
    # one bucket: an int32 count, then (fp32 value, index) pairs padded to the largest count
    assert bytes4 == [4 + (4 + 4) * kept] * K
    assert bytes8 == [4 + (4 + 8) * kept] * K
    assert torch.equal(out4, out8) and torch.equal(sent4, sent8)
    expected = torch.where(x.abs() >= v, x, torch.zeros(())).double().mean(0)
    assert (out8.double() - expected).abs().max() <= 1e-6
    assert Threshold(index_bytes=8).payload_bytes(10) == 124


# -- 1-bit SGD: where −0.0 goes --------------------------------------------------------------------
def onebit_by_hand(x: torch.Tensor, rule: str) -> torch.Tensor:
    """1-bit SGD with one segment per row (GRACE's per-tensor form): entries split into
    "negative" and the others — by the sign bit (−0.0 negative) or by x < 0 (GRACE's
    `tensor < 0`; CNTK's `u >= 0` for the upper bit) — each decoded to its group's mean (0 for
    an empty group), in float64."""
    out = torch.empty(x.shape, dtype=F64)
    for r, row in enumerate(x.tolist()):
        neg = [math.copysign(1.0, v) < 0 if rule == "signbit" else v < 0 for v in row]
        low = [v for v, n in zip(row, neg, strict=True) if n]
        high = [v for v, n in zip(row, neg, strict=True) if not n]
        mean0 = sum(low) / len(low) if low else 0.0
        mean1 = sum(high) / len(high) if high else 0.0
        out[r] = torch.tensor([mean0 if n else mean1 for n in neg], dtype=F64)
    return out


@pytest.mark.parametrize("rule", ["signbit", "less_than"])
def test_onebit_sign_rule_puts_negative_zero_where_the_rule_says(rule):
    x = torch.tensor(
        [[-0.0, 1.0, -2.0, 0.0, 3.0, -0.0, -1.0, 2.0], [-0.0, -0.0, -0.0, 4.0, 0.5, 1.5, -3.0, 0.0]]
    )
    c = OneBit(sign_rule=rule)
    chunk = [Chunk("t", 0, 8, (8,))]
    codec = c.codec(chunk, torch.float32, "cpu", (0, 1))
    out = torch.empty_like(x)
    codec.decode(codec.encode(x, 0), 0, out)
    want = onebit_by_hand(x, rule)
    assert (out.double() - want).abs().max() <= 1e-6, (out, want)
    assert codec.wire_bytes == 1 + 8  # one packed byte of signs, two fp32 means either way


def test_the_two_onebit_rules_differ_only_on_negative_zero():
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))

    def both() -> list[torch.Tensor]:
        outs = []
        for rule in ("signbit", "less_than"):
            c = OneBit(sign_rule=rule)
            codec = c.codec([Chunk("t", 0, 8, (8,))], torch.float32, "cpu", (0, 1))
            out = torch.empty_like(x)
            codec.decode(codec.encode(x, 0), 0, out)
            outs.append(out)
        return outs

    same = both()
    assert torch.equal(same[0], same[1])
    x[0, 0] = -0.0
    differ = both()
    assert not torch.equal(differ[0], differ[1])
    assert torch.equal(differ[0][1], differ[1][1])  # the row without −0.0 is the same


# -- a bad value: one line naming the choices, before any worker starts ----------------------------
BAD = [
    (["compressor=sketch", "compressor.sketch_update=add"],
     "compressor.sketch_update=add; choose one of: subtract, zero"),
    (["compressor=natural", "compressor.bits_per_value=7"],
     "compressor.bits_per_value=7; choose one of: 9"),
    (["compressor=threshold", "compressor.index_bytes=2"],
     "compressor.index_bytes=2; choose one of: 4"),
    (["compressor=onebit", "compressor.sign_rule=zero"],
     "compressor.sign_rule=zero; choose one of: signbit, less_than"),
    (["algorithm=local_sgd", "outer=slowmo", "outer.inner_state=zero"],
     "outer.inner_state=zero; choose one of: keep, reset, average"),
]  # fmt: skip


@pytest.mark.parametrize("args,fragment", BAD, ids=[a[-1] for a, _ in BAD])
def test_a_bad_convention_option_is_one_line(args, fragment, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    code, out, err = run_main(
        [*SYNTHETIC_SMALL, *args, f"hydra.run.dir={run_dir}"], tmp_path, monkeypatch, capsys
    )
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and fragment in lines[0], err
    assert not run_dir.exists()
