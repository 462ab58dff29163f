"""Token files read through memory maps (`data/token_files.py`): nanoGPT's `train.bin` /
`val.bin` and llm.c's shards give the same windows, batches and training as the ids held in
memory; no window spans two shards; a bad file is one line before training, an id beyond the
vocabulary one line naming the file and offset at the batch that reads it."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    compose_config,
    final_params,
    kill_9_and_resume,
    metric_lines,
    run_main,
    same,
    untimed,
)

from dpresearch.data import token_files
from dpresearch.data.text import TEXT_PARTITIONS, DrawnBatches, TextDataset
from dpresearch.data.token_files import TokenMap
from dpresearch.train import train

VOCAB, BLOCK, K = 50, 16, 3
REPO = Path(__file__).resolve().parents[1]


def nanogpt_folder(folder: Path, n: int = 20_000, seed: int = 0) -> Path:
    """train.bin of `n` random uint16 ids, val.bin and test.bin, meta.json of VOCAB ids."""
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for split, size in (("train", n), ("val", 3000), ("test", 2000)):
        rng.integers(0, VOCAB, size).astype(np.uint16).tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return folder


def write_shard(
    path: Path,
    ids: np.ndarray,
    magic: int = 20240520,
    version: int = 1,
    dtype: str = "uint16",
    count: int | None = None,
) -> None:
    """An llm.c shard: 256 int32 (magic, version, token count), then the ids."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version, len(ids) if count is None else count
    path.write_bytes(header.tobytes() + ids.astype(dtype).tobytes())


def shard_folder(folder: Path, train_sizes=(3000, 10, 4000, 2500), val_sizes=(900, 700)) -> Path:
    """llm.c shards whose file f holds only ids 10f .. 10f + 9, so a window's ids tell which
    files it read; one train shard (10 tokens) is shorter than a window."""
    folder.mkdir()
    rng = np.random.default_rng(1)
    for split, sizes in (("train", train_sizes), ("val", val_sizes)):
        for f, size in enumerate(sizes):
            write_shard(folder / f"corpus_{split}_{f:06d}.bin", 10 * f + rng.integers(0, 10, size))
    return folder


def load(folder: Path, **kw) -> TextDataset:
    kw = {"block_size": BLOCK, "eval_tokens": 512, "vocab_size": VOCAB, **kw}
    return TextDataset.load(folder, **kw)


# -- the same windows as the ids in memory ------------------------------------------------------
@pytest.mark.parametrize("partition", TEXT_PARTITIONS)
def test_mapped_and_in_memory_bins_give_the_same_windows(tmp_path, partition):
    """nanoGPT's layout read through maps (the default) and read whole (`memmap=False`): the
    same shards, window starts, training batches and evaluation batches, bit for bit; the
    mapped streams are maps (no copy of the corpus)."""
    folder = nanogpt_folder(tmp_path / "nano")
    mapped, whole = (
        load(folder, partition=partition),
        load(folder, partition=partition, memmap=False),
    )
    assert isinstance(mapped.train_inputs, TokenMap) and isinstance(
        whole.train_inputs, torch.Tensor
    )
    assert torch.equal(mapped.train_inputs[:], whole.train_inputs.long())
    k = 1 if partition in ("by_work", "by_role") else K  # (one file: one work)
    a, b = mapped.make_partitioner(k, seed=3), whole.make_partitioner(k, seed=3)
    assert a.shards == b.shards
    for w in range(k):
        starts = a.epoch_indices(w, 1)
        assert torch.equal(starts, b.epoch_indices(w, 1))
        for x, y in zip(mapped.train_batch(starts), whole.train_batch(starts), strict=True):
            assert x.dtype == y.dtype == torch.int64 and torch.equal(x, y)
    for split in ("val", "test"):
        pairs = zip(
            mapped.test_batches(7, split=split), whole.test_batches(7, split=split), strict=True
        )
        for (x, y), (u, v) in pairs:
            assert torch.equal(x, u) and torch.equal(y, v)
    assert mapped.facts() == whole.facts()


LM = [
    "data=text",
    "model=gpt_tiny",
    "model.block_size=16",
    "data.eval_tokens=256",
    "data.sample_tokens=8",
    "workers=2",
    "train.batch_size=8",
    "train.steps=4",
    "train.progress=false",
    "backend.threads=1",
]


def test_mapped_and_in_memory_bins_train_the_same(tmp_path):
    """Four steps of two workers on the same train.bin mapped and held in memory: the same
    losses and final parameters, bit for bit."""
    folder = nanogpt_folder(tmp_path / "nano")
    runs = {}
    for memmap in ("true", "false"):
        cfg = compose_config(*LM, f"data.root={folder}", f"data.memmap={memmap}")
        runs[memmap] = (train(cfg, tmp_path / memmap), final_params(tmp_path / memmap))
    (summary, params), (summary_whole, params_whole) = runs["true"], runs["false"]
    assert summary["test/loss"] == summary_whole["test/loss"]
    assert summary["train/loss"] == summary_whole["train/loss"]
    assert same(params, params_whole)


@pytest.mark.parametrize("folder", ["nano", "shards"])
def test_batches_drawn_as_read_are_the_epochs_indices(tmp_path, monkeypatch, folder):
    """A worker's epoch drawn chunk by chunk as the loop reads it (3 batches of 8 a chunk):
    batch n is `epoch_indices[8n : 8n + 8]`, read in order, from a resumed position on, or
    again from an earlier one; the last batch of the epoch too."""
    monkeypatch.setattr(DrawnBatches, "CHUNK_WINDOWS", 24)
    root = (
        nanogpt_folder(tmp_path / folder) if folder == "nano" else shard_folder(tmp_path / folder)
    )
    part = load(root, partition="iid", piece=700).make_partitioner(2, seed=9)
    steps = part.samples_per_worker // 8
    expected = part.epoch_indices(1, 2)[: steps * 8].split(8)
    for order in (range(steps), range(steps - 7, steps), [5, 1, 9, 9, 2, steps - 1, 0]):
        batches = part.epoch_batches(1, 2, 8, steps, torch.device("cpu"))
        assert len(batches) == steps
        for n in order:
            assert torch.equal(batches[n], expected[n]), n
    with pytest.raises(IndexError):
        batches[steps]


def test_kill_9_then_resume_on_mapped_shards_equals_uninterrupted(tmp_path):
    """A command-line run on llm.c shards SIGKILLed after a checkpoint and resumed ends as an
    uninterrupted run: parameters bit for bit, metrics line for line."""
    folder = shard_folder(tmp_path / "shards", train_sizes=(30_000, 10, 40_000))
    args = [
        *LM,
        f"data.root={folder}",
        f"data.vocab_size={VOCAB}",
        "train.steps=60",
        "train.log_every=1",
        "train.eval_every=30",
        "train.checkpoint_every=10",
    ]
    run_dir, reference = kill_9_and_resume(args, tmp_path, kill_after=15)
    assert same(final_params(run_dir), final_params(reference))
    lines = metric_lines(run_dir)
    assert [m["step"] for m in lines] == list(range(1, 61))
    assert [untimed(m) for m in lines] == [untimed(m) for m in metric_lines(reference)]


def test_a_token_map_pickles_as_its_files(tmp_path):
    """A pickled `TokenMap` (a spawned process's copy) holds the file list, not the ids, and
    reads the same ids."""
    folder = nanogpt_folder(tmp_path / "nano", n=200_000)
    stream = load(folder).train_inputs
    blob = pickle.dumps(stream)
    assert len(blob) < 2_000
    at = torch.tensor([[0, 1], [199_998, 199_999]])
    assert torch.equal(pickle.loads(blob)[at], stream[at])


def resident_kb(path: Path) -> int:
    """KB of `path`'s mapped pages resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="no /proc/self/smaps")
@pytest.mark.parametrize("release", [True, False])
def test_pages_read_are_released_so_rss_stays_bounded(tmp_path, monkeypatch, release):
    """Batches of 64 windows, one a page, read from a train.bin: with `RELEASE_BYTES` at what
    three batches may map, the file's pages resident in this process drop to none after every
    third batch and are there after the others; without a release (1 TB) they only grow (the
    measure sees them)."""
    per_batch = 64 * token_files.MAP_PER_READ
    monkeypatch.setattr(token_files, "RELEASE_BYTES", 3 * per_batch if release else 1 << 40)
    folder = nanogpt_folder(tmp_path / "nano", n=4 << 20)
    stream = load(folder).train_inputs
    stream.release()
    file = folder / "train.bin"
    starts = torch.arange(0, 12 * 64 * token_files.PAGE // 2, token_files.PAGE // 2)
    resident = []
    for batch in starts.split(64):
        stream[batch[:, None] + torch.arange(17)]
        resident.append(resident_kb(file))
    if release:
        assert resident[2::3] == [0] * 4 and all(
            r > 0 for i, r in enumerate(resident) if i % 3 != 2
        )
    else:
        assert resident == sorted(resident) and resident[-1] >= 12 * 64 * token_files.PAGE // 1024


# -- llm.c's shards -------------------------------------------------------------------------------
def test_shards_read_back_to_back_as_one_stream(tmp_path):
    """The train shards in name order make the training stream, each a work; the validation
    shards the validation split, which serves as the test split too."""
    folder = shard_folder(tmp_path / "shards")
    data = load(folder)
    files = sorted(folder.glob("*_train_*.bin"))
    expected = np.concatenate([np.fromfile(f, dtype=np.uint16, offset=1024) for f in files])
    assert np.array_equal(data.train_inputs[:].numpy(), expected)
    assert [name for name, _, _ in data.works] == [f.name for f in files]
    assert [b - a for _, a, b in data.works] == [3000, 10, 4000, 2500]
    assert len(data.val_inputs) == len(data.test_inputs) == 1600


def file_of(windows: torch.Tensor) -> torch.Tensor:
    """The shard each window's tokens came from (-1: more than one): file f holds ids 10f.."""
    files = windows // 10
    return torch.where((files == files[:, :1]).all(1), files[:, 0], -1)


@pytest.mark.parametrize("partition", TEXT_PARTITIONS)
def test_no_window_spans_two_shards(tmp_path, partition):
    """Every partition's training windows (many epochs' worth) and the evaluation windows lie
    inside one shard; every shard that holds a window is read (but the 10-token one)."""
    data = load(shard_folder(tmp_path / "shards"), partition=partition, piece=700)
    part = data.make_partitioner(2, seed=4)
    read = []
    for w in range(2):
        starts = torch.cat([part.epoch_indices(w, e) for e in range(8)])
        x, y = data.train_batch(starts)
        files = file_of(torch.cat([x, y[:, -1:]], 1))
        assert (files >= 0).all(), f"worker {w}: a window spans two shards"
        read += files.unique().tolist()
    assert sorted(set(read)) == [0, 2, 3]
    for split in ("val", "test"):
        windows = torch.cat(
            [torch.cat([x, y[:, -1:]], 1) for x, y in data.test_batches(64, split=split)]
        )
        assert (file_of(windows) >= 0).all() and sorted(file_of(windows).unique().tolist()) == [
            0,
            1,
        ]


def test_a_shard_stream_with_one_file_draws_as_a_bin_does(tmp_path):
    """One train shard: the same windows as the same ids in a train.bin (the header skipped)."""
    rng = np.random.default_rng(2)
    ids, val = rng.integers(0, VOCAB, 9000), rng.integers(0, VOCAB, 1000)
    (tmp_path / "shards").mkdir()
    write_shard(tmp_path / "shards" / "x_train_0.bin", ids)
    write_shard(tmp_path / "shards" / "x_val_0.bin", val)
    bins = tmp_path / "nano"
    bins.mkdir()
    ids.astype(np.uint16).tofile(bins / "train.bin")
    val.astype(np.uint16).tofile(bins / "val.bin")
    for partition in TEXT_PARTITIONS:
        a = load(tmp_path / "shards", partition=partition)
        b = load(bins, partition=partition)
        k = 1 if partition in ("by_work", "by_role") else K  # (one file: one work)
        pa, pb = a.make_partitioner(k, 0), b.make_partitioner(k, 0)
        starts = pa.epoch_indices(k - 1, 0)
        assert torch.equal(starts, pb.epoch_indices(k - 1, 0))
        assert torch.equal(a.train_batch(starts)[0], b.train_batch(starts)[0])


# -- bad files ------------------------------------------------------------------------------------
BAD_SHARDS = {
    "magic": (dict(magic=1234), "has header magic 1234 version 1, not an llm.c shard"),
    "version": (dict(version=3), "has header magic 20240520 version 3, not an llm.c shard"),
    "count": (dict(count=999), "header counts 999 uint16 ids"),
    "odd bytes": (dict(dtype="uint8"), "header counts 500 uint16 ids (2024 bytes with the header), "
                                       "but the file holds 1524 bytes"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD_SHARDS))
def test_a_bad_shard_is_one_line_exit_2_before_training(name, tmp_path, monkeypatch, capsys):
    """A shard whose header is not llm.c's, or whose size disagrees with its token count: one
    `error:` line naming the file, exit 2, nothing run."""
    kw, fragment = BAD_SHARDS[name]
    folder = shard_folder(tmp_path / "shards")
    bad = folder / "corpus_train_000002.bin"
    write_shard(bad, np.arange(500) % VOCAB, **kw)
    args = [*LM, f"data.root={folder}", f"data.vocab_size={VOCAB}", f"hydra.run.dir={tmp_path}/run"]
    code, out, err = run_main(args, tmp_path, monkeypatch, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert str(bad) in lines[0] and fragment in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_short_and_mixed_shards_are_one_line(tmp_path):
    """A file shorter than the header, shards of two token types, no validation shard; and
    `data.memmap` not a boolean."""
    folder = shard_folder(tmp_path / "short")
    (folder / "corpus_train_000009.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="holds 100 bytes, shorter than an llm.c shard's header"):
        load(folder)
    folder = shard_folder(tmp_path / "mixed")
    write_shard(folder / "corpus_train_000009.bin", np.arange(600), 20240801, 7, "uint32")
    with pytest.raises(ValueError, match=r"mix token types \['uint16', 'uint32'\]"):
        load(folder)
    folder = shard_folder(tmp_path / "noval", val_sizes=())
    with pytest.raises(FileNotFoundError, match="has train shards but no \\*_val_\\*.bin"):
        load(folder)
    with pytest.raises(ValueError, match="data.memmap=yes must be true or false"):
        load(tmp_path / "short", memmap="yes")


@pytest.mark.parametrize("backend", ["simulated", "gloo"])
def test_an_id_beyond_the_vocabulary_ends_the_run_at_its_batch(tmp_path, backend):
    """A train.bin whose ids from token 200 000 on are beyond the vocabulary passes the
    start-up checks (no scan of the file) and ends the run at the first step that reads one:
    one `error:` line naming the file and the byte offset, exit 2, on the command line (a
    gloo worker's too)."""
    folder = nanogpt_folder(tmp_path / "nano", n=1_000_000)
    ids = np.fromfile(folder / "train.bin", dtype=np.uint16)
    ids[200_000:] = VOCAB + 7
    ids.tofile(folder / "train.bin")
    args = [
        *LM,
        f"data.root={folder}",
        "train.steps=50",
        f"backend={backend}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "dpresearch.train", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert f"{folder / 'train.bin'} holds token id {VOCAB + 7} at token " in lines[0]
    token = int(lines[0].split(" at token ")[1].split()[0])
    assert token >= 200_000 and f"(byte {2 * token})" in lines[0]
    assert "Traceback" not in out.stderr + out.stdout
