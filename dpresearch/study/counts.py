"""The counts a study's reading quotes, stated by its report (`summary_sentences`, in the
notes) so that no README types one by hand: the runs by role (`run_counts`), the grids grown
past their initial lrs (`grown_grids`), and per horizon how many picks are interior, at an edge
and won within noise (`pick_counts`); `tests/test_study_readme_counts.py` ties each to the run
data (issue 32: counts are generated, not typed)."""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import TYPE_CHECKING

from dpresearch.study.select import Horizon, case_columns, setting_of, untuned
from dpresearch.study.spec import Study

if TYPE_CHECKING:
    from dpresearch.study.report import StudyReport


@dataclass(frozen=True)
class PickCounts:
    """At one horizon (or summed over several): `tuned` cases with a grid of their own,
    `picks` of them with a selectable lr, `edge` picks at an edge of the lrs tried (`bound` of
    them with the bound reached), `close` picks won within noise."""

    tuned: int
    picks: int
    edge: int
    bound: int
    close: int

    @property
    def interior(self) -> int:
        return self.picks - self.edge

    def __add__(self, other: PickCounts) -> PickCounts:
        return PickCounts(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


def pick_counts(study: Study, horizon: Horizon) -> PickCounts:
    picks = horizon.picks.values()
    return PickCounts(
        sum(c.lr_from is None for c in study.cases),
        len(picks),
        sum(bool(p.edge) for p in picks),
        sum(p.bound_reached for p in picks),
        sum(p.close for p in picks),
    )


def run_counts(study: Study, runs) -> dict[str, int]:
    """How many runs did what: `grid` on the tuning seeds at their case's initial lrs,
    `extensions` on the tuning seeds at lrs a grid extension added, `final` the rest (the final
    seeds, and cases that reuse another case's lr)."""
    tuning = runs[runs["cfg.seed"].isin(list(study.selection_seeds))]
    own = {c.name: set(c.settings()) for c in study.cases if c.lr_from is None}
    tuned = tuning[tuning["case"].isin(own)]
    grid = sum(
        setting_of(row, case_columns(study, row["case"])) in own[row["case"]]
        for _, row in tuned.iterrows()
    )
    return {"grid": grid, "extensions": len(tuned) - grid, "final": len(runs) - len(tuned)}


def grown_grids(study: Study, runs) -> dict[str, tuple[int, int]]:
    """Each tuned case whose tuning seeds ran values beyond its initial grid → (how many above
    its largest initial lr, how many below its smallest; with `tune_also`, summed over the
    tuned keys)."""
    tuning = runs[runs["cfg.seed"].isin(list(study.selection_seeds))]
    out = {}
    for case in study.cases:
        if case.lr_from is not None or not case.lrs:
            continue
        ran = tuning[tuning["case"] == case.name]
        if ran.empty:  # a study still running: nothing tried yet (its columns may not exist)
            continue
        up = down = 0
        grids = [case.grid, *(grid for _, grid in case.also)]
        for grid, column in zip(grids, case_columns(study, case.name), strict=True):
            tried = {float(v) for v in ran[column].dropna()}
            up += sum(v > max(grid.values) for v in tried)
            down += sum(v < min(grid.values) for v in tried)
        if up or down:
            out[case.name] = (up, down)
    return out


def _picks_sentence(counts: PickCounts, where: str) -> str:
    n = counts.picks
    text = (
        f"picks{where}: {counts.interior} of {n} interior, {counts.edge} at an edge of the lrs "
        f"tried ({counts.bound} with the bound reached); {counts.close} of {n} won within noise"
    )
    missing = counts.tuned - n
    if missing > 0:
        text += f"; {missing} of {counts.tuned} tuned cases with no selectable lr"
    return text


def summary_sentences(report: StudyReport) -> list[str]:
    """The counts a reading quotes, stated by the report so that none is typed by hand: the
    runs by role, the grids grown, and the picks at each horizon (and over all of them)."""
    study = report.study
    if untuned(study):
        return [f"runs: {len(report.runs)}, every case at one lr (no grid, nothing selected)"]
    runs = run_counts(study, report.runs)
    grown = grown_grids(study, report.runs)
    tuned = sum(c.lr_from is None for c in study.cases)
    lines = [
        f"runs by role: {runs['grid']} on the tuning seeds at the initial grids' lrs, "
        f"{runs['extensions']} on the tuning seeds at lrs added by grid extensions, "
        f"{runs['final']} final-seed or reused-lr runs",
        f"grids grown past their initial lrs: {len(grown)} of {tuned} tuned cases "
        f"({sum(u > 0 for u, _ in grown.values())} upwards, "
        f"{sum(d > 0 for _, d in grown.values())} downwards)",
    ]
    counts = [pick_counts(study, h) for h in report.horizons]
    if len(counts) == 1:
        return [*lines, _picks_sentence(counts[0], "")]
    lines += [
        _picks_sentence(c, f" at {h.label}") for c, h in zip(counts, report.horizons, strict=True)
    ]
    total = sum(counts[1:], counts[0])
    lines.append(_picks_sentence(total, f" over the {len(counts)} horizons"))
    return lines
