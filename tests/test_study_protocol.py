"""The study protocol on stub objectives through the real harness (issue 18, A and B): grids
grow until the pick is interior or the bound, final seeds run only then, the report marks
choices won within the noise and never shows an edge pick without "bound reached"."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from helpers import STUB_VAL_EXAMPLES as VAL_EXAMPLES
from helpers import peak_at, stub_runner, stub_study

from dpresearch.analysis.quality import binomial_se
from dpresearch.study import StudyError, run_study
from dpresearch.study.report import report_study, selected_lrs
from dpresearch.study.spec import grid_values


def test_grids_are_log_spaced():
    assert grid_values({"from": 0.01, "to": 1, "per_decade": 2}, "lrs") == (
        (0.01, 0.032, 0.1, 0.32, 1.0),
        pytest.approx(10**0.5),
    )
    with pytest.raises(StudyError, match="not log-spaced"):
        grid_values([0.1, 0.2, 0.9], "lrs")


def test_a_grids_bounds_are_its_values_as_written():
    # 10^-1.5 = 0.0316 lies below `from: 0.032` and 10^-2.5 = 0.00316 below 0.0032: the bounds
    # still hold them, as the grid writes them (the first gossip study lost its 0.032 this way).
    assert grid_values({"from": 0.032, "to": 0.32, "per_decade": 2}, "lrs")[0] == (
        0.032,
        0.1,
        0.32,
    )
    assert grid_values({"from": 0.0032, "to": 0.01, "per_decade": 2}, "lrs")[0] == (0.0032, 0.01)
    assert grid_values({"from": 0.033, "to": 0.31, "per_decade": 2}, "lrs")[0] == (0.1,)


def test_a_grid_grows_past_its_edge_until_the_pick_is_interior_then_runs_the_final_seeds(
    tmp_path,
):
    """Acceptance A: the best lr (1.0) lies two steps above the initial grid; the harness adds
    0.32, 1 and 3.2 on the tuning seeds, picks 1 (interior), and only then runs the final
    seeds there. A second case is bounded at 0.32: its pick stays at the edge, the report says
    "bound reached", and its final seeds run at the bound."""
    study = stub_study(
        tmp_path,
        {
            "free": {"overrides": [], "lrs": [0.01, 0.032, 0.1]},
            "bounded": {"overrides": [], "lrs": [0.01, 0.032, 0.1], "lr_range": [0.001, 0.32]},
        },
    )
    ran: list[str] = []
    out = tmp_path / "out"
    run_study(
        study,
        out,
        launcher=stub_runner(lambda c, lr, s: peak_at(1.0)(c, lr, s), ran),
        log=lambda line: None,
    )

    def lrs_run(case, seeds):
        return [
            float(p.split("lr ")[1].split(" |")[0])
            for p in ran
            if p.startswith(case) and int(p.rsplit(" ", 1)[1]) in seeds
        ]

    assert sorted(set(lrs_run("free", (0, 1)))) == [0.01, 0.032, 0.1, 0.32, 1.0, 3.2]
    assert sorted(set(lrs_run("bounded", (0, 1)))) == [0.01, 0.032, 0.1, 0.32]
    assert lrs_run("free", (2, 3)) == [1.0, 1.0] and lrs_run("bounded", (2, 3)) == [0.32, 0.32]
    last_tuning = max(i for i, p in enumerate(ran) if p.endswith(("seed 0", "seed 1")))
    first_final = min(i for i, p in enumerate(ran) if p.endswith(("seed 2", "seed 3")))
    assert first_final > last_tuning  # no final seed before the grids stopped growing
    assert selected_lrs(study, out) == {"free": 1.0, "bounded": 0.32}

    text = report_study(study, out, tmp_path / "results").read_text()
    free = next(line for line in text.splitlines() if line.startswith("| free | 1 |"))
    bounded = next(line for line in text.splitlines() if line.startswith("| bounded | 0.32 |"))
    assert "edge" not in free and "bound reached" not in free
    assert "largest lr tried: bound reached" in bounded and "within [0.001, 0.32]" in bounded
    # the final seeds alone make the results row: test/acc of seeds 2, 3 at lr 1
    finals = [100 * (peak_at(1.0)("free", 1.0, s) - 0.01) for s in (2, 3)]
    assert f"{sum(finals) / 2:.1f} ± " in free

    ran.clear()  # resumed: nothing runs again
    run_study(study, out, launcher=stub_runner(peak_at(1.0), ran), log=lambda line: None)
    assert ran == []


def test_a_choice_won_within_the_noise_is_marked(tmp_path):
    """Acceptance B: two lrs 0.5 points apart on a 500-example validation split (binomial SE
    ≈ 2 points) — the report marks the choice; a choice won by 20 points is not marked."""
    values = {
        ("close", 0.032): 0.700,
        ("close", 0.1): 0.705,
        ("close", 0.32): 0.60,
        ("clear", 0.032): 0.50,
        ("clear", 0.1): 0.70,
        ("clear", 0.32): 0.45,
    }
    study = stub_study(
        tmp_path,
        {name: {"overrides": [], "lrs": [0.032, 0.1, 0.32]} for name in ("close", "clear")},
    )
    out = tmp_path / "out"
    run_study(
        study,
        out,
        launcher=stub_runner(lambda c, lr, s: values[(c, lr)] + 0.001 * s, []),
        log=lambda line: None,
    )
    text = report_study(study, out, tmp_path / "results").read_text()
    close = next(line for line in text.splitlines() if line.startswith("| close | 0.1 |"))
    clear = next(line for line in text.splitlines() if line.startswith("| clear | 0.1 |"))
    se = math.hypot(binomial_se(0.7055, VAL_EXAMPLES), binomial_se(0.7005, VAL_EXAMPLES))
    assert f"won by 0.5 < SE {100 * se:.1f} over lr 0.032: within noise" in close
    assert "within noise" not in clear
    # the selection cell carries its SE: seeds' spread and the split's binomial error
    spread = statistics.stdev([0.705, 0.706]) / math.sqrt(2)
    se_best = math.hypot(spread, binomial_se(0.7055, VAL_EXAMPLES))
    assert f"70.5 ± {100 * se_best:.1f} (n=2)" in close
    grid = text.split("Every lr tried")[1]
    assert "| close | 0.032 | 0,1 |" in grid and "| 2,3 |" in grid  # tuning and final apart


def test_a_study_of_another_lr_names_it_in_its_tables(tmp_path):
    # A study of the outer lr: its tables head the lr column with the key the grid sets.
    diloco = ["algorithm=local_sgd", "algorithm.period=2", "outer=nesterov"]
    study = stub_study(
        tmp_path,
        {"diloco": {"overrides": diloco, "lrs": [0.35, 0.7, 1.4]}},
        lr_key="outer.optimizer.lr",
    )
    out = tmp_path / "out"
    runner = stub_runner(peak_at(0.7), [], lr_key="outer.optimizer.lr")
    run_study(study, out, launcher=runner, log=lambda line: None)
    assert selected_lrs(study, out) == {"diloco": 0.7}
    text = report_study(study, out, tmp_path / "results").read_text()
    heads = [ln for ln in text.splitlines() if ln.startswith("| case | lr (outer.optimizer.lr) |")]
    assert len(heads) == 2, text  # the results table and every lr tried
    assert "| diloco | 0.7 |" in text


def test_a_study_selecting_on_one_seed_is_refused(tmp_path):
    study = stub_study(tmp_path, {"a": {"overrides": [], "lrs": [0.1, 0.32]}}, tune_seeds=[0])
    with pytest.raises(StudyError, match="at least 2"):
        run_study(
            study, tmp_path / "out", launcher=stub_runner(peak_at(1.0), []), log=lambda line: None
        )


def test_the_report_says_which_result_holds_at_which_horizon(tmp_path):
    """A claim judged at two horizons of the same runs: "slow" (EF-like: a late start) loses
    to "fast" after one epoch and beats it after four; each horizon selects its own lr, the
    verdict table states both, and nothing is said beyond the last horizon."""
    curves = {
        "slow": lambda acc, e: 0.15 + (acc - 0.15) * (e - 0.9) / 3.1,  # 17 % after 1 epoch
        "fast": lambda acc, e: min(acc, 0.55),  # flat at 55 % from the first epoch
    }
    accs = {
        ("slow", 0.1): 0.85,
        ("slow", 0.32): 0.80,
        ("slow", 0.032): 0.75,
        ("fast", 0.1): 0.60,
        ("fast", 0.32): 0.55,
        ("fast", 0.032): 0.50,
    }
    study = stub_study(
        tmp_path,
        {name: {"overrides": [], "lrs": [0.032, 0.1, 0.32]} for name in ("slow", "fast")},
        claim={
            "statement": "slow beats fast",
            "horizons": [1, 4],
            "expect": [{"better": "slow", "than": "fast"}],
        },
    )
    out = tmp_path / "out"
    ran: list[str] = []
    run_study(
        study,
        out,
        launcher=stub_runner(lambda c, lr, s: accs[(c, lr)] + 0.001 * s, ran, curves),
        log=lambda line: None,
    )
    assert len(ran) == 12 + 4  # no extension: both horizons pick lr 0.1 (interior)
    text = report_study(study, out, tmp_path / "results").read_text()
    claim = text.split("## Claim")[1].split("##")[0]
    row = next(line for line in claim.splitlines() if line.startswith("| slow > fast"))
    at_1, at_4 = row.split(" | ")[1:3]
    slow_1 = statistics.mean(curves["slow"](0.85 + 0.001 * s, 1) for s in (2, 3))
    assert at_1.startswith(f"does not hold ({100 * (slow_1 - 0.55):+.1f} ± ")
    assert at_4.startswith(f"holds ({100 * (0.8525 - 0.55):+.1f} ± ")
    assert "Nothing here is concluded about training longer than 4 epochs." in text
    assert "## Results at 1 epochs" in text and "## Results at 4 epochs" in text
    assert (tmp_path / "results" / "table_1_epochs.tex").exists()


def test_a_horizon_window_averages_the_last_evaluations():
    """At a constant lr one evaluation scatters: with `window`, a metric at horizon h is the
    mean of its values logged in (h·(1 − window), h]; counters keep their last value."""
    import pandas as pd

    from dpresearch.analysis.quality import at_horizon

    runs = pd.DataFrame({"run": ["a"], "status": ["finished"], "test/acc": [0.9]})
    metrics = pd.DataFrame(
        {
            "run": pd.Categorical(["a"] * 10),
            "step": range(1, 11),
            "epoch": [float(e) for e in range(1, 11)],
            "test/acc": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.5, 0.9],
            "comm/bytes": [float(e) for e in range(1, 11)],
        }
    )
    last, _ = at_horizon(runs, metrics, 10.0)
    mean, _ = at_horizon(runs, metrics, 10.0, window=0.3)  # epochs 8, 9, 10
    assert last["test/acc"].iloc[0] == 0.9
    assert mean["test/acc"].iloc[0] == pytest.approx((0.8 + 0.5 + 0.9) / 3)
    assert mean["comm/bytes"].iloc[0] == 10.0
    early, _ = at_horizon(runs, metrics, 4.0, window=0.3)  # (2.8, 4]: epochs 3 and 4
    assert (
        early["test/acc"].iloc[0] == pytest.approx(0.35) and early["status"].iloc[0] == "finished"
    )


def test_a_case_whose_every_lr_diverged_grows_below_its_grid(tmp_path):
    """Every lr of the initial grid diverges (0.1, 0.32, 1): no lr can be picked, so the harness
    adds the grid's step below (0.032), then keeps growing past the edge pick until it is
    interior (0.01 best, 0.0032 tried), and only then runs the final seeds at 0.01."""
    study = stub_study(tmp_path, {"hot": {"overrides": [], "lrs": [0.1, 0.32, 1.0]}})
    ran: list[str] = []
    inner = stub_runner(peak_at(0.01), ran)

    def runner(point, run_dir, overrides):
        inner(point, run_dir, overrides)
        if point.lr >= 0.1:  # the loss blew up: the trainer's summary says so
            summary = json.loads((run_dir / "summary.json").read_text())
            (run_dir / "summary.json").write_text(json.dumps({**summary, "status": "diverged"}))
        return 0

    lines: list[str] = []
    run_study(study, tmp_path / "out", launcher=runner, log=lines.append)
    tuned = sorted(
        {float(p.split("lr ")[1].split(" |")[0]) for p in ran if p.endswith(("seed 0", "seed 1"))}
    )
    assert tuned == [0.0032, 0.01, 0.032, 0.1, 0.32, 1.0]
    assert any(
        "hot: no lr tried can be picked (every one failed); adding lr 0.032" in line
        for line in lines
    )
    assert [p for p in ran if p.endswith(("seed 2", "seed 3"))] == [
        "hot | lr 0.01 | seed 2",
        "hot | lr 0.01 | seed 3",
    ]
    assert selected_lrs(study, tmp_path / "out") == {"hot": 0.01}


def test_modeled_time_is_repriced_on_every_network_the_study_names(tmp_path):
    """`network: [1gbe, wan_100mbit]` with `metrics: [comm/modeled_s@wan_100mbit]`: each run's
    modeled communication seconds in all, re-priced from its own network's price of its op
    table to the WAN preset's — the preset's own price of that table."""
    import pandas as pd

    from dpresearch.comm.network import NetworkModel
    from dpresearch.study.report import with_repriced_totals

    study = stub_study(
        tmp_path,
        {"a": [], "b": []},
        lrs=[0.1],
        network=["1gbe", "wan_100mbit"],
        metrics=["comm/modeled_s@wan_100mbit"],
    )
    assert study.networks == ("1gbe", "wan_100mbit")
    # the third run's ops hide behind one step of compute each: free on 1 GbE, not on the WAN
    ops = [
        [["allreduce", 1_000_000, 8, 0, 144]],
        [["allgather", 4096, 8, 0, 9]],
        [["allreduce", 65_536, 8, 0, 36, "", 1]],
    ]
    own = NetworkModel.preset("1gbe", 0.01)
    runs = pd.DataFrame(
        {
            "run": ["a0", "b0", "c0"],
            "comm/ops": ops,
            "comm/modeled_s": [own.total_seconds(o) for o in ops],
            "cfg.network.latency_us": [50.0] * 3,
            "cfg.network.bandwidth_gbit": [1.0] * 3,
            "cfg.network.compute_step_s": [0.01] * 3,
        }
    )
    assert runs["comm/modeled_s"][2] == 0.0
    priced = with_repriced_totals(study, runs)["comm/modeled_s@wan_100mbit"].tolist()
    wan = NetworkModel.preset("wan_100mbit", 0.01)
    assert priced == pytest.approx([wan.total_seconds(o) for o in ops], rel=1e-12)
    assert priced[0] > 10 * runs["comm/modeled_s"][0]  # 100 Mbit/s and 10 ms: far dearer
    assert priced[2] > 0.1  # 14 latency rounds of 10 ms are not hidden behind 10 ms of compute
    with pytest.raises(StudyError, match="network must be a preset name or a list"):
        stub_study(tmp_path, {"a": []}, lrs=[0.1], network={"name": "1gbe"})


def test_a_verdict_on_one_final_seed_says_so(tmp_path):
    """Seeds 0, 1 tune and seed 2 alone is final: each side's SE holds no seed-to-seed spread
    (issue 43), so the verdict carries "one final seed"; with two final seeds it does not."""
    for seeds, marked in (([0, 1, 2], True), ([0, 1, 2, 3], False)):
        folder = tmp_path / str(len(seeds))
        folder.mkdir()
        study = stub_study(
            folder,
            {name: {"overrides": [], "lrs": [0.032, 0.1, 0.32]} for name in ("a", "b")},
            seeds=seeds,
            claim={
                "statement": "a beats b",
                "horizons": [4],
                "expect": [{"better": "a", "than": "b"}],
            },
        )
        runner = stub_runner(lambda c, lr, s: peak_at(0.1)(c, lr, s) - 0.2 * (c == "b"), [])
        run_study(study, folder / "out", launcher=runner, log=lambda line: None)
        text = report_study(study, folder / "out", folder / "results").read_text()
        claim = text.split("## Claim")[1].split("##")[0]
        row = next(line for line in claim.splitlines() if line.startswith("| a > b"))
        assert row.split(" | ")[1].startswith("holds (+20.0"), row
        assert ("one final seed" in row) == marked, row


def test_a_bound_that_drops_its_nearest_grid_value_warns_and_the_dry_run_shows_lrs(
    tmp_path, capsys
):
    """`{from: 0.03, to: 0.3, per_decade: 2}` is 0.032, 0.1: 0.32, nearest to `to`, is left
    out, and the loader says so; 0.032 (nearest to `from`) is in, so `from` is not named. The
    dry run lists each case's lrs (issue 43)."""
    grid = {"from": 0.03, "to": 0.3, "per_decade": 2}
    cases = {"a": {"overrides": [], "lrs": grid}, "b": {"overrides": [], "lrs": [0.01, 0.1]}}
    study = stub_study(tmp_path, cases, seeds=[0, 1], tune_seeds=[0, 1])
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "warning: case 'a' lrs: to: 0.3 is not a grid value (10^(k/2)); the nearest, 0.32, lies "
        "above it and is left out: write to: 0.32 to try it"
    ]
    assert study.case("a").grid.values == (0.032, 0.1)
    run_study(
        study, tmp_path / "out", launcher=stub_runner(peak_at(0.1), []), dry_run=True, log=print
    )
    out = capsys.readouterr().out
    assert "   a: 4 missing (lrs 0.032, 0.1)" in out and "   b: 4 missing (lrs 0.01, 0.1)" in out
    stub_study(tmp_path, {"a": {"overrides": [], "lrs": {**grid, "to": 0.32}}})
    assert capsys.readouterr().err == ""  # 0.32 is a grid value: nothing dropped


def test_a_point_of_an_earlier_grid_left_running_in_the_book_does_not_stop_the_study(tmp_path):
    """A study whose grid changed after a killed run: status.json still books a point the study
    no longer has, as running. Only the current grid's points gate the extensions and the
    final seeds, so the study grows its grid and runs its final seeds."""
    study = stub_study(tmp_path, {"free": {"overrides": [], "lrs": [0.1, 0.32, 1.0]}})
    out = tmp_path / "out"
    out.mkdir()
    stale = {"case": "gone", "lr": 0.5, "seed": 0, "dir": "runs/gone/lr0.5/seed0",
             "status": "running", "pid": None}  # fmt: skip
    (out / "status.json").write_text(json.dumps({"points": {"gone | lr 0.5 | seed 0": stale}}))
    ran: list[str] = []
    lines: list[str] = []
    run_study(study, out, launcher=stub_runner(peak_at(1.0), ran), log=lines.append)
    assert not any("did not finish" in line for line in lines), lines
    assert "free | lr 3.2 | seed 0" in ran  # the edge pick 1.0 grew the grid
    assert [p for p in ran if p.endswith(("seed 2", "seed 3"))] == [
        "free | lr 1 | seed 2",
        "free | lr 1 | seed 3",
    ]
