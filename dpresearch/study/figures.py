"""A study report's plots (`plot_files`): final metric against bytes per epoch, each case's
curves at its selected lr against epochs, bytes and time, and the study's histograms."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpresearch.analysis.runs import FINISHED
from dpresearch.study.tables import (
    final_runs,
    pick_for,
    raw_label,
    result_metrics,
    results_frame,
    setting_label,
)

if TYPE_CHECKING:
    from dpresearch.study.report import StudyReport


FINAL_RUNS = "final seeds at its selected lr"  # what a plotted case averages


def plot_files(report: StudyReport, out: Path) -> list[tuple[Path, Any]]:
    """Each case's final accuracy against its bytes per epoch (the last horizon), then curves
    of each case at its selected lr (the last horizon's pick, final seeds): accuracy and loss
    against epochs, bytes, modeled and simulated time; the study's extra curves against epochs.
    Returns (path, figure) pairs."""
    from dpresearch.analysis.plots import plot_groups, plot_points
    from dpresearch.analysis.timing import SCENARIO_CLOCK, add_modeled_time, modeled_column

    study, horizon = report.study, report.last
    metrics = report.metrics
    for network in study.networks:
        metrics = add_modeled_time(metrics, report.runs, network)
    groups: dict[str, list[str]] = {}
    for case in study.cases:
        pick = pick_for(horizon, study, case.name)
        if pick is None:
            continue
        rows = final_runs(report, horizon, case.name, pick)
        rows = rows[rows["status"] == FINISHED] if not report.include_failed else rows
        if len(rows):
            groups[f"{case.name}, {setting_label(study, case.name, pick.setting)}"] = list(
                rows["run"]
            )
    written = []
    _, raw = results_frame(report, horizon)
    main = study.claim.metric if study.claim else study.target_metric
    if "MB_per_epoch" in raw and main in raw:
        points = [
            (f"{r['case']}, {raw_label(study, r)}", r["MB_per_epoch"], r[main], r[f"{main} std"])
            for r in raw.to_dict("records")
            if math.isfinite(r.get("MB_per_epoch", math.nan)) and math.isfinite(r[main])
        ]
        if points:
            stem = f"{main}_vs_MB_per_epoch".replace("/", "_")
            path = out / f"{stem}.png"
            suffix = "" if len(report.horizons) == 1 else f", at {horizon.label}"
            written.append(
                (
                    path,
                    plot_points(
                        points,
                        "MB_per_epoch",
                        main,
                        path,
                        study.title + suffix,
                        study.labels,
                        over=FINAL_RUNS,
                    ),
                )
            )
    for name in study.histograms:
        series = {}
        for label, runs in groups.items():
            rows = report.runs[report.runs["run"].isin(runs)]
            counts: list[float] = []
            for hist in rows.get(name, ()):
                if isinstance(hist, list):
                    counts += [0.0] * max(0, len(hist) - len(counts))
                    for i, h in enumerate(hist):
                        counts[i] += h
            if counts:
                series[label] = counts
        if series:
            from dpresearch.analysis.plots import axis_label, plot_histograms

            path = out / f"{name.replace('/', '_')}.png"
            xlabel, _ = axis_label(name, study.labels)
            fig = plot_histograms(
                series,
                xlabel,
                "gradients (count, summed over the runs)",
                path,
                study.title,
                what="gradients applied at each staleness, summed over the case's final-seed runs",
            )
            written.append((path, fig))
    # tokens: the x axis of a language model (logged by text data), beside epochs
    xs = ["epoch", "tokens", "comm/bytes", *(modeled_column(n) for n in study.networks or [None])]
    xs += ["time/simulated_s", "time/modeled_s"]
    xs += sorted(c for c in metrics.columns if c.startswith(SCENARIO_CLOCK))  # scenarios
    ys = [
        m
        for m in dict.fromkeys([*result_metrics(report), *study.curves])
        if m in metrics and m not in xs
    ]
    # curves only against epochs, but the selection metric (validation) against every x
    selection = report.selection.metric
    vlines = list(study.claim.horizons) if study.claim and study.claim.horizons else []
    horizon_key = study.claim.horizon_key if study.claim else "epoch"
    for y in ys:
        for x in xs:
            if x not in metrics or metrics[x].isna().all() or not metrics[y].notna().any():
                continue
            curve_only = y in study.curves and y not in result_metrics(report) and y != selection
            if curve_only and x != "epoch":
                continue
            stem = f"{y}_vs_{x}".replace("/", "_").replace("@", "_")
            path = out / f"{stem}.png"
            fig = plot_groups(
                metrics,
                groups,
                x,
                y,
                [path],
                title=study.title,
                vlines=vlines if x == horizon_key else (),
                labels=study.labels,
                over=FINAL_RUNS,
            )
            written.append((path, fig))
    return written
