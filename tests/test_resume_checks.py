"""A resume continues the run it names or is refused before anything is written (issue 21,
items 2 and 4; acceptance B's refused-resume part and D's resume rows).

One real run (the command line: `.hydra/`, `provenance.json`, `train.log`, checkpoints at steps
4 and 8 of 10) is copied for each case. A resume whose configuration differs from the
checkpoint's in anything that shapes the trajectory is one `error:` line naming the keys, exit
2, and every file of the named run byte-identical; `train.resume_allow_changes` lets a
deliberate change through; a finished run resumed with `auto` is left as it is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import run_cli, run_main

import dpresearch.train as entry
from dpresearch.run.resume import trajectory_differences

RUN = [
    "data.num_train=256",
    "data.num_test=64",
    "data.num_features=16",
    "model.hidden=[32]",
    "train.progress=false",
    "train.batch_size=16",
    "train.log_every=1",
    "train.steps=10",
    "train.checkpoint_every=4",
    "train.checkpoint_keep=5",
]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished run made by the command line."""
    root = tmp_path_factory.mktemp("resume")
    out = run_cli([*RUN, f"hydra.run.dir={root / 'run'}"], cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "run"


def copy_run(source: Path, tmp_path: Path, unfinished: bool) -> Path:
    """A copy of `source` (unfinished: as a run killed after its step-8 checkpoint)."""
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    if unfinished:
        (run_dir / "summary.json").unlink()
        (run_dir / "model_final.pt").unlink()
    return run_dir


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# (changed overrides, keys the error line must name, a fragment it must hold)
REFUSED = [
    (["optimizer=adam"], "optimizer._target_", '"torch.optim.SGD" → "torch.optim.Adam"'),
    (["compressor=topk", "compressor.ratio=0.1"], "compressor._target_", "compressor.ratio"),
    (["data.num_train=512"], "data.num_train", "data.num_train (256 → 512)"),
    (["train.steps=20"], "train.steps", "train.resume_allow_changes=[train.steps]"),
    (["seed=1"], "seed", "seed (0 → 1)"),
    (["network=1gbe"], "network.bandwidth_gbit", "network.name"),
]


@pytest.mark.parametrize("changes,key,fragment", REFUSED, ids=[" ".join(c) for c, _, _ in REFUSED])
def test_a_resume_with_other_settings_is_refused_and_writes_nothing(
    changes, key, fragment, finished, tmp_path, monkeypatch, capsys
):
    run_dir = copy_run(finished, tmp_path, unfinished=True)
    before = snapshot(run_dir)
    args = [*RUN, *changes, "train.resume=auto", f"hydra.run.dir={run_dir}"]
    code, out, err = run_main(args, tmp_path, monkeypatch, capsys)
    line = one_error_line(err)
    assert code == 2 and "was written with other settings" in line, line
    assert key in line and fragment in line, line
    assert snapshot(run_dir) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.slow  # the refusal in-process above stays
def test_the_same_refusal_from_the_command_line_leaves_the_run_byte_identical(finished, tmp_path):
    """Through a process of its own: Hydra never starts, so neither `.hydra/*.yaml` nor
    `provenance.json` nor `train.log` is rewritten."""
    run_dir = copy_run(finished, tmp_path, unfinished=True)
    before = snapshot(run_dir)
    out = run_cli(
        [*RUN, "optimizer=adam", "train.resume=auto", f"hydra.run.dir={run_dir}"], cwd=tmp_path
    )
    assert out.returncode == 2 and "optimizer._target_" in one_error_line(out.stderr)
    out = run_cli(
        [*RUN, "optimizer=adam", f"train.resume={run_dir / 'checkpoints' / 'step_4.pt'}"],
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "step_4.pt was written" in one_error_line(out.stderr)
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_a_deliberate_change_is_let_through_by_name(finished, tmp_path, monkeypatch):
    run_dir = copy_run(finished, tmp_path, unfinished=True)
    args = [*RUN, "train.steps=14", "train.resume=auto", f"hydra.run.dir={run_dir}"]
    out = run_cli([*args, "train.resume_allow_changes=[train.steps]"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [
        int(line.split('"step": ')[1].split(",")[0])
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(1, 15))


# Resumes refused whatever train.resume_allow_changes lets by: (changes, allowed, fragments).
# A checkpoint past the run's end; a compute clock that drew nothing at async.speed=constant
# resumed with an exponential one, whose streams the checkpoint does not hold (before: the
# speed model's ValueError from inside the trainer).
ALLOWED_YET_REFUSED = [
    (["train.steps=6"], "train", ["step_8.pt is at step 8, past this run's train.steps=6"]),
    (
        ["async.speed=exponential"],
        "async.speed",
        [
            "step_8.pt holds the random streams of async.speed=constant",
            "resume with async.speed=constant, async.straggler_prob=0.0",
        ],
    ),
]


@pytest.mark.parametrize("changes,allowed,fragments", ALLOWED_YET_REFUSED)
def test_a_resume_that_cannot_continue_is_refused_even_when_allowed(
    changes, allowed, fragments, finished, tmp_path, monkeypatch, capsys
):
    run_dir = copy_run(finished, tmp_path, unfinished=True)
    before = snapshot(run_dir)
    args = [
        *RUN,
        *changes,
        "train.resume=auto",
        f"train.resume_allow_changes=[{allowed}]",
        f"hydra.run.dir={run_dir}",
    ]
    code, _, err = run_main(args, tmp_path, monkeypatch, capsys)
    line = one_error_line(err)
    assert code == 2 and all(f in line for f in fragments), line
    assert snapshot(run_dir) == before


def test_an_unknown_allowed_change_is_refused(finished, tmp_path, monkeypatch, capsys):
    run_dir = copy_run(finished, tmp_path, unfinished=True)
    args = [
        *RUN,
        "train.resume=auto",
        "train.resume_allow_changes=[optimizer.lrr]",
        f"hydra.run.dir={run_dir}",
    ]
    code, _, err = run_main(args, tmp_path, monkeypatch, capsys)
    assert code == 2 and "optimizer.lrr is not a config key" in one_error_line(err)


def test_resume_auto_of_a_finished_run_writes_nothing(finished, tmp_path, monkeypatch, capsys):
    """The same configuration: nothing to do, exit 0; another one: refused, exit 2. Either way
    the run is untouched (before: `provenance.json` and `.hydra/` were rewritten)."""
    run_dir = copy_run(finished, tmp_path, unfinished=False)
    before = snapshot(run_dir)
    monkeypatch.setattr(entry, "_hydra_main", lambda: pytest.fail("Hydra started"))
    code, out, err = run_main(
        [*RUN, "train.resume=auto", f"hydra.run.dir={run_dir}"], tmp_path, monkeypatch, capsys
    )
    assert code == 0 and "finished; nothing to resume" in out and not err
    code, out, err = run_main(
        [*RUN, "optimizer.lr=0.5", "train.resume=auto", f"hydra.run.dir={run_dir}"],
        tmp_path,
        monkeypatch,
        capsys,
    )
    line = one_error_line(err)
    assert code == 2 and "holds a finished run made with other settings" in line
    assert "optimizer.lr (0.1 → 0.5)" in line
    assert snapshot(run_dir) == before


def test_trajectory_differences_names_nodes_once_and_skips_bookkeeping():
    from helpers import compose_config
    from omegaconf import OmegaConf

    base = compose_config(*RUN)
    saved = OmegaConf.to_container(base, resolve=True)
    assert trajectory_differences(saved, base) == []
    quiet = compose_config(
        *RUN,
        "train.log_every=7",
        "train.checkpoint_every=2",
        "logger.project=x",
        "backend.timeout_s=5",
        "debug.fail_worker=1",
    )
    assert trajectory_differences(saved, quiet) == []
    topk = compose_config(*RUN, "compressor=topk")
    # algorithm.compressor mirrors compressor (${compressor}): named once, by the node itself
    differing = trajectory_differences(saved, topk)
    assert differing[:2] == ["compressor._target_", "compressor.margin"]
    assert all(key.startswith("compressor.") for key in differing), differing
    assert trajectory_differences(saved, topk, allowed=["compressor"]) == []
    assert trajectory_differences(saved, compose_config(*RUN, "seed=3")) == ["seed"]


def test_a_key_added_since_a_run_was_saved_differs_only_when_it_is_on():
    """A run saved before `train.grad_clip`, `train.init_from` and `train.eval_bn_stats`
    existed resumes under a configuration that has them at their schema defaults; one that
    sets a new key otherwise is refused."""
    from helpers import compose_config
    from omegaconf import OmegaConf

    base = compose_config(*RUN)
    saved = OmegaConf.to_container(base, resolve=True)
    assert saved["train"]["grad_clip"] is None and saved["train"]["init_from"] is None
    assert saved["train"]["eval_bn_stats"] == "consensus"  # a default that is not null
    del saved["train"]["grad_clip"], saved["train"]["init_from"], saved["train"]["eval_bn_stats"]
    assert trajectory_differences(saved, base) == []
    clipped = compose_config(*RUN, "train.grad_clip=1.0")
    assert trajectory_differences(saved, clipped) == ["train.grad_clip"]
    averaged = compose_config(*RUN, "train.eval_bn_stats=recompute")
    assert trajectory_differences(saved, averaged) == ["train.eval_bn_stats"]
    # a mapping added since (its default an empty one): `train.time_scenarios`
    del saved["train"]["time_scenarios"]
    assert trajectory_differences(saved, base) == []
    timed = compose_config(*RUN, "+train.time_scenarios={slow:{slowdown:2}}")
    assert trajectory_differences(saved, timed) == ["train.time_scenarios.slow.slowdown"]
