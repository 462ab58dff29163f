"""Run directories → one row per run (config, summary, status) and one row per logged step.

A run directory is what the trainer writes: `config.yaml` (resolved config), `metrics.jsonl`
(one JSON object per logged step), `summary.json` (final metrics; written at the end only), and,
when a study launched it, `study_point.json` (study, case, tuned values, seed).

Status of a run: `summary.json`'s `status` when present (finished / diverged / interrupted);
otherwise inferred — no summary → `unfinished`; a non-finite final `train/loss` → `diverged`;
else `finished`. Only `finished` runs enter aggregates unless the caller asks otherwise.

Non-finite floats are written by the logger as the strings "nan", "inf", "-inf"; in the
per-step frame they read as missing values (NaN), so a diverged curve simply stops.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

STATUSES = ("finished", "diverged", "did not train", "interrupted", "unfinished")
FINISHED = "finished"
POINT_FILE = "study_point.json"
# Folders that hold a `config.yaml` but are not runs (Hydra's copy, W&B's files).
_NOT_RUNS = {".hydra", "wandb", "files", "__pycache__"}
_RUN_FILES = ("summary.json", "metrics.jsonl", "config.yaml")
# libyaml's loader (`yaml.safe_load`'s result, built in C) where PyYAML has it
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def find_runs(roots: Iterable[str | Path], include_unfinished: bool = True) -> list[Path]:
    """Every run directory at or below each root, sorted by path.

    A run directory holds `summary.json` or `metrics.jsonl` (or `config.yaml` alone: a run that
    died before its first log line). `include_unfinished=False` keeps those with a summary only.
    """
    found: set[Path] = set()
    for root in map(Path, roots):
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in _NOT_RUNS)
            names = set(files)
            if "summary.json" in names or (include_unfinished and names & set(_RUN_FILES)):
                found.add(Path(folder))
    return sorted(found)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        if isinstance(node, list):  # hashable, so config columns can be grouped on
            node = json.dumps(node)
        return {prefix[:-1]: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out


def _number(value: Any) -> Any:
    """The logger's "nan"/"inf"/"-inf" strings back to floats; anything else unchanged."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return value


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def infer_status(summary: dict[str, Any] | None) -> str:
    """The run's status from its summary (None: no summary.json) — see the module docstring."""
    if summary is None:
        return "unfinished"
    if isinstance(summary.get("status"), str) and summary["status"]:
        return summary["status"]  # as the trainer recorded it (finished, diverged, …)
    loss = summary.get("train/loss")
    return "diverged" if loss is not None and not _finite(loss) else FINISHED


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_choices(run: Path) -> dict[str, str]:
    """The config-group choices Hydra recorded for the run (`.hydra/hydra.yaml`,
    `hydra.runtime.choices`: e.g. compressor → topk), {} when there is none. A text scan of
    that one block: the whole file is large and the rest is not needed."""
    try:
        text = (run / ".hydra" / "hydra.yaml").read_text()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    start = text.find("\n    choices:\n")
    out: dict[str, str] = {}
    if start < 0:
        return out
    for line in text[start + 14 :].splitlines():
        if not line.startswith("      ") or ":" not in line:
            break
        key, _, value = line.strip().partition(":")
        if "/" not in key:  # hydra's own groups (hydra/launcher, ...) are not the run's
            value = value.strip()
            out[key] = "" if value in ("null", "") else value
    return out


def run_row(
    label: str,
    config: dict[str, Any] | None,
    summary: dict[str, Any] | None,
    point: dict[str, Any] | None = None,
    choices: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One run's row (see `load_summaries`) from its files' contents."""
    row: dict[str, Any] = {"run": label, "status": infer_status(summary)}
    row.update({k: v for k, v in (point or {}).items() if k in ("study", "case", "point")})
    row.update({f"choice.{k}": v for k, v in (choices or {}).items()})
    row.update(_flatten(config or {}, "cfg."))
    row.update({k: _number(v) for k, v in (summary or {}).items()})
    return row


def read_run(run: Path) -> tuple[dict, dict | None, dict, dict[str, str]]:
    """(config, summary or None, study point, choices) as the run directory holds them."""
    config_path = run / "config.yaml"
    config = yaml.load(config_path.read_text(), _YAML_LOADER) if config_path.exists() else {}
    return (
        config or {},
        _read_json(run / "summary.json"),
        _read_json(run / POINT_FILE) or {},
        read_choices(run),
    )


def _run_row(run: Path) -> dict[str, Any]:
    return run_row(str(run), *read_run(run))


def load_summaries(runs: Sequence[str | Path]):
    """One row per run: `run` (its path), `status`, `study`/`case`/`point` when a study launched
    it, the config-group choices (`choice.*`, e.g. `choice.compressor` = topk), flattened
    config keys (`cfg.*`) and the summary's metrics (missing for unfinished runs).
    """
    import pandas as pd

    return pd.DataFrame([_run_row(Path(r)) for r in runs])


def _complete_lines(blob: bytes) -> bytes:
    """`blob` ending in a newline, without a torn last line (a writer killed mid-line)."""
    if not blob or blob.endswith(b"\n"):
        return blob
    cut = blob.rfind(b"\n")
    try:
        json.loads(blob[cut + 1 :])
        return blob + b"\n"
    except ValueError:
        return blob[: cut + 1]


_NON_FINITE = (b': "nan"', b': "inf"', b': "-inf"')


def _sanitize(blob: bytes) -> bytes:
    # Arrow's JSON reader takes neither NaN literals nor overflowing numbers: missing instead.
    # Searching is cheap, replacing copies: only the files that hold such values are rewritten.
    for token in _NON_FINITE:
        if token in blob:
            blob = blob.replace(token, b": null")
    return blob


def _parse(blob: bytes):
    """One pandas frame from JSON lines (pyarrow when installed, pandas otherwise)."""
    import pandas as pd

    if re.search(rb"\S", blob) is None:  # (strip() would copy the whole blob)
        return pd.DataFrame()
    try:
        import pyarrow as pa
        import pyarrow.json as pj
    except ImportError:
        return pd.read_json(io.BytesIO(blob), lines=True, dtype=False)
    options = pj.ReadOptions(block_size=max(1 << 20, min(len(blob) // 8, 64 << 20)))
    # Types from a sample, numbers as float64 (step as int64): the reader then skips type
    # inference for those columns (~25% faster) and a column logged as 1 in one run and 1.5 in
    # another cannot clash; fields the sample lacks are still inferred.
    sample = pj.read_json(io.BytesIO(blob[: blob.find(b"\n", 1 << 16) + 1] or blob)).schema
    fields = [
        pa.field(f.name, pa.int64() if f.name == "step" else pa.float64())
        if pa.types.is_integer(f.type) or pa.types.is_floating(f.type) or pa.types.is_null(f.type)
        else f
        for f in sample
    ]
    parse = pj.ParseOptions(explicit_schema=pa.schema(fields), unexpected_field_behavior="infer")
    return pj.read_json(io.BytesIO(blob), read_options=options, parse_options=parse).to_pandas()


def load_metrics_many(runs: Sequence[str | Path]):
    """Every logged step of every run in one frame, with a `run` column (the path as given in
    `runs`, categorical in that order). Files are read whole and parsed in one call."""
    import numpy as np
    import pandas as pd

    blobs, counts = [], []
    for run in runs:
        path = Path(run) / "metrics.jsonl"
        blob = _sanitize(_complete_lines(path.read_bytes())) if path.exists() else b""
        blobs.append(blob)
        counts.append(blob.count(b"\n"))
    try:
        df = _parse(b"".join(blobs))
    except (ValueError, ArithmeticError, TypeError):
        # A column whose type changes between runs (a metric logged as a number in one run and
        # as text in another): parse run by run and let pandas reconcile.
        frames = [_parse(b) for b in blobs]
        df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    labels = [str(r) for r in runs]
    codes = np.repeat(np.arange(len(labels)), counts)
    df.insert(0, "run", pd.Categorical.from_codes(codes, categories=labels))
    return df


def load_metrics(run: str | Path):
    """The run's metrics.jsonl as a DataFrame, one row per logged step."""
    return load_metrics_many([run]).drop(columns="run")
