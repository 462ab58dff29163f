"""Run data for the studies whose run directories are gone: built from the `runs.csv` their
last report wrote (one row per run: status, study point, final metrics).

The compression, PowerSGD-Table-6 and local-SGD studies ran on a GPU machine whose run
directories were not kept; only their reports' `results/runs.csv` (commit 282f1d4) survive.
This turns such a file into the study's shipped run data (`dpresearch.analysis.rundata`) so
`python -m dpresearch.study report` regenerates their reports from the repository. What the
CSV does not hold is not invented: no curves (so no plots, no time-to-accuracy, no horizon
other than the end), no config beyond the seed and the lr (read from the study point). The
data-set sizes every one of those runs used (CIFAR-10 subset: 10 classes, 4577 training
examples of which 508 held out for validation, 1017 test) are added to each summary, since
the standard errors need them.

    python experiments/legacy_rundata.py experiments/local_sgd/study.yaml \
        experiments/local_sgd/results/runs.csv
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

from dpresearch.analysis.rundata import write_rundata
from dpresearch.study.spec import load_study

SUBSET = {
    "data/classes": 10,
    "data/train_examples": 4577,
    "data/val_examples": 508,
    "data/test_examples": 1017,
}
DERIVED = ("tta/", "MB")  # columns the old report computed; the new one recomputes what it can
KEYS = ("run", "status", "study", "case", "point")


def _value(text: str):
    if text == "":
        return None
    try:
        number = float(text)
    except ValueError:
        return text
    if not math.isfinite(number):
        return str(number)
    return int(number) if number.is_integer() and "." not in text and "e" not in text else number


def records(runs_csv: Path) -> list[dict]:
    out = []
    with runs_csv.open() as f:
        for row in csv.DictReader(f):
            point = row["point"]  # "case | lr 0.1 | seed 0"
            lr = float(point.split("| lr ")[1].split(" |")[0])
            seed = int(point.rsplit("seed ", 1)[1])
            summary = {
                k: _value(v)
                for k, v in row.items()
                if k not in KEYS and not k.startswith(DERIVED) and v != ""
            }
            summary.update(SUBSET, status=row["status"])
            out.append(
                {
                    "run": "runs/" + row["run"].split("/runs/", 2)[-1],
                    "point": {"study": row["study"], "case": row["case"], "point": point},
                    "choices": {},
                    "config": {"seed": seed, "optimizer": {"lr": lr}},
                    "summary": summary,
                    "curves": {},
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", type=Path)
    parser.add_argument("runs_csv", type=Path)
    args = parser.parse_args()
    study = load_study(args.study)
    header = {
        "study": study.name,
        "source": "results/runs.csv of commit 282f1d4 (final "
        "metrics only; the run directories were not kept)",
    }
    path = write_rundata(records(args.runs_csv), study.data_path, header)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
