"""Cutting a flat gradient row into compression units (chunks) and communication buckets."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from dpresearch.compress.chunks import Chunk

GRANULARITIES = ("tensor", "bucket", "model")
ParamLayout = Sequence[tuple[int, tuple[int, ...]]]


@dataclass(frozen=True)
class Bucket:
    """Columns [start, end) of the flat row, communicated together; `chunks` tile it (offsets
    relative to `start`)."""

    start: int
    end: int
    chunks: tuple[Chunk, ...]


def param_layout(model: nn.Module) -> list[tuple[int, tuple[int, ...]]]:
    """(offset, shape) of each trainable parameter in the flat row (the `Replicas` order)."""
    layout, offset = [], 0
    for p in model.parameters():
        if p.requires_grad:
            layout.append((offset, tuple(p.shape)))
            offset += p.numel()
    return layout


def tensor_key(index: int) -> str:
    """Chunk key of the `index`-th trainable parameter (shared by reducer and DDP hook)."""
    return f"t{index}"


def plan_buckets(
    layout: ParamLayout, granularity: str, bucket_mb: float, itemsize: int = 4
) -> list[Bucket]:
    """Group consecutive parameters into buckets of at most `bucket_mb` MiB (a larger parameter
    gets its own; bucket_mb ≤ 0: one parameter per bucket), then cut them into chunks:
    - "tensor": one chunk per parameter, with its shape, key "t<i>";
    - "bucket": one chunk per bucket (its tensors flattened together), key "bucket<j>";
    - "model":  a single bucket and chunk covering everything, key "model".
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r}; choose one of: {', '.join(GRANULARITIES)}")
    sizes = [math.prod(shape) for _, shape in layout]
    for (offset, _), (next_offset, _), size in zip(layout, layout[1:], sizes, strict=False):
        if offset + size != next_offset:
            raise ValueError("param layout must tile the flat row: offsets must be contiguous")
    if not layout:
        return []
    total = layout[-1][0] + sizes[-1]
    if granularity == "model":
        return [Bucket(layout[0][0], total, (Chunk("model", 0, total - layout[0][0]),))]

    cap = bucket_mb * 2**20
    groups: list[list[int]] = [[]]
    filled = 0
    for i, size in enumerate(sizes):
        if groups[-1] and (cap <= 0 or (filled + size) * itemsize > cap):
            groups.append([])
            filled = 0
        groups[-1].append(i)
        filled += size

    buckets = []
    for j, group in enumerate(groups):
        start = layout[group[0]][0]
        end = layout[group[-1]][0] + sizes[group[-1]]
        if granularity == "bucket":
            chunks = (Chunk(f"bucket{j}", 0, end - start),)
        else:
            chunks = tuple(
                Chunk(tensor_key(i), layout[i][0] - start, sizes[i], tuple(layout[i][1]))
                for i in group
                if sizes[i] > 0
            )
        buckets.append(Bucket(start, end, chunks))
    return buckets
