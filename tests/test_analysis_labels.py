"""The analysis without a study reads like a paper (issue 22, item 5): runs are grouped by what
differs between them but the seed, named with short labels from their config, titled by what
they share, and written with paths relative to where the analysis ran."""

from __future__ import annotations

import json

import yaml
from helpers import ramp, write_run

from dpresearch.analysis import ReportSpec, load_report, write_report
from dpresearch.analysis.__main__ import main as analysis_main
from dpresearch.study import load_study
from dpresearch.study.launcher import _point_overrides

SWEEP = {  # (compressor choice, ratio, error feedback) → final accuracy
    ("identity", None, "none"): 0.80,
    ("topk", 0.01, "ef14"): 0.75,
    ("topk", 0.01, "none"): 0.60,
}


def write_sweep(root):
    for (compressor, ratio, ef), acc in SWEEP.items():
        for seed in (0, 1):
            run = write_run(
                root / f"{compressor}-{ef}-s{seed}",
                lr=0.1,
                seed=seed,
                accs=ramp(acc + seed / 100),
                final_loss=0.5,
            )
            config = yaml.safe_load((run / "config.yaml").read_text())
            config["compressor"] = {
                "_target_": f"x.{compressor}",
                **({"ratio": ratio} if ratio else {}),
            }
            config["error_feedback"] = {"_target_": "x.ErrorFeedback", "mode": ef}
            config["algorithm"] = {"_target_": "x.SyncSGD", "seed": seed}
            config["logger"] = {"name": f"run-{seed}"}  # bookkeeping: never a case key
            (run / "config.yaml").write_text(yaml.safe_dump(config))
            (run / ".hydra").mkdir()
            choices = {
                "algorithm": "sync",
                "compressor": compressor,
                "error_feedback": ef,
                "model": "mlp",
                "data": "synthetic",
                "hydra/launcher": "basic",
            }
            (run / ".hydra" / "hydra.yaml").write_text(
                yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}, sort_keys=False)
            )
    return root


def test_a_seed_sweep_is_aggregated_under_short_labels(tmp_path, monkeypatch):
    root = write_sweep(tmp_path / "runs")
    report = load_report([root], ReportSpec(target=0.7))
    table = report.table.set_index("case")
    assert sorted(table.index) == ["sync", "topk(0.01)", "topk(0.01)+ef14"]
    assert table["n"].tolist() == [2, 2, 2]  # the seeds are aggregated
    assert table.loc["topk(0.01)+ef14", "test/acc"] == 0.755
    assert report.spec.title == "mlp on synthetic, K = 4"
    monkeypatch.chdir(tmp_path)
    out = write_report(report, "results")
    text = out.read_text()
    assert "| topk(0.01)+ef14 | 2 | 75.5 ± 0.7 |" in text  # accuracy in %, one decimal
    assert str(tmp_path) not in (tmp_path / "results" / "runs.csv").read_text()
    assert "runs/identity-none-s0" in (tmp_path / "results" / "runs.csv").read_text()


def test_cli_prints_the_labelled_table(tmp_path, capsys):
    root = write_sweep(tmp_path / "runs")
    assert analysis_main([str(root)]) == 0
    out = capsys.readouterr().out
    assert "| sync | 2 |" in out and "dpresearch" not in out.split("note:")[0]


def test_study_points_are_named_by_what_the_study_varies(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text(
        json.dumps(
            {
                "name": "s",
                "lrs": [0.1],
                "seeds": [3],
                "cases": {"top-k 1% + EF": ["compressor=topk"]},
            }
        )
    )
    study = load_study(path)
    overrides = _point_overrides(study, study.points()[0])
    assert "logger.name='top-k 1% + EF | lr=0.1 | seed=3'" in overrides
