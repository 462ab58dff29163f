"""Run directories → pandas DataFrames, comparison tables and convergence plots.

A run directory is what the trainer writes: `config.yaml`, `metrics.jsonl`, `summary.json`.
Needs the `analysis` extra (pandas, matplotlib).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml


def find_runs(roots: Iterable[str | Path]) -> list[Path]:
    """Every run directory (one holding summary.json) at or below each root."""
    found: list[Path] = []
    for root in map(Path, roots):
        found += sorted(p.parent for p in root.rglob("summary.json"))
    return found


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out


def load_summaries(runs: Sequence[str | Path]):
    """One row per run: `run` (its path), flattened config keys (`cfg.*`) and summary metrics."""
    import pandas as pd

    rows = []
    for run in map(Path, runs):
        config = yaml.safe_load((run / "config.yaml").read_text()) or {}
        summary = json.loads((run / "summary.json").read_text())
        rows.append({"run": str(run), **_flatten(config, "cfg."), **summary})
    return pd.DataFrame(rows)


def load_metrics(run: str | Path):
    """The run's metrics.jsonl as a DataFrame, one row per logged step."""
    import pandas as pd

    lines = (Path(run) / "metrics.jsonl").read_text().splitlines()
    return pd.DataFrame([json.loads(line) for line in lines if line.strip()])


def markdown_table(df, columns: Sequence[str], formats: dict[str, str] | None = None) -> str:
    """A GitHub-markdown table of `columns` of `df`, cells formatted by `formats[col]`."""
    formats = formats or {}
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = [
        "| " + " | ".join(format(row[c], formats.get(c, "")) for c in columns) + " |"
        for _, row in df.iterrows()
    ]
    return "\n".join([head, rule, *body])


def plot_curves(
    runs: dict[str, str | Path], x: str, y: str, out: str | Path, logx: bool = False
) -> None:
    """One line per labelled run of metric `y` against `x` (e.g. epoch, comm/bytes,
    comm/modeled_s), saved to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    colors = plt.get_cmap("tab20").colors
    styles = ("-", "--", ":", "-.")
    for i, (label, run) in enumerate(runs.items()):
        df = load_metrics(run)
        df = df[df[y].notna()] if y in df else df.iloc[0:0]
        ax.plot(
            df[x],
            df[y],
            marker=".",
            label=label,
            color=colors[i % len(colors)],
            linestyle=styles[(i // len(colors)) % len(styles)],
        )
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
