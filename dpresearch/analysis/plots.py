"""Curves of a logged metric against epochs, bytes or time, one line per group of runs.

A group's line is the mean over its runs at each logged step, with a band of ± one standard
deviation where the group holds more than one run (seeds). The x value at a step is the mean
of the runs' x there (identical across seeds for epochs and bytes). Figures are drawn without
pyplot (no global state, no display needed) and saved in the format each path's suffix names
(`.png`, `.pdf`, `.svg`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from dpresearch.analysis.errors import require_columns

COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
)
STYLES = ("-", "--", ":", "-.")


def group_curves(metrics, groups: Mapping[str, Sequence[str]], x: str, y: str):
    """Per group label and step: `x` (mean), `y` (mean), `y std`, `n` — one frame, ordered by
    group then step."""
    require_columns(metrics.columns, ["step", x, y], "metric")
    label_of = {str(run): label for label, runs in groups.items() for run in runs}
    rows = metrics.loc[metrics[y].notna() & metrics[x].notna(), ["run", "step", x, y]]
    # on a categorical `run` this maps each category once, not every row
    rows = rows.assign(group=rows["run"].map(lambda run: label_of.get(str(run))))
    rows = rows[rows["group"].notna()]
    curves = rows.groupby(["group", "step"], sort=False, observed=True).agg(
        x=(x, "mean"), y=(y, "mean"), y_std=(y, "std"), n=(y, "size")
    )
    return curves.reset_index().sort_values(["group", "step"], kind="stable")


def plot_groups(
    metrics,
    groups: Mapping[str, Sequence[str]],
    x: str,
    y: str,
    outs: Sequence[str | Path],
    logx: bool = False,
    title: str | None = None,
    xlabel: str | None = None,
) -> None:
    """Draw `y` against `x` for every group (see the module docstring) into each of `outs`."""
    from matplotlib.figure import Figure

    curves = group_curves(metrics, groups, x, y)
    fig = Figure(figsize=(10, 5))
    ax = fig.subplots()
    for i, label in enumerate(groups):
        c = curves[curves["group"] == label]
        if c.empty:
            continue
        color = COLORS[i % len(COLORS)]
        n = int(c["n"].max())
        ax.plot(
            c["x"],
            c["y"],
            color=color,
            marker=".",
            markersize=3,
            linestyle=STYLES[(i // len(COLORS)) % len(STYLES)],
            label=f"{label}, n={n}" if n > 1 else label,
        )
        if n > 1:
            spread = c["y_std"].fillna(0.0)
            ax.fill_between(
                c["x"], c["y"] - spread, c["y"] + spread, color=color, alpha=0.2, linewidth=0
            )
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(y)
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if groups:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    for out in outs:
        fig.savefig(out, dpi=120)


def plot_curves(
    runs: Mapping[str, str | Path], x: str, y: str, out: str | Path, logx: bool = False
) -> None:
    """One line per labelled run of metric `y` against `x` (e.g. epoch, comm/bytes,
    comm/modeled_s), saved to `out`. Labels must be distinct (a dict cannot repeat them)."""
    from dpresearch.analysis.runs import load_metrics_many

    paths = [str(p) for p in runs.values()]
    metrics = load_metrics_many(paths)
    if y not in metrics:
        metrics[y] = float("nan")
    plot_groups(metrics, {label: [str(p)] for label, p in runs.items()}, x, y, [out], logx)
