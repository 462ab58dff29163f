"""Run directories stay inside their sweep or study directory (issue 21, item 5, acceptance E).

Sweep values and study case names holding `../`, absolute paths, commas, spaces, quotes and
unicode each get one folder directly inside the sweep (study) directory; an output path with a
comma or a space is handed to Hydra whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import SMALL, run_cli

from dpresearch.config.sweep import NAME_MAX_BYTES, safe_folder_name
from dpresearch.study import load_study, run_study
from dpresearch.study.spec import slug

HOSTILE = [
    "../x",
    "../../../etc",
    "/abs/path",
    "..",
    ".",
    "",
    "a,b",
    "a b",
    "ünïcødé",
    "a\nb",
    "%2F",
    "${x}",
    "back\\slash",
    "x" * 300,
    "é" * 200,
]


def test_safe_folder_names_are_one_folder_and_distinct():
    names = [safe_folder_name(h) for h in HOSTILE]
    for name in names:
        assert "/" not in name and "\n" not in name and name not in ("", ".", "..")
        assert len(name.encode()) <= NAME_MAX_BYTES
        assert (Path("/sweep") / name).parent == Path("/sweep")
    assert len(set(names)) == len(names)  # `%` is escaped too: no two names meet
    assert safe_folder_name("0-seed=1,lr=0.1") == "0-seed=1,lr=0.1"  # a plain name is kept
    assert safe_folder_name("ünïcødé") == "ünïcødé"


def test_study_folder_names_are_one_folder():
    for name in HOSTILE:
        folder = slug(name)
        assert "/" not in folder and not folder.startswith(".") and folder
        assert (Path("/study/runs") / folder).parent == Path("/study/runs")
        assert len(folder) <= 100


@pytest.mark.slow  # a command-line sweep; folder names: in-process above, a study's below
def test_a_sweep_over_hostile_values_keeps_every_run_inside(tmp_path):
    sweep = tmp_path / "sweep"
    values = "'../../escape','/abs/path','a b','ünï','x,y',..,\"it's\""
    out = run_cli(
        [
            "-m",
            f"logger.project={values}",
            *SMALL,
            "data.num_train=256",
            "data.num_test=64",
            "train.steps=2",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    runs = sorted(p.parent for p in tmp_path.rglob("summary.json"))
    assert len(runs) == 7 and all(run.parent == sweep for run in runs), runs
    projects = {yaml.safe_load((r / "config.yaml").read_text())["logger"]["project"] for r in runs}
    assert projects == {"../../escape", "/abs/path", "a b", "ünï", "x,y", "..", "it's"}
    assert not (tmp_path / "escape").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "sweep"
    ]


def test_a_study_with_hostile_case_names_keeps_every_run_inside(tmp_path):
    cases = {name: ["compressor=identity"] for name in ("..", "../../up", "/abs", "a,b c", "ü")}
    study_file = tmp_path / "study.yaml"
    study_file.write_text(
        yaml.safe_dump(
            {
                "name": "../../s",
                "common": [*SMALL, "train.steps=2", "train.save_model=false"],
                "lrs": [0.1],
                "seeds": [0],
                "cases": cases,
            },
            allow_unicode=True,
        )
    )
    study = load_study(study_file)
    out = tmp_path / "out, with a comma"
    records = run_study(study, out, launcher="inprocess", log=lambda _: None)
    assert {r["status"] for r in records.values()} == {"finished"}
    runs = sorted(p.parent for p in tmp_path.rglob("summary.json"))
    assert len(runs) == 5
    assert all(run.parent.parent.parent == out / "runs" for run in runs), runs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out, with a comma", "study.yaml"]


@pytest.mark.slow
def test_study_output_path_with_a_comma_and_a_space_on_the_command_line(tmp_path):
    """The local launcher hands `hydra.run.dir` to a child process: quoted, the comma and the
    space are part of the path (unquoted, Hydra read a comma as a list of values)."""
    study_file = tmp_path / "study.yaml"
    study_file.write_text(
        yaml.safe_dump(
            {
                "name": "s",
                "common": [*SMALL, "train.steps=2"],
                "lrs": [0.1],
                "seeds": [0],
                "cases": {"a": []},
            }
        )
    )
    out = tmp_path / "a,b c"
    result = run_cli(
        ["run", str(study_file), "--out", str(out)],
        cwd=tmp_path,
        module="dpresearch.study",
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    status = json.loads((out / "status.json").read_text())["points"]
    assert [p["status"] for p in status.values()] == ["finished"]
    assert (out / "runs" / "a" / "lr0.1" / "seed0" / "summary.json").exists()


@pytest.mark.slow  # two command-line runs; the sweep over hostile values above stays
def test_a_single_run_directory_with_a_comma(tmp_path):
    """Unquoted, a comma in a single run's value is one line naming the fix; quoted, it is
    part of the path."""
    args = [*SMALL, "data.num_train=256", "data.num_test=64", "train.steps=2"]
    out = run_cli([*args, f"hydra.run.dir={tmp_path}/a,b"], cwd=tmp_path)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "a comma (or a range) makes a list of values" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    out = run_cli([*args, f"hydra.run.dir='{tmp_path}/a,b'"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "a,b" / "summary.json").exists()
