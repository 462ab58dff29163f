"""The model cut into fragments of whole blocks of layers, and the staggered schedule that
syncs them.

A *layer* is a module that owns trainable parameters directly (a convolution, a BatchNorm, a
linear layer). A *block* is the unit fragments are made of: the outermost module containing a
layer that sits below the model and is not a plain container (`Sequential`, `ModuleList`,
`ModuleDict`) — a ResNet's residual block, a transformer block — or the layer itself when there
is none (a stem convolution, the classifier, an MLP's linear layers). Blocks follow
`model.modules()` order, the order of the `Replicas` flat rows, so a block's parameters are one
contiguous range of columns and its floating-point buffers (BatchNorm statistics) one
contiguous range of the buffer row; a buffer of a module without parameters goes with the block
before it (the first block if none).

Fragments (Streaming DiLoCo, Douillard et al. 2025, §2.2) are groups of blocks:
- "sequential": F runs of consecutive blocks, cut where the running parameter count is closest
  to f·D/F, so each fragment holds ≈ D/F parameters (≥ 1 block each);
- "strided": block b goes to fragment b mod F (the paper's strided pattern, which spreads
  depth over the fragments; sizes follow the blocks').

The schedule (`Schedule`): with period H, F fragments and overlap τ, fragment f is *launched*
after every step whose 1-based count n satisfies n ≡ ⌊f·H/F⌋ (mod H), n ≥ 1 (fragment 0 at
H, 2H, …), and *merged* τ steps later (after step n + τ). F = 1, τ = 0 is DiLoCo's schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

PATTERNS = ("sequential", "strided")
Columns = slice | Tensor


CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class Block:
    """One block: its module name, the indices of its parameter tensors (in
    `model.parameters()` order) and its column ranges in the parameter and buffer rows."""

    name: str
    tensors: tuple[int, ...]
    params: tuple[int, int]
    buffers: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.params[1] - self.params[0]


@dataclass(frozen=True)
class Fragment:
    """A group of blocks: `params` / `buffers` are the columns of the flat rows it covers (a
    slice when they are contiguous, else a sorted index tensor) and `tensors` the indices of
    its parameter tensors, in the rows' order."""

    index: int
    blocks: tuple[Block, ...]
    params: Columns
    buffers: Columns
    tensors: tuple[int, ...]
    numel: int
    buffer_numel: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(block.name for block in self.blocks)


def block_of(model: nn.Module, name: str) -> str:
    """The block the module `name` belongs to (see the module docstring)."""
    parts = name.split(".") if name else []
    for depth in range(1, len(parts)):
        prefix = ".".join(parts[:depth])
        if not isinstance(model.get_submodule(prefix), CONTAINERS):
            return prefix
    return name or type(model).__name__


def blocks_of(model: nn.Module) -> list[Block]:
    """The model's blocks in the flat rows' order (see the module docstring)."""
    found: list[tuple[str, list[int], list[int], list[int]]] = []  # name, tensors, cols, bufs
    tensor = offset = buffer_offset = 0
    seen: set[int] = set()  # a tied parameter (GPT's head is its embedding) belongs to the first
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            block = block_of(model, name)
            numel = sum(p.numel() for p in own)
            ids = list(range(tensor, tensor + len(own)))
            if found and found[-1][0] == block:
                found[-1][1].extend(ids)
                found[-1][2][1] = offset + numel
            else:
                start = 0 if not found else buffer_offset  # leading buffers join the first
                found.append((block, ids, [offset, offset + numel], [start, buffer_offset]))
            tensor, offset = tensor + len(own), offset + numel
        buffer_offset += sum(
            b.numel() for _, b in module.named_buffers(recurse=False) if b.is_floating_point()
        )
        if found:
            found[-1][3][1] = buffer_offset
    if offset != sum(p.numel() for p in model.parameters() if p.requires_grad):
        raise ValueError(
            "the model shares parameters between modules; fragments need each parameter "
            "owned by one layer"
        )
    if len({b[0] for b in found}) != len(found):
        raise ValueError("the model's blocks are not contiguous in its parameter order")
    return [Block(n, tuple(ids), (c[0], c[1]), (b[0], b[1])) for n, ids, c, b in found]


def split(blocks: Sequence[Block], count: int, pattern: str = "sequential") -> list[Fragment]:
    """`count` fragments of `blocks` by `pattern` (see the module docstring)."""
    if pattern not in PATTERNS:
        raise ValueError(f"outer.fragment_pattern={pattern}; choose one of: {', '.join(PATTERNS)}")
    if not 1 <= count <= len(blocks):
        raise ValueError(
            f"outer.fragments={count}: the model has {len(blocks)} blocks of layers; choose 1 "
            f"to {len(blocks)} fragments"
        )
    if pattern == "strided":
        groups = [list(blocks[f::count]) for f in range(count)]
    else:
        groups = _balanced_runs(blocks, count)
    return [_fragment(f, group) for f, group in enumerate(groups)]


def _balanced_runs(blocks: Sequence[Block], count: int) -> list[list[Block]]:
    """Consecutive runs, each cut where the running count is closest to its share of D."""
    sizes = [block.numel for block in blocks]
    total = sum(sizes)
    cumulative = [0]
    for size in sizes:
        cumulative.append(cumulative[-1] + size)
    cuts = [0]
    for f in range(1, count):
        lo, hi = cuts[-1] + 1, len(blocks) - (count - f)  # ≥ 1 block for every fragment
        target = f * total / count
        cuts.append(min(range(lo, hi + 1), key=lambda b: (abs(cumulative[b] - target), b)))
    cuts.append(len(blocks))
    return [list(blocks[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]


def _columns(ranges: Sequence[tuple[int, int]]) -> Columns:
    ranges = [r for r in ranges if r[1] > r[0]]
    if not ranges:
        return slice(0, 0)
    if all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)):
        return slice(ranges[0][0], ranges[-1][1])
    return torch.cat([torch.arange(a, b) for a, b in ranges])


def _fragment(index: int, blocks: Sequence[Block]) -> Fragment:
    return Fragment(
        index=index,
        blocks=tuple(blocks),
        params=_columns([block.params for block in blocks]),
        buffers=_columns([block.buffers for block in blocks]),
        tensors=tuple(t for block in blocks for t in block.tensors),
        numel=sum(block.numel for block in blocks),
        buffer_numel=sum(block.buffers[1] - block.buffers[0] for block in blocks),
    )


def on_device(fragment: Fragment, device: torch.device) -> Fragment:
    """The fragment with its index tensors (if any) on `device`."""

    def move(cols: Columns) -> Columns:
        return cols if isinstance(cols, slice) else cols.to(device)

    return Fragment(
        fragment.index,
        fragment.blocks,
        move(fragment.params),
        move(fragment.buffers),
        fragment.tensors,
        fragment.numel,
        fragment.buffer_numel,
    )


def take(rows: Tensor, cols: Columns) -> Tensor:
    """rows[..., cols]: a view for a slice, a gathered copy for an index."""
    return rows[..., cols] if isinstance(cols, slice) else rows.index_select(-1, cols)


def put(rows: Tensor, cols: Columns, value: Tensor) -> None:
    """rows[..., cols] = value (broadcast over leading dimensions)."""
    if isinstance(cols, slice):
        rows[..., cols].copy_(value)
    else:
        rows.index_copy_(-1, cols, value.expand(*rows.shape[:-1], value.shape[-1]).contiguous())


@dataclass(frozen=True)
class Schedule:
    """When each fragment is launched and merged (see the module docstring)."""

    period: int
    fragments: int = 1
    overlap: int = 0

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ValueError(f"outer.period={self.period}: must be >= 1")
        if not 1 <= self.fragments <= self.period:
            raise ValueError(
                f"outer.fragments={self.fragments} with outer.period={self.period}: at most one "
                "fragment starts per step; use 1 to period fragments"
            )
        if not 0 <= self.overlap < self.period:
            raise ValueError(
                f"outer.overlap={self.overlap} with outer.period={self.period}: a fragment must "
                "be merged before it is sent again; use 0 <= overlap < period"
            )

    def offset(self, fragment: int) -> int:
        """Fragment f is sent after steps n ≡ ⌊f·H/F⌋ (mod H)."""
        return (fragment * self.period) // self.fragments

    def launches(self, done: int) -> list[int]:
        """Fragments sent after step `done` (1-based)."""
        if done < 1:
            return []
        return [f for f in range(self.fragments) if (done - self.offset(f)) % self.period == 0]

    def merges(self, done: int) -> list[int]:
        """Fragments merged after step `done`: those launched τ steps before."""
        return self.launches(done - self.overlap)
