"""Tokenizers for text data: the characters of a corpus, raw bytes, or GPT-2's BPE (tiktoken).

A `Vocabulary` turns text into token ids and back, and knows its own identity (`fingerprint`),
which a run records and a resume checks: a checkpoint trained on one vocabulary never continues
on another. Each kind also says how many characters a token stands for on average over a text
(`chars_per_token`), so bits per character can be reported for every tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TOKENIZERS = ("char", "byte", "gpt2")


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer and its vocabulary.

    kind: "char" (the `symbols` of a corpus, one code point each, ids in sorted order),
    "byte" (the 256 byte values of the UTF-8 encoding), "gpt2" (tiktoken's GPT-2 BPE, 50257 ids)
    or "ids" (a pre-tokenized corpus whose vocabulary is only its size, with `symbols` when its
    metadata lists them).
    """

    kind: str
    size: int
    symbols: tuple[str, ...] = ()

    @property
    def fingerprint(self) -> str:
        """A short hash of the vocabulary: two vocabularies encode alike iff equal."""
        text = json.dumps([self.kind, self.size, list(self.symbols)], ensure_ascii=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def is_characters(self) -> bool:
        """Whether one token is one character (bits per token = bits per character)."""
        return self.kind == "char" or (
            self.kind == "ids" and bool(self.symbols) and all(len(s) == 1 for s in self.symbols)
        )

    def describe(self) -> str:
        return f"{self.kind} ({self.size} tokens)"

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (int64). A character outside a char vocabulary raises
        ValueError naming it."""
        if self.kind == "byte":
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        if self.kind == "gpt2":
            return np.asarray(_gpt2_encoding().encode_ordinary(text), dtype=np.int64)
        if not self.symbols:
            raise ValueError(f"a {self.kind} vocabulary without symbols cannot encode text")
        codes = _code_points(text)
        table = np.array([ord(s) for s in self.symbols], dtype=np.uint32)
        ids = np.searchsorted(table, codes)
        ids = np.minimum(ids, len(table) - 1)
        bad = table[ids] != codes
        if bad.any():
            raise ValueError(f"character {chr(int(codes[bad][0]))!r} is not in the vocabulary")
        return ids.astype(np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (bytes that do not decode are replaced)."""
        if self.kind == "byte":
            return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
        if self.kind == "gpt2":
            return _gpt2_encoding().decode([int(i) for i in ids])
        if not self.symbols:
            return " ".join(str(int(i)) for i in ids)
        return "".join(self.symbols[int(i)] for i in ids)

    def chars_per_token(self, ids: np.ndarray) -> float:
        """Characters per token over the token ids `ids` (1.0 for a char vocabulary)."""
        if self.is_characters or len(ids) == 0:
            return 1.0
        if self.kind == "ids" and not self.symbols:
            return 1.0  # unknown: reported per token
        return len(self.decode(ids.tolist())) / len(ids)


def characters_of(texts: Sequence[str]) -> Vocabulary:
    """The char vocabulary of `texts`: every distinct code point, sorted."""
    codes = np.unique(np.concatenate([np.unique(_code_points(t)) for t in texts]))
    return Vocabulary("char", len(codes), tuple(chr(int(c)) for c in codes))


def make_vocabulary(kind: str, texts: Sequence[str]) -> Vocabulary:
    """The vocabulary of tokenizer `kind` ("char", "byte", "gpt2") for the corpus `texts`.
    Raises ValueError (one line naming the fix) for an unknown kind or a GPT-2 encoding that
    is not available offline."""
    if kind == "char":
        return characters_of(texts)
    if kind == "byte":
        return Vocabulary("byte", 256)
    if kind == "gpt2":
        return Vocabulary("gpt2", _gpt2_encoding().n_vocab)
    raise ValueError(f"data.tokenizer={kind}; choose one of: {', '.join(TOKENIZERS)}")


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def _gpt2_encoding():
    """tiktoken's GPT-2 encoding, from its local cache only (nothing is downloaded)."""
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        raise ValueError(
            "data.tokenizer=gpt2 needs the tiktoken package (pip install tiktoken) with its "
            "gpt2 encoding cached offline; or use data.tokenizer=char or byte"
        ) from None

    def offline(*args, **kwargs):
        raise OSError("not cached")

    fetch = tiktoken.load.read_file
    tiktoken.load.read_file = offline  # a cache miss must fail here, not reach the network
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception:
        raise ValueError(
            "data.tokenizer=gpt2: tiktoken's gpt2 encoding is not cached on this machine "
            "(set TIKTOKEN_CACHE_DIR to a folder holding it); or use data.tokenizer=char or byte"
        ) from None
    finally:
        tiktoken.load.read_file = fetch
