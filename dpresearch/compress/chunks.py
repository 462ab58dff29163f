"""Chunks (compression units) and the plan-time tables that let a codec treat all chunks of a
bucket, for all rows, in a few batched operations.

A bucket's chunks tile its flat row. `ChunkTable` groups the chunks of equal size: each group
is read from stacked rows `[R, n]` as one `[R, G, s]` tensor — a zero-copy strided view when its
chunks sit at evenly spaced offsets (consecutive layers of one width usually do), else a gather —
so a per-chunk kernel (a norm, a top-k, a threshold) runs once per group instead of once per
chunk and row. Batched reductions along the last dimension give bit-for-bit the results of the
same reduction on each chunk alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Chunk:
    """One compression unit: `numel` elements at `offset` within its bucket's flat row, named
    by a `key` stable across steps (its random streams and state are keyed by it).

    `shape` is the tensor's own shape when the chunk is exactly one parameter (PowerSGD uses it
    to view a conv weight as out × in·k·k), else None.
    """

    key: str
    offset: int
    numel: int
    shape: tuple[int, ...] | None = None

    @property
    def slice(self) -> slice:
        return slice(self.offset, self.offset + self.numel)


@dataclass(frozen=True)
class ChunkGroup:
    """Chunks of one size `numel`: their indices in the bucket's chunk list and offsets, and
    how to view them in a row: evenly spaced (`stride` apart from `offsets[0]`) or not
    (`index`, the `[G·s]` columns to gather)."""

    numel: int
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    stride: int | None
    index: Tensor | None


class ChunkTable:
    """Plan-time facts about a bucket's chunks on one device: sizes, offsets, equal-size groups.

    Groups are maximal runs of evenly spaced chunks of one size (a group of one chunk is
    trivially evenly spaced), so most groups are views; chunks of one size at irregular
    offsets (e.g. BatchNorm weights and biases, 2 per block) are gathered, which costs a copy of
    their (small) total size.
    """

    def __init__(self, chunks: Sequence[Chunk], device: torch.device | str = "cpu") -> None:
        self.chunks = tuple(chunks)
        self.device = torch.device(device)
        self.numel = max((ch.offset + ch.numel for ch in chunks), default=0)
        self.numels = torch.tensor([ch.numel for ch in chunks], dtype=torch.long, device=device)
        self.groups: list[ChunkGroup] = []
        by_size: dict[int, list[int]] = {}
        for i, ch in enumerate(chunks):
            by_size.setdefault(ch.numel, []).append(i)
        for size, members in sorted(by_size.items()):
            members.sort(key=lambda i: chunks[i].offset)
            for run in _even_runs(members, [chunks[i].offset for i in members], min_run=3):
                self.groups.append(self._group(size, run))

    def _group(self, size: int, members: list[int]) -> ChunkGroup:
        offsets = tuple(self.chunks[i].offset for i in members)
        steps = {b - a for a, b in zip(offsets, offsets[1:], strict=False)}
        if len(steps) <= 1:
            return ChunkGroup(size, tuple(members), offsets, steps.pop() if steps else size, None)
        cols = torch.cat([torch.arange(o, o + size) for o in offsets]).to(self.device)
        return ChunkGroup(size, tuple(members), offsets, None, cols)

    def view(self, x: Tensor, group: ChunkGroup) -> Tensor:
        """Group `group` of the stacked rows `x` `[..., n]` (last dimension contiguous) as
        `[..., G, s]`: a view for evenly spaced chunks, else a gathered copy."""
        if group.index is not None:
            # (advanced indexing: index_select would first copy a non-contiguous x whole)
            return x[..., group.index].unflatten(-1, (len(group.members), -1))
        lead = x.shape[:-1]
        return x.as_strided(
            (*lead, len(group.members), group.numel),
            (*x.stride()[:-1], group.stride, 1),
            x.storage_offset() + group.offsets[0],
        )

    def put(self, out: Tensor, group: ChunkGroup, values: Tensor) -> None:
        """Write `values` `[..., G, s]` into group `group`'s columns of `out` `[..., n]`."""
        if group.index is None:
            self.view(out, group).copy_(values)
        else:
            out.index_copy_(-1, group.index, values.flatten(-2))

    def per_element(self, values: Tensor) -> Tensor:
        """Per-chunk values `[..., C]` repeated over each chunk's elements: `[..., n]` (the
        chunks must tile the row in order)."""
        return torch.repeat_interleave(values, self.numels, dim=-1)

    def runs(self, bits: int) -> list[tuple[int, int]]:
        """Chunk index ranges [a, b) whose `bits`-wide streams, packed chunk by chunk and
        concatenated, equal one stream of their elements: every chunk but the last of a range
        fills whole bytes. One `pack_rows` call per range packs all its chunks."""
        runs, start = [], 0
        for i, ch in enumerate(self.chunks):
            if (ch.numel * bits) % 8 or i == len(self.chunks) - 1:
                runs.append((start, i + 1))
                start = i + 1
        return runs


def _even_runs(members: list[int], offsets: list[int], min_run: int) -> list[list[int]]:
    """Split `members` (sorted by offset) into maximal runs of evenly spaced offsets; runs
    shorter than `min_run` are merged into one irregular group (gathered)."""
    runs: list[list[int]] = []
    loose: list[int] = []
    i = 0
    while i < len(members):
        j = i + 1
        if j < len(members):
            step = offsets[j] - offsets[i]
            while j + 1 < len(members) and offsets[j + 1] - offsets[j] == step:
                j += 1
            j += 1
        run = members[i:j]
        if len(run) >= min_run or len(members) == len(run):
            runs.append(run)
        else:
            loose.extend(run)
        i = j
    if loose:
        runs.append(sorted(loose))
    return runs
