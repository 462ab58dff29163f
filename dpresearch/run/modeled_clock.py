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
- compression, hierarchy, Streaming DiLoCo's fragments: communication priced as recorded
  (compressed bytes, each tier on its link, fragments hidden behind τ steps charged only what
  they do not hide); a step with a fragment in flight is a round like any other.

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
"""

from __future__ import annotations

from typing import Any

from dpresearch.asynchrony.clock import EventClock
from dpresearch.asynchrony.options import AsyncOptions
from dpresearch.asynchrony.speed import SpeedModel
from dpresearch.comm.ledger import OFF_STEP_PURPOSES, CommLedger

OWN_CLOCK = "time/simulated_s"  # the metric of an algorithm that simulates its own clock


class ModeledClock:
    """Per-worker modeled seconds of a run (see the module docstring). `speed`: the run's
    speed model over all K workers, or None when the algorithm keeps its own clock."""

    def __init__(self, speed: SpeedModel | None, workers: int, ledger: CommLedger) -> None:
        self.speed, self.ledger = speed, ledger
        self.times = [0.0] * workers
        self._comm_at_begin = 0.0
        self._ops_at_begin = 0

    @classmethod
    def for_run(cls, cfg: Any, algorithm: Any, ledger: CommLedger, workers: int) -> ModeledClock:
        """The clock of a run: the `async` node's speed model for a lockstep algorithm, none
        for one with its own event clock (or one whose processes do not step together)."""
        own = not algorithm.traits.lockstep or isinstance(
            getattr(algorithm, "clock", None), EventClock
        )
        if own:
            return cls(None, workers, ledger)
        opts = AsyncOptions.from_node(cfg.get("async"))
        return cls(SpeedModel.from_options(opts, workers, cfg.seed), workers, ledger)

    def step_begins(self) -> None:
        self._comm_at_begin = self.ledger.modeled_s
        self._ops_at_begin = len(self.ledger.step_ops)

    def step_ends(self) -> None:
        """Every worker computed one step; a step that communicated is a round."""
        if self.speed is None:
            return
        times = self.times
        for w in range(len(times)):
            times[w] += self.speed.draw(w)
        comm = self.ledger.modeled_s - self._comm_at_begin
        ops = self.ledger.step_ops[self._ops_at_begin :]
        if comm > 0 or any(op.purpose not in OFF_STEP_PURPOSES for op in ops):
            times[:] = [max(times) + comm] * len(times)

    def seconds(self, algorithm_metrics: dict[str, Any]) -> float:
        """`time/modeled_s` now: the last worker's time, or the algorithm's own clock."""
        if self.speed is None:
            return float(algorithm_metrics.get(OWN_CLOCK, float("nan")))
        return max(self.times)

    def state_dict(self) -> dict:
        return {
            "times": list(self.times),
            "speed": self.speed.state_dict() if self.speed is not None else None,
        }

    def load_state_dict(self, state: dict | None) -> None:
        """Restore; None (a checkpoint from before the clock existed) starts it at the
        checkpoint's step from zero."""
        if state is None:
            return
        self.times = [float(t) for t in state["times"]]
        if self.speed is not None and state["speed"] is not None:
            self.speed.load_state_dict(state["speed"])
