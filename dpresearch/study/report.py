"""A study's results.md, tables and plots — always rendered from its shipped run data.

`report_study` packs the run directories under `<out>/runs` (when there are any) into the
study's run-data file (`<study>.rundata.jsonl.gz` beside the YAML, see
`dpresearch.analysis.rundata`), then renders everything from that file alone, so a fresh clone
regenerates the committed report byte for byte.

What a report states (one rule for every study):
- **Selection** on the tuning seeds' mean of the study's metric, its standard error beside it
  (`analysis.quality.standard_error`), a mark where the choice was won by less than the
  standard error of the difference, and "bound reached" beside every pick at an edge of its
  grid (the launcher extends a grid until its pick is interior or the bound is reached).
- **Results** on the final seeds only (never averaged with the tuning seeds), per horizon;
  accuracy in % with one decimal ± std, bytes in MB/GB with three significant figures; a case
  whose runs diverged or did not train prints that instead of a number.
- **Claim**: each expectation judged at each horizon on the final seeds: holds where the
  difference exceeds twice its standard error, the opposite holds where it is below minus
  twice, unresolved otherwise. Nothing is concluded beyond the last horizon. A verdict whose
  side has one final seed says "one final seed": its SE holds no seed-to-seed spread.
- **Published numbers** in a table of their own, with their set-up and source, never in a
  column beside ours; a row measured in another setting than the case it names (its `differs`
  column) or naming no case goes to a second table, "published, other setting", naming what
  differs.
- **Counts** a reading quotes, in the notes (`counts.summary_sentences`): the runs by role, the
  grids grown, and per horizon how many picks are interior, at an edge and within noise — so
  that no README types a count by hand (`tests/test_study_readme_counts.py` ties each to the
  run data).

This module loads the run data, builds the `StudyReport` and writes results.md and the result
files; the tables' cells and frames are `study.tables`, the claim's verdicts `study.claims`,
the plots `study.figures`, the counts `study.counts`.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpresearch import SOURCE_ROOT
from dpresearch.analysis.aggregate import Selection, duplicate_seed_notes
from dpresearch.analysis.errors import AnalysisError
from dpresearch.analysis.quality import mark_untrained
from dpresearch.analysis.runs import FINISHED, STATUSES, find_runs
from dpresearch.analysis.tables import latex_table, markdown_table
from dpresearch.study.claims import Z, claim_frame
from dpresearch.study.counts import summary_sentences
from dpresearch.study.figures import plot_files
from dpresearch.study.select import (
    Horizon,
    examples_behind,
    horizons,
    lr_column,
    selection_of,
    tuned_columns,
    untuned,
)
from dpresearch.study.spec import Study, StudyError, slug
from dpresearch.study.tables import grid_frame, published_frame, result_metrics, results_frame


# -- run data ------------------------------------------------------------------------------------
def pack_study(study: Study, out: str | Path) -> Path | None:
    """Pack the run directories under `out/runs` into the study's run-data file (None when
    there are none: the shipped file stays as it is). Refused (StudyError) where the run data
    already holds a point that `out/runs` lacks — a study still running, or run with `--only`,
    would otherwise replace the shipped runs with fewer."""
    from dpresearch.analysis.rundata import pack_runs

    out = Path(out)
    paths = find_runs([out / "runs"])
    if not paths:
        return None
    if study.data_path.exists():
        _refuse_to_drop(study, out)
    return pack_runs(paths, out, study.data_path, study.curves, {"study": study.name})


def _refuse_to_drop(study: Study, out: Path) -> None:
    """StudyError naming the fix if the run data holds points no directory under `out/runs`
    holds (by the point's name: case, lr, any second key, seed)."""
    from dpresearch.analysis.rundata import read_rundata
    from dpresearch.study.status import launched_points

    _, records = read_rundata(study.data_path)
    packed = {(r.get("point") or {}).get("point") for r in records} - {None}
    on_disk = {point.get("point") for _, point in launched_points(out)}
    missing = sorted(packed - on_disk)
    if missing:
        data, runs = relative(study.data_path), out / "runs"
        raise StudyError(
            f"{data} holds {len(missing)} runs that {runs} lacks (e.g. {missing[0]!r}): packing "
            f"{runs} would drop them; unpack them there first (python -m dpresearch.study "
            f"unpack {relative(study.path)} --out {out}), report the shipped data from another "
            f"--out, or delete {data} to replace it"
        )


def load_data(study: Study):
    """(header, runs, metrics) from the study's run-data file, runs that did not train marked."""
    from dpresearch.analysis.rundata import load_rundata

    try:
        header, runs, metrics = load_rundata(study.data_path)
    except AnalysisError as exc:
        raise StudyError(str(exc)) from None
    if runs.empty:
        raise StudyError(f"{study.data_path.name} holds no runs; run the study first")
    return header, mark_untrained(runs, metrics), metrics


def relative(path: Path) -> str:
    """`path` relative to this source checkout (the shipped studies; none for an installed
    wheel) or the current directory, else its name."""
    for base in (*filter(None, [SOURCE_ROOT]), Path.cwd()):
        try:
            return Path(path).resolve().relative_to(base.resolve()).as_posix()
        except ValueError:
            continue
    return Path(path).name


# -- the report ----------------------------------------------------------------------------------
@dataclass
class StudyReport:
    study: Study
    header: dict[str, Any]
    runs: Any
    metrics: Any
    selection: Selection
    horizons: list[Horizon]
    include_failed: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def last(self) -> Horizon:
        return self.horizons[-1]


def build(study: Study, header: dict, runs, metrics, include_failed: bool = False) -> StudyReport:
    if "case" not in runs or lr_column(study) not in runs:
        raise StudyError(f"{study.data_path.name}: runs without a study case or lr")
    runs = with_repriced_totals(study, runs)
    selection = selection_of(study, runs)
    found = horizons(study, runs, metrics)
    report = StudyReport(study, header, runs, metrics, selection, found, include_failed)
    counts = runs["status"].value_counts()
    order = [*(s for s in STATUSES if s in counts), *sorted(set(counts.index) - set(STATUSES))]
    report.notes.append(f"{len(runs)} runs: " + ", ".join(f"{counts[s]} {s}" for s in order))
    seeds = sorted(int(s) for s in runs["cfg.seed"].dropna().unique())
    tuning = [s for s in study.selection_seeds if s in seeds]
    final = [s for s in study.final_seeds if s in seeds]
    if untuned(study):
        report.notes.append(
            f"seeds {','.join(map(str, seeds))} at each case's one lr: nothing selected, every "
            "seed's run in the results tables"
        )
    else:
        report.notes.append(
            f"seeds {','.join(map(str, seeds))}: selected on seeds {','.join(map(str, tuning))} "
            f"only (the tuning seeds)"
            + (
                f"; the final seeds {','.join(map(str, final))} ran at the selected lr and alone "
                "make the results tables"
                if final
                else "; no final seeds: the results tables "
                "show the tuning seeds' own values, which the selection favours"
            )
        )
    if len(study.selection_seeds) < 2:
        report.notes.append(
            "one tuning seed: below the rule of ≥ 2 this harness now requires to run a study; "
            "the standard errors come from the validation split alone"
        )
    finished = runs[runs["status"] == FINISHED]
    report.notes += duplicate_seed_notes(
        finished, ["case", *tuned_columns(study, finished)], "cfg.seed"
    )
    if header.get("source"):
        report.notes.append(f"run data: {header['source']}")
    report.notes += summary_sentences(report)
    return report


REPRICED = "comm/modeled_s@"


def with_repriced_totals(study: Study, runs):
    """`runs` with a column `comm/modeled_s@<preset>` for each such name in the study's
    `metrics`: every run's modeled communication seconds in all, its op table priced on that
    preset (`analysis.timing.repriced_totals`)."""
    from dpresearch.analysis.timing import repriced_totals

    for name in study.metrics:
        if not name.startswith(REPRICED) or name in runs or "comm/ops" not in runs:
            continue
        totals = runs["run"].map(repriced_totals(runs, name[len(REPRICED) :]))
        runs = runs.assign(**{name: totals.astype(float)})
    return runs


# -- output --------------------------------------------------------------------------------------
def _horizon_sentence(report: StudyReport) -> str:
    study, runs = report.study, report.runs
    epochs = runs["epoch"].dropna() if "epoch" in runs else []
    steps = runs["total_steps"].dropna() if "total_steps" in runs else []
    length = (f"{float(max(epochs)):g} epochs" if len(epochs) else "their own length") + (
        f" ({int(max(steps))} steps)" if len(steps) else ""
    )
    if study.claim and study.claim.horizons:
        from dpresearch.study.select import horizon_unit

        unit = horizon_unit(study.claim.horizon_key)
        hs = [f"{h:g}" for h in study.claim.horizons]
        column = runs.get("cfg.schedule._target_")
        schedule = (
            str(column.dropna().iloc[0]) if column is not None and column.notna().any() else ""
        )
        prefix = (
            f"the schedule is constant after its warm-up, so a run's first h {unit} are a run "
            f"of h {unit} (the same runs serve every horizon; each horizon selects its own lr)"
            if schedule.endswith("Constant")
            else f"the schedule ({schedule.rsplit('.', 1)[-1] or 'not recorded'}) may depend on "
            f"the run length: a value at h {unit} of a longer run need not be that of a run of "
            f"h {unit}"
        )
        window = study.claim.window
        averaged = (
            f" Each metric at a horizon h is the mean of its values logged in the last "
            f"{window:.0%} of it, (h·{1 - window:g}, h] (one evaluation at a constant lr "
            "scatters by several points)."
            if window
            else ""
        )
        return (
            f"**Horizons:** {', '.join(hs[:-1])}{' and ' if len(hs) > 1 else ''}{hs[-1]} {unit} "
            f"of runs {length} long; {prefix}.{averaged} Nothing here is concluded about "
            f"training longer than {hs[-1]} {unit}."
        )
    return (
        f"**Horizon:** every result is at the end of runs {length} long; nothing here is "
        "concluded about training longer."
    )


def describe(report: StudyReport) -> list[str]:
    study, selection = report.study, report.selection
    lines = []
    if study.claim:
        lines.append(f"**Claim tested:** {study.claim.statement}")
    lines.append(_horizon_sentence(report))
    examples = examples_behind(report.runs, selection.metric)
    se_rule = "the seeds' spread s/√n" + (
        f" combined with the binomial error √(p(1−p)/N) of the {int(examples)}-example split "
        "it is measured on (the same split in every seed, so averaging seeds cannot remove "
        "it)"
        if examples
        else ""
    )
    if untuned(study):
        lines.append(
            "**Selection:** none: every case runs at one lr (no grid), so no run is chosen over "
            "another and every seed's run enters the results."
        )
        lines += _results_and_bytes(report, "over the seeds at the case's one lr (`n` runs)")
        return lines
    lines.append(
        f"**Selection:** per case, the lr with the {selection.describe()}, on the tuning seeds "
        f"only; beside it its standard error ({se_rule}). A choice won by less than the "
        'standard error of the difference to the runner-up is marked "within noise". An lr '
        "at which a seed diverged or did not train is never preferred."
    )
    if all(c.grid.extend == 0 for c in study.cases if c.lr_from is None):
        lines.append(
            "**Grids:** as listed; this study allowed no grid extension (`extend: 0`), so a "
            'pick at the smallest or largest lr tried says "bound reached": its optimum may '
            "lie beyond the grid."
        )
    else:
        lines.append(
            "**Grids:** log-spaced; where a pick is the smallest or largest lr tried, the "
            "harness adds the next grid value beyond it on the tuning seeds, again until the "
            "pick is interior or the case's bound is reached, before any final seed runs. A "
            'pick still at an edge says "bound reached".'
        )
    if study.also_keys:
        keys = ", ".join(f"`{k}`" for k in study.also_keys)
        lines.append(
            f"**Two keys:** the cases that tune {keys} beside the lr do so on a joint grid (every "
            "lr × every value) and select the best pair; per key, the runner-up is the best pair "
            'with another value of that key, and "within noise" and "bound reached" are stated '
            "per key. A key whose pick is at an edge grows past it as the lr does, the new value "
            "crossed with every value of the other key tried; the final seeds run at the pair."
        )
    lines += _results_and_bytes(
        report,
        "over the final seeds at the selected lr (`n` runs), never averaged with the tuning seeds",
    )
    return lines


def _results_and_bytes(report: StudyReport, averaged: str) -> list[str]:
    """The Results, Bytes and Verdicts paragraphs; `averaged`: what a results row is a mean
    over."""
    study = report.study
    lines = [
        f"**Results:** mean ± sample standard deviation {averaged}; accuracy in %. A run whose "
        "final training loss is above its first logged one, unless its test loss fell and ended "
        "below a uniform prediction's, ln(classes) (a gossip worker's logged loss is its local "
        "one, not the evaluated model's), or whose test accuracy is within two binomial "
        'standard errors of chance, is shown as "did not train", a non-finite loss as '
        '"diverged"; neither enters a mean.'
        + (
            " (here diverged and unfinished runs are included: --include-failed.)"
            if report.include_failed
            else ""
        )
    ]
    if "comm/bytes_per_epoch" in report.runs:
        lines.append(
            "**Bytes:** MB = 10⁶ bytes of `comm/bytes`, the algorithm's payload a worker sent "
            "(gradients as compressed, models, gossip messages), mean over workers; BatchNorm-"
            "buffer broadcasts (`comm/bytes_buffers`), evaluation and metric traffic are "
            "counted apart and not included."
        )
    if study.claim and study.claim.expect:
        lines.append(
            f"**Verdicts:** an expectation holds where the difference of the final seeds' means "
            f"of `{study.claim.metric}` exceeds {Z:g} standard errors of the difference (each "
            "side's SE as above, on the test split), does not hold where it is below minus "
            f"{Z:g}, and is unresolved otherwise."
        )
    return lines


def published_markdown(frame) -> list[str]:
    """Published rows like for like with the case they name (no `differs`) in one table, and
    rows in another setting (their `differs` says what; or no case of ours) in a second table
    with what differs beside the nearest case, so no number sits beside a case it was not
    measured in (`analysis.published.split_by_setting`)."""
    from dpresearch.analysis.published import DIFFERS, split_by_setting

    if frame is None or frame.empty:
        return []
    same, other = split_by_setting(frame)
    shown = [c for c in frame.columns if c not in ("note", DIFFERS)]
    lines = []
    if not same.empty:
        lines += [
            "## Published numbers in our case's setting (their scale, their units — not "
            "comparable to ours)",
            "",
            markdown_table(same, shown),
            "",
        ]
    if not other.empty:
        first = ["case", DIFFERS] if "case" in frame else [DIFFERS]
        columns = [*first, *(c for c in shown if c not in first)]
        other = other.assign(**{DIFFERS: other.get(DIFFERS, "")})
        lines += [
            "## Published, other setting (what differs from our nearest case named; not "
            "beside our cases)",
            "",
            markdown_table(
                other, columns, headers={"case": "nearest case of ours", DIFFERS: "what differs"}
            ),
            "",
        ]
    if "note" in frame:
        lines += [f"- {n}" for n in frame["note"] if n] + [""]
    return lines


def render(report: StudyReport, plots: Sequence[tuple[Path, Any]], command: str) -> str:
    study = report.study
    lines = [f"# {study.title}", ""]
    if study.description:
        lines += [study.description.strip(), ""]
    lines += [
        f"Generated by `{command}` from {len(report.runs)} runs shipped in "
        f"`{study.data_path.name}` (do not edit by hand).",
        "",
    ]
    for line in describe(report):
        lines += [line, ""]
    if study.claim and study.claim.expect:
        frame = claim_frame(report)
        lines += [
            "## Claim: which result holds at which horizon",
            "",
            markdown_table(frame, list(frame.columns)),
            "",
        ]
    for horizon in report.horizons:
        shown, _ = results_frame(report, horizon)
        grid = grid_frame(report, horizon)
        title = "Results" if len(report.horizons) == 1 else f"Results at {horizon.label}"
        lines += [f"## {title}", "", markdown_table(shown, list(shown.columns)), ""]
        at = "" if len(report.horizons) == 1 else f" at {horizon.label}"
        lines += [
            f"Every run{at}, by case (one lr each, nothing selected):"
            if untuned(study)
            else f"Every lr tried{at} (tuning and final seeds apart):",
            "",
            markdown_table(grid, list(grid.columns)),
            "",
        ]
    lines += published_markdown(published_frame(study))
    failed = report.runs[report.runs["status"] != FINISHED]
    if not failed.empty:
        cols = [
            c
            for c in (
                "run",
                "status",
                "case",
                *tuned_columns(study),
                "cfg.seed",
                "step",
                "epoch",
                "train/loss",
            )
            if c in failed
        ]
        frame = failed.copy()
        if "train/loss" in frame:
            frame["train/loss"] = frame["train/loss"].map(
                lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
            )
        lines += [
            "## Runs that did not finish or did not train",
            "",
            markdown_table(
                frame,
                cols,
                {"step": ".0f", "epoch": "g"},
                {c: c.removeprefix("cfg.") for c in cols},
            ),
            "",
        ]
    lines += ["## Notes", "", *(f"- {n}" for n in report.notes), ""]
    if plots:
        from dpresearch.analysis.report import figure_lines

        captions = [fig.dpresearch_caption for _, fig in plots]
        lines += ["## Plots", "", *figure_lines([p for p, _ in plots], captions), ""]
    return "\n".join(lines)


def write(report: StudyReport, results: Path, command: str) -> tuple[Path, list]:
    """results.md, results.csv (every horizon, raw numbers), table(_<h>).{md,tex}, grid.csv,
    runs.csv and the plots; returns (results.md, [(plot path, figure)])."""
    import pandas as pd

    from dpresearch.analysis.tables import csv_table

    results.mkdir(parents=True, exist_ok=True)
    raws, grids = [], []
    for horizon in report.horizons:
        shown, raw = results_frame(report, horizon)
        raws.append(raw)
        grid = grid_frame(report, horizon)
        grid.insert(0, "horizon", horizon.label)
        grids.append(grid)
        stem = "table" if len(report.horizons) == 1 else "table_" + slug(horizon.label)
        (results / f"{stem}.md").write_text(markdown_table(shown, list(shown.columns)) + "\n")
        caption = f"{report.study.title} — {horizon.label}"
        (results / f"{stem}.tex").write_text(
            latex_table(shown, list(shown.columns), caption=caption) + "\n"
        )
    raw = pd.concat(raws, ignore_index=True)
    (results / "results.csv").write_text(
        csv_table(raw, [c for c in raw.columns if not c.endswith(" std")])
    )
    grid = pd.concat(grids, ignore_index=True)
    (results / "grid.csv").write_text(grid.to_csv(index=False))
    run_cols = [
        c
        for c in (
            "run",
            "status",
            "case",
            *tuned_columns(report.study),
            "cfg.seed",
            "epoch",
            "step",
            *result_metrics(report),
            "val/acc",
            "comm/bytes_per_epoch",
            "time/wall_s",
        )
        if c in report.runs
    ]
    report.runs[list(dict.fromkeys(run_cols))].to_csv(results / "runs.csv", index=False)
    plots = plot_files(report, results)
    path = results / "results.md"
    path.write_text(render(report, plots, command))
    return path, plots


def selected_lrs(study: Study, out: str | Path) -> dict[str, float]:
    """Each case's lr selected at the study's last horizon, from the runs under `out/runs`
    (the launcher's and the report's rule); a case with nothing selectable is left out."""
    from dpresearch.study.launcher import study_horizons

    found = study_horizons(study, out)
    return {case: pick.lr for case, pick in found[-1].picks.items()} if found else {}


def _wandb_settings(runs) -> dict | None:
    """project/mode of the study's W&B logger when its runs had it on, else None."""
    if "cfg.logger.wandb" not in runs:
        return None
    on = runs["cfg.logger.wandb"].fillna(False).astype(bool)
    if not on.any():
        return None
    first = runs[on].iloc[0]
    mode = first.get("cfg.logger.mode")
    return {
        "project": first.get("cfg.logger.project") or "dpresearch",
        "mode": mode if isinstance(mode, str) else None,
    }


def report_study(
    study: Study,
    out: str | Path,
    results: str | Path | None = None,
    include_failed: bool = False,
    command: str = "",
    wandb: bool | None = None,
) -> Path:
    """Pack the runs under `out/runs` (if any) into the study's run data, then write
    results.md and the rest into `results` (default: the study's results folder) from that
    file alone; log the results table as a `wandb.Table` (group = the study) when the runs
    logged to W&B (`wandb` None) or when asked."""
    pack_study(study, out)
    if not study.data_path.exists():
        raise StudyError(
            f"no runs under {Path(out) / 'runs'} and no shipped run data "
            f"{relative(study.data_path)}; run the study first"
        )
    header, runs, metrics = load_data(study)
    report = build(study, header, runs, metrics, include_failed)
    command = command or f"python -m dpresearch.study report {shlex.quote(relative(study.path))}"
    path, _ = write(report, Path(results or study.results_dir), command)
    settings = _wandb_settings(runs) if wandb is None else ({} if wandb else None)
    if settings is not None:
        from dpresearch.analysis.wandb_table import log_table

        _, raw = results_frame(report, report.last)
        name = slug(study.name)
        log_table(raw, list(raw.columns), key=f"{name}/results", group=name, **settings)
    return path
