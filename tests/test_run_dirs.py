"""Run directories never mix (issue 9, acceptance C and item 2), and what a run leaves in its
directory (item 6: first line, train.log, provenance.json)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CONF_DIR, SMALL, cli_env, load_scaled, run_cli
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dpresearch.config.validate import ConfigError
from dpresearch.launch.run_dir import claim_run_dir

QUICK = [*SMALL, "data.num_train=256", "data.num_test=64", "train.steps=4", "train.log_every=1"]


def steps_of(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def test_default_sweep_directories_differ_within_one_second():
    """Two sweeps composed back to back (well within a second) get different directories."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        first = compose("config", return_hydra_config=True).hydra.sweep.dir
        second = compose("config", return_hydra_config=True).hydra.sweep.dir
    assert first != second
    for name in (first, second):  # the time down to the microsecond
        assert re.fullmatch(r"multirun/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-\d{6}", name), name


def test_sweep_point_folder_names_carry_every_override_including_seed():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", return_hydra_config=True)
    assert list(cfg.hydra.job.config.override_dirname.exclude_keys) == []
    sweep = OmegaConf.to_container(cfg.hydra.sweep, resolve=False)
    assert sweep["subdir"] == "${hydra.job.num}-${hydra.job.override_dirname}"


@pytest.mark.slow  # two command-line sweeps at once; the default suite's sweeps: test_sweeps
def test_two_sweeps_started_together_never_share_a_file(tmp_path):
    """Acceptance C: `-m seed=0,1` and `-m seed=2,3` started at once, default directories."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dpresearch.train", "-m", f"seed={seeds}", *QUICK],
            cwd=tmp_path,
            env=cli_env(WANDB_MODE="disabled"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for seeds in ("0,1", "2,3")
    ]
    outputs = [p.communicate(timeout=load_scaled(300))[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    sweeps = sorted(p.parent for p in tmp_path.glob("multirun/*/*/multirun.yaml"))
    assert len(sweeps) == 2, sweeps
    points = sorted(p.parent for p in tmp_path.glob("multirun/*/*/*/metrics.jsonl"))
    seeds = sorted(int(p.name.split("seed=")[1].split(",")[0]) for p in points)
    assert seeds == [0, 1, 2, 3]  # each folder name says its seed
    for point in points:
        assert steps_of(point / "metrics.jsonl") == [1, 2, 3, 4]  # one run's lines only
        config = (point / "config.yaml").read_text()
        assert f"seed: {point.name.split('seed=')[1].split(',')[0]}" in config


@pytest.mark.slow
def test_rerun_into_the_same_directory_is_refused_and_the_run_is_kept(tmp_path):
    """Acceptance C: the second run changes nothing in the first one's directory. Also item 6:
    the first line names the run directory, train.log holds the output, provenance.json."""
    run_dir = tmp_path / "run"
    first = run_cli([*QUICK, "train.progress=true", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.splitlines()[0] == f"run directory: {run_dir}"
    log = (run_dir / "train.log").read_text()
    assert "run directory:" in log and "step 4/4" in log
    provenance = json.loads((run_dir / "provenance.json").read_text())
    assert len(provenance["git"]["commit"]) == 40 and isinstance(provenance["git"]["dirty"], bool)
    assert provenance["versions"]["torch"] and provenance["host"]
    assert "train.steps=4" in provenance["command"] and "train.steps=4" in provenance["overrides"]
    assert not (run_dir / ".lock").exists()  # released at exit
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}

    again = run_cli([*QUICK, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert again.returncode == 2
    assert again.stderr.strip().startswith(f"error: hydra.run.dir={run_dir} already holds")
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    assert steps_of(run_dir / "metrics.jsonl") == [1, 2, 3, 4]


@pytest.mark.slow
def test_claim_is_exclusive_between_processes(tmp_path):
    """Two processes cannot write one directory: while one holds the claim, another's fails
    with one line naming the holder; after release it succeeds."""
    run_dir = tmp_path / "run"
    probe = (
        "import sys; from dpresearch.launch.run_dir import claim_run_dir\n"
        "from dpresearch.config.validate import ConfigError\n"
        "try:\n    claim_run_dir(sys.argv[1])\nexcept ConfigError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    with claim_run_dir(run_dir):
        held = subprocess.run(
            [sys.executable, "-c", probe, str(run_dir)],
            capture_output=True,
            text=True,
            env=cli_env(),
            timeout=load_scaled(60),
        )
    assert held.returncode == 3
    assert "is being written by another run (pid" in held.stdout
    free = subprocess.run(
        [sys.executable, "-c", probe, str(run_dir)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=load_scaled(60),
    )
    assert free.returncode == 0, free.stdout


def test_claim_refuses_a_directory_holding_a_run_unless_resuming(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("{}")
    try:
        claim_run_dir(run_dir)
    except ConfigError as exc:
        assert "already holds another run (summary.json)" in str(exc)
    else:
        raise AssertionError("claimed a directory holding a run")
    with claim_run_dir(run_dir, resume=True):  # what train.resume will use
        assert (run_dir / ".lock").exists()
    assert not (run_dir / ".lock").exists()
