"""Time scenarios: one run's modeled clock under several speed models and networks.

For a lockstep algorithm the trajectory depends on neither the speed model (`async.speed`,
`compute_s`, `cv`, `slow_workers`, `slowdown`, `straggler_prob`, `straggler_factor`) nor the
network preset: only `time/modeled_s` does (`run/modeled_clock.py`). `train.time_scenarios`
names further clocks, each a mapping of those speed keys and `network: <preset>`:

    train.time_scenarios:
      slow2: {slow_workers: [0], slowdown: 2}
      lognormal_wan: {speed: lognormal, cv: 0.5, network: wan_100mbit}

and the run logs `time/modeled_s@<name>` beside `time/modeled_s` at every logged step: each
scenario's own `ModeledClock`, with the per-worker streams a run with those `async` keys would
draw (same seed), pricing the step's recorded ops on that scenario's network — exactly (float
equality) the `time/modeled_s` of a separate run configured with the scenario's keys
(`async.<key>=...`, `network=<preset>`). A key the scenario leaves out is the run's own. The
scenario's network is the preset's file over the schema's defaults, keeping the run's
`network.compute_step_s` (the compute ops hide behind), `network.intra` and `network.inter`
(a two-level cluster's tiers; `inter: null` prices the inter tier on the scenario's network).

Exactness: a separate run's ledger adds each op's price on its network to its per-purpose
totals in the order recorded; a scenario's `Repricing` does the same for every op the run's
ledger records (`CommLedger.repricings`), so its `modeled_s` — and the clock's increments read
from it — are the separate run's to the bit. Algorithms that keep their own event clock
(asynchronous SGD, AD-PSGD, asynchronous Local-SGD: their node references `${async}`, and their
trajectory depends on the speeds) are refused.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf

from dpresearch.asynchrony.options import SPEED_KEYS, AsyncOptions, check_options
from dpresearch.comm.hierarchy import INTER, INTRA, Hierarchy
from dpresearch.comm.ledger import OFF_STEP_PURPOSES, CommOp
from dpresearch.comm.network import NetworkModel
from dpresearch.errors import ConfigError
from dpresearch.options import CONF, Options

KEY = "train.time_scenarios"
METRIC = "time/modeled_s@"  # + the scenario's name
NAME = re.compile(r"^[A-Za-z0-9_-]+$")
# network keys a scenario keeps from the run: the compute ops hide behind, a cluster's tiers
RUN_NETWORK_KEYS = ("compute_step_s", "intra", "inter")


@dataclass(frozen=True)
class ScenarioOptions(Options):
    """One time scenario of `train.time_scenarios.<name>`: the speed keys of the `async` node
    and a network preset; every key left out (null) is the run's own."""

    NODE: ClassVar[str] = KEY + ".<name>"

    speed: str | None = None
    """compute-time model (`async.speed`)"""
    compute_s: float | None = None
    """mean seconds per gradient (`async.compute_s`)"""
    cv: float | None = None
    """coefficient of variation of lognormal and uniform times (`async.cv`)"""
    slow_workers: list[int] | None = None
    """workers whose times are multiplied by `slowdown` (`async.slow_workers`)"""
    slowdown: float | None = None
    """the slow workers' factor (`async.slowdown`)"""
    straggler_prob: float | None = None
    """probability that any one gradient straggles (`async.straggler_prob`)"""
    straggler_factor: float | None = None
    """a straggling gradient's factor (`async.straggler_factor`)"""
    network: str | None = None
    """a network preset (`conf/network/<preset>.yaml`: 1gbe, wan_100mbit, ...)"""

    def speed_options(self, run: Mapping[str, Any] | None) -> AsyncOptions:
        """The `async` node of a run with this scenario's speed keys over the run's `run`."""
        node = dict(run or {})
        node.update({k: getattr(self, k) for k in SPEED_KEYS if getattr(self, k) is not None})
        return AsyncOptions.from_node(node)

    def network_node(self, run: Mapping[str, Any]) -> dict[str, Any]:
        """The `network` node of a run with this scenario's preset (the run's own if none):
        the preset's keys, the others at their defaults (`run.build.network_model`'s)."""
        if self.network is None:
            return dict(run)
        node = preset_node(self.network)
        node.update({k: run[k] for k in RUN_NETWORK_KEYS if k in run})
        return node

    def cluster(self, cfg: DictConfig) -> DictConfig:
        """The `network` and `comm` nodes of a run of `cfg` with this scenario's network: what
        `run.build.network_model` and `hierarchy_of` price it from."""
        run = OmegaConf.to_container(cfg.network, resolve=True)
        node = self.network_node(run)  # type: ignore[arg-type]
        return OmegaConf.create({"network": node, "comm": cfg.get("comm") or {}})


def presets() -> list[str]:
    """The network presets: the files of `conf/network`."""
    return sorted(p.stem for p in (CONF / "network").glob("*.yaml"))


def preset_node(name: str) -> dict[str, Any]:
    """The keys `conf/network/<name>.yaml` sets."""
    if name not in presets():
        raise ValueError(
            f"network: {name} is not a network preset; choose one of: {', '.join(presets())}"
        )
    loaded = OmegaConf.to_container(OmegaConf.load(CONF / "network" / f"{name}.yaml"))
    assert isinstance(loaded, dict)
    return loaded


def scenarios_of(cfg: DictConfig) -> dict[str, ScenarioOptions]:
    """`train.time_scenarios` as options by name; ValueError (one line) for a bad name or key."""
    node = cfg.train.get("time_scenarios") or {}
    known = [f.name for f in dataclasses.fields(ScenarioOptions)]
    out = {}
    for name, keys in node.items():
        if not NAME.match(str(name)):
            raise ValueError(
                f"{KEY}: scenario name {name!r} may hold only letters, digits, _ and - "
                f"(it names the metric {METRIC}<name>)"
            )
        keys = OmegaConf.to_container(keys) if isinstance(keys, DictConfig) else keys
        if not isinstance(keys, Mapping):
            raise ValueError(
                f"{KEY}.{name} must be a mapping of {', '.join(known)}, e.g. "
                f"{{slow_workers: [0], slowdown: 2, network: wan_100mbit}}"
            )
        unknown = sorted(set(keys) - set(known))
        if unknown:
            raise ValueError(
                f"{KEY}.{name}.{unknown[0]} is not a scenario key; valid: {', '.join(known)}"
            )
        out[str(name)] = ScenarioOptions.from_node(keys)
    return out


def keeps_own_clock(cfg: DictConfig, cls: type | None) -> bool:
    """Whether the algorithm (`cls`: its class, None if unknown) keeps its own event clock (its
    node references `${async}`, or it does not step in lockstep): its trajectory depends on
    the speed model."""
    used = json.dumps(OmegaConf.to_container(cfg.algorithm, resolve=False))
    return "${async}" in used or (cls is not None and not cls.traits.lockstep)


def check_config(cfg: DictConfig, cls: type | None) -> None:
    """Raise `ConfigError` (one line naming the fix) for scenarios that cannot be logged by a
    run of algorithm `cls` (None: not importable, reported by the target check)."""
    try:
        scenarios = scenarios_of(cfg)
        if scenarios and keeps_own_clock(cfg, cls):
            name = cfg.algorithm._target_.rsplit(".", 1)[-1]
            raise ConfigError(
                f"{KEY} is set but {name} keeps its own event clock (its trajectory depends "
                "on the speed model): run it once per scenario with async.<key>=... and "
                "network=<preset>, or drop train.time_scenarios"
            )
        run_async = OmegaConf.to_container(cfg.get("async") or {}, resolve=True)
        for name, opts in scenarios.items():
            try:
                check_options(opts.speed_options(run_async), cfg.workers)  # type: ignore[arg-type]
                if opts.network is not None:
                    preset_node(opts.network)
            except ValueError as exc:
                raise ValueError(f"{KEY}.{name}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None


@dataclass
class Repricing:
    """A run's training traffic priced on another network, op by op as `CommLedger` prices
    its own (`modeled_by_purpose[purpose] += op's seconds`, in the order recorded), so that
    `modeled_s` is a run on that network's to the bit. Fed by `CommLedger.repricings`."""

    network: NetworkModel
    tiers: dict[str, NetworkModel] = field(default_factory=dict)
    modeled_by_purpose: dict[str, float] = field(default_factory=dict)
    _prices: dict[CommOp, float] = field(default_factory=dict)

    def network_of(self, op: CommOp) -> NetworkModel:
        """The link `op` is priced on: its tier's, else this network (as `CommLedger`)."""
        return self.tiers.get(op.tier, self.network) if op.tier else self.network

    def add(self, op: CommOp) -> None:
        price = self._prices.get(op)
        if price is None:
            price = self._prices[op] = self.network_of(op).op_seconds(op)
        self.modeled_by_purpose[op.purpose] = self.modeled_by_purpose.get(op.purpose, 0.0) + price

    @property
    def modeled_s(self) -> float:
        return sum(s for p, s in self.modeled_by_purpose.items() if p not in OFF_STEP_PURPOSES)

    def reset(self) -> None:
        self.modeled_by_purpose = {}

    def state_dict(self) -> dict:
        return {"modeled_by_purpose": dict(self.modeled_by_purpose)}

    def load_state_dict(self, state: dict) -> None:
        self.modeled_by_purpose = dict(state["modeled_by_purpose"])

    @classmethod
    def on(cls, network: NetworkModel, hierarchy: Hierarchy | None) -> Repricing:
        """Pricing on `network`, a two-level cluster's tiers on `hierarchy`'s links."""
        tiers = {INTRA: hierarchy.intra, INTER: hierarchy.inter} if hierarchy else {}
        return cls(network, tiers)
