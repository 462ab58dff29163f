"""Benchmark smoke runs. The emulated-network benchmark: it skips cleanly where it cannot run,
and (as root with iproute2) runs one tiny case and leaves no namespace behind. Issue 16's
benchmarks at tiny sizes: each runs end to end, prints its ratio line and writes its JSON; the
GPU benchmark skips cleanly without a GPU; the threads benchmark's competing processes are gone
when it ends."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import SHARED, cli_env, load_scaled

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "bench" / "emulated_network.py"
BENCH = REPO / "experiments" / "bench"
SUBSET = SHARED / "data" / "cifar10-subset"


def load(name: str):
    """The benchmark script `experiments/bench/<name>.py` as a module (registered in
    sys.modules: its dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# One measured round of one block of 1 (or 2) steps after one warm-up: the tiny schedule.
ONE_ROUND = ("--rounds", "1", "--block", "1", "--blocks", "1", "--warmup", "1")
ONE_ROUND_OF_2 = ("--rounds", "1", "--block", "2", "--blocks", "1", "--warmup", "1")


def test_parse_rate() -> None:
    bench = load("emulated_network")
    assert bench.parse_rate("100mbit") == 100e6
    assert bench.parse_rate("1Gbit") == 1e9
    assert bench.parse_rate("2.5gbit") == 2.5e9
    with pytest.raises(ValueError, match="100mbit"):
        bench.parse_rate("100MB/s")


def test_skips_when_not_root(monkeypatch, capsys) -> None:
    bench = load("emulated_network")
    monkeypatch.setattr(bench.os, "geteuid", lambda: 1000)
    assert bench.main(["--model", "mlp"]) == 0
    assert capsys.readouterr().out.strip() == (
        "emulated_network: skipped: needs root (network namespaces and tc qdiscs)"
    )


def test_skips_without_iproute2(monkeypatch, capsys) -> None:
    bench = load("emulated_network")
    monkeypatch.setattr(bench.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bench.shutil, "which", lambda tool: None)
    assert bench.main(["--model", "mlp"]) == 0
    assert "skipped: `ip` (iproute2) is not installed" in capsys.readouterr().out


def test_skips_when_namespaces_fail(monkeypatch, capsys) -> None:
    bench = load("emulated_network")
    monkeypatch.setattr(bench.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bench.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    calls: list[tuple[str, ...]] = []

    def refuse(*cmd: str) -> str:
        calls.append(cmd)
        raise subprocess.CalledProcessError(1, cmd, "", "mount --make-shared failed: EPERM\n")

    monkeypatch.setattr(bench, "_run", refuse)
    assert bench.main(["--model", "mlp", "--floor-rate", ""]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("emulated_network: skipped: cannot create")
    assert "EPERM" in out[0]
    assert calls == [calls[0]] and calls[0][:3] == ("ip", "netns", "add")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2",
)
def test_tiny_run_leaves_no_namespace() -> None:
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--model",
        "mlp",
        "--rates",
        "100mbit",
        "--floor-rate",
        "",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--compressors",
        "identity",
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=load_scaled(120), cwd=REPO, env=cli_env()
    )  # this checkout's package in every rank, whatever the editable install points at
    assert done.returncode == 0, done.stderr[-2000:]
    if "skipped:" in done.stdout:
        pytest.skip(done.stdout.strip())
    assert re.search(r"^   identity +5292\.1 ", done.stdout, re.MULTILINE), done.stdout
    names = re.search(r"veth (\S+)↔(\S+)", done.stdout).groups()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)


def test_fit_recovers_a_per_message_overhead() -> None:
    """Cases built from a known overhead give it back; zero-residual cases give zero."""
    from dpresearch.comm.ledger import CommOp
    from dpresearch.comm.network import NetworkModel

    fit = load("network_fit")
    base = NetworkModel(1e-4, 1e7, 0.0, 1.25, allgather_latency_s=3e-4)
    truth = NetworkModel(1e-4, 1e7, 2e-3, 1.25, allgather_latency_s=3e-4)
    shapes = {
        "dense": [CommOp("allreduce", 1_000_000, 2)],
        "sparse": [CommOp("allgather", 300, 2)] * 65 + [CommOp("broadcast", 5504, 2)],
    }
    cases = [fit.Case(n, fit.modeled(truth, ops), tuple(ops)) for n, ops in shapes.items()]
    assert fit.fit_message_overhead(cases, base) == pytest.approx(2e-3)
    exact = [fit.Case(n, fit.modeled(base, ops), tuple(ops)) for n, ops in shapes.items()]
    assert fit.fit_message_overhead(exact, base) == pytest.approx(0.0, abs=1e-12)


def test_fit_recovers_the_gloo_terms_together() -> None:
    """Cases priced with a known overhead and allgather factor give both back; the bounds hold
    where the unconstrained optimum breaks them; no allgather leaves the factor as given."""
    from dpresearch.comm.ledger import CommOp
    from dpresearch.comm.network import NetworkModel

    fit = load("network_fit")
    given = NetworkModel(1e-4, 1e7, 0.0, 1.0, allgather_latency_s=2.5e-4)
    shapes = {
        "dense": [CommOp("allreduce", 1_000_000, 2)],
        "gather": [CommOp("allgather", 140_000, 2), CommOp("broadcast", 5504, 2)],
        "sparse": [CommOp("allgather", 22_000, 2), CommOp("broadcast", 5504, 2)],
        "many": [CommOp("allreduce", 30_000, 2)] * 3 + [CommOp("broadcast", 5504, 2)],
    }

    def cases(truth, names=shapes):
        return [fit.Case(n, fit.modeled(truth, shapes[n]), tuple(shapes[n])) for n in names]

    truth = NetworkModel(1e-4, 1e7, 1.5e-3, 1.3, allgather_latency_s=2.5e-4)
    assert fit.fit_gloo_terms(cases(truth), given) == pytest.approx((1.5e-3, 1.3))
    faster = NetworkModel(1e-4, 1e7, 1e-3, 0.7, allgather_latency_s=2.5e-4)
    overhead, factor = fit.fit_gloo_terms(cases(faster), given)
    assert factor == 1.0 and overhead > 0  # an allgather cannot beat the wire
    no_gather = cases(truth, ["dense", "many"])
    assert fit.fit_gloo_terms(no_gather, replace(given, allgather_factor=1.2)) == pytest.approx(
        (1.5e-3, 1.2)
    )


def test_step_figures_and_ops_per_step() -> None:
    fit = load("network_fit")
    rows = [
        {
            "time/comm_s": 0.1 * s,
            "time/comm_overlapped_s": 0.05 * s,
            "time/compute_s": s,
            "comm/modeled_s": 0.2 * s,
            "comm/bytes": 10 * s,
        }
        for s in range(1, 5)
    ]
    figures = fit.step_figures(rows, 2, 4)
    assert len(figures) == 2
    assert figures[0]["busy"] == pytest.approx(0.15)
    assert figures[0]["step"] == pytest.approx(1.1)
    assert figures[0]["bytes"] == 10
    ops = fit.ops_per_step([["allgather", 8, 2, 0], ["broadcast", 4, 2, 0]] * 3, 3)
    assert [op.kind for op in ops] == ["allgather", "broadcast"]
    with pytest.raises(ValueError, match="different ops"):
        fit.ops_per_step([["allgather", 8, 2, 0], ["allgather", 9, 2, 0]], 2)


def test_peer_wait_is_the_union_of_waits() -> None:
    fit = load("network_fit")
    # one step, three calls: two overlapping background waits, one synchronous call on time
    mine = [
        ["allreduce", 4, 0, 0, 1.0, 1.0],
        ["allreduce", 4, 0, 0, 1.5, 1.5],
        ["broadcast", 4, 0.1, 0, 3.0, 3.1],
    ]
    peer = [
        ["allreduce", 4, 0, 0, 2.0, 2.0],
        ["allreduce", 4, 0, 0, 2.5, 2.5],
        ["broadcast", 4, 0.1, 0, 2.9, 3.1],
    ]
    assert fit.peer_wait(mine, peer, 0, 1) == [pytest.approx(1.5)]  # [1, 2] ∪ [1.5, 2.5]
    with pytest.raises(ValueError, match="different collectives"):
        fit.peer_wait(mine, peer[:2], 0, 1)


def test_stacked_codecs_bench_runs_and_both_sides_agree(capsys) -> None:
    """The codec benchmark at a tiny size: both sides compute the same aggregate (top-k the
    same entries, sign the same scales), and it prints one ratio line per case."""
    bench = load("stacked_codecs")
    results = bench.main(["--workers", "2", "--rounds", "2", "--steps", "1", "--clock", "cpu"])
    assert [(r["compressor"], r["workers"]) for r in results] == [("topk", 2), ("sign", 2)]
    for r in results:
        assert r["max_abs_diff"] == 0.0
        assert r["ratio"] > 0 and r["ratio_range"][0] <= r["ratio"] <= r["ratio_range"][1]
    out = capsys.readouterr().out
    assert "ratio = ours / per-tensor loop" in out and len(out.strip().splitlines()) == 4


def test_codecs_vs_minimal_bench_runs_and_both_sides_agree(tmp_path, capsys) -> None:
    """Issue 31's codec / 1-bit SGD / 1-bit Adam benchmark at K = 2, one round of one step:
    every case passes its bit-identity check (it exits with an error line otherwise), prints one
    ratio line and writes its JSON."""
    bench = load("codecs_vs_minimal")
    out = tmp_path / "codecs.json"
    rows = bench.main(["--workers", "2", "--rounds", "1", "--steps", "1", "--json", str(out)])
    assert [(r["case"], r["workers"]) for r in rows] == [
        ("natural", 2),
        ("sign", 2),
        ("onebit", 2),
        ("onebit_adam", 2),
    ]
    assert all(r["identical"] and r["ratio"] > 0 for r in rows)
    assert len(json.loads(out.read_text())["measurements"]) == 4
    printed = capsys.readouterr().out
    assert "ratio = ours ÷ minimal" in printed and printed.count("≤1.") == 4


# -- issue 16 ----------------------------------------------------------------------------------
def bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=load_scaled(timeout),
        cwd=REPO,
        env=cli_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_batched_vs_ensemble_tiny(tmp_path):
    out = tmp_path / "ens.json"
    done = bench(
        "batched_vs_ensemble.py",
        "--models",
        "logreg",
        "--workers",
        "2",
        "--modes",
        "false",
        "stacked",
        "vmap",
        *ONE_ROUND_OF_2,
        "--floor",
        "--json",
        str(out),
    )
    stacked = r"\| logreg \| 2 \| stacked \| 2 workers stacked.*\| \d+\.\d+ \["
    assert re.search(stacked, done.stdout)
    assert re.search(r"\| logreg \| 2 \| vmap \| 2 workers batched.*\| \d+\.\d+ \[", done.stdout)
    assert re.search(r"\| logreg \| 2 \| false \| 2 workers one by one", done.stdout)
    assert re.search(r"\| logreg \| 2 \| floor \| ensemble \+ flat gradient buffer", done.stdout)
    ratios = json.loads(out.read_text())["summary"]
    assert [r["mode"] for r in ratios] == ["false", "stacked", "vmap", "floor"]
    assert all(r["ratios"][0] > 0 for r in ratios)
    assert all(r["over_floor"][0] > 0 for r in ratios[:3]) and ratios[3]["over_floor"] == []


@pytest.mark.slow
def test_consensus_metric_cost_tiny(tmp_path):
    out = tmp_path / "cm.json"
    done = bench(
        "consensus_metric_cost.py",
        "--workers",
        "2",
        *ONE_ROUND_OF_2,
        "--calls",
        "1",
        "--json",
        str(out),
    )
    assert "consensus distance at log_every=10, K=2 MLP D-PSGD:" in done.stdout
    data = json.loads(out.read_text())
    assert 0 < data["share_median"] < data["old_share_median"]  # cheaper than before


def test_gpu_benchmark_skips_cleanly_without_a_gpu_and_runs_on_the_cpu(tmp_path):
    """The whole GPU table in smoke mode on the CPU (issue 31, item 5): ResNet-20 stacked,
    vmapped, one by one and one process; the GPT rows at the test size."""
    import torch

    if not torch.cuda.is_available():
        done = bench("gpu_batched.py")
        assert done.stdout.strip().startswith("gpu_batched: skipped: no CUDA GPU")
    out = tmp_path / "gpu.json"
    done = bench(
        "gpu_batched.py",
        "--device",
        "cpu",
        "--workers",
        "2",
        "--batch",
        "2",
        *ONE_ROUND,
        "--random-images",
        "--gpt",
        "--gpt-model",
        "gpt_tiny",
        "--json",
        str(out),
    )
    for row in ("| loop ÷ stacked |", "| stacked ÷ single |", "| vmap ÷ stacked |"):
        assert row in done.stdout, row
    assert "stacked side: 2 workers stacked" in done.stdout
    assert "GPT, batched_workers=stacked:" in done.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["loop_over_stacked"][0] > 0 and set(summary["gpt"]) == {"stacked", "false"}


@pytest.mark.slow
@pytest.mark.skipif(not SUBSET.is_dir(), reason=f"no CIFAR subset at {SUBSET}")
def test_checkpoint_cost_tiny(tmp_path):
    out = tmp_path / "ckpt.json"
    done = bench(
        "checkpoint_cost.py",
        "--model",
        "resnet20",
        "--workers",
        "2",
        "--batch",
        "4",
        "--warmup",
        "2",
        "--steps",
        "1",
        "--repeats",
        "2",
        "--json",
        str(out),
    )
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
    done = bench(
        "threads_under_load.py",
        "--cases",
        "choco_mlp",
        "--competitors",
        "1",
        *ONE_ROUND_OF_2,
        "--json",
        str(out),
        timeout=600,
    )
    assert re.search(r"\| choco_mlp \| \d+\.\d+ \[.*\| ≤ 1\.2 \| threads: 1 \(", done.stdout)


@pytest.mark.slow
@pytest.mark.skipif(not SUBSET.is_dir(), reason=f"no CIFAR subset at {SUBSET}")
def test_study_point_time_tiny(tmp_path):
    out = tmp_path / "point.json"
    done = bench(
        "study_point_time.py", "--steps", "2", "--rounds", "1", "--json", str(out), timeout=900
    )
    assert "old ÷ new wall time:" in done.stdout
    assert len(json.loads(out.read_text())["ratios"]) == 1


def test_study_point_keeps_the_points_overrides_but_the_thread_pin():
    module = load("study_point_time")
    args = module.argparse.Namespace(study=module.STUDY, case="top-k 1% + EF", lr=0.1, seed=0)
    overrides = module.point_overrides(args)
    assert "compressor=topk" in overrides and "optimizer.lr=0.1" in overrides
    assert "seed=0" in overrides and not any(o.startswith("backend.threads") for o in overrides)
    assert all("{repo}" not in o for o in overrides)


@pytest.mark.slow
@pytest.mark.distributed
def test_async_real_pushes_tiny(tmp_path):
    """Issue 17's benchmark E at tiny size (after vs after): both sides run real gloo ranks,
    the rates are read back from their metrics and the ratio line is printed."""
    out = tmp_path / "pushes.json"
    done = bench("async_real_pushes.py", "--smoke", "--json", str(out), timeout=900)
    assert "after / before: median" in done.stdout and "target ≥ 0.95" in done.stdout
    result = json.loads(out.read_text())
    assert result["rounds"] == 1 and result["before_pushes_per_s"] > 0
    assert result["after_pushes_per_s"] > 0


@pytest.mark.slow
@pytest.mark.distributed
def test_async_real_cpu_tiny():
    """The CPU-per-push companion of benchmark E at tiny size (this code on both sides, run at
    once): every rank's CPU time is read per window and the ratios are printed."""
    done = bench(
        "async_real_cpu.py",
        "--before",
        str(REPO),
        "--windows",
        "2",
        "--seconds",
        "2",
        "--warmup",
        "100",
        "--hidden",
        "16",
        "--features",
        "16",
        timeout=900,
    )
    assert "after / before: server CPU per push" in done.stdout
    lines = [line for line in done.stdout.splitlines() if "ms CPU per push" in line]
    assert [line.split(":")[0] for line in lines] == ["before", "after"]


# -- issue 22 ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_worker_start_tiny():
    """Three gloo launches (~10-40 s each on a loaded 2-core machine): slow."""
    done = bench("worker_start.py", "--rounds", "1", "--steps", "1", timeout=600)
    assert re.search(r"first forkserver launch \(server start included\): \d+\.\d+ s", done.stdout)
    assert re.search(r"spawn / forkserver: median \d+\.\d+ \(range", done.stdout)
    assert re.search(r"^load [\d. ]+ on \d+ CPUs -> load ", done.stdout, re.M)  # the load


SHAKESPEARE = SHARED / "data" / "shakespeare" / "works"


@pytest.mark.skipif(not SHAKESPEARE.is_dir(), reason=f"no Shakespeare corpus at {SHAKESPEARE}")
def test_lm_throughput_tiny(tmp_path):
    """The LM benchmark end to end at a tiny size: every side measured, both ratio rows
    printed, the per-round ratios written; `--device cuda` skips cleanly without a GPU."""
    import torch

    if not torch.cuda.is_available():
        done = bench("lm_throughput.py", "--device", "cuda")
        assert done.stdout.strip().startswith("lm_throughput: skipped: no CUDA GPU")
    out = tmp_path / "lm.json"
    done = bench(
        "lm_throughput.py",
        "--model",
        "gpt_tiny",
        "--workers",
        "2",
        "--batch",
        "2",
        *ONE_ROUND,
        "--json",
        str(out),
    )
    assert "| simulated ÷ minimal_global |" in done.stdout and "| ours ÷ minimal |" in done.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["simulated_over_minimal_global"][0] > 0 and summary["ours_over_minimal"][0] > 0


@pytest.mark.slow
@pytest.mark.skipif(not SHAKESPEARE.is_dir(), reason=f"no Shakespeare corpus at {SHAKESPEARE}")
def test_gpu_lm_script_runs_on_the_cpu(tmp_path):
    """The GPU script's CPU smoke mode (4 steps, gpt_tiny): the benchmark's JSON and both runs'
    metrics, summaries and samples land in OUT, and its last lines compare the two runs."""
    done = subprocess.run(
        [
            "bash",
            str(BENCH / "gpu_lm.sh"),
            str(tmp_path / "out"),
            "4",
            "cpu",
            "gpt_tiny",
            sys.executable,
        ],
        cwd=REPO,
        env=cli_env(DPRESEARCH_SHAKESPEARE=str(SHAKESPEARE)),
        capture_output=True,
        text=True,
        timeout=load_scaled(600),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert names == {"lm_throughput.json"} | {
        f"{case}_{f}"
        for case in ("sync", "diloco")
        for f in ("metrics.jsonl", "summary.json", "sample.txt")
    }
    assert re.search(r"^diloco: val/bpc \d", done.stdout, re.M), done.stdout[-1000:]


@pytest.mark.slow
@pytest.mark.skipif(not SHAKESPEARE.is_dir(), reason=f"no Shakespeare corpus at {SHAKESPEARE}")
def test_lm_study_gpu_script_runs_on_the_cpu(tmp_path):
    """The LM study's GPU script in its CPU smoke mode (budget 0: gpt_tiny, 4 steps): the
    benchmark's JSON, the YAML as it ran (train.steps set) and the six runs (3 cases × 2 seeds,
    each with its summary) packed in runs.tgz land in OUT."""
    import tarfile

    out = tmp_path / "out"
    done = subprocess.run(
        [
            "bash",
            str(REPO / "experiments" / "lm_shakespeare" / "gpu.sh"),
            str(out),
            "0",
            "cpu",
            sys.executable,
        ],
        cwd=REPO,
        env=cli_env(DPRESEARCH_SHAKESPEARE=str(SHAKESPEARE)),
        capture_output=True,
        text=True,
        timeout=load_scaled(900),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert {p.name for p in out.iterdir()} == {
        "lm_throughput.json",
        "gpu.yaml",
        "study.log",
        "runs.tgz",
    }
    assert "  - train.steps=4\n" in (out / "gpu.yaml").read_text()
    with tarfile.open(out / "runs.tgz") as tar:
        summaries = [n for n in tar.getnames() if n.endswith("summary.json")]
    assert len(summaries) == 6, summaries


# -- issue 31 ----------------------------------------------------------------------------------
def test_adpsgd_vs_minimal_tiny(tmp_path, monkeypatch, one_thread):
    """The AD-PSGD benchmark at a tiny size: ours and the minimal loop end at the same bits
    (the same work, so the ratio means something), and they trained. Its check can fail: the
    minimal loop given other partners (each worker's draws reversed) is refused."""
    module = load("adpsgd_vs_minimal")
    out = tmp_path / "adpsgd.json"
    sizes = ["--workers", "4", "--features", "32", "--batch", "8", "--updates", "120"]
    assert module.main([*sizes, "--rounds", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["final_max_abs_diff"] == 0.0 and result["target"] == 1.15
    lo, hi = result["ratio_range"]
    assert 0 < lo <= result["ratio_median"] <= hi and len(result["seconds"]["ours"]) == 2
    assert len(result["load"]) == 2
    assert result["log_every"] == 100  # the default: ours logs as a run does
    namespace = module.argparse.Namespace(
        workers=4, features=32, batch=8, updates=120, clock="cpu", log_every=100
    )
    _, rows = module.minimal(namespace)
    initial = module.reference(namespace)["row"]
    assert (rows - initial).abs().max() > 1e-3  # it trained

    reference = module.reference

    def other_partners(args) -> dict:
        ref = reference(args)
        ref["partners"] = [draws[::-1] for draws in ref["partners"]]
        return ref

    monkeypatch.setattr(module, "reference", other_partners)
    with pytest.raises(SystemExit, match="error: ours and the minimal loop end .* apart"):
        module.main([*sizes, "--rounds", "1", "--out", str(out)])


def test_token_files_bench_runs_and_deletes_its_files(tmp_path, capsys) -> None:
    """Issue 42's token-file benchmark at a tiny size (a 2 MB train.bin, 64 ids, one
    command-line run, one round): the run measured (an RSS, a start-up), the throughput ratio
    printed, the JSON written, and the generated files gone."""
    bench = load("token_files")
    out_json = tmp_path / "r.json"
    (tmp_path / "tmp").mkdir()
    args = [
        "--gb",
        "0.002",
        "--small-mb",
        "1",
        "--vocab",
        "64",
        "--rows",
        "big",
        "--rounds",
        "1",
        "--tp-steps",
        "10",
        "--workers",
        "2",
        "--batch",
        "2",
        "--dir",
        str(tmp_path / "tmp"),
        "--json",
        str(out_json),
    ]
    assert bench.main(args) == 0
    result = json.loads(out_json.read_text())
    assert list(result["rss"]) == ["0.002 GB mapped"]
    for row in result["rss"].values():
        assert row["rss_mb"] > 50 and 0 < row["first_step_s"] <= row["total_s"]
    assert len(result["ratio"]) == 1 and result["ratio"][0] > 0
    assert "mapped ÷ in memory, time per token:" in capsys.readouterr().out
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.skipif(not SHAKESPEARE.is_dir(), reason=f"no Shakespeare corpus at {SHAKESPEARE}")
def test_gpu_table_script_runs_on_the_cpu(tmp_path):
    """Issue 42's GPU table in its CPU smoke mode (`--tiny`): every row's benchmark runs (the
    GPT simulated three ways against the minimal loop, ResNet-20 stacked / one by one / one
    process, the optimizer step stacked and per worker), writes its JSON, and the table's
    rows are printed; the optimizer benchmark skips cleanly without a GPU."""
    import torch

    if not torch.cuda.is_available():
        done = bench("stacked_optimizer.py", "--device", "cuda")
        assert done.stdout.strip().startswith("stacked_optimizer: skipped: no CUDA GPU")
    done = subprocess.run(
        ["bash", str(BENCH / "gpu_table.sh"), str(tmp_path / "out"), "--tiny", sys.executable],
        cwd=REPO,
        env=cli_env(DPRESEARCH_SHAKESPEARE=str(SHAKESPEARE)),
        capture_output=True,
        text=True,
        timeout=load_scaled(600),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert names == {
        "lm_sync.json",
        "lm_diloco.json",
        "lm_sparseloco.json",
        "resnet.json",
        "optimizer.json",
    }
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    table = rows[rows.index("| row (CPU) | ratio, median [range] | goal |") :]
    assert len(table) == 1 + 3 + 2 + 2, table
    assert all(re.search(r"\| \d+\.\d\d \[", row) for row in table[1:]), table
