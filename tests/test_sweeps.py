"""Sweeps that survive their bad points, under every launcher the README shows (issue 9,
item 4's sweep clause and acceptance G)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import SMALL, run_cli

QUICK = [*SMALL, "data.num_train=256", "data.num_test=64", "train.steps=4", "train.log_every=2"]


def points(sweep_dir: Path) -> dict[str, Path]:
    """Point folder name → folder, for the points that started (have a config.yaml)."""
    return {p.parent.name: p.parent for p in sweep_dir.glob("*/config.yaml")}


@pytest.mark.slow
def test_sweep_runs_every_good_point_and_lists_the_failed_ones(tmp_path):
    """`workers=0` is rejected before launching (no folder); `workers=3` fails while running
    (worker 2 raises); `workers=2` completes; the sweep exits 1 naming both failed points."""
    sweep = tmp_path / "sweep"
    out = run_cli(
        [
            "-m",
            "workers=2,0,3",
            "debug.fail_worker=2",
            "debug.fail_at_step=1",
            *QUICK,
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert errors[-1].startswith("error: 2 of 3 sweep points failed, the others ran: ")
    assert "workers=0" in errors[-1] and "workers=3" in errors[-1]
    assert "need at least 1 worker" in errors[-1] and "injected failure" in errors[-1]
    started = points(sweep)
    assert len(started) == 2 and not any("workers=0" in name for name in started)
    (good,) = [d for name, d in started.items() if "workers=2" in name]
    summary = json.loads((good / "summary.json").read_text())
    assert summary["total_steps"] == 4  # the good point's results are whole
    (bad,) = [d for name, d in started.items() if "workers=3" in name]
    assert not (bad / "summary.json").exists()


def check_parallel_gloo_sweep(tmp_path: Path, seeds: list[int]) -> None:
    """A sweep over `seeds` through the joblib launcher, each point a gloo ×2 run: every job's
    lines labelled with its number, its train.log holding what its workers printed."""
    sweep = tmp_path / "sweep"
    out = run_cli(
        [
            "-m",
            "hydra/launcher=parallel",
            "backend=gloo",
            "workers=2",
            f"seed={','.join(map(str, seeds))}",
            *QUICK,
            "train.progress=true",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        timeout=540,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    started = points(sweep)
    assert sorted(name.split("seed=")[1].split(",")[0] for name in started) == list(map(str, seeds))
    for directory in started.values():
        assert json.loads((directory / "summary.json").read_text())["total_steps"] == 4
    for job in range(len(seeds)):
        assert f"[{job}] run directory: {sweep}/{job}-" in out.stdout
        assert f"[{job}] gloo: starting 2 worker processes" in out.stdout
        assert f"[{job}] gloo: 2 processes started and connected in " in out.stdout
        assert f"[{job}] step 4/4" in out.stdout  # printed by the job's gloo worker 0
    for directory in started.values():  # train.log holds what the run printed, workers too
        log = (directory / "train.log").read_text()
        assert log.startswith("run directory: ") and "step 4/4" in log


@pytest.mark.slow  # a joblib worker that spawns its gloo processes: one new interpreter each
@pytest.mark.distributed
def test_parallel_launcher_runs_a_gloo_point_with_labelled_output(tmp_path):
    """Acceptance G, joblib launcher: a gloo ×2 run inside a joblib (loky) job (`cannot find
    context for 'loky'` before), its lines labelled."""
    check_parallel_gloo_sweep(tmp_path, [0])


@pytest.mark.slow
@pytest.mark.distributed
def test_parallel_launcher_runs_a_gloo_sweep_with_labelled_output(tmp_path):
    """Acceptance G, joblib launcher: two gloo ×2 runs at once, each job's lines labelled."""
    check_parallel_gloo_sweep(tmp_path, [0, 1])


@pytest.mark.slow
@pytest.mark.distributed
def test_basic_launcher_runs_a_gloo_sweep(tmp_path):
    """Acceptance G, the default launcher (one job after another)."""
    sweep = tmp_path / "sweep"
    out = run_cli(
        ["-m", "backend=gloo", "workers=2", "seed=0,1", *QUICK, f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
        timeout=540,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    started = points(sweep)
    assert len(started) == 2
    assert all((d / "summary.json").exists() for d in started.values())


def test_slurm_launcher_settings_compose_for_a_gloo_sweep(tmp_path):
    """Acceptance G, SLURM (no cluster here): the launcher and the sweeper compose with a
    gloo ×2 configuration, one task per node that starts the workers itself."""
    out = run_cli(
        ["hydra/launcher=slurm", "backend=gloo", "workers=2", "--cfg", "hydra"],
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "_target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher" in (
        out.stdout
    )
    assert "_target_: hydra_plugins.dpresearch_sweeper.DpresearchSweeper" in out.stdout
    assert "tasks_per_node: 1" in out.stdout
    # requeued on SIGUSR2 (time limit, preemption) after the run's own final checkpoint
    assert "signal_delay_s: 120" in out.stdout and "max_num_timeout: 3" in out.stdout
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()
