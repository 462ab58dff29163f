"""A study's learning-rate selection, at each horizon it states: one rule for the launcher
(which lrs to add, where the final seeds run) and the report (what it prints).

Per case and horizon, over the tuning seeds' runs only: the mean selection metric of every
setting tried (an lr; with `tune_also`, an lr and a value of the other key), its standard error
(`quality.standard_error`), the best setting among those where no seed diverged or did not
train, and per tuned key (`Axis`) the runner-up — the best setting with another value of that
key — and whether that key's choice was won by less than the standard error of the difference
√(SE_best² + SE_runner-up²) (`close`). A pick whose value of a key is the smallest or largest
of that key tried is at an edge on that key: its `next_value` is the key's grid's next value
beyond it, or None when the bound is reached (`Grid.next_beyond`). With one key (the lr) the
runner-up is simply the second best lr.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from dpresearch.analysis.aggregate import Selection, aggregate, choose_selection
from dpresearch.analysis.quality import at_horizon, examples_for, standard_error
from dpresearch.study.spec import Study


@dataclass(frozen=True)
class Axis:
    """A pick along one tuned key: its value, the runner-up's value of that key (the best
    setting with another value of it), the margin, and where the value lies among those
    tried."""

    key: str
    value: float
    runner_up: float | None  # its value of the key
    margin: float  # |best − runner-up| on the metric (NaN without a runner-up)
    margin_se: float  # standard error of that difference
    edge: str  # "", "smallest" or "largest" of the values tried
    next_value: float | None  # the grid's next value beyond an edge; None: bound reached

    @property
    def close(self) -> bool:
        """Won by less than the standard error of the difference (or by an unknown one)."""
        if self.runner_up is None:
            return False
        return not math.isfinite(self.margin_se) or self.margin < self.margin_se

    @property
    def bound_reached(self) -> bool:
        return bool(self.edge) and self.next_value is None


@dataclass(frozen=True)
class Pick:
    """A case's selected setting: the metric's mean `value` ± `se` over `n` tuning seeds, and
    per tuned key (the lr first) its `Axis`."""

    case: str
    value: float
    se: float
    n: int
    axes: tuple[Axis, ...]

    @property
    def lr(self) -> float:
        return self.axes[0].value

    @property
    def setting(self) -> tuple[float, ...]:
        """(lr, each other tuned key's value)."""
        return tuple(a.value for a in self.axes)

    # The lr's runner-up and margin (a one-key study's whole choice).
    runner_up = property(lambda self: self.axes[0].runner_up)
    margin = property(lambda self: self.axes[0].margin)
    margin_se = property(lambda self: self.axes[0].margin_se)
    next_lr = property(lambda self: self.axes[0].next_value)

    @property
    def edge(self) -> str:
        """ "" where the pick is interior on every key, else its first edge."""
        return next((a.edge for a in self.axes if a.edge), "")

    @property
    def close(self) -> bool:
        """Some key's choice won within noise."""
        return any(a.close for a in self.axes)

    @property
    def bound_reached(self) -> bool:
        """At an edge of some key whose bound is reached."""
        return any(a.bound_reached for a in self.axes)


HORIZON_UNITS = {
    "epoch": "epochs",
    "time/simulated_s": "simulated s",
    "step": "steps",
    "time/modeled_s": "modeled s",
}


def horizon_unit(key: str) -> str:
    """The unit horizons in `key` are given in (a time scenario's clock, `time/modeled_s@<name>`:
    modeled s of that scenario)."""
    if key.startswith("time/modeled_s@"):
        return f"modeled s ({key.split('@', 1)[1]})"
    return HORIZON_UNITS.get(key, key)


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
        return f"{self.epochs:g} {horizon_unit(self.key)}"


def lr_column(study: Study) -> str:
    return f"cfg.{study.lr_key}"


def tuned_columns(study: Study, runs=None) -> list[str]:
    """The columns of the tuned keys: the lr's, then each `tune_also` key's (those `runs`
    has, where given)."""
    also = [f"cfg.{key}" for key in study.also_keys]
    return [lr_column(study), *(c for c in also if runs is None or c in runs)]


def case_columns(study: Study, case: str) -> list[str]:
    """The columns of the keys `case` tunes (a case reusing another's lr: that case's)."""
    own = study.case(case)
    source = study.case(own.lr_from) if own.lr_from else own
    return [lr_column(study), *(f"cfg.{key}" for key, _ in source.also)]


def setting_of(row, columns: list[str]) -> tuple[float, ...]:
    return tuple(float(row[c]) for c in columns)


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
    seed = "cfg.seed"
    own = {c.name for c in study.cases if c.lr_from is None}
    basis = runs[runs["case"].isin(own) & runs[seed].isin(list(study.selection_seeds))]
    if basis.empty:
        return None
    stats = aggregate(basis, ["case", *tuned_columns(study, runs)], [selection.metric], seed)
    examples = examples_behind(runs, selection.metric)
    stats["se"] = [
        standard_error(m, s, int(n), examples)
        for m, s, n in zip(
            stats[selection.metric], stats[f"{selection.metric} std"], stats["n"], strict=True
        )
    ]
    return stats


def picks_of(study: Study, stats, selection: Selection) -> dict[str, Pick]:
    """Each tuned case's pick (see the module docstring); cases with no valid lr are absent."""
    if stats is None:
        return {}
    metric = selection.metric
    out = {}
    for case, frame in stats.groupby("case", sort=False):
        valid = frame[(frame["n"] > 0) & (frame["diverged"] == 0) & frame[metric].notna()]
        if valid.empty:
            continue
        ranked = valid.sort_values(metric, ascending=selection.mode == "min", kind="stable")
        best = ranked.iloc[0]
        own = study.case(str(case))
        grids = [(study.lr_key, own.grid), *own.also]
        axes = []
        for (key, grid), column in zip(grids, case_columns(study, str(case)), strict=True):
            tried = sorted(float(v) for v in frame[column].unique())
            value = float(best[column])
            others = ranked[ranked[column] != best[column]]  # the runner-up on this key
            second = others.iloc[0] if len(others) else None
            edge = ""
            if len(tried) > 1 and value == tried[-1]:
                edge = "largest"
            elif len(tried) > 1 and value == tried[0]:
                edge = "smallest"
            margin, margin_se = math.nan, math.nan
            if second is not None:
                margin = abs(float(best[metric]) - float(second[metric]))
                margin_se = math.hypot(float(best["se"]), float(second["se"]))
            axes.append(
                Axis(
                    key,
                    value,
                    float(second[column]) if second is not None else None,
                    margin,
                    margin_se,
                    edge,
                    grid.next_beyond(tried, edge == "largest") if edge else None,
                )
            )
        out[str(case)] = Pick(
            str(case), float(best[metric]), float(best["se"]), int(best["n"]), tuple(axes)
        )
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


def chosen_lrs(found: list[Horizon]) -> dict[str, list[tuple[float, ...]]]:
    """Each case's selected settings ((lr, each other tuned key's value)) over all horizons
    (where its final seeds run)."""
    out: dict[str, list[tuple[float, ...]]] = {}
    for horizon in found:
        for case, pick in horizon.picks.items():
            if pick.setting not in out.setdefault(case, []):
                out[case].append(pick.setting)
    return out


def extensions(study: Study, found: list[Horizon]) -> dict[str, list[tuple[float, ...]]]:
    """Per case, the settings to add: on every key where the pick is at an edge short of its
    bound, one grid step beyond it, crossed with every value tried of the other tuned keys
    (the grid stays a full product); and for a case where nothing can be picked (a seed of
    every lr tried failed) one lr step below the smallest lr tried if a seed diverged there,
    or above the largest if seeds there only did not train (`unpickable`), likewise crossed."""
    out: dict[str, list[tuple[float, ...]]] = {}
    for horizon in found:
        wanted = [
            (case, i, axis.next_value)
            for case, pick in horizon.picks.items()
            for i, axis in enumerate(pick.axes)
        ]
        wanted += [(case, 0, lr) for case, lr in unpickable(study, horizon).items()]
        for case, i, value in wanted:
            if value is None:
                continue
            columns = case_columns(study, case)
            frame = horizon.stats[horizon.stats["case"] == case]
            tried = [sorted({float(v) for v in frame[c]}) for c in columns]
            tried[i] = [value]
            for setting in itertools.product(*tried):
                if setting not in out.setdefault(case, []):
                    out[case].append(setting)
    return {case: settings for case, settings in out.items() if settings}


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


def untuned(study: Study) -> bool:
    """Whether no case of `study` selects an lr (each runs at one lr of its own)."""
    return all(len(c.settings()) == 1 and c.lr_from is None for c in study.cases)
