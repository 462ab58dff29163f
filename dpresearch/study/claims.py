"""A study's claim judged (`verdict`, `claim_frame`): each expectation at each horizon on the
final seeds holds where the difference exceeds `Z` standard errors, the opposite holds where it
is below minus `Z`, unresolved otherwise; a side with one final seed says so."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dpresearch.analysis.aggregate import default_mode
from dpresearch.analysis.quality import is_accuracy, standard_error
from dpresearch.study.select import Horizon, examples_behind
from dpresearch.study.tables import final_runs, mean_cell, pick_for

if TYPE_CHECKING:
    from dpresearch.study.report import StudyReport


Z = 2.0  # a claim holds where the difference exceeds Z standard errors


def _side(report: StudyReport, horizon: Horizon, case: str, metric: str):
    """(mean, SE, n, failure text) of a case's results row on `metric`."""
    pick = pick_for(horizon, report.study, case)
    if pick is None:
        return math.nan, math.nan, 0, "no lr selected"
    rows = final_runs(report, horizon, case, pick)
    text, mean, std, n = mean_cell(rows, metric, report.include_failed, str)
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
