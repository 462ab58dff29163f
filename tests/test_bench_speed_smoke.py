"""Smoke runs of issue 16's benchmarks at tiny sizes: each runs end to end, prints its ratio
line and writes its JSON; the GPU benchmark skips cleanly without a GPU; the competing
processes of the threads benchmark are gone when it ends."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED, cli_env

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "experiments" / "bench"
SUBSET = SHARED / "data" / "cifar10-subset"


def bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env=cli_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_batched_vs_ensemble_tiny(tmp_path):
    out = tmp_path / "ens.json"
    done = bench("batched_vs_ensemble.py", "--models", "logreg", "--workers", "2",
                 "--modes", "false", "true", "--rounds", "1", "--block", "2", "--blocks", "1",
                 "--warmup", "1", "--json", str(out))  # fmt: skip
    assert re.search(r"\| logreg \| 2 \| true \| 2 workers batched.*\| \d+\.\d+ \[", done.stdout)
    assert re.search(r"\| logreg \| 2 \| false \| 2 workers one by one", done.stdout)
    ratios = json.loads(out.read_text())["summary"]
    assert len(ratios) == 2 and all(r["ratios"][0] > 0 for r in ratios)


def test_consensus_metric_cost_tiny(tmp_path):
    out = tmp_path / "cm.json"
    done = bench("consensus_metric_cost.py", "--workers", "2", "--rounds", "1", "--block", "2",
                 "--blocks", "1", "--warmup", "1", "--calls", "1", "--json", str(out))  # fmt: skip
    assert "consensus distance at log_every=10, K=2 MLP D-PSGD:" in done.stdout
    data = json.loads(out.read_text())
    assert 0 < data["share_median"] < data["old_share_median"]  # cheaper than before


def test_gpu_benchmark_skips_cleanly_without_a_gpu_and_runs_on_the_cpu(tmp_path):
    import torch

    if not torch.cuda.is_available():
        done = bench("gpu_batched.py")
        assert done.stdout.strip().startswith("gpu_batched: skipped: no CUDA GPU")
    out = tmp_path / "gpu.json"
    done = bench("gpu_batched.py", "--device", "cpu", "--workers", "2", "--batch", "2",
                 "--rounds", "1", "--block", "1", "--blocks", "1", "--warmup", "1",
                 "--random-images", "--json", str(out))  # fmt: skip
    assert "| loop ÷ batched |" in done.stdout and "| batched ÷ single (batch 4) |" in done.stdout
    assert json.loads(out.read_text())["summary"]["loop_over_batched"][0] > 0


@pytest.mark.skipif(not SUBSET.is_dir(), reason=f"no CIFAR subset at {SUBSET}")
def test_checkpoint_cost_tiny(tmp_path):
    out = tmp_path / "ckpt.json"
    done = bench("checkpoint_cost.py", "--model", "resnet20", "--workers", "2", "--batch", "4",
                 "--warmup", "2", "--steps", "1", "--repeats", "2", "--json", str(out))  # fmt: skip
    assert "vs torch.save + fsync" in done.stdout and "(target <= 1.5)" in done.stdout
    assert json.loads(out.read_text())["checkpoint_over_torch_save_fsync"] > 0


def test_threads_benchmark_stops_its_competitors():
    module = load("threads_under_load")
    competitors = module.start_competitors(2)
    try:
        assert all(p.poll() is None for p in competitors)  # running, CPU-bound
    finally:
        module.stop(competitors)
    assert all(p.poll() is not None for p in competitors)
    for p in competitors:
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)


@pytest.mark.slow
def test_threads_under_load_tiny(tmp_path):
    out = tmp_path / "threads.json"
    done = bench("threads_under_load.py", "--cases", "choco_mlp", "--rounds", "1",
                 "--competitors", "1", "--block", "2", "--blocks", "1", "--warmup", "1",
                 "--json", str(out), timeout=600)  # fmt: skip
    assert re.search(r"\| choco_mlp \| \d+\.\d+ \[.*\| ≤ 1\.2 \| threads: 1 \(", done.stdout)


@pytest.mark.slow
@pytest.mark.skipif(not SUBSET.is_dir(), reason=f"no CIFAR subset at {SUBSET}")
def test_study_point_time_tiny(tmp_path):
    out = tmp_path / "point.json"
    done = bench("study_point_time.py", "--steps", "2", "--rounds", "1", "--json", str(out),
                 timeout=900)  # fmt: skip
    assert "old ÷ new wall time:" in done.stdout
    assert len(json.loads(out.read_text())["ratios"]) == 1


def test_study_point_keeps_the_points_overrides_but_the_thread_pin():
    module = load("study_point_time")
    args = module.argparse.Namespace(study=module.STUDY, case="top-k 1% + EF", lr=0.06, seed=0)
    overrides = module.point_overrides(args)
    assert "compressor=topk" in overrides and "optimizer.lr=0.06" in overrides
    assert "seed=0" in overrides and not any(o.startswith("backend.threads") for o in overrides)
    assert all("{repo}" not in o for o in overrides)
