"""SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706): `outer=sparseloco`, a composition of the
outer optimizer (plain SGD, lr α, no momentum), EF14 with a decay β (e ← β·e + Δ) and the
`quantized_topk` codec (chunk-wise top-k, values quantized to 2 bits).

A. The codec: each block keeps exactly its k largest |x|; the decoded values are the
   statistical quantizer's, restated here in float64; the wire bytes are a hand count, in the
   codec and in the ledger; `average=senders` is each entry's mean over its senders.
B. The whole update equals SparseLoCo's Algorithm 1 written here on plain tensors (float64),
   with either average.
C. Runs: simulated K = 2 equals 2 gloo processes (either average); killed (also kill -9) and
   resumed exactly; the GPT trains on Shakespeare.
D. decay = 1 is EF14 as it was; bad values are one `error:` line; `average=senders` (the
   reference code's per-entry mean) against a hand restatement, and refused for gossip.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import (
    SHAKESPEARE_WORKS,
    SYNTHETIC_SMALL,
    TOL64,
    compose_config,
    gap,
    gpt_shakespeare_losses,
    least_squares_shards,
    refused_before_start,
    tiny_local_sgd,
    tiny_sgd_steps,
    tiny_tanh_model,
    train_on_shards,
)
from helpers import finished_run as run

from dpresearch.algorithms.outer import OuterOptimizer
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.compress import Chunk, CompressedReducer, ErrorFeedback, TopK
from dpresearch.compress.quantized_topk import QuantizedTopK
from dpresearch.run.checkpoint_files import latest_checkpoint
from dpresearch.run.trainer import InjectedFailure

NET = NetworkModel.preset("10gbe")
SPARSELOCO = ["algorithm=local_sgd", "algorithm.period=4", "outer=sparseloco"]
# small blocks, so that the MLP's tensors have several blocks, a partial last one, k > 1
SMALL_BLOCKS = ["outer.compressor.chunk_size=64", "outer.compressor.density=0.1"]


# -- the quantizer and the selection, restated independently (plain Python floats) ---------------
def statistical_quantizer(values: list[float], bits: int, range_sigmas: float) -> list[float]:
    """SparseLoCo's 2^bits-bin quantizer of one tensor's kept values, as its reference code
    defines it: μ the mean, c = v − μ, σ = ‖c‖/√(K−1), step s = R·σ/2^bits (1 if 0), code
    q = clamp(round(c/s + 2^bits/2), 0, 2^bits − 1) (round half to even), decoded
    value = (mean of c over q's bin) + μ."""
    n, count = 2**bits, len(values)
    mu = sum(values) / count
    c = [v - mu for v in values]
    sigma = math.sqrt(sum(x * x for x in c) / (count - 1)) if count > 1 else 0.0
    s = range_sigmas * sigma / n
    if not (s > 0 and math.isfinite(s)):
        s = 1.0
    q = [min(max(round(x / s + n // 2), 0), n - 1) for x in c]
    members = {j: [x for x, b in zip(c, q, strict=True) if b == j] for j in range(n)}
    centroid = {j: sum(m) / len(m) if m else 0.0 for j, m in members.items()}
    return [centroid[b] + mu for b in q]


def kept_positions(x: list[float], chunk: int, density: float) -> list[int]:
    """Positions kept in one tensor `x`: blocks of min(chunk, len) consecutive entries, each
    keeping its max(1, round(density·length)) largest |x| (ascending position order)."""
    size, positions = min(chunk, len(x)), []
    for start in range(0, len(x), size):
        block = list(range(start, min(start + size, len(x))))
        k = min(len(block), max(1, round(density * len(block))))
        positions += sorted(sorted(block, key=lambda j: -abs(x[j]))[:k])
    return positions


def sent_positions(e: torch.Tensor, sizes: list[int], chunk: int, density: float) -> torch.Tensor:
    """1.0 where one worker's flat accumulator `e` over tensors of `sizes` sends an entry."""
    mask, offset = torch.zeros_like(e), 0
    for size in sizes:
        for j in kept_positions(e[offset : offset + size].tolist(), chunk, density):
            mask[offset + j] = 1.0
        offset += size
    return mask


def aggregate(sent: list[torch.Tensor], masks: list[torch.Tensor], average: str) -> torch.Tensor:
    """The anchor's step direction from the workers' decoded messages: their mean over all K
    (`all`, Algorithm 1) or each entry's mean over the workers that sent it (`senders`, the
    reference code's `scatter_reduce(..., "mean", include_self=False)`: 0 where none did)."""
    if average == "all":
        return sum(sent) / len(sent)
    return sum(sent) / torch.clamp(sum(masks), min=1.0)


def message(
    e: torch.Tensor,
    sizes: list[int],
    chunk: int,
    density: float,
    bits: int,
    range_sigmas: float = 6.0,
) -> torch.Tensor:
    """Q(TopK_chunk(e)) for one worker's flat accumulator `e` over tensors of `sizes`."""
    out, offset = torch.zeros_like(e), 0
    for size in sizes:
        x = e[offset : offset + size].tolist()
        kept = kept_positions(x, chunk, density)
        decoded = statistical_quantizer([x[j] for j in kept], bits, range_sigmas)
        for j, v in zip(kept, decoded, strict=True):
            out[offset + j] = v
        offset += size
    return out


# -- A: the codec -------------------------------------------------------------------------------
CHUNKS = [Chunk("t0", 0, 200, (10, 20)), Chunk("t1", 200, 64), Chunk("t2", 264, 7)]
N = 271


def coded(x: torch.Tensor, compressor: QuantizedTopK) -> torch.Tensor:
    """Every row of `x` `[R, N]` through the codec over CHUNKS, as the receivers decode it."""
    codec = compressor.codec(CHUNKS, x.dtype, "cpu", workers=tuple(range(x.shape[0])))
    out = torch.empty_like(x)
    codec.decode(codec.encode(x, step=0), 0, out)
    return out


def test_each_block_keeps_exactly_its_k_largest_magnitudes():
    """Blocks of 64: t0 (200 entries) has blocks 64, 64, 64, 8 keeping 6, 6, 6, 1 (10 %,
    round half to even, at least 1); t1 one block keeping 6; t2 (7 < 64) one block of 7
    keeping 1. The decoded row is non-zero exactly at each block's k largest |x|."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, N, dtype=torch.float64, generator=gen)
    out = coded(x, QuantizedTopK(density=0.1, chunk_size=64, bits=2))
    blocks = [(0, 64, 6), (64, 128, 6), (128, 192, 6), (192, 200, 1), (200, 264, 6), (264, 271, 1)]
    for row in range(3):
        for start, end, k in blocks:
            sent = set((out[row, start:end] != 0).nonzero().view(-1).tolist())
            top = set(x[row, start:end].abs().topk(k).indices.tolist())
            assert len(sent) == k and sent == top, (row, start)


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
def test_decoded_values_are_the_statistical_quantizers(bits):
    """Per tensor, the kept values decode to the quantizer restated above (float64, to 1e-12):
    at most 2^bits distinct values per tensor; a tensor keeping one value sends it exactly."""
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(2, N, dtype=torch.float64, generator=gen) * torch.linspace(0.1, 3, N)
    out = coded(x, QuantizedTopK(density=0.1, chunk_size=64, bits=bits, range_sigmas=6.0))
    expected = torch.stack([message(row, [200, 64, 7], 64, 0.1, bits) for row in x])
    assert gap(out, expected) <= 1e-12
    for ch in CHUNKS:
        values = out[:, ch.slice][out[:, ch.slice] != 0]
        assert 1 <= len(set(values.tolist())) <= 2**bits * 2  # two rows: two codebooks
    assert torch.equal(out[:, 264:][out[:, 264:] != 0], x[:, 264:][out[:, 264:] != 0])


# (tensor shape, chunk_size, density, bits, dtype, hand count of one worker's bytes)
BYTES = [
    # 10 000 entries in blocks 4096, 4096, 1808 keeping 64, 64, 28 (round(28.25)): K = 156;
    # indices ⌈156·12/8⌉ = 234, values ⌈156·2/8⌉ = 39, scales μ + 4 codebook entries in
    # fp32 = 20: 293
    ((100, 100), 4096, 1 / 64, 2, torch.float32, 234 + 39 + 20),
    # 1000 in blocks 256 × 3 + 232 keeping 4 × 3 + 4 (round(3.625)): K = 16; indices 8 bits:
    # 16, values ⌈16·3/8⌉ = 6, scales (1 + 8)·4 = 36: 58
    ((1000,), 256, 1 / 64, 3, torch.float32, 16 + 6 + 36),
    # the first in float64: scales 5·8 = 40
    ((100, 100), 4096, 1 / 64, 2, torch.float64, 234 + 39 + 40),
    # 3 entries, density 3 %: one block keeping 1, 2-bit indices: 1 + 1 + 20
    ((3,), 4096, 0.03, 2, torch.float32, 1 + 1 + 20),
]


@pytest.mark.parametrize("shape,chunk,density,bits,dtype,expected", BYTES)
def test_wire_bytes_are_the_hand_count(shape, chunk, density, bits, dtype, expected):
    """The documented payload, the codec's wire row and the ledger's record of one exchange
    (2 workers, allgather) all equal the hand count: indices + codes + scales."""
    compressor = QuantizedTopK(density=density, chunk_size=chunk, bits=bits)
    n = math.prod(shape)
    assert compressor.payload_bytes(n, shape, dtype) == expected
    codec = compressor.codec([Chunk("t0", 0, n, shape)], dtype, "cpu", workers=(0, 1))
    assert codec.wire_bytes == expected
    comm = SimulatedCommunicator(2, NET)
    reducer = CompressedReducer(compressor, comm, [(0, shape)], ErrorFeedback("ef14"), dtype=dtype)
    reducer.reduce(torch.randn(2, n, dtype=dtype), 0)
    assert comm.ledger.bytes_by_worker == [expected, expected]
    assert reducer.payload_bytes(dtype) == expected


def test_senders_average_is_each_entrys_mean_over_the_workers_that_sent_it():
    """One exchange of K = 5 workers (blocks of 64 at 10 %; workers 0 and 1 send the same row,
    so some entries have 2 senders or more): `average=senders` equals the per-entry mean of the
    decoded messages over the workers that sent it, restated with `kept_positions` (float64,
    to 1e-12); at every entry s of K workers sent it is K/s times `average=all`, 0 where none
    did; the ledger's bytes are the same for both."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, N, dtype=torch.float64, generator=gen)
    x[1] = x[0]
    outs, ledgers = {}, {}
    for average in ("all", "senders"):
        comm = SimulatedCommunicator(5, NET)
        compressor = QuantizedTopK(density=0.1, chunk_size=64, average=average)
        aggregation = compressor.aggregation(CHUNKS, range(5), torch.float64, "cpu")
        outs[average] = torch.empty(N, dtype=torch.float64)
        aggregation.run(x, comm, 0, outs[average])
        ledgers[average] = comm.ledger.bytes_by_worker
    sent = [message(row, [200, 64, 7], 64, 0.1, 2) for row in x]
    masks = [sent_positions(row, [200, 64, 7], 64, 0.1) for row in x]
    senders = sum(masks)
    assert gap(outs["senders"], aggregate(sent, masks, "senders")) <= 1e-12
    assert gap(outs["all"], aggregate(sent, masks, "all")) <= 1e-12
    hit = senders > 0
    assert gap(outs["senders"][hit] * senders[hit], outs["all"][hit] * 5) <= 1e-12
    assert torch.equal(outs["senders"][~hit], torch.zeros_like(outs["senders"][~hit]))
    assert int(senders.max()) >= 2 and int(senders[hit].min()) == 1  # both kinds of entry
    assert ledgers["senders"] == ledgers["all"]


# -- B: the whole update against SparseLoCo's Algorithm 1 ---------------------------------------
K, H, ROUNDS, INNER_LR = 4, 3, 5, 0.1
ALPHA, BETA, CHUNK, DENSITY = 0.8, 0.9, 64, 0.1


@pytest.mark.parametrize("average", ["all", "senders"])
def test_the_update_is_sparselocos_algorithm_1_written_apart(average, one_thread):
    """Ours (the outer optimizer over local SGD, the `outer=sparseloco` nodes with α = 0.8,
    β = 0.9, blocks of 64 at 10 %) against SparseLoCo's Algorithm 1 on plain float64 tensors:
    K = 4 workers, H = 3 inner plain-SGD steps on their own least-squares data, then per worker
    Δ_i = θ − x_i, e_i ← β·e_i + Δ_i, m_i = Q(TopK_chunk(e_i)), e_i ← e_i − m_i; the anchor
    θ ← θ − α·(1/K)·Σ_i m_i (`average=all`; `senders`: each entry divided by the number of
    workers that sent it instead of K); every worker restarts from θ. After 5 rounds the anchor, the
    workers and the accumulators agree (α ≠ 1 separates this update from the
    reference code's e ← β·e + α·Δ). Agree to 1e-9 (`helpers.TOL64`): ours (nn.Linear, the
    allgather's sum) and the reference (x @ W.T + b, Python's sum) are different computations
    of the same math, so the comparison is in float64, where their rounding is ~1e-16 and
    cannot move a top-k choice or a 2-bit level."""
    node = compose_config(
        *SPARSELOCO,
        *SMALL_BLOCKS,
        f"outer.optimizer.lr={ALPHA}",
        f"outer.error_feedback.decay={BETA}",
        f"outer.compressor.average={average}",
    ).outer
    data = least_squares_shards(K)
    theta, replicas, inner, base = tiny_local_sgd(K, INNER_LR, H)
    ours = OuterOptimizer(
        replicas,
        base.comm,
        inner,
        base,
        node.optimizer,
        compressor=node.compressor,
        error_feedback=node.error_feedback,
    )
    train_on_shards(ours, data, H * ROUNDS, H)

    workers = [theta.clone() for _ in range(K)]
    memory = [torch.zeros_like(theta) for _ in range(K)]
    for _ in range(ROUNDS):
        for w, (x, y) in enumerate(data):
            workers[w] = tiny_sgd_steps(workers[w], x, y, INNER_LR, H)
        sent, masks = [], []
        for w in range(K):
            memory[w] = BETA * memory[w] + (theta - workers[w])
            sent.append(message(memory[w], [144, 24, 72, 3], CHUNK, DENSITY, 2))
            masks.append(sent_positions(memory[w], [144, 24, 72, 3], CHUNK, DENSITY))
            memory[w] = memory[w] - sent[w]
        theta = theta - ALPHA * aggregate(sent, masks, average)
        workers = [theta.clone() for _ in range(K)]

    assert gap(ours.anchor.params[0], theta) <= TOL64
    assert gap(replicas.params, theta.expand(K, -1)) <= TOL64
    (reducer,) = ours.reducers
    assert gap(reducer.memory.memory, torch.stack(memory)) <= TOL64
    assert min(m.abs().max().item() for m in memory) > 1e-3  # the memories hold a residual
    assert (
        gap(theta, torch.cat([p.detach().reshape(-1) for p in tiny_tanh_model().parameters()]))
        > 0.01
    )


def test_outer_sparseloco_composes_the_papers_defaults():
    """outer=sparseloco: outer SGD (lr α = 1, no momentum), EF14 with β = 0.95, the codec at
    64 of every 4096 entries (1.56 %), 2-bit values, R = 6 σ."""
    node = compose_config(*SPARSELOCO).outer
    assert node.optimizer._target_ == "torch.optim.SGD"
    sgd = node.optimizer
    assert (sgd.lr, sgd.momentum, sgd.nesterov) == (1.0, 0.0, False)
    assert (node.error_feedback.mode, node.error_feedback.decay) == ("ef14", 0.95)
    assert node.compressor._target_ == "dpresearch.compress.quantized_topk.QuantizedTopK"
    c = node.compressor
    assert (c.density * 4096, c.chunk_size, c.bits, c.range_sigmas) == (64, 4096, 2, 6.0)


# -- C: runs --------------------------------------------------------------------------------------
def test_a_run_sends_the_hand_counted_bytes_every_outer_round():
    """On the default MLP (tensors 32×16, 32, 10×32, 10; one block each at 4096) every outer
    round sends per worker: 512 → k 8, 9-bit indices: 9 + 2 + 20; 32 → k 1: 1 + 1 + 20;
    320 → k 5: 6 + 2 + 20; 10 → k 1: 1 + 1 + 20 — 103 bytes, the run's only traffic."""
    trainer = run(*SPARSELOCO, "workers=4", "train.steps=12")
    assert trainer.summary["outer/rounds"] == 3
    assert trainer.summary["outer/bytes_per_round"] == 31 + 22 + 28 + 22
    assert trainer.summary["comm/bytes"] == 3 * 103
    assert torch.equal(trainer.replicas.params[0], trainer.algorithm.anchor.params[0])


GLOO_ARGS = [*SPARSELOCO, *SMALL_BLOCKS, "optimizer.momentum=0.9", "workers=2", "train.steps=24"]


def row_and_anchor(trainer, summary: dict) -> tuple:
    """What each rank keeps: its parameter row, the outer anchor θ, the summary."""
    return trainer.replicas.params[0].clone(), trainer.algorithm.anchor.params[0].clone(), summary


@pytest.mark.distributed
def test_simulated_k2_equals_two_gloo_processes(tmp_path):
    """SparseLoCo over local SGD on 2 gloo processes (one worker each, an allgather of the
    quantized messages) ends with the simulated K = 2 run's parameters, bytes, ops. Both in
    float64 (`helpers.build_trainer`), to 1e-9: the same math on both sides, but gloo's
    collectives need not add in the simulated order, and in float32 a reordering is a
    CPU-dependent few ulps per step that training amplifies."""
    from helpers import cases_on_gloo

    cases = {"all": GLOO_ARGS, "senders": [*GLOO_ARGS, "outer.compressor.average=senders"]}
    real = cases_on_gloo(2, tmp_path, cases, row_and_anchor)
    finals = {}
    for case, args in cases.items():
        simulated = run(*args, dtype=torch.float64)
        for rank in range(2):
            params, anchor, summary = real[rank][case]
            assert params.dtype == torch.float64
            assert gap(params, simulated.replicas.params[rank]) <= TOL64, (case, rank)
            assert gap(anchor, simulated.algorithm.anchor.params[0]) <= TOL64, (case, rank)
            assert summary["comm/bytes"] == simulated.summary["comm/bytes"]
            assert sorted(summary["comm/ops"]) == sorted(simulated.summary["comm/ops"])
        assert simulated.summary["outer/rounds"] == 6
        finals[case] = simulated.algorithm.anchor.params[0]
    assert gap(finals["all"], finals["senders"]) > 1e-3  # the two averages differ


def test_killed_and_resumed_equals_uninterrupted(tmp_path, one_thread):
    """A run that dies at step 35 after a checkpoint at 30 (period 4: the accumulators there
    are non-zero), resumed, ends bit for bit as the uninterrupted run, metrics and bytes too."""
    from helpers import CHECKPOINTED, check_resumed

    check_resumed(
        tmp_path, [*CHECKPOINTED, "workers=4", *SPARSELOCO, *SMALL_BLOCKS], InjectedFailure
    )


@pytest.mark.slow
def test_kill_9_then_resume_auto_is_exact(tmp_path):
    """A real SIGKILL of a command-line SparseLoCo run (every checkpoint holds non-zero
    accumulators), then `train.resume=auto`: bit for bit the uninterrupted run."""
    from helpers import CHECKPOINTED, final_params, kill_9_and_resume, metric_lines, same

    args = [
        *CHECKPOINTED,
        "workers=4",
        *SPARSELOCO,
        *SMALL_BLOCKS,
        "train.steps=300",
        "train.eval_every=150",
        "train.checkpoint_every=10",
    ]

    def check_state(run_dir: Path) -> None:
        ckpt = torch.load(latest_checkpoint(run_dir), weights_only=False)
        state = ckpt["states"][0]["algorithm"]
        assert state["reducers"][0]["memory"]["memory"].abs().sum() > 0

    run_dir, reference = kill_9_and_resume(args, tmp_path, kill_after=25, before_resume=check_state)
    assert [m["step"] for m in metric_lines(run_dir)] == list(range(1, 301))
    assert same(final_params(run_dir), final_params(reference))


@pytest.mark.skipif(not SHAKESPEARE_WORKS.is_dir(), reason="no Shakespeare corpus")
def test_sparseloco_trains_the_gpt_on_shakespeare(tmp_path, one_thread):
    """`algorithm=local_sgd outer=sparseloco` (H = 5, AdamW inner steps) on gpt_tiny, 2
    workers: the training loss falls by more than 0.8 in 100 steps (from about 4.2 over the
    first 10), the held-out loss ends below 3.5, and each outer round sends under 1 % of the
    dense fp32 bytes (1.56 % of the entries at 2 + 12 bits each, plus the codebooks)."""
    losses, summary = gpt_shakespeare_losses(tmp_path / "run", "workers=2", "outer=sparseloco")
    assert losses[0] - losses[-1] > 0.8, losses
    assert summary["val/loss"] < 3.5
    assert summary["outer/rounds"] == 20
    dense = 4 * sum(summary["outer/fragment_numel"])
    assert summary["outer/bytes_per_round"] < 0.01 * dense


# -- D: EF14 as it was, bad input -----------------------------------------------------------------
def test_decay_multiplies_the_memory_before_the_new_input_and_one_is_ef14():
    """EF14 with decay β: p = g + β·e, then e ← p − D(C(p)) (top-k 5 %), over whole rows and
    over a DDP-style index set of columns; decay = 1 leaves EF14 bit for bit as it was."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(2, 300, generator=gen) for _ in range(4)]
    cols = torch.randperm(300, generator=gen)[:120]
    for columns, width in ((slice(None), 300), (cols, 120)):
        codec = TopK(ratio=0.05).codec([Chunk("x", 0, width)], workers=(0, 1))
        default = ErrorFeedback("ef14").bind(2, 300)
        one, decayed = (ErrorFeedback("ef14", decay=d).bind(2, 300) for d in (1.0, 0.8))
        for step, g in enumerate(grads):
            g = g[:, columns]
            for memory in (default, one, decayed):
                previous = memory.memory[:, columns].clone()
                p = memory.compensate(g.clone(), step, cols=columns)
                compensated = 0.8 * previous + g if memory is decayed else previous + g
                assert torch.equal(p, compensated)
                sent = torch.empty_like(p)
                codec.decode(codec.encode(p, step), step, sent)
                target = p - sent
                memory.update(p, sent, cols=columns)
                assert torch.equal(memory.memory[:, columns], target)
            assert torch.equal(default.memory, one.memory)
        assert not torch.equal(decayed.memory, default.memory)


BAD = [
    (["outer.compressor.bits=9"], "outer.compressor.bits=9: must be a whole number in 1..8"),
    (["outer.compressor.bits=0"], "outer.compressor.bits=0: must be a whole number in 1..8"),
    (["outer.compressor.density=0"], "outer.compressor.density=0: must be in (0, 1]"),
    (["outer.compressor.density=1.5"], "outer.compressor.density=1.5: must be in (0, 1]"),
    (["outer.compressor.chunk_size=0"], "outer.compressor.chunk_size=0: must be in 1..65536"),
    (["outer.compressor.range_sigmas=0"], "outer.compressor.range_sigmas=0: must be a number > 0"),
    (["outer.error_feedback.decay=1.5"], "outer.error_feedback.decay=1.5: must be a number in"),
    (["outer.error_feedback.mode=ef21"], "set error_feedback@outer.error_feedback=ef14"),
    (["outer.compressor.average=some"], "outer.compressor.average=some: choose one of: all, se"),
]


@pytest.mark.parametrize("args,fragment", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_are_one_line_before_any_worker(args, fragment, tmp_path, monkeypatch, capsys):
    """Each bad value of the SparseLoCo nodes: exit code 2, one `error: ` line naming the key,
    nothing written."""
    argv = [*SYNTHETIC_SMALL, *SPARSELOCO, *args]
    refused_before_start(argv, fragment, tmp_path, monkeypatch, capsys)


def test_senders_average_is_refused_where_messages_are_decoded_one_at_a_time(
    tmp_path, monkeypatch, capsys
):
    """`average=senders` needs every worker's message at once: the pairing check refuses it
    for gossip and pushes (and takes `average=all` there), and a CHOCO-SGD run asking for it
    is one `error:` line before any worker."""
    from dpresearch.compress.pairing import check_pairing

    for use in ("gossip", "push"):
        check_pairing(QuantizedTopK(), use=use)
        with pytest.raises(ValueError, match="needs every worker's message at once"):
            check_pairing(QuantizedTopK(average="senders"), use=use)
    argv = [*SYNTHETIC_SMALL, "algorithm=choco", "compressor=quantized_topk",
            "compressor.average=senders"]  # fmt: skip
    refused_before_start(argv, "set compressor.average=all", tmp_path, monkeypatch, capsys)
