"""Run data a study ships: every run's config, summary and curves in one compressed file.

A study's report is always rendered from this file, so a fresh clone regenerates every table
and plot without the run directories (`python -m dpresearch.study report STUDY.yaml`).

Format (`*.rundata.jsonl.gz`, gzip without a time stamp, so packing the same runs twice gives
the same bytes): a header line `{"format": FORMAT, ...}`, then one JSON object per run, sorted
by its label:

    {"run": "runs/none/lr0.1/seed0",      # relative to the study's output folder
     "point": {...study_point.json...}, "choices": {"compressor": "topk", ...},
     "config": {...resolved config...}, "summary": {...summary.json...} or null,
     "curves": {"step": [...], "epoch": [...], "test/acc": [..., null, ...], ...}}

Curves keep the columns the reports use (`CURVES`, every `time/modeled_s@<scenario>` a run
logs, plus those a study names); floats are kept
to 7 significant digits (the report prints at most 4). Non-finite numbers are written as the
logger writes them ("nan", "inf", "-inf"). `load_rundata` returns the same frames as
`load_summaries` and `load_metrics_many` would from the directories.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dpresearch.analysis.errors import AnalysisError
from dpresearch.analysis.runs import load_metrics_many, read_run, run_row
from dpresearch.analysis.timing import SCENARIO_CLOCK

FORMAT = "dpresearch-rundata/1"
CURVES = (
    "step",
    "epoch",
    "lr",
    "train/loss",
    "train/acc",
    "test/loss",
    "test/acc",
    "val/loss",
    "val/acc",
    "comm/bytes",
    "comm/modeled_s",
    "time/wall_s",
    "time/simulated_s",
    "time/modeled_s",
    "tokens",
    "test/bpc",
    "val/bpc",
)
DIGITS = 7


def _compact(value: Any) -> Any:
    """JSON-ready: floats to DIGITS significant digits, non-finite ones as strings."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return float(f"{value:.{DIGITS}g}")
    if isinstance(value, dict):
        return {str(k): _compact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_compact(v) for v in value]
    return value


def _curves(metrics, columns: Sequence[str]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for column in columns:
        if column not in metrics or metrics[column].isna().all():
            continue
        values = metrics[column].astype(object).where(metrics[column].notna(), None).tolist()
        out[column] = [_compact(v) if isinstance(v, float) else v for v in values]
    return out


def pack_runs(
    runs: Iterable[str | Path],
    root: str | Path,
    path: str | Path,
    curves: Sequence[str] = (),
    header: dict[str, Any] | None = None,
) -> Path:
    """Write the run directories `runs` (labelled by their path relative to `root`) into
    `path`; returns `path`."""
    root = Path(root)
    columns = list(dict.fromkeys([*CURVES, *curves]))
    records = []
    for run in sorted(map(Path, runs)):
        config, summary, point, choices = read_run(run)
        point = {k: v for k, v in point.items() if k != "overrides"}  # the config holds them
        metrics = load_metrics_many([run]).drop(columns="run")
        scenarios = [c for c in metrics.columns if c.startswith(SCENARIO_CLOCK)]
        records.append(
            {
                "run": run.relative_to(root).as_posix(),
                "point": point,
                "choices": choices,
                "config": config,
                "summary": summary,
                "curves": _curves(metrics, [*columns, *scenarios]),
            }
        )
    return write_rundata(records, path, header)


def write_rundata(
    records: Sequence[dict[str, Any]], path: str | Path, header: dict[str, Any] | None = None
) -> Path:
    """Write run records (see the module docstring) as a rundata file."""
    path = Path(path)
    lines = [
        json.dumps(
            {"format": FORMAT, **(header or {}), "runs": len(records)},
            sort_keys=True,
            ensure_ascii=False,
        )
    ]
    for record in sorted(records, key=lambda r: r["run"]):
        lines.append(json.dumps(_compact(record), sort_keys=True, ensure_ascii=False))
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as f:
        f.write(("\n".join(lines) + "\n").encode())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(path)
    return path


def read_rundata(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, run records) of a rundata file."""
    path = Path(path)
    if not path.exists():
        raise AnalysisError(f"no run data at {path}; run the study first (or fetch the file)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    header = json.loads(lines[0]) if lines else {}
    if header.get("format") != FORMAT:
        raise AnalysisError(f"{path.name} is not a {FORMAT} file")
    return header, [json.loads(line) for line in lines[1:]]


def frames(records: Sequence[dict[str, Any]]):
    """(runs, metrics) frames of run records, as `load_summaries` and `load_metrics_many`
    give them from directories (`run` = the record's label)."""
    import numpy as np
    import pandas as pd

    from dpresearch.analysis.runs import _number

    runs = pd.DataFrame(
        [
            run_row(r["run"], r.get("config"), r.get("summary"), r.get("point"), r.get("choices"))
            for r in records
        ]
    )
    parts, counts = [], []
    for r in records:
        curves = r.get("curves") or {}
        n = max((len(v) for v in curves.values()), default=0)
        frame = pd.DataFrame({k: [_number(v) for v in values] for k, values in curves.items()})
        for column in frame.columns:
            if column == "step":
                frame[column] = frame[column].astype("int64")
            else:
                frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
        parts.append(frame)
        counts.append(n)
    metrics = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    labels = [r["run"] for r in records]
    codes = np.repeat(np.arange(len(labels)), counts)
    metrics.insert(0, "run", pd.Categorical.from_codes(codes, categories=labels))
    return runs, metrics


def load_rundata(path: str | Path):
    """(header, runs, metrics) of a rundata file (see `frames`)."""
    header, records = read_rundata(path)
    runs, metrics = frames(records)
    return header, runs, metrics
