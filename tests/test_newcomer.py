"""What a newcomer meets first (issue 33, item 6): the main job's offline error names the three
ways out, `study --help` is whole, and a resume command names the interpreter that ran."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import REPO, importable_checkout

from dpresearch.run import ending
from dpresearch.study.__main__ import __doc__ as study_doc
from dpresearch.study.__main__ import parser as study_parser


def test_offline_main_job_names_the_three_ways_out(tmp_path):
    """`bash scripts/run.sh` without the data and without a network: one error naming data the
    user has (`data.root=… data.download=false`), the shipped subset and the synthetic default,
    exit 1, nothing left behind in the data folder. The checkout is a copy whose `.venv` is
    this interpreter, already set up (setup.sh's stamp), so nothing is installed."""
    tree = tmp_path / "checkout"
    (tree / "scripts").mkdir(parents=True)
    for name in ("run.sh", "setup.sh"):
        shutil.copy(REPO / "scripts" / name, tree / "scripts" / name)
    shutil.copy(REPO / "pyproject.toml", tree / "pyproject.toml")
    venv = tree / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "python").chmod(0o755)
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()
    (tree / ".venv" / ".dpresearch-setup").write_text(f"{digest} \n")
    data = tmp_path / "data"
    closed = "http://127.0.0.1:9"  # the discard port: the connection is refused at once
    env = dict(
        os.environ,
        PYTHONPATH=str(importable_checkout()),
        DPRESEARCH_DATA=str(data),
        https_proxy=closed,
        HTTPS_PROXY=closed,
        http_proxy=closed,
        HTTP_PROXY=closed,
    )
    env.pop("no_proxy", None)
    env.pop("NO_PROXY", None)
    out = subprocess.run(
        ["bash", "scripts/run.sh"], cwd=tree, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "already installed" in out.stdout  # setup.sh did not reach for the network
    err = out.stderr
    assert "could not download CIFAR-10" in err, err
    assert "data.root=" in err and "data.download=false" in err, err
    assert "experiment=resnet20_cifar10_subset" in err, err
    assert ".venv/bin/python -m dpresearch.train\n" in err, err  # the synthetic default
    assert "Traceback" not in err, err
    assert not data.exists() or not any(data.iterdir())  # no half-downloaded folder


def test_study_help_is_whole():
    """`python -m dpresearch.study --help` says the whole description, not its first line."""
    text = " ".join(study_parser().format_help().split())
    assert " ".join(study_doc.split()) in text
    assert "exit 1." in text
    for action in ("run:", "status:", "report:"):
        assert action in text


def test_resume_command_names_the_interpreter_that_ran(tmp_path, monkeypatch):
    """A `.venv` interpreter is named by its path (`.venv/bin/python` from the checkout), never
    as a bare `python` that the shell would find elsewhere; one PATH finds is named bare."""
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    python = venv / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    other = tmp_path / "usr" / "bin"
    other.mkdir(parents=True)
    (other / "python").write_text("#!/bin/sh\n")
    (other / "python").chmod(0o755)
    monkeypatch.setenv("PATH", str(other))
    monkeypatch.chdir(tmp_path)
    assert ending.interpreter(str(python)) == ".venv/bin/python"
    monkeypatch.chdir(other)
    assert ending.interpreter(str(python)) == str(python)  # outside the checkout: absolute
    monkeypatch.setenv("PATH", str(venv))  # the venv activated: its `python` is this one
    assert ending.interpreter(str(python)) == "python"

    monkeypatch.setattr(sys, "executable", str(python))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(other))
    monkeypatch.delenv(ending.INVOCATION_ENV, raising=False)
    ending.remember_invocation(str(REPO / "dpresearch" / "train.py"), ["seed=1"])
    command = ending.resume_command(Path("outputs/r"), ["seed=1"])
    assert command.startswith(".venv/bin/python -m dpresearch.train seed=1 "), command
