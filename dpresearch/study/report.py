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
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpresearch import SOURCE_ROOT
from dpresearch.analysis.aggregate import Selection, default_mode, duplicate_seed_notes
from dpresearch.analysis.errors import AnalysisError
from dpresearch.analysis.quality import is_accuracy, mark_untrained, standard_error
from dpresearch.analysis.runs import FINISHED, STATUSES, find_runs
from dpresearch.analysis.tables import (
    MISSING,
    latex_table,
    markdown_table,
    mean_std,
    megabytes,
    percent,
    significant,
    with_spread,
)
from dpresearch.study.counts import summary_sentences
from dpresearch.study.select import (
    Horizon,
    Pick,
    case_columns,
    examples_behind,
    horizons,
    lr_column,
    selection_of,
    setting_of,
    tuned_columns,
    untuned,
)
from dpresearch.study.spec import Study, StudyError, slug

MB = 1e6
FINAL_RUNS = "final seeds at its selected lr"  # what a plotted case averages
Z = 2.0  # a claim holds where the difference exceeds Z standard errors


# -- run data ------------------------------------------------------------------------------------
def pack_study(study: Study, out: str | Path) -> Path | None:
    """Pack the run directories under `out/runs` into the study's run-data file (None when
    there are none: the shipped file stays as it is)."""
    from dpresearch.analysis.rundata import pack_runs

    out = Path(out)
    paths = find_runs([out / "runs"])
    if not paths:
        return None
    return pack_runs(paths, out, study.data_path, study.curves, {"study": study.name})


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
    report.notes += duplicate_seed_notes(finished, ["case", lr_column(study)], "cfg.seed")
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


def _final_runs(report: StudyReport, horizon: Horizon, case: str, pick: Pick):
    """The runs a case's results row averages: the final seeds at the pick's setting (a case
    reusing another's lr: all its seeds; no final seeds: the tuning seeds)."""
    study, runs = report.study, horizon.runs
    rows = runs[runs["case"] == case]
    for column, value in zip(case_columns(study, case), pick.setting, strict=True):
        rows = rows[rows[column] == value]
    seeds = study.final_seeds or study.selection_seeds
    return rows[rows["cfg.seed"].isin(list(seeds))]


def _pick_for(horizon: Horizon, study: Study, case: str) -> Pick | None:
    return horizon.picks.get(study.case(case).lr_from or case)


def _statuses(rows) -> str:
    failed = rows[rows["status"] != FINISHED]["status"].value_counts()
    return ", ".join(f"{n} {s}" for s, n in failed.items())


def _failed_text(rows) -> str:
    kinds = set(rows["status"]) - {FINISHED}
    return "/".join(sorted(kinds)) if kinds else MISSING


def _mean_cell(rows, metric: str, include_failed: bool, fmt) -> tuple[str, float, float, int]:
    """(cell text "mean ± std", mean, std, n) over the finished rows (all with
    include_failed); the failure status when none is usable."""
    import pandas as pd

    usable = rows if include_failed else rows[rows["status"] == FINISHED]
    values = pd.to_numeric(usable[metric], errors="coerce").dropna() if metric in usable else []
    if len(values) == 0:
        return (_failed_text(rows) if len(rows) else MISSING), math.nan, math.nan, 0
    mean = float(values.mean())
    std = float(values.std(ddof=1)) if len(values) > 1 else math.nan
    return mean_std(mean, std, fmt), mean, std, len(values)


def _fmt_for(metric: str):
    """Accuracies in % with one decimal; anything else None: three significant figures, the
    spread to the same decimal place (`with_spread`)."""
    return percent if is_accuracy(metric) else None


def _metric_head(metric: str, labels: dict[str, str] | None = None) -> str:
    from dpresearch.analysis.plots import axis_label

    return axis_label(metric, labels)[0]


def _pm(mean: float, se: float, metric: str) -> str:
    """ "mean ± SE" in the metric's format (SE "unknown" when it is not known)."""
    fmt = _fmt_for(metric)
    if fmt is None:
        return with_spread(mean, se) if math.isfinite(se) else f"{significant(mean)} ± unknown"
    return f"{fmt(mean)} ± {fmt(se) if math.isfinite(se) else 'unknown'}"


def _one(value: float, metric: str) -> str:
    fmt = _fmt_for(metric)
    return significant(value, 2) if fmt is None else fmt(value)


def _selection_cell(pick: Pick, metric: str) -> str:
    return f"{_pm(pick.value, pick.se, metric)} (n={pick.n})"


def _pick_note(pick: Pick, metric: str, study: Study) -> str:
    """Per tuned key (the lr first): an edge pick, and a choice won within noise."""
    case = study.case(pick.case)
    grids = [case.grid, *(grid for _, grid in case.also)]
    notes = []
    for axis, grid in zip(pick.axes, grids, strict=True):
        name = "lr" if axis.key == study.lr_key else axis.key
        if axis.edge:
            notes.append(
                f"{axis.edge} {name} tried: bound reached ({grid.describe()})"
                if axis.bound_reached
                else f"{axis.edge} {name} tried: the grid is still being extended"
            )
        if axis.runner_up is not None and axis.close:
            se = _one(axis.margin_se, metric) if math.isfinite(axis.margin_se) else "unknown"
            notes.append(
                f"won by {_one(axis.margin, metric)} < SE {se} over {name} "
                f"{axis.runner_up:g}: within noise"
            )
    return "; ".join(notes)


def _also_values(study: Study, case: str, setting: Sequence[float]) -> dict[str, Any]:
    """Each `tune_also` key of the study → the setting's value of it (MISSING where the case
    does not tune it)."""
    columns = case_columns(study, case)[1:]
    mine = dict(zip((c.removeprefix("cfg.") for c in columns), setting[1:], strict=True))
    return {key: mine.get(key, MISSING) for key in study.also_keys}


def _setting_label(study: Study, case: str, setting: Sequence[float]) -> str:
    """`lr 0.1`, or `lr 0.1, outer.optimizer.lr 0.7` (a plot's series)."""
    also = [f", {k} {v:g}" for k, v in _also_values(study, case, setting).items() if v != MISSING]
    return f"lr {setting[0]:g}" + "".join(also)


def _raw_label(study: Study, raw: dict) -> str:
    """`_setting_label` of a results.csv row."""
    also = [f", {k} {raw[k]:g}" for k in study.also_keys if math.isfinite(raw.get(k, math.nan))]
    return f"lr {raw['lr']:g}" + "".join(also)


RESULT_METRICS = ("test/acc", "train/loss")


def _lr_head(study: Study) -> str:
    """The tables' lr column: "lr", or the key it sets where that is not the optimizer's lr
    (a study of the outer lr)."""
    return "lr" if study.lr_key == "optimizer.lr" else f"lr ({study.lr_key})"


def result_metrics(report: StudyReport) -> list[str]:
    study, runs = report.study, report.runs
    wanted = [study.claim.metric] if study.claim else []
    wanted += [study.target_metric, *RESULT_METRICS, *study.metrics]
    return [m for m in dict.fromkeys(wanted) if m in runs]


def results_frame(report: StudyReport, horizon: Horizon):
    """(shown strings, raw numbers) of the results table at `horizon`: one row per case."""
    import pandas as pd

    study, metric = report.study, report.selection.metric
    metrics = result_metrics(report)
    shown, raw = [], []
    for case in study.cases:
        pick = _pick_for(horizon, study, case.name)
        row = {"case": case.name}
        values: dict[str, Any] = {"case": case.name, "horizon": horizon.epochs}
        if pick is None:
            row.update(
                {
                    _lr_head(study): MISSING,
                    **dict.fromkeys(study.also_keys, MISSING),
                    _selection_head(study, metric): MISSING,
                }
            )
            rows = horizon.runs[horizon.runs["case"] == case.name]
            for m in metrics:
                row[_metric_head(m, study.labels)] = _failed_text(rows) if len(rows) else "not run"
            row["MB sent per worker per epoch"] = MISSING
            row["n"] = "0"
            row["note"] = "no lr could be selected" if len(rows) else "not run"
            shown.append(row)
            raw.append(values)
            continue
        rows = _final_runs(report, horizon, case.name, pick)
        row[_lr_head(study)] = f"{pick.lr:g}"
        values["lr"] = pick.lr
        for key, value in _also_values(study, case.name, pick.setting).items():
            row[key] = value if value == MISSING else f"{value:g}"
            values[key] = math.nan if value == MISSING else value
        row[_selection_head(study, metric)] = (
            _selection_cell(pick, metric) if case.lr_from is None else f"lr of {case.lr_from}"
        )
        values.update({"selection_mean": pick.value, "selection_se": pick.se})
        n = 0
        for m in metrics:
            text, mean, std, n_m = _mean_cell(rows, m, report.include_failed, _fmt_for(m))
            row[_metric_head(m, study.labels)] = text
            values.update({m: mean, f"{m} std": std})
            n = max(n, n_m)
        per_epoch = "comm/bytes_per_epoch"
        if per_epoch in rows:
            text, mean, _, _ = _mean_cell(
                rows, per_epoch, report.include_failed, lambda v: megabytes(v / MB)
            )
            row["MB sent per worker per epoch"] = text.split(" ± ")[0]
            values["MB_per_epoch"] = mean / MB if math.isfinite(mean) else math.nan
        row["n"] = f"{n}/{len(rows)}" if n != len(rows) else str(n)
        values["n"] = n
        notes = [_pick_note(pick, metric, study)] if case.lr_from is None else []
        failed = _statuses(rows)
        if failed:
            notes.append(failed)
        if not len(rows):
            notes.append("final seeds not run yet")
        row["note"] = "; ".join(x for x in notes if x)
        shown.append(row)
        raw.append(values)
    return pd.DataFrame(shown), pd.DataFrame(raw)


def grid_frame(report: StudyReport, horizon: Horizon):
    """Every lr tried, tuning seeds and final seeds in separate columns (strings)."""
    import pandas as pd

    study, metric = report.study, report.selection.metric
    runs = horizon.runs
    main = study.claim.metric if study.claim else study.target_metric
    rows = []
    for case in study.cases:
        frame = runs[runs["case"] == case.name]
        pick = _pick_for(horizon, study, case.name)
        columns = case_columns(study, case.name)
        tried = frame[columns].dropna().drop_duplicates()
        for setting in sorted(setting_of(r, columns) for _, r in tried.iterrows()):
            at = frame
            for column, value in zip(columns, setting, strict=True):
                at = at[at[column] == value]
            tuning = at[at["cfg.seed"].isin(list(study.selection_seeds))]
            final = at[~at["cfg.seed"].isin(list(study.selection_seeds))]
            if case.lr_from is not None:
                tuning, final = tuning.iloc[:0], at
            row = {"case": case.name, _lr_head(study): f"{setting[0]:g}"}
            for key, value in _also_values(study, case.name, setting).items():
                row[key] = value if value == MISSING else f"{value:g}"
            for name, part in (("tuning", tuning), ("final", final)):
                seeds = ",".join(str(int(s)) for s in sorted(part["cfg.seed"]))
                row[f"{name} seeds"] = seeds or MISSING
                text, mean, std, n = _mean_cell(
                    part, metric, report.include_failed, _fmt_for(metric)
                )
                if name == "tuning" and n:
                    se = standard_error(mean, std, n, examples_behind(runs, metric))
                    text = f"{_pm(mean, se, metric)} (SE)" if math.isfinite(se) else text
                row[f"{name}: {metric}"] = text if len(part) else MISSING
                if main != metric:
                    row[f"{name}: {main}"] = (
                        _mean_cell(part, main, report.include_failed, _fmt_for(main))[0]
                        if len(part)
                        else MISSING
                    )
                failed = _statuses(part)
                row[f"{name}: not usable"] = failed
            row["selected"] = "✓" if pick is not None and pick.setting == setting else ""
            rows.append(row)
    frame = pd.DataFrame(rows)
    for name in ("tuning", "final"):
        column = f"{name}: not usable"
        if column in frame and not frame[column].astype(bool).any():
            frame = frame.drop(columns=column)
    return frame


def _side(report: StudyReport, horizon: Horizon, case: str, metric: str):
    """(mean, SE, n, failure text) of a case's results row on `metric`."""
    pick = _pick_for(horizon, report.study, case)
    if pick is None:
        return math.nan, math.nan, 0, "no lr selected"
    rows = _final_runs(report, horizon, case, pick)
    text, mean, std, n = _mean_cell(rows, metric, report.include_failed, str)
    se = standard_error(mean, std, n, examples_behind(horizon.runs, metric))
    return mean, se, n, ("" if n else (text if len(rows) else "not run"))


def verdict(report: StudyReport, horizon: Horizon, expectation) -> str:
    """One expectation judged at one horizon (see the module docstring)."""
    study = report.study
    metric = study.claim.metric
    a, se_a, n_a, why_a = _side(report, horizon, expectation.case, metric)
    b, se_b, n_b, why_b = _side(report, horizon, expectation.other, metric)
    if not n_a or not n_b:
        if not n_a and n_b and why_a in ("diverged", "did not train", "diverged/did not train"):
            return f"does not hold ({expectation.case}: {why_a})"
        if n_a and not n_b and why_b in ("diverged", "did not train", "diverged/did not train"):
            return f"holds ({expectation.other}: {why_b})"
        return "not testable (" + "; ".join(x for x in (why_a, why_b) if x) + ")"
    diff = (a - b) if default_mode(metric) == "max" else (b - a)  # > 0: `case` is better
    se = math.hypot(se_a, se_b) if math.isfinite(se_a) and math.isfinite(se_b) else math.nan
    if is_accuracy(metric):
        text = (
            f"{100 * diff:+.1f}" + (f" ± {100 * se:.1f}" if math.isfinite(se) else "") + " points"
        )
    else:
        text = f"{diff:+.3g} ± {se:.2g}" if math.isfinite(se) else f"{diff:+.3g}"
    if not math.isfinite(se):
        text += ", SE unknown"
    if min(n_a, n_b) == 1:  # the SE holds no seed-to-seed spread: the verdict says so
        text += ", one final seed"
    if not math.isfinite(se):
        return f"unresolved ({text})"
    low = -expectation.within if expectation.within is not None else 0.0
    if diff - Z * se > low:
        return f"holds ({text})"
    if diff + Z * se < low:
        return f"does not hold ({text})"
    return f"unresolved ({text})"


def claim_frame(report: StudyReport):
    import pandas as pd

    study = report.study
    rows = []
    for expectation in study.claim.expect:
        row = {"expectation": expectation.describe(study.claim.metric)}
        for horizon in report.horizons:
            row[f"at {horizon.label}"] = verdict(report, horizon, expectation)
        rows.append(row)
    return pd.DataFrame(rows)


# -- published numbers ---------------------------------------------------------------------------
PUBLISHED_REQUIRED = ("value", "unit", "source")


def published_frame(study: Study):
    """The study's published numbers (a CSV beside it), checked: every row has a value, a
    unit and a source; shown as they are, in a table of their own. `case` names the study's
    case a row sits beside (empty: context); rows naming a case this study does not have
    belong to another study reading the same file and are left out."""
    import pandas as pd

    if not study.published:
        return None
    path = study.path.parent / study.published["file"]
    if not path.exists():
        raise StudyError(f"published-numbers file {path} does not exist")
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    missing = [c for c in PUBLISHED_REQUIRED if c not in frame]
    if missing:
        raise StudyError(
            f"{path.name} needs the columns {', '.join(PUBLISHED_REQUIRED)}; "
            f"missing {', '.join(missing)}"
        )
    for i, row in frame.iterrows():
        empty = [c for c in PUBLISHED_REQUIRED if not str(row[c]).strip()]
        if empty:
            raise StudyError(f"{path.name} row {i + 2}: no {', '.join(empty)}")
    if "case" in frame:  # rows for cases another study of the same file has are left out
        names = {c.name for c in study.cases}
        frame = frame[frame["case"].isin(names) | (frame["case"] == "")]
    return frame


# -- output --------------------------------------------------------------------------------------
def _horizon_sentence(report: StudyReport) -> str:
    study, runs = report.study, report.runs
    epochs = runs["epoch"].dropna() if "epoch" in runs else []
    steps = runs["total_steps"].dropna() if "total_steps" in runs else []
    length = (f"{float(max(epochs)):g} epochs" if len(epochs) else "their own length") + (
        f" ({int(max(steps))} steps)" if len(steps) else ""
    )
    if study.claim and study.claim.horizons:
        from dpresearch.study.select import HORIZON_UNITS

        unit = HORIZON_UNITS.get(study.claim.horizon_key, study.claim.horizon_key)
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


def _selection_head(study: Study, metric: str) -> str:
    """The results table's column of the selection metric: what selected each case's lr, or,
    in a study that selects nothing, that metric over every seed of the case."""
    head = _metric_head(metric, study.labels)
    return f"{head}, every seed" if untuned(study) else f"selection: {head}"


def _results_and_bytes(report: StudyReport, averaged: str) -> list[str]:
    """The Results, Bytes and Verdicts paragraphs; `averaged`: what a results row is a mean
    over."""
    study = report.study
    lines = [
        f"**Results:** mean ± sample standard deviation {averaged}; accuracy in %. A run whose "
        "final training loss is above its first logged one while its test loss did not fall "
        "(a gossip worker's logged loss is its local one, not the evaluated model's), or whose "
        "test accuracy is within two binomial standard errors of chance, is shown as "
        '"did not train", a non-finite loss as "diverged"; neither enters a mean.'
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


def plot_files(report: StudyReport, out: Path) -> list[tuple[Path, Any]]:
    """Each case's final accuracy against its bytes per epoch (the last horizon), then curves
    of each case at its selected lr (the last horizon's pick, final seeds): accuracy and loss
    against epochs, bytes, modeled and simulated time; the study's extra curves against epochs.
    Returns (path, figure) pairs."""
    from dpresearch.analysis.plots import plot_groups, plot_points
    from dpresearch.analysis.timing import add_modeled_time, modeled_column

    study, horizon = report.study, report.last
    metrics = report.metrics
    for network in study.networks:
        metrics = add_modeled_time(metrics, report.runs, network)
    groups: dict[str, list[str]] = {}
    for case in study.cases:
        pick = _pick_for(horizon, study, case.name)
        if pick is None:
            continue
        rows = _final_runs(report, horizon, case.name, pick)
        rows = rows[rows["status"] == FINISHED] if not report.include_failed else rows
        if len(rows):
            groups[f"{case.name}, {_setting_label(study, case.name, pick.setting)}"] = list(
                rows["run"]
            )
    written = []
    _, raw = results_frame(report, horizon)
    main = study.claim.metric if study.claim else study.target_metric
    if "MB_per_epoch" in raw and main in raw:
        points = [
            (f"{r['case']}, {_raw_label(study, r)}", r["MB_per_epoch"], r[main], r[f"{main} std"])
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
        lines += [
            f"Every lr tried{'' if len(report.horizons) == 1 else f' at {horizon.label}'} "
            "(tuning and final seeds apart):",
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
