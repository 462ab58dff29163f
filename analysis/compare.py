"""Compare runs: a thin wrapper over `python -m dpresearch.analysis` (kept for old commands).

    python analysis/compare.py outputs/ multirun/ --by cfg.compressor._target_ \
        --metrics test/acc comm/bytes_per_epoch --plot curves.png --x comm/bytes

Runs sharing a `--by` label are aggregated (mean ± std, `n`), never overwritten; several
`--by` keys may be given. `--plot` draws `--y` against `--x`, one line per label with a seed
band. Everything else (selection, time-to-accuracy, LaTeX/CSV, results.md) is in
`python -m dpresearch.analysis --help`.
"""

from __future__ import annotations

import argparse
import sys

from dpresearch.analysis.errors import AnalysisError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", help="run directories or folders holding them")
    parser.add_argument(
        "--by",
        nargs="+",
        help="columns that label a group (default: what differs between the runs but the seed)",
    )
    parser.add_argument("--metrics", nargs="+", default=["test/acc", "comm/bytes_per_epoch"])
    parser.add_argument("--plot", help="write a PNG of --y against --x for every label")
    parser.add_argument("--x", default="epoch")
    parser.add_argument("--y", default="test/acc")
    args = parser.parse_args()
    from dpresearch.analysis.plots import plot_groups
    from dpresearch.analysis.report import FORMATS, ReportSpec, headers, load_report
    from dpresearch.analysis.tables import markdown_table

    try:
        report = load_report(args.roots, ReportSpec(by=args.by, tune=[], metrics=args.metrics))
        print(markdown_table(report.table, report.columns, FORMATS, headers(report.columns)))
        for note in report.notes:
            print(f"note: {note}")
        if args.plot:
            plot_groups(report.metrics, report.groups, args.x, args.y, [args.plot])
            print(f"wrote {args.plot}")
    except AnalysisError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
