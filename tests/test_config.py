"""Every option of every config group composes and validates; bad input gives one line."""

from __future__ import annotations

import pytest
from helpers import CONF_DIR, compose_config, run_cli

from dpresearch.config.validate import ConfigError, validate

GROUPS = ["data", "model", "optimizer", "schedule", "algorithm", "backend", "network", "logger"]
NEEDS_GPU = {("backend", "nccl")}
# Algorithms an optimizer selects (conf/optimizer/<x>.yaml overrides /algorithm): they compose
# with that optimizer.
SELECTED_BY = {
    ("algorithm", "onebit_adam"): ["optimizer=onebit_adam"],
    ("algorithm", "zero_one_adam"): ["optimizer=zero_one_adam"],
    ("algorithm", "demo"): ["optimizer=demo"],
}
# Options with a mandatory value (`???`): composed with one (validate reads no data).
REQUIRED = {
    ("data", "text"): ["data.root=corpus.txt"],
    # hierarchical DiLoCo's inner algorithm: nodes, and an outer optimizer to join them
    ("algorithm", "node_sync"): [
        "comm.hierarchy.workers_per_node=2",
        "outer=nesterov",
        "outer.period=4",
    ],
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in GROUPS for o in options(g) if (g, o) not in NEEDS_GPU]
)
def test_every_option_composes_and_validates(group, option):
    extra = [*SELECTED_BY.get((group, option), []), *REQUIRED.get((group, option), [])]
    cfg = compose_config(*extra, f"{group}={option}")
    validate(cfg)


def test_required_groups_exist():
    for group in GROUPS:
        assert options(group), f"conf/{group} has no options"


def test_nccl_without_gpu_is_rejected():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError, match="backend=gloo"):
        validate(compose_config("backend=nccl"))


def test_unknown_target_argument_is_rejected():
    with pytest.raises(ConfigError, match="model.width is not an option"):
        validate(compose_config("+model.width=3"))


def test_cfg_job_prints_composed_config(tmp_path):
    out = run_cli(["--cfg", "job", "algorithm=local_sgd"], cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "period: 8" in out.stdout and "workers: 4" in out.stdout


@pytest.mark.parametrize(
    "launcher,target",
    [("parallel", "JoblibLauncher"), ("slurm", "SlurmLauncher")],
)
def test_sweep_launchers_compose(launcher, target):
    """conf/hydra/launcher/: joblib (parallel local jobs) and submitit (SLURM)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith(target)
