"""The modeled wall clock of every family: `time/modeled_s`.

Each worker w keeps its own modeled time t_w. A step of a lockstep algorithm adds worker w's
compute time for that step, drawn from the run's speed model (`async.speed`, `async.compute_s`,
`async.slow_workers` … — `asynchrony/speed.py`, the same seeded per-worker streams the
asynchronous simulator draws from). A step that recorded communication of the training steps
(any purpose but evaluation and metrics: the ops `comm/modeled_s` prices) is a round: it ends
when the last participant arrives, and its collectives take what the network model charges
them in that step (Δc, the step's increment of `comm/modeled_s`):

    t_w ← max_v t_v + Δc   for every worker w.

A step without communication leaves the workers apart, each at its own speed. So:

- synchronous data parallelism (one allreduce per step): every step waits for the slowest
  worker, T = Σ_steps (max_w c_w,s + Δc_s);
- local SGD / DiLoCo / SlowMo (communication every H steps): each worker runs its H steps at
  its own speed, the outer allreduce starts when the slowest arrives:
  T_round = max_w Σ_{h<H} c_w,h + Δc_round;
- gossip (D-PSGD, CHOCO, SGP): every gossip step is treated as a round of all workers (the
  slowest worker holds everyone back) — an upper bound on a worker that waits only for its
  in-peers;
- NoLoCo (no all-reduce: a worker meets only its peer of the round): the algorithm names the
  groups that met in the step (`meetings()`, each a tuple of worker ids), and each group ends
  apart: t_w ← max_{v∈g} t_v + Δc for w in g — a slow worker holds back its peer only;
- a two-level cluster (`comm.hierarchy`, G workers a node): a step whose communication all
  stayed inside the nodes (the intra tier: hierarchical DiLoCo's per-step gradient average,
  `algorithm=node_sync`) is a round of each node on its own, t_w ← max_{v ∈ node(w)} t_v + Δc
  (every node's collective runs at once, priced once); a step with any other op is a round of
  all workers. So hierarchical DiLoCo's outer round takes
  T_round = max_nodes Σ_{h<H} (max_{w ∈ node} c_w,h + c_intra) + c_outer;
- compression, hierarchy: communication priced as recorded (compressed bytes, each tier on
  its link).

An exchange that runs behind computation (ops recorded `hidden_behind(h)`: a Streaming DiLoCo
fragment merged τ steps later, a one-step-delayed or eager outer round merged H steps later)
is a background transfer on one link: it starts when its last participant sends it and the
link is free, s = max(max_w t_w, link free), takes its full modeled seconds T (what the
network model charges without hiding), and h steps later every worker waits for it,
t_w ← max(t_w, s + T); the workers are not gathered when it is sent. So a delayed outer round
t ends for worker w at max(its own arrival, the end of round t − 1's allreduce): the
communication hides behind the next round's compute, what it does not hide is waited for. An
exposed op starts when the link is free too.

`time/modeled_s` is max_w t_w: when the last worker is done. Algorithms that run their own
event simulator (asynchronous SGD, AD-PSGD: an `EventClock` as `algorithm.clock`) already
price each worker's compute under the same speed model and every transfer on the network:
their `time/simulated_s` is the modeled clock and this one draws nothing. Asynchronous
Local-SGD (`algorithm=async_local_sgd`) is one of them: its event clock draws a worker's H_w
step times per push (`EventClock.steps`), so a push arrives at pull + Σ_h c_w,h + push after
the worker's release, and a step's time is the arrival of the push it belongs to.

Every process of a lockstep run holds all K workers' streams and draws the same times from
the run's seed, and every process records the same collectives, so the clock is identical on
every rank and in the simulator. The state (the streams and t) is checkpointed: a resumed run
continues the same clock.

`train.time_scenarios` (`run/time_scenarios.py`) adds clocks of other speed models and
networks, each priced by its own `Repricing` of the ledger's ops (`pricing`) and logged as
`time/modeled_s@<name>`; their state is checkpointed with this one's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import OmegaConf

from dpresearch.asynchrony.clock import EventClock
from dpresearch.asynchrony.options import AsyncOptions
from dpresearch.asynchrony.speed import SpeedModel
from dpresearch.comm.hierarchy import INTRA
from dpresearch.comm.ledger import OFF_STEP_PURPOSES, CommLedger
from dpresearch.run.time_scenarios import KEY, METRIC, Repricing, scenarios_of

OWN_CLOCK = "time/simulated_s"  # the metric of an algorithm that simulates its own clock


class ModeledClock:
    """Per-worker modeled seconds of a run (see the module docstring). `speed`: the run's
    speed model over all K workers, or None when the algorithm keeps its own clock.
    `per_node`: G of a two-level cluster (None: flat), whose intra-only steps are node rounds."""

    def __init__(
        self,
        speed: SpeedModel | None,
        workers: int,
        ledger: CommLedger,
        meetings: Callable[[], Sequence[Sequence[int]] | None] | None = None,
        per_node: int | None = None,
        pricing: Any = None,
    ) -> None:
        self.speed, self.ledger, self.per_node = speed, ledger, per_node
        # what prices the ops (`modeled_s`, `network_of`): the ledger, or a scenario's
        # `Repricing` of it on another network
        self.pricing = pricing if pricing is not None else ledger
        self.scenarios: dict[str, ModeledClock] = {}  # `train.time_scenarios`' clocks
        # the groups that met in the step (None: everyone, a round of all workers)
        self.meetings = meetings
        self.times = [0.0] * workers
        self._comm_at_begin = 0.0
        self._ops_at_begin = 0
        self.link_free = 0.0  # when the link finishes what was sent on it
        self.pending: list[list[float]] = []  # [steps left, ready at] of background exchanges

    @classmethod
    def for_run(
        cls,
        cfg: Any,
        algorithm: Any,
        ledger: CommLedger,
        workers: int,
        pricings: dict[str, Repricing] | None = None,
    ) -> ModeledClock:
        """The clock of a run: the `async` node's speed model for a lockstep algorithm, none
        for one with its own event clock (or one whose processes do not step together).
        `pricings`: each time scenario's (`train.time_scenarios`) pricing of the ops."""
        own = not algorithm.traits.lockstep or isinstance(
            getattr(algorithm, "clock", None), EventClock
        )
        scenarios = scenarios_of(cfg)
        if own:
            if scenarios:
                raise ValueError(f"{KEY}: the algorithm keeps its own event clock")
            return cls(None, workers, ledger)
        node = cfg.get("async")
        opts = AsyncOptions.from_node(node)
        per_node = cfg.get("comm", {}).get("hierarchy", {}).get("workers_per_node")
        speed = SpeedModel.from_options(opts, workers, cfg.seed)
        meetings = getattr(algorithm, "meetings", None)
        clock = cls(speed, workers, ledger, meetings, per_node)
        run_async = OmegaConf.to_container(node, resolve=True) if node is not None else {}
        for name, scenario in scenarios.items():
            pricing = (pricings or {})[name]
            ledger.repricings.append(pricing)
            scenario_speed = SpeedModel.from_options(
                scenario.speed_options(run_async),  # type: ignore[arg-type]
                workers,
                cfg.seed,
            )
            clock.scenarios[name] = cls(scenario_speed, workers, ledger, None, per_node, pricing)
        return clock

    def step_begins(self) -> None:
        self._comm_at_begin = self.pricing.modeled_s
        self._ops_at_begin = len(self.ledger.step_ops)
        for scenario in self.scenarios.values():
            scenario.step_begins()

    def step_ends(self) -> None:
        """Every worker computed one step; a step that communicated is a round."""
        if self.speed is None:
            return
        # asked once a step (NoLoCo hands its pairs over once), for every scenario's clock too
        met = self.meetings() if self.meetings is not None else None
        for scenario in self.scenarios.values():
            scenario.advance(met)
        self.advance(met)

    def advance(self, met: Sequence[Sequence[int]] | None) -> None:
        """`step_ends` with `met`, the groups that met in the step (None: everyone)."""
        assert self.speed is not None
        times = self.times
        for w in range(len(times)):
            times[w] += self.speed.draw(w)
        comm = self.pricing.modeled_s - self._comm_at_begin
        ops = [
            op
            for op in self.ledger.step_ops[self._ops_at_begin :]
            if op.purpose not in OFF_STEP_PURPOSES
        ]
        hidden = [op for op in ops if op.hidden_steps]
        arrived = max(times)
        for entry in self.pending:
            entry[0] -= 1
        if hidden:  # background exchanges: their full seconds, charged here only when waited for
            network = self.pricing.network_of
            comm -= sum(network(op).op_seconds(op) for op in hidden)
            start = max(arrived, self.link_free)
            self.link_free = start + sum(
                network(op).seconds(op.kind, op.nbytes, op.group, op.peers) for op in hidden
            )
            self.pending.append([float(max(op.hidden_steps for op in hidden)), self.link_free])
        if len(hidden) < len(ops) or (not hidden and comm > 0):
            groups = met
            g = self.per_node
            if groups is None and g and ops and all(op.tier == INTRA for op in ops):
                groups = [range(start, start + g) for start in range(0, len(times), g)]
            if groups is None:
                self.link_free = max(arrived, self.link_free) + comm
                times[:] = [self.link_free] * len(times)
            else:  # NoLoCo's pairs, a cluster's nodes: each group ends apart, on its own link
                for group in groups:
                    end = max(times[w] for w in group) + comm
                    for w in group:
                        times[w] = end
        for _, ready in [entry for entry in self.pending if entry[0] <= 0]:
            times[:] = [max(t, ready) for t in times]
        self.pending = [entry for entry in self.pending if entry[0] > 0]

    def seconds(self, algorithm_metrics: dict[str, Any]) -> float:
        """`time/modeled_s` now: the last worker's time, or the algorithm's own clock."""
        if self.speed is None:
            return float(algorithm_metrics.get(OWN_CLOCK, float("nan")))
        return max(self.times)

    def scenario_seconds(self) -> dict[str, float]:
        """`time/modeled_s@<name>` of every time scenario now."""
        return {METRIC + name: max(clock.times) for name, clock in self.scenarios.items()}

    def state_dict(self) -> dict:
        state = {
            "times": list(self.times),
            "speed": self.speed.state_dict() if self.speed is not None else None,
            "link_free": self.link_free,
            "pending": [list(entry) for entry in self.pending],
        }
        if self.pricing is not self.ledger:
            state["pricing"] = self.pricing.state_dict()
        if self.scenarios:
            state["scenarios"] = {n: c.state_dict() for n, c in self.scenarios.items()}
        return state

    def load_state_dict(self, state: dict | None) -> None:
        """Restore; None (a checkpoint from before the clock existed) starts it at the
        checkpoint's step from zero."""
        if state is None:
            return
        self.times = [float(t) for t in state["times"]]
        self.link_free = float(state.get("link_free", max(self.times)))
        self.pending = [[float(a), float(b)] for a, b in state.get("pending", [])]
        if self.speed is not None and state["speed"] is not None:
            self.speed.load_state_dict(state["speed"])
        if "pricing" in state:
            self.pricing.load_state_dict(state["pricing"])
        saved = state.get("scenarios") or {}
        for name, clock in self.scenarios.items():
            # a scenario the checkpoint lacks (added with train.resume_allow_changes): from zero
            clock.load_state_dict(saved.get(name))
