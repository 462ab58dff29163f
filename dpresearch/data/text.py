"""Text corpora for language models: windows of tokens from a stream of token ids.

Sources (`TextDataset.load`, the `_target_` of `data=shakespeare` and `data=text`):
- a `.txt` file, or a folder of them (each file one *work*, read in name order), tokenized
  and held whole on the training device (int32);
- pre-tokenized files (`token_files.py`), memory-mapped (`memmap`; false: read whole into
  memory): nanoGPT's layout, a folder with `train.bin` and `val.bin` (token ids, `dtype` uint16
  by default, as nanoGPT's `prepare.py` writes them; `test.bin` if present, else the validation
  ids serve as the test split too), or llm.c's shards (`*_train_*.bin`, `*_val_*.bin`: a 256 ×
  int32 header, then the ids; each shard a *work*, and no window spans two shards). The
  vocabulary: `meta.pkl` (read with an unpickler that builds plain containers only) or
  `meta.json` (`{"vocab_size": N, "itos": {...}}`), or `data.vocab_size` where there is
  neither.

Splits, fixed for every run: the works named in `val_works` / `test_works` are held out whole
(the shared Shakespeare corpus: two plays each); without named works, the last `test_fraction`
of the text is the test split and the `val_fraction` before it the validation split. Evaluation
reads a fixed set of windows of each split: `eval_tokens // block_size` windows spread evenly.

Training examples are windows of `block_size + 1` tokens (inputs, and targets one token later).
Each worker draws its windows at random from its own shard with its own seeded stream
(`WindowPartitioner`); an epoch is the training tokens once (N // block_size windows in all).
A shard is a list of ranges of the stream laid back to back (`Layout`); a window may run from
one range into the next, but never from one segment of the stream (a shard file) into another.
Partitions (`partition`): `iid` (the stream cut into pieces of `piece` tokens, dealt at random
to the workers: contiguous text inside, the whole corpus's mix across), `contiguous` (K
consecutive shards of the stream), `shared` (every worker samples the whole stream, as nanoGPT's
DDP ranks do), `by_work` (whole works per worker, balanced by size: non-IID), `by_role` (LEAF's
split: the speeches of each speaking role of each play together, roles dealt to workers by
size) and `dirichlet` (each work's pieces spread over the workers by Dir(alpha) proportions).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dpresearch.data.base import Dataset
from dpresearch.data.partition import DirichletPartitioner, Partitioner
from dpresearch.data.token_files import TokenMap, is_token_folder, open_splits
from dpresearch.data.tokenize import Vocabulary, make_vocabulary
from dpresearch.models.sampling import sample_tokens

TEXT_PARTITIONS = ("iid", "contiguous", "shared", "by_work", "by_role", "dirichlet")
# A speaker's name on its own line, ending in a full stop ("Ham.", "First Clown."), between a
# blank line and the speech: how the Gutenberg plays mark who speaks.
SPEAKER = re.compile(r"^[A-Z0-9][A-Za-z0-9'\- ]{0,30}\.$")
BIN_DTYPES = ("uint16", "uint32", "int32", "int64")
# The unigram entropy of a longer stream is estimated from this many tokens, in 64 chunks
# spread evenly over it (exact below: every token of the shipped corpora).
UNIGRAM_TOKENS = 1 << 24
Stream = Tensor | TokenMap  # a split's token ids: in memory, or memory-mapped files


@dataclass
class TextDataset(Dataset):
    """A tokenized corpus: `train_inputs` / `val_inputs` / `test_inputs` are the token streams
    of the three splits (int32 tensors, or `TokenMap`s of token files); `test_targets` /
    `val_targets` the start positions of each split's fixed evaluation windows. A model maps
    token windows `[B, T]` to logits `[B, T, V]` (`num_classes` = the vocabulary's size); the
    loss is the mean cross-entropy per token.

    `works`: (name, start, end) of each work in the training stream; `speeches`: rows (role,
    start, end) of every speech, `roles` their names ("work/speaker").
    """

    PARTITIONS: ClassVar[tuple[str, ...]] = TEXT_PARTITIONS
    own_validation: ClassVar[bool] = True

    block_size: int = 64
    vocab: Vocabulary = field(default_factory=lambda: Vocabulary("byte", 256))
    works: tuple[tuple[str, int, int], ...] = ()
    speeches: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    roles: tuple[str, ...] = ()
    piece: int = 1024
    sample_tokens: int = 500
    source: str = ""
    # characters per token of each split (1 for a char vocabulary): bits per character
    chars_per_token: dict[str, float] = field(default_factory=dict)
    # The window layout of the last `make_partitioner`: the ranges of the training stream of
    # each worker's shard, back to back (None: the stream itself).
    _layout_ranges: Layout | None = field(default=None, init=False, repr=False)

    # -- shapes and counts ------------------------------------------------------------------

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.block_size,)

    @property
    def output_shape(self) -> tuple[int, ...]:
        return (self.block_size, self.num_classes)

    @property
    def num_train(self) -> int:
        """Training windows in an epoch: the training tokens once."""
        return int(self.train_inputs.shape[0]) // self.block_size

    @property
    def tokens_per_example(self) -> int:
        return self.block_size

    @cached_property
    def unigram_bits(self) -> float:
        """Entropy of the training tokens' unigram distribution, in bits per character: what a
        model that ignores context achieves at best (over `UNIGRAM_TOKENS` tokens spread over
        a longer stream)."""
        stream, n = self.train_inputs, int(self.train_inputs.shape[0])
        chunk = min(n, UNIGRAM_TOKENS // 64) if n > UNIGRAM_TOKENS else n
        starts = np.linspace(0, n - chunk, 64 if n > UNIGRAM_TOKENS else 1).astype(np.int64)
        counts = sum(
            np.bincount(stream[a : a + chunk].cpu().numpy(), minlength=self.num_classes)
            for a in starts.tolist()
        )
        p = torch.from_numpy(counts[counts > 0] / counts.sum())
        return float(-(p * p.log2()).sum()) / self.chars_per_token.get("train", 1.0)

    def facts(self) -> dict[str, Any]:
        facts = {
            "data/tokenizer": self.vocab.kind,
            "data/vocab_size": self.vocab.size,
            "data/vocab_fingerprint": self.vocab.fingerprint,
            "data/train_tokens": int(self.train_inputs.shape[0]),
            "data/block_size": self.block_size,
            "data/unigram_bits_per_char": round(self.unigram_bits, 4),
        }
        for split in ("val", "test"):
            stream = getattr(self, f"{split}_inputs")
            if stream is not None:
                facts[f"data/{split}_tokens"] = int(stream.shape[0])
        return facts

    def to(self, device: torch.device | str) -> TextDataset:
        super().to(device)
        if self._layout_ranges is not None:
            self._layout_ranges = self._layout_ranges.to(device)
        return self

    def hold_out(self, size: float, seed: int = 0) -> TextDataset:
        if size:
            raise ValueError(
                f"train.val_size={size}: a text corpus holds out its own validation split "
                "(data.val_works or data.val_fraction); set train.val_size=0"
            )
        return self

    # -- batches ----------------------------------------------------------------------------

    def windows(self, stream: Stream, starts: Tensor, layout: Layout | None) -> Tensor:
        """`[N, block_size + 1]` token windows of `stream` at `starts` (positions in `layout`,
        or in the stream itself), as int64."""
        at = starts[:, None] + torch.arange(self.block_size + 1, device=starts.device)
        if layout is not None:
            at = layout.positions(at)
        return stream[at].long()

    def train_batch(
        self, indices: Tensor, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        if indices.device != self.train_inputs.device:
            indices = indices.to(self.train_inputs.device)
        w = self.windows(self.train_inputs, indices, self._layout_ranges)
        return w[:, :-1], w[:, 1:]

    def train_batches(
        self, indices: Sequence[Tensor], generators: Sequence[torch.Generator | None]
    ) -> tuple[Tensor, Tensor]:
        x, y = self.train_batch(torch.cat(list(indices)))
        return x.view(len(indices), -1, self.block_size), y.view(len(indices), -1, self.block_size)

    def transform_test(self, inputs: Tensor) -> Tensor:
        return inputs

    def test_batches(
        self, batch_size: int, shard: int = 0, num_shards: int = 1, split: str = "test"
    ) -> Iterator[tuple[Tensor, Tensor]]:
        stream, starts = getattr(self, f"{split}_inputs"), getattr(self, f"{split}_targets")
        n = int(starts.shape[0])
        lo, hi = shard * n // num_shards, (shard + 1) * n // num_shards
        for begin in range(lo, hi, batch_size):
            w = self.windows(stream, starts[begin : min(begin + batch_size, hi)], None)
            yield w[:, :-1], w[:, 1:]

    def probe_batch(
        self, rows: int, batch: int, generator: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        shape = (rows, batch, self.block_size)
        return (
            torch.randint(self.num_classes, shape, generator=generator),
            torch.randint(self.num_classes, shape, generator=generator),
        )

    def sample(self, model: torch.nn.Module, generator: torch.Generator) -> str | None:
        """`sample_tokens` tokens generated by `model` after the first window of the test
        split (the prompt, included), each drawn from the softmax of the model's last
        position over at most `block_size` tokens of context."""
        if not self.sample_tokens:
            return None
        prompt = self.test_inputs[: self.block_size].long()[None]
        tokens = sample_tokens(
            model, prompt, self.sample_tokens, self.block_size, generator=generator
        )
        ids, start = tokens[0].tolist(), prompt.shape[1]
        return (
            f"{self.vocab.decode(ids[:start])}\n---- generated: ----\n"
            f"{self.vocab.decode(ids[start:])}\n"
        )

    # -- the objective ----------------------------------------------------------------------

    def loss(self, outputs: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
        """Mean cross-entropy per token; with `reduction="sum"`, the sum over windows of each
        window's mean (so that a sum divided by the number of windows is the mean per token)."""
        flat = F.cross_entropy(
            outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1), reduction=reduction
        )
        return flat / targets.shape[-1] if reduction == "sum" else flat

    def hits(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Per window, the fraction of its tokens predicted right (next-token accuracy)."""
        return (outputs.argmax(-1) == targets).float().mean(-1)

    def split_metrics(self, split: str, loss: float) -> dict[str, float]:
        """Bits per character of a split's mean loss per token (and, where a token is not one
        character, bits per token and perplexity)."""
        bits = loss / math.log(2)
        result = {f"{split}/bpc": bits / self.chars_per_token.get(split, 1.0)}
        if not self.vocab.is_characters:
            result[f"{split}/bits_per_token"] = bits
            result[f"{split}/ppl"] = math.exp(min(loss, 700.0))
        return result

    # -- partitions -------------------------------------------------------------------------

    def make_partitioner(self, num_workers: int, seed: int) -> WindowPartitioner:
        """The partitioner of `self.partition`; the data set reads its training windows through
        the layout of the partitioner it made last."""
        ranges, identity = self._shard_ranges(num_workers, seed)
        if identity:
            layout = None
            shards = [(int(r[0, 0]), int(r[0, 1] - r[0, 0])) for r in ranges]
        else:
            layout, shards = _concat(ranges)
        bounds = np.array([0] + [b for _, b in _segments(self.train_inputs)], dtype=np.int64)
        spans = [
            _spans(r, offset, bounds) if len(bounds) > 2 else np.array([[offset, length]])
            for r, (offset, length) in zip(ranges, shards, strict=True)
        ]
        need = self.block_size + 1
        for worker, ((_, length), s) in enumerate(zip(shards, spans, strict=True)):
            if (s[:, 1] >= need).any():
                continue
            where = " in any one file of the corpus" if len(bounds) > 2 else ""
            raise ValueError(
                f"data.partition={self.partition}: worker {worker}'s shard holds {length} "
                f"tokens, fewer than one window of data.block_size+1={need}{where}; use fewer "
                "workers, a smaller data.block_size or another data.partition"
            )
        device = self.train_inputs.device
        self._layout_ranges = None if layout is None else layout.to(device)
        return WindowPartitioner(self.num_train, num_workers, seed, shards, self.block_size, spans)

    def _shard_ranges(self, k: int, seed: int) -> tuple[list[np.ndarray], bool]:
        """Each worker's ranges of the training stream (`[M, 2]`: start, end), in the order
        they are laid out, and whether the layout is the stream itself (each worker one range,
        at its own position)."""
        n = int(self.train_inputs.shape[0])
        kind = self.partition
        if kind == "shared":
            return [np.array([[0, n]])] * k, True
        if kind == "contiguous":
            return [np.array([[w * n // k, (w + 1) * n // k]]) for w in range(k)], True
        if kind == "iid":
            pieces = _pieces(_segments(self.train_inputs), self.piece)
            order = np.random.default_rng([seed % 2**64, 0x4949]).permutation(len(pieces))
            if len(pieces) < k:
                raise ValueError(
                    f"data.partition=iid: {len(pieces)} pieces of data.piece={self.piece} "
                    f"tokens cannot be dealt to {k} workers; lower data.piece"
                )
            return [pieces[np.sort(order[w::k])] for w in range(k)], False
        if kind == "by_work":
            sizes = [end - start for _, start, end in self.works]
            if len(sizes) < k:
                raise ValueError(
                    f"data.partition=by_work: {len(sizes)} training works cannot go to {k} "
                    "workers; use data.partition=by_role or dirichlet, or fewer workers"
                )
            groups = _balance(sizes, k)
            return [np.array([self.works[i][1:] for i in g]).reshape(-1, 2) for g in groups], False
        if kind == "by_role":
            sizes_by_role = np.bincount(
                self.speeches[:, 0],
                weights=self.speeches[:, 2] - self.speeches[:, 1],
                minlength=len(self.roles),
            )
            if len(self.roles) < k:
                raise ValueError(
                    f"data.partition=by_role: {len(self.roles)} speaking roles cannot go to {k} "
                    "workers; use fewer workers"
                )
            groups = _balance(sizes_by_role.tolist(), k)
            shards = []
            for group in groups:
                rows = self.speeches[np.isin(self.speeches[:, 0], group)]
                rows = rows[np.lexsort((rows[:, 1], rows[:, 0]))]  # role by role, in text order
                shards.append(rows[:, 1:])
            return shards, False
        if kind == "dirichlet":
            cuts = [_pieces([(start, end)], self.piece) for _, start, end in self.works]
            pieces = np.concatenate(cuts)
            labels = np.repeat(np.arange(len(cuts)), [len(c) for c in cuts])
            split = DirichletPartitioner(torch.from_numpy(labels), k, seed, self.alpha)
            return [pieces[shard.numpy()] for shard in split.shards], False
        raise ValueError(f"data.partition={kind}; choose one of: {', '.join(TEXT_PARTITIONS)}")

    # -- loading ----------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        root: str | os.PathLike[str],
        tokenizer: str = "char",
        block_size: int = 64,
        val_works: Sequence[str] = (),
        test_works: Sequence[str] = (),
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        partition: str = "iid",
        alpha: float = 1.0,
        piece: int = 1024,
        eval_tokens: int = 65536,
        sample_tokens: int = 500,
        vocab_size: int | None = None,
        dtype: str = "uint16",
        memmap: bool = True,
        device: str | torch.device = "cpu",
    ) -> TextDataset:
        """Read the corpus at `root` (see the module docstring) and place it on `device`.
        Missing data raises FileNotFoundError, unusable data or options ValueError, each one
        line naming the fix."""
        if dtype not in BIN_DTYPES:
            raise ValueError(f"data.dtype={dtype}; choose one of: {', '.join(BIN_DTYPES)}")
        if not isinstance(memmap, bool):
            raise ValueError(f"data.memmap={memmap} must be true or false")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"data.block_size={block_size} must be a positive integer")
        if not isinstance(piece, int) or piece < block_size + 1:
            raise ValueError(
                f"data.piece={piece} must be an integer >= data.block_size+1={block_size + 1}"
            )
        if not isinstance(eval_tokens, int) or eval_tokens < block_size:
            raise ValueError(
                f"data.eval_tokens={eval_tokens} must be an integer >= data.block_size"
            )
        for key, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 0.5:
                raise ValueError(f"data.{key}={value} must be a number in (0, 0.5), e.g. 0.05")
        if (
            isinstance(sample_tokens, bool)
            or not isinstance(sample_tokens, int)
            or sample_tokens < 0
        ):
            raise ValueError(
                f"data.sample_tokens={sample_tokens} must be an integer >= 0 (tokens generated "
                "into sample.txt at the end; 0: none)"
            )
        path = Path(root).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"data.root={root} does not exist; point data.root at a .txt file, a folder of "
                ".txt files or a nanoGPT folder with train.bin and val.bin"
            )
        if is_token_folder(path):
            parts = _read_bins(path, vocab_size, dtype, memmap)
        else:
            parts = _read_texts(path, tokenizer, val_works, test_works, val_fraction, test_fraction)
        vocab, streams, works, speeches, roles, cpt = parts
        tensors: dict[str, Stream] = {}
        for split, ids in streams.items():
            longest = max(b - a for a, b in _segments(ids))
            if longest < block_size + 2:
                raise ValueError(
                    f"data.block_size={block_size}: the {split} split holds only {longest} "
                    "tokens (in any one file), fewer than one window; lower data.block_size or "
                    "give more text"
                )
            tensors[split] = (
                ids if isinstance(ids, TokenMap) else torch.from_numpy(ids.astype(np.int32))
            )
        starts = {
            s: _eval_starts(_segments(streams[s]), block_size, eval_tokens) for s in ("val", "test")
        }
        return cls(
            train_inputs=tensors["train"],
            train_targets=torch.tensor([end - start for _, start, end in works]),
            test_inputs=tensors["test"],
            test_targets=starts["test"],
            val_inputs=tensors["val"],
            val_targets=starts["val"],
            num_classes=vocab.size,
            partition=partition,
            alpha=alpha,
            block_size=block_size,
            vocab=vocab,
            works=tuple(works),
            speeches=speeches,
            roles=tuple(roles),
            piece=piece,
            sample_tokens=sample_tokens,
            source=str(path),
            chars_per_token=cpt,
        ).to(device)


class WindowPartitioner(Partitioner):
    """Random windows from each worker's shard: in epoch e, worker w draws
    `samples_per_worker` window starts uniformly in its shard (offset, length), from numpy's
    generator seeded (seed, e, w) — a pure function, the same in every process.
    `samples_per_worker` is N // K (N windows in an epoch), whatever the shard's size.

    `spans[w]` (`[S, 2]`: offset, length): the parts of worker w's shard a window may not leave
    (one per file of the corpus it holds); a start is drawn uniformly among the starts of whole
    windows inside one span. By default each shard is one span (the same draw)."""

    def __init__(
        self,
        num_examples: int,
        num_workers: int,
        seed: int,
        shards: Sequence[tuple[int, int]],
        block_size: int,
        spans: Sequence[np.ndarray] | None = None,
    ) -> None:
        super().__init__(num_examples, num_workers, seed)
        self.shards = list(shards)
        self.block_size = block_size
        self.spans = list(spans) if spans is not None else [np.array([s]) for s in shards]

    @property
    def samples_per_worker(self) -> int:
        return self.num_examples // self.num_workers

    def epoch_indices(self, worker: int, epoch: int) -> Tensor:
        return self.draw(worker, self.rng(worker, epoch), self.samples_per_worker)

    def rng(self, worker: int, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed % 2**64, epoch, worker, 0x5458])

    def draw(self, worker: int, rng: np.random.Generator, count: int) -> Tensor:
        """The next `count` window starts of `worker` from its epoch's `rng`."""
        spans = self.spans[worker]
        rooms = np.maximum(spans[:, 1] - self.block_size, 0)
        draws = rng.integers(0, rooms.sum(), size=count)
        return torch.from_numpy(_span_starts(draws, spans[:, 0], rooms))

    def epoch_batches(
        self, worker: int, epoch: int, batch_size: int, steps: int, device: torch.device
    ) -> Sequence[Tensor]:
        """`epoch_indices`'s batches drawn as they are read (`DrawnBatches`): an epoch of a
        large corpus holds millions of windows."""
        return DrawnBatches(self, worker, epoch, batch_size, steps, device)


class DrawnBatches(Sequence[Tensor]):
    """A worker's epoch of `WindowPartitioner` batches, drawn `CHUNK_WINDOWS` windows at a time
    as they are read (forward; reading an earlier chunk draws again from the epoch's start).
    Numpy's bounded draws continue one stream across calls, so batch n is
    `epoch_indices(worker, epoch)[n * batch_size : (n + 1) * batch_size]`, and a resumed run
    reads the same batches; an epoch's indices are never held whole."""

    CHUNK_WINDOWS = 1 << 16

    def __init__(
        self,
        part: WindowPartitioner,
        worker: int,
        epoch: int,
        batch_size: int,
        steps: int,
        device: torch.device,
    ) -> None:
        self.part, self.worker, self.epoch = part, worker, epoch
        self.batch_size, self.steps, self.device = batch_size, steps, device
        self.per_chunk = max(1, self.CHUNK_WINDOWS // batch_size)  # batches a chunk
        self._rng: np.random.Generator | None = None
        self._drawn = 0  # chunks drawn from `_rng`
        self._chunk, self._batches = -1, ()

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, pos):  # type: ignore[override]
        if not 0 <= pos < self.steps:
            raise IndexError(pos)
        chunk, at = divmod(pos, self.per_chunk)
        if chunk != self._chunk:
            if self._rng is None or chunk < self._drawn:
                self._rng, self._drawn = self.part.rng(self.worker, self.epoch), 0
            while self._drawn <= chunk:  # (chunks before the one asked for: drawn, dropped)
                batches = min(self.per_chunk, self.steps - self._drawn * self.per_chunk)
                starts = self.part.draw(self.worker, self._rng, batches * self.batch_size)
                self._drawn += 1
            self._batches = starts.to(self.device).split(self.batch_size)
            self._chunk = chunk
        return self._batches[at]


# -- helpers ---------------------------------------------------------------------------------


@dataclass
class Layout:
    """Ranges of the training stream laid back to back: range i starts at layout position
    `offsets[i]` and stream position `starts[i]` (no empty range), and runs to the next."""

    offsets: Tensor
    starts: Tensor

    def positions(self, at: Tensor) -> Tensor:
        """The stream positions of layout positions `at` (any shape)."""
        i = torch.searchsorted(self.offsets, at, right=True) - 1
        return self.starts[i] + (at - self.offsets[i])

    def to(self, device: torch.device | str) -> Layout:
        return Layout(self.offsets.to(device), self.starts.to(device))


def _segments(stream: Stream | np.ndarray) -> list[tuple[int, int]]:
    """The (start, end) ranges of `stream` no window may span: its files (one range for a
    stream in memory)."""
    return stream.segments if isinstance(stream, TokenMap) else [(0, len(stream))]


def _span_starts(draws: np.ndarray, offsets: np.ndarray, rooms: np.ndarray) -> np.ndarray:
    """Window starts of `draws`, indices into the spans' starts (`rooms[j]` starts from
    `offsets[j]` on), span after span."""
    if len(rooms) == 1:
        return draws + offsets[0]
    ends = np.cumsum(rooms)
    j = np.searchsorted(ends, draws, side="right")
    return offsets[j] + draws - (ends[j] - rooms[j])


def _pieces(ranges: Sequence[tuple[int, int]], size: int) -> np.ndarray:
    """`ranges` cut into consecutive pieces of at most `size` tokens (`[M, 2]`: start, end)."""
    cuts = [np.arange(start, end, size, dtype=np.int64) for start, end in ranges]
    ends = [np.minimum(a + size, end) for a, (_, end) in zip(cuts, ranges, strict=True)]
    return np.stack([np.concatenate(cuts), np.concatenate(ends)], 1)


def _balance(sizes: Sequence[float], k: int) -> list[list[int]]:
    """Items (by index) dealt to `k` groups, largest first to the least loaded group (ties: the
    lower index): groups of nearly equal total size, deterministically."""
    loads = [0.0] * k
    groups: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        g = min(range(k), key=lambda g: (loads[g], g))
        groups[g].append(i)
        loads[g] += sizes[i]
    return [sorted(g) for g in groups]


def _concat(shards: Sequence[np.ndarray]) -> tuple[Layout, list[tuple[int, int]]]:
    """The layout of each shard's ranges (`[M, 2]`), back to back, and each shard's (offset,
    length) in it."""
    ranges = np.concatenate([r.reshape(-1, 2) for r in shards]).astype(np.int64)
    lengths = ranges[:, 1] - ranges[:, 0]
    offsets = np.cumsum(lengths) - lengths
    totals = [int((r[:, 1] - r[:, 0]).sum()) for r in shards]
    firsts = np.cumsum(totals) - totals
    keep = lengths > 0  # an empty range would share its successor's offset
    layout = Layout(torch.from_numpy(offsets[keep]), torch.from_numpy(ranges[keep, 0]))
    return layout, [(int(a), t) for a, t in zip(firsts, totals, strict=True)]


def _spans(ranges: np.ndarray, offset: int, bounds: np.ndarray) -> np.ndarray:
    """The spans (`[S, 2]`: layout offset, length) of a shard whose `ranges` are laid back to
    back from layout position `offset`: the ranges cut at the segment `bounds` (0, the end of
    each segment), consecutive pieces of one segment joined."""
    pieces = []
    for a, b in ranges.reshape(-1, 2).tolist():
        inner = bounds[(bounds > a) & (bounds < b)].tolist()
        pieces += list(zip([a, *inner], [*inner, b], strict=True))
    cut = np.array(pieces, dtype=np.int64).reshape(-1, 2)
    cut = cut[cut[:, 1] > cut[:, 0]]
    lengths = cut[:, 1] - cut[:, 0]
    segment = np.searchsorted(bounds, cut[:, 0], side="right")
    first = np.flatnonzero(np.r_[True, segment[1:] != segment[:-1]])
    starts = offset + np.cumsum(lengths) - lengths
    return np.stack([starts[first], np.add.reduceat(lengths, first)], 1)


def _eval_starts(segments: Sequence[tuple[int, int]], block_size: int, eval_tokens: int) -> Tensor:
    """Start positions of a split's evaluation windows: as many as `eval_tokens` allow (at
    most the non-overlapping ones), spread evenly over the starts of whole windows inside one
    segment (a file) of the split."""
    n = segments[-1][1]
    count = max(1, min(eval_tokens // block_size, (n - 1) // block_size))
    offsets = np.array([a for a, _ in segments], dtype=np.int64)
    rooms = np.array([max(b - a - block_size, 0) for a, b in segments], dtype=np.int64)
    draws = torch.linspace(0, rooms.sum() - 1, count, dtype=torch.float64).round().long()
    return torch.from_numpy(_span_starts(draws.numpy(), offsets, rooms))


def _read_text(file: Path) -> str:
    raw = file.read_bytes()
    if b"\x00" in raw:
        raise ValueError(
            f"data.root: {file} is not text (binary content); point data.root at .txt files "
            "or a nanoGPT folder with train.bin and val.bin"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(
            f"data.root: {file} is not UTF-8 text; convert it, or use data.tokenizer=byte on "
            "a UTF-8 copy"
        ) from None


def _read_texts(
    path: Path,
    tokenizer: str,
    val_works: Sequence[str],
    test_works: Sequence[str],
    val_fraction: float,
    test_fraction: float,
):
    """The splits of a `.txt` file or folder, tokenized."""
    files = [path] if path.is_file() else sorted(path.glob("*.txt"))
    if not files:
        raise ValueError(
            f"data.root={path} holds no .txt file; point data.root at a .txt file, a folder of "
            "them or a nanoGPT folder with train.bin and val.bin"
        )
    docs = [(f.stem, _read_text(f)) for f in files]
    if not any(text.strip() for _, text in docs):
        raise ValueError(f"data.root={path}: the corpus is empty; give it some text")
    names = {name for name, _ in docs}
    for key, chosen in (("val_works", val_works), ("test_works", test_works)):
        missing = [w for w in chosen if w not in names]
        if missing:
            raise ValueError(
                f"data.{key}: {missing[0]} is not a work of data.root={path}; choose among its "
                f"file names without .txt, e.g. {sorted(names)[0]}"
            )
    if set(val_works) & set(test_works):
        raise ValueError("data.val_works and data.test_works share a work; hold each out once")
    vocab = make_vocabulary(tokenizer, [text for _, text in docs])
    if val_works or test_works:
        if not (val_works and test_works):
            raise ValueError("data.val_works and data.test_works: name works for both or neither")
        train_docs = [(n, t) for n, t in docs if n not in val_works and n not in test_works]
        held = {
            "val": "".join(t for n, t in docs if n in val_works),
            "test": "".join(t for n, t in docs if n in test_works),
        }
    else:
        train_docs, held = _cut_fractions(docs, val_fraction, test_fraction)
    if not train_docs:
        raise ValueError("data.val_works/test_works hold out every work; leave some to train on")
    stream, works, speeches, roles = _encode_works(vocab, train_docs)
    streams = {"train": stream, **{s: vocab.encode(t) for s, t in held.items()}}
    cpt = {s: vocab.chars_per_token(ids[:200_000]) for s, ids in streams.items()}
    return vocab, streams, works, speeches, roles, cpt


def _cut_fractions(docs, val_fraction: float, test_fraction: float):
    """Training documents and the held-out texts: the last `test_fraction` of the characters
    is the test split, the `val_fraction` before it the validation split."""
    total = sum(len(t) for _, t in docs)
    cuts = [round(total * (1 - val_fraction - test_fraction)), round(total * (1 - test_fraction))]
    train, val, test, at = [], [], [], 0
    for name, text in docs:
        a, b = at, at + len(text)
        lo, hi = min(max(cuts[0] - a, 0), len(text)), min(max(cuts[1] - a, 0), len(text))
        if lo > 0:
            train.append((name, text[:lo]))
        val.append(text[lo:hi])
        test.append(text[hi:])
        at = b
    return train, {"val": "".join(val), "test": "".join(test)}


def _speeches(text: str) -> list[tuple[str, int, int]]:
    """(speaker, start, end) character spans of `text`'s speeches; the text before the first
    speaker line, and a text without any (a poem), is one span with speaker ""."""
    lines = text.split("\n")
    spans, starts, offset = [], [], 0
    for i, line in enumerate(lines):
        blank_before = i == 0 or not lines[i - 1].strip()
        next_text = i + 1 < len(lines) and bool(lines[i + 1].strip())
        if blank_before and next_text and SPEAKER.match(line.strip()):
            starts.append((line.strip().rstrip("."), offset))
        offset += len(line) + 1
    bounds = [("", 0)] + starts
    for (speaker, a), (_, b) in zip(bounds, bounds[1:] + [("", len(text))], strict=True):
        if b > a:
            spans.append((speaker, a, b))
    return spans


def _encode_works(vocab: Vocabulary, docs):
    """The training stream of `docs`, each speech encoded on its own, with the works' and the
    speeches' token ranges and the role names ("work/speaker")."""
    parts, works, rows, roles, role_ids, at = [], [], [], [], {}, 0
    for name, text in docs:
        start = at
        for speaker, a, b in _speeches(text):
            ids = vocab.encode(text[a:b])
            role = f"{name}/{speaker}"
            if role not in role_ids:
                role_ids[role] = len(roles)
                roles.append(role)
            rows.append((role_ids[role], at, at + len(ids)))
            parts.append(ids)
            at += len(ids)
        works.append((name, start, at))
    speeches = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return np.concatenate(parts), works, speeches, roles


class _MetaUnpickler(pickle.Unpickler):
    """Plain containers only (dicts, lists, strings, numbers): a planted `meta.pkl` cannot run
    code (plain pickle.load executes whatever callable the file names)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"meta.pkl: unexpected object {module}.{name}")


def _read_meta(folder: Path, vocab_size: int | None) -> Vocabulary:
    meta: Any = None
    file = folder / ("meta.json" if (folder / "meta.json").is_file() else "meta.pkl")
    if file.suffix == ".json":
        try:
            meta = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"data.root: {file} is not JSON ({exc})") from None
    elif file.is_file():
        try:
            with open(folder / "meta.pkl", "rb") as f:
                meta = _MetaUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, ValueError) as exc:
            raise ValueError(
                f"data.root: {folder / 'meta.pkl'} is not a plain vocabulary ({exc}); write a "
                "meta.json instead"
            ) from None
    if meta is None:
        if vocab_size is None:
            raise ValueError(
                f"data.root={folder} has no meta.pkl or meta.json; set data.vocab_size (50257 "
                "for GPT-2 tokens)"
            )
        return Vocabulary("ids", int(vocab_size))
    if not isinstance(meta, dict):
        raise ValueError(
            f"data.root: {file} is not nanoGPT's vocabulary (a dict with vocab_size and itos); "
            "fix it or remove it and set data.vocab_size"
        )
    itos = meta.get("itos") or {}
    # JSON keys are strings, pickled ones ints; a list is its own order
    table = {int(k): v for k, v in (enumerate(itos) if isinstance(itos, list) else itos.items())}
    symbols = tuple(str(table[i]) for i in sorted(table))
    size = int(meta.get("vocab_size", vocab_size or len(symbols)))
    if symbols and len(symbols) != size:
        raise ValueError(f"data.root: {folder} meta lists {len(symbols)} symbols for {size} ids")
    return Vocabulary("ids", size, symbols)


def _read_bins(folder: Path, vocab_size: int | None, dtype: str, memmap: bool):
    """The splits of a token folder (`token_files.py`): memory-mapped, or with `memmap` false
    read whole (int32 in memory, every id checked here). Each file of the training split is a
    work (and its one speech)."""
    vocab = _read_meta(folder, vocab_size)
    maps = open_splits(folder, dtype, vocab.size)
    streams: dict[str, TokenMap | np.ndarray] = dict(maps)
    if not memmap:
        for split, stream in maps.items():
            ids = stream.whole()
            low, top = int(ids.min()), int(ids.max())
            if top >= vocab.size or low < 0:
                raise ValueError(
                    f"data.root: {folder} ({split}) holds token id {low if low < 0 else top}, "
                    f"outside the vocabulary of {vocab.size}; check data.dtype and "
                    "data.vocab_size"
                )
            streams[split] = ids
    train = maps["train"]
    names = [path.name for path, _, _ in train.files]
    works = [(name, a, b) for name, (a, b) in zip(names, train.segments, strict=True)]
    speeches = np.array([[i, a, b] for i, (_, a, b) in enumerate(works)], dtype=np.int64)
    roles = [f"{name}/" for name, _, _ in works]
    cpt = {s: vocab.chars_per_token(ids[:200_000]) for s, ids in streams.items()}
    return vocab, streams, works, speeches.reshape(-1, 3), roles, cpt
