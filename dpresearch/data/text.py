"""Text corpora for language models: windows of tokens, held whole on the training device.

Sources (`TextDataset.load`, the `_target_` of `data=shakespeare` and `data=text`):
- a `.txt` file, or a folder of them (each file one *work*, read in name order);
- nanoGPT's pre-tokenized layout: a folder with `train.bin` and `val.bin` (token ids, `dtype`
  uint16 by default, as nanoGPT's `prepare.py` writes them; `test.bin` if present, else the
  validation ids serve as the test split too) and its vocabulary in `meta.pkl` (read with an
  unpickler that builds plain containers only) or `meta.json` (`{"vocab_size": N, "itos":
  {...}}`), or `data.vocab_size` where there is neither.

Splits, fixed for every run: the works named in `val_works` / `test_works` are held out whole
(the shared Shakespeare corpus: two plays each); without named works, the last `test_fraction`
of the text is the test split and the `val_fraction` before it the validation split. Evaluation
reads a fixed set of windows of each split: `eval_tokens // block_size` windows spread evenly.

Training examples are windows of `block_size + 1` tokens (inputs, and targets one token later).
Each worker draws its windows at random from its own shard with its own seeded stream
(`WindowPartitioner`); an epoch is the training tokens once (N // block_size windows in all).
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
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dpresearch.data.base import Dataset
from dpresearch.data.partition import DirichletPartitioner, Partitioner
from dpresearch.data.tokenize import Vocabulary, make_vocabulary

TEXT_PARTITIONS = ("iid", "contiguous", "shared", "by_work", "by_role", "dirichlet")
# A speaker's name on its own line, ending in a full stop ("Ham.", "First Clown."), between a
# blank line and the speech: how the Gutenberg plays mark who speaks.
SPEAKER = re.compile(r"^[A-Z0-9][A-Za-z0-9'\- ]{0,30}\.$")
BIN_DTYPES = ("uint16", "uint32", "int32", "int64")


@dataclass
class TextDataset(Dataset):
    """A tokenized corpus: `train_inputs` / `val_inputs` / `test_inputs` are the token streams
    (int32) of the three splits; `test_targets` / `val_targets` the start positions of each
    split's fixed evaluation windows. A model maps token windows `[B, T]` to logits `[B, T, V]`
    (`num_classes` = the vocabulary's size); the loss is the mean cross-entropy per token.

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
    # The window layout of the last `make_partitioner`: positions in the training stream of
    # each worker's shard, back to back (None: the stream itself).
    _positions: Tensor | None = field(default=None, init=False, repr=False)

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

    @property
    def unigram_bits(self) -> float:
        """Entropy of the training tokens' unigram distribution, in bits per character: what a
        model that ignores context achieves at best."""
        counts = torch.bincount(self.train_inputs.long().cpu(), minlength=self.num_classes)
        p = counts[counts > 0].double() / counts.sum()
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
        if self._positions is not None:
            self._positions = self._positions.to(device)
        return self

    def hold_out(self, size: float, seed: int = 0) -> TextDataset:
        if size:
            raise ValueError(
                f"train.val_size={size}: a text corpus holds out its own validation split "
                "(data.val_works or data.val_fraction); set train.val_size=0"
            )
        return self

    # -- batches ----------------------------------------------------------------------------

    def windows(self, stream: Tensor, starts: Tensor, layout: Tensor | None) -> Tensor:
        """`[N, block_size + 1]` token windows of `stream` at `starts` (positions in `layout`,
        or in the stream itself), as int64."""
        at = starts[:, None] + torch.arange(self.block_size + 1, device=starts.device)
        if layout is not None:
            at = layout[at]
        return stream[at].long()

    def train_batch(
        self, indices: Tensor, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        if indices.device != self.train_inputs.device:
            indices = indices.to(self.train_inputs.device)
        w = self.windows(self.train_inputs, indices, self._positions)
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

    @torch.no_grad()
    def sample(self, model: torch.nn.Module, generator: torch.Generator) -> str | None:
        """`sample_tokens` tokens generated by `model` after the first window of the test
        split (the prompt, included), each drawn from the softmax of the model's last
        position over at most `block_size` tokens of context."""
        if not self.sample_tokens:
            return None
        device = self.test_inputs.device
        was_training = model.training
        model.eval()
        tokens = self.test_inputs[: self.block_size].long().to(device)[None]
        prompt = tokens.shape[1]
        for _ in range(self.sample_tokens):
            logits = model(tokens[:, -self.block_size :])[:, -1].float()
            probs = torch.softmax(logits, -1)
            nxt = torch.multinomial(probs.to(generator.device), 1, generator=generator)
            tokens = torch.cat([tokens, nxt.to(device)], 1)
        model.train(was_training)
        ids = tokens[0].tolist()
        return (
            f"{self.vocab.decode(ids[:prompt])}\n---- generated: ----\n"
            f"{self.vocab.decode(ids[prompt:])}\n"
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
        layout, shards = self._layout(num_workers, seed)
        need = self.block_size + 1
        for worker, (_, length) in enumerate(shards):
            if length < need:
                raise ValueError(
                    f"data.partition={self.partition}: worker {worker}'s shard holds {length} "
                    f"tokens, fewer than one window of data.block_size+1={need}; use fewer "
                    "workers, a smaller data.block_size or another data.partition"
                )
        device = self.train_inputs.device
        self._positions = None if layout is None else torch.from_numpy(layout).to(device)
        return WindowPartitioner(self.num_train, num_workers, seed, shards, self.block_size)

    def _layout(self, k: int, seed: int) -> tuple[np.ndarray | None, list[tuple[int, int]]]:
        """(positions of the shards back to back or None for the stream itself, each worker's
        (offset, length) in them)."""
        n = int(self.train_inputs.shape[0])
        kind = self.partition
        if kind == "shared":
            return None, [(0, n)] * k
        if kind == "contiguous":
            return None, [(w * n // k, (w + 1) * n // k - w * n // k) for w in range(k)]
        if kind == "iid":
            pieces = _pieces([(0, n)], self.piece)
            order = np.random.default_rng([seed % 2**64, 0x4949]).permutation(len(pieces))
            if len(pieces) < k:
                raise ValueError(
                    f"data.partition=iid: {len(pieces)} pieces of data.piece={self.piece} "
                    f"tokens cannot be dealt to {k} workers; lower data.piece"
                )
            groups = [sorted(order[w::k].tolist()) for w in range(k)]
            return _concat([[pieces[i] for i in g] for g in groups])
        if kind == "by_work":
            sizes = [end - start for _, start, end in self.works]
            if len(sizes) < k:
                raise ValueError(
                    f"data.partition=by_work: {len(sizes)} training works cannot go to {k} "
                    "workers; use data.partition=by_role or dirichlet, or fewer workers"
                )
            groups = _balance(sizes, k)
            return _concat([[self.works[i][1:] for i in g] for g in groups])
        if kind == "by_role":
            sizes_by_role = np.bincount(
                self.speeches[:, 0], weights=self.speeches[:, 2] - self.speeches[:, 1],
                minlength=len(self.roles),
            )  # fmt: skip
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
                shards.append([(int(a), int(b)) for _, a, b in rows])
            return _concat(shards)
        if kind == "dirichlet":
            pieces, labels = [], []
            for w, (_, start, end) in enumerate(self.works):
                cut = _pieces([(start, end)], self.piece)
                pieces += cut
                labels += [w] * len(cut)
            split = DirichletPartitioner(torch.tensor(labels), k, seed, self.alpha)
            return _concat([[pieces[i] for i in shard.tolist()] for shard in split.shards])
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
        device: str | torch.device = "cpu",
    ) -> TextDataset:
        """Read the corpus at `root` (see the module docstring) and place it on `device`.
        Missing data raises FileNotFoundError, unusable data or options ValueError, each one
        line naming the fix."""
        if dtype not in BIN_DTYPES:
            raise ValueError(f"data.dtype={dtype}; choose one of: {', '.join(BIN_DTYPES)}")
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
        if path.is_dir() and (path / "train.bin").is_file():
            parts = _read_bins(path, vocab_size, dtype)
        else:
            parts = _read_texts(path, tokenizer, val_works, test_works, val_fraction, test_fraction)
        vocab, streams, works, speeches, roles, cpt = parts
        tensors = {}
        for split, ids in streams.items():
            if len(ids) < block_size + 2:
                raise ValueError(
                    f"data.block_size={block_size}: the {split} split holds only {len(ids)} "
                    "tokens, fewer than one window; lower data.block_size or give more text"
                )
            tensors[split] = torch.from_numpy(ids.astype(np.int32))
        starts = {
            s: _eval_starts(len(streams[s]), block_size, eval_tokens) for s in ("val", "test")
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
    `samples_per_worker` is N // K (N windows in an epoch), whatever the shard's size."""

    def __init__(
        self,
        num_examples: int,
        num_workers: int,
        seed: int,
        shards: Sequence[tuple[int, int]],
        block_size: int,
    ) -> None:
        super().__init__(num_examples, num_workers, seed)
        self.shards = list(shards)
        self.block_size = block_size

    @property
    def samples_per_worker(self) -> int:
        return self.num_examples // self.num_workers

    def epoch_indices(self, worker: int, epoch: int) -> Tensor:
        offset, length = self.shards[worker]
        rng = np.random.default_rng([self.seed % 2**64, epoch, worker, 0x5458])
        starts = rng.integers(0, length - self.block_size, size=self.samples_per_worker)
        return torch.from_numpy(starts + offset)


# -- helpers ---------------------------------------------------------------------------------


def _pieces(ranges: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """`ranges` cut into consecutive pieces of at most `size` tokens."""
    return [(a, min(a + size, end)) for start, end in ranges for a in range(start, end, size)]


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


def _concat(
    shards: Sequence[Sequence[tuple[int, int]]],
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Positions of each shard's ranges, back to back, and each shard's (offset, length)."""
    parts, spans, offset = [], [], 0
    for ranges in shards:
        positions = (
            np.concatenate([np.arange(a, b) for a, b in ranges])
            if ranges
            else np.zeros(0, dtype=np.int64)
        )
        parts.append(positions)
        spans.append((offset, len(positions)))
        offset += len(positions)
    return np.concatenate(parts).astype(np.int64), spans


def _eval_starts(n: int, block_size: int, eval_tokens: int) -> Tensor:
    """Start positions of a split's evaluation windows: as many as `eval_tokens` allow (at
    most the non-overlapping ones), spread evenly over the split."""
    count = max(1, min(eval_tokens // block_size, (n - 1) // block_size))
    return torch.linspace(0, n - block_size - 1, count, dtype=torch.float64).round().long()


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


def _read_bins(folder: Path, vocab_size: int | None, dtype: str):
    """The splits of a nanoGPT folder (train.bin, val.bin, test.bin if present)."""
    vocab = _read_meta(folder, vocab_size)
    if not (folder / "val.bin").is_file():
        raise FileNotFoundError(f"data.root={folder} has train.bin but no val.bin; add it")
    streams = {}
    for split in ("train", "val", "test"):
        file = folder / f"{split}.bin"
        if not file.is_file():
            file = folder / "val.bin"  # nanoGPT's layout has no test split
        size = file.stat().st_size
        item = np.dtype(dtype).itemsize
        if size == 0 or size % item:
            raise ValueError(
                f"data.root: {file} holds {size} bytes, not a whole number of {dtype} ids; "
                "set data.dtype to the type it was written with"
            )
        ids = np.fromfile(file, dtype=dtype)
        low, top = int(ids.min()), int(ids.max())
        if top >= vocab.size or low < 0:
            raise ValueError(
                f"data.root: {file} holds token id {low if low < 0 else top}, outside the "
                f"vocabulary of {vocab.size}; check data.dtype and data.vocab_size"
            )
        streams[split] = ids.astype(np.int64)
    n = len(streams["train"])
    works = [("train.bin", 0, n)]
    speeches = np.array([[0, 0, n]], dtype=np.int64)
    cpt = {s: vocab.chars_per_token(ids[:200_000]) for s, ids in streams.items()}
    return vocab, streams, works, speeches, ["train.bin/"], cpt
