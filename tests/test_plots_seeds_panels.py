"""Plots a reader trusts (issue 40, item 5): a case whose seeds may disagree shows each seed as a
thin line beside its mean; more than `MAX_SERIES` cases are split into panels by family, the
first case in every panel. Read from the matplotlib figure objects."""

from __future__ import annotations

import pandas as pd
import pytest

from dpresearch.analysis.plots import (
    MAX_SERIES,
    SEED_LINES,
    SEED_WIDTH,
    family,
    panels,
    plot_groups,
    seeds_disagree,
)

STEPS = (1, 2, 3, 4)


def frame(finals: dict[str, float]) -> pd.DataFrame:
    """One run per entry, its test/acc rising linearly from 0 to its final value."""
    rows = [
        {"run": run, "step": s, "epoch": float(s), "test/acc": final * s / STEPS[-1]}
        for run, final in finals.items()
        for s in STEPS
    ]
    return pd.DataFrame(rows)


def lines(ax, thin: bool) -> list:
    """The axes' data lines: the thin per-run ones, or the labelled means."""
    out = [ln for ln in ax.get_lines() if ln.get_xdata().size == len(STEPS)]
    return [ln for ln in out if (ln.get_linewidth() == SEED_WIDTH) == thin]


def test_seeds_disagree_rule():
    assert not seeds_disagree([0.5])  # one run: nothing to show beside it
    assert seeds_disagree([0.5, 0.5])  # 2..SEED_LINES runs: always
    assert seeds_disagree([0.1] * SEED_LINES)
    many = SEED_LINES + 3
    assert not seeds_disagree([0.40 + 0.01 * i for i in range(many)])  # evenly spread
    split = [0.40, 0.41, 0.42, 0.43, 0.70, 0.71, 0.72, 0.73]  # two clusters, mean between
    assert len(split) == many and seeds_disagree(split)


def test_a_case_with_few_seeds_shows_each_beside_the_mean(tmp_path):
    finals = {"a0": 0.3, "a1": 0.6, "a2": 0.35, "b0": 0.5}
    groups = {"A": ["a0", "a1", "a2"], "B": ["b0"]}
    fig = plot_groups(frame(finals), groups, "epoch", "test/acc", [tmp_path / "p.png"])
    (ax,) = fig.axes
    thin, means = lines(ax, True), lines(ax, False)
    assert len(means) == 2 and len(thin) == 3  # B's single run has no seed lines
    assert all(ln.get_linewidth() < means[0].get_linewidth() for ln in thin)
    assert all(ln.get_label().startswith("_") for ln in thin)  # not in the legend
    assert {ln.get_color() for ln in thin} == {means[0].get_color()}  # A's colour
    # each thin line is one run's own curve (in %): the finals as written
    assert sorted(round(ln.get_ydata()[-1], 6) for ln in thin) == [30.0, 35.0, 60.0]
    assert "Thin lines" in fig.dpresearch_caption


def test_many_agreeing_seeds_show_the_band_only(tmp_path):
    n = SEED_LINES + 3
    finals = {f"a{i}": 0.40 + 0.01 * i for i in range(n)}
    fig = plot_groups(frame(finals), {"A": list(finals)}, "epoch", "test/acc", [tmp_path / "p.png"])
    assert len(lines(fig.axes[0], True)) == 0 and len(lines(fig.axes[0], False)) == 1
    assert "Thin lines" not in fig.dpresearch_caption


def test_family_and_panels():
    assert family("D-PSGD ring (Dirichlet 0.1), lr 0.32") == "Dirichlet 0.1"
    assert family("top-k 1% + EF") == "top-k"
    assert family("fp16, lr 0.032") == "fp16"  # a study's lr suffix is not part of the name
    labels = ["base (IID)"] + [f"m{i} (IID)" for i in range(6)] + [f"m{i} (skew)" for i in range(5)]
    got = panels(labels)
    assert got == [labels[:7], [labels[0], *labels[7:]]]  # IID, then skew with the baseline
    assert panels(labels[:MAX_SERIES]) == [labels[:MAX_SERIES]]  # fits: one panel
    big = ["base"] + [f"x {i}" for i in range(10)]  # one family larger than a panel
    assert [len(p) for p in panels(big)] == [MAX_SERIES, 1 + 10 - (MAX_SERIES - 1)]
    assert all(p[0] == "base" for p in panels(big))


@pytest.mark.parametrize("cases", [MAX_SERIES, MAX_SERIES + 3])
def test_more_than_max_series_split_into_panels(tmp_path, cases):
    names = ["allreduce (IID)"] + [f"m{i} (IID)" for i in range(5)]
    names += [f"m{i} (Dirichlet)" for i in range(cases - len(names))]
    finals = {name: 0.2 + 0.01 * i for i, name in enumerate(names)}
    groups = {name: [name] for name in names}  # one run each: no seed lines
    fig = plot_groups(frame(finals), groups, "epoch", "test/acc", [tmp_path / "p.png"])
    if cases <= MAX_SERIES:
        assert len(fig.axes) == 1 and len(lines(fig.axes[0], False)) == cases
        return
    assert len(fig.axes) == 2
    first, second = (lines(ax, False) for ax in fig.axes)
    assert len(first) == 6 and len(second) == 1 + cases - 6  # the baseline in both
    assert first[0].get_color() == second[0].get_color()  # the same series, the same look
    assert [ax.get_title() for ax in fig.axes] == ["IID", "Dirichlet"]
    assert len(fig.legends[0].get_texts()) == cases  # one legend, the baseline once
    assert "2 panels" in fig.dpresearch_caption
