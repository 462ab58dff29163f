"""The cells and frames of a study report's tables: each case's results row at a horizon
(`results_frame`, on the final seeds at its pick), the selection grid (`grid_frame`), the
published numbers (`published_frame`), and the cells they share (mean ± std, the pick's note,
a setting's label). The rules they follow are `study.report`'s module docstring."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dpresearch.analysis.quality import is_accuracy, standard_error
from dpresearch.analysis.runs import FINISHED
from dpresearch.analysis.tables import (
    MISSING,
    mean_std,
    megabytes,
    percent,
    significant,
    with_spread,
)
from dpresearch.study.select import (
    Horizon,
    Pick,
    case_columns,
    examples_behind,
    setting_of,
    untuned,
)
from dpresearch.study.spec import Study, StudyError

if TYPE_CHECKING:
    from dpresearch.study.report import StudyReport


MB = 1e6


def final_runs(report: StudyReport, horizon: Horizon, case: str, pick: Pick):
    """The runs a case's results row averages: the final seeds at the pick's setting (a case
    reusing another's lr: all its seeds; no final seeds: the tuning seeds)."""
    study, runs = report.study, horizon.runs
    rows = runs[runs["case"] == case]
    for column, value in zip(case_columns(study, case), pick.setting, strict=True):
        rows = rows[rows[column] == value]
    seeds = study.final_seeds or study.selection_seeds
    return rows[rows["cfg.seed"].isin(list(seeds))]


def pick_for(horizon: Horizon, study: Study, case: str) -> Pick | None:
    return horizon.picks.get(study.case(case).lr_from or case)


def _statuses(rows) -> str:
    failed = rows[rows["status"] != FINISHED]["status"].value_counts()
    return ", ".join(f"{n} {s}" for s, n in failed.items())


def _failed_text(rows) -> str:
    kinds = set(rows["status"]) - {FINISHED}
    return "/".join(sorted(kinds)) if kinds else MISSING


def mean_cell(rows, metric: str, include_failed: bool, fmt) -> tuple[str, float, float, int]:
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


def setting_label(study: Study, case: str, setting: Sequence[float]) -> str:
    """`lr 0.1`, or `lr 0.1, outer.optimizer.lr 0.7` (a plot's series)."""
    also = [f", {k} {v:g}" for k, v in _also_values(study, case, setting).items() if v != MISSING]
    return f"lr {setting[0]:g}" + "".join(also)


def raw_label(study: Study, raw: dict) -> str:
    """`setting_label` of a results.csv row."""
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
        pick = pick_for(horizon, study, case.name)
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
        rows = final_runs(report, horizon, case.name, pick)
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
            text, mean, std, n_m = mean_cell(rows, m, report.include_failed, _fmt_for(m))
            row[_metric_head(m, study.labels)] = text
            values.update({m: mean, f"{m} std": std})
            n = max(n, n_m)
        per_epoch = "comm/bytes_per_epoch"
        if per_epoch in rows:
            text, mean, _, _ = mean_cell(
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
    """Every lr tried, tuning seeds and final seeds in separate columns (strings); in a study
    that selects nothing (`untuned`), every seed's runs under plain heads ("seeds", the
    metrics as mean ± std), with no selected column: no seed there tunes anything."""
    import pandas as pd

    study, metric = report.study, report.selection.metric
    runs = horizon.runs
    main = study.claim.metric if study.claim else study.target_metric
    plain = untuned(study)

    def head(role: str, column: str) -> str:
        return column if plain else f"{role}: {column}"

    rows = []
    for case in study.cases:
        frame = runs[runs["case"] == case.name]
        if frame.empty:  # a study still running: this case has no run yet
            continue
        pick = pick_for(horizon, study, case.name)
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
            parts = (("", at),) if plain else (("tuning", tuning), ("final", final))
            for name, part in parts:
                seeds = ",".join(str(int(s)) for s in sorted(part["cfg.seed"]))
                row[f"{name} seeds".strip()] = seeds or MISSING
                text, mean, std, n = mean_cell(
                    part, metric, report.include_failed, _fmt_for(metric)
                )
                if name == "tuning" and n:
                    se = standard_error(mean, std, n, examples_behind(runs, metric))
                    text = f"{_pm(mean, se, metric)} (SE)" if math.isfinite(se) else text
                row[head(name, metric)] = text if len(part) else MISSING
                if main != metric:
                    row[head(name, main)] = (
                        mean_cell(part, main, report.include_failed, _fmt_for(main))[0]
                        if len(part)
                        else MISSING
                    )
                failed = _statuses(part)
                row[head(name, "not usable")] = failed
            if not plain:
                row["selected"] = "✓" if pick is not None and pick.setting == setting else ""
            rows.append(row)
    frame = pd.DataFrame(rows)
    for column in ("not usable",) if plain else ("tuning: not usable", "final: not usable"):
        if column in frame and not frame[column].astype(bool).any():
            frame = frame.drop(columns=column)
    return frame


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


def _selection_head(study: Study, metric: str) -> str:
    """The results table's column of the selection metric: what selected each case's lr, or,
    in a study that selects nothing, that metric over every seed of the case."""
    head = _metric_head(metric, study.labels)
    return f"{head}, every seed" if untuned(study) else f"selection: {head}"
