"""Pre-tokenized corpora read through memory maps: a split of any size costs no memory.

Two layouts (`open_splits`):
- nanoGPT's: `train.bin` and `val.bin` (and `test.bin` if present), bare token ids of
  `data.dtype` (uint16 as nanoGPT's `prepare.py` writes them);
- llm.c's shards: files named `*_train_*.bin` and `*_val_*.bin` (and `*_test_*.bin`), each a
  header of 256 int32 (magic 20240520 and version 1 for uint16 GPT-2 ids, or magic 20240801 and
  version 7 for uint32 LLaMA-3 ids; then the token count) followed by the ids; a split's shards
  are read in name order, back to back.

A split is a `TokenMap`: the files' ids as one stream, read where a batch needs them (`stream[at]`
gathers the ids at positions `at` into an int64 tensor), never copied whole. An id at or beyond
the vocabulary is found in the batch that reads it (a `ConfigError` naming the file and the
byte offset); checking every id at start-up would read the whole corpus in every process.

The pages a process has read stay mapped into it, and count in its RSS, until it drops them:
after reads that may have touched `RELEASE_BYTES`, the maps' pages are released
(`madvise(MADV_DONTNEED)`; they stay in the page cache, shared by every process reading the
file), so a run's RSS stays bounded however long it reads a corpus larger than memory.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dpresearch.errors import ConfigError

HEADER_INTS = 256
# (magic, version) of llm.c's shard header -> the dtype of its ids
SHARD_FORMATS = {(20240520, 1): "uint16", (20240801, 7): "uint32"}
SPLIT_FILES = ("train", "val", "test")
RELEASE_BYTES = 256 << 20
PAGE = mmap.PAGESIZE
# What one window's read may map into the process: a read fault maps the page cache's folio
# around the page read whole, and large folios reach 2 MB (Linux 6.x; measured ~0.8 MB a
# random window on a freshly written file; 64 KB of fault-around with small folios).
MAP_PER_READ = 2 << 20


class TokenMap:
    """The token ids of one or more files back to back, each file memory-mapped.

    `files`: (path, header bytes, token count) per file. Behaves as the 1-D stream tensor that
    `TextDataset` reads: `len`, `shape`, `device` (where gathered ids are put), `to(device)`,
    `stream[a:b]` and `stream[positions]` (int64 tensors). `segments` are the files' (start, end)
    token ranges in the stream. Pickles as its file list (a worker re-maps the files)."""

    def __init__(
        self,
        files: Sequence[tuple[Path, int, int]],
        dtype: str,
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.files = [(Path(p), int(h), int(n)) for p, h, n in files]
        self.dtype = np.dtype(dtype)
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self.bounds = np.cumsum([0] + [n for _, _, n in self.files]).astype(np.int64)
        self.signed = self.dtype.kind == "i"
        self._open()
        self._touched = 0  # bytes of pages the reads since the last release may have mapped

    def _open(self) -> None:
        self._maps = [
            np.memmap(path, dtype=self.dtype, mode="r", offset=header, shape=(count,))
            for path, header, count in self.files
        ]
        # plain views of the maps: indexing them skips np.memmap's subclass bookkeeping
        self._arrays = [m.view(np.ndarray) for m in self._maps]

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_maps", "_arrays")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return int(self.bounds[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    @property
    def segments(self) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in zip(self.bounds[:-1], self.bounds[1:], strict=True)]

    def to(self, device: torch.device | str) -> TokenMap:
        self.device = torch.device(device)
        return self

    def __getitem__(self, at: slice | Tensor) -> Tensor:
        """The ids at `at` (a slice, or a tensor of stream positions of any shape), int64 on
        `device`."""
        if isinstance(at, slice):
            at = torch.from_numpy(np.arange(*at.indices(len(self)), dtype=np.int64))
        flat = at.reshape(-1).cpu().numpy()
        if len(self._arrays) == 1:
            which, ids = None, self._arrays[0][flat]
        else:
            ids = np.empty(flat.shape, dtype=self.dtype)
            which = np.searchsorted(self.bounds, flat, side="right") - 1
            for f in np.unique(which):
                mask = which == f
                ids[mask] = self._arrays[f][flat[mask] - self.bounds[f]]
        if len(ids) and (ids.max() >= self.vocab_size or (self.signed and ids.min() < 0)):
            self._refuse(ids, flat, which)
        rows = at.shape[0] if at.dim() > 1 else 1
        self._touched += flat.size * self.dtype.itemsize + rows * MAP_PER_READ
        if self._touched > RELEASE_BYTES:
            self.release()
        return torch.from_numpy(ids.astype(np.int64)).view(at.shape).to(self.device)

    def whole(self) -> np.ndarray:
        """Every id of the stream, read into memory (the files' dtype)."""
        return np.concatenate(self._arrays)

    def release(self) -> None:
        """Drop the maps' pages from this process (the next read maps them again)."""
        for m in self._maps:
            m._mmap.madvise(mmap.MADV_DONTNEED)  # (numpy keeps the mmap object it maps)
        self._touched = 0

    def _refuse(self, ids: np.ndarray, flat: np.ndarray, which: np.ndarray | None) -> None:
        """Raise `ConfigError` naming the first id outside the vocabulary, where it is."""
        i = int(np.flatnonzero((ids >= self.vocab_size) | (ids < 0))[0])
        f = 0 if which is None else int(which[i])
        path, header, _ = self.files[f]
        token = int(flat[i] - self.bounds[f])
        raise ConfigError(
            f"data.root: {path} holds token id {int(ids[i])} at token {token} (byte "
            f"{header + token * self.dtype.itemsize}), outside the vocabulary of "
            f"{self.vocab_size}; check data.dtype and data.vocab_size, or fix the file"
        )


def is_token_folder(path: Path) -> bool:
    """Whether `path` is a folder of nanoGPT's `train.bin` or of llm.c's train shards."""
    return path.is_dir() and ((path / "train.bin").is_file() or bool(_shards(path, "train")))


def open_splits(folder: Path, dtype: str, vocab_size: int) -> dict[str, TokenMap]:
    """The train / val / test `TokenMap`s of a token folder (`is_token_folder`); without a
    test split, the validation files serve as the test split too. Raises ValueError (one line,
    naming the fix) for a missing validation split or a file that is not what it claims."""
    shards = {split: _shards(folder, split) for split in SPLIT_FILES}
    if shards["train"]:
        if not shards["val"]:
            raise FileNotFoundError(
                f"data.root={folder} has train shards but no *_val_*.bin; add one"
            )
        files = {s: [_shard(p) for p in shards[s] or shards["val"]] for s in SPLIT_FILES}
        kinds = {d for fs in files.values() for _, _, _, d in fs}
        if len(kinds) > 1:
            raise ValueError(
                f"data.root={folder}: its shards mix token types {sorted(kinds)}; keep one"
            )
        (kind,) = kinds
        return {s: TokenMap([f[:3] for f in fs], kind, vocab_size) for s, fs in files.items()}
    if not (folder / "val.bin").is_file():
        raise FileNotFoundError(f"data.root={folder} has train.bin but no val.bin; add it")
    maps = {}
    for split in SPLIT_FILES:
        file = folder / f"{split}.bin"
        if not file.is_file():
            file = folder / "val.bin"  # nanoGPT's layout has no test split
        size, item = file.stat().st_size, np.dtype(dtype).itemsize
        if size == 0 or size % item:
            raise ValueError(
                f"data.root: {file} holds {size} bytes, not a whole number of {dtype} ids; "
                "set data.dtype to the type it was written with"
            )
        maps[split] = TokenMap([(file, 0, size // item)], dtype, vocab_size)
    return maps


def _shards(folder: Path, split: str) -> list[Path]:
    return sorted(p for p in folder.glob(f"*_{split}_*.bin") if p.is_file())


def _shard(path: Path) -> tuple[Path, int, int, str]:
    """(path, header bytes, token count, dtype) of an llm.c shard, its header checked
    against the file's size."""
    header_bytes = HEADER_INTS * 4
    size = path.stat().st_size
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if len(header) < HEADER_INTS:
        raise ValueError(
            f"data.root: {path} holds {size} bytes, shorter than an llm.c shard's header of "
            f"{header_bytes}; rewrite it with llm.c's write_datafile"
        )
    magic, version, count = (int(v) for v in header[:3])
    dtype = SHARD_FORMATS.get((magic, version))
    if dtype is None:
        known = ", ".join(f"{m} version {v}" for m, v in SHARD_FORMATS)
        raise ValueError(
            f"data.root: {path} has header magic {magic} version {version}, not an llm.c "
            f"shard ({known}); rewrite it with llm.c's write_datafile"
        )
    item = np.dtype(dtype).itemsize
    if count <= 0 or size != header_bytes + count * item:
        raise ValueError(
            f"data.root: {path}'s header counts {count} {dtype} ids ({header_bytes + count * item} "
            f"bytes with the header), but the file holds {size} bytes; the file is cut short or "
            "not an llm.c shard: rewrite it"
        )
    return path, header_bytes, count, dtype
