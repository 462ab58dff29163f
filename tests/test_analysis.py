"""Run directories load into DataFrames, tables and plots (dpresearch.analysis)."""

from __future__ import annotations

from conftest import compose_config

from dpresearch.analysis import find_runs, load_metrics, load_summaries, markdown_table, plot_curves
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
