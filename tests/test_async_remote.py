"""Asynchronous training on real processes (issue 8, acceptance E): a gloo server and 4 worker
processes train the MLP with τ ≈ K − 1 under equal speeds; a killed worker ends the run
non-zero within 30 s; a hung worker is named by the server. Issue 17: the real mode runs the
ordinary loop on every rank through the communicator's messages; with a seeded event order it
equals the simulator; it checkpoints (pushes in flight included) and resumes exactly after
kill -9 or SIGTERM (acceptance B)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    SMALL,
    compose_config,
    final_params,
    free_port,
    load_scaled,
    metric_lines,
    run_cli,
    run_ours,
    same,
    start_cli,
    stop_and_resume,
    wait_for_step,
    worker_processes,
)

from dpresearch.run.checkpoint_files import latest_checkpoint, to_cpu
from dpresearch.train import train

ASYNC = "algorithm=async_sgd"


@pytest.mark.slow
@pytest.mark.distributed
def test_four_gloo_workers_train_with_staleness_k_minus_one(small_config, tmp_path):
    steps, k = 160, 4
    run_ours(
        small_config,
        tmp_path,
        "real",
        f"workers={k}",
        ASYNC,
        "backend=gloo",
        "backend.threads=1",
        "async.inject_delay=0.03",
        "compressor=topk",
        "compressor.ratio=0.1",
        "error_feedback=ef14",
        f"train.steps={steps}",
    )
    summary = json.loads((tmp_path / "real" / "summary.json").read_text())
    histogram = summary["async/tau_histogram"]
    mean = sum(t * n for t, n in enumerate(histogram)) / sum(histogram)
    assert sum(histogram) == steps == summary["async/updates"]
    assert abs(mean - (k - 1)) <= 0.3 * (k - 1), histogram
    assert min(summary["async/applied_per_worker"]) > 0
    assert summary["async"]["mode"] == "real processes"
    assert summary["test/acc"] > 0.5 and summary["train/loss"] < 1.5


def _holds(pid: int, name: str) -> bool:
    """Whether process `pid` has a file called `name` open."""
    try:
        return any(os.readlink(fd).endswith(name) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """A long real-mode run; returns it once it is logging, with its metrics file."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dpresearch.train",
            ASYNC,
            "backend=gloo",
            "workers=4",
            "async.inject_delay=0.05",
            "train.steps=1000000",
            "train.log_every=1",
            *SMALL[:-1],
            *extra,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + load_scaled(180)
    while time.monotonic() < deadline:
        found = list(tmp_path.rglob("metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 5:
            return run, found[0]
        assert run.poll() is None, run.communicate()[1][-3000:]
        time.sleep(0.5)
    run.kill()
    raise AssertionError("the run did not start logging in time")


def _a_worker(run: subprocess.Popen) -> int:
    """A worker process of `run` (not the server, which writes metrics.jsonl)."""
    procs = worker_processes(run.pid)
    workers = [p for p in procs if not _holds(p, "metrics.jsonl")]
    assert len(procs) == 5 and len(workers) == 4, (procs, workers)
    return workers[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_worker_ends_the_run_within_30_s(tmp_path):
    run, _ = _start(tmp_path)
    try:
        os.kill(_a_worker(run), signal.SIGKILL)
        killed = time.monotonic()
        _, err = run.communicate(timeout=load_scaled(60))
        elapsed = time.monotonic() - killed
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    assert elapsed < load_scaled(30), f"took {elapsed:.1f}s"
    assert "error: worker process failed" in err and "SIGKILL" in err


@pytest.mark.slow
@pytest.mark.distributed
def test_hung_worker_is_named_by_the_server(tmp_path):
    run, _ = _start(tmp_path, "async.timeout_s=5")
    victim = _a_worker(run)
    try:
        os.kill(victim, signal.SIGSTOP)
        _, err = run.communicate(timeout=load_scaled(120))
    finally:
        if run.poll() is None:
            run.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    assert run.returncode != 0
    assert "WorkerLost" in err and "sent no gradient for async.timeout_s=5s" in err


# -- issue 17: the real mode through the communicator, checkpoints and exact resume ------------
SEEDED = [
    *SMALL[:-1],
    "train.progress=false",
    ASYNC,
    "workers=4",
    "backend.threads=1",
    "async.speed=exponential",
    "async.order=seeded",
    "data.num_train=512",
    "data.num_test=64",
    "train.batch_size=16",
    "optimizer.momentum=0.9",
]


@pytest.mark.distributed
def test_seeded_real_run_equals_the_simulator(tmp_path):
    """With the event clock's order driving the server, 4 gloo workers and a server compute
    exactly what the event simulator computes (same pushes, same order, same arithmetic)."""
    args = [
        *SEEDED,
        "train.steps=40",
        "compressor=topk",
        "compressor.ratio=0.2",
        "error_feedback=ef14",
    ]
    simulated = train(compose_config(*args), tmp_path / "sim")
    real = train(compose_config(*args, "backend=gloo"), tmp_path / "real")
    assert same(final_params(tmp_path / "sim"), final_params(tmp_path / "real"))
    assert real["async/tau_histogram"] == simulated["async/tau_histogram"]
    assert real["async"]["mode"] == "real processes" and real["async"]["order"] == "seeded"
    # every push recorded once, at the same bytes: by each worker's ledger when simulated, as
    # heard by the server on real ranks
    assert real["comm/bytes"] == simulated["comm/bytes"] == 40 / 4 * real["async"]["push_bytes"]
    assert real["comm/ops"] == simulated["comm/ops"]


def _resume_state(rank: int, port: int, args: list[str], out: str) -> None:
    """Build the resumed run on real ranks and save rank 0's server state (no step taken)."""
    import torch.distributed as dist

    from dpresearch.comm.distributed import DistributedCommunicator
    from dpresearch.run.build import network_model
    from dpresearch.run.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=5)
    cfg = compose_config(*args)
    comm = DistributedCommunicator(network_model(cfg), messages=True, first_worker=1)
    trainer = Trainer(cfg, comm, torch.device("cpu"), None)
    if rank == 0:
        torch.save(to_cpu(trainer.algorithm.state_dict()), f"{out}/resumed.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_real_async_kill_9_then_resume_continues_exactly(tmp_path):
    """Acceptance B: the whole job killed (SIGKILL) after a checkpoint; `train.resume=auto`
    continues from it — the server's parameters, optimizer state and staleness statistics at
    resume are the checkpoint's, every push before it is counted once, and with the seeded
    order the resumed run ends as an uninterrupted one."""
    steps = 1200
    run_dir = tmp_path / "run"
    args = [
        *SEEDED,
        "backend=gloo",
        f"train.steps={steps}",
        "train.checkpoint_every=20",
        "train.log_every=1",
        "train.eval_every=600",
        "async.inject_delay=0.02",
    ]
    proc = start_cli([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    try:
        wait_for_step(run_dir, proc, 45, timeout=300)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank
        proc.communicate(timeout=load_scaled(60))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None and not (run_dir / "summary.json").exists()
    saved = torch.load(checkpoint, weights_only=False)
    server = saved["states"][0]["algorithm"]
    # at resume: what the checkpoint holds, the pushes then in flight held with it
    torch.multiprocessing.spawn(
        _resume_state,
        args=(free_port(), [*args, f"train.resume={checkpoint}"], str(tmp_path)),
        nprocs=5,
    )
    resumed = torch.load(tmp_path / "resumed.pt")
    for key in ("params", "buffers", "total"):
        assert torch.equal(resumed["server"][key], server["server"][key])
    assert (
        resumed["server"]["optimizer"]["state"].keys()
        == server["server"]["optimizer"]["state"].keys()
    )
    for k, v in server["server"]["optimizer"]["state"].items():
        assert torch.equal(
            resumed["server"]["optimizer"]["state"][k]["momentum_buffer"], v["momentum_buffer"]
        )
    assert resumed["server"]["stats"] == server["server"]["stats"]
    assert resumed["server"]["version"] == saved["step"] == server["steps"]
    held = server["transport"]["held"]
    assert len(held) == 4 and sorted(p[0] for p in held) == [0, 1, 2, 3]  # asgd: all 4 in flight
    out = run_cli(
        [*args, f"hydra.run.dir={run_dir}", "train.resume=auto"], cwd=tmp_path, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert sum(summary["async/tau_histogram"]) == summary["async/updates"] == steps
    assert summary["comm/bytes"] == steps / 4 * summary["async"]["push_bytes"]  # each once
    assert [m["step"] for m in metric_lines(run_dir)] == list(range(1, steps + 1))
    reference = tmp_path / "reference"
    train(compose_config(*[a for a in args if a != "backend=gloo"]), reference)
    assert same(final_params(run_dir), final_params(reference))


@pytest.mark.distributed
@pytest.mark.slow
def test_real_async_sigterm_checkpoints_and_resumes_exactly(tmp_path):
    """SIGTERM to the job: every rank stops at a step boundary through the server, with a
    checkpoint holding the pushes in flight and `status: interrupted`; the resumed run ends as
    the simulator's."""
    steps = 600
    args = [
        *SEEDED,
        "backend=gloo",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.eval_every=300",
        "async.inject_delay=0.02",
    ]
    run_dir, _ = stop_and_resume(tmp_path, args, signal.SIGTERM, bound_s=60)
    reference = tmp_path / "reference"
    train(compose_config(*[a for a in args if a != "backend=gloo"]), reference)
    assert same(final_params(run_dir), final_params(reference))
    assert [m["step"] for m in metric_lines(run_dir)] == list(range(1, steps + 1))
