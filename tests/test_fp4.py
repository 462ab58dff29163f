"""FP4 outer gradients for Streaming DiLoCo (issue 32, item 4): the codec against the format
written out here (its 16 values from the IEEE rule for the bit fields, the nearest by brute force
in float64; stochastic rounding with the documented stream), ties, unbiasedness, wire bytes
against the formula, synchronous compression with EF14, Streaming DiLoCo with it (each outer
gradient the fp32 mean of the workers' FP4 messages; trains as fp32 does; simulated ≡ 2 gloo
processes bit for bit), and bad values as one error line."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    SYNTHETIC_SMALL,
    cases_on_gloo,
    fp4_reference,
    fp4_values,
    layout_of,
    refused_before_start,
)
from helpers import finished_run as run

from dpresearch.compress import FP4, CompressedReducer, plan_buckets, rng
from dpresearch.compress.fp4 import FORMATS

pytestmark = pytest.mark.usefixtures("one_thread")

# Sizes that fill whole bytes of 4-bit codes and sizes that do not, repeated sizes at even and
# irregular offsets, one-entry tensors.
SHAPES = [
    (16, 3, 3, 3),
    (16,),
    (16,),
    (16, 16, 3, 3),
    (16,),
    (16,),
    (10, 64),
    (10,),
    (7,),
    (1,),
    (13, 5),
    (301,),
]
LAYOUT, D = layout_of(SHAPES)
CHUNKS = plan_buckets(LAYOUT, "tensor", bucket_mb=25)[0].chunks
WORKERS = (0, 5, 2)


def inputs(step: int) -> torch.Tensor:
    """Rows of entries spread over several orders of magnitude (so every code occurs), some
    exact zeros, and one all-zero tensor (scale 0)."""
    gen = torch.Generator().manual_seed(300 + step)
    x = torch.randn(len(WORKERS), D, generator=gen)
    x *= torch.exp2(torch.randint(-8, 3, (len(WORKERS), D), generator=gen).float())
    x[:, ::17] = 0.0
    x[:, CHUNKS[1].slice] = 0.0
    return x


def wire_codes(codec, wire: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row read by hand: all fp32 scales first (chunk order), then per chunk ⌈d/2⌉ bytes of
    4-bit codes, entry 2k in the low nibble of byte k. Returns (scales [R, S], codes [R, n])."""
    scale_count = sum(-(-ch.numel // codec.compressor.bucket(ch.numel)) for ch in CHUNKS)
    scales = wire[:, : 4 * scale_count].contiguous().view(torch.float32)
    codes, offset = torch.empty(wire.shape[0], D, dtype=torch.long), 4 * scale_count
    for ch in CHUNKS:
        packed = wire[:, offset : offset + math.ceil(ch.numel / 2)].long()
        nibbles = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(1)
        codes[:, ch.slice] = nibbles[:, : ch.numel]
        offset += math.ceil(ch.numel / 2)
    assert offset == wire.shape[1]
    return scales, codes


def reference_rows(c: FP4, x: torch.Tensor, step: int, workers) -> tuple[torch.Tensor, ...]:
    """`helpers.fp4_reference` of every chunk of every row: (scales, codes, decoded)."""
    scales, codes, decoded = [], torch.empty_like(x, dtype=torch.long), torch.empty_like(x)
    for row, worker in enumerate(workers):
        found = []
        for ch in CHUNKS:
            u = None
            if c.rounding == "stochastic":
                seed = rng.stream_seed("FP4", c.seed, worker, ch.key, step)
                r = rng.Int16Stream(seed, torch.device("cpu")).fill(torch.empty(ch.numel))
                u = (r.double() + 32768.5) / 65536.0
            got = fp4_reference(x[row, ch.slice], c.format, c.bucket(ch.numel), u)
            codes[row, ch.slice], decoded[row, ch.slice] = got[0], got[2]
            found.append(got[1])
        scales.append(torch.cat(found))
    return torch.stack(scales), codes, decoded


def test_the_formats_are_the_16_values_of_their_bit_fields():
    for name, magnitudes in FORMATS.items():
        values = fp4_values(name)
        assert values[:8] == list(magnitudes) and values[8:] == [-m for m in magnitudes]
    assert FORMATS["e3m0"] == (0, 2**-2, 2**-1, 1, 2, 4, 8, 16)
    assert FORMATS["e2m1"] == (0, 0.5, 1, 1.5, 2, 3, 4, 6)  # OCP MX FP4


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("bucket_size", [None, 100])
def test_nearest_is_the_brute_force_nearest_value_of_the_format(fmt, bucket_size):
    c = FP4(format=fmt, bucket_size=bucket_size, seed=3)
    codec = c.codec(CHUNKS, torch.float32, "cpu", WORKERS)
    magnitudes = torch.tensor(FORMATS[fmt], dtype=torch.float64)
    for step in range(2):
        x = inputs(step)
        wire = codec.encode(x, step)
        scales, codes = wire_codes(codec, wire)
        ref_scales, ref_codes, ref_decoded = reference_rows(c, x, step, WORKERS)
        assert torch.equal(scales, ref_scales)
        assert torch.equal(codes, ref_codes)
        decoded = torch.empty_like(x)
        codec.decode(wire, step, decoded)
        assert torch.equal(decoded, ref_decoded)
        assert len(set(codes.flatten().tolist())) >= 14  # (almost) every code occurs
        # Nearest in float64 too, not only to the fp32 ratio: y = |v|·top/max|v| exactly, and
        # the chosen magnitude at most 2·2⁻²³·y farther from it than the nearest one (the fp32
        # ratio is within 2⁻²⁴·y of y for s's rounding and again for the division's).
        for row in range(x.shape[0]):
            for ch in CHUNKS:
                v, b = x[row, ch.slice].double(), c.bucket(ch.numel)
                peaks = torch.stack([part.abs().max() for part in v.split(b)])
                s = torch.repeat_interleave(peaks / magnitudes[-1], b)[: v.numel()]
                y = torch.where(s > 0, v.abs() / s.clamp(min=1e-300), 0.0)
                chosen = magnitudes[codes[row, ch.slice] & 7]
                best = (y[:, None] - magnitudes[None, :]).abs().min(1).values
                assert ((y - chosen).abs() - best <= 2 * 2**-23 * y).all()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_tie_goes_to_the_larger_magnitude(fmt):
    """Scale 1 exactly (the bucket's max is the top value), every midpoint and its negative:
    each rounds away from zero; just below a midpoint rounds down."""
    m = torch.tensor(FORMATS[fmt])
    mids = (m[1:] + m[:-1]) / 2
    below = torch.nextafter(mids, torch.zeros_like(mids))
    x = torch.cat([m[-1:], mids, -mids, below]).unsqueeze(0)
    chunk = plan_buckets(layout_of([(x.shape[1],)])[0], "tensor", 25)[0].chunks
    codec = FP4(format=fmt).codec(chunk)
    out = torch.empty_like(x)
    codec.decode(codec.encode(x, 0), 0, out)
    assert torch.equal(out[0], torch.cat([m[-1:], m[1:], -m[1:], m[:-1]]))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_stochastic_rounding_is_the_reference_with_the_documented_stream(fmt):
    c = FP4(format=fmt, rounding="stochastic", bucket_size=64, seed=11)
    codec = c.codec(CHUNKS, torch.float32, "cpu", WORKERS)
    for step in range(2):
        x = inputs(step)
        wire = codec.encode(x, step)
        scales, codes = wire_codes(codec, wire)
        ref_scales, ref_codes, ref_decoded = reference_rows(c, x, step, WORKERS)
        assert torch.equal(scales, ref_scales) and torch.equal(codes, ref_codes)
        decoded = torch.empty_like(x)
        codec.decode(wire, step, decoded)
        assert torch.equal(decoded, ref_decoded)
        # one row alone (a push, a worker per process) draws the same numbers
        alone = codec.encode(x[1:2], step, WORKERS[1:2]).clone()
        assert torch.equal(alone[0], codec.encode(x, step)[1])


def test_stochastic_rounding_is_unbiased():
    """2000 workers round the same 64 entries once each: every entry's mean is within 5.5
    standard errors of the entry, the standard error sqrt(p(1 − p)/N)·gap·s from its own p."""
    n, count = 64, 2000
    x = torch.randn(1, n, generator=torch.Generator().manual_seed(5)).expand(count, n)
    chunk = plan_buckets(layout_of([(n,)])[0], "tensor", 25)[0].chunks
    codec = FP4(rounding="stochastic", seed=2).codec(chunk, workers=range(count))
    out = torch.empty(count, n)
    codec.decode(codec.encode(x.contiguous(), 0), 0, out)
    m = torch.tensor(FORMATS["e3m0"], dtype=torch.float64)
    s = x[0].abs().max().double() / m[-1]
    y = x[0].double().abs() / s
    lo = (y[:, None] >= m[None, :]).sum(1) - 1
    gap = (m[(lo + 1).clamp(max=7)] - m[lo]) * s
    p = torch.where(gap > 0, (y * s - m[lo] * s) / gap.clamp(min=1e-300), 0.0)
    error = (p * (1 - p) / count).sqrt() * gap
    mean = out.double().mean(0)
    covered = error > 0
    assert covered.sum() > n - 3
    assert ((mean - x[0].double()).abs()[covered] <= 5.5 * error[covered]).all()
    assert torch.equal(mean[~covered], x[0].double()[~covered].float().double())


@pytest.mark.parametrize("bucket_size", [None, 1, 7, 100])
def test_bytes_are_4_bits_per_entry_and_4_per_scale(bucket_size):
    c = FP4(bucket_size=bucket_size)
    for d in (1, 2, 7, 100, 301, 4096):
        b = min(bucket_size or d, d)
        assert c.payload_bytes(d) == 4 * math.ceil(d / b) + math.ceil(d / 2)
    codec = c.codec(CHUNKS)
    assert codec.wire_bytes == sum(c.payload_bytes(ch.numel) for ch in CHUNKS)


def test_sync_with_ef14_sends_the_formula_and_trains():
    trainer = run("compressor=fp4", "error_feedback=ef14", "workers=4", "train.steps=30")
    tensors = [p.numel() for p in trainer.replicas.models[0].parameters()]
    per_step = sum(4 + math.ceil(d / 2) for d in tensors)  # one scale per tensor
    assert trainer.summary["comm/bytes"] == 30 * per_step
    assert trainer.summary["train/loss"] < 0.8 * math.log(10)


# -- Streaming DiLoCo with FP4 outer gradients --------------------------------------------------
STREAMING = [
    "algorithm=local_sgd",
    "algorithm.period=8",
    "optimizer=adamw",
    "optimizer.lr=0.003",
    "optimizer.exclude_bn_bias_from_weight_decay=false",
    "workers=4",
    "train.steps=40",
    "model.hidden=[32,32,32]",
    "outer.fragments=3",
]


def test_streaming_fp4_sends_each_fragment_as_the_fp32_mean_of_fp4_messages(monkeypatch):
    """`outer=streaming_fp4`: FP4 E3M0, one scale per tensor, nearest, no error feedback. At
    every merge the outer optimizer gets the mean, in fp32 and worker order, of each worker's Δ
    through FP4 written out here; the bytes of a round are the fragments' FP4 payloads; it
    trains as fp32 outer gradients do, and it is `compressor@outer.compressor=fp4` exactly."""
    calls = []
    reduce = CompressedReducer.reduce

    def recorded(self, rows, step):
        delta = rows.clone()
        reduce(self, rows, step)
        calls.append((self, step, delta, rows[0].clone()))

    monkeypatch.setattr(CompressedReducer, "reduce", recorded)
    trainer = run(*STREAMING, "outer=streaming_fp4")
    monkeypatch.setattr(CompressedReducer, "reduce", reduce)
    compressor = trainer.algorithm.reducers[0].compressor
    assert isinstance(compressor, FP4)
    assert (compressor.format, compressor.rounding, compressor.bucket_size) == (
        "e3m0",
        "nearest",
        None,
    )
    assert not trainer.algorithm.reducers[0].memory.active
    assert len(calls) >= 12
    for reducer, step, delta, mean in calls:
        expected = torch.zeros(delta.shape[1])
        for k in range(delta.shape[0]):
            decoded = torch.empty(delta.shape[1])
            for bucket in reducer.buckets:
                for ch in bucket.chunks:
                    cols = slice(bucket.start + ch.offset, bucket.start + ch.offset + ch.numel)
                    decoded[cols] = fp4_reference(delta[k, cols], "e3m0", ch.numel)[2]
            expected += decoded
        assert torch.equal(mean, expected / delta.shape[0]), step
    per_round = sum(4 + math.ceil(p.numel() / 2) for p in trainer.replicas.models[0].parameters())
    assert trainer.summary["comm/bytes"] == sum(r.payload_bytes() for r, *_ in calls)
    assert sum(r.payload_bytes() for r in trainer.algorithm.reducers) == per_round
    fp32 = run(*STREAMING, "outer=streaming")
    assert fp32.summary["comm/bytes"] > 7 * trainer.summary["comm/bytes"]
    # trains: well below chance (ln 10), within 5 % of the fp32 outer gradients' loss
    loss, reference = trainer.summary["train/loss"], fp32.summary["train/loss"]
    assert loss < 0.6 * math.log(10) and abs(loss - reference) < 0.05 * reference
    same = run(*STREAMING, "outer=streaming", "compressor@outer.compressor=fp4")
    assert torch.equal(same.replicas.params, trainer.replicas.params)


def test_streaming_fp4_e2m1_and_stochastic_options_run():
    for option in ("outer.compressor.format=e2m1", "outer.compressor.rounding=stochastic"):
        trainer = run(*STREAMING, "outer=streaming_fp4", option)
        key, value = option.rsplit(".", 1)[1].split("=")
        assert getattr(trainer.algorithm.reducers[0].compressor, key) == value
        assert trainer.summary["train/loss"] < 0.6 * math.log(10)


def row_only(trainer, summary: dict) -> tuple:
    """What each rank keeps: its parameter row and the summary."""
    return trainer.replicas.params[0].clone(), summary


@pytest.mark.distributed
@pytest.mark.slow  # ~10 s: two processes; the allgather path is covered by faster tests
def test_streaming_fp4_simulated_equals_two_gloo_processes_bit_for_bit(tmp_path):
    """An allgather of FP4 rows, decoded and summed in rank order on both sides: bit for bit."""
    args = [*STREAMING, "workers=2", "outer=streaming_fp4"]
    real = cases_on_gloo(2, tmp_path, {"fp4": args}, row_only, torch.float32)
    simulated = run(*args)
    for rank in range(2):
        params, summary = real[rank]["fp4"]
        assert torch.equal(params, simulated.replicas.params[rank]), rank
        assert summary["comm/bytes"] == simulated.summary["comm/bytes"]
        assert sorted(summary["comm/ops"]) == sorted(simulated.summary["comm/ops"])


# -- bad input: one line naming the choices, before any worker starts -----------------------------
BAD = [
    (["compressor=fp4", "compressor.format=e4m3"],
     "compressor.format=e4m3; choose one of: e3m0 (sign + 3 exponent bits, Streaming DiLoCo's), "
     "e2m1 (sign + 2 exponent bits + 1 mantissa bit, OCP MX FP4)"),
    (["compressor=fp4", "compressor.rounding=up"],
     "compressor.rounding=up; choose one of: nearest, stochastic"),
    (["compressor=fp4", "compressor.bucket_size=0"], "compressor.bucket_size=0: must be >= 1"),
    (["algorithm=local_sgd", "outer=streaming_fp4", "outer.compressor.format=fp8"],
     "outer.compressor.format=fp8; choose one of: e3m0"),
]  # fmt: skip


@pytest.mark.parametrize("args,fragment", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_is_one_error_line(args, fragment, tmp_path, monkeypatch, capsys):
    refused_before_start([*SYNTHETIC_SMALL, *args], fragment, tmp_path, monkeypatch, capsys)
