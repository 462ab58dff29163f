"""Checkpoints and exact resume (issue 9, item 1, acceptance A and E's stop part).

A 60-step run killed at step 35 (an injected failure: the process dies with the run) after a
checkpoint at step 30, then resumed with `train.resume=auto`, ends with parameters equal bit
for bit (`torch.equal`) to an uninterrupted run's, and its `metrics.jsonl` holds every step
once, with the same values as the uninterrupted run's lines (timings aside).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    CHECKPOINT_CASES,
    CHECKPOINTED,
    RESUME_STEPS,
    SUBSET,
    check_resumed,
    cli_env,
    compose_config,
    final_params,
    kill_9_and_resume,
    kill_and_resume,
    load_scaled,
    metric_lines,
    run_cli,
    same,
    stop_and_resume,
    wait_for_step,
)
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from dpresearch.run.checkpoint_files import (
    checkpoint_files,
    checkpoint_interval,
    find_resume,
    latest_checkpoint,
)
from dpresearch.run.trainer import InjectedFailure
from dpresearch.train import train

# Lines that differ between two runs of the same computation: wall-clock timings.


# Simulated asynchronous SGD: 60 pushes of 4 workers; the server, protocol, speed streams,
# event queue and push codecs are in the checkpoint (`AsyncSGD.state_dict`).
ASYNC = "algorithm=async_sgd"
ASYNC_CASES = {
    "asgd_straggler": [
        ASYNC, "async.speed=exponential", "async.slow_workers=[0]", "async.slowdown=4",
        "async.straggler_prob=0.2", "optimizer.momentum=0.9",
    ],
    "ssp": [ASYNC, "protocol=ssp", "protocol.max_staleness=2", "async.speed=exponential"],
    "softsync": [  # c=4: the checkpoint at push 30 holds an open group of 2
        ASYNC, "protocol=softsync", "protocol.c=4", "async.speed=lognormal",
        "optimizer.momentum=0.9",
    ],
    "fixed_delay": [ASYNC, "async.delay=3", "optimizer.momentum=0.9"],
    "delay_adaptive": [
        ASYNC, "async.lr_policy=delay_adaptive", "async.speed=exponential",
        "async.slow_workers=[2]", "async.slowdown=3",
    ],
    "topk_ef14": [
        ASYNC, "compressor=topk", "compressor.ratio=0.1", "error_feedback=ef14",
        "async.speed=exponential",
    ],
}  # fmt: skip
# What the asynchronous runs report beyond the common keys: simulated time (a "time/" key, but
# a pure function of the configuration) and the staleness figures.
ASYNC_KEYS = ("async/", "time/simulated_s")


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_killed_and_resumed_equals_uninterrupted_simulated(case, tmp_path, one_thread):
    check_resumed(tmp_path, [*CHECKPOINTED, "workers=4", *CHECKPOINT_CASES[case]], InjectedFailure)


@pytest.mark.parametrize("case", list(ASYNC_CASES))
def test_killed_and_resumed_async_equals_uninterrupted(case, tmp_path, one_thread):
    args = [*CHECKPOINTED, "workers=4", *ASYNC_CASES[case]]
    check_resumed(tmp_path, args, InjectedFailure)
    resumed, reference = tmp_path / "resumed", tmp_path / "reference"

    def reported(line: dict) -> dict:
        return {k: v for k, v in line.items() if k.startswith(ASYNC_KEYS)}

    lines, ref_lines = metric_lines(resumed), metric_lines(reference)
    assert [reported(m) for m in lines] == [reported(m) for m in ref_lines]
    assert "time/simulated_s" in lines[-1] and "async/staleness_mean" in lines[-1]
    summary = reported(json.loads((resumed / "summary.json").read_text()))
    ref_summary = reported(json.loads((reference / "summary.json").read_text()))
    assert summary == ref_summary
    assert sum(summary["async/tau_histogram"]) == summary["async/gradients_applied"]
    assert summary["async/staleness_mean_run"] > 0  # the checkpoint held a stale queue
    assert summary["time/simulated_s"] > 0


@pytest.mark.skipif(not SUBSET.is_dir(), reason=f"no CIFAR subset at {SUBSET}")
def test_augmented_images_and_batchnorm_resume_exactly(tmp_path):
    """The default suite's form of the ResNet-20 test below (slow): CIFAR images with random
    crop + flip (each worker's augmentation generator) into an MLP with BatchNorm (running
    statistics), killed at step 35 and resumed, equals the uninterrupted run bit for bit."""
    args = [
        "data=cifar10",
        f"data.root={SUBSET}",
        "data.subset=512",
        "data.augment=true",
        "model=mlp",
        "model.hidden=[16]",
        "model.batch_norm=true",
        "workers=2",
        "train.batch_size=4",
        f"train.steps={RESUME_STEPS}",
        "train.log_every=1",
        "train.eval_every=60",
        "train.progress=false",
        "backend.threads=1",
    ]
    reference = tmp_path / "reference"
    train(compose_config(*args), reference)
    resumed = kill_and_resume(tmp_path, args, InjectedFailure)
    assert same(final_params(resumed), final_params(reference))
    assert [m["step"] for m in metric_lines(resumed)] == list(range(1, RESUME_STEPS + 1))


@pytest.mark.slow
@pytest.mark.skipif(not SUBSET.is_dir(), reason=f"no CIFAR subset at {SUBSET}")
def test_resnet20_with_augmentation_and_batchnorm_resumes_exactly(tmp_path):
    """ResNet-20 (BatchNorm) on the CIFAR subset with random crop + flip: 60 steps of 2 workers
    × 4 images on the first 512 images."""
    args = [
        "experiment=resnet20_cifar10_subset",
        f"data.root={SUBSET}",
        "data.subset=512",
        "workers=2",
        "train.batch_size=4",
        "train.eval_batch_size=500",
        f"train.steps={RESUME_STEPS}",
        "train.log_every=5",
        "train.eval_every=60",
        "train.progress=false",
        "backend.threads=2",
    ]
    reference = tmp_path / "reference"
    train(compose_config(*args), reference)
    resumed = kill_and_resume(tmp_path, [*args, "train.log_every=1"], InjectedFailure)
    assert same(final_params(resumed), final_params(reference))
    steps = [m["step"] for m in metric_lines(resumed)]
    assert steps == list(range(1, RESUME_STEPS + 1))


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_and_resumed_equals_uninterrupted_gloo(tmp_path):
    """sync + QSGD + EF14 on 2 gloo processes: a worker process dies at step 35."""
    check_resumed(
        tmp_path,
        [
            *CHECKPOINTED,
            "workers=2",
            *CHECKPOINT_CASES["sync_qsgd_ef14"],
            "backend=gloo",
            "backend.threads=1",
        ],
        ChildFailedError,
    )


def test_checkpoint_interval_and_resume_lookup(tmp_path):
    assert checkpoint_interval(None, 50) == 0
    assert checkpoint_interval("0", 50) == 0
    assert checkpoint_interval(200, 50) == 200
    assert checkpoint_interval("1ep", 50) == 50
    assert checkpoint_interval("0.5ep", 50) == 25
    assert checkpoint_interval("0.001ep", 50) == 1
    assert find_resume(None, tmp_path) is None
    assert find_resume("auto", tmp_path) is None  # nothing there: a fresh start
    run_dir = tmp_path / "run"
    cfg = compose_config(*CHECKPOINTED, "train.steps=20", "train.checkpoint_every=1ep")
    train(cfg, run_dir)
    files = checkpoint_files(run_dir / "checkpoints")
    assert [f.name for f in files] == ["step_8.pt", "step_16.pt"]  # 8 steps per epoch
    assert find_resume("auto", run_dir) == files[-1]
    assert find_resume(str(run_dir), None) == files[-1].resolve()
    assert find_resume(str(files[0]), None) == files[0].resolve()
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


def test_resume_auto_without_a_checkpoint_starts_fresh_and_drops_old_lines(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train/loss": 9}\n')
    train(compose_config(*CHECKPOINTED, "train.steps=5", "train.resume=auto"), run_dir)
    assert [m["step"] for m in metric_lines(run_dir)] == [1, 2, 3, 4, 5]
    assert metric_lines(run_dir)[0]["train/loss"] != 9


def test_resume_of_another_layout_is_one_line_before_any_worker_starts(tmp_path):
    from dpresearch.config.validate import ConfigError

    run_dir = tmp_path / "run"
    args = [*CHECKPOINTED, "workers=2", "train.steps=10", "train.checkpoint_every=5"]
    train(compose_config(*args), run_dir)
    with pytest.raises(ConfigError, match="was written with workers=2, this run has workers=4"):
        train(compose_config(*CHECKPOINTED, f"train.resume={run_dir}"), tmp_path / "new")
    # the same workers as 2 gloo processes: refused from the header, nothing launched
    with pytest.raises(ConfigError, match="with processes=1, this run has processes=2"):
        train(compose_config(*args, "backend=gloo", f"train.resume={run_dir}"), tmp_path / "g")
    with pytest.raises(ConfigError, match="with algorithm=dpresearch.algorithms.sync.SyncSGD"):
        train(compose_config(*args, "algorithm=dpsgd", f"train.resume={run_dir}"), tmp_path / "d")


# -- stop requests -------------------------------------------------------------------------


def test_kill_9_then_resume_equals_uninterrupted(tmp_path):
    """A real SIGKILL at an arbitrary step (after the first checkpoint): the lock and any
    half-written file it leaves are taken over, the resumed run ends as an uninterrupted one."""
    args = [*CHECKPOINTED, "train.steps=400", "train.eval_every=200", "train.checkpoint_every=10"]

    def tear(run_dir: Path) -> None:
        (run_dir / "checkpoints" / ".step_999.pt.half.tmp").write_bytes(b"torn")

    run_dir, reference = kill_9_and_resume(args, tmp_path, kill_after=35, before_resume=tear)
    assert [m["step"] for m in metric_lines(run_dir)] == list(range(1, 401))
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    assert same(final_params(run_dir), final_params(reference))


@pytest.mark.slow  # the default suite's signal stop: test_async_remote's SIGTERM on gloo
def test_sigint_simulated_stops_cleanly_and_resumes_exactly(tmp_path):
    args = [*CHECKPOINTED, "train.steps=600", "train.log_every=1", "train.eval_every=300"]
    run_dir, _ = stop_and_resume(tmp_path, args, signal.SIGINT, bound_s=10)
    steps = [m["step"] for m in metric_lines(run_dir)]
    assert steps == list(range(1, 601))
    reference = tmp_path / "reference"
    train(compose_config(*args), reference)
    assert same(final_params(run_dir), final_params(reference))


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_gloo_stops_within_10_s_and_resumes_exactly(tmp_path):
    """Acceptance E: SIGTERM to the launcher of a gloo × 2 run."""
    args = [
        *CHECKPOINTED,
        "workers=2",
        "backend=gloo",
        "backend.threads=1",
        "comm.deterministic=true",
        "train.steps=4000",
        "train.log_every=1",
        "train.eval_every=2000",
    ]
    run_dir, _ = stop_and_resume(tmp_path, args, signal.SIGTERM, bound_s=10)
    assert [m["step"] for m in metric_lines(run_dir)] == list(range(1, 4001))
    # deterministic sums: simulated and gloo agree bit for bit (test_equivalence)
    reference = tmp_path / "reference"
    train(compose_config(*[a for a in args if not a.startswith("backend=")]), reference)
    assert same(final_params(run_dir), final_params(reference))


def test_progress_line_shows_throughput_and_eta():
    from dpresearch.run.progress import format_progress

    line = format_progress(
        {
            "step": 50,
            "epoch": 0.5,
            "samples": 6400,
            "train/loss": 1.0,
            "lr": 0.1,
            "comm/bytes": 0.0,
            "comm/modeled_s": 0.0,
            "time/wall_s": 10.0,
        },
        total_steps=200,
    )
    assert "5 steps/s (640 img/s)" in line and "ETA 0:30" in line


@pytest.mark.slow  # two command-line runs; the default suite's CLI resume: kill -9 above
def test_resume_from_a_checkpoint_file_continues_in_its_run_directory(tmp_path):
    """`train.resume=<run>/checkpoints/step_N.pt` without `hydra.run.dir`: the run continues
    in `<run>` from step N (a Lightning `ckpt_path`, but the run's own directory)."""
    run_dir = tmp_path / "run"
    args = [*CHECKPOINTED, "train.steps=10", "train.checkpoint_every=4", "train.checkpoint_keep=5"]
    train(compose_config(*args), run_dir)  # in this process: one interpreter start fewer
    refused = run_cli([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert refused.returncode == 2 and "or train.resume=auto to continue" in refused.stderr
    before = (run_dir / "metrics.jsonl").read_text().splitlines()
    out = run_cli(
        [*args, f"train.resume={run_dir / 'checkpoints' / 'step_4.pt'}"], cwd=tmp_path / "run"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    after = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in after] == list(range(1, 11))
    assert after[:4] == before[:4] and after[4:] != before[4:]  # steps 5-10 run again
    assert not (run_dir / "outputs").exists()


def test_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    """Offline W&B (no network in tests): the resumed attempt logs under the run id stored in
    the run directory, so `wandb sync` (or an online run) continues one W&B run."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    args = [
        *CHECKPOINTED,
        "train.steps=10",
        "train.checkpoint_every=5",
        "logger=wandb",
        "logger.mode=offline",
    ]
    with pytest.raises(InjectedFailure):
        train(compose_config(*args, "debug.fail_worker=0", "debug.fail_at_step=7"), run_dir)
    run_id = (run_dir / "wandb_id").read_text().strip()
    train(compose_config(*args, "train.resume=auto"), run_dir)
    assert (run_dir / "wandb_id").read_text().strip() == run_id
    runs = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    # W&B names a folder offline-run-<second>-<id>, adding "-1" when both attempts start
    # within the same second.
    pattern = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(runs) == 2 and all(pattern.fullmatch(name) for name in runs), runs


def test_resume_auto_of_a_finished_run_leaves_it_as_it_is(tmp_path):
    run_dir = tmp_path / "run"
    train(compose_config(*CHECKPOINTED, "train.steps=5"), run_dir)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    summary = train(compose_config(*CHECKPOINTED, "train.steps=5", "train.resume=auto"), run_dir)
    assert summary["status"] == "finished"
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


SCHEDULER = """
import pathlib, runpy, signal, sys

marker = pathlib.Path(sys.argv[1])
sys.argv = ["dpresearch.train", *sys.argv[2:]]


def requeue(signum, frame):  # what submitit's SIGUSR2 handler does: requeue, then exit
    marker.write_text("requeued")
    sys.exit(0)


signal.signal(signal.SIGUSR2, requeue)
runpy.run_module("dpresearch.train", run_name="__main__")
"""


@pytest.mark.slow  # the default suite's signal stop: test_async_remote's SIGTERM on gloo
def test_sigusr2_checkpoints_then_hands_on_to_the_schedulers_handler(tmp_path):
    """SLURM/submitit: SIGUSR2 before a time limit or a preemption. The run stops at a step
    boundary with a final checkpoint and `status: interrupted`, then the handler that was
    installed before it (submitit's requeue) runs; the requeued job resumes exactly."""
    run_dir, marker = tmp_path / "run", tmp_path / "requeued"
    args = [*CHECKPOINTED, "train.steps=600", "train.eval_every=300", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SCHEDULER, str(marker), *args],
        cwd=tmp_path,
        env=cli_env(WANDB_MODE="disabled"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_step(run_dir, proc, 3, timeout=240)
        os.kill(proc.pid, signal.SIGUSR2)
        _, err = proc.communicate(timeout=load_scaled(120))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert marker.read_text() == "requeued", err[-3000:]
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert latest_checkpoint(run_dir).name == f"step_{summary['interrupted_at_step']}.pt"
    out = run_cli([*args, "train.resume=auto"], cwd=tmp_path)  # the requeued job
    assert out.returncode == 0, out.stderr[-3000:]
    assert [m["step"] for m in metric_lines(run_dir)] == list(range(1, 601))
    reference = tmp_path / "reference"
    train(compose_config(*args[:-1]), reference)
    assert same(final_params(run_dir), final_params(reference))
