"""Sign compressors: scaled sign (EF-signSGD) and majority vote (signSGD / Signum)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dpresearch.compress.base import Chunk, SingleRoundCompressor
from dpresearch.compress.codec import Codec
from dpresearch.compress.kernels import BLOCK, numpy_path
from dpresearch.compress.wire import Spec, pack_rows, packed_size, sign_table

# packed bytes per row above which a gather per row straight into the output beats one gather
# of all rows into scratch and a copy (about 8 µs of copying against a call's few µs)
ROW_GATHER = 4096


class SignCodec(Codec):
    """Sign bits of the whole bucket packed in a few passes (one `pack_rows` per run of chunks
    whose sizes fill whole bytes: all of them in the usual layouts), for all rows at once; the
    scaled sign adds one fp32 scale per chunk, ‖x‖₁/d, summed per group of equal-size chunks."""

    scaled = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.spans = self._spans()
        numels = [float(ch.numel) for ch in self.chunks]
        self.numels = torch.tensor(numels, dtype=torch.float32, device=self.device)
        self.members = [torch.tensor(g.members, device=self.device) for g in self.table.groups]
        # per group: where each of its chunks' packed signs start in the packed-sign region,
        # and all their bytes, [G, ⌈s/8⌉]
        self.dest = []
        for group in self.table.groups:
            starts = [self.layout.slots[i][-1][1] for i in group.members]
            nbytes = torch.arange(packed_size(group.numel, 1))
            every = torch.tensor(starts).unsqueeze(1) + nbytes
            self.dest.append((starts, every.to(self.device)))
        self._signs = sign_table(self.dtype, self.device)
        # per run: the chunk each packed byte belongs to (chunks start on a byte in a run)
        self.byte_chunks = []
        for first, last in self.table.runs(1):
            nbytes = [packed_size(ch.numel, 1) for ch in self.chunks[first:last]]
            chunk_ids = torch.repeat_interleave(torch.arange(first, last), torch.tensor(nbytes))
            self.byte_chunks.append(chunk_ids.to(self.device))
        self._offsets: dict[str, Tensor] = {}

    def _spans(self) -> list[tuple[slice, slice]]:
        """Per run of chunks [first, last): (its columns of a row, its bytes of the packed-sign
        region)."""
        spans = []
        for first, last in self.table.runs(1):
            head, tail = self.chunks[first], self.chunks[last - 1]
            start, end = self.layout.slots[first][-1][1], self.layout.slots[last - 1][-1][1]
            cols = slice(head.offset, tail.offset + tail.numel)
            spans.append((cols, slice(start, end + packed_size(tail.numel, 1))))
        return spans

    def encode_rows(self, x: Tensor, step: int, workers: tuple[int, ...], wire: Tensor) -> None:
        l1 = self._pack_signs(x, wire, l1=self.scaled)
        if l1 is not None:
            self.layout.write_region(wire, torch.float32, l1.div_(self.numels))

    def _pack_signs(self, x: Tensor, wire: Tensor, l1: bool = False) -> Tensor | None:
        """Pack the sign bits of `x` `[R, n]` (1 = negative, −0.0 included) into the packed-bit
        region of `wire`; with `l1`, also return ‖x‖₁ of every chunk of every row, `[R, C]` fp32
        (a workspace buffer; a chunk over `BLOCK` entries accumulates its fp32 block sums in
        fp64), computed per group of equal-size chunks, `BLOCK` entries of each chunk at a time
        (x is read from memory once); without, one sign pass and one `pack_rows` per run of
        chunks, and None. Subclasses that send signs beside other values (1-bit SGD, natural
        compression) call it for the sign bits."""
        rows = x.shape[0]
        bits = self.layout.region(wire, torch.uint8)
        if not l1:  # nothing else to read: one sign pass and one `pack_rows` per run
            for cols, span in self.spans:
                part = x[:, cols]
                negative = self.ws.get("negative", tuple(part.shape), torch.bool, self.device)
                if numpy_path(part):
                    np.signbit(part.numpy(), out=negative.numpy())
                else:
                    torch.signbit(part, out=negative)
                pack_rows(negative, 1, bits[:, span], self.ws)
            return None
        norms = self.ws.get("l1", (rows, len(self.chunks)), torch.float32, self.device)
        for group, members, dest in zip(self.table.groups, self.members, self.dest, strict=True):
            view = self.table.view(x, group)
            total = None
            for start in range(0, group.numel, BLOCK):  # BLOCK is a multiple of 8
                part = view[..., start : start + BLOCK]
                width = part.shape[-1]
                negative = self.ws.get("negative", tuple(part.shape), torch.bool, self.device)
                if numpy_path(part):
                    np.signbit(part.numpy(), out=negative.numpy())
                else:
                    torch.signbit(part, out=negative)
                shape = (rows, len(members), packed_size(width, 1))
                packed = self.ws.get("packed", shape, torch.uint8, self.device)
                pack_rows(negative.view(-1, width), 1, packed.view(-1, shape[-1]), self.ws)
                first = start // 8
                if shape[-1] >= 64:  # long runs of bytes: a copy per chunk
                    for j, begin in enumerate(dest[0]):
                        bits[:, begin + first : begin + first + shape[-1]].copy_(packed[:, j])
                else:  # many short ones: one indexed copy
                    where = dest[1][:, first : first + shape[-1]].reshape(-1)
                    bits.index_copy_(1, where, packed.view(rows, -1))
                if l1:
                    magnitude = self.ws.get("abs", tuple(part.shape), x.dtype, self.device)
                    sums = torch.abs(part, out=magnitude).sum(-1, dtype=torch.float32)
                    if group.numel > BLOCK:
                        total = sums.double() if total is None else total.add_(sums)
            if l1:
                norms.index_copy_(1, members, sums if total is None else total.to(torch.float32))
        return norms if l1 else None

    def decode_rows(self, wire: Tensor, step: int, out: Tensor) -> None:
        tables = None
        if self.scaled:
            scale = self.layout.region(wire, torch.float32)
            rows, chunks = wire.shape[0], len(self.chunks)
            tables = self.ws.get("tables", (rows, chunks, 256, 8), self.dtype, self.device)
            torch.mul(scale.reshape(rows, chunks, 1, 1), self._signs, out=tables)
        self._unpack_signs(wire, out, tables)

    def _unpack_signs(self, wire: Tensor, out: Tensor, tables: Tensor | None = None) -> None:
        """Write the decoded value of every entry of wire rows `[R, L]` into `out` `[R, n]`:
        one gather per run of chunks, each packed byte picking its 8 values from a 256 × 8
        table — ±1 (`sign_table`), or with `tables` `[R, C, 256, 8]` (`out`'s dtype) the table
        of its row and chunk (±scale; 1-bit SGD's two means) — so the values are written once,
        with no unpacked bits in between."""
        packed = self.layout.region(wire, torch.uint8)
        rows = wire.shape[0]
        per_chunk = tables is not None
        tables = tables.view(-1, 8) if per_chunk else self._signs
        for (cols, span), byte_chunks in zip(self.spans, self.byte_chunks, strict=True):
            # (index buffers from the workspace: fresh megabytes would cost page faults)
            codes = self.ws.get("codes", (rows, span.stop - span.start), torch.int32, self.device)
            codes.copy_(packed[:, span])
            if per_chunk:  # row r, chunk c: table r·C + c
                codes.add_(self._table_offsets(byte_chunks, rows, span))
            target = out[:, cols]
            width = cols.stop - cols.start
            whole = width // 8  # bytes whose 8 values all lie in the run
            if target.is_contiguous() and width == codes.shape[1] * 8:
                torch.index_select(tables, 0, codes.view(-1), out=target.view(-1, 8))
                continue
            if target.stride(-1) == 1 and whole >= ROW_GATHER:
                # long rows: each row's whole bytes straight into place, one gather per row,
                # rather than all rows into scratch and a copy of everything
                for r in range(rows):
                    place = target[r, : 8 * whole].view(-1, 8)
                    torch.index_select(tables, 0, codes[r, :whole], out=place)
                codes, target = codes[:, whole:], target[:, 8 * whole :]
                width -= 8 * whole
            values = self.ws.get("values", (rows, codes.shape[1] * 8), self.dtype, self.device)
            torch.index_select(tables, 0, codes.reshape(-1), out=values.view(-1, 8))
            target.copy_(values[:, :width])

    def _table_offsets(self, byte_chunks: Tensor, rows: int, span: slice) -> Tensor:
        """256·(r·C + chunk of the byte) for each packed byte of a run, `[rows, bytes]`
        (built once per row count)."""
        key = f"offsets.{span.start}.{rows}"
        cached = self._offsets.get(key)
        if cached is None:
            first = torch.arange(rows, device=self.device).mul_(len(self.chunks)).unsqueeze(1)
            cached = self._offsets[key] = (byte_chunks + first).mul_(256).to(torch.int32)
        return cached


class ScaledSignCodec(SignCodec):
    scaled = True


class ScaledSign(SingleRoundCompressor):
    """C(x) = (‖x‖₁/d)·sign(x) (Karimireddy et al. 2019, EF-signSGD; zero counts as positive),
    one scale per chunk. Non-linear (per-worker scale): gathered, decoded, averaged. Use it
    with error feedback.

    Wire bytes per chunk of d entries: ⌈d/8⌉ + 4 — one fp32 scale, the signs packed 8 per byte.
    """

    codec_class = ScaledSignCodec

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return [(torch.float32, 1), (torch.uint8, packed_size(chunk.numel, 1))]


class MajorityVote(SingleRoundCompressor):
    """signSGD with majority vote (Bernstein et al. 2018); with local momentum before the
    compressor (`error_feedback.momentum`) this is Signum.

    Each worker sends only sign(x) (zero counts as positive). Aggregation is non-linear: the
    packed signs are gathered, every receiver decodes the K sign vectors, sums them (the vote
    count, an integer in [−K, K], exact in fp32), and `finalize` takes the sign of the sum, so
    the aggregate is ±1 per coordinate, or 0 on a tie (even K). Every worker computes the same
    vote locally — the allgather replaces the paper's parameter server, which would send the
    1-bit vote back. The aggregate has unit magnitude: pair it with a small learning rate.

    Wire bytes per chunk of d entries: ⌈d/8⌉ (signs packed 8 per byte).

    Not a gossip codec: its aggregate is a vote, not a weighted sum of decoded messages; and no
    error feedback (unscaled signs would make the memory accumulate p − sign(p)).
    """

    gossip = False
    memories = ("none",)
    memories_note = (
        "unscaled signs would make the memory accumulate p - sign(p) (Signum: "
        "error_feedback.momentum=0.9; EF-signSGD: compressor=sign)"
    )
    codec_class = SignCodec

    def payload_spec(self, chunk: Chunk, dtype: torch.dtype) -> Spec:
        return [(torch.uint8, packed_size(chunk.numel, 1))]

    def finalize(self, total: Tensor, count: int) -> None:
        total.sign_()
