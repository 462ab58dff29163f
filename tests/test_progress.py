"""What a run prints while it trains (issue 43, item 5): its length, cadence and units before
the first step; a first progress line within `FIRST_LINE_S` of the loop's start however far
the first logged step is (time-based, between logged rows, changing no logged row); losses
named in nats, bits per character named; the language-model presets evaluate on a cadence."""

from __future__ import annotations

import math

from helpers import SMALL, compose_config, metric_lines, untimed

import dpresearch.run.metrics as metrics
from dpresearch.run.progress import FIRST_LINE_S, Pacer, format_progress, format_start
from dpresearch.study import load_study
from dpresearch.train import train

QUIET = [a for a in SMALL if not a.startswith(("train.progress", "train.log_every"))]


def test_pacer_is_time_based():
    now = [100.0]
    pacer = Pacer(first_s=10.0, every_s=60.0, clock=lambda: now[0])
    now[0] = 109.9
    assert not pacer.due()
    now[0] = 110.0
    assert pacer.due()
    pacer.printed()
    now[0] = 169.9
    assert not pacer.due()
    now[0] = 170.0
    assert pacer.due()
    assert Pacer().first_s == FIRST_LINE_S == 10.0


def test_first_line_comes_between_logged_rows_and_changes_none(tmp_path, monkeypatch, capsys):
    """A line due after step 1 of a run logging every 3 steps: step 1's loss (what a run
    logging every step logs at step 1), no bytes (those need a collective); the logged rows
    equal those of the same run without progress."""
    args = [*QUIET, "train.steps=6", "workers=2"]
    train(compose_config(*args, "train.log_every=1", "train.progress=false"), tmp_path / "every")
    train(compose_config(*args, "train.log_every=3", "train.progress=false"), tmp_path / "quiet")
    monkeypatch.setattr(metrics, "Pacer", lambda: Pacer(first_s=0.0, every_s=math.inf))
    capsys.readouterr()
    train(compose_config(*args, "train.log_every=3", "train.progress=true"), tmp_path / "shown")
    lines = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("step "))
    assert (
        lines[first - 1].startswith("training 6 steps (") and "losses in nats" in lines[first - 1]
    )
    step1 = metric_lines(tmp_path / "every")[0]
    assert lines[first].startswith(f"step 1/6 | ep {step1['epoch']:.2f} | ")
    assert f"| loss {step1['train/loss']:.4f} nats |" in lines[first] and "sent" not in lines[first]
    assert [line.split(" | ")[0] for line in lines[first : first + 3]] == [
        "step 1/6",
        "step 3/6",
        "step 6/6",
    ]
    shown, quiet = metric_lines(tmp_path / "shown"), metric_lines(tmp_path / "quiet")
    assert [untimed(r) for r in shown] == [untimed(r) for r in quiet]


def test_progress_names_its_units():
    row = {
        "step": 50, "epoch": 0.5, "samples": 6400, "tokens": 409600, "train/loss": 2.5,
        "test/loss": 2.0, "test/bpc": 2.0 / math.log(2), "lr": 1e-3, "comm/bytes": 1e6,
        "comm/modeled_s": 0.0, "time/wall_s": 10.0,
    }  # fmt: skip
    line = format_progress(row, total_steps=100)
    assert "| loss 2.5000 nats |" in line and "| test loss 2.0000 nats = 2.8854 bpc |" in line
    start = format_start(300, 564, 10, 50, text=True)
    assert start.startswith("training 300 steps (0.532 epochs of 564): a progress line every 10")
    assert "evaluation every 50 steps and at the end" in start and "bpc: bits per" in start
    assert "evaluation at the end; losses in nats" in format_start(6, 16, 3, 16, text=False)


def test_language_model_presets_evaluate_every_50_steps_and_the_study_pins_its_own():
    """`data=shakespeare` and `data=text` evaluate every 50 steps (a curve on the README's
    300-step run); the shipped LM studies name their cadence, so their results do not move."""
    for data in ("data=shakespeare", "data=text"):
        assert compose_config(data, "data.root=x", "model=gpt_tiny").train.eval_every == 50
    assert compose_config().train.eval_every is None  # the others: once an epoch
    from helpers import REPO

    for name in ("study", "gpu"):
        study = load_study(REPO / f"experiments/lm_shakespeare/{name}.yaml")
        assert any(o.startswith("train.eval_every=") for o in study.common), name
