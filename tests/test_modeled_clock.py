"""`time/modeled_s`: every worker's compute under the speed model plus the network model's
communication, a round ending when its last participant arrives (`run/modeled_clock.py`); for
asynchronous Local-SGD, its event simulator's push arrivals."""

from __future__ import annotations

import pytest
from helpers import (
    CHECKPOINTED,
    SMALL_512,
    compose_config,
    kill_and_resume,
    metric_lines,
    train_on_gloo,
)

from dpresearch.analysis.plots import axis_label
from dpresearch.analysis.runs import load_metrics_many
from dpresearch.analysis.timing import time_to_accuracy
from dpresearch.config.validate import ConfigError, validate
from dpresearch.run.trainer import InjectedFailure
from dpresearch.train import train

# K = 4, worker 3 three times slower (c = 0.25 s a step: every time below is exact in binary)
C, SLOW, K, H = 0.25, 3.0, 4, 5
STRAGGLER = [
    f"workers={K}",
    f"async.compute_s={C}",
    "async.slow_workers=[3]",
    f"async.slowdown={SLOW}",
    "network=1gbe",
]
DILOCO = ["algorithm=local_sgd", f"algorithm.period={H}", "outer=nesterov"]
PARAMS = 16 * 32 + 32 + 32 * 10 + 10  # the 16-32-10 MLP of SMALL


def allreduce_s(nbytes: int) -> float:
    """A ring allreduce of `nbytes` among K workers on 1 GbE (50 µs, 1 Gbit/s), by hand."""
    return 2 * (K - 1) * 50e-6 + 2 * (K - 1) / K * nbytes / (1e9 / 8)


def modeled(tmp_path, *overrides: str) -> dict[int, float]:
    train(compose_config(*SMALL_512, *STRAGGLER, "train.steps=10", *overrides), tmp_path)
    return {m["step"]: m["time/modeled_s"] for m in metric_lines(tmp_path)}


def test_sync_waits_for_the_slowest_worker_every_step(tmp_path):
    # every step: the slowest worker's 3c, then the gradient's allreduce
    step_s = SLOW * C + allreduce_s(4 * PARAMS)
    assert modeled(tmp_path) == {s: pytest.approx(s * step_s, rel=1e-12) for s in (5, 8, 10)}


def test_diloco_round_ends_when_the_slowest_worker_arrives(tmp_path):
    # a round: the slow worker's H steps at its own speed, then the outer allreduce of Δ
    round_s = H * SLOW * C + allreduce_s(4 * PARAMS)
    expected = {5: round_s, 8: round_s + 3 * SLOW * C, 10: 2 * round_s}
    assert modeled(tmp_path, *DILOCO) == {
        s: pytest.approx(t, rel=1e-12) for s, t in expected.items()
    }
    # an analysis time axis: time to a target on the modeled clock
    tta = time_to_accuracy(load_metrics_many([tmp_path]), "step", 8)
    assert tta["tta/modeled_s"].tolist() == [pytest.approx(expected[8], rel=1e-12)]
    assert axis_label("time/modeled_s", {})[0].startswith("modeled wall-clock time")


# asynchronous Local-SGD: a worker pulls (a message of the parameters), runs its H steps at its own
# speed and pushes Δ (a message of a 4-number float64 header and Δ); no buffers in the MLP
ASYNC_LOCAL = ["algorithm=async_local_sgd", f"algorithm.period={H}"]
PULL_BYTES, PUSH_BYTES = 8 * 3 + 4 * PARAMS, 8 * 4 + 4 * PARAMS


def message_s(nbytes: int) -> float:
    """One point-to-point message of `nbytes` on 1 GbE (50 µs, 1 Gbit/s), by hand."""
    return 50e-6 + nbytes / (1e9 / 8)


def async_local(tmp_path, *overrides: str) -> list[dict]:
    args = [*SMALL_512, *STRAGGLER, *ASYNC_LOCAL, "train.steps=50", *overrides]
    train(compose_config(*args), tmp_path)
    return metric_lines(tmp_path)


def test_async_local_sgd_workers_push_at_their_own_speed(tmp_path):
    # a fast round: pull, H·c, push; the slow worker's 3·H·c: the three fast workers push
    # twice (steps 1–30, H steps each, worker by worker) before it arrives (steps 31–35; 32 is
    # the epoch's end), then their third time (36–50); `comm/bytes`: the mean over K workers of
    # the pushes so far
    transfer = message_s(PULL_BYTES) + message_s(PUSH_BYTES)
    fast, slow = H * C + transfer, H * SLOW * C + transfer
    rounds = {5: fast, 10: fast, 15: fast, 20: 2 * fast, 25: 2 * fast, 30: 2 * fast}
    expected = {**rounds, 32: slow, 35: slow, 40: 3 * fast, 45: 3 * fast, 50: 3 * fast}
    rows = async_local(tmp_path)
    assert {m["step"]: m["time/modeled_s"] for m in rows} == {
        s: pytest.approx(t, rel=1e-12) for s, t in expected.items()
    }
    assert {m["step"]: m["comm/bytes"] for m in rows} == {
        s: s // H * PUSH_BYTES / K for s in expected
    }
    assert rows[-1]["async/applied_per_worker_min"] == 1  # the slow worker: once
    # synchronous DiLoCo's second round ends at 2·(H·3c + allreduce): the fast workers'
    # third push came earlier
    assert 3 * fast < 2 * (H * SLOW * C + allreduce_s(4 * PARAMS))


def test_dynamic_local_updates_give_the_slow_worker_fewer_steps(tmp_path):
    # DyLU: H_3 = ⌊H · (1/3c) / (1/c)⌋ = 1 local step a round (0.75 s), the others H = 5 (1.25 s)
    transfer = message_s(PULL_BYTES) + message_s(PUSH_BYTES)
    fast, slow = H * C + transfer, SLOW * C + transfer
    expected = {
        1: slow,
        16: fast,
        17: 2 * slow,
        18: 3 * slow,
        33: 2 * fast,
        34: 4 * slow,
        49: 3 * fast,  # 3.75 + 3 transfers: before the slow worker's 3.75 + 5
        50: 5 * slow,
    }
    rows = async_local(tmp_path, "algorithm.dynamic_local_updates=true", "train.log_every=1")
    clock = {m["step"]: m["time/modeled_s"] for m in rows}
    assert {s: clock[s] for s in expected} == {
        s: pytest.approx(t, rel=1e-12) for s, t in expected.items()
    }


def test_speed_keys_are_every_familys_and_checked():
    validate(compose_config(*STRAGGLER, "async.speed=lognormal"))  # sync takes the speed model
    with pytest.raises(ConfigError, match="async.slowdown=0"):
        validate(compose_config("async.slowdown=0"))
    with pytest.raises(ConfigError, match="async.lr_policy is set but SyncSGD"):
        validate(compose_config("async.lr_policy=inverse"))


# random speeds and stragglers: the clock's streams are state
RANDOM = ["workers=4", "async.speed=lognormal", "async.straggler_prob=0.2", "network=1gbe"]


def test_resume_continues_the_same_clock(tmp_path):
    args = [*CHECKPOINTED, *RANDOM, *DILOCO]
    train(compose_config(*args), tmp_path / "reference")
    resumed = kill_and_resume(tmp_path, args, InjectedFailure)
    clock = [m["time/modeled_s"] for m in metric_lines(resumed)]
    assert clock == [m["time/modeled_s"] for m in metric_lines(tmp_path / "reference")]
    assert len(set(clock)) == len(clock)  # it moved every step


@pytest.mark.slow
def test_gloo_ranks_keep_the_simulated_clock(tmp_path):
    """The clock, DiLoCo's diagnostics and sync's `ef/memory_norm` (`test_diagnostics.py`) on
    real ranks."""
    common = [
        *SMALL_512,
        "workers=2",
        "async.speed=lognormal",
        "async.straggler_prob=0.3",
        "async.slow_workers=[1]",
        "async.slowdown=2",
        "train.steps=9",
        "train.log_every=1",
    ]
    cases = {
        "diloco": ["algorithm=local_sgd", "algorithm.period=3", "outer=nesterov"],
        "sync_ef": ["compressor=topk", "error_feedback=ef14"],
    }
    for name, args in cases.items():
        train(compose_config(*common, *args), tmp_path / name)
    train_on_gloo(
        2,
        [
            (compose_config(*common, *args, "backend=gloo"), tmp_path / f"{name}_gloo")
            for name, args in cases.items()
        ],
    )
    logged = {
        "diloco": [
            "outer/pseudo_grad_cosine",
            "outer/pseudo_grad_cosine_min",
            "outer/drift",
            "outer/momentum_norm",
        ],
        "sync_ef": ["ef/memory_norm"],
    }
    for name, own in logged.items():
        keys = ["time/modeled_s", "comm/bytes_metrics", *own]
        simulated, gloo = (
            [[m.get(k) for k in keys] for m in metric_lines(d)]
            for d in (tmp_path / name, tmp_path / f"{name}_gloo")
        )
        assert simulated == gloo and len(gloo) == 9, name
        assert all(v is not None for v in gloo[-1]), name  # (DiLoCo: one pair, K = 2)


def test_event_simulated_algorithms_report_their_own_clock(tmp_path):
    # asynchronous SGD already prices each worker's compute and every transfer per push
    train(compose_config(*SMALL_512, *STRAGGLER, "algorithm=async_sgd", "train.steps=8"), tmp_path)
    rows = metric_lines(tmp_path)
    assert [m["time/modeled_s"] for m in rows] == [m["time/simulated_s"] for m in rows]
    assert rows[-1]["time/modeled_s"] > 0
