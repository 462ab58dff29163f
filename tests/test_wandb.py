"""W&B never fails a run: an online start that cannot reach the server, or has no API key,
falls back to offline with one warning line (issue 9, item 5); runs get readable names and
groups (item 6)."""

from __future__ import annotations

import socket

import pytest
import yaml
from helpers import SMALL, load_scaled, run_cli
from omegaconf import DictConfig, OmegaConf

from dpresearch.run.logger import RunLogger
from dpresearch.run.wandb_names import default_names


def closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def online_logger(init_timeout_s: float) -> DictConfig:
    """A `logger` node for an online W&B run (project "p", run "n" in group "g")."""
    return OmegaConf.create(
        {
            "wandb": True,
            "mode": "online",
            "project": "p",
            "entity": None,
            "name": "n",
            "group": "g",
            "job_type": None,
            "tags": [],
            "init_timeout_s": init_timeout_s,
        }
    )


@pytest.mark.slow  # waits for W&B's connection timeout; the fallback in-process below stays
def test_unreachable_server_falls_back_to_offline_and_the_run_completes(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    run_dir = tmp_path / "run"
    out = run_cli(
        [
            "logger=wandb",
            "logger.mode=online",
            "logger.init_timeout_s=5",
            "train.steps=3",
            *SMALL,
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: W&B online start failed ("), lines
    assert f"logging offline to {run_dir / 'wandb'}" in lines[0]
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert (run_dir / "summary.json").exists()


def test_a_server_that_never_answers_falls_back_within_15_s(tmp_path, monkeypatch, capsys):
    """No network (here: a local port that accepts connections and never answers, so nothing
    leaves this machine): the start falls back to offline in one line within 15 s, with the
    default `logger.init_timeout_s` (30 s; W&B itself took 40 s here, 90 s without a network)."""
    import time

    import wandb

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # the kernel completes connections; no one ever reads them
    url = f"http://127.0.0.1:{hole.getsockname()[1]}"
    monkeypatch.setenv("WANDB_BASE_URL", url)
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    wandb.teardown()
    cfg = online_logger(init_timeout_s=30)
    try:
        started = time.monotonic()
        logger = RunLogger(tmp_path / "run", {"seed": 0}, cfg)
        took = time.monotonic() - started
        logger.log({"step": 1, "train/loss": 1.0})
        logger.finish({"train/loss": 1.0})
    finally:
        hole.close()
        wandb.teardown()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and f"W&B online start failed (no answer from {url} within" in err[0]
    assert took <= load_scaled(15), f"{took:.1f} s"
    assert len(list((tmp_path / "run" / "wandb").glob("offline-run-*"))) == 1


def test_no_api_key_falls_back_to_offline(tmp_path, monkeypatch, capsys):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no saved login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    cfg = online_logger(init_timeout_s=5)
    logger = RunLogger(tmp_path / "run", {"seed": 0}, cfg)
    logger.log({"step": 1, "train/loss": 1.0})
    logger.finish({"train/loss": 1.0})
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "W&B online start failed (No API key configured" in err[0], err
    assert len(list((tmp_path / "run" / "wandb").glob("offline-run-*"))) == 1


def hydra_info(mode: str, choices: dict, override_dirname: str = "", sweep_dir: str = ""):
    from hydra.types import RunMode

    return OmegaConf.create(
        {
            "mode": RunMode[mode],
            "runtime": {"choices": choices},
            "job": {"override_dirname": override_dirname},
            "sweep": {"dir": sweep_dir},
        }
    )


CHOICES = {
    "algorithm": "sync",
    "compressor": "topk",
    "error_feedback": "ef14",
    "model": "resnet20",
    "data": "cifar10",
    "experiment": None,
}


def test_run_names_say_what_ran_and_groups_follow_the_sweep_or_study():
    cfg = OmegaConf.create({"workers": 8, "seed": 1, "logger": {"name": None, "group": None}})
    name, group = default_names(cfg, hydra_info("RUN", CHOICES))
    assert (name, group) == ("sync-topk-ef14-resnet20-cifar10-w8-s1", None)
    study = dict(CHOICES, experiment="resnet20_cifar10", error_feedback="none")
    assert default_names(cfg, hydra_info("RUN", study)) == (
        "sync-topk-resnet20-cifar10-w8-s1",
        "resnet20_cifar10",
    )
    name, group = default_names(
        cfg,
        hydra_info("MULTIRUN", CHOICES, "seed=1,workers=8", "/x/multirun/2026-01-01/10-00-00-1"),
    )
    assert name == "sync-topk-ef14-resnet20-cifar10-w8-s1 [seed=1,workers=8]"
    assert group == "multirun/2026-01-01/10-00-00-1"
    cfg.logger.name, cfg.logger.group = "mine", "ours"
    assert default_names(cfg, hydra_info("RUN", CHOICES)) == ("mine", "ours")


def test_sweep_point_names_hold_the_swept_values_not_the_fixed_ones(tmp_path):
    """Points of `-m seed=0,1 optimizer.lr=0.1,0.2 workers=8 data=cifar10` are told apart by
    their lr (the seed is in the name already); `workers=8` is the same for every point."""
    (tmp_path / "multirun.yaml").write_text(
        yaml.safe_dump(
            {
                "hydra": {
                    "overrides": {
                        "task": ["seed=0,1", "optimizer.lr=0.1,0.2", "workers=8", "data=cifar10"]
                    }
                }
            }
        )
    )
    cfg = OmegaConf.create({"workers": 8, "seed": 1, "logger": {"name": None, "group": None}})
    hc = hydra_info(
        "MULTIRUN", CHOICES, "data=cifar10,optimizer.lr=0.2,seed=1,workers=8", str(tmp_path)
    )
    hc.overrides = {"task": ["seed=1", "optimizer.lr=0.2", "workers=8", "data=cifar10"]}
    name, _ = default_names(cfg, hc)
    assert name == "sync-topk-ef14-resnet20-cifar10-w8-s1 [optimizer.lr=0.2]"


def test_results_table_follows_a_wandb_mode_set_after_wandb_started(tmp_path, monkeypatch):
    """W&B reads the environment once per process; a study report asked for in disabled mode
    after an earlier W&B use in the same process must still not try to log in."""
    import pandas as pd
    import wandb

    from dpresearch.analysis.wandb_table import log_table

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no saved login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    wandb.teardown()
    wandb.setup()  # the process's W&B settings, taken with no mode set
    try:
        monkeypatch.setenv("WANDB_MODE", "disabled")
        table = pd.DataFrame({"case": ["dense"], "acc": [0.5]})
        assert log_table(table, ["case", "acc"], group="g") is True
    finally:
        wandb.teardown()
