"""Learning-rate schedules: warm-up, step decay, cosine, one-cycle."""

from __future__ import annotations

import pytest

from dpresearch.schedules import Constant, Cosine, OneCycle, StepDecay


def test_step_decay_with_warmup_matches_the_recipe():
    """PowerSGD/ChocoSGD recipe: 5-epoch linear warm-up, ×0.1 at epochs 150 and 250."""
    s = StepDecay(
        milestones=[150, 250],
        gamma=0.1,
        warmup_epochs=5,
        warmup_from=1 / 16,
        steps_per_epoch=10,
        total_steps=3000,
    )
    assert s(0) == pytest.approx(1 / 16)
    assert s(25) == pytest.approx(1 / 16 + (1 - 1 / 16) * 0.5)
    assert s(50) == 1.0
    assert s(1499) == 1.0
    assert s(1500) == pytest.approx(0.1)
    assert s(2500) == pytest.approx(0.01)


def test_cosine_and_constant():
    c = Cosine(final=0.0, steps_per_epoch=10, total_steps=100)
    assert c(0) == pytest.approx(1.0)
    assert c(50) == pytest.approx(0.5)
    assert c(100) == pytest.approx(0.0, abs=1e-12)
    assert Constant(steps_per_epoch=10, total_steps=100)(77) == 1.0


def test_one_cycle_rises_then_falls():
    s = OneCycle(
        pct_start=0.3, div_factor=25, final_div_factor=1e4, steps_per_epoch=1, total_steps=100
    )
    assert s(0) == pytest.approx(1 / 25)
    assert s(30) == pytest.approx(1.0)
    assert s(100) == pytest.approx(1 / 25e4)
    assert s(10) < s(20) < s(30) > s(60) > s(90)
