"""Codecs over stacked rows (issue 16, item 3): every compressor's batched codec equals a
per-worker, per-tensor reference written here (the way the library computed it before, one
chunk of one worker at a time); error feedback keeps memory + sent = compensated for sync, CHOCO
and pushes; and no scratch buffer lives at module level in `compress/`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers import fp4_reference, layout_of

import dpresearch.compress as dc
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.compress import (
    Chunk,
    CompressedReducer,
    ErrorFeedback,
    check_pairing,
    plan_buckets,
    rng,
)
from dpresearch.compress.topk import kept

NET = NetworkModel.preset("10gbe")
SEED, K = 13, 3
# Repeated sizes at even offsets (views) and at irregular ones (gathered), sizes that do not
# fill whole bytes of packed bits, single-entry chunks, and a chunk large enough for top-k's
# threshold selection.
SHAPES = [
    (16, 3, 3, 3), (16,), (16,), (16, 16, 3, 3), (16,), (16,), (16, 16, 3, 3), (16,), (16,),
    (16, 16, 3, 3), (16,), (16,), (64, 32, 3, 3), (64,), (64,), (10, 64), (10,), (7,), (1,),
    (13, 5), (301,),
]  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")


LAYOUT, D = layout_of(SHAPES)
CHUNKS = plan_buckets(LAYOUT, "tensor", bucket_mb=25)[0].chunks


# -- the per-worker, per-tensor references ------------------------------------------------------


def ref_topk(c: dc.TopK, v: torch.Tensor, chunk: Chunk, step: int, worker: int) -> torch.Tensor:
    idx = torch.topk(v.abs(), kept(v.numel(), c.ratio)).indices
    out = torch.zeros_like(v)
    out[idx] = v[idx]
    return out


def ref_randomk(
    c: dc.RandomK, v: torch.Tensor, chunk: Chunk, step: int, worker: int
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.stream_seed("randomk", c.seed, chunk.key, step))
    k = kept(v.numel(), c.ratio)
    idx = torch.randint(0, v.numel(), (k,), generator=gen)
    out = torch.zeros_like(v)
    if c.unbiased:
        return out.index_add_(0, idx, v[idx], alpha=v.numel() / k)
    out[idx] = v[idx]
    return out


def ref_quantize(c: dc.QSGD, v: torch.Tensor, chunk: Chunk, step: int, worker: int) -> torch.Tensor:
    """ξ = ⌊v·s/ν + u⌋ per bucket, u from the worker's 16-bit dither stream for this chunk and
    step; decoded ξ·ν/s."""
    s, d = c.levels, v.numel()
    bucket = c.bucket(d)
    seed = rng.stream_seed(type(c).__name__, c.seed, worker, chunk.key, step)
    dither = rng.Int16Stream(seed, torch.device("cpu")).fill(torch.empty(d))
    out = torch.empty_like(v)
    for start in range(0, d, bucket):
        part = v[start : start + bucket]
        if isinstance(c, dc.TernGrad):
            norm = part.abs().max()
        else:
            norm = torch.linalg.vector_norm(part, 2, dtype=torch.float32)
        scale = s * 65536.0 / norm if norm > 0 else torch.tensor(0.0)
        level = dither[start : start + bucket].addcmul_(part, scale.expand_as(part))
        level = torch.add(torch.tensor(s + 32768.5 / 65536.0), level, alpha=1 / 65536)
        codes = level.to(torch.uint8).clamp_(max=2 * s)
        out[start : start + bucket] = (codes.to(torch.int16) - s).float() * (norm / s)
    return out


def ref_fp4(c: dc.FP4, v: torch.Tensor, chunk: Chunk, step: int, worker: int) -> torch.Tensor:
    """`helpers.fp4_reference`, with the worker's 16-bit stream for stochastic rounding."""
    u = None
    if c.rounding == "stochastic":
        seed = rng.stream_seed("FP4", c.seed, worker, chunk.key, step)
        u = rng.Int16Stream(seed, torch.device("cpu")).fill(torch.empty(v.numel())) + 32768.5
        u = u.double() / 65536.0
    return fp4_reference(v, c.format, c.bucket(v.numel()), u)[2]


def ref_scaled_sign(c, v: torch.Tensor, chunk: Chunk, step: int, worker: int) -> torch.Tensor:
    scale = v.abs().sum() / v.numel()
    return torch.where(torch.signbit(v), -scale, scale)


def ref_vote(c, v: torch.Tensor, chunk: Chunk, step: int, worker: int) -> torch.Tensor:
    return torch.where(torch.signbit(v), -1.0, 1.0)


def ref_cast(c, v: torch.Tensor, chunk: Chunk, step: int, worker: int) -> torch.Tensor:
    return v.to(c.wire_dtype_for(v.dtype)).to(v.dtype)


CODECS = {
    "identity": (lambda: dc.Identity(seed=SEED), ref_cast),
    "fp16": (lambda: dc.FP16(seed=SEED), ref_cast),
    "bf16": (lambda: dc.BF16(seed=SEED), ref_cast),
    "topk1%": (lambda: dc.TopK(ratio=0.01, seed=SEED), ref_topk),
    "topk5%": (lambda: dc.TopK(ratio=0.05, seed=SEED), ref_topk),
    "topk_sampled": (
        lambda: dc.TopK(ratio=0.05, selection="sampled", sample_size=200, seed=SEED),
        ref_topk,
    ),
    "randomk": (lambda: dc.RandomK(ratio=0.05, seed=SEED), ref_randomk),
    "randomk_unbiased": (lambda: dc.RandomK(ratio=0.05, unbiased=True, seed=SEED), ref_randomk),
    "qsgd": (lambda: dc.QSGD(levels=7, bucket_size=100, seed=SEED), ref_quantize),
    "qsgd_s3": (lambda: dc.QSGD(levels=3, bucket_size=None, seed=SEED), ref_quantize),
    "terngrad": (lambda: dc.TernGrad(seed=SEED), ref_quantize),
    "fp4": (lambda: dc.FP4(seed=SEED), ref_fp4),
    "fp4_e2m1_stochastic": (
        lambda: dc.FP4(format="e2m1", rounding="stochastic", bucket_size=100, seed=SEED),
        ref_fp4,
    ),
    "sign": (lambda: dc.ScaledSign(seed=SEED), ref_scaled_sign),
    "signum": (lambda: dc.MajorityVote(seed=SEED), ref_vote),
}


def reference(name: str, x: torch.Tensor, step: int, workers) -> torch.Tensor:
    """D(C(x[w])) chunk by chunk, worker by worker."""
    make, ref = CODECS[name]
    c = make()
    out = torch.empty_like(x)
    for row, worker in enumerate(workers):
        for ch in CHUNKS:
            out[row, ch.slice] = ref(c, x[row, ch.slice], ch, step, worker)
    return out


def inputs(step: int, rows: int = K) -> torch.Tensor:
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(100 + step))


# -- the stacked codec equals the reference ----------------------------------------------------


@pytest.mark.parametrize("name", sorted(CODECS))
def test_stacked_codec_equals_per_worker_per_tensor_reference(name):
    make, _ = CODECS[name]
    workers = (0, 5, 2)  # global ids seed the streams, whatever the row
    codec = make().codec(CHUNKS, torch.float32, "cpu", workers)
    for step in range(3):
        x = inputs(step)
        wire = codec.encode(x, step)
        assert wire.shape == (K, codec.wire_size)
        assert codec.wire_bytes == sum(make().payload_bytes(ch.numel) for ch in CHUNKS)
        decoded = torch.empty_like(x)
        codec.decode(wire, step, decoded)
        assert torch.equal(decoded, reference(name, x, step, workers)), step
        # one row alone (a push, a worker per process) encodes to the same bytes
        alone = codec.encode(x[1:2], step, workers[1:2]).clone()
        assert torch.equal(alone[0], codec.encode(x, step)[1])


@pytest.mark.parametrize("name", ["sign", "signum"])
def test_long_rows_not_filling_whole_bytes_decode_as_the_reference(name):
    """A run of chunks of more than `ROW_GATHER` packed bytes whose width is not a multiple of 8
    (ResNet-20's) is decoded one row at a time straight into the output, here a bucket view of
    wider rows: the values of the per-tensor reference, and the columns around left alone."""
    from dpresearch.compress.sign import ROW_GATHER

    layout, d = layout_of([(64, 576), (9,)])
    chunks = plan_buckets(layout, "tensor", bucket_mb=25)[0].chunks
    assert d // 8 >= ROW_GATHER and d % 8
    make, ref = CODECS[name]
    codec = make().codec(chunks, torch.float32, "cpu", range(K))
    x = torch.randn(K, d, generator=torch.Generator().manual_seed(5))
    wide = torch.full((K, d + 11), 7.0)
    codec.decode(codec.encode(x, 0), 0, wide[:, 3 : 3 + d])
    for w in range(K):
        for ch in chunks:
            want = ref(make(), x[w, ch.slice], ch, 0, w)
            assert torch.equal(wide[w, 3 + ch.offset : 3 + ch.offset + ch.numel], want)
    assert (wide[:, :3] == 7).all() and (wide[:, 3 + d :] == 7).all()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_gathered_aggregate_and_weighted_sums_equal_the_reference(name):
    """Sync's aggregate (allgather, Σ_k D(wire_k) in worker order, finalize) and CHOCO's
    weighted accumulation out[b] += Σ_r w[b, r]·D(rows[b, r]) (fp64 state)."""
    make, _ = CODECS[name]
    compressor = make()
    x, step = inputs(7), 7
    ref = reference(name, x, step, range(K))
    aggregation = compressor.aggregation(CHUNKS, range(K), torch.float32, "cpu", "allgather")
    out = torch.empty(D)
    sent = torch.empty(K, D)
    aggregation.run(x, SimulatedCommunicator(K, NET), step, out, sent)
    assert torch.equal(sent, ref)
    expected = torch.zeros(D)
    for k in range(K):
        expected += ref[k]
    compressor.finalize(expected, K)
    assert torch.equal(out, expected)
    if not compressor.gossip:
        return
    codec = compressor.codec(CHUNKS, torch.float32, "cpu", range(K), linear=False)
    wire = codec.encode(x, step)
    rows = torch.stack([wire, wire.roll(1, 0), torch.zeros_like(wire)], 1)  # zero: padding
    weights = torch.tensor([[0.5, 0.25, 0.0], [0.2, 0.8, 0.0], [1.0, 0.5, 0.0]])
    state = torch.randn(K, D, dtype=torch.float64)
    expected = state.clone()
    for r, source in enumerate([ref, ref.roll(1, 0)]):
        expected += (source * weights[:, r : r + 1]).double()
    codec.accumulate(rows, step, state, weights)
    assert torch.equal(state, expected)


@pytest.mark.parametrize("name", sorted(n for n in CODECS if CODECS[n][0]().gossip))
def test_a_zero_wire_row_decodes_to_zeros(name):
    """The contract that lets a neighbour exchange pad missing in-peers with zero rows of
    weight 0: they decode to zeros and add nothing."""
    codec = CODECS[name][0]().codec(CHUNKS, workers=range(2), linear=False)
    decoded = torch.full((2, D), 7.0)
    codec.decode(torch.zeros(2, codec.wire_size, dtype=codec.layout.dtype), 3, decoded)
    assert torch.equal(decoded, torch.zeros(2, D))


def test_pairing_is_read_from_the_class_traits():
    class Vote(dc.ChunkCompressor):
        gossip = False
        memories = ("none",)

        def payload_spec(self, chunk, dtype):
            return [(torch.uint8, chunk.numel)]

        def compress(self, x, chunk, step, worker):
            return [(x > 0).to(torch.uint8)]

        def decompress(self, payload, chunk, step, out):
            out.copy_(payload[0])

    check_pairing(Vote(), ErrorFeedback(mode="none", momentum=0.9), "sync")
    with pytest.raises(ValueError, match="cannot be used for gossip"):
        check_pairing(Vote(), None, "gossip")
    with pytest.raises(ValueError, match="error_feedback.mode=ef14 with Vote: it takes mode none"):
        check_pairing(Vote(), ErrorFeedback(mode="ef14"), "sync")
    with pytest.raises(ValueError, match="collective=auto"):
        check_pairing(Vote(), None, "sync", collective="allreduce")
    with pytest.raises(ValueError, match="support error_feedback=none or ef14"):
        check_pairing(dc.TopK(), ErrorFeedback(mode="ef21"), "push")


def test_powersgd_owns_one_q_per_process_and_equals_the_per_worker_reference():
    """Two rounds over stacked rows = the protocol written per worker and per tensor. In
    float64 (issue 33, class b: batched matmuls and Gram–Schmidt against per-worker matmuls
    and QR), to 1e-9: Q is drawn in float32 and cast, in ours as here."""
    f64 = torch.float64
    chunks = [ch for ch in CHUNKS if ch.shape is not None and len(ch.shape) > 1]
    compressor = dc.PowerSGD(rank=2, min_compression_rate=1.0, seed=SEED)
    comm = SimulatedCommunicator(K, NET)
    n = max(ch.offset + ch.numel for ch in chunks)
    aggregation = compressor.aggregation(chunks, range(K), f64, "cpu")
    q_ref: dict[str, torch.Tensor] = {}
    for step in range(3):
        x = inputs(step)[:, :n].to(f64).contiguous()
        out, sent = torch.empty(n, dtype=f64), torch.empty(K, n, dtype=f64)
        aggregation.run(x, comm, step, out, sent)
        for ch in chunks:
            m, c = compressor.matrix_shape(ch.numel, ch.shape)
            if ch.key not in q_ref:
                gen = torch.Generator().manual_seed(rng.stream_seed("powersgd", SEED, ch.key))
                q_ref[ch.key] = torch.randn(c, 2, generator=gen).to(f64)
            mats = [x[w, ch.slice].view(m, c) for w in range(K)]
            p = sum(mat @ q_ref[ch.key] for mat in mats) / K
            p, _ = torch.linalg.qr(p)  # Gram–Schmidt up to column signs
            q_ref[ch.key] = sum(mat.T @ p for mat in mats) / K
            approx = (p @ q_ref[ch.key].T).reshape(-1)
            assert torch.allclose(out[ch.slice], approx, atol=1e-9, rtol=0), ch.key
            assert torch.equal(sent[:, ch.slice], out[ch.slice].expand(K, -1))
            # Q is the compressor's, once per process (not one copy per worker)
            assert compressor.q[ch.key].shape == (c, 2)


def test_stacked_codecs_run_on_a_bucket_view_of_wider_rows():
    """The reducer hands codecs column slices of the `[W, D]` gradient rows (row stride D)."""
    wide = inputs(3)
    x = torch.cat([wide, torch.randn(K, 17)], 1)[:, :D]
    assert not x.is_contiguous()
    for name in ("topk1%", "qsgd", "sign"):
        codec = CODECS[name][0]().codec(CHUNKS, workers=range(K))
        decoded = torch.empty(K, D)
        codec.decode(codec.encode(x, 3), 3, decoded)
        assert torch.equal(decoded, reference(name, wide, 3, range(K))), name


# -- error feedback: memory + sent = compensated -------------------------------------------------


@pytest.mark.parametrize("name", ["topk1%", "randomk", "sign", "qsgd"])
def test_ef_memory_plus_sent_is_the_compensated_gradient(name):
    """For any codec e_new = p − sent, computed once; for sparsifiers (sent = p or 0 entrywise)
    e_new + sent = p bitwise."""
    codec = CODECS[name][0]().codec(CHUNKS, workers=range(K))
    memory = ErrorFeedback(mode="ef14").bind(K, D)
    for step in range(4):
        g = inputs(step)
        e_old = memory.memory.clone()
        p = memory.compensate(g, step)
        assert torch.equal(p, g + e_old)
        compensated = p.clone()
        sent = torch.empty(K, D)
        codec.decode(codec.encode(p, step), step, sent)
        memory.update(p, sent)
        assert torch.equal(memory.memory, compensated - sent)
        if name in ("topk1%", "randomk"):
            assert torch.equal(memory.memory + sent, compensated)


def test_sync_reducer_memory_plus_sent_is_compensated():
    comm = SimulatedCommunicator(K, NET)
    reducer = CompressedReducer(dc.TopK(ratio=0.01, seed=SEED), comm, LAYOUT, ErrorFeedback())
    codec = dc.TopK(ratio=0.01, seed=SEED).codec(CHUNKS, workers=range(K))
    for step in range(4):
        g = inputs(step)
        compensated = g + reducer.memory.memory
        sent = torch.empty(K, D)
        codec.decode(codec.encode(compensated, step), step, sent)
        reducer.reduce(g, step)
        assert torch.equal(reducer.memory.memory + sent, compensated)
        aggregate = torch.zeros(D)
        for k in range(K):
            aggregate += sent[k]
        assert torch.equal(g, (aggregate / K).expand(K, -1))


def test_push_memory_plus_sent_is_compensated_and_the_server_decodes_sent():
    from dpresearch.compress import ChannelNeeds, open_channel
    from dpresearch.models.mlp import MLP

    model = MLP(10, (16,), hidden=[300])
    params = torch.zeros(2, sum(p.numel() for p in model.parameters()))
    node = {"_target_": "dpresearch.compress.topk.TopK", "ratio": 0.01}
    codec = open_channel(ChannelNeeds.push(), model, params, [3, 7], node, {"mode": "ef14"}, SEED)
    gen = torch.Generator().manual_seed(1)
    for count in range(4):
        for row in (1, 0):
            g = torch.randn(params.shape[1], generator=gen)
            compensated = g + codec.memory.memory[row]
            wire, sent = codec.encode(row, g, count)
            assert torch.equal(codec.memory.memory[row] + sent, compensated)
            server = codec.decode(wire.clone(), count, torch.empty_like(g))
            assert torch.equal(server, sent)


def test_choco_public_copies_move_by_exactly_what_was_sent(small_config):
    """x̂_i += D(q_i) and s_i += Σ_j w_ij D(q_j), the messages decoded from the exchanged wire
    rows: CHOCO's memory of what the neighbours have (x − x̂) loses exactly what was sent."""
    from dpresearch.run.trainer import Trainer

    cfg = small_config(
        "workers=4",
        "algorithm=choco",
        "compressor=topk",
        "compressor.ratio=0.1",
        "topology=ring",
        "train.steps=3",
    )
    trainer = Trainer(cfg, SimulatedCommunicator(4, NET), torch.device("cpu"), None)
    trainer.run()
    choco = trainer.algorithm
    params = trainer.replicas.params
    x_hat, s = choco.x_hat.clone(), choco.s.clone()
    with torch.no_grad():
        params.add_(torch.randn_like(params) * 0.01)  # any new local models
    for opt in choco.optimizers:
        for group in opt.param_groups:
            group["lr"] = 0.0
    before = params.clone()
    sent = torch.empty_like(params)
    wire = choco.codec.encode((before - x_hat).to(params.dtype), 3)
    choco.codec.decode(wire, 3, sent)
    own_w, peer_w = choco.local_weights(3)
    choco.after_backward(3)
    assert torch.equal(choco.x_hat, x_hat + sent)
    expected = s + (sent * own_w.unsqueeze(1)).double()
    ins = choco.topology.in_peers(3)
    for i in range(4):
        for p, j in enumerate(ins[i]):
            expected[i] += (sent[j] * peer_w[i, p]).double()
    assert torch.equal(choco.s, expected)


# -- no module-level scratch -----------------------------------------------------------------


def test_no_module_level_mutable_state_in_compress():
    """Scratch buffers are owned by codecs and memories: no module-level dict, list or set
    (literal or constructed), and no `global` statement, anywhere in dpresearch/compress."""
    package = Path(__file__).resolve().parents[1] / "dpresearch" / "compress"
    offenders = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            value = getattr(node, "value", None)
            names = [getattr(t, "id", "") for t in getattr(node, "targets", [])]
            if names == ["__all__"]:
                continue
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and value is not None:
                if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp)):
                    offenders.append(f"{path.name}:{node.lineno}")
                if isinstance(value, ast.Call) and getattr(value.func, "id", "") in (
                    "dict",
                    "list",
                    "set",
                    "defaultdict",
                ):
                    offenders.append(f"{path.name}:{node.lineno}")
        offenders += [
            f"{path.name}:{n.lineno} global" for n in ast.walk(tree) if isinstance(n, ast.Global)
        ]
    assert offenders == []
