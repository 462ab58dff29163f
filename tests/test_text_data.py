"""Text corpora for language models (`dpresearch.data.text`, `dpresearch.data.tokenize`), no
training: the Shakespeare corpus's fixed splits, every partition's windows and shards, the
tokenizers, nanoGPT's pre-tokenized layout (its pickle read without running anything), and
every bad input as one `error:` line before any worker starts."""

from __future__ import annotations

import os
import pickle
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SHARED, compose_config, run_cli, run_main
from hydra.utils import instantiate

from dpresearch.data.text import TEXT_PARTITIONS, TextDataset, WindowPartitioner
from dpresearch.data.tokenize import Vocabulary, make_vocabulary
from dpresearch.errors import ConfigError

WORKS = SHARED / "data" / "shakespeare" / "works"
SUBSET = SHARED / "data" / "cifar10-subset"
needs_corpus = pytest.mark.skipif(not WORKS.is_dir(), reason=f"no Shakespeare corpus at {WORKS}")
VAL, TEST = ("julius_caesar", "twelfth_night"), ("macbeth", "tempest")
BLOCK, K = 16, 4


def work_text(name: str) -> str:
    return (WORKS / f"{name}.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def corpus() -> TextDataset:
    """The corpus as `data=shakespeare` loads it (the config's own node), 16-token windows."""
    cfg = compose_config("data=shakespeare", f"data.root={WORKS}", f"data.block_size={BLOCK}")
    return instantiate(cfg.data, device="cpu")


def decode(data: TextDataset, ids) -> str:
    return data.vocab.decode(torch.as_tensor(ids).tolist())


# -- splits -----------------------------------------------------------------------------------
@needs_corpus
def test_shakespeare_holds_out_two_plays_each_for_validation_and_test(corpus):
    """Validation is exactly Julius Caesar + Twelfth Night, the test Macbeth + The Tempest (the
    files' text, in that order); the other 38 works train; every character is in one split
    (5,057,198 in all), over 84 distinct characters."""
    names = sorted(p.stem for p in WORKS.glob("*.txt"))
    assert len(names) == 42
    assert decode(corpus, corpus.val_inputs) == "".join(work_text(n) for n in VAL)
    assert decode(corpus, corpus.test_inputs) == "".join(work_text(n) for n in TEST)
    assert [name for name, _, _ in corpus.works] == [n for n in names if n not in VAL + TEST]
    sizes = [int(getattr(corpus, f"{s}_inputs").shape[0]) for s in ("train", "val", "test")]
    assert sum(sizes) == 5_057_198
    assert corpus.vocab.kind == "char" and corpus.vocab.size == corpus.num_classes == 84
    # the works' ranges tile the training stream
    ends = [(start, end) for _, start, end in corpus.works]
    assert ends[0][0] == 0 and ends[-1][1] == sizes[0]
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))


def test_a_single_file_splits_by_its_last_fractions(tmp_path):
    """Without named works, the last 5 % of the characters are the test split and the 5 %
    before them the validation split (the defaults of `data=text`)."""
    text = "".join(f"line {i}: {'abcdefghij'[i % 10] * (i % 7)}\n" for i in range(400))
    (tmp_path / "corpus.txt").write_text(text)
    cfg = compose_config(
        "data=text",
        f"data.root={tmp_path / 'corpus.txt'}",
        "data.block_size=8",
        "data.eval_tokens=64",
    )
    data = instantiate(cfg.data, device="cpu")
    n = len(text)
    cut_val, cut_test = round(n * 0.90), round(n * 0.95)
    assert decode(data, data.train_inputs) == text[:cut_val]
    assert decode(data, data.val_inputs) == text[cut_val:cut_test]
    assert decode(data, data.test_inputs) == text[cut_test:]
    assert [name for name, _, _ in data.works] == ["corpus"]


# -- partitions -------------------------------------------------------------------------------
def layout_of(data: TextDataset, part: WindowPartitioner) -> np.ndarray | None:
    """The training stream's position at each position of the partition's layout (None: the
    stream itself)."""
    if data._layout_ranges is None:
        return None
    offset, length = part.shards[-1]
    return data._layout_ranges.positions(torch.arange(offset + length)).numpy()


def shard_owner(data: TextDataset, part: WindowPartitioner) -> np.ndarray:
    """For every position of the training stream, the worker whose shard holds it (-1: none);
    shards must not overlap."""
    n = int(data.train_inputs.shape[0])
    owner = np.full(n, -1)
    layout = layout_of(data, part)
    for w, (offset, length) in enumerate(part.shards):
        positions = layout[offset : offset + length]
        assert (owner[positions] == -1).all(), "shards overlap"
        owner[positions] = w
    return owner


def work_of(data: TextDataset, positions: np.ndarray) -> np.ndarray:
    starts = np.array([start for _, start, _ in data.works])
    return np.searchsorted(starts, positions, side="right") - 1


@needs_corpus
@pytest.mark.parametrize("partition", TEXT_PARTITIONS)
def test_every_worker_draws_its_windows_inside_its_shard(corpus, partition):
    """In every partition a worker's windows (block_size + 1 tokens: inputs and the next-token
    targets) lie inside its own shard and are the tokens at those positions of the training
    stream; the shards (all but `shared`'s) are disjoint and cover the stream; an epoch is the
    training tokens once."""
    corpus.partition, corpus.alpha = partition, 1.0
    part = corpus.make_partitioner(K, seed=5)
    n = int(corpus.train_inputs.shape[0])
    assert part.samples_per_worker == corpus.num_train // K == n // BLOCK // K
    assert n - (K + 1) * BLOCK < part.samples_per_worker * K * BLOCK <= n
    layout = layout_of(corpus, part)
    for w, (offset, length) in enumerate(part.shards):
        starts = part.epoch_indices(w, 0).numpy()
        assert len(starts) == part.samples_per_worker
        assert starts.min() >= offset and starts.max() + BLOCK < offset + length
        x, y = corpus.train_batch(torch.from_numpy(starts[:64]))
        at = starts[:64, None] + np.arange(BLOCK + 1)
        expected = corpus.train_inputs.numpy()[at if layout is None else layout[at]]
        assert torch.equal(x, torch.from_numpy(expected[:, :-1]).long())
        assert torch.equal(y, torch.from_numpy(expected[:, 1:]).long())
    if partition == "shared":
        assert part.shards == [(0, n)] * K and layout is None
    elif partition == "contiguous":
        assert part.shards == [(w * n // K, n // K) for w in range(K)] and layout is None
    else:
        assert (shard_owner(corpus, part) >= 0).all()  # every token in exactly one shard


@needs_corpus
@pytest.mark.parametrize("partition", TEXT_PARTITIONS)
def test_epoch_indices_are_a_pure_function_of_seed_epoch_and_worker(corpus, partition):
    """Two partitioners made alike draw the same windows; another worker, epoch or seed
    draws others."""
    corpus.partition, corpus.alpha = partition, 1.0
    a, b = corpus.make_partitioner(K, seed=7), corpus.make_partitioner(K, seed=7)
    assert a.shards == b.shards
    assert torch.equal(a.epoch_indices(1, 3), b.epoch_indices(1, 3))
    assert not torch.equal(a.epoch_indices(1, 3), a.epoch_indices(2, 3))
    assert not torch.equal(a.epoch_indices(1, 3), a.epoch_indices(1, 4))
    other = corpus.make_partitioner(K, seed=8)
    assert not torch.equal(a.epoch_indices(1, 3), other.epoch_indices(1, 3))


@needs_corpus
def test_by_work_gives_each_worker_whole_works_from_the_files(corpus):
    """by_work: each worker's shard is whole works back to back, its windows the works' own
    text (rebuilt from the files); the shards balance (largest / smallest < 1.5 with K = 8)."""
    corpus.partition = "by_work"
    part = corpus.make_partitioner(8, seed=0)
    lengths = [length for _, length in part.shards]
    assert max(lengths) / min(lengths) < 1.5
    layout = layout_of(corpus, part)
    names = [name for name, _, _ in corpus.works]
    seen = []
    for w, (offset, length) in enumerate(part.shards):
        mine = sorted(set(work_of(corpus, layout[offset : offset + length]).tolist()))
        seen += mine
        ranges = [corpus.works[i][1:] for i in mine]
        assert length == sum(end - start for start, end in ranges)  # whole works only
        text = "".join(work_text(names[i]) for i in mine)
        tokens = corpus.vocab.encode(text)
        for start in part.epoch_indices(w, 0)[:200].tolist():
            x, y = corpus.train_batch(torch.tensor([start]))
            window = np.concatenate([x[0].numpy(), y[0, -1:].numpy()])
            assert np.array_equal(window, tokens[start - offset : start - offset + BLOCK + 1])
    assert sorted(seen) == list(range(len(names)))  # each work on exactly one worker


@needs_corpus
def test_by_role_shards_are_whole_speeches_of_their_roles(corpus):
    """by_role (LEAF's split): every speech lies whole in one worker's shard, the worker of its
    role (work/speaker); a speech's text starts with its speaker's name line."""
    corpus.partition = "by_role"
    part = corpus.make_partitioner(K, seed=0)
    owner = shard_owner(corpus, part)
    role_worker: dict[int, int] = {}
    for role, a, b in corpus.speeches.tolist():
        workers = set(owner[a:b].tolist())
        assert len(workers) == 1, (corpus.roles[role], a, b)
        assert role_worker.setdefault(role, workers.pop()) == owner[a]
    assert len(set(role_worker.values())) == K
    stream = corpus.train_inputs
    for role, a, b in corpus.speeches[:: max(1, len(corpus.speeches) // 300)].tolist():
        speaker = corpus.roles[role].split("/", 1)[1]
        if speaker:
            assert decode(corpus, stream[a:b]).startswith(f"{speaker}."), corpus.roles[role]
    lengths = [length for _, length in part.shards]
    assert max(lengths) / min(lengths) < 1.05


@needs_corpus
def test_dirichlet_over_works_is_near_uniform_for_large_alpha_and_skewed_for_small(corpus):
    """dirichlet: each work's pieces spread over the workers by Dir(alpha) proportions. With
    alpha = 1000 every worker's mix of works is the corpus's (total variation < 0.05); with
    alpha = 0.01 each work goes nearly whole to one worker."""
    n = int(corpus.train_inputs.shape[0])
    overall = np.bincount(work_of(corpus, np.arange(n)), minlength=len(corpus.works)) / n

    def mixes(alpha: float) -> tuple[list[float], float]:
        corpus.partition, corpus.alpha = "dirichlet", alpha
        part = corpus.make_partitioner(K, seed=0)
        owner = shard_owner(corpus, part)
        works = work_of(corpus, np.arange(n))
        tv = []
        for w in range(K):
            mix = np.bincount(works[owner == w], minlength=len(corpus.works)) / (owner == w).sum()
            tv.append(0.5 * np.abs(mix - overall).sum())
        per_work = np.zeros((len(corpus.works), K))
        np.add.at(per_work, (works, owner), 1)
        top_share = (per_work.max(1) / per_work.sum(1) * overall).sum()  # token-weighted
        return tv, top_share

    uniform, uniform_top = mixes(1000.0)
    skewed, skewed_top = mixes(0.01)
    assert max(uniform) < 0.05 and uniform_top < 0.3
    assert min(skewed) > 0.5 and skewed_top > 0.9


# -- tokenizers -------------------------------------------------------------------------------
@needs_corpus
def test_char_tokens_round_trip_the_corpus(corpus):
    """The training stream decodes to the training works' files exactly; encoding a held-out
    play gives its split's ids."""
    text = "".join(work_text(name) for name, _, _ in corpus.works)
    assert decode(corpus, corpus.train_inputs) == text
    assert np.array_equal(
        corpus.vocab.encode(work_text(VAL[0])), corpus.val_inputs[: len(work_text(VAL[0]))].numpy()
    )
    with pytest.raises(ValueError, match="'é' is not in the vocabulary"):
        corpus.vocab.encode("café")


def test_byte_tokens_round_trip_utf8_text(tmp_path):
    """Byte tokens: 256 ids, UTF-8 text with accents, CJK and emoji round-trips; bits per
    character count the characters, not the bytes."""
    vocab = make_vocabulary("byte", [])
    text = "Ça s'écrit: naïve café, 日本語, ✓ — \U0001f600\n"
    ids = vocab.encode(text)
    assert vocab.size == 256 and len(ids) == len(text.encode("utf-8")) > len(text)
    assert int(ids.max()) < 256 and vocab.decode(ids.tolist()) == text
    assert vocab.chars_per_token(ids) == pytest.approx(len(text) / len(ids))
    (tmp_path / "c.txt").write_text(text * 100, encoding="utf-8")
    cfg = compose_config(
        "data=text",
        f"data.root={tmp_path / 'c.txt'}",
        "data.tokenizer=byte",
        "data.block_size=8",
        "data.eval_tokens=64",
    )
    data = instantiate(cfg.data, device="cpu")
    assert data.num_classes == 256 and not data.vocab.is_characters
    metrics = data.split_metrics("test", 1.0)
    per_char = metrics["test/bits_per_token"] * len(ids) / len(text)
    assert metrics["test/bpc"] == pytest.approx(per_char, rel=0.05)


def test_gpt2_without_tiktoken_is_one_line(monkeypatch):
    """GPT-2 tokens without the tiktoken package: ValueError, one line naming the fix."""
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken raises ImportError
    with pytest.raises(ValueError) as info:
        make_vocabulary("gpt2", ["text"])
    message = str(info.value)
    assert "\n" not in message and "data.tokenizer=char or byte" in message
    assert "tiktoken" in message


def test_gpt2_without_its_cached_encoding_is_one_line_and_never_downloads(monkeypatch):
    """tiktoken present but its encoding not cached: the download it would make is refused
    (one line naming data.tokenizer=char or byte), and tiktoken's reader is put back."""
    fake = types.ModuleType("tiktoken")
    load = types.ModuleType("tiktoken.load")
    fetched = []

    def read_file(url: str) -> bytes:  # the network: must never be reached
        fetched.append(url)
        return b""

    def get_encoding(name: str):
        return load.read_file(f"https://openaipublic.blob.core.windows.net/{name}.tiktoken")

    load.read_file = read_file
    fake.load, fake.get_encoding = load, get_encoding
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    monkeypatch.setitem(sys.modules, "tiktoken.load", load)
    with pytest.raises(ValueError) as info:
        make_vocabulary("gpt2", ["text"])
    message = str(info.value)
    assert "\n" not in message and "not cached" in message
    assert "data.tokenizer=char or byte" in message
    assert fetched == [] and load.read_file is read_file


# -- nanoGPT's layout -------------------------------------------------------------------------
CHARS = "\n !abcdefghij"


def write_bins(folder: Path, ids: dict[str, np.ndarray], meta: bytes | None = None) -> Path:
    folder.mkdir()
    for split, values in ids.items():
        values.astype(np.uint16).tofile(folder / f"{split}.bin")
    if meta is not None:
        (folder / "meta.pkl").write_bytes(meta)
    return folder


def char_meta() -> bytes:
    itos = dict(enumerate(CHARS))
    return pickle.dumps(
        {"vocab_size": len(CHARS), "itos": itos, "stoi": {c: i for i, c in itos.items()}}
    )


def load_bins(folder: Path, **kw) -> TextDataset:
    return TextDataset.load(folder, block_size=8, eval_tokens=64, **kw)


def test_nanogpt_folder_loads_with_its_pickled_vocabulary(tmp_path):
    """train.bin / val.bin (uint16) and nanoGPT's meta.pkl (a plain dict): the ids load as
    they are, val.bin serves as the test split too, and one-character symbols make bits per
    character the bits per token."""
    rng = np.random.default_rng(0)
    train_ids, val_ids = rng.integers(0, len(CHARS), 2000), rng.integers(0, len(CHARS), 300)
    folder = write_bins(tmp_path / "nano", {"train": train_ids, "val": val_ids}, char_meta())
    data = load_bins(folder)
    assert data.vocab.kind == "ids" and data.vocab.size == data.num_classes == len(CHARS)
    assert data.vocab.symbols == tuple(CHARS) and data.vocab.is_characters
    assert np.array_equal(data.train_inputs[:].numpy(), train_ids)
    assert np.array_equal(data.val_inputs[:].numpy(), val_ids)
    assert np.array_equal(data.test_inputs[:].numpy(), val_ids)
    assert data.split_metrics("test", 2.0) == {"test/bpc": pytest.approx(2.0 / np.log(2))}
    assert decode(data, train_ids[:5]) == "".join(CHARS[i] for i in train_ids[:5])


def test_nanogpt_folder_with_a_meta_json_of_its_size_only(tmp_path):
    """meta.json naming only the vocabulary's size (GPT-2 ids, say): the ids load, and with
    no symbols to count characters by, the metrics are per token (bits per token, perplexity)
    beside `bpc`."""
    import json

    ids = np.arange(500) % 50
    folder = write_bins(tmp_path / "nano", {"train": ids, "val": ids[:200], "test": ids[:100]})
    (folder / "meta.json").write_text(json.dumps({"vocab_size": 50}))
    data = load_bins(folder)
    assert data.vocab.size == 50 and not data.vocab.is_characters
    assert np.array_equal(data.test_inputs[:].numpy(), ids[:100])  # test.bin when present
    metrics = data.split_metrics("val", 1.0)
    assert set(metrics) == {"val/bpc", "val/bits_per_token", "val/ppl"}


def test_nanogpt_meta_json_with_its_symbols(tmp_path):
    """meta.json as the module docstring describes it, `{"vocab_size": N, "itos": {...}}`:
    JSON object keys are strings ("0", "1", ...), which `_read_meta` must read as ids."""
    import json

    ids = np.arange(300) % len(CHARS)
    folder = write_bins(tmp_path / "nano", {"train": ids, "val": ids})
    meta = {"vocab_size": len(CHARS), "itos": dict(enumerate(CHARS))}
    (folder / "meta.json").write_text(json.dumps(meta))
    data = load_bins(folder)
    assert data.vocab.symbols == tuple(CHARS) and data.vocab.is_characters


@pytest.mark.parametrize("name", ["meta.pkl", "meta.json"])
def test_a_meta_that_is_not_a_dict_is_one_line(tmp_path, name):
    """A meta.pkl / meta.json holding a list, not the vocabulary's dict: a ValueError of one
    line (the entry point's `error:` line), not a traceback."""
    ids = np.arange(300) % len(CHARS)
    folder = write_bins(tmp_path / "nano", {"train": ids, "val": ids})
    (folder / name).write_bytes(pickle.dumps([1, 2]) if name == "meta.pkl" else b"[1, 2]")
    with pytest.raises(ValueError) as info:
        load_bins(folder)
    assert "\n" not in str(info.value) and name in str(info.value)


class Planted:
    """Pickles as a call of os.system: what a planted meta.pkl would run on plain
    pickle.load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", ["instance", "nested"])
def test_a_meta_pkl_naming_a_callable_is_refused_without_running_it(tmp_path, payload):
    """A meta.pkl that names a callable (here os.system, alone or inside the vocabulary dict)
    is refused with one line; the call never happens."""
    marker = tmp_path / "ran"
    planted = Planted(marker)
    obj = planted if payload == "instance" else {"vocab_size": 13, "itos": planted}
    ids = np.arange(200) % 13
    folder = write_bins(tmp_path / "nano", {"train": ids, "val": ids}, pickle.dumps(obj))
    with pytest.raises(ValueError) as info:
        load_bins(folder)
    message = str(info.value)
    assert "\n" not in message and "is not a plain vocabulary" in message
    assert "meta.json" in message
    assert not marker.exists()


def test_a_bin_of_the_wrong_size_or_with_ids_beyond_the_vocabulary_is_one_line(tmp_path):
    """A .bin whose size is not a whole number of ids (written with another dtype): a
    ValueError of one line naming data.dtype at load. One holding an id >= vocab_size: the
    batch that reads it raises one line naming the file, the id and its byte offset (mapped);
    read whole (`memmap=False`), the load does."""
    ids = np.arange(200) % len(CHARS)
    odd = write_bins(tmp_path / "odd", {"train": ids, "val": ids}, char_meta())
    with open(odd / "train.bin", "ab") as f:
        f.write(b"\x01")
    with pytest.raises(ValueError) as info:
        load_bins(odd)
    assert "\n" not in str(info.value) and "not a whole number of uint16 ids" in str(info.value)
    # (beyond the 200 000 tokens the load reads to count characters per token)
    beyond = np.arange(300_000) % len(CHARS)
    beyond[250_017] = len(CHARS)
    big = write_bins(tmp_path / "big", {"train": beyond, "val": ids}, char_meta())
    data = load_bins(big)
    data.train_batch(torch.tensor([0, 250_018, 250_000]))  # windows of 9 tokens
    with pytest.raises(ConfigError) as info:
        data.train_batch(torch.tensor([0, 250_010]))  # 250 010-250 018 holds token 250 017
    message = str(info.value)
    assert "\n" not in message
    assert f"token id {len(CHARS)} at token 250017 (byte 500034)" in message
    assert str(big / "train.bin") in message and "data.dtype" in message
    with pytest.raises(ValueError) as info:
        load_bins(big, memmap=False)
    message = str(info.value)
    assert "\n" not in message and f"token id {len(CHARS)}, outside the vocabulary" in message


@pytest.mark.parametrize("memmap", [True, False])
def test_a_negative_id_is_named_in_its_line(tmp_path, memmap):
    """A signed .bin (data.dtype=int32) holding -1: the line names the offending id."""
    ids = (np.arange(300) % len(CHARS)).astype(np.int32)
    ids[5] = -1
    folder = tmp_path / "nano"
    folder.mkdir()
    ids.tofile(folder / "train.bin")
    ids.tofile(folder / "val.bin")
    (folder / "meta.pkl").write_bytes(char_meta())
    with pytest.raises(ValueError, match="token id -1"):
        load_bins(folder, dtype="int32", memmap=memmap).train_batch(torch.tensor([0]))


# -- bad input: one `error:` line, exit 2, before any worker starts -----------------------------


def make_inputs(tmp: Path) -> None:
    """The bad corpora the table names: an empty folder, a folder of blank text, a binary
    .txt, a corpus of tiny named works."""
    (tmp / "empty").mkdir()
    (tmp / "blank").mkdir()
    (tmp / "blank" / "a.txt").write_text("\n  \n")
    (tmp / "binary.txt").write_bytes(b"PK\x03\x04\x00\x00binary\x00")
    tiny = tmp / "tiny"
    tiny.mkdir()
    rng = np.random.default_rng(0)
    for name, size in (("big", 3000), ("small", 30), ("v", 400), ("t", 400)):
        (tiny / f"{name}.txt").write_text("".join(rng.choice(list("abcdefgh \n"), size)))


SHAKESPEARE = ["data=shakespeare", f"data.root={WORKS}", "model=gpt_tiny"]
# name: (overrides, a fragment the error line must hold); "{tmp}" is the test's inputs folder.
BAD = {
    "root missing": (["data=text", "data.root={tmp}/nowhere.txt", "model=gpt_tiny"],
                     "data.root={tmp}/nowhere.txt does not exist"),
    "empty folder": (["data=text", "data.root={tmp}/empty", "model=gpt_tiny"],
                     "data.root={tmp}/empty holds no .txt file"),
    "empty text": (["data=text", "data.root={tmp}/blank", "model=gpt_tiny"],
                   "the corpus is empty"),
    "binary txt": (["data=text", "data.root={tmp}/binary.txt", "model=gpt_tiny"],
                   "binary.txt is not text (binary content)"),
    "windows beyond the positions": (
        ["data=shakespeare", f"data.root={WORKS}", "model=gpt", "data.block_size=128",
         "model.block_size=64"],
        "model.block_size=64 is shorter than the data's windows of 128",
    ),
    "window beyond a shard": (
        ["data=text", "data.root={tmp}/tiny", "data.val_works=[v]", "data.test_works=[t]",
         "data.partition=by_work", "workers=2", "model=gpt_tiny"],
        "data.partition=by_work: worker 1's shard holds 30 tokens, fewer than one window",
    ),
    "resnet on text": (["data=shakespeare", f"data.root={WORKS}", "model=resnet20"],
                       "model ResNetCifar cannot take this data set's inputs of shape (64,)"),
    "gpt on vectors": (["model=gpt", "data.num_train=256", "data.num_test=64"],
                       "model.GPT takes integer token ids"),
    "gpt on images": (["model=gpt", "data=cifar10", f"data.root={SUBSET}"],
                      "GPT takes windows of token ids, not inputs of shape [3, 32, 32]"),
    "partition foo": ([*SHAKESPEARE, "data.partition=foo"],
                      "data.partition=foo; choose one of: iid, contiguous, shared, by_work, "
                      "by_role, dirichlet"),
    "val_size": ([*SHAKESPEARE, "train.val_size=0.1"],
                 "train.val_size=0.1: a text corpus holds out its own validation split"),
    "gpt2 without tiktoken": ([*SHAKESPEARE, "data.tokenizer=gpt2"],
                              "or use data.tokenizer=char or byte"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_exit_2_and_nothing_written(name, tmp_path, monkeypatch, capsys):
    args, fragment = BAD[name]
    if any(str(WORKS) in a for a in args) and not WORKS.is_dir():
        pytest.skip(f"no Shakespeare corpus at {WORKS}")
    if any(str(SUBSET) in a for a in args) and not SUBSET.is_dir():
        pytest.skip(f"no CIFAR subset at {SUBSET}")
    if "data.tokenizer=gpt2" in args:
        monkeypatch.setitem(sys.modules, "tiktoken", None)
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    make_inputs(inputs)
    args = [a.replace("{tmp}", str(inputs)) for a in args]
    fragment = fragment.replace("{tmp}", str(inputs))
    run_dir = tmp_path / "run"
    code, out, err = run_main([*args, f"hydra.run.dir={run_dir}"], tmp_path, monkeypatch, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]
    assert "error" not in out and "Traceback" not in out + err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs"]  # nothing written


@needs_corpus
@pytest.mark.parametrize(
    "args,fragment",
    [
        (["data=text", "data.root={tmp}/nowhere.txt", "model=gpt_tiny"], "does not exist"),
        (
            [
                "data=shakespeare",
                f"data.root={WORKS}",
                "model=gpt_tiny",
                "backend=gloo",
                "workers=2",
                "data.partition=foo",
            ],
            "data.partition=foo; choose one of",
        ),
    ],
    ids=["missing root", "gloo partition"],
)
def test_bad_input_on_the_command_line(args, fragment, tmp_path):
    """The real command line (gloo too: nothing is launched): one line on stderr, exit 2."""
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = run_cli(args, cwd=tmp_path, timeout=120)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    assert "error" not in out.stdout
    assert list(tmp_path.iterdir()) == []  # no outputs/, no run directory


def test_vocabulary_fingerprint_tells_vocabularies_apart():
    """The fingerprint a checkpoint records: equal vocabularies alike, any difference in kind,
    size or symbols apart."""
    a = Vocabulary("char", 3, ("a", "b", "c"))
    assert a.fingerprint == Vocabulary("char", 3, ("a", "b", "c")).fingerprint
    others = [
        Vocabulary("char", 3, ("a", "b", "d")),
        Vocabulary("ids", 3, ("a", "b", "c")),
        Vocabulary("byte", 256),
        Vocabulary("ids", 256),
    ]
    assert len({v.fingerprint for v in [a, *others]}) == 5
