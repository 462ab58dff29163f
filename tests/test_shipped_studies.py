"""Every shipped study regenerates its committed report from the repository alone (issue 18,
C), its figures carry units on both axes and distinct colours (issue 22, D), and its published
numbers name a source (issue 18, D)."""

from __future__ import annotations

import csv
import re
from collections import Counter

import pytest
from helpers import REPO

from dpresearch.study import load_study
from dpresearch.study.report import build, load_data, relative, write

STUDIES = sorted(p for p in REPO.glob("experiments/*/*.yaml") if load_study(p).data_path.exists())
UNIT = re.compile(r"\([^()]+\)$")


def test_every_study_ships_its_run_data():
    """The five studies (compression, PowerSGD Table 6, local SGD, gossip, asynchronous least
    squares) each ship run data and a report made from it."""
    folders = {p.parent.name for p in STUDIES}
    assert folders >= {"compression_subset", "powersgd_table6", "local_sgd", "gossip_subset",
                       "async"}  # fmt: skip
    for path in STUDIES:
        assert load_study(path).data_path.stat().st_size < 2_000_000  # compact


# Files beside a report made by the study's own scripts, not by the report.
MADE_ELSEWHERE = {"full_scale_bytes.md", "modeled.md"}

# The two largest reports (several seconds each) are slow; the default suite regenerates the rest.
SLOW_REPORTS = {"async", "gossip_subset"}


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if p.parent.name in SLOW_REPORTS else p
     for p in STUDIES],
    ids=lambda p: f"{p.parent.name}/{p.stem}",
)  # fmt: skip
def test_report_regenerates_byte_for_byte_with_readable_figures(path, tmp_path):
    study = load_study(path)
    command = f"python -m dpresearch.study report {relative(study.path)}"
    report = build(study, *load_data(study))
    results, plots = write(report, tmp_path, command)
    committed = study.results_dir
    made = sorted(p.name for p in tmp_path.iterdir())
    shipped = sorted(  # a folder inside is another study's results (e.g. results/ef_claim)
        p.name for p in committed.iterdir() if p.is_file() and p.name not in MADE_ELSEWHERE
    )
    assert made == shipped
    for name in made:
        assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), name
    text = results.read_text()
    assert "/work/" not in text and str(REPO) not in text  # paths relative to the repository

    for png, fig in plots:
        for ax in fig.axes:
            assert UNIT.search(ax.get_xlabel()), (png.name, ax.get_xlabel())
            assert UNIT.search(ax.get_ylabel()), (png.name, ax.get_ylabel())
            colours = Counter(
                str(line.get_color()) for line in ax.get_lines() if line.get_label()[:1] != "_"
            )
            repeated = sum(n - 1 for n in colours.values() if n > 1)
            assert repeated <= 1, (png.name, colours)


def test_published_numbers_name_their_source_and_unit():
    """Every published value sits in a CSV row with its unit, set-up and a source a reader can
    open (a URL, or a paper with its table); its `case` is one of a study's in that folder."""
    files = sorted(REPO.glob("experiments/*/published*.csv"))
    assert files
    for path in files:
        cases = {c.name for s in path.parent.glob("*.yaml") for c in load_study(s).cases}
        with path.open() as f:
            rows = list(csv.DictReader(f))
        for row in rows:
            assert row["value"] and row["unit"] and row["source"], row
            assert "http" in row["source"] or "Table" in row["source"], row["source"]
            assert row["case"] in cases or row["case"] == "", row["case"]
            assert "RECIPES" not in row["source"]  # never a second-hand summary
    grace = {r["setting"]: r["value"] for r in csv.DictReader(
        (REPO / "experiments/compression_subset/published_grace.csv").open())}  # fmt: skip
    assert "90.05" not in grace.values() and "90.77" not in grace.values()
    assert grace["GRACE: topk ratio 0.01, no memory"] == "84.77"
    assert grace["GRACE: no compression (baseline, plain SGD optimizer)"] == "89.13"


def test_plots_keep_distinct_colours_up_to_twenty_series(tmp_path):
    import pandas as pd

    from dpresearch.analysis.plots import plot_groups

    rows = [{"run": f"r{i}", "step": s, "epoch": float(s), "test/acc": 0.1 * s + 0.01 * i}
            for i in range(20) for s in (3, 1, 2)]  # fmt: skip
    metrics = pd.DataFrame(rows)
    fig = plot_groups(metrics, {f"case {i}": [f"r{i}"] for i in range(20)}, "epoch", "test/acc",
                      [tmp_path / "x.png"])  # fmt: skip
    lines = fig.axes[0].get_lines()
    assert len({str(line.get_color()) for line in lines}) == 20
    assert all(list(line.get_xdata()) == sorted(line.get_xdata()) for line in lines)  # in x order
    assert fig.axes[0].get_ylabel() == "test accuracy (%)"
    assert max(lines[0].get_ydata()) == pytest.approx(30.0)  # a fraction shown in %

