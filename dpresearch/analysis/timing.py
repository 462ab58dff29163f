"""Modeled communication time on a chosen network, and time-to-accuracy per run.

Re-pricing: a finished run's `comm/ops` table (every distinct operation with its count) priced
on the chosen preset gives its exact total; divided by the same table priced on the run's own
network (`cfg.network`) it gives a factor, and the per-step curve on the preset is the logged
`comm/modeled_s` times that factor. The curve is exact when the mix of operations is the same
at every step (every synchronous codec without warm-up); otherwise the end point is exact and
the intermediate points are scaled. A run without `comm/ops` (unfinished) can be re-priced only
onto its own network.

Time-to-accuracy: the first logged step at which `metric ≥ target` (or ≤ for a loss metric);
the columns give its epoch, bytes per worker (`comm/bytes`), modeled seconds, measured seconds
(`time/wall_s`), simulated seconds (`time/simulated_s`, where the run logs it) and modeled
wall-clock seconds (`time/modeled_s`: compute and communication, `run/modeled_clock.py`). Runs
that never reach the target have NaN there and `tta/reached` = 0.
"""

from __future__ import annotations

import math
from typing import Any

from dpresearch.analysis.errors import AnalysisError, require_columns
from dpresearch.comm.network import PRESETS, NetworkModel

# Logged column → time-to-accuracy column (the modeled column is added per network).
TTA_SOURCES = {
    "epoch": "tta/epoch",
    "comm/bytes": "tta/bytes",
    "time/wall_s": "tta/wall_s",
    "time/simulated_s": "tta/simulated_s",
    "time/modeled_s": "tta/modeled_s",
}


SCENARIO_CLOCK = "time/modeled_s@"  # + a time scenario's name (`run/time_scenarios.py`)


def modeled_column(network: str | None) -> str:
    """Name of the per-step modeled-seconds column on `network` (None: the run's own)."""
    return f"modeled_s@{network}" if network else "comm/modeled_s"


def _compute_step_s(row: Any) -> float:
    """The run's modeled compute seconds per step (what overlapped ops hide behind)."""
    value = row.get("cfg.network.compute_step_s")
    try:
        return 0.0 if value is None or math.isnan(float(value)) else float(value)
    except (TypeError, ValueError):
        return 0.0


def _own_network(row: Any) -> NetworkModel | None:
    latency, bandwidth = row.get("cfg.network.latency_us"), row.get("cfg.network.bandwidth_gbit")
    try:
        return NetworkModel.from_units(
            float(latency), float(bandwidth), compute_step_s=_compute_step_s(row)
        )
    except (TypeError, ValueError):
        return None


def repricing_factors(runs, network: str) -> dict[str, float]:
    """run → (its ops priced on `network`) / (its ops priced on its own network); both keep
    the run's own compute time per step (what overlapped ops hide behind). NaN where no factor
    exists: no op table, or ops the run's own network hid entirely but `network` does not."""
    factors: dict[str, float] = {}
    for row, theirs in zip(
        runs.to_dict("records"), repriced_totals(runs, network).values(), strict=True
    ):
        own, ops = _own_network(row), row.get("comm/ops")
        if own == NetworkModel.preset(network, _compute_step_s(row)):
            factors[row["run"]] = 1.0
        elif own is None or not isinstance(ops, list):
            factors[row["run"]] = math.nan
        else:
            mine = own.total_seconds(ops)
            factors[row["run"]] = theirs / mine if mine > 0 else (0.0 if theirs == 0 else math.nan)
    return factors


def repriced_totals(runs, network: str) -> dict[str, float]:
    """run → its whole `comm/ops` table priced on `network` (the run's own compute time per
    step hiding what it overlaps): exact for every finished run, also one whose own network
    hid all of its communication; NaN without an op table."""
    if network not in PRESETS:
        raise AnalysisError(
            f"unknown network preset {network!r}; choose one of: " + ", ".join(PRESETS)
        )
    totals: dict[str, float] = {}
    for row in runs.to_dict("records"):
        ops = row.get("comm/ops")
        target = NetworkModel.preset(network, _compute_step_s(row))
        totals[row["run"]] = target.total_seconds(ops) if isinstance(ops, list) else math.nan
    return totals


def add_modeled_time(metrics, runs, network: str | None):
    """`metrics` with the per-step modeled-seconds column for `network` (see module doc)."""
    if not network or "comm/modeled_s" not in metrics:
        return metrics
    factors = repricing_factors(runs, network)
    factor = metrics["run"].map(factors).astype(float)
    return metrics.assign(**{modeled_column(network): metrics["comm/modeled_s"] * factor})


def time_to_accuracy(metrics, metric: str, target: float, network: str | None = None):
    """One row per run in `metrics` (which must hold the modeled column when `network` is
    given; see `add_modeled_time`): `run`, `tta/reached` and the TTA columns present."""
    import pandas as pd

    require_columns(metrics.columns, [metric], "metric")
    mode_min = "loss" in metric
    values = pd.to_numeric(metrics[metric], errors="coerce")
    hit = metrics[(values <= target) if mode_min else (values >= target)]
    first = hit.groupby("run", observed=False, sort=False).head(1).set_index("run")
    sources = {**TTA_SOURCES}
    modeled = modeled_column(network)
    if modeled in metrics:
        sources[modeled] = f"tta/{modeled}"
    # each time scenario's modeled clock (`train.time_scenarios`): `tta/time/modeled_s@<name>`
    sources.update({c: f"tta/{c}" for c in metrics.columns if c.startswith(SCENARIO_CLOCK)})
    present = {src: dst for src, dst in sources.items() if src in metrics}
    out = pd.DataFrame(index=pd.Index(metrics["run"].cat.categories, name="run"))
    out["tta/reached"] = out.index.isin(first.index).astype(int)
    for src, dst in present.items():
        out[dst] = first[src].reindex(out.index).astype(float)
    return out.reset_index()
