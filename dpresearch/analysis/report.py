"""From run directories to a study's tables, plots and `results.md`.

`build_report` loads every run (finished or not), aggregates seeds per case and tuned setting,
selects the best setting per case on a stated metric, adds time-to-accuracy and published
numbers; `write_report` writes the tables (markdown, LaTeX, CSV), every run's row (`runs.csv`,
with its status), the plots and `results.md`. Nothing is dropped silently: runs that did not
finish are listed with their status and counted in each row's `excluded` column; runs sharing
a case and a seed are named in the notes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dpresearch.analysis.aggregate import (
    Selection,
    aggregate,
    choose_selection,
    duplicate_seed_notes,
    key_texts,
    select_best,
)
from dpresearch.analysis.errors import AnalysisError, require_columns
from dpresearch.analysis.labels import default_title, label_parts, varying_keys
from dpresearch.analysis.published import Published, join_published
from dpresearch.analysis.quality import mark_untrained
from dpresearch.analysis.runs import FINISHED, STATUSES, find_runs, load_metrics_many
from dpresearch.analysis.runs import load_summaries as load_runs_frame
from dpresearch.analysis.timing import add_modeled_time, modeled_column, time_to_accuracy

DEFAULT_METRICS = ("test/acc", "best/test_acc", "test/bpc", "val/bpc", "train/loss")
DEFAULT_TUNE = ("cfg.optimizer.lr",)
MB = 1e6
PROGRESS_FROM_RUNS = 50  # load_report's progress lines start at this many runs


@dataclass
class ReportSpec:
    """What to compute. `by`: the keys that define a case (None: `case` when a study launched
    the runs, else a label of what differs between the runs' configs but the seed, so a seed
    sweep is aggregated). `tune`: keys selected over within a case when they vary
    there. `select`: the selection metric (`name[:min|max]`; None: validation metric, else
    final training loss). `target`: time-to-accuracy target on `target_metric`. `network`:
    preset the modeled seconds are re-priced on (None: each run's own network).
    `select_seeds`: the selection reads only these seeds' runs (a study's tuning seeds: the
    other seeds ran at the selected setting alone), the table still averages every seed."""

    by: Sequence[str] | None = None
    tune: Sequence[str] | None = None
    seed_key: str = "cfg.seed"
    select: str | None = None
    metrics: Sequence[str] | None = None
    target: float | None = None
    target_metric: str = "test/acc"
    network: str | None = None
    include_failed: bool = False
    published: Published | None = None
    title: str = ""  # "": the runs' study, else what they share
    select_seeds: Sequence[int] | None = None


@dataclass
class Report:
    spec: ReportSpec
    by: list[str]
    tune: list[str]
    selection: Selection | None
    runs: Any  # one row per run (pandas)
    metrics: Any  # one row per logged step of every run
    grid: Any  # one row per case × tuned setting (None without tuning)
    table: Any  # one row per case: the selected setting
    columns: list[str]  # shown columns of `table`
    grid_columns: list[str]
    failed: Any  # runs that did not finish
    groups: dict[str, list[str]]  # plot label → runs (the selected setting's averaged runs)
    notes: list[str] = field(default_factory=list)


def _derive(runs) -> list[str]:
    """Add MB columns for the byte counters; return the derived metric names."""
    derived = []
    for src, dst in (
        ("comm/bytes_per_epoch", "MB/epoch"),
        ("comm/bytes", "MB"),
        ("tta/bytes", "tta/MB"),
    ):
        if src in runs:
            import pandas as pd

            runs[dst] = pd.to_numeric(runs[src], errors="coerce") / MB
            derived.append(dst)
    return derived


def _tuned_keys(runs, by: list[str], tune: Sequence[str] | None) -> list[str]:
    if tune is not None:
        require_columns(runs.columns, tune, "tuning key")
        return list(tune)
    candidates = [k for k in DEFAULT_TUNE if k in runs]
    return [
        k for k in candidates if (runs.groupby(by, dropna=False)[k].nunique(dropna=False) > 1).any()
    ]


def selected_on_seeds(runs, grid, by, tune, selection, seed_key, seeds, include_failed):
    """`grid`'s rows whose setting is best per case on the runs of `seeds` alone (a boolean
    Series aligned with `grid`)."""
    import pandas as pd

    basis = runs[runs[seed_key].isin(list(seeds))]
    if basis.empty:
        return grid["selected"] & False
    chosen = select_best(
        aggregate(basis, [*by, *tune], [selection.metric], seed_key, include_failed),
        by,
        tune,
        selection,
    )
    keys = [*by, *tune]
    picked = set(key_texts(chosen[chosen["selected"]], keys))
    return pd.Series([key in picked for key in key_texts(grid, keys)], index=grid.index)


def grid_edge_notes(grid, by: Sequence[str], tune: Sequence[str]) -> list[str]:
    """One note per case whose selected value of a numeric tuned key is the smallest or the
    largest of those it tried: the best setting may lie outside the grid."""
    import pandas as pd

    notes = []
    for case, frame in grid.groupby(list(by), dropna=False, sort=False):
        chosen = frame[frame["selected"]]
        if chosen.empty:
            continue
        for key in tune:
            values = pd.to_numeric(frame[key], errors="coerce").dropna()
            value = pd.to_numeric(chosen[key], errors="coerce").iloc[0]
            if values.nunique() < 2 or pd.isna(value):
                continue
            edge = (
                "smallest" if value == values.min() else "largest" if value == values.max() else ""
            )
            if edge:
                name = case[0] if isinstance(case, tuple) and len(case) == 1 else case
                notes.append(
                    f"{name}: the selected {key.removeprefix('cfg.')}={value:g} is the {edge} "
                    f"of the {values.nunique()} values tried; the best may lie beyond the grid"
                )
    return notes


def build_report(runs, metrics, spec: ReportSpec) -> Report:
    """The report of `runs` (`load_summaries`) and their steps (`load_metrics_many`)."""
    import pandas as pd

    if runs.empty:
        raise AnalysisError("no run directories found")
    runs = mark_untrained(runs.copy(), metrics)
    notes: list[str] = []
    if spec.by:
        by = list(spec.by)
    else:  # a study's cases, else what differs between the runs but their seed
        by = ["case"]
        if "case" not in runs:
            runs["case"], keys = label_parts(runs, varying_keys(runs, spec.seed_key))
            shown = ", ".join(k.removeprefix("cfg.") for k in keys)
            notes.append(
                f"cases: runs grouped by what differs between them ({shown})"
                if keys
                else "cases: the runs differ only in their seed"
            )
    require_columns(runs.columns, by, "--by column")
    tune = [k for k in _tuned_keys(runs, by, spec.tune) if k not in by]
    metrics = add_modeled_time(metrics, runs, spec.network)
    wanted = list(spec.metrics) if spec.metrics else [m for m in DEFAULT_METRICS if m in runs]
    require_columns(runs.columns, wanted, "metric")

    tta_cols: list[str] = []
    if spec.target is not None:
        tta = time_to_accuracy(metrics, spec.target_metric, spec.target, spec.network)
        runs = runs.merge(tta, on="run", how="left")
        tta_cols = [c for c in tta.columns if c not in ("run", "tta/bytes")]
    derived = _derive(runs)
    tta_cols += ["tta/MB"] if "tta/MB" in runs else []
    costs = [c for c in derived if c == "MB/epoch"] if not spec.metrics else []

    selection = None
    if tune:
        selection = choose_selection(list(runs.columns), spec.select)
    values = list(
        dict.fromkeys([*wanted, *costs, *tta_cols, *([selection.metric] if selection else [])])
    )
    seed_key = spec.seed_key if spec.seed_key in runs else None
    if seed_key is None:
        notes.append(f"no {spec.seed_key} column: every run counts as one seed")
    notes += duplicate_seed_notes(runs[runs["status"] == FINISHED], [*by, *tune], seed_key)

    grid = aggregate(runs, [*by, *tune], values, seed_key, spec.include_failed)
    if tune:
        grid = select_best(grid, by, tune, selection)
        if spec.select_seeds is not None and seed_key is not None:
            grid["selected"] = selected_on_seeds(
                runs, grid, by, tune, selection, seed_key, spec.select_seeds, spec.include_failed
            )
            notes.append(
                f"selected on seeds {', '.join(map(str, spec.select_seeds))} only (the tuning "
                "seeds); the other seeds ran at the selected setting"
            )
        notes += grid_edge_notes(grid, by, tune)
        table = grid[grid["selected"]]
        missing = grid[~grid.set_index(by).index.isin(table.set_index(by).index)]
        if not missing.empty:  # cases where nothing could be selected: shown, never dropped
            lost = aggregate(
                runs[runs.set_index(by).index.isin(missing.set_index(by).index)],
                by,
                values,
                seed_key,
                spec.include_failed,
            )
            table = pd.concat([table, lost], ignore_index=True)
        table = table.reset_index(drop=True)
    else:
        table = grid

    for frame in (grid, table):
        if "tta/reached" in frame:
            reached = (frame["tta/reached"] * frame["n"]).round().fillna(0).astype(int)
            frame["reached"] = reached.astype(str) + "/" + frame["n"].astype(str)
    shown_values = [c for c in values if c != "tta/reached"]
    extra = ["reached"] if "tta/reached" in values else []
    columns = [*by, *tune, "n", *shown_values, *extra, "excluded"]
    grid_columns = [
        *by,
        *tune,
        "n",
        "seeds",
        *dict.fromkeys([*([selection.metric] if selection else []), *wanted]),
        "excluded",
        "selected",
    ]
    grid_columns = [c for c in grid_columns if c in grid]

    if spec.published is not None:
        table, more = join_published(table, spec.published, by[0])
        notes += more
        columns += [c for c in table.columns if c.startswith("published ")]
        columns += ["ref"] if "ref" in table else []

    runs = _with_last_step(runs, metrics)
    failed = runs[runs["status"] != FINISHED]
    counts = runs["status"].value_counts()
    order = [*(s for s in STATUSES if s in counts), *sorted(set(counts.index) - set(STATUSES))]
    notes.insert(0, f"{len(runs)} runs: " + ", ".join(f"{counts[s]} {s}" for s in order))
    if not failed.empty:
        notes.insert(
            1,
            "runs that did not finish are listed with their status (results.md, runs.csv) and "
            + (
                "included in the means (--include-failed)"
                if spec.include_failed
                else "left out of every mean"
            ),
        )

    groups = _plot_groups(runs, table, by, tune, spec.include_failed)
    if not spec.title:
        spec = replace(spec, title=default_title(runs))
    return Report(
        spec,
        by,
        tune,
        selection,
        runs,
        metrics,
        grid if tune else None,
        table,
        columns,
        grid_columns,
        failed,
        groups,
        notes,
    )


def _with_last_step(runs, metrics):
    """Runs without a summary get `step`, `epoch` and `train/loss` of their last logged line
    (how far a killed run got)."""
    cols = [c for c in ("step", "epoch", "train/loss") if c in metrics]
    todo = runs["status"] == "unfinished"
    if not cols or not todo.any():
        return runs
    last = metrics.groupby("run", observed=True, sort=False)[cols].tail(1)
    last = last.assign(run=metrics.loc[last.index, "run"].astype(str)).set_index("run")
    runs = runs.copy()
    for c in cols:
        values = runs.loc[todo, "run"].map(last[c])
        runs.loc[todo, c] = values
    return runs


def _plot_groups(runs, table, by, tune, include_failed: bool) -> dict[str, list[str]]:
    """Plot label → the runs averaged in each row of `table`, every row (a case without a
    `--by` key included: its value reads "–" in its label as in the table). A label names the
    row's case values as the table prints them, then its tuned values (`lr=0.1`)."""
    from dpresearch.analysis.tables import display_frame

    keys = [*by, *tune]
    usable = runs if include_failed else runs[runs["status"] == FINISHED]
    members: dict[tuple[str, ...], list[str]] = {}
    for key, run in zip(key_texts(usable, keys), usable["run"], strict=True):
        members.setdefault(key, []).append(run)
    shown = display_frame(table, keys, FORMATS)
    groups: dict[str, list[str]] = {}
    for key, cells in zip(key_texts(table, keys), shown.itertuples(index=False), strict=True):
        label = " / ".join(cells[: len(by)])
        if tune:
            label += ", " + ", ".join(
                f"{k.split('.')[-1]}={v}" for k, v in zip(tune, cells[len(by) :], strict=True)
            )
        if members.get(key):  # (a case none of whose runs finished has no curve)
            groups[label] = members[key]
    return groups


def load_report(
    roots: Sequence[str | Path], spec: ReportSpec, progress: Callable[[str], None] | None = None
) -> Report:
    """`build_report` on every run directory under `roots`; `progress` (if given) hears one
    line per stage (found, summaries read, metrics read) with the seconds so far, when there
    are `PROGRESS_FROM_RUNS` runs or more (a few runs load in a blink)."""
    started = time.perf_counter()
    paths = find_runs(roots)
    if not paths:
        raise AnalysisError(f"no run directories under {', '.join(map(str, roots))}")

    def say(line: str) -> None:
        if progress is not None and len(paths) >= PROGRESS_FROM_RUNS:
            progress(f"{line} ({time.perf_counter() - started:.1f} s)")

    say(f"{len(paths)} run directories found; reading their summaries and configs")
    runs = load_runs_frame(paths)
    say("reading metrics.jsonl")
    metrics = load_metrics_many(paths)
    say("aggregating")
    return build_report(runs, metrics, spec)


# -- output -----------------------------------------------------------------------------------

FORMATS = {"MB/epoch": "MB", "MB": "MB", "tta/MB": "MB", "n": "d", "test/acc": "%",
           "best/test_acc": "%", "val/acc": "%", "train/acc": "%", "test/acc_local_mean": "%",
           "test/acc_local_min": "%", "train/loss": ".3g", "tta/epoch": ".3g",
           "tta/wall_s": ".3g", "tta/simulated_s": ".3g",
           "tta/modeled_s": ".3g", "comm/bytes": "bytes", "comm/bytes_per_epoch": "bytes",
           "comm/bytes_max": "bytes", "outer/bytes_per_round": "bytes",
           "tta/bytes": "bytes"}  # fmt: skip


# Shown names of the columns the report derives (metrics are named by `plots.axis_label`).
HEADS = {
    "MB/epoch": "MB sent per worker per epoch",
    "MB": "MB sent per worker",
    "tta/MB": "MB sent per worker to the target",
    "comm/bytes_per_epoch": "MB sent per worker per epoch",
    "comm/bytes_max": "MB sent by the busiest worker",
    "outer/bytes_per_round": "MB sent per worker per outer round",
    "tta/bytes": "MB sent per worker to the target",
    "tta/epoch": "epochs to the target",
    "tta/wall_s": "measured wall time to the target (s)",
    "tta/simulated_s": "simulated time to the target (s)",
    "reached": "seeds reaching it",
}


def headers(columns: Sequence[str]) -> dict[str, str]:
    """Shown names, as a study's report heads its columns: a metric by its label with its unit
    (`test accuracy (%)`, `training loss, log window (nats)`, `test loss (bits per
    character)`), a config key by its shortest unambiguous name (`algorithm`, `period`, `lr`),
    anything else as it is."""
    from dpresearch.analysis.labels import key_names
    from dpresearch.analysis.plots import LABELS, axis_label

    keys = [c for c in columns if c.startswith(("cfg.", "choice."))]
    out = {c: c for c in columns} | key_names(keys)
    for c in columns:
        if c in HEADS:
            out[c] = HEADS[c]
        elif c in LABELS or c.endswith("/acc"):
            out[c] = axis_label(c)[0]
        elif c.startswith(("tta/modeled_s", "tta/time/modeled_s@")):  # (@: a time scenario)
            out[c] = axis_label(c.removeprefix("tta/"))[0].replace(" (s)", " to the target (s)")
    return out


def relative_path(path: str) -> str:
    """`path` relative to the current directory when it lies below it (generated files never
    hold the absolute paths of the machine that made them)."""
    try:
        return Path(path).resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


def failed_table(report: Report) -> str:
    from dpresearch.analysis.tables import markdown_table

    f = report.failed.copy()
    f["run"] = f["run"].map(relative_path)
    cols = [
        c
        for c in [
            "run",
            "status",
            *report.by,
            *report.tune,
            report.spec.seed_key,
            "step",
            "epoch",
            "train/loss",
        ]
        if c in f
    ]
    if "train/loss" in f:  # a diverged loss reads "nan", not "missing"
        f["train/loss"] = f["train/loss"].map(lambda v: f"{v:.4g}" if v == v else "nan")
    cols = list(dict.fromkeys(cols))
    return markdown_table(f, cols, {"step": ".0f"}, headers(cols))


def plot_files(
    report: Report, out: Path, kinds: Sequence[str] = ("png",)
) -> tuple[list[Path], list[str]]:
    """Accuracy and loss against epochs, bytes and modeled time; returns the first-kind paths
    and each figure's caption."""
    from dpresearch.analysis.plots import plot_groups

    ys = [
        y
        for y in dict.fromkeys(
            [report.spec.target_metric, "test/acc", "test/bpc", "val/bpc", "train/loss"]
        )
        if y in report.metrics
    ]
    modeled = modeled_column(report.spec.network)
    written, captions = [], []
    for y in ys:
        for x in ("epoch", "tokens", "comm/bytes", modeled):
            if x not in report.metrics or not report.metrics[x].notna().any():
                continue
            stem = f"{y}_vs_{x}".replace("/", "_").replace("@", "_")
            paths = [out / f"{stem}.{kind}" for kind in kinds]
            fig = plot_groups(report.metrics, report.groups, x, y, paths, title=report.spec.title)
            written.append(paths[0])
            captions.append(fig.dpresearch_caption)
    return written, captions


def describe(report: Report) -> list[str]:
    """The protocol lines results.md states: selection, aggregation, time-to-accuracy."""
    spec = report.spec
    lines = []
    if report.selection is not None:
        tuned = ", ".join(f"`{k}`" for k in report.tune)
        lines.append(
            f"**Selection:** per case, the setting of {tuned} with the "
            f"{report.selection.describe()}; a setting in which a seed diverged "
            "is never preferred to one in which none did."
        )
    agg = "mean ± sample standard deviation over seeds (`n` runs)"
    lines.append(
        f"**Aggregation:** {agg}; only finished runs are averaged"
        + (
            " (here diverged and unfinished runs are included: --include-failed)."
            if spec.include_failed
            else "."
        )
    )
    if any(c in report.columns for c in ("MB/epoch", "MB", "tta/MB")):
        lines.append(
            "**Bytes:** MB = 10⁶ bytes of `comm/bytes`, the algorithm's payload a worker sent "
            "(gradients as compressed, models, gossip messages), mean over workers; BatchNorm-"
            "buffer broadcasts (`comm/bytes_buffers`), evaluation and metric traffic are "
            "counted apart and not included."
        )
    if spec.target is not None:
        net = spec.network or "each run's own network"
        lines.append(
            f"**Time to accuracy:** first logged step with `{spec.target_metric}` "
            f"{'≤' if 'loss' in spec.target_metric else '≥'} "
            f"{spec.target:g}: epochs, MB per worker, modeled communication seconds on {net} "
            "(the run's operations re-priced; per-step values scaled by the ratio of the "
            "re-priced total to the logged one, exact when every step sends the same "
            "operations), measured wall seconds, simulated seconds where logged. Means over "
            "the seeds that reached the target (`reached`)."
        )
    return lines


def render_markdown(
    report: Report, plots: Sequence[Path] = (), header: str = "", captions: Sequence[str] = ()
) -> str:
    from dpresearch.analysis.tables import markdown_table

    lines = [f"# {report.spec.title}", ""]
    if header:
        lines += [header, ""]
    for line in describe(report):
        lines += [line, ""]
    table = markdown_table(report.table, report.columns, FORMATS, headers(report.columns))
    lines += ["## Results", "", table, ""]
    if report.spec.published is not None:
        lines += [
            "Published numbers (`published …` columns):",
            "",
            *(f"- {n}" for n in report.spec.published.footnotes()),
            "",
        ]
    if report.grid is not None:
        lines += [
            "## Every setting tried",
            "",
            markdown_table(report.grid, report.grid_columns, FORMATS, headers(report.grid_columns)),
            "",
        ]
    if not report.failed.empty:
        lines += ["## Runs that did not finish", "", failed_table(report), ""]
    lines += ["## Notes", "", *(f"- {n}" for n in report.notes), ""]
    if plots:
        lines += ["## Plots", "", *figure_lines(plots, captions), ""]
    return "\n".join(lines)


def figure_lines(plots: Sequence[Path], captions: Sequence[str] = ()) -> list[str]:
    """Each plot as a markdown image, its caption (what its line, band or bar is) under it."""
    lines = []
    for i, p in enumerate(plots):
        caption = captions[i] if i < len(captions) else ""
        lines += [f"![{p.stem}]({p.name})", *([f"*{caption}*"] if caption else []), ""]
    return lines[:-1]


def check_out_dir(out: str | Path, flag: str = "--out", create: bool = False) -> Path:
    """`out` as a folder a report can be written into (made when `create`); raises
    `AnalysisError` (one line) for a file, or a folder that cannot be made or written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AnalysisError(
            f"{flag} {out} is a file; pass a folder (it gets results.md, the tables and plots)"
        )
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise AnalysisError(f"{flag} {out} cannot be written ({existing} is not a writable folder)")
    if create:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise AnalysisError(f"{flag} {out} cannot be made ({exc.strerror or exc})") from None
    return out


def write_report(
    report: Report, out: str | Path, header: str = "", plot_kinds: Sequence[str] = ("png",)
) -> Path:
    """Write results.md, table.{md,tex,csv}, grid.{md,csv}, runs.csv and the plots into
    `out`; returns the path of results.md."""
    from dpresearch.analysis.tables import csv_table, latex_table, markdown_table

    out = check_out_dir(out, create=True)
    shown = headers(report.columns)
    (out / "table.md").write_text(
        markdown_table(report.table, report.columns, FORMATS, shown) + "\n"
    )
    (out / "table.tex").write_text(
        latex_table(report.table, report.columns, FORMATS, shown, report.spec.title) + "\n"
    )
    (out / "table.csv").write_text(csv_table(report.table, report.columns))
    if report.grid is not None:
        (out / "grid.csv").write_text(csv_table(report.grid, report.grid_columns))
    run_cols = [
        c
        for c in report.runs.columns
        if not c.startswith("cfg.") and c not in ("comm/ops", "comm/op_counts", "topology")
    ]
    runs = report.runs[run_cols].copy()
    runs["run"] = runs["run"].map(relative_path)
    runs.to_csv(out / "runs.csv", index=False)
    plots, captions = plot_files(report, out, plot_kinds) if plot_kinds else ([], [])
    path = out / "results.md"
    path.write_text(render_markdown(report, plots, header, captions))
    return path
