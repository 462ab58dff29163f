"""`train.time_scenarios` (`run/time_scenarios.py`): one lockstep run logs
`time/modeled_s@<name>` for other speed models and network presets, each exactly (float
equality) the `time/modeled_s` of a separate run configured with that scenario's keys."""

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
from dpresearch.study.select import horizon_unit
from dpresearch.train import train

BASE = ["workers=4", "async.compute_s=0.25", "network=1gbe", "train.steps=12"]
# each scenario, and the overrides of a separate run that configures it
SCENARIOS = {
    "slow4": ("{slow_workers:[3],slowdown:4}", ["async.slow_workers=[3]", "async.slowdown=4"]),
    "lognormal_wan": (
        "{speed:lognormal,cv:1.0,network:wan_100mbit}",
        ["async.speed=lognormal", "async.cv=1.0", "network=wan_100mbit"],
    ),
    "straggle": (
        "{straggler_prob:0.3,compute_s:0.1,network:10gbe}",
        ["async.straggler_prob=0.3", "async.compute_s=0.1", "network=10gbe"],
    ),
}
GIVEN = "+train.time_scenarios={" + ",".join(f"{n}:{v}" for n, (v, _) in SCENARIOS.items()) + "}"
DILOCO = ["algorithm=local_sgd", "algorithm.period=4", "outer=nesterov"]
METHODS = {
    "sync": [],
    "diloco": DILOCO,
    "streaming": [*DILOCO[:2], "outer=streaming", "outer.fragments=2", "outer.overlap=2"],
    "eager": [*DILOCO, "outer.delay=eager"],
    "noloco": [*DILOCO[:2], "outer=noloco"],
    "hierarchical": [
        "algorithm=node_sync",
        "comm.hierarchy.workers_per_node=2",
        "network.intra=nvlink",
        "outer=nesterov",
        "outer.period=4",
    ],
}


def clocks(run_dir) -> list[dict[str, float]]:
    return [
        {k: v for k, v in m.items() if k.startswith("time/modeled_s")}
        for m in metric_lines(run_dir)
    ]


@pytest.mark.parametrize("method", METHODS)
def test_each_scenario_is_the_clock_of_a_separate_run(tmp_path, method):
    args = [*SMALL_512, *BASE, *METHODS[method]]
    train(compose_config(*args, GIVEN), tmp_path / "scenarios")
    together = clocks(tmp_path / "scenarios")
    train(compose_config(*args), tmp_path / "own")
    assert [{"time/modeled_s": row["time/modeled_s"]} for row in together] == clocks(
        tmp_path / "own"
    )
    for name, (_, overrides) in SCENARIOS.items():
        train(compose_config(*args, *overrides), tmp_path / name)
        alone = [row["time/modeled_s"] for row in clocks(tmp_path / name)]
        assert [row[f"time/modeled_s@{name}"] for row in together] == alone, name
        assert alone != [row["time/modeled_s"] for row in together], name  # it is another clock


def test_resume_logs_the_same_scenario_clocks(tmp_path):
    args = [*CHECKPOINTED, *BASE[:3], *DILOCO, GIVEN]
    train(compose_config(*args), tmp_path / "reference")
    resumed = kill_and_resume(tmp_path, args, InjectedFailure)
    reference = clocks(tmp_path / "reference")
    assert clocks(resumed) == reference
    assert len({row["time/modeled_s@lognormal_wan"] for row in reference}) == len(reference)


def test_a_scenario_clock_is_an_analysis_axis(tmp_path):
    train(compose_config(*SMALL_512, *BASE, *DILOCO, GIVEN), tmp_path / "run")
    metrics = load_metrics_many([tmp_path / "run"])
    rows = metric_lines(tmp_path / "run")
    tta = time_to_accuracy(metrics, "train/loss", 100.0)  # reached at the first row
    assert tta["tta/time/modeled_s@slow4"].tolist() == [rows[0]["time/modeled_s@slow4"]]
    assert axis_label("time/modeled_s@slow4")[0] == "modeled wall-clock time, scenario slow4 (s)"
    assert horizon_unit("time/modeled_s@slow4") == "modeled s (slow4)"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm=async_sgd"], "AsyncSGD keeps its own event clock"),
        (["algorithm=adpsgd"], "keeps its own event clock"),
        (["algorithm=async_local_sgd"], "keeps its own event clock"),
        (["+train.time_scenarios={a:{network:5gbe}}"], "network: 5gbe is not a network preset"),
        (["+train.time_scenarios={a:{slowdwn:2}}"], "a.slowdwn is not a scenario key"),
        (["+train.time_scenarios={a:{slowdown:-1}}"], "a: async.slowdown=-1"),
        (["+train.time_scenarios={a:{slow_workers:[9]}}"], "has worker 9"),
        (["+train.time_scenarios={a:{speed:gamma}}"], "async.speed=gamma is not an option"),
        (["+train.time_scenarios={a@b:{slowdown:2}}"], "may hold only letters"),
        (["+train.time_scenarios={a:2}"], "must be a mapping"),
    ],
)
def test_bad_time_scenarios_are_one_line(overrides, message):
    given = overrides if overrides[0].startswith("+") else [*overrides, GIVEN]
    cfg = compose_config(*SMALL_512, *given)
    with pytest.raises(ConfigError, match="train.time_scenarios") as err:
        validate(cfg, given)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_gloo_ranks_log_the_simulated_scenario_clocks(tmp_path):
    """On real ranks (every process holds all K workers' streams and records the same ops)
    each scenario's clock is the simulator's."""
    given = GIVEN.replace("slow_workers:[3]", "slow_workers:[1]")
    args = [*SMALL_512, "workers=2", *BASE[1:], *DILOCO, given, "train.log_every=1"]
    train(compose_config(*args), tmp_path / "simulated")
    train_on_gloo(2, [(compose_config(*args, "backend=gloo"), tmp_path / "gloo")])
    simulated = clocks(tmp_path / "simulated")
    assert clocks(tmp_path / "gloo") == simulated
    assert set(simulated[0]) == {"time/modeled_s", *(f"time/modeled_s@{n}" for n in SCENARIOS)}


def test_a_resume_that_changes_a_scenarios_streams_is_refused(tmp_path):
    """A scenario's clock continues its checkpointed streams: a resume that makes it draw
    others (constant → lognormal) is refused, whatever train.resume_allow_changes says; a
    change between random kinds passes."""
    from omegaconf import OmegaConf

    from dpresearch.run.resume import check_speed_streams

    def config(speed: str):
        return compose_config(*SMALL_512, f"+train.time_scenarios={{a:{{speed:{speed}}}}}")

    saved = OmegaConf.to_container(config("exponential"), resolve=True)
    check_speed_streams(saved, config("lognormal"), tmp_path / "step_8.pt")
    with pytest.raises(ConfigError) as err:
        check_speed_streams(saved, config("constant"), tmp_path / "step_8.pt")
    assert "train.time_scenarios.a.speed=exponential" in str(err.value)
    assert "resume with train.time_scenarios.a.speed=exponential" in str(err.value)
