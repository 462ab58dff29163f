"""Run directories load into DataFrames, tables and plots (dpresearch.analysis)."""

from __future__ import annotations

import math
import statistics

import pytest
from helpers import OPS, compose_config, ramp, write_run

from dpresearch.analysis import (
    AnalysisError,
    ReportSpec,
    add_modeled_time,
    aggregate,
    choose_selection,
    find_runs,
    load_metrics,
    load_metrics_many,
    load_report,
    load_summaries,
    markdown_table,
    plot_curves,
    select_best,
    time_to_accuracy,
    write_report,
)
from dpresearch.analysis.__main__ import main as analysis_main
from dpresearch.analysis.published import load_published
from dpresearch.analysis.wandb_table import log_table
from dpresearch.comm.network import NetworkModel
from dpresearch.train import train


def test_runs_become_a_table_and_a_plot(tmp_path):
    for name, compressor in (("dense", "identity"), ("sparse", "topk")):
        cfg = compose_config(
            f"compressor={compressor}",
            "train.steps=6",
            "train.log_every=2",
            "train.eval_every=3",
            "train.progress=false",
        )
        train(cfg, tmp_path / "runs" / name)
    runs = find_runs([tmp_path / "runs"])
    assert [r.name for r in runs] == ["dense", "sparse"]
    df = load_summaries(runs)
    assert list(df["cfg.compressor._target_"].str.rsplit(".", n=1).str[-1]) == ["Identity", "TopK"]
    assert df.loc[1, "comm/bytes"] < df.loc[0, "comm/bytes"] / 10
    table = markdown_table(df, ["cfg.compressor._target_", "comm/bytes"], {"comm/bytes": ".0f"})
    assert table.count("\n") == 3 and "TopK" in table
    metrics = load_metrics(runs[0])
    assert list(metrics["step"]) == [2, 3, 4, 6]
    assert metrics["test/acc"].notna().sum() == 2
    plot_curves(
        {"dense": runs[0], "sparse": runs[1]},
        "comm/bytes",
        "test/acc",
        tmp_path / "acc.png",
        logx=True,
    )
    assert (tmp_path / "acc.png").stat().st_size > 1000


# -- fixture run directories with known answers (acceptance A) ---------------------------------

# case: lr: (final test acc per seed 0,1,2; final train loss per seed)
GRID = {
    "A": {0.1: ((0.50, 0.60, 0.70), (0.9, 1.0, 1.1)), 0.01: ((0.80, 0.82, 0.84), (0.4, 0.5, 0.6))},
    "B": {
        0.1: ((0.70, 0.74, 0.78), (0.3, 0.3, 0.3)),
        0.01: ((0.60, 0.60, 0.60), (0.8, 0.8, 0.8)),
        # lowest loss of all, but seed 2 diverges: never selected, never averaged in
        1.0: ((0.90, 0.90, 0.10), (0.01, 0.01, float("nan"))),
    },
}


def write_fixture(root):
    for case, lrs in GRID.items():
        for lr, (accs, losses) in lrs.items():
            for seed, (acc, loss) in enumerate(zip(accs, losses, strict=True)):
                write_run(
                    root / case / f"lr{lr}" / f"s{seed}",
                    lr=lr,
                    seed=seed,
                    case=case,
                    accs=ramp(acc),
                    final_loss=loss,
                )
    # killed: a logged curve, no summary (and a torn last line)
    killed = write_run(
        root / "A" / "lr0.1" / "s3",
        lr=0.1,
        seed=3,
        case="A",
        accs=ramp(0.99),
        final_loss=0.0,
        finished=False,
    )
    with (killed / "metrics.jsonl").open("a") as f:
        f.write('{"step": 11, "epo')
    return root


def test_mean_std_and_status(tmp_path):
    runs = load_summaries(find_runs([write_fixture(tmp_path)]))
    assert len(runs) == 16
    assert runs["status"].value_counts().to_dict() == {
        "finished": 14,
        "diverged": 1,
        "unfinished": 1,
    }
    agg = aggregate(runs, ["case", "cfg.optimizer.lr"], ["test/acc", "train/loss"]).set_index(
        ["case", "cfg.optimizer.lr"]
    )
    row = agg.loc[("A", 0.01)]
    assert row["n"] == 3 and row["seeds"] == "0,1,2" and row["excluded"] == ""
    assert row["test/acc"] == pytest.approx(0.82)
    assert row["test/acc std"] == pytest.approx(statistics.stdev([0.80, 0.82, 0.84]))
    row = agg.loc[("A", 0.1)]  # the killed seed 3 is counted apart, not averaged
    assert (row["n"], row["runs"], row["excluded"]) == (3, 4, "1 unfinished")
    assert row["test/acc"] == pytest.approx(0.6)
    row = agg.loc[("B", 1.0)]
    assert (row["n"], row["excluded"], row["diverged"]) == (2, "1 diverged", 1)
    assert row["test/acc"] == pytest.approx(0.9) and row["test/acc std"] == 0
    everything = aggregate(runs, ["case", "cfg.optimizer.lr"], ["test/acc"], include_failed=True)
    assert everything.set_index(["case", "cfg.optimizer.lr"]).loc[("B", 1.0), "n"] == 3


def test_best_lr_is_selected_on_the_stated_metric(tmp_path):
    runs = load_summaries(find_runs([write_fixture(tmp_path)]))
    selection = choose_selection(list(runs.columns))  # no validation metric here
    assert (selection.metric, selection.mode) == ("train/loss", "min")
    assert "test set never selects" in selection.describe()
    agg = aggregate(runs, ["case", "cfg.optimizer.lr"], ["train/loss", "test/acc"])
    best = select_best(agg, ["case"], ["cfg.optimizer.lr"], selection)
    chosen = best[best["selected"]].set_index("case")["cfg.optimizer.lr"].to_dict()
    assert chosen == {"A": 0.01, "B": 0.1}  # B's lr 1.0 diverged on one seed
    on_test = choose_selection(list(runs.columns), "test/acc")
    assert on_test.mode == "max" and "overstates" in on_test.why
    best = select_best(agg, ["case"], ["cfg.optimizer.lr"], on_test)
    assert best[best["selected"]].set_index("case")["cfg.optimizer.lr"].to_dict() == {
        "A": 0.01,
        "B": 0.1,
    }
    with pytest.raises(AnalysisError, match="available: .*test/acc"):
        choose_selection(list(runs.columns), "val/acc")


def test_time_to_accuracy_on_a_repriced_network(tmp_path):
    root = tmp_path / "runs"
    write_run(root / "fast", lr=0.1, seed=0, accs=ramp(1.0), final_loss=0.1)  # 0.1 per step
    write_run(root / "slow", lr=0.1, seed=1, accs=ramp(0.4), final_loss=0.1)  # never 0.5
    paths = find_runs([root])
    runs, metrics = load_summaries(paths), load_metrics_many(paths)
    metrics = add_modeled_time(metrics, runs, "1gbe")
    tta = time_to_accuracy(metrics, "test/acc", 0.5, "1gbe").set_index("run")
    fast = tta.loc[str(root / "fast")]
    own = NetworkModel.from_units(20.0, 10.0).total_seconds(OPS)
    gbe = NetworkModel.preset("1gbe").total_seconds(OPS)
    assert fast["tta/reached"] == 1
    assert fast["tta/epoch"] == pytest.approx(1.0)  # step 5 of 5 per epoch
    assert fast["tta/bytes"] == 5000
    assert fast["tta/wall_s"] == 10
    assert fast["tta/modeled_s@1gbe"] == pytest.approx(0.05 * gbe / own)
    assert tta.loc[str(root / "slow"), "tta/reached"] == 0
    assert math.isnan(tta.loc[str(root / "slow"), "tta/epoch"])
    assert "tta/simulated_s" not in tta  # not logged by these runs


def test_report_excludes_and_reports_failed_runs(tmp_path):
    root = write_fixture(tmp_path / "runs")
    published = tmp_path / "published.csv"
    published.write_text("case,top1,citation\nA,91.5,Paper One (2020)\nC,80,Paper Two\n")
    spec = ReportSpec(
        target=0.7, network="1gbe", published=load_published(published, columns=["top1"])
    )
    report = load_report([root], spec)
    assert report.by == ["case"] and report.tune == ["cfg.optimizer.lr"]
    table = report.table.set_index("case")
    assert table.loc["A", "cfg.optimizer.lr"] == 0.01 and table.loc["B", "cfg.optimizer.lr"] == 0.1
    assert table.loc["A", "reached"] == "3/3" and table.loc["B", "reached"] == "3/3"
    # A at lr 0.01: accuracies ramp to 0.80/0.82/0.84 over 10 steps: ≥ 0.7 at step 9 each
    assert table.loc["A", "tta/epoch"] == pytest.approx(9 / 5)
    assert table.loc["A", "published top1"] == "91.5" and table.loc["A", "ref"] == "1"
    assert sorted(report.failed["status"]) == ["diverged", "unfinished"]
    assert any("matching no case: C" in n for n in report.notes)
    out = write_report(report, tmp_path / "out", plot_kinds=("png", "pdf"))
    text = out.read_text()
    assert "lowest mean final `train/loss`" in text
    assert "## Runs that did not finish" in text and "diverged" in text
    assert "16 runs: 14 finished, 1 diverged, 1 unfinished" in text
    assert "[1] Paper One (2020)" in text
    for name in (
        "table.md",
        "table.tex",
        "table.csv",
        "grid.csv",
        "runs.csv",
        "test_acc_vs_epoch.png",
        "train_loss_vs_comm_bytes.png",
        "test_acc_vs_modeled_s_1gbe.png",
        "test_acc_vs_epoch.pdf",
    ):
        assert (tmp_path / "out" / name).stat().st_size > 0, name
    assert len((tmp_path / "out" / "runs.csv").read_text().splitlines()) == 17
    assert r"$\pm$" in (tmp_path / "out" / "table.tex").read_text()
    assert "test/acc std" in (tmp_path / "out" / "table.csv").read_text()


def test_runs_sharing_a_label_are_kept_apart(tmp_path):
    root = tmp_path / "runs"
    for i, lr in enumerate((0.1, 0.01)):  # same case, same seed: one sweep without seeds
        write_run(
            root / f"r{i}",
            lr=lr,
            seed=0,
            case="same",
            accs=ramp(0.5 + i / 10),
            final_loss=1.0 - i / 10,
        )
    report = load_report([root], ReportSpec(tune=[]))
    assert report.table["n"].tolist() == [2]
    assert any("differ in cfg.optimizer.lr" in n for n in report.notes), report.notes
    report = load_report([root], ReportSpec())  # lr varies: selected, not merged
    assert report.grid["n"].tolist() == [1, 1]
    assert len(report.groups) == 1 and "lr=0.01" in next(iter(report.groups))


def test_cli_wrong_column_is_one_error_line(tmp_path, capsys):
    root = write_fixture(tmp_path / "runs")
    assert analysis_main([str(root), "--by", "case", "--metrics", "test/accuracy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: no metric 'test/accuracy' (did you mean 'test/acc'?); available:"
    )
    assert "test/acc" in err[0]
    assert analysis_main([str(root), "--format", "csv", "--target", "0.7"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("case,cfg.optimizer.lr,n,test/acc,test/acc std")
    assert "selected on: lowest mean final `train/loss`" in out


def test_final_table_as_wandb_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    report = load_report([write_fixture(tmp_path / "runs")], ReportSpec())
    assert log_table(report.table, report.columns, project="test", group="fixture")


def test_metrics_of_many_runs_load_in_one_frame(tmp_path):
    lines = {
        "a": ['{"step": 1, "x": 1, "phase": "warm"}', '{"step": 2, "x": "nan", "y": 0.5}'],
        "b": ['{"step": 1, "x": 1.5, "phase": 3}', '{"step": 2, "x": "-inf"}', '{"step": 3, "x'],
        "c": [],
    }
    for name, rows in lines.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(rows))
    df = load_metrics_many([tmp_path / n for n in lines])
    assert df["run"].astype(str).tolist() == [str(tmp_path / r) for r in "aabb"]
    assert df["step"].tolist() == [1, 2, 1, 2]  # b's torn last line is dropped
    assert df["x"].iloc[0] == 1 and df["x"].iloc[2] == 1.5
    assert df["x"].iloc[[1, 3]].isna().all()  # non-finite values read as missing
    assert df["y"].iloc[1] == 0.5 and df["y"].isna().sum() == 3
    assert df["phase"].tolist()[::2] == ["warm", 3]  # a type clash falls back, loses nothing


def test_recorded_status_wins_over_inference(tmp_path):
    write_run(tmp_path / "a", lr=0.1, seed=0, accs=ramp(0.5), final_loss=0.3, status="interrupted")
    write_run(tmp_path / "b", lr=0.1, seed=1, accs=ramp(0.5), final_loss=float("nan"))
    write_run(tmp_path / "c", lr=0.1, seed=2, accs=ramp(0.5), final_loss=0.3)
    runs = load_summaries(find_runs([tmp_path]))
    assert runs["status"].tolist() == ["interrupted", "diverged", "finished"]
    agg = aggregate(runs, ["cfg.optimizer.lr"], ["test/acc"])
    assert agg.loc[0, "n"] == 1 and agg.loc[0, "excluded"] == "1 diverged, 1 interrupted"


def untrained_status(cases: dict, classes: int = 10) -> dict[str, str]:
    """`mark_untrained`'s status of finished runs, each case's (train losses, test losses, test
    accuracy) logged at the same steps (None: not logged there)."""
    import pandas as pd

    from dpresearch.analysis.quality import mark_untrained

    summaries, steps = [], []
    for name, (losses, tested, acc) in cases.items():
        summaries.append(
            {
                "run": name,
                "status": "finished",
                "train/loss": losses[-1],
                "test/acc": acc,
                "data/classes": classes,
                "data/test_examples": 1000,
            }
        )
        steps += [
            {"run": name, "step": i, "train/loss": t, "test/loss": e}
            for i, (t, e) in enumerate(zip(losses, tested, strict=True))
        ]
    runs, metrics = pd.DataFrame(summaries), pd.DataFrame(steps)
    return dict(zip(runs["run"], mark_untrained(runs, metrics)["status"], strict=True))


def test_a_run_did_not_train_by_its_loss_or_its_chance_accuracy():
    """`mark_untrained`: a finished run whose training loss rose, or whose accuracy is at
    chance, did not train — unless the evaluated model's test loss fell (gossip workers on
    label-skewed data log local losses that rise while the averaged model improves)."""
    from dpresearch.analysis.quality import UNTRAINED

    cases = {
        "learnt": ([2.3, 1.5], [2.3, 1.6], 0.45),
        "local loss rose, averaged model learnt": ([1.6, 1.8], [2.4, 1.7], 0.35),
        "both losses rose": ([1.6, 1.8], [2.0, 2.4], 0.35),
        "rose, evaluated once": ([1.6, 1.8], [None, 2.0], 0.35),
        "at chance": ([2.3, 2.2], [2.3, 2.25], 0.10),
    }
    assert untrained_status(cases) == {
        "learnt": "finished",
        "local loss rose, averaged model learnt": "finished",
        "both losses rose": UNTRAINED,
        "rose, evaluated once": UNTRAINED,
        "at chance": UNTRAINED,
    }


def test_a_test_loss_that_fell_but_ends_above_a_uniform_prediction_did_not_train():
    """The exception needs the evaluated model to have trained: a run that blew up and
    recovered part of the way (test loss falling from 9.0 to 3.0 nats, above ln 10 = 2.30)
    did not train; a gossip run whose averaged model ends at 2.2 nats trained, though that is
    above its workers' first (local, label-skewed) training loss of 1.3; for a regression
    (one class: no uniform prediction) the bar is the first training loss."""
    from dpresearch.analysis.quality import UNTRAINED

    assert untrained_status(
        {
            "blew up, recovered part of the way": ([1.6, 9.5], [9.0, 3.0], 0.30),
            "just above uniform": ([1.6, 1.8], [2.4, 2.31], 0.30),
            "gossip, local loss below the averaged model's": ([1.3, 1.7], [2.4, 2.2], 0.30),
        }
    ) == {
        "blew up, recovered part of the way": UNTRAINED,
        "just above uniform": UNTRAINED,
        "gossip, local loss below the averaged model's": "finished",
    }
    assert untrained_status(
        {
            "regression, ends above its start": ([0.5, 0.8], [0.9, 0.6], None),
            "regression, ends below its start": ([0.5, 0.8], [0.9, 0.4], None),
        },
        classes=1,
    ) == {
        "regression, ends above its start": UNTRAINED,
        "regression, ends below its start": "finished",
    }
