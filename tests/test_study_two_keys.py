"""A study tuning a second key per case beside the lr (issue 40, item 1: `tune_also`): the 2-D
grid expanded into points, each key's grid grown past its edges until the joint pick is
interior on both (or a bound), the final seeds at the joint pick only, and the report's tables
with both keys and the selection and "within noise" per key."""

from __future__ import annotations

import json
import math
import statistics

import yaml
from helpers import SMALL, STUB_VAL_EXAMPLES, stub_runner, stub_study

from dpresearch.analysis.quality import binomial_se
from dpresearch.study import load_study, run_study
from dpresearch.study.__main__ import main as study_main
from dpresearch.study.report import report_study, selected_lrs

DILOCO = ["algorithm=local_sgd", "algorithm.period=2", "outer=nesterov"]
OUTER = "outer.optimizer.lr"


def test_a_two_key_dry_run_lists_every_pair(tmp_path, capsys):
    body = {
        "name": "two", "common": [*SMALL, "train.steps=4"], "seeds": [0, 1], "lrs": [0.1, 0.05],
        "tune_also": {"key": OUTER, "values": [0.35, 0.7, 1.4]},
        "cases": {"diloco": DILOCO, "sync": {"overrides": [], "tune_also": None},
                  "diloco own": {"overrides": DILOCO, "tune_also": {"values": [0.5, 1.0]}}},
    }  # fmt: skip
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    study = load_study(path)
    ids = [p.id for p in study.points() if p.seed == 0]
    assert ids == [
        *(
            f"diloco | lr {lr} | {OUTER} {o} | seed 0"
            for lr in (0.1, 0.05)
            for o in (0.35, 0.7, 1.4)
        ),
        "sync | lr 0.1 | seed 0",
        "sync | lr 0.05 | seed 0",
        *(f"diloco own | lr {lr} | {OUTER} {o} | seed 0" for lr in (0.1, 0.05) for o in (0.5, 1)),
    ]
    point = study.points()[2]
    assert str(point.dir) == f"runs/diloco/lr0.1/{OUTER}0.7/seed0"
    assert point.overrides[-3:] == ("optimizer.lr=0.1", f"{OUTER}=0.7", "seed=0")
    assert study_main(["run", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "== study two: 24 points" in out  # (6 + 2 + 4) settings × 2 seeds
    assert "diloco: 12 missing" in out and "sync: 4 missing" in out
    # the second key is checked as the lr is: set by a case, or misspelt, it is one line
    body["cases"]["diloco"] = [*DILOCO, f"{OUTER}=0.5"]
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    assert study_main(["run", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"error: case 'diloco' sets {OUTER}; the study sets it (lrs, tune_also, seeds, "
        "and the run directory)"
    )
    body["cases"]["diloco"] = DILOCO
    body["tune_also"]["key"] = "outer.optimizerr.lr"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    assert study_main(["run", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: tune_also key outer.optimizerr.lr: outer.optimizerr is not"), err


def objective(case: str, setting: tuple[float, float], seed: int) -> float:
    """Validation accuracy 0.8 at lr 0.1 and outer lr 1.4, falling by 0.5 per decade² of the
    lr (a clear choice) and 0.01 per decade² of the outer lr (nearly flat), +0.001 per seed."""
    lr, outer = setting
    return (
        0.8 - 0.5 * math.log10(lr / 0.1) ** 2 - 0.01 * math.log10(outer / 1.4) ** 2 + 0.001 * seed
    )


def test_the_second_key_grows_past_its_edge_then_the_final_seeds_run_at_the_pair(tmp_path):
    """The outer lr's best (1.4) lies beyond the initial [0.35, 0.7]: the harness adds 1.4,
    then 2.8, each crossed with every lr tried, picks (0.1, 1.4) — interior on both keys — and
    only then runs the final seeds there. A case bounded at 0.7 stays at its edge: "bound
    reached" on that key. The report gives both keys in its tables and says per key which
    choice is within noise (the outer lr's, nearly flat here; not the lr's)."""
    study = stub_study(
        tmp_path,
        {
            "free": {"overrides": DILOCO},
            "bounded": {"overrides": DILOCO, "tune_also": {"range": [0.1, 0.7]}},
        },
        lrs=[0.032, 0.1, 0.32],
        lr_key="optimizer.lr",
        tune_also={"key": OUTER, "values": [0.35, 0.7]},
    )
    ran: list[str] = []
    out = tmp_path / "out"
    logged: list[str] = []
    run_study(study, out, launcher=stub_runner(objective, ran), log=logged.append)

    def tried(case, seeds):
        return {
            (float(p.split(" | ")[1][3:]), float(p.split(" | ")[2].split()[1]))
            for p in ran
            if p.startswith(case) and int(p.rsplit(" ", 1)[1]) in seeds
        }

    lrs = (0.032, 0.1, 0.32)
    assert tried("free", (0, 1)) == {(lr, o) for lr in lrs for o in (0.35, 0.7, 1.4, 2.8)}
    assert tried("bounded", (0, 1)) == {(lr, o) for lr in lrs for o in (0.35, 0.7)}
    assert tried("free", (2, 3)) == {(0.1, 1.4)} and tried("bounded", (2, 3)) == {(0.1, 0.7)}
    last_tuning = max(i for i, p in enumerate(ran) if p.endswith(("seed 0", "seed 1")))
    first_final = min(i for i, p in enumerate(ran) if p.endswith(("seed 2", "seed 3")))
    assert first_final > last_tuning  # no final seed before the grids stopped growing
    assert (
        f"== free: the pick is at an edge of its grid; adding lr 0.032 | {OUTER} 1.4, "
        f"lr 0.1 | {OUTER} 1.4, lr 0.32 | {OUTER} 1.4"
    ) in logged
    assert selected_lrs(study, out) == {"free": 0.1, "bounded": 0.1}
    point = json.loads(
        (out / "runs/free/lr0.1/outer.optimizer.lr1.4/seed2/study_point.json").read_text()
    )
    assert point["also"] == {OUTER: 1.4}

    text = report_study(study, out, tmp_path / "results").read_text()
    heads = [ln for ln in text.splitlines() if ln.startswith(f"| case | lr | {OUTER} |")]
    assert len(heads) == 2, text  # the results table and every setting tried
    free = next(ln for ln in text.splitlines() if ln.startswith("| free | 0.1 | 1.4 |"))
    bounded = next(ln for ln in text.splitlines() if ln.startswith("| bounded | 0.1 | 0.7 |"))
    # outer lr 0.7 and 2.8 lie log10(2) from 1.4: 0.01·log10(2)² = 0.09 points below (0.7
    # first: the stable order); SE: the seeds' spread and each 500-example split's
    best, second = 0.8005, 0.8005 - 0.01 * math.log10(2) ** 2
    spread = statistics.stdev([0.0, 0.001]) / math.sqrt(2)
    se = math.hypot(
        spread, binomial_se(best, STUB_VAL_EXAMPLES), spread, binomial_se(second, STUB_VAL_EXAMPLES)
    )
    assert f"won by 0.1 < SE {100 * se:.1f} over {OUTER} 0.7: within noise" in free, free
    assert "over lr" not in free and "edge" not in free and "bound reached" not in free
    assert f"largest {OUTER} tried: bound reached" in bounded and "within [0.1, 0.7]" in bounded
    grid = text.split("Every lr tried")[1]
    assert grid.count("| free |") == 12 and grid.count("| bounded |") == 6
    assert "| free | 0.1 | 1.4 | 0,1 |" in grid and "| 2,3 |" in grid
    assert "**Two keys:**" in text
    assert "several runs with the same seed" not in text  # one run per seed at each pair
    ran.clear()  # resumed: nothing runs again
    run_study(study, out, launcher=stub_runner(objective, ran), log=lambda line: None)
    assert ran == []


def test_a_study_still_running_reports_before_a_two_key_case_has_run(tmp_path):
    """`study report` while a study runs (its points of a two-key case not started yet): the
    report is written, the case's row says "not run", and no other case's counts change."""
    study = stub_study(
        tmp_path,
        {"sync": {"overrides": [], "tune_also": None}, "diloco": {"overrides": DILOCO}},
        lrs=[0.032, 0.1, 0.32],
        tune_also={"key": OUTER, "values": [0.35, 0.7, 1.4]},
    )
    out = tmp_path / "out"
    peak = stub_runner(lambda case, lr, seed: 0.8 - abs(math.log10(lr / 0.1)), [])
    run_study(study, out, launcher=peak, only=["sync"], log=lambda line: None)
    text = report_study(study, out, tmp_path / "results").read_text()
    assert "| diloco | – | – |" in text and "not run" in text.split("| diloco |")[1], text
    assert "| sync | 0.1 | – |" in text
    assert "grids grown past their initial lrs: 0 of 2 tuned cases" in text
