"""Run directories → pandas DataFrames → tables (markdown, LaTeX, CSV) and plots.

A run directory is what the trainer writes: `config.yaml`, `metrics.jsonl`, `summary.json`
(see `runs`). The pieces, each a module with one job:

- `runs`: find and load runs (status included: finished, diverged, interrupted, unfinished);
- `aggregate`: mean ± std over seeds per group, best-setting selection on a stated metric;
- `timing`: modeled seconds on any network preset, time-to-accuracy;
- `tables`, `plots`, `published`: output;
- `report`: all of it for a study (`python -m dpresearch.analysis`);
- `wandb_table`: the final table as a `wandb.Table`.

Needs the `analysis` extra (pandas, pyarrow, matplotlib).
"""

from dpresearch.analysis.aggregate import Selection, aggregate, choose_selection, select_best
from dpresearch.analysis.errors import AnalysisError
from dpresearch.analysis.plots import plot_curves, plot_groups
from dpresearch.analysis.report import ReportSpec, build_report, load_report, write_report
from dpresearch.analysis.runs import (
    find_runs,
    infer_status,
    load_metrics,
    load_metrics_many,
    load_summaries,
)
from dpresearch.analysis.tables import csv_table, latex_table, markdown_table
from dpresearch.analysis.timing import add_modeled_time, time_to_accuracy

__all__ = [
    "AnalysisError",
    "ReportSpec",
    "Selection",
    "add_modeled_time",
    "aggregate",
    "build_report",
    "choose_selection",
    "csv_table",
    "find_runs",
    "infer_status",
    "latex_table",
    "load_metrics",
    "load_metrics_many",
    "load_report",
    "load_summaries",
    "markdown_table",
    "plot_curves",
    "plot_groups",
    "select_best",
    "time_to_accuracy",
    "write_report",
]
