"""What a number can carry: runs that did not train, standard errors, values at a horizon.

- `did_not_train`: a finished run whose final training loss is above its initial one (the
  first logged value; without a curve, ln(classes), a uniform prediction's loss) — unless the
  evaluated model trained: its own test loss fell from its first evaluation to its last AND
  ended below a uniform prediction's, ln(classes) (without classes, e.g. a regression, below
  the initial training loss) —, or whose accuracy is at chance (within two binomial standard
  errors of 1/classes on its test split).
  The exception is for runs whose logged training loss is not the evaluated model's: gossip
  workers on label-skewed data log their local losses, which rise as mixing pulls each model
  toward the others' classes while the averaged (evaluated) model improves. Its bar is
  ln(classes), not the first logged training loss: both losses are mean cross-entropies in
  nats (per example; per token for a language model), but those local losses are on each
  worker's own few classes and start below ln(classes), where the averaged model's test loss
  on all classes need not go. A model whose held-out loss ends above a uniform prediction's
  did not train, whatever its curve did in between (a run that blew up at once and then
  recovered part of the way is no exception).
  `mark_untrained` gives such runs the status `did not train`, so no mean includes them and
  tables print the status instead of a number.
- `standard_error`: the standard error of a mean over seeds of a metric: the seeds' spread
  (s/√n) and, for an accuracy measured on N examples, the binomial sampling error of that
  split, √(p(1−p)/N), combined in quadrature. The second term stays when the split is the same
  for every seed (the validation split is): averaging seeds does not remove it.
- `truncate` / `at_horizon`: every run as it stood after `epoch` epochs (or any growing
  column, e.g. simulated seconds) — the metrics frame cut there, and the runs frame's metrics
  replaced by their last values up to it (a run that diverged later counts as finished at that
  horizon; one that stopped earlier as unfinished).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

UNTRAINED = "did not train"
EPS = 1e-6
EXAMPLES = {"val": "data/val_examples", "test": "data/test_examples"}


def is_accuracy(metric: str) -> bool:
    return metric.rsplit("/", 1)[-1] in ("acc", "acc_local_mean", "accuracy", "top1")


def examples_for(metric: str) -> str | None:
    """The summary key holding how many examples `metric` was measured on (None: unknown)."""
    return EXAMPLES.get(metric.split("/", 1)[0]) if is_accuracy(metric) else None


def binomial_se(p: float, n: float) -> float:
    if not (n and n > 0) or not math.isfinite(p):
        return math.nan
    p = min(max(p, 0.0), 1.0)
    return math.sqrt(p * (1 - p) / n)


def standard_error(mean: float, std: float, n: int, examples: float | None = None) -> float:
    """See the module docstring; NaN when nothing is known (one seed, no split size)."""
    seeds = std / math.sqrt(n) if n >= 2 and math.isfinite(std) else math.nan
    split = binomial_se(mean, examples) if examples else math.nan
    parts = [x for x in (seeds, split) if math.isfinite(x)]
    return math.sqrt(sum(x * x for x in parts)) if parts else math.nan


def _first_losses(metrics) -> dict[str, float]:
    if "train/loss" not in metrics:
        return {}
    rows = metrics.loc[metrics["train/loss"].notna(), ["run", "train/loss"]]
    first = rows.groupby("run", observed=True, sort=False)["train/loss"].first()
    return {str(k): float(v) for k, v in first.items()}


def _test_losses(metrics) -> dict[str, tuple[float, float]]:
    """(first, last) logged test loss of each run evaluated at least twice."""
    if "test/loss" not in metrics:
        return {}
    rows = metrics.loc[metrics["test/loss"].notna(), ["run", "test/loss"]]
    grouped = rows.groupby("run", observed=True, sort=False)["test/loss"]
    first, last, count = grouped.first(), grouped.last(), grouped.count()
    return {str(k): (float(first[k]), float(last[k])) for k in first.index if count[k] >= 2}


def did_not_train(
    row: dict[str, Any],
    initial_loss: float | None,
    test_losses: tuple[float, float] | None = None,
) -> bool:
    """See the module docstring (`row`: one run's summary values; `test_losses`: the first and
    last evaluation's test loss, None when evaluated fewer than twice)."""
    classes = row.get("data/classes")
    loss = row.get("train/loss")
    if initial_loss is None and isinstance(classes, numbers.Real) and classes >= 2:
        initial_loss = math.log(classes)
    uniform = math.log(classes) if isinstance(classes, numbers.Real) and classes >= 2 else None
    bar = uniform if uniform is not None else initial_loss
    evaluated_trained = (
        test_losses is not None
        and test_losses[1] < test_losses[0]
        and bar is not None
        and test_losses[1] < bar
    )
    if (
        isinstance(loss, numbers.Real)
        and initial_loss is not None
        and math.isfinite(loss)
        and loss > initial_loss
        and not evaluated_trained
    ):
        return True
    acc, n = row.get("test/acc"), row.get("data/test_examples")
    if isinstance(acc, numbers.Real) and isinstance(classes, numbers.Real) and classes >= 2:
        chance = 1.0 / classes
        return acc <= chance + 2 * binomial_se(chance, n or math.inf) if n else acc <= chance
    return False


def mark_untrained(runs, metrics):
    """`runs` with finished runs that did not train given that status (see module doc)."""
    first = _first_losses(metrics) if metrics is not None else {}
    tested = _test_losses(metrics) if metrics is not None else {}
    runs = runs.copy()
    for i, row in runs.iterrows():
        run = str(row["run"])
        if row["status"] == "finished" and did_not_train(
            row.to_dict(), first.get(run), tested.get(run)
        ):
            runs.at[i, "status"] = UNTRAINED
    return runs


def truncate(metrics, value: float, key: str = "epoch"):
    """The logged steps at or before `value` of `key` (epochs by default)."""
    return metrics[metrics[key] <= value + EPS] if key in metrics else metrics.iloc[:0]


MEASURED = ("test/", "val/", "train/")  # measurements (not counters) a window may average


def at_horizon(runs, metrics, value: float, key: str = "epoch", window: float = 0.0):
    """(runs, metrics) as they stood at `value` of `key` — epochs by default, or any logged
    column that grows along a run, e.g. simulated seconds (see the module docstring). With
    `window` > 0, each measured metric (test/, val/, train/) is the mean of its values logged
    in the last `window` fraction of the horizon, (value·(1 − window), value], instead of the
    last one: one evaluation at a constant lr scatters by several points."""
    import pandas as pd

    cut = truncate(metrics, value, key)
    reached = metrics.groupby("run", observed=True)[key].max() >= value - EPS
    columns = [c for c in cut.columns if c not in ("run",)]
    last = cut.groupby("run", observed=True, sort=False)[columns].last()  # last non-null each
    if window > 0:
        recent = cut[cut[key] > value * (1 - window) + EPS]
        measured = [c for c in columns if c.startswith(MEASURED)]
        means = recent.groupby("run", observed=True, sort=False)[measured].mean()
        last[measured] = means.reindex(last.index)[measured].fillna(last[measured])
    out = runs.copy()
    for column in columns:
        values = out["run"].map(last[column]) if column in last else None
        if values is not None:
            out[column] = values
    if "test/acc" in cut:
        best = cut.groupby("run", observed=True)["test/acc"].max()
        out["best/test_acc"] = out["run"].map(best)
    loss = out["train/loss"] if "train/loss" in out else pd.Series(0.0, index=out.index)
    got_there = out["run"].map(reached).fillna(False).astype(bool)
    finite = pd.to_numeric(loss, errors="coerce").map(lambda v: v == v and abs(v) != math.inf)
    status = out["status"].where(~got_there, "finished")
    status = status.where(~(got_there & ~finite), "diverged")
    status = status.where(got_there | (out["status"] == "diverged"), "unfinished")
    out["status"] = status
    return out, cut
