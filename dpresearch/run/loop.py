"""The training loop, the same for every algorithm and every worker layout.

Per step: the algorithm plans which local workers compute and on which parameters
(`Algorithm.plan`; lockstep algorithms: all of them, on their own), receives the schedule's lr
multiplier, and each planned worker runs forward and backward on its own next batch into its
row of the flat gradient buffer (`WorkerCompute`); then the processes agree on the step's
verdict and the algorithm does what it does between backward and the next forward. Everything
else — metrics, evaluation, checkpoints, fault injection — is a `Hook` called at fixed points.

Ending a run. After each step's backward the processes agree on the step's verdict
(`Algorithm.agree`: lockstep algorithms in one tiny collective, none in a simulated run;
asynchronous ones by their messages): a stop request (SIGTERM/SIGINT, `dpresearch.run.stop`),
a non-finite training loss (`train.on_nonfinite`), a write into the run directory that the
machine refused in an earlier step's hooks (`io_errors.RunIOError`: a full disk; the main
process alone writes, so only it knows), a checkpoint due, the run's end. A stop finishes the
step (its hooks run) and ends with `Outcome("interrupted")`; a non-finite loss under `stop`
ends before the step's update with `Outcome("diverged")`; `skip_step` drops the update and
counts it; a refused write ends before the step's update with `Outcome("failed_io")` (after
the last step: at once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dpresearch.algorithms.base import StepPlan, Verdict
from dpresearch.comm.ledger import CommLedger
from dpresearch.run import stop
from dpresearch.run.build import Run
from dpresearch.run.io_errors import RunIOError
from dpresearch.run.timing import LoopClock

NONFINITE_MODES = ("stop", "skip_step", "continue")
GO_ON = Verdict()  # a step after which nothing happens but the next


@dataclass
class LoopState:
    """The loop's own position, checkpointed beside the run's parts: steps done, the best test
    accuracy, the last logged metrics (and the algorithm's among them), the loop clock and the
    skipped steps."""

    step: int = 0
    best_acc: float = 0.0
    last: dict[str, Any] = field(default_factory=dict)
    algorithm_metrics: dict[str, Any] = field(default_factory=dict)
    skipped: int = 0
    clock: LoopClock | None = None  # started with the loop
    _clock_state: dict[str, float] | None = None
    io_error: RunIOError | None = None  # a write a hook could not make (not checkpointed)

    def start_clock(self, ledger: CommLedger) -> LoopClock:
        """The loop clock, starting now (continuing a resumed run's regions)."""
        self.clock = LoopClock(ledger)
        if self._clock_state is not None:
            self.clock.load_state_dict(self._clock_state)
        return self.clock

    def state_dict(self) -> dict[str, Any]:
        clock = self.clock.state_dict() if self.clock is not None else self._clock_state
        return {
            "best_acc": self.best_acc,
            "last": self.last,
            "algorithm_metrics": self.algorithm_metrics,
            "clock": clock,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        self.step, self.best_acc, self.last = step, state["best_acc"], state["last"]
        self.algorithm_metrics, self.skipped = state["algorithm_metrics"], state["skipped"]
        self._clock_state = state["clock"]


@dataclass(frozen=True)
class Outcome:
    """How the loop ended: "finished", "interrupted" (after step `step`, by `signum`),
    "diverged" (a non-finite loss at step `step`, 1-based as metrics count) or "failed_io" (a
    refused write, `LoopState.io_error`; the run stopped after step `step`)."""

    status: str
    step: int
    signum: int = 0


class Hook:
    """Something the loop calls at fixed points; every method is optional."""

    def after_compute(self, step: int) -> None:
        """After the planned workers' forward/backward of `step` (0-based), before the
        agreement (fault injection)."""

    def after_step(self, done: int, verdict: Verdict) -> None:
        """After step `done` (1-based) was applied or dropped, with the step's verdict
        (`verdict.finished`: the run's last)."""


def run_loop(
    run: Run, state: LoopState, hooks: Sequence[Hook], on_nonfinite: str = "stop"
) -> Outcome:
    """Run steps from `state.step` on until the verdict says the run is finished (lockstep:
    after `run.total_steps`), or a stop request or a non-finite loss ends it (see the module
    docstring). The caller records stop requests (`stop.handling()`, held until the run's
    ending is written, since a scheduler's signal is handed on afterwards)."""
    if on_nonfinite not in NONFINITE_MODES:
        raise ValueError(f"train.on_nonfinite={on_nonfinite}")
    algorithm, compute = run.algorithm, run.compute
    clock = state.start_clock(run.ledger)
    rows = _Rows(run)
    run.replicas.train()
    step = state.step
    while True:
        plan = algorithm.plan(step)
        algorithm.set_lr(run.schedule(step))
        clock.step_begins()
        run.modeled.step_begins()
        algorithm.before_forward(step)
        rows.prepare(plan)
        compute.run(plan.workers, plan.ahead, plan.models)
        for hook in hooks:
            hook.after_compute(step)
        verdict = algorithm.agree(
            proposal(run, plan, step + 1, on_nonfinite, state.io_error is not None)
        )
        if verdict.io_failed:
            algorithm.drop_step(step)
            clock.step_ends()
            return Outcome("failed_io", step)
        if verdict.nonfinite:
            algorithm.drop_step(step)
            if on_nonfinite == "stop":
                clock.step_ends()
                return Outcome("diverged", step + 1)
            compute.forget_last(plan.workers)
            state.skipped += 1
        else:
            algorithm.after_backward(step)
        clock.step_ends()
        run.modeled.step_ends()
        done = state.step = step + 1
        for hook in hooks:
            try:
                hook.after_step(done, verdict)
            except RunIOError as exc:  # ends the run at the next agreement, all together
                state.io_error = state.io_error or exc
        run.ledger.end_step()  # the step's ops are priced and counted: keep the list bounded
        if verdict.finished:  # (on the last step: finishing is the stop)
            return Outcome("failed_io" if state.io_error is not None else "finished", done)
        if verdict.signum:
            return Outcome("interrupted", done, verdict.signum)
        step = done


def proposal(
    run: Run, plan: StepPlan, done: int, on_nonfinite: str, io_failed: bool = False
) -> Verdict:
    """This process's view of step `done` (1-based) for the agreement: a stop request, a
    non-finite loss of its workers (or one that reached it by message), a refused write, a
    checkpoint due by `train.checkpoint_every`, and the last step."""
    nonfinite = on_nonfinite != "continue" and not (
        run.compute.last_losses_finite(plan.workers) and run.algorithm.losses_finite()
    )
    finished = done >= run.total_steps
    every = run.checkpoint_every
    checkpoint = bool(every) and done % every == 0 and not finished
    signum = stop.requested() or 0
    if not (signum or nonfinite or checkpoint or finished or io_failed):
        return GO_ON  # (most steps: a frozen dataclass built per step costs microseconds)
    return Verdict(
        signum=signum,
        nonfinite=nonfinite,
        checkpoint=checkpoint,
        finished=finished,
        io_failed=io_failed,
    )


class _Rows:
    """Loads a plan's reads into their parameter rows (the compute overwrites the planned
    gradient rows: nothing to zero)."""

    def __init__(self, run: Run) -> None:
        self.replicas = run.replicas

    def prepare(self, plan: StepPlan) -> None:
        params = self.replicas.params
        for w, source in plan.reads.items():
            params[w].copy_(source)
