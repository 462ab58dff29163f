"""Issue 22, item 3 and 4: the entry points tell the truth — `--help` everywhere, the exact
resume command, one final line per run, progress on long operations, "did you mean" for
analysis keys, one line naming the extra to install — and follow Hydra's conventions (a user's
configs on `hydra.searchpath`, tab completion)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml
from helpers import SMALL, compose_config, ramp, run_cli, write_run

from dpresearch import CONF_DIR, __version__, cli
from dpresearch.analysis import report as analysis_report
from dpresearch.analysis.__main__ import main as analysis_main
from dpresearch.config.cli_check import compose_command_line, parse_command_line, task_config
from dpresearch.config.preflight import preflight
from dpresearch.config.validate import ConfigError
from dpresearch.run import ending as run_lines
from dpresearch.study import StudyError, load_study, run_study
from dpresearch.study.__main__ import main as study_main
from dpresearch.train import train
from dpresearch.tune_gamma import main as tune_gamma_main

# -- the `dpresearch` command and --help on every entry point ----------------------------------


def test_dpresearch_command_lists_its_commands_and_names_a_typo(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("train", "study", "analysis", "tune-gamma"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert capsys.readouterr().out.strip() == f"dpresearch {__version__}"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["studdy", "run", "x.yaml"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1
    assert err[0].startswith("error: dpresearch has no command 'studdy'; did you mean study?")


@pytest.mark.parametrize("command", ["study", "analysis", "tune-gamma", "tune_gamma"])
def test_every_subcommand_answers_help(command, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cli.main sets the subcommand's argv
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    if command.startswith("tune"):
        assert "default configuration:" in out and "workers: 9" in out


def test_train_help_is_hydras(tmp_path):
    out = run_cli(["--help"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "== Config ==" in out.stdout and "compressor:" in out.stdout
    assert not any(tmp_path.iterdir())  # --help writes nothing


def test_tab_completion_of_overrides(tmp_path, monkeypatch):
    """Hydra's bash completion, as `eval "$(dpresearch-train -sc install=bash)"` installs it:
    the shell asks `-sc query=bash` with the line typed so far."""
    monkeypatch.setenv("COMP_LINE", "dpresearch-train compressor=to")
    monkeypatch.setenv("COMP_POINT", "30")
    out = run_cli(["-sc", "query=bash"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "compressor=topk" in out.stdout.split()


# -- tune_gamma: help and progress -------------------------------------------------------------


def test_tune_gamma_says_what_it_does_while_it_runs(capsys):
    tune_gamma_main(["workers=4", "steps=5", "gammas=[0.1,1.0]", "compressor=sign"])
    captured = capsys.readouterr()
    progress = captured.err.strip().splitlines()
    assert progress[0] == "tuning gamma: 2 values x 5 gossip steps (K=4, d=2000)"
    assert progress[1].startswith("  [1/2] gamma 0.1: final ") and "ETA" in progress[1]
    assert progress[2].startswith("  [2/2] gamma 1: final ")
    assert "best gamma: 1 " in captured.out


# -- the lines a run ends with -----------------------------------------------------------------


def test_resume_command_repeats_the_invocation_with_the_run_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(run_lines.INVOCATION_ENV, raising=False)
    run_lines.remember_invocation(
        "/x/bin/dpresearch-train",
        ["-cd", "/my/conf", "hydra.searchpath=[file:///c]", "train.steps=9", "model.hidden=[8]"],
    )
    command = run_lines.resume_command(tmp_path, ["train.steps=9", "model.hidden=[8]"])
    assert shlex.split(command) == [
        "dpresearch-train",
        "-cd",
        "/my/conf",
        "hydra.searchpath=[file:///c]",
        "train.steps=9",
        "model.hidden=[8]",
        f"hydra.run.dir={tmp_path}",
        "train.resume=auto",
    ]


def test_resume_command_of_a_sweep_point_is_a_single_run_of_that_point(monkeypatch, tmp_path):
    """A sweep point resumes as a single run: its own values, no -m, no sweep placement, an
    earlier train.resume replaced."""
    run_lines.remember_invocation(
        str(Path("dpresearch/train.py").resolve()),
        ["-m", "seed=0,1", "hydra/launcher=slurm", "hydra.sweep.dir=/s", "train.resume=auto"],
    )
    command = run_lines.resume_command(tmp_path / "1-seed=1", ["seed=1", "train.resume=auto"])
    assert shlex.split(command) == [
        run_lines.interpreter(),
        "-m",
        "dpresearch.train",
        "seed=1",
        f"hydra.run.dir={tmp_path / '1-seed=1'}",
        "train.resume=auto",
    ]
    run_lines.remember_invocation("dpresearch train", ["seed=2"])
    assert shlex.split(run_lines.resume_command(tmp_path, ["seed=2"]))[:3] == [
        "dpresearch",
        "train",
        "seed=2",
    ]


def test_final_and_interrupted_lines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summary = {"status": "finished", "step": 5, "total_steps": 5}
    assert run_lines.final_line(summary, tmp_path / "outputs" / "r", 3.04) == (
        "finished: 5/5 steps in 3.0 s; results in outputs/r"
    )
    stopped = {"status": "interrupted", "interrupted_at_step": 3, "total_steps": 9}
    line = run_lines.interrupted_line(
        {**stopped, "checkpoint": "/c/step_3.pt"}, tmp_path, 2.0, "CMD"
    )
    assert line == "interrupted at step 3/9 after 2.0 s: checkpoint /c/step_3.pt; resume with: CMD"
    line = run_lines.interrupted_line({**stopped, "checkpoint": None}, tmp_path, 2.0, "CMD")
    assert "no checkpoint" in line and "resume" not in line


def test_resume_auto_in_a_directory_without_a_checkpoint_says_so(tmp_path, capsys):
    run_dir = tmp_path / "fresh"
    train(compose_config(*SMALL, "train.steps=2", "train.resume=auto"), run_dir)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "resume" in ln]
    assert lines == [
        f"train.resume=auto: no checkpoint in {run_dir}; starting from step 0 (to continue an "
        "earlier run, pass its directory as hydra.run.dir)"
    ]


# -- analysis: did you mean, every key, progress, the missing extra ----------------------------


def _runs(root: Path, n: int = 2) -> Path:
    for seed in range(n):
        write_run(root / f"s{seed}", lr=0.1, seed=seed, case="A", accs=ramp(0.5), final_loss=1.0)
    return root


def test_a_misspelled_key_gets_a_short_line_with_the_closest_names(tmp_path, capsys):
    root = _runs(tmp_path / "runs")
    for args, hint in [
        (["--by", "cas"], "(did you mean 'case'?)"),
        (["--by", "seed"], "(did you mean 'cfg.seed'?)"),
        (["--tune", "cfg.optimiser.lr"], "(did you mean 'cfg.optimizer.lr'?)"),
    ]:
        assert analysis_main([str(root), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and hint in err[0], err
        assert len(err[0]) < 800 and "config keys cfg.* (--keys lists them)" in err[0]
    assert analysis_main([str(root), "--keys"]) == 0
    keys = capsys.readouterr().out.split()
    assert (
        "case" in keys
        and "cfg.optimizer.lr" in keys
        and keys.index("case") < keys.index("cfg.seed")
    )


def test_analysis_of_many_runs_reports_progress(tmp_path, capsys, monkeypatch):
    root = _runs(tmp_path / "runs", n=3)
    monkeypatch.setattr(analysis_report, "PROGRESS_FROM_RUNS", 3)
    assert analysis_main([str(root), "--by", "case"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("analysis: 3 run directories found; reading their summaries")
    assert [e.split(" (")[0] for e in err[1:]] == [
        "analysis: reading metrics.jsonl",
        "analysis: aggregating",
    ]
    assert analysis_main([str(root), "--by", "case", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_analysis_without_its_extra_is_one_line_naming_the_install(tmp_path, capsys, monkeypatch):
    root = _runs(tmp_path / "runs")
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas now fails
    assert analysis_main([str(root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: the analysis needs pandas, which is not installed; "
        "pip install 'dpresearch[analysis]'"
    ]
    study = tmp_path / "s.yaml"
    study.write_text(yaml.safe_dump({"name": "s", "lrs": [0.1], "seeds": [0], "cases": {"a": []}}))
    assert study_main(["report", str(study)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the study report needs pandas" in err[0], err
    assert "pip install 'dpresearch[analysis]'" in err[0]


# -- studies: where runs go, {repo}, progress --------------------------------------------------

STUDY = {
    "name": "where",
    "common": [*SMALL],
    "lrs": [0.1],
    "seeds": [0, 1],
    "cases": {"a": ["train.steps=2"]},
}


def test_study_runs_go_under_the_current_directory(tmp_path, monkeypatch, capsys):
    path = tmp_path / "spec" / "where.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(STUDY))
    monkeypatch.chdir(tmp_path)
    assert study_main(["status", str(path)]) == 0
    out = capsys.readouterr().out  # a dry run writes no status.json, so names none
    assert f"runs go to {Path('runs') / 'where' / 'runs'}" in out and "status.json" not in out


def test_repo_stands_for_the_git_repository_holding_the_study(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    (mine / ".git").mkdir(parents=True)
    (mine / "studies").mkdir()
    path = mine / "studies" / "s.yaml"
    path.write_text(yaml.safe_dump({**STUDY, "common": ["data.root={repo}/data"]}))
    assert load_study(path).common == (f"data.root={mine.resolve()}/data",)
    import dpresearch.study.spec as spec

    monkeypatch.setattr(spec, "SOURCE_ROOT", None)  # an installed wheel: no checkout either
    with pytest.raises(StudyError, match=r"^\{repo\} in the study in / .* there is none; "):
        spec.repository_of(Path("/"))  # no .git at or above it


def test_study_progress_counts_points_and_estimates_the_rest(tmp_path):
    path = tmp_path / "where.yaml"
    path.write_text(yaml.safe_dump(STUDY))

    def runner(point, run_dir, overrides):  # a point that "finished" at once
        (run_dir / "summary.json").write_text(json.dumps({"status": "finished"}))
        return 0

    lines: list[str] = []
    run_study(load_study(path), tmp_path / "out", launcher=runner, log=lines.append)
    ends = [ln for ln in lines if ": finished" in ln]
    assert len(ends) == 2
    assert re.fullmatch(
        r"== a \| lr 0.1 \| seed 0: finished in \d+ s \[1/2; \d+:\d\d so far, "
        r"ETA \d+:\d\d\]",
        ends[0],
    ), ends[0]
    assert ends[1].endswith("ETA 0:00]")


# -- Hydra: a user's configs on hydra.searchpath ------------------------------------------------


def user_configs(root: Path) -> Path:
    """A config folder outside the repository: a compressor and an experiment of one's own."""
    (root / "compressor").mkdir(parents=True)
    (root / "compressor" / "mytopk.yaml").write_text(
        "_target_: dpresearch.compress.topk.TopK\nratio: 0.05\n"
    )
    (root / "experiment").mkdir()
    (root / "experiment" / "quick.yaml").write_text(
        "# @package _global_\ntrain:\n  steps: 3\n  log_every: 1\n"
    )
    return root


def test_preflight_honours_hydra_searchpath(tmp_path):
    conf = user_configs(tmp_path / "myconf")
    search = f"hydra.searchpath=[file://{conf}]"
    cmd = parse_command_line([search, "compressor=mytopk", "experiment=quick", *SMALL])
    cfg = task_config(compose_command_line(cmd, CONF_DIR))
    assert cfg.compressor.ratio == 0.05 and cfg.train.steps == 3
    preflight(cfg, cmd.overrides)
    with pytest.raises(ConfigError, match=r"compressor=nope is not an option; .*mytopk"):
        compose_command_line(parse_command_line([search, "compressor=nope"]), CONF_DIR)
    with pytest.raises(ConfigError, match="compressor=mytopk is not an option"):
        compose_command_line(parse_command_line(["compressor=mytopk"]), CONF_DIR)


@pytest.mark.slow
def test_a_run_with_ones_own_compressor_from_the_searchpath(tmp_path):
    """The whole command line: checked, run with the user's compressor, and the run's last
    line says it finished, how far, and where."""
    conf = user_configs(tmp_path / "myconf")
    out = run_cli(
        [
            f"hydra.searchpath=[file://{conf}]",
            "compressor=mytopk",
            "experiment=quick",
            *SMALL,
            "hydra.run.dir=run",
        ],
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["compressor"] == {"_target_": "dpresearch.compress.topk.TopK", "ratio": 0.05}
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("finished: 3/3 steps in ") and last.endswith(" s; results in run")
