"""Acceptance D (issue 17): a new asynchronous protocol and a new gossip algorithm are each one
class + one YAML. The files are taken from docs/extending.md (every block headed
`# file: <path>`), written to a directory of the user's own, and trained with through
`hydra.searchpath` — the worked example of the docs, composed and run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    SMALL,
    TOL64,
    check_resumed,
    compose_config,
    final_state64,
    max_diff,
    run_cli,
)

from dpresearch.run.trainer import InjectedFailure
from dpresearch.train import train

DOC = REPO / "docs" / "extending.md"
BLOCK = re.compile(r"```(?:python|yaml)\n# file: (\S+)\n(.*?)```", re.S)


@pytest.fixture
def own_code(tmp_path: Path, monkeypatch) -> str:
    """The doc's files written under `tmp_path/own`; returns the searchpath override."""
    root = tmp_path / "own"
    files = BLOCK.findall(DOC.read_text())
    assert {name for name, _ in files} == {
        "my_research/protocols.py",
        "my_research/gossip.py",
        "my_research/lstm.py",
        "conf/protocol/first_k.yaml",
        "conf/algorithm/randomized_gossip.yaml",
        "conf/model/char_lstm.yaml",
    }
    for name, text in files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "my_research" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))
    return f"hydra.searchpath=[file://{root / 'conf'}]"


def final(run_dir: Path) -> dict:
    return torch.load(run_dir / "model_final.pt")


def run(tmp_path: Path, name: str, *args: str) -> dict:
    train(compose_config(*SMALL, "train.steps=40", "workers=4", *args), tmp_path / name)
    return final(tmp_path / name)


def test_first_k_protocol_spans_sync_and_asgd(own_code, tmp_path, one_thread):
    """k = K is the synchronous barrier, k = 1 asynchronous SGD, exactly; k = 2 in between."""
    speeds = [
        "algorithm=async_sgd",
        "async.speed=exponential",
        "async.slow_workers=[1]",
        "async.slowdown=3",
    ]
    first_k = [*speeds, "protocol=first_k", own_code]
    assert (
        max_diff(
            run(tmp_path, "k4", *first_k, "protocol.k=4"),
            run(tmp_path, "sync", *speeds, "protocol=sync"),
        )
        == 0
    )
    assert (
        max_diff(
            run(tmp_path, "k1", *first_k, "protocol.k=1"),
            run(tmp_path, "asgd", *speeds, "protocol=asgd"),
        )
        == 0
    )
    two = run(tmp_path, "k2", *first_k, "protocol.k=2")
    assert max_diff(two, final(tmp_path / "sync")) > 1e-4
    assert max_diff(two, final(tmp_path / "asgd")) > 1e-4


def test_first_k_protocol_checkpoints_and_resumes_exactly(own_code, tmp_path, one_thread):
    args = [
        *SMALL,
        "data.num_train=512",
        "train.batch_size=16",
        "train.log_every=1",
        "train.eval_every=20",
        "train.steps=60",
        "workers=4",
        "algorithm=async_sgd",
        "async.speed=exponential",
        "protocol=first_k",
        "protocol.k=3",
        own_code,
    ]
    check_resumed(tmp_path, args, InjectedFailure)


def test_randomized_gossip_on_two_workers_is_dpsgd(own_code, tmp_path, one_thread):
    """Two workers on a complete graph are always matched: x ← (x_0 + x_1)/2 − η·g, D-PSGD's
    update with weights 1/2. Two implementations of the same update (issue 33, class b):
    float64, to 1e-9 (`helpers.final_state64`)."""
    common = [*SMALL, "train.steps=40", "workers=2", "topology=complete"]
    ours, _ = final_state64(compose_config(*common, "algorithm=randomized_gossip", own_code))
    dpsgd, _ = final_state64(compose_config(*common, "algorithm=dpsgd"))
    assert next(iter(ours.values())).dtype == torch.float64
    assert max_diff(ours, dpsgd) <= TOL64


def test_randomized_gossip_trains_and_resumes_exactly(own_code, tmp_path, one_thread):
    args = [
        *SMALL,
        "data.num_train=512",
        "train.batch_size=16",
        "train.log_every=1",
        "train.eval_every=20",
        "train.steps=60",
        "workers=8",
        "topology=ring",
        "algorithm=randomized_gossip",
        own_code,
    ]
    check_resumed(tmp_path, args, InjectedFailure)
    summary = train(compose_config(*args[:-1], "train.steps=200", own_code), tmp_path / "long")
    assert summary["test/acc"] > 0.5 and summary["gossip/consensus_distance"] < 0.1


@pytest.mark.slow  # three interpreter starts; the code they run is tested in-process above
def test_the_docs_commands_run_and_check_their_input(own_code, tmp_path):
    out = run_cli(
        [
            *SMALL,
            "algorithm=async_sgd",
            "protocol=first_k",
            "protocol.k=3",
            "train.steps=20",
            own_code,
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").exists()
    bad = run_cli(
        ["algorithm=async_sgd", "protocol=first_k", own_code, f"hydra.run.dir={tmp_path / 'bad'}"],
        cwd=tmp_path,
    )
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr
    assert lines[0] == (
        "error: protocol=first_k needs 1 <= protocol.k <= workers (4), e.g. protocol.k=2"
    )
    assert not (tmp_path / "bad").exists()
    directed = run_cli(
        [
            "algorithm=randomized_gossip",
            "topology=exponential",
            own_code,
            f"hydra.run.dir={tmp_path / 'd'}",
        ],
        cwd=tmp_path,
    )
    assert directed.returncode == 2 and "must be undirected" in directed.stderr


def test_char_lstm_trains_on_the_shared_corpus(own_code, tmp_path, one_thread):
    """The doc's language model, one class + one YAML: the checks pass, it trains on the
    Shakespeare corpus (loss falls from ln 84 ≈ 4.43) and reports bits per character."""
    import json

    corpus = REPO.parent / "shared" / "data" / "shakespeare" / "works"
    if not corpus.is_dir():
        pytest.skip(f"the Shakespeare corpus is not at {corpus}")
    args = [
        "data=shakespeare",
        f"data.root={corpus}",
        "model=char_lstm",
        "model.block_size=16",
        "data.eval_tokens=512",
        "data.sample_tokens=10",
        "train.steps=40",
        "train.log_every=10",
        "optimizer.lr=0.01",
        "schedule=constant",
        own_code,
        f"hydra.run.dir={tmp_path / 'lstm'}",
    ]
    out = run_cli(args, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((tmp_path / "lstm" / "summary.json").read_text())
    assert summary["test/bpc"] < 4.2  # the unigram entropy is 4.80 bits per character
    assert (tmp_path / "lstm" / "sample.txt").read_text()
