"""The chunked-DCT top-k compressor (`compressor=dct_topk`, `compress/dct.py`): DeMo's message
on the shared compression seams.

A. The codec: a decoded message is, block by block, the IDCT of the k largest coefficients of
   the block's DCT-II (written here from its cosine definition, float64); a sum of rows is the
   sum of their decodes; the wire bytes are a hand count.
B. The composition: synchronous SGD + this compressor + EF14 with decay β + sign-SGD
   (`optimizer=sign_sgd`) is `algorithm=demo` bit for bit (its default `sign=true`); with plain
   SGD it is `algorithm.sign=false` — parameters, losses and bytes.
C. Under every family: sync, CHOCO (compressed gossip) and DiLoCo's compressed Δ train and send
   the hand-counted bytes.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import finished_run
from torch import nn

from dpresearch.compress.chunks import Chunk
from dpresearch.compress.dct import DCTTopK, whole_blocks_note
from dpresearch.compress.layout import param_layout


def cos_basis(n: int) -> torch.Tensor:
    """Row u: α_u·cos(π(2j + 1)u / 2n) over j (the orthonormal DCT-II), term by term."""
    return torch.tensor(
        [[math.sqrt((1 if u == 0 else 2) / n) * math.cos(math.pi * (2 * j + 1) * u / (2 * n))
          for j in range(n)] for u in range(n)],
        dtype=torch.float64,
    )  # fmt: skip


def chunks_of(model: nn.Module) -> list[Chunk]:
    return [
        Chunk(str(i), o, math.prod(s), tuple(s)) for i, (o, s) in enumerate(param_layout(model))
    ]


# -- A: the codec ---------------------------------------------------------------------------------
def test_a_decoded_message_is_the_idct_of_each_blocks_k_largest_coefficients():
    """An 8 × 12 matrix, chunk 4 (4 × 4 blocks), topk 3, and a 6-vector (blocks of 1 × 3, all 3
    kept): every block of the decoded rows equals Cᵀ·q·C, q the block's 3 largest |DCT-II|
    coefficients (others 0), to 1e-12; the vector comes back whole; `accumulate` with weights
    equals the weighted sum of the decoded rows."""
    chunks = [Chunk("w", 0, 96, (8, 12)), Chunk("b", 96, 6, (6,))]
    codec = DCTTopK(topk=3, chunk=4).codec(chunks, torch.float64, "cpu", (0, 1, 2), False)
    x = torch.randn(3, 102, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = torch.empty_like(x)
    wire = codec.encode(x, 0).clone()
    codec.decode(wire, 0, out)
    c4 = cos_basis(4)
    for r in range(3):
        mat, got = x[r, :96].reshape(8, 12), out[r, :96].reshape(8, 12)
        for i in range(2):
            for j in range(3):
                rows, cols = slice(4 * i, 4 * i + 4), slice(4 * j, 4 * j + 4)
                coeffs = (c4 @ mat[rows, cols] @ c4.T).flatten()
                q = torch.zeros(16, dtype=torch.float64)
                top = torch.argsort(coeffs.abs(), descending=True)[:3]
                q[top] = coeffs[top]
                assert (got[rows, cols] - c4.T @ q.reshape(4, 4) @ c4).abs().max() <= 1e-12
    assert (out[:, 96:] - x[:, 96:]).abs().max() <= 1e-12
    weights = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64)
    total = torch.zeros(1, 102, dtype=torch.float64)
    codec.accumulate(wire.unsqueeze(0), 0, total, weights)
    assert (total[0] - (weights[0, :, None] * out).sum(0)).abs().max() <= 1e-12


def test_wire_bytes_are_demos_hand_count():
    """Linear(12, 8) + Linear(8, 6) in float32, chunk 4, topk 5 (tests/test_demo.py's count):
    30 + 8 + 20 + 6 = 64 coefficients of 4 bytes and one-byte indices: 320 bytes; a 64 × 64
    matrix at the defaults (one 64 × 64 block, 32 kept): two-byte indices, 32·(4 + 2) = 192."""
    model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 6))
    codec = DCTTopK(topk=5, chunk=4).codec(chunks_of(model), torch.float32, "cpu", (0,), False)
    assert codec.wire_bytes == 320
    square = DCTTopK().codec(chunks_of(nn.Linear(64, 64, bias=False)), torch.float32)
    assert square.wire_bytes == 192 == DCTTopK().payload_bytes(4096, (64, 64), torch.float32)


def test_a_topk_that_sends_every_block_whole_is_refused_and_most_bytes_warned():
    """Shapes 30 × 32, 30 and 10 × 30 at chunk 64: blocks 30 × 32 (960), 1 × 30 and 10 × 30
    (300). topk 960 sends all three whole: refused. topk 300 sends the last two whole: 300 +
    30 + 300 = 630 coefficients of 4 + 2 bytes (largest block 960: int16 indices) = 3780 bytes
    of the dense 1290·4 = 5160 (73 %): warned, naming 2 of 3 blocks. topk 32: 32 + 30 + 32 = 94
    coefficients, 564 bytes (11 %): nothing said."""
    shapes = [(30, 32), (30,), (10, 30)]
    with pytest.raises(ValueError, match=r"^algorithm.topk=960 sends every coefficient: this "
                       r"model's largest DCT block holds 960 .* all 3 blocks .* use "
                       r"algorithm.topk < 960$"):  # fmt: skip
        whole_blocks_note(shapes, 64, 960, "algorithm")
    note = whole_blocks_note(shapes, 64, 300, "compressor")
    assert note is not None
    assert note.startswith("compressor.topk=300 sends 73% of the dense bytes")
    assert "2 of this model's 3 DCT blocks hold at most 300 coefficients" in note
    assert whole_blocks_note(shapes, 64, 32, "compressor") is None


# -- B: DeMo as a composition ---------------------------------------------------------------------
# The default MLP (16-32-10): with chunk 8, topk 4 its tensors 32×16, 32, 10×32, 10 send
# 8·4 + 4·4 + 8·4 + 2·4 = 88 coefficients (largest block 8 × 8: one-byte indices).
DCT = ["compressor.chunk=8", "compressor.topk=4"]
SYNC = ["algorithm=sync", "compressor=dct_topk", *DCT, "error_feedback=ef14"]
DEMO = ["algorithm=demo", "algorithm.chunk=8", "algorithm.topk=4"]


@pytest.mark.parametrize(
    ("demo", "composed"),
    [
        (["optimizer.lr=0.01"], ["error_feedback.decay=0.999", "optimizer=sign_sgd",
                                 "optimizer.lr=0.01"]),
        (["algorithm.sign=false", "algorithm.beta=0.9", "optimizer.lr=0.01"],
         ["error_feedback.decay=0.9", "optimizer=sgd", "optimizer.lr=0.01"]),
    ],
    ids=["sign", "algorithm_1"],
)  # fmt: skip
def test_sync_dct_topk_ef14_with_decay_is_algorithm_demo(demo, composed):
    """12 steps of K = 2 in float64: the same parameters bit for bit, the same losses and
    bytes (88 coefficients·(8 + 1) = 792 per worker and step, one all-gather)."""
    run = ["workers=2", "train.steps=12"]
    reference = finished_run(*run, *DEMO, *demo, dtype=torch.float64)
    composition = finished_run(*run, *SYNC, *composed, dtype=torch.float64)
    assert torch.equal(reference.replicas.params, composition.replicas.params)
    for key in ("train/loss", "test/loss", "comm/bytes", "comm/ops"):
        assert reference.summary[key] == composition.summary[key], key
    assert composition.summary["comm/ops"] == [["allgather", 792, 2, 0, 12]]


# -- C: under every family ------------------------------------------------------------------------
UNTRAINED = math.log(10) - 0.3  # well below the 10 classes' chance loss


def test_under_sync_chocos_gossip_and_dilocos_delta_it_trains_and_sends_the_hand_count():
    """fp32, 4 workers, 24 steps, 88 coefficients·(4 + 1) = 440 bytes per message: sync sends
    one per step (24·440 per worker), CHOCO on the ring one to each of 2 neighbours per step
    (24·2·440), DiLoCo (period 4) one per outer round (6·440); each ends below chance loss."""
    runs = {
        "sync": ([*SYNC], 24 * 440, "allgather"),
        "choco": (["algorithm=choco", "compressor=dct_topk", *DCT], 24 * 2 * 440, "p2p"),
        "diloco": (["algorithm=local_sgd", "algorithm.period=4", "outer=sgd",
                    "compressor@outer.compressor=dct_topk", "outer.compressor.chunk=8",
                    "outer.compressor.topk=4", "error_feedback@outer.error_feedback=ef14"],
                   6 * 440, "allgather"),
    }  # fmt: skip
    for name, (args, expected, op) in runs.items():
        trainer = finished_run(*args, "workers=4", "train.steps=24")
        assert trainer.summary["comm/bytes"] == expected, name
        assert [o[:2] for o in trainer.summary["comm/ops"]] == [[op, 440]], name
        assert trainer.summary["test/loss"] < UNTRAINED, name
