"""`python -m dpresearch.analysis ROOTS...`: run directories → tables, plots and results.md.

    python -m dpresearch.analysis runs/compression_subset --by case \
        --select train/loss:min --target 0.6 --network 1gbe --out results/

Prints the selected-setting table (markdown by default) and, with `--out`, writes results.md,
table.{md,tex,csv}, grid.csv, runs.csv (every run with its status) and the plots. A request the
runs cannot answer (a column that does not exist, no runs) is one `error:` line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dpresearch.analysis.errors import AnalysisError, require_modules


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dpresearch.analysis", description=__doc__.splitlines()[0]
    )
    p.add_argument("roots", nargs="+", type=Path, help="run directories or folders holding them")
    p.add_argument(
        "--by",
        nargs="+",
        help="keys defining a case (default: the study's cases, else what differs between "
        "the runs' configs but the seed and keys copying it; a run without a key reads –)",
    )
    p.add_argument(
        "--tune",
        nargs="*",
        help="keys selected over within a case "
        "(default: cfg.optimizer.lr where it varies; give none to turn off)",
    )
    p.add_argument("--seed-key", default="cfg.seed")
    p.add_argument(
        "--select",
        help="selection metric NAME[:min|max] (default: a validation "
        "metric, else train/loss; never a test metric)",
    )
    p.add_argument(
        "--metrics",
        nargs="+",
        help="final metrics to aggregate "
        "(default: test/acc best/test_acc train/loss, those present)",
    )
    p.add_argument("--target", type=float, help="time-to-accuracy target")
    p.add_argument("--target-metric", default="test/acc")
    p.add_argument(
        "--network", help="preset for modeled seconds (1gbe, 10gbe, ...; default: each run's own)"
    )
    p.add_argument(
        "--include-failed", action="store_true", help="average diverged and unfinished runs too"
    )
    p.add_argument("--published", type=Path, help="CSV of published numbers to join")
    p.add_argument("--published-key", default="case", help="its column matching our case")
    p.add_argument("--published-columns", nargs="+")
    p.add_argument("--format", choices=("md", "latex", "csv"), default="md")
    p.add_argument("--out", type=Path, help="folder for results.md, tables and plots")
    p.add_argument("--plots", nargs="*", default=["png"], help="plot kinds (png pdf svg)")
    p.add_argument("--title", default="", help="(default: the runs' study, else what they share)")
    p.add_argument("--wandb", metavar="PROJECT", help="also log the table as a wandb.Table")
    p.add_argument("--wandb-group")
    p.add_argument(
        "--keys",
        action="store_true",
        help="list every key (column) --by, --tune and --metrics can name, then stop",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except AnalysisError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    require_modules("pandas", *(["matplotlib"] if args.out and args.plots else []))
    from dpresearch.analysis.published import load_published
    from dpresearch.analysis.report import (
        FORMATS,
        ReportSpec,
        check_out_dir,
        headers,
        load_report,
        write_report,
    )
    from dpresearch.analysis.tables import csv_table, latex_table, markdown_table

    if args.out:
        check_out_dir(args.out)  # before the runs are read: a wrong --out costs nothing

    published = (
        load_published(args.published, args.published_key, args.published_columns)
        if args.published
        else None
    )
    spec = ReportSpec(
        by=args.by,
        tune=args.tune,
        seed_key=args.seed_key,
        select=args.select,
        metrics=args.metrics,
        target=args.target,
        target_metric=args.target_metric,
        network=args.network,
        include_failed=args.include_failed,
        published=published,
        title=args.title,
    )
    if args.keys:
        return list_keys(args.roots)
    progress = None if args.quiet else _progress_line
    report = load_report(args.roots, spec, progress=progress)
    if args.format == "latex":
        print(latex_table(report.table, report.columns, FORMATS, headers(report.columns)))
    elif args.format == "csv":
        print(csv_table(report.table, report.columns), end="")
    else:
        print(markdown_table(report.table, report.columns, FORMATS, headers(report.columns)))
    if report.selection is not None:
        print(f"selected on: {report.selection.describe()}")
    for note in report.notes:
        print(f"note: {note}")
    if args.out:
        path = write_report(report, args.out, plot_kinds=args.plots)
        print(f"wrote {path} and the tables and plots beside it")
    if args.wandb:
        from dpresearch.analysis.wandb_table import log_table

        if not log_table(report.table, report.columns, project=args.wandb, group=args.wandb_group):
            print("note: wandb is not installed; no table logged")
    return 0


def _progress_line(line: str) -> None:
    print(f"analysis: {line}", file=sys.stderr, flush=True)


def list_keys(roots: list[Path]) -> int:
    """Print every column of the runs under `roots` (run-level ones, then `cfg.*`)."""
    from dpresearch.analysis.runs import find_runs, load_summaries

    paths = find_runs(roots)
    if not paths:
        raise AnalysisError(f"no run directories under {', '.join(map(str, roots))}")
    columns = [str(c) for c in load_summaries(paths).columns]
    for column in sorted(columns, key=lambda c: (c.startswith("cfg."), c)):
        print(column)
    return 0


if __name__ == "__main__":
    sys.exit(main())
