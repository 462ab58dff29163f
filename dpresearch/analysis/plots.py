"""Curves of a logged metric against epochs, bytes or time, one line per group of runs.

A group's line is the mean over its runs at each logged step, with a band of ± one sample
standard deviation where the group holds more than one run (seeds); its points are drawn in the
order of x, so no line runs backwards. Where a group's seeds may disagree (`seeds_disagree`:
always from 2 up to `SEED_LINES` runs, where a band says little about so few; beyond, when their
last values split into clusters) each run is also drawn as a thin line of the group's colour
beside the mean, so a split (two seeds stalling, three not) is not read as a wide band around a
value no seed reached. More than `MAX_SERIES` groups are drawn in panels, one or more families
each (`panels`), the first group (a study's baseline) repeated in every panel. Every figure
carries a caption saying what its lines, bands or bars are (`Figure.dpresearch_caption`, written
under the figure in results.md). The legend sits below the axes, inside the figure, its long
labels wrapped; the figure grows to hold it, so nothing is clipped and matplotlib has nothing to
warn about. Axes carry units (`axis_label`): accuracies in %, bytes in MB, times in seconds; an
axis whose positive values span more than two decades is logarithmic. Up to 20 groups get 20
distinct colours, each with its own marker. Figures are drawn without pyplot (no global state,
no display needed), saved in the format each path's suffix names (`.png`, `.pdf`, `.svg`)
without a time stamp (the same data gives the same file), and returned so callers and tests can
read them.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

from dpresearch.analysis.errors import require_columns

# 20 distinct colours: tab10, then tab20's light shades.
COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5",
    "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5",
)  # fmt: skip
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
STYLES = ("-", "--", ":", "-.")
DECADES = 2.0  # a positive axis spanning more than this many decades is drawn on a log scale
WIDTH, HEIGHT = 9.0, 4.8  # inches: the axes' figure before the legend below is added
LEGEND_WRAP = 70  # characters per legend line (two columns: half)
LEGEND_LINE = 0.16  # inches per legend text line at font size 7
MAX_SERIES = 8  # groups in one panel at most
SEED_LINES = 5  # groups of up to this many runs always show each run
PANEL_HEIGHT = 3.6  # inches per panel where a figure has several
SEED_WIDTH = 0.6  # line width of one run drawn beside its group's mean (the mean's: 1.3)

# metric → (axis label with its unit, factor applied to the values)
LABELS: dict[str, tuple[str, float]] = {
    "epoch": ("training progress (epochs)", 1.0),
    "step": ("training progress (steps)", 1.0),
    "tokens": ("training tokens, all workers (millions)", 1e-6),
    "test/bpc": ("test loss (bits per character)", 1.0),
    "val/bpc": ("validation loss (bits per character)", 1.0),
    "comm/bytes_per_token": ("data sent per worker per training token (bytes)", 1.0),
    "comm/bytes": ("data sent per worker (MB)", 1e-6),
    "comm/modeled_s": ("modeled communication time (s)", 1.0),
    "time/simulated_s": ("simulated time (s)", 1.0),
    "time/modeled_s": ("modeled wall-clock time: compute and communication (s)", 1.0),
    "time/wall_s": ("measured wall time (s)", 1.0),
    "test/acc": ("test accuracy (%)", 100.0),
    "val/acc": ("validation accuracy (%)", 100.0),
    "train/acc": ("training accuracy, log window (%)", 100.0),
    "best/test_acc": ("best test accuracy (%)", 100.0),
    "test/acc_local_mean": ("workers' own models, mean test accuracy (%)", 100.0),
    "train/loss": ("training loss, log window (nats)", 1.0),
    "test/loss": ("test loss (nats)", 1.0),
    "val/loss": ("validation loss (nats)", 1.0),
    "gossip/consensus_distance": (
        "consensus distance Ξ² = (1/K)Σ‖xᵢ − x̄‖² (parameter units²)",
        1.0,
    ),
    "lr": ("learning rate (per-worker batch)", 1.0),
    "MB_per_epoch": ("data sent per worker per epoch (MB)", 1.0),
    "async/tau_histogram": ("staleness τ of an applied gradient (server updates)", 1.0),
}
NETWORKS = {
    "1gbe": "1 GbE",
    "10gbe": "10 GbE",
    "25gbe": "25 GbE",
    "100gb_ib": "100 Gb InfiniBand",
    "nvlink": "NVLink",
    "wan_100mbit": "a 100 Mbit/s, 10 ms WAN",
}


def axis_label(metric: str, labels: Mapping[str, str] | None = None) -> tuple[str, float]:
    """(label with unit, value factor) of `metric`; `labels` (metric → label) win, unscaled."""
    if labels and metric in labels:
        return labels[metric], LABELS.get(metric, ("", 1.0))[1]
    if metric in LABELS:
        return LABELS[metric]
    if metric.startswith("time/modeled_s@"):  # a time scenario's clock (`train.time_scenarios`)
        scenario = metric.split("@", 1)[1]
        return f"modeled wall-clock time, scenario {scenario} (s)", 1.0
    if metric.startswith("modeled_s@"):
        net = metric.split("@", 1)[1]
        return f"modeled communication time on {NETWORKS.get(net, net)} (s)", 1.0
    if metric.endswith("_s"):
        return f"{metric} (s)", 1.0
    if metric.endswith("/acc"):
        return f"{metric} (%)", 100.0
    return f"{metric} (as logged)", 1.0


def group_curves(metrics, groups: Mapping[str, Sequence[str]], x: str, y: str):
    """Per group label and step: `x` (mean), `y` (mean), `y std`, `n` — one frame, ordered by
    group then x."""
    require_columns(metrics.columns, ["step", x, y], "metric")
    label_of = {str(run): label for label, runs in groups.items() for run in runs}
    rows = metrics.loc[metrics[y].notna() & metrics[x].notna(), ["run", "step", x, y]]
    # on a categorical `run` this maps each category once, not every row
    rows = rows.assign(group=rows["run"].map(lambda run: label_of.get(str(run))))
    rows = rows[rows["group"].notna()]
    curves = rows.groupby(["group", "step"], sort=False, observed=True).agg(
        x=(x, "mean"), y=(y, "mean"), y_std=(y, "std"), n=(y, "size")
    )
    return curves.reset_index().sort_values(["group", "x", "step"], kind="stable")


def seeds_disagree(last: Sequence[float]) -> bool:
    """Whether a group whose runs ended at `last` shows each run (see the module docstring):
    2 ≤ n ≤ `SEED_LINES`, or more runs whose sorted last values have a gap wider than their
    sample standard deviation (separate clusters, the mean between them)."""
    import numpy as np

    values = np.sort(np.asarray([v for v in last if v == v], dtype=float))
    if len(values) < 2:
        return False
    if len(values) <= SEED_LINES:
        return True
    return bool(np.diff(values).max() > values.std(ddof=1))


def family(label: str) -> str:
    """The family a series belongs to for `panels`: the setting in the label's last
    parentheses ("D-PSGD ring (Dirichlet 0.1), lr 0.32" → "Dirichlet 0.1"), else its first
    word ("top-k 1% + EF" → "top-k")."""
    name = re.sub(r", lr [^,()]*$", "", label)  # a study's ", lr 0.1" suffix
    match = re.search(r"\(([^()]*)\)$", name)
    if match:
        return match.group(1)
    words = name.split()
    return words[0].rstrip(",;:") if words else name


def panels(labels: Sequence[str]) -> list[list[str]]:
    """`labels` split into panels of at most `MAX_SERIES` (one panel where they fit): whole
    families in order of their first label, consecutive ones packed together while they fit (a
    larger family cut into consecutive chunks); the first label leads every panel."""
    labels = list(labels)
    if len(labels) <= MAX_SERIES:
        return [labels]
    head, rest = labels[0], labels[1:]
    families: dict[str, list[str]] = {family(head): []}
    for label in rest:
        families.setdefault(family(label), []).append(label)
    room = MAX_SERIES - 1  # beside the first label
    chunks = [m[i : i + room] for m in families.values() for i in range(0, len(m), room)]
    out: list[list[str]] = []
    for chunk in (c for c in chunks if c):
        if out and len(out[-1]) + len(chunk) <= room:
            out[-1] += chunk
        else:
            out.append(list(chunk))
    return [[head, *members] for members in out] or [[head]]


def _spans_decades(values) -> bool:
    positive = values[values > 0]
    return len(positive) > 1 and positive.max() / positive.min() > 10**DECADES


def style(i: int) -> dict[str, object]:
    """Colour, marker and line style of the i-th series (distinct for i < 20)."""
    return {
        "color": COLORS[i % len(COLORS)],
        "marker": MARKERS[i % len(MARKERS)],
        "linestyle": STYLES[(i // len(COLORS)) % len(STYLES)],
    }


def plot_groups(
    metrics,
    groups: Mapping[str, Sequence[str]],
    x: str,
    y: str,
    outs: Sequence[str | Path],
    logx: bool | None = None,
    title: str | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    logy: bool | None = None,
    vlines: Sequence[float] = (),
    labels: Mapping[str, str] | None = None,
    over: str = "runs (seeds)",
):
    """Draw `y` against `x` for every group (see the module docstring) into each of `outs`;
    returns the figure. `logx`/`logy` None: logarithmic where the values span decades.
    `vlines`: x positions marked with a dotted line (e.g. the horizons a study reports).
    `over`: what a group's runs are, for the caption."""
    from matplotlib.figure import Figure

    curves = group_curves(metrics, groups, x, y)
    x_label, x_scale = axis_label(x, labels)
    y_label, y_scale = axis_label(y, labels)
    drawn = [label for label in groups if (curves["group"] == label).any()]
    layout = panels(drawn) if drawn else [[]]
    fig = Figure(figsize=(WIDTH, HEIGHT if len(layout) == 1 else PANEL_HEIGHT * len(layout)))
    axes = fig.subplots(len(layout), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    most = int(curves["n"].max()) if len(curves) else 0
    index = {label: i for i, label in enumerate(groups)}
    seeds = {label for label in drawn if seeds_disagree(_last_values(metrics, groups[label], y))}
    caption = (
        f"Lines: the mean over each case's {over} at each logged step (n in the legend); band: "
        "± one sample standard deviation over them (none where n = 1)."
        if most > 1
        else "Lines: one run each; no band (one run per case)."
    )
    if seeds:
        caption += (
            f" Thin lines: each run of a case with 2–{SEED_LINES} runs, or more whose final "
            "values split (a gap wider than their standard deviation)."
        )
    if len(layout) > 1:
        caption += (
            f" {len(layout)} panels of at most {MAX_SERIES} cases, by family (the setting in "
            "parentheses, else the first word), the first case in each; shared axes."
        )
    fig.dpresearch_caption = caption
    for ax, members in zip(axes, layout, strict=True):
        for label in members:
            c = curves[curves["group"] == label]
            xs, ys = c["x"] * x_scale, c["y"] * y_scale
            n = int(c["n"].max())
            look = style(index[label])
            legend = f"{label} (n={n})" if n > 1 else label
            if ax is not axes[0] and label == layout[0][0]:
                legend = "_repeat"  # the figure's one legend names the repeated series once
            ax.plot(
                xs,
                ys,
                markersize=3.5,
                markevery=max(1, len(c) // 12),
                linewidth=1.3,
                label=legend,
                **look,
            )
            if n > 1:
                spread = c["y_std"].fillna(0.0) * y_scale
                ax.fill_between(
                    xs, ys - spread, ys + spread, color=look["color"], alpha=0.15, linewidth=0
                )
            if label in seeds:
                for run in run_curves(metrics, groups[label], x, y):
                    ax.plot(
                        run[x] * x_scale,
                        run[y] * y_scale,
                        color=look["color"],
                        linestyle=look["linestyle"],
                        linewidth=SEED_WIDTH,
                        alpha=0.6,
                        label="_seed",
                    )
        for v in vlines:
            ax.axvline(v * x_scale, color="0.5", linestyle=":", linewidth=1)
        if len(layout) > 1:
            names = dict.fromkeys(family(label) for label in members[1:])
            ax.set_title(", ".join(names), fontsize=8)
    if logx if logx is not None else _spans_decades(curves["x"]):
        axes[0].set_xscale("log")
    if logy if logy is not None else _spans_decades(curves["y"]):
        axes[0].set_yscale("log")
    finish(fig, list(axes), xlabel or x_label, ylabel or y_label, title, bool(groups))
    for out in outs:
        save(fig, out)
    return fig


def _last_values(metrics, runs: Sequence[str], y: str) -> list[float]:
    """Each of `runs`' last logged value of `y`."""
    return [float(c[y].iloc[-1]) for c in run_curves(metrics, runs, None, y) if len(c)]


def run_curves(metrics, runs: Sequence[str], x: str | None, y: str) -> list:
    """One frame per run of `runs` (in their order): its logged `x` and `y` (no missing
    value), ordered by x (by step where x is None)."""
    names = {str(r) for r in runs}
    cols = list(dict.fromkeys(["run", "step", *([x] if x else []), y]))
    rows = metrics.loc[metrics[y].notna() & metrics["run"].astype(str).isin(names), cols]
    if x:
        rows = rows[rows[x].notna()]
    order = [x, "step"] if x else ["step"]
    by_run = {str(k): g for k, g in rows.groupby(rows["run"].astype(str), sort=False)}
    return [by_run[str(r)].sort_values(order, kind="stable") for r in runs if str(r) in by_run]


def plot_points(
    points: Sequence[tuple[str, float, float, float]],
    x: str,
    y: str,
    out: str | Path,
    title: str | None = None,
    labels: Mapping[str, str] | None = None,
    over: str = "runs (seeds)",
):
    """One marker per (label, x, y, y spread) — e.g. each case's final accuracy against its
    bytes per epoch — with its spread as an error bar; returns the figure. `over`: what a
    marker averages, for the caption."""
    from matplotlib.figure import Figure

    x_label, x_scale = axis_label(x, labels)
    y_label, y_scale = axis_label(y, labels)
    fig = Figure(figsize=(WIDTH, HEIGHT))
    ax = fig.subplots()
    fig.dpresearch_caption = (
        f"Markers: the mean over each case's {over}; bars: ± one sample standard deviation over "
        "them (none where one run)."
    )
    for i, (label, xv, yv, spread) in enumerate(points):
        look = style(i)
        yerr = spread * y_scale if spread == spread else None
        ax.errorbar(
            xv * x_scale,
            yv * y_scale,
            yerr=yerr,
            color=look["color"],
            marker=look["marker"],
            linestyle="none",
            markersize=6,
            capsize=3,
            label=label,
        )
    import numpy as np

    xs = np.array([p[1] for p in points], dtype=float)
    if len(xs) and xs.min() > 0 and xs.max() / xs.min() > 10:  # amounts over a decade: log
        ax.set_xscale("log")
    finish(fig, ax, x_label, y_label, title, bool(points))
    save(fig, out)
    return fig


def plot_histograms(
    series: Mapping[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    out: str | Path,
    title: str | None = None,
    what: str = "counts",
):
    """Small multiples: one panel per labelled histogram (counts of 0, 1, 2, ...), the label as
    the panel's title, x and y shared so panels compare at a glance; two columns from three
    series on. Log-scaled counts; a symmetric-log x axis when the values reach past 100.
    `what`: what a bar's height is, for the caption."""
    from matplotlib.figure import Figure

    n = max(1, len(series))
    cols = 1 if n < 3 else 2
    rows = -(-n // cols)
    fig = Figure(figsize=(WIDTH, 1.2 + 2.2 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False).ravel()
    fig.dpresearch_caption = (
        f"One panel per case; bars: {what} (no spread: nothing is averaged); the panels share "
        "their axes."
    )
    longest = max((len(c) for c in series.values()), default=0)
    for i, (ax, (label, counts)) in enumerate(zip(axes, series.items(), strict=False)):
        edges = [k - 0.5 for k in range(len(counts) + 1)]  # a lone bin (τ = 0) shows too
        ax.stairs(counts, edges, linewidth=1.3, color=style(i)["color"])
        ax.set_title("\n".join(textwrap.wrap(label, 60)), fontsize=8)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if longest > 100:
            ax.set_xscale("symlog", linthresh=10)
        ax.set_yscale("log")
        # the shared axes' labels drawn once, on the outer panels (each panel still holds them)
        ax.xaxis.label.set_visible(i + cols >= n)
        ax.tick_params(labelbottom=i + cols >= n)
        ax.yaxis.label.set_visible(i % cols == 0)
    for ax in axes[len(series) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=9)
    save(fig, out)
    return fig


def finish(fig, ax, xlabel: str, ylabel: str, title: str | None, legend: bool) -> None:
    """The look every figure shares: axis labels, a small title, a light grid, the legend
    below the axes inside the figure (`legend`: there are labelled series; labels wrapped, one
    or two columns, the figure made taller to hold it), a constrained layout. `ax`: one axes,
    or a column of panels (labels on each, the title above the figure, one legend of every
    panel's series)."""
    axes = ax if isinstance(ax, list) else [ax]
    for a in axes:
        a.set_xlabel(xlabel)
        a.set_ylabel(ylabel)
        a.grid(alpha=0.3)
        # panels share x: every one holds its label, drawn once, under the last
        a.xaxis.label.set_visible(a is axes[-1])
    if title:
        text = "\n".join(textwrap.wrap(title, 110))
        if len(axes) == 1:
            axes[0].set_title(text, fontsize=9)
        else:
            fig.suptitle(text, fontsize=9)
    fig.set_layout_engine("constrained")
    handles, labels = [], []
    for a in axes:
        h, lab = a.get_legend_handles_labels()
        handles += h
        labels += lab
    if legend and handles:
        cols = 2 if len(labels) > 4 and max(map(len, labels)) <= LEGEND_WRAP else 1
        wrapped = ["\n".join(textwrap.wrap(t, LEGEND_WRAP // cols) or [""]) for t in labels]
        heights = [t.count("\n") + 1 for t in wrapped]
        lines = sum(sorted(heights, reverse=True)[: -(-len(heights) // cols)])
        height = HEIGHT if len(axes) == 1 else PANEL_HEIGHT * len(axes)
        fig.set_size_inches(WIDTH, height + 0.3 + LEGEND_LINE * 1.25 * lines)
        fig.legend(
            handles, wrapped, loc="outside lower center", ncols=cols, fontsize=7, frameon=False
        )


def save(fig, out: str | Path) -> None:
    """Save without the time stamp and software version matplotlib embeds by default."""
    suffix = Path(out).suffix.lower()
    meta = {
        ".png": {"Software": None},
        ".pdf": {"CreationDate": None, "Producer": None},
        ".svg": {"Date": None, "Creator": None},
    }
    fig.savefig(out, dpi=120, metadata=meta.get(suffix))


def plot_curves(
    runs: Mapping[str, str | Path], x: str, y: str, out: str | Path, logx: bool | None = None
):
    """One line per labelled run of metric `y` against `x` (e.g. epoch, comm/bytes,
    comm/modeled_s), saved to `out`. Labels must be distinct (a dict cannot repeat them)."""
    from dpresearch.analysis.runs import load_metrics_many

    paths = [str(p) for p in runs.values()]
    metrics = load_metrics_many(paths)
    if y not in metrics:
        metrics[y] = float("nan")
    return plot_groups(metrics, {label: [str(p)] for label, p in runs.items()}, x, y, [out], logx)
