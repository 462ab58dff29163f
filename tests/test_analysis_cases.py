"""A newcomer's first comparison (issue 43, item 4), on a mixed sweep of synchronous SGD, local
SGD and local SGD with an outer optimizer over two seeds, as the trainer writes them: the
synchronous algorithm and the outer optimizer copy the seed into their own nodes
(`algorithm.seed`, `outer.seed`), local SGD has no such key.

- the seed and every key copying it never split a case;
- a case without a `--by` key is in every plot as in the table (its value "–");
- the tables read as a study's: metrics named with their unit, config keys by their short names,
  "mean ± std" from `tables.mean_std` (the study report's formatter), bytes without a spread.
"""

from __future__ import annotations

import json
import statistics

import pytest
import yaml
from helpers import ramp, write_run

from dpresearch.analysis import ReportSpec, load_report, write_report
from dpresearch.analysis.report import FORMATS, headers
from dpresearch.analysis.tables import markdown_table, percent, with_spread

# name → (algorithm choice, its node without the seed, copies the seed, outer node or None)
METHODS = {
    "sync": ("sync", {"_target_": "x.SyncSGD", "buffers": "broadcast"}, True, None),
    "local": ("local_sgd", {"_target_": "x.LocalSGD", "period": 8}, False, None),
    "diloco": ("local_sgd", {"_target_": "x.LocalSGD", "period": 8}, False,
               {"_target_": "x.OuterSGD", "lr": 0.7}),
}  # fmt: skip
SEEDS = (0, 1)


def final_acc(name: str, seed: int) -> float:
    return 0.5 + len(name) / 50 + seed / 20


def final_loss(name: str, seed: int) -> float:
    return 1.0 + len(name) / 100 + seed * 0.0123


def write_mixed(root, methods=METHODS):
    for name, (choice, node, copies, outer) in methods.items():
        for seed in SEEDS:
            run = write_run(
                root / f"{name}-s{seed}",
                lr=0.1,
                seed=seed,
                accs=ramp(final_acc(name, seed)),
                final_loss=final_loss(name, seed),
            )
            config = yaml.safe_load((run / "config.yaml").read_text())
            config["algorithm"] = {**node, **({"seed": seed} if copies else {})}
            config["data"] = {"_target_": "x.make_synthetic", "seed": seed}  # copies it too
            choices = {"algorithm": choice, "model": "mlp", "data": "synthetic", "outer": "none"}
            if outer is not None:
                config["outer"] = {**outer, "seed": seed}
                choices["outer"] = "sgd"
            (run / "config.yaml").write_text(yaml.safe_dump(config))
            (run / ".hydra").mkdir()
            (run / ".hydra" / "hydra.yaml").write_text(
                yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}, sort_keys=False)
            )
            summary = json.loads((run / "summary.json").read_text())
            summary["test/bpc"] = final_loss(name, seed) / 2
            (run / "summary.json").write_text(json.dumps(summary))
    return root


def test_the_seed_and_its_copies_never_split_a_case(tmp_path):
    report = load_report([write_mixed(tmp_path / "runs")], ReportSpec())
    table = report.table.set_index("case")
    assert sorted(table.index) == ["local_sgd(8)", "local_sgd(8), outer=sgd", "sync"]
    assert table["n"].tolist() == [2, 2, 2]
    assert table["seeds"].tolist() == ["0,1"] * 3
    cases = next(n for n in report.notes if n.startswith("cases:"))
    assert "seed" not in cases, cases  # neither algorithm.seed, outer.seed nor data.seed
    assert sorted(report.groups) == sorted(table.index)  # every case is plotted


def test_a_key_equal_to_the_seed_in_one_run_only_still_splits(tmp_path):
    """Value identity means every run that has the key: a real setting that happens to equal
    one run's seed is still a case key."""
    methods = {
        name: ("local_sgd", {"_target_": "x.LocalSGD", "period": period}, False, None)
        for name, period in (("a", 1), ("b", 4))
    }
    report = load_report([write_mixed(tmp_path / "runs", methods)], ReportSpec())
    assert sorted(report.table["case"]) == ["local_sgd(1)", "local_sgd(4)"]


def captured_figures(monkeypatch) -> list:
    """Every figure `write_report` draws, as (file stem, figure)."""
    import dpresearch.analysis.plots as plots

    drawn = []
    real = plots.plot_groups

    def spy(metrics, groups, x, y, outs, *args, **kwargs):
        fig = real(metrics, groups, x, y, outs, *args, **kwargs)
        drawn.append((outs[0].stem, fig))
        return fig

    monkeypatch.setattr(plots, "plot_groups", spy)
    return drawn


def legend_of(fig) -> list[str]:
    return [t.get_text() for t in fig.legends[0].get_texts()]


def test_a_case_without_a_by_key_is_in_every_plot_as_in_the_table(tmp_path, monkeypatch):
    drawn = captured_figures(monkeypatch)
    spec = ReportSpec(by=["choice.algorithm", "cfg.algorithm.period"])
    two = {k: METHODS[k] for k in ("sync", "local")}
    report = load_report([write_mixed(tmp_path / "runs", two)], spec)
    shown = markdown_table(report.table, report.columns, FORMATS, headers(report.columns))
    assert "| algorithm | period | n |" in shown
    assert "| sync | – | 2 |" in shown and "| local_sgd | 8 | 2 |" in shown
    write_report(report, tmp_path / "out")
    assert len(drawn) >= 6  # accuracy and loss against epochs, bytes, modeled time
    for stem, fig in drawn:
        assert sorted(legend_of(fig)) == ["local_sgd / 8 (n=2)", "sync / – (n=2)"], stem
        assert len(fig.axes[0].collections) == 2, stem  # one ± std band per case


def test_tables_read_as_the_study_report(tmp_path):
    report = load_report([write_mixed(tmp_path / "runs")], ReportSpec())
    shown = markdown_table(report.table, report.columns, FORMATS, headers(report.columns))
    head = shown.splitlines()[0]
    assert head == (
        "| case | n | test accuracy (%) | best test accuracy (%) | test loss (bits per "
        "character) | training loss, log window (nats) | MB sent per worker per "
        "epoch | excluded |"
    )
    row = next(line for line in shown.splitlines() if line.startswith("| sync |"))
    accs = [final_acc("sync", s) for s in SEEDS]
    losses = [final_loss("sync", s) for s in SEEDS]
    acc = f"{percent(statistics.mean(accs))} ± {percent(statistics.stdev(accs))}"
    loss = with_spread(statistics.mean(losses), statistics.stdev(losses))
    assert loss == "1.05 ± 0.01"  # three significant figures, the std to the same place
    assert row == f"| sync | 2 | {acc} | {acc} | 0.523 ± 0.004 | {loss} | 0.00500 MB |  |", row
    grid = report.grid_columns
    assert not any(h.startswith(("cfg.", "choice.")) for h in headers(grid).values())


def test_raw_byte_metrics_read_in_megabytes_as_the_study_report(tmp_path):
    """Byte counters asked for by name are shown as the derived MB columns are (the mean alone,
    three significant figures, the unit in every cell and the header): 10 steps of 1000 bytes
    are "0.0100 MB", 5000 bytes per epoch "0.00500 MB", never "1e+04 ± 0.0e+00"."""
    spec = ReportSpec(metrics=["comm/bytes", "comm/bytes_per_epoch"])
    report = load_report([write_mixed(tmp_path / "runs")], spec)
    shown = markdown_table(report.table, report.columns, FORMATS, headers(report.columns))
    head, _, *rows = shown.splitlines()
    assert head.startswith(
        "| case | n | data sent per worker (MB) | MB sent per worker per epoch |"
    ), head
    row = next(line for line in rows if line.startswith("| sync |"))
    assert row.startswith("| sync | 2 | 0.0100 MB | 0.00500 MB |"), row


@pytest.mark.parametrize(
    "column,head",
    [
        ("cfg.optimizer.lr", "lr"),
        ("choice.compressor", "compressor"),
        ("val/bpc", "validation loss (bits per character)"),
        ("test/loss", "test loss (nats)"),
        ("tta/modeled_s@1gbe", "modeled communication time on 1 GbE to the target (s)"),
    ],
)
def test_headers_name_units_and_short_keys(column, head):
    assert headers([column, "n"]) == {column: head, "n": "n"}
