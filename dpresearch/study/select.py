"""A study's learning-rate selection, at each horizon it states: one rule for the launcher
(which lrs to add, where the final seeds run) and the report (what it prints).

Per case and horizon, over the tuning seeds' runs only: the mean selection metric of every lr
tried, its standard error (`quality.standard_error`), the best lr among those where no seed
diverged or did not train, the runner-up, and whether the choice was won by less than the
standard error of the difference √(SE_best² + SE_second²) (`close`). A pick at the smallest or
largest lr tried is an edge: `next_lr` is the grid's next value beyond it, or None when the
bound is reached (`Grid.next_beyond`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dpresearch.analysis.aggregate import Selection, aggregate, choose_selection
from dpresearch.analysis.quality import at_horizon, examples_for, standard_error
from dpresearch.study.spec import Study


@dataclass(frozen=True)
class Pick:
    case: str
    lr: float
    value: float
    se: float
    n: int
    runner_up: float | None  # its lr
    margin: float  # |best − runner-up| on the metric (NaN without a runner-up)
    margin_se: float  # standard error of that difference
    edge: str  # "", "smallest" or "largest" of the lrs tried
    next_lr: float | None  # the grid's next value beyond an edge; None: bound reached

    @property
    def close(self) -> bool:
        """Won by less than the standard error of the difference (or by an unknown one)."""
        if self.runner_up is None:
            return False
        return not math.isfinite(self.margin_se) or self.margin < self.margin_se

    @property
    def bound_reached(self) -> bool:
        return bool(self.edge) and self.next_lr is None


HORIZON_UNITS = {"epoch": "epochs", "time/simulated_s": "simulated s", "step": "steps"}


@dataclass
class Horizon:
    """The study at one horizon: `epochs` None is the runs' own end."""

    epochs: float | None
    runs: Any  # runs frame at the horizon
    metrics: Any  # metrics cut at the horizon
    stats: Any  # per (case, lr): the tuning seeds' selection metric (mean, std, n, se)
    picks: dict[str, Pick]

    key: str = "epoch"

    @property
    def label(self) -> str:
        if self.epochs is None:
            return "the end of training"
        return f"{self.epochs:g} {HORIZON_UNITS.get(self.key, self.key)}"


def lr_column(study: Study) -> str:
    return f"cfg.{study.lr_key}"


def selection_of(study: Study, runs) -> Selection:
    return choose_selection(list(runs.columns), study.select)


def examples_behind(runs, metric: str) -> float | None:
    """How many examples stand behind `metric` in `runs` (its binomial standard error), if known."""
    key = examples_for(metric)
    if key is None or key not in runs:
        return None
    values = runs[key].dropna()
    return float(values.iloc[0]) if len(values) else None


def tuning_stats(study: Study, runs, selection: Selection):
    """Per tuned case and lr: the tuning seeds' mean, std, n, diverged count and SE."""
    lr, seed = lr_column(study), "cfg.seed"
    own = {c.name for c in study.cases if c.lr_from is None}
    basis = runs[runs["case"].isin(own) & runs[seed].isin(list(study.selection_seeds))]
    if basis.empty:
        return None
    stats = aggregate(basis, ["case", lr], [selection.metric], seed)
    examples = examples_behind(runs, selection.metric)
    stats["se"] = [
        standard_error(m, s, int(n), examples)
        for m, s, n in zip(
            stats[selection.metric], stats[f"{selection.metric} std"], stats["n"], strict=True
        )  # fmt: skip
    ]
    return stats


def picks_of(study: Study, stats, selection: Selection) -> dict[str, Pick]:
    """Each tuned case's pick (see the module docstring); cases with no valid lr are absent."""
    if stats is None:
        return {}
    lr, metric = lr_column(study), selection.metric
    out = {}
    for case, frame in stats.groupby("case", sort=False):
        tried = sorted(float(v) for v in frame[lr])
        valid = frame[(frame["n"] > 0) & (frame["diverged"] == 0) & frame[metric].notna()]
        if valid.empty:
            continue
        ranked = valid.sort_values(metric, ascending=selection.mode == "min", kind="stable")
        best = ranked.iloc[0]
        second = ranked.iloc[1] if len(ranked) > 1 else None
        value = float(best[lr])
        edge = ""
        if len(tried) > 1 and value == tried[-1]:
            edge = "largest"
        elif len(tried) > 1 and value == tried[0]:
            edge = "smallest"
        grid = study.case(str(case)).grid
        next_lr = grid.next_beyond(tried, edge == "largest") if edge else None
        margin = (
            abs(float(best[metric]) - float(second[metric])) if second is not None else math.nan
        )
        margin_se = (
            math.hypot(float(best["se"]), float(second["se"])) if second is not None else math.nan
        )
        out[str(case)] = Pick(
            str(case), value, float(best[metric]), float(best["se"]), int(best["n"]),
            float(second[lr]) if second is not None else None, margin, margin_se, edge, next_lr,
        )  # fmt: skip
    return out


def horizon_epochs(study: Study) -> list[float | None]:
    """The horizons the study reports: the claim's, else the runs' own end."""
    return list(study.claim.horizons) if study.claim and study.claim.horizons else [None]


def horizons(study: Study, runs, metrics) -> list[Horizon]:
    """The study at each of its horizons (`runs` with `did not train` already marked)."""
    from dpresearch.analysis.quality import mark_untrained

    selection = selection_of(study, runs)
    key = study.claim.horizon_key if study.claim else "epoch"
    out = []
    for value in horizon_epochs(study):
        if value is None:
            at_runs, at_metrics = runs, metrics
        else:
            window = study.claim.window if study.claim else 0.0
            at_runs, at_metrics = at_horizon(runs, metrics, value, key, window)
            at_runs = mark_untrained(at_runs, at_metrics)
        stats = tuning_stats(study, at_runs, selection)
        picks = picks_of(study, stats, selection)
        out.append(Horizon(value, at_runs, at_metrics, stats, picks, key))
    return out


def chosen_lrs(found: list[Horizon]) -> dict[str, list[float]]:
    """Each case's selected lrs over all horizons (where its final seeds run)."""
    out: dict[str, list[float]] = {}
    for horizon in found:
        for case, pick in horizon.picks.items():
            if pick.lr not in out.setdefault(case, []):
                out[case].append(pick.lr)
    return out


def extensions(study: Study, found: list[Horizon]) -> dict[str, list[float]]:
    """Per case, the lrs to add: one grid step beyond every edge pick short of its bound, and
    for a case where no lr can be picked (a seed of every lr tried failed) one step below the
    smallest lr tried if a seed diverged there, or above the largest if seeds there only did
    not train (`unpickable`)."""
    out: dict[str, list[float]] = {}
    for horizon in found:
        wanted = [(case, pick.next_lr) for case, pick in horizon.picks.items()]
        wanted += list(unpickable(study, horizon).items())
        for case, lr in wanted:
            if lr is not None and lr not in out.setdefault(case, []):
                out[case].append(lr)
    return {case: lrs for case, lrs in out.items() if lrs}


def unpickable(study: Study, horizon: Horizon) -> dict[str, float | None]:
    """Each tuned case with tuning runs but no pick at `horizon` → the lr to try next: the
    grid's step below the smallest lr tried where a seed diverged at it (the lr is too large
    everywhere), above the largest where its seeds did not train and none diverged (too small
    everywhere), None otherwise or at the grid's bound."""
    if horizon.stats is None:
        return {}
    lr, seed = lr_column(study), "cfg.seed"
    runs = horizon.runs[horizon.runs[seed].isin(list(study.selection_seeds))]
    out: dict[str, float | None] = {}
    for case in horizon.stats["case"].unique():
        if case in horizon.picks:
            continue
        own = runs[runs["case"] == case]
        tried = sorted(float(v) for v in own[lr].unique())
        if not tried:
            continue
        at_smallest = set(own[own[lr] == tried[0]]["status"])
        at_largest = set(own[own[lr] == tried[-1]]["status"])
        grid = study.case(str(case)).grid
        if "diverged" in at_smallest:
            out[str(case)] = grid.next_beyond(tried, up=False)
        elif "did not train" in at_largest and "diverged" not in at_largest:
            out[str(case)] = grid.next_beyond(tried, up=True)
        else:
            out[str(case)] = None
    return out
