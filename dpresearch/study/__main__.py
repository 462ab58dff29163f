"""`python -m dpresearch.study run|status|report|unpack STUDY.yaml`: run a study, show where it
stands, write its results.md, or unpack its shipped run data into run directories (to add seeds
or grow a grid without re-running it). Runs go to `runs/<study name>/` under the current
directory (or `--out`), results beside the study file in `results/` (or `--results`).
Problems are one `error:` line, exit 2; a run whose points failed (the others ran) ends with one
`error:` line naming them, exit 1."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dpresearch.analysis.errors import AnalysisError, require_modules
from dpresearch.study.spec import StudyError, load_study, slug


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dpresearch.study", description=" ".join(__doc__.split())
    )
    p.add_argument(
        "action",
        choices=("run", "status", "report", "unpack"),
        help="run: start the points not yet done; status: show where the study stands; "
        "report: write results.md, tables and plots; unpack: the shipped run data as run "
        "directories under --out, so `run` adds only what is missing",
    )
    p.add_argument("study", type=Path, help="the study YAML")
    p.add_argument(
        "--out", type=Path, help="runs folder (default: runs/<study name> in the current directory)"
    )
    p.add_argument(
        "--results",
        type=Path,
        help="report folder (default: the study's `results`, else <study dir>/results)",
    )
    p.add_argument("--launcher", default="local", choices=("local", "hydra", "inprocess"))
    p.add_argument("--hydra-launcher", help="with --launcher hydra: e.g. parallel, slurm")
    p.add_argument("--jobs", type=int, default=1, help="local launcher: points at once")
    p.add_argument(
        "--start-until",
        type=float,
        metavar="SECONDS",
        help="start no point after SECONDS (a time-limited allocation; run again to go on)",
    )
    p.add_argument("--only", nargs="+", help="these cases only")
    p.add_argument("--dry-run", action="store_true", help="show what would run")
    p.add_argument("--report", action="store_true", help="run: write the report at the end")
    p.add_argument(
        "--include-failed",
        action="store_true",
        help="report: average diverged and unfinished runs too",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    failed: list[str] = []
    try:
        study = load_study(args.study)
        if args.action == "report" or args.report:  # before any point runs, not after
            require_modules("pandas", "matplotlib", purpose="the study report")
        out = args.out or Path("runs") / slug(study.name)
        results = args.results or study.results_dir
        if args.action == "report" or args.report:
            from dpresearch.analysis.report import check_out_dir

            check_out_dir(results, "--results")
        if args.action == "unpack":
            from dpresearch.study.unpack import unpack_study

            print(f"unpacked {unpack_study(study, out)} runs into {out / 'runs'}")
        if args.action == "status" and _shipped_status(study, out, args.study):
            pass
        elif args.action in ("run", "status"):
            from dpresearch.study.launcher import run_study, summarize

            records = run_study(
                study,
                out,
                launcher=args.launcher,
                jobs=args.jobs,
                start_until=None if args.start_until is None else time.time() + args.start_until,
                hydra_launcher=args.hydra_launcher,
                only=args.only,
                dry_run=args.dry_run or args.action == "status",
                log=lambda line: print(line, flush=True),
            )
            book = out / "status.json"
            print(
                f"== points: {summarize(records)}"
                + (f" (status in {book})" if book.exists() else f" (runs go to {out / 'runs'})")
            )
            if args.action == "status":
                from dpresearch.study.status import describe, directory_points, tally

                print("== runs on disk, by part of the protocol:")
                print("\n".join(describe(tally(study, directory_points(out)))))
            failed = [point for point, r in records.items() if r.get("status") == "failed"]
        if args.action == "report" or args.report:
            from dpresearch.study.report import report_study

            path = report_study(study, out, results, args.include_failed)
            print(f"wrote {path}")
    except (StudyError, AnalysisError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.action == "run" and failed:  # as a sweep: the others ran, the failures are named
        print(
            f"error: {len(failed)} of {len(records)} points failed: {'; '.join(failed)} "
            f"(their logs: launcher.log in each point's folder under {out / 'runs'})",
            file=sys.stderr,
        )
        return 1
    return 0


def _shipped_status(study, out: Path, study_file: Path) -> bool:
    """`status` of a study with no run directories under `out` but shipped run data: print
    what the run data holds and how to add runs; False (nothing printed) otherwise."""
    from dpresearch.analysis.runs import find_runs
    from dpresearch.study.status import describe, packed_points, tally

    if not study.data_path.exists() or ((out / "runs").is_dir() and find_runs([out / "runs"])):
        return False
    points = packed_points(study)
    print(
        f"== study {study.name}: no runs under {out / 'runs'}; its shipped run data "
        f"({study.data_path.name}) holds {len(points)} runs:"
    )
    print("\n".join(describe(tally(study, points))))
    print(
        f"== to add runs (more seeds, a grown grid): python -m dpresearch.study unpack "
        f"{study_file} --out {out}, then `run {study_file} --out {out}` runs only what is "
        "missing"
    )
    return True


if __name__ == "__main__":
    sys.exit(main())
