"""Loading never runs code (issue 21, item 1, acceptance A).

A payload (a pickle whose `__reduce__` names `os.system`) is planted in a checkpoint given by
path, in a checkpoint `train.resume=auto` finds, in a CIFAR batch file (with an MD5SUMS that
vouches for it) and in the data verification cache; every load refuses it in one `error:`
line (exit 2, nothing written) and the payload's marker file never appears.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SYNTHETIC_SMALL, run_cli, run_main

from dpresearch.run.checkpoint_files import FORMAT, CheckpointError, load_checkpoint, read_header


class Payload:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def plant_checkpoint(path: Path, marker: Path) -> None:
    """A file shaped like a dpresearch checkpoint whose pickle carries the payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": FORMAT, "step": 5, "workers": 4, "processes": 1, "states": [Payload(marker)]}
    torch.save(state, path)


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_the_payload_runs_under_plain_pickle(tmp_path):
    """The planted file is live: an unrestricted load does run it (so the refusals below are
    the loader's doing, not a dud payload's)."""
    marker = tmp_path / "ran"
    plant_checkpoint(tmp_path / "evil.pt", marker)
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


def test_a_planted_checkpoint_is_refused_by_the_loader(tmp_path):
    marker = tmp_path / "ran"
    plant_checkpoint(tmp_path / "evil.pt", marker)
    for load in (load_checkpoint, read_header):
        with pytest.raises(CheckpointError, match="asks to import posix.system") as err:
            load(tmp_path / "evil.pt")
        assert "\n" not in str(err.value) and "refused without loading it" in str(err.value)
    assert not marker.exists()


def test_a_non_checkpoint_file_is_one_line(tmp_path):
    (tmp_path / "notes.pt").write_text("hello\nworld\n")
    with pytest.raises(CheckpointError, match="cannot be read") as err:
        load_checkpoint(tmp_path / "notes.pt")
    assert "\n" not in str(err.value)
    torch.save({"weights": torch.ones(2)}, tmp_path / "model.pt")  # tensors, but not ours
    with pytest.raises(CheckpointError, match="is not a dpresearch checkpoint"):
        read_header(tmp_path / "model.pt")
    torch.save({"format": 1, "step": 3}, tmp_path / "old.pt")
    with pytest.raises(CheckpointError, match=f"of format 1, this version reads format {FORMAT}"):
        read_header(tmp_path / "old.pt")


def test_resume_from_a_planted_checkpoint_path_never_runs_it(tmp_path, monkeypatch, capsys):
    marker, evil = tmp_path / "ran", tmp_path / "shared" / "evil.pt"
    plant_checkpoint(evil, marker)
    run_dir = tmp_path / "run"
    args = [*SYNTHETIC_SMALL, f"train.resume={evil}", f"hydra.run.dir={run_dir}"]
    code, out, err = run_main(args, tmp_path, monkeypatch, capsys)
    line = one_error_line(err)
    assert code == 2 and "is not a dpresearch checkpoint" in line and "posix.system" in line
    assert not marker.exists() and not run_dir.exists()


def test_resume_auto_finding_a_planted_checkpoint_never_runs_it(tmp_path, monkeypatch, capsys):
    marker, run_dir = tmp_path / "ran", tmp_path / "run"
    plant_checkpoint(run_dir / "checkpoints" / "step_5.pt", marker)
    (run_dir / "checkpoints" / "latest").write_text("step_5.pt\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 5}\n')
    before = snapshot(run_dir)
    args = [*SYNTHETIC_SMALL, "train.resume=auto", f"hydra.run.dir={run_dir}"]
    code, out, err = run_main(args, tmp_path, monkeypatch, capsys)
    line = one_error_line(err)
    assert code == 2 and "step_5.pt is not a dpresearch checkpoint" in line
    assert not marker.exists()
    assert snapshot(run_dir) == before  # the named run is left as it was, lock file included


@pytest.mark.slow  # the same refusal in-process above, through train.resume=PATH and =auto
def test_resume_of_a_planted_checkpoint_on_the_command_line(tmp_path):
    """The same through the real entry point, in a process of its own."""
    marker, run_dir = tmp_path / "ran", tmp_path / "run"
    plant_checkpoint(run_dir / "checkpoints" / "step_5.pt", marker)
    (run_dir / "checkpoints" / "latest").write_text("step_5.pt\n")
    before = snapshot(run_dir)
    out = run_cli([*SYNTHETIC_SMALL, "train.resume=auto", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "is not a dpresearch checkpoint" in one_error_line(out.stderr)
    assert not marker.exists() and snapshot(run_dir) == before


def write_cifar10_with_payload(root: Path, marker: Path) -> None:
    """A CIFAR-10 folder whose first training batch carries the payload, with an MD5SUMS that
    vouches for every file (so verification passes and the batch is unpickled)."""
    import hashlib

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        content = {"labels": [1, 2], "data": rng.integers(0, 256, (2, 3072), dtype=np.uint8)}
        if name == "data_batch_1":
            content["data"] = Payload(marker)
        with open(folder / name, "wb") as f:
            pickle.dump(content, f, protocol=2)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{k}" for k in range(10)]}, f, protocol=2)
    sums = [f"{hashlib.md5(p.read_bytes()).hexdigest()}  {p.name}" for p in folder.iterdir()]
    (folder / "MD5SUMS").write_text("\n".join(sums) + "\n")


def test_a_planted_data_batch_never_runs(tmp_path, monkeypatch, capsys):
    marker, root, run_dir = tmp_path / "ran", tmp_path / "data", tmp_path / "run"
    write_cifar10_with_payload(root, marker)
    args = ["data=cifar10", f"data.root={root}", "model=resnet20", f"hydra.run.dir={run_dir}"]
    code, out, err = run_main(args, tmp_path, monkeypatch, capsys)
    line = one_error_line(err)
    assert code == 2 and "data_batch_1 is corrupt" in line and "posix.system" in line
    assert not marker.exists() and not run_dir.exists()


def test_an_object_array_in_a_data_batch_is_refused(tmp_path):
    """The CIFAR reader rebuilds numeric arrays only: an object array would hand its elements
    to the unpickler as Python objects."""
    from dpresearch.data.cifar import CIFAR10

    marker = tmp_path / "ran"
    write_cifar10_with_payload(tmp_path, marker)
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    with open(batch, "wb") as f:
        pickle.dump({"labels": [1], "data": np.array([None], dtype=object)}, f, protocol=2)
    with pytest.raises(ValueError, match="object arrays are not read"):
        CIFAR10.load(tmp_path, verify=False)


def test_a_planted_verification_cache_never_runs(tmp_path, monkeypatch):
    """The data verification cache (`.dpresearch-verified.json`, or the user's cache for a
    read-only folder) is JSON: a pickle planted there is an unreadable cache, so the files are
    hashed again, and the payload is never run."""
    from dpresearch.data.verify import MARKER, verify_files

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"abc")
    marker = tmp_path / "ran"
    (folder / MARKER).write_bytes(pickle.dumps(Payload(marker)))
    official = {"a.bin": "900150983cd24fb0d6963f7d28e17f72"}  # md5(b"abc")
    verify_files(folder, official, "test data")
    assert not marker.exists()
    assert json.loads((folder / MARKER).read_text())["files"]["a.bin"]["md5"] == official["a.bin"]
    (folder / "a.bin").write_bytes(b"abd")  # and a changed file is still caught
    with pytest.raises(ValueError, match="corrupt or changed"):
        verify_files(folder, official, "test data")
