"""Benchmark: the analysis on 1,000 run directories × 1,000 logged steps (issue 10).

Writes (once; reused when present) 1,000 synthetic run directories — 50 cases × 4 lrs × 5
seeds, each with the trainer's files (config.yaml, a 1,000-line metrics.jsonl with the
trainer's keys and an evaluation every 10 steps, summary.json with `comm/ops`, the resolved
config of a real top-k run), 2% of them diverged and 1% unfinished — then times, in a fresh
process, from nothing imported to files
written: finding the runs, loading summaries and every step, seed aggregation, best-lr
selection, time-to-accuracy re-priced on 1 GbE, the markdown table and one plot (accuracy
against epochs, one line per case with seed bands). Target: ≤ 10 s. Prints each phase.

    python experiments/bench/analysis_speed.py [--root /tmp/dpresearch-analysis-bench]
        [--runs 1000] [--steps 1000] [--fresh]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

BUDGET_S = 10.0
SEEDS, LRS = 5, (0.3, 0.1, 0.03, 0.01)


def write_runs(root: Path, runs: int, steps: int) -> None:
    """`runs` run directories of `steps` logged steps each under `root/runs`."""
    rng, template = random.Random(0), config_template()
    cases = math.ceil(runs / (SEEDS * len(LRS)))
    made = 0
    for c in range(cases):
        for lr in LRS:
            for seed in range(SEEDS):
                if made == runs:
                    return
                d = root / "runs" / f"case{c:02d}" / f"lr{lr:g}" / f"seed{seed}"
                d.mkdir(parents=True)
                diverged, unfinished = made % 50 == 7, made % 100 == 3
                _write_run(d, c, lr, seed, steps, rng, diverged, unfinished, template)
                made += 1


def config_template() -> str:
    """The trainer's resolved config.yaml of a top-k run, with fields to fill in."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from dpresearch.train import CONF_DIR

    overrides = [
        "compressor=topk",
        "seed=1234567",
        "optimizer.lr=0.7654321",
        "compressor.ratio=0.1234567",
        "optimizer.momentum=0.9",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides)
    text = OmegaConf.to_yaml(OmegaConf.to_container(cfg, resolve=True))
    for value, field in (("1234567", "{seed}"), ("0.7654321", "{lr}"), ("0.1234567", "{ratio}")):
        text = text.replace(value, field)
    return text


def _write_run(
    d: Path,
    case: int,
    lr: float,
    seed: int,
    steps: int,
    rng,
    diverged: bool,
    unfinished: bool,
    template: str,
) -> None:
    config = template.replace("{seed}", str(seed)).replace("{lr}", str(lr))
    (d / "config.yaml").write_text(config.replace("{ratio}", str(0.01 * (case + 1))))
    (d / "study_point.json").write_text(json.dumps({"study": "bench", "case": f"case{case:02d}"}))
    nbytes, rate = 4000 * (case + 1), 0.002 * (1 + rng.random())
    lines = []
    for step in range(1, steps + 1):
        acc = 1 - math.exp(-rate * step)
        loss = '"nan"' if diverged and step > steps // 2 else f"{2.3 * (1 - acc) + 0.01:.6f}"
        extra = f', "test/loss": {loss}, "test/acc": {acc:.6f}' if step % 10 == 0 else ""
        lines.append(
            f'{{"step": {step}, "epoch": {step / 20}, "samples": {step * 128}, '
            f'"train/loss": {loss}, "train/acc": {acc:.6f}, "lr": {lr}, '
            f'"comm/bytes": {float(nbytes * step)}, "comm/bytes_max": {float(nbytes * step)}, '
            f'"comm/modeled_s": {step * 1e-4:.8g}, "time/compute_s": {step * 0.05:.6f}, '
            f'"time/comm_s": {step * 0.001:.6f}, "time/wall_s": {step * 0.052:.6f}{extra}}}\n'
        )
    (d / "metrics.jsonl").write_text("".join(lines))
    if unfinished:
        return
    last = json.loads(lines[-1])
    summary = {
        **last,
        "best/test_acc": last.get("test/acc"),
        "steps_per_epoch": 20,
        "total_steps": steps,
        "comm/bytes_per_epoch": nbytes * 20.0,
        "comm/ops": [["allgather", nbytes, 4, 0, steps]],
    }
    (d / "summary.json").write_text(json.dumps(summary))


class Phases:
    """Wall and CPU seconds of consecutive phases."""

    def __init__(self) -> None:
        self.times: dict[str, tuple[float, float]] = {}
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def done(self, name: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.times[name] = (wall - self._wall, cpu - self._cpu)
        self._wall, self._cpu = wall, cpu


def analyse(root: Path, out: Path) -> dict[str, tuple[float, float]]:
    """The timed part: (wall, CPU) seconds per phase."""
    phases = Phases()
    from dpresearch.analysis.plots import plot_groups
    from dpresearch.analysis.report import FORMATS, ReportSpec, build_report, headers
    from dpresearch.analysis.runs import find_runs, load_metrics_many, load_summaries
    from dpresearch.analysis.tables import markdown_table

    phases.done("import")
    paths = find_runs([root / "runs"])
    phases.done("find")
    runs = load_summaries(paths)
    phases.done("summaries + configs")
    metrics = load_metrics_many(paths)
    phases.done(f"metrics ({len(metrics):,} rows)")
    report = build_report(runs, metrics, ReportSpec(target=0.9, network="1gbe"))
    phases.done("aggregate, select, time-to-accuracy")
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(report.table, report.columns, FORMATS, headers(report.columns))
    (out / "table.md").write_text(table + "\n")
    phases.done("table")
    plot_groups(report.metrics, report.groups, "epoch", "test/acc", [out / "acc_vs_epoch.png"])
    phases.done("plot")
    assert len(report.runs) == len(paths) and len(report.table) == len(report.groups)
    return phases.times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path("/tmp/dpresearch-analysis-bench"))
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--fresh", action="store_true", help="rewrite the run directories")
    p.add_argument("--analyse", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    marker = args.root / f"made-{args.runs}x{args.steps}"
    if not args.analyse and (args.fresh or not marker.exists()):
        shutil.rmtree(args.root, ignore_errors=True)
        t = time.perf_counter()
        write_runs(args.root, args.runs, args.steps)
        marker.touch()
        print(
            f"wrote {args.runs} runs × {args.steps} steps in {time.perf_counter() - t:.1f} s "
            f"({sum(f.stat().st_size for f in args.root.rglob('*.jsonl')) / 1e6:.0f} MB of "
            "metrics.jsonl) — not timed"
        )
    if not args.analyse:  # timed in a fresh process: imports count
        cmd = [
            sys.executable,
            __file__,
            "--analyse",
            "--root",
            str(args.root),
            "--runs",
            str(args.runs),
            "--steps",
            str(args.steps),
        ]
        sys.exit(subprocess.run(cmd).returncode)
    times = analyse(args.root, args.root / "out")
    total, cpu = (sum(v[i] for v in times.values()) for i in (0, 1))
    print(f"  {'phase':<40} {'wall s':>7} {'CPU s':>7}")
    for phase, (wall, used) in times.items():
        print(f"  {phase:<40} {wall:7.2f} {used:7.2f}")
    verdict = "within" if total <= BUDGET_S else "OVER"
    print(
        f"analysis of {args.runs} runs × {args.steps} steps: {total:.2f} s wall = "
        f"{total / BUDGET_S:.2f} × the {BUDGET_S:g} s budget ({verdict}); {cpu:.2f} s CPU; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
        f"output in {args.root / 'out'}"
    )


if __name__ == "__main__":
    main()
