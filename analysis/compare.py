"""Compare finished runs: a markdown table of their summaries and, optionally, curves.

    python analysis/compare.py outputs/ multirun/ --by cfg.compressor._target_ \
        --metrics test/acc comm/bytes_per_epoch --plot curves.png --x comm/bytes
"""

from __future__ import annotations

import argparse

from dpresearch.analysis import find_runs, load_summaries, markdown_table, plot_curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", help="run directories or folders holding them")
    parser.add_argument("--by", default="run", help="column that labels each run")
    parser.add_argument("--metrics", nargs="+", default=["test/acc", "comm/bytes_per_epoch"])
    parser.add_argument("--plot", help="write a PNG of --y against --x for every run")
    parser.add_argument("--x", default="epoch")
    parser.add_argument("--y", default="test/acc")
    args = parser.parse_args()
    runs = find_runs(args.roots)
    if not runs:
        raise SystemExit(f"no run directories (with summary.json) under {args.roots}")
    df = load_summaries(runs)
    print(markdown_table(df, [args.by, *args.metrics]))
    if args.plot:
        plot_curves(
            dict(zip(df[args.by].astype(str), df["run"], strict=True)), args.x, args.y, args.plot
        )
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
