"""Every shipped study regenerates its committed report from the repository alone (issue 18,
C), its figures carry units on both axes and distinct colours (issue 22, D), and its published
numbers name a source (issue 18, D)."""

from __future__ import annotations

import csv
import re
from collections import Counter
from pathlib import Path

import pytest
from helpers import REPO, project_files

from dpresearch.study import load_study
from dpresearch.study.report import build, load_data, relative, write

STUDIES = [p for p in project_files("experiments/*/*.yaml") if load_study(p).data_path.exists()]
UNIT = re.compile(r"\([^()]+\)$")


def test_every_study_ships_its_run_data():
    """The five studies (compression, PowerSGD Table 6, local SGD, gossip, asynchronous least
    squares) each ship run data and a report made from it."""
    folders = {p.parent.name for p in STUDIES}
    assert folders >= {
        "compression_subset",
        "powersgd_table6",
        "local_sgd",
        "gossip_subset",
        "async",
    }
    for path in STUDIES:
        assert load_study(path).data_path.stat().st_size < 2_000_000  # compact


# Files beside a report made by the study's own scripts, not by the report.
MADE_ELSEWHERE = {"full_scale_bytes.md", "modeled.md"}

# The largest reports (several seconds each) are slow; the default suite regenerates the rest.
SLOW_REPORTS = {"async", "diloco_scaling", "gossip_subset", "stragglers"}


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=pytest.mark.slow) if p.parent.name in SLOW_REPORTS else p
        for p in STUDIES
    ],
    ids=lambda p: f"{p.parent.name}/{p.stem}",
)
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
        for ax in (a for a in fig.axes if a.get_visible()):  # an unused panel is not drawn
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
    files = project_files("experiments/*/published*.csv")
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
    grace = {
        r["setting"]: r["value"]
        for r in csv.DictReader(
            (REPO / "experiments/compression_subset/published_grace.csv").open()
        )
    }
    assert "90.05" not in grace.values() and "90.77" not in grace.values()
    assert grace["GRACE: topk ratio 0.01, no memory"] == "84.77"
    assert grace["GRACE: no compression (baseline, plain SGD optimizer)"] == "89.13"


# Each shipped report's published rows: (case, value) pairs beside our cases (like for like) and
# in the "other setting" block, read back from the committed results.md.
SAME_HEADING = "## Published numbers in our case's setting"
OTHER_HEADING = "## Published, other setting"


def _published_blocks(text: str) -> dict[str, list[list[str]]]:
    """The rows of each published table of a results.md, cells stripped, by heading prefix."""
    blocks: dict[str, list[list[str]]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        for heading in (SAME_HEADING, OTHER_HEADING):
            if line.startswith(heading):
                rows = []
                for row in lines[i + 2 :]:
                    if not row.startswith("|"):
                        break
                    rows.append([c.strip() for c in row.strip("|").split(" | ")])
                blocks[heading] = rows
    return blocks


def test_published_rows_are_like_for_like_or_name_what_differs():
    """Issue 32, item 3: every published row either was measured in the setting of the case it
    names (empty `differs`) or names what differs; a row naming no case names what differs too.
    Each shipped report keeps the two apart: like-for-like rows in one table, the others in a
    "published, other setting" table headed by their case and what differs — no row in both."""
    for path in project_files("experiments/*/published*.csv"):
        with path.open() as f:
            rows = list(csv.DictReader(f))
        assert rows and "differs" in rows[0], path.name
        for row in rows:
            assert row["case"] or row["differs"], (path.name, row["setting"])
    checked = 0
    for path in STUDIES:
        study = load_study(path)
        if not study.published:
            continue
        with (path.parent / study.published["file"]).open() as f:
            rows = list(csv.DictReader(f))
        names = {c.name for c in study.cases}
        rows = [r for r in rows if r["case"] in names or not r["case"]]
        same = [(r["case"], r["value"]) for r in rows if r["case"] and not r["differs"]]
        other = [
            (r["case"], r["differs"], r["value"]) for r in rows if r["differs"] or not r["case"]
        ]
        blocks = _published_blocks((study.results_dir / "results.md").read_text())
        header = f"{path.parent.name}/{path.stem}"
        shown_same = blocks.get(SAME_HEADING, [])
        shown_other = blocks.get(OTHER_HEADING, [])
        if same:  # header row first; the case is the first column, the value the third
            assert shown_same[0][:3] == ["case", "setting", "value"], header
            assert [(r[0], r[2]) for r in shown_same[2:]] == same, header
        else:
            assert not shown_same, header
        if other:
            head = shown_other[0][:4]
            assert head == ["nearest case of ours", "what differs", "setting", "value"], header
            assert [(r[0], r[1], r[3]) for r in shown_other[2:]] == other, header
        else:
            assert not shown_other, header
        checked += 1
    assert checked >= 7


def test_published_split_keeps_other_settings_out_of_the_join():
    """`split_by_setting` and `join_published` agree: a row naming what differs, or no case,
    is never beside our case; a like-for-like row is, and the join says why a row is left out."""
    import pandas as pd

    from dpresearch.analysis.published import Published, join_published, split_by_setting

    frame = pd.DataFrame(
        {
            "case": ["A", "A", "", "B"],
            "differs": ["", "levels 64 (ours 1)", "no case", ""],
            "value": [1.0, 2.0, 3.0, 4.0],
            "source": ["p", "q", "r", "s"],
        }
    )
    same, other = split_by_setting(frame)
    assert list(same["value"]) == [1.0, 4.0] and list(other["value"]) == [2.0, 3.0]
    published = Published(Path("x.csv"), frame, "case", ["value"], "source", ["p", "q", "r", "s"])
    table, notes = join_published(pd.DataFrame({"case": ["A", "B"]}), published, "case")
    assert list(table["published value"]) == ["1.0", "4.0"]
    assert "published A not joined, other setting: levels 64 (ours 1)" in notes


def test_plots_keep_distinct_colours_up_to_twenty_series(tmp_path):
    import pandas as pd

    from dpresearch.analysis.plots import plot_groups

    rows = [
        {"run": f"r{i}", "step": s, "epoch": float(s), "test/acc": 0.1 * s + 0.01 * i}
        for i in range(20)
        for s in (3, 1, 2)
    ]
    metrics = pd.DataFrame(rows)
    fig = plot_groups(
        metrics,
        {f"case {i}": [f"r{i}"] for i in range(20)},
        "epoch",
        "test/acc",
        [tmp_path / "x.png"],
    )
    # 20 cases are drawn in panels (more than MAX_SERIES), the first case in each: its repeats
    # are unlabelled, so the labelled lines are the 20 cases once
    lines = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label()[:1] != "_"]
    assert len(fig.axes) > 1 and len(lines) == 20
    assert len({str(line.get_color()) for line in lines}) == 20
    assert all(list(line.get_xdata()) == sorted(line.get_xdata()) for line in lines)  # in x order
    assert fig.axes[0].get_ylabel() == "test accuracy (%)"
    assert max(lines[0].get_ydata()) == pytest.approx(30.0)  # a fraction shown in %
