"""Seeds aggregated explicitly, and the best hyper-parameter setting per case.

Contracts:
- `aggregate` returns one row per group of `keys` — every group present in the runs, also one
  whose runs all failed (then `n` = 0) — with, for each metric, the mean over the group's
  included runs (column `<metric>`) and the sample standard deviation (`<metric> std`, NaN for
  one run); `n` (runs averaged), `seeds` (their seeds), `runs` (all runs in the group) and
  `excluded` (e.g. "1 diverged, 1 unfinished"). Only `finished` runs are averaged unless
  `include_failed`.
- `select_best` marks, per case, the setting of the tuned keys whose mean selection metric is
  best. A setting in which any seed diverged or did not train ranks below every setting in which
  none did, and a setting with no averaged run is never selected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dpresearch.analysis.errors import AnalysisError, require_columns
from dpresearch.analysis.runs import FINISHED, STATUSES

# (a language model's bits per character first: its runs also report next-token accuracy)
VALIDATION_METRICS = ("val/bpc", "val/acc", "valid/acc", "validation/acc", "val/loss", "valid/loss")
TRAIN_METRIC = "train/loss"
FAILED = ("diverged", "did not train")


@dataclass(frozen=True)
class Selection:
    """The metric a setting is selected on: its final value, averaged over seeds."""

    metric: str
    mode: str  # "max" or "min"
    why: str

    def describe(self) -> str:
        best = "highest" if self.mode == "max" else "lowest"
        return f"{best} mean final `{self.metric}` over seeds ({self.why})"


def default_mode(metric: str) -> str:
    lower_is_better = ("loss", "error", "bpc", "ppl", "bits")
    return "min" if any(word in metric for word in lower_is_better) else "max"


def choose_selection(columns: Sequence[str], metric: str | None = None) -> Selection:
    """`metric` as given (`name` or `name:min|max`), else the first validation metric present,
    else the final training loss — never a test metric by default."""
    if metric:
        name, _, mode = metric.partition(":")
        if mode not in ("", "min", "max"):
            raise AnalysisError(f"selection mode {mode!r} in {metric!r}; use {name}:min or :max")
        require_columns(columns, [name], "selection metric")
        why = "chosen by the user" + (
            "; a test metric: selecting on it overstates accuracy" if "test" in name else ""
        )
        return Selection(name, mode or default_mode(name), why)
    for name in VALIDATION_METRICS:
        if name in columns:
            return Selection(name, default_mode(name), "validation split of the training set")
    if TRAIN_METRIC in columns:
        return Selection(
            TRAIN_METRIC, "min", "no validation metric in these runs; the test set never selects"
        )
    raise AnalysisError(
        "nothing to select on: no validation metric and no train/loss; pass --select METRIC"
    )


def key_texts(frame, keys: Sequence[str]) -> list[tuple[str, ...]]:
    """Each row's values of `keys` as text, a missing one as "–": rows of runs and of tables
    compare by it, and a case without some key (NaN, which equals nothing, and which pandas
    keeps missing through `astype(str)`) still finds its runs."""
    import numbers

    from dpresearch.analysis.tables import MISSING

    def text(value) -> str:
        if value is None or value != value:
            return MISSING
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return repr(float(value))  # 8 and 8.0 (a column NaN made float) are one value
        return str(value)

    return [tuple(map(text, row)) for row in frame[list(keys)].itertuples(index=False)]


def _excluded_text(statuses) -> str:
    counts = statuses[statuses != FINISHED].value_counts().to_dict()
    order = sorted(counts, key=lambda s: (STATUSES.index(s) if s in STATUSES else 99, s))
    return ", ".join(f"{counts[s]} {s}" for s in order)


def aggregate(
    runs,
    keys: Sequence[str],
    metrics: Sequence[str],
    seed_key: str | None = "cfg.seed",
    include_failed: bool = False,
):
    """Group `runs` (one row per run, with `status`) by `keys`; see the module docstring."""
    import pandas as pd

    keys = list(keys)
    require_columns(runs.columns, [*keys, *metrics])
    if runs.empty:
        raise AnalysisError("no runs to aggregate")
    runs = runs.copy()
    for m in metrics:
        runs[m] = pd.to_numeric(runs[m], errors="coerce")
    included = runs if include_failed else runs[runs["status"] == FINISHED]
    by = dict(by=keys, dropna=False, sort=False, observed=True)
    everything = runs.groupby(**by)
    out = everything.size().rename("runs").to_frame()
    out["excluded"] = everything["status"].agg(_excluded_text)
    # never preferred in a selection: a seed that diverged or did not train
    out["diverged"] = everything["status"].agg(lambda s: int(s.isin(FAILED).sum()))
    groups = included.groupby(**by)
    out["n"] = groups.size().reindex(out.index).fillna(0).astype(int)
    if seed_key and seed_key in runs:
        out["seeds"] = groups[seed_key].agg(lambda s: ",".join(map(str, sorted(s))))
    for m in metrics:
        out[m] = groups[m].mean()
        out[f"{m} std"] = groups[m].std(ddof=1)
    out["seeds"] = out.get("seeds", pd.Series(dtype=object)).fillna("")
    return out.reset_index()


def duplicate_seed_notes(runs, keys: Sequence[str], seed_key: str | None) -> list[str]:
    """One line if some group holds two runs with the same seed: they are averaged together;
    it names the config keys that differ between them (so the caller can split on them) and
    up to three such groups."""
    if not seed_key or seed_key not in runs:
        return []
    config = [c for c in runs.columns if c.startswith("cfg.") and c != seed_key]
    shared, varying = [], set()
    for group, frame in runs.groupby([*keys, seed_key], dropna=False, sort=False):
        if len(frame) < 2:
            continue
        shared.append(dict(zip([*keys, seed_key], group, strict=True)))
        varying |= {c for c in config if frame[c].astype(str).nunique() > 1}
    if not shared:
        return []
    examples = "; ".join(str(g) for g in shared[:3]) + ("; …" if len(shared) > 3 else "")
    differ = (
        f"; they differ in {', '.join(sorted(varying))} (add to --by or --tune to split)"
        if varying
        else ""
    )
    return [
        f"{len(shared)} groups hold several runs with the same seed, averaged together "
        f"({examples}){differ}"
    ]


def select_best(agg, case_keys: Sequence[str], tune_keys: Sequence[str], selection: Selection):
    """`agg` (from `aggregate` over case + tune keys) with a boolean `selected` column."""
    require_columns(agg.columns, [*case_keys, *tune_keys, selection.metric])
    ranked = agg.copy()
    ranked["_failed"] = ranked["diverged"] > 0
    score = ranked[selection.metric]
    ranked["_score"] = -score if selection.mode == "max" else score
    ranked = ranked[ranked["n"] > 0].sort_values(
        ["_failed", "_score"], ascending=True, na_position="last", kind="stable"
    )
    if case_keys:
        best = ranked.groupby(list(case_keys), dropna=False, sort=False).head(1).index
    else:
        best = ranked.head(1).index
    out = agg.copy()
    out["selected"] = out.index.isin(best)
    return out
