"""Natural compression (Horváth et al. 2019): unbiased stochastic rounding to a power of two."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dpresearch.compress import rng
from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.compress.sign import SignCodec
from dpresearch.compress.wire import Spec, packed_size, unpack_rows

MANTISSA_BITS = 23
MAX_FINITE_EXPONENT = 254  # fp32 exponent field of the largest finite power of two, 2^127
BITS_PER_VALUE = (9, 8)


class NaturalCodec(SignCodec):
    """All rows' exponent codes in one pass over the fp32 bit patterns: with e the exponent
    field and m the 23-bit mantissa of |x| = 2^(e−127)·(1 + m/2²³), the code is e + 1 with
    probability m/2²³ (a draw r < m of the worker's 23-bit stream for this chunk and step),
    else e — so |x| becomes the power of two below or above it with the probabilities that
    keep its mean. Zero and subnormals (e = 0) round to 0 or 2⁻¹²⁶ the same way. Decoding
    rebuilds the fp32 word sign | code | 0-mantissa.

    The codes travel in an int8 region of the row (bytes reinterpreted) so that all chunks' codes
    are one contiguous region written in one copy; the sign bits in the packed-bit region of
    the sign codec."""

    compressor: Natural

    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        self._pack_signs(x, wire)
        if x.dtype == torch.float32 and x.is_contiguous():
            bits = x.view(torch.int32)
        else:
            bits = self.ws.get("word", tuple(x.shape), torch.float32, self.device).copy_(x)
            bits = bits.view(torch.int32)
        draws = self.ws.get("draws", tuple(x.shape), torch.int32, self.device)
        for row, worker in enumerate(workers):
            for ch in self.chunks:
                seed = rng.stream_seed("natural", self.compressor.seed, worker, ch.key, step)
                rng.uniform_bits(seed, draws[row, ch.slice], MANTISSA_BITS)
        shape = tuple(x.shape)
        code = torch.bitwise_right_shift(
            bits, MANTISSA_BITS, out=self.ws.get("code", shape, torch.int32, self.device)
        )
        code.bitwise_and_(0xFF)
        # non-finite inputs (exponent field 255) stay non-finite
        nonfinite = torch.eq(code, 0xFF, out=self.ws.get("nonfinite", shape, torch.bool,
                                                          self.device))  # fmt: skip
        mantissa = self.ws.get("mantissa", shape, torch.int32, self.device)
        torch.bitwise_and(bits, (1 << MANTISSA_BITS) - 1, out=mantissa)
        up = torch.lt(draws, mantissa, out=self.ws.get("up", shape, torch.bool, self.device))
        code.add_(up).clamp_(max=MAX_FINITE_EXPONENT).masked_fill_(nonfinite, 0xFF)
        self.layout.write_region(wire, torch.int8, code.to(torch.uint8).view(torch.int8))

    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        # the fp32 word sign | code | 0-mantissa, built with integer shifts (a select between
        # ±word costs several times more)
        shape = tuple(out.shape)
        direct = out.dtype == torch.float32 and out.is_contiguous()
        word = out.view(torch.int32) if direct else self.ws.get("word", shape, torch.int32,
                                                                 self.device)  # fmt: skip
        codes = self.layout.region(wire, torch.int8).view(torch.uint8)
        word.copy_(codes).bitwise_left_shift_(MANTISSA_BITS)
        negative = self.ws.get("negative", shape, torch.int32, self.device)
        packed = self.layout.region(wire, torch.uint8)
        for cols, span in self.spans:
            width = cols.stop - cols.start
            negative[:, cols].copy_(unpack_rows(packed[:, span], 1, width, self.ws))
        word.bitwise_or_(negative.bitwise_left_shift_(31))
        if not direct:
            out.copy_(word.view(torch.float32))


class Natural(SingleRoundCompressor):
    """Natural compression C_nat (Horváth et al. 2019): every entry x ≠ 0 with
    2^a ≤ |x| < 2^(a+1) becomes sign(x)·2^a with probability (2^(a+1) − |x|)/2^a and
    sign(x)·2^(a+1) otherwise. Unbiased, E C(x) = x, with variance E(C(x) − x)² ≤ x²/8 per
    entry (the worst case is |x| = (4/3)·2^a), so E‖C(x) − x‖² ≤ ‖x‖²/8 — the paper's ω = 1/8 —
    for fp32 normals, |x| ≥ 2^-126; a subnormal rounds to 0 or 2^-126 (unbiased, outside the
    bound: no subnormal power of two has a code).

    An fp32 power of two needs only its sign and its 8-bit exponent field: 9 bits per value
    (zero is exponent 0; the exponent of the largest finite power is 254, so |x| ≥ 2^127 cannot
    round up and is kept at 2^127 — biased there; non-finite inputs stay non-finite).
    Randomness: one 23-bit draw per entry from the worker's stream for (seed, worker, chunk,
    step). Non-linear (per-worker rounding): gathered, decoded, averaged. Unbiased, so it
    trains without error feedback; any mode is accepted.

    Wire bytes per chunk of d entries: d + ⌈d/8⌉ (the exponents, then the sign bits).

    bits_per_value: the byte ledger's count. 9 (default; the paper's sign + 8-bit exponent):
    the wire row as sent, d + ⌈d/8⌉. 8 (GRACE's `natural`, one int8 per value with the sign
    folded in and the exponent clamped to [2⁻¹¹⁰, 2¹⁷]): d bytes per chunk recorded for the
    same wire row — only the ledger (and the time modeled from it) changes, not the values
    (GRACE's clamp is not applied). The codes are still decoded from our 9-bit row, so with 8
    the codec serves the synchronous allgather only (gossip and pushes, which price the wire
    row itself, are refused).
    """

    codec_class = NaturalCodec

    def __init__(self, seed: int = 0, bits_per_value: int = 9) -> None:
        super().__init__(seed)
        if isinstance(bits_per_value, bool) or bits_per_value not in BITS_PER_VALUE:
            raise ValueError(
                f"bits_per_value={bits_per_value}; choose one of: 9 (sign + exponent, the "
                "paper's), 8 (GRACE's byte per value)"
            )
        self.bits_per_value = int(bits_per_value)
        if self.bits_per_value == 8:  # an instance trait: the check reads the instance
            self.gossip = False
            self.gossip_note = (
                "with bits_per_value=8 counts bytes other than its wire row, which gossip and "
                "pushes price; set compressor.bits_per_value=9"
            )

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return [(torch.int8, chunk.numel), (torch.uint8, packed_size(chunk.numel, 1))]

    def payload_bytes(
        self, numel: int, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32
    ) -> int:
        if self.bits_per_value == 8:
            return numel
        return super().payload_bytes(numel, shape, dtype)

    def charged_bytes(self, chunks: Sequence[Chunk]) -> int | None:
        return sum(ch.numel for ch in chunks) if self.bits_per_value == 8 else None
