"""Learning-rate schedules as multipliers of the (scaled) base lr, defined in epochs.

Each class is a Hydra `_target_`; the trainer adds `steps_per_epoch` and `total_steps`.
Calling a schedule with the step index (0-based) gives the multiplier for that step.
Warm-up (all schedules but `OneCycle`): linear from `warmup_from` to 1 over `warmup_epochs`
(Goyal et al. 2017 warm up from the single-worker lr: `warmup_from = 1/K`), or over
`warmup_steps` optimizer steps instead (language models count warm-up in steps, e.g. nanoGPT's
100); the two are exclusive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class Schedule:
    """Base: linear warm-up then `after_warmup(epoch)`; `epoch` is fractional.

    `warmup_steps` (None: unused) gives the warm-up in steps; it is held as the equivalent
    `warmup_epochs` (steps / `steps_per_epoch`), so every schedule's decay starts where the
    warm-up ends. Setting both to > 0 is a `ValueError`.
    """

    def __init__(
        self,
        steps_per_epoch: int,
        total_steps: int,
        warmup_epochs: float = 0.0,
        warmup_from: float = 0.0,
        warmup_steps: int | None = None,
    ) -> None:
        self.steps_per_epoch = max(1, steps_per_epoch)
        self.total_steps = max(1, total_steps)
        if warmup_steps is not None:
            is_int = isinstance(warmup_steps, int) and not isinstance(warmup_steps, bool)
            if not is_int or warmup_steps < 0:
                raise ValueError(
                    f"schedule.warmup_steps={warmup_steps}: must be an integer >= 0 (or null)"
                )
            if warmup_steps > 0 and warmup_epochs > 0:
                raise ValueError(
                    "schedule.warmup_steps and schedule.warmup_epochs are both set; use one"
                )
            if warmup_steps > 0:
                warmup_epochs = warmup_steps / self.steps_per_epoch
        self.warmup_steps = warmup_steps
        self.warmup_epochs = warmup_epochs
        self.warmup_from = warmup_from

    def __call__(self, step: int) -> float:
        epoch = step / self.steps_per_epoch
        if epoch < self.warmup_epochs:
            frac = epoch / self.warmup_epochs
            return (self.warmup_from + (1.0 - self.warmup_from) * frac) * self.after_warmup(epoch)
        return self.after_warmup(epoch)

    def after_warmup(self, epoch: float) -> float:
        return 1.0

    @property
    def total_epochs(self) -> float:
        return self.total_steps / self.steps_per_epoch


class Constant(Schedule):
    """Constant lr (after optional warm-up)."""


class StepDecay(Schedule):
    """Multiply by `gamma` at each epoch in `milestones` (e.g. [150, 250], gamma 0.1)."""

    def __init__(self, milestones: Sequence[float] = (), gamma: float = 0.1, **kw) -> None:
        super().__init__(**kw)
        self.milestones = sorted(milestones)
        self.gamma = gamma

    def after_warmup(self, epoch: float) -> float:
        return self.gamma ** sum(epoch >= m for m in self.milestones)


class Cosine(Schedule):
    """Cosine decay from 1 to `final` over the run (after warm-up)."""

    def __init__(self, final: float = 0.0, **kw) -> None:
        super().__init__(**kw)
        self.final = final

    def after_warmup(self, epoch: float) -> float:
        span = max(self.total_epochs - self.warmup_epochs, 1e-12)
        t = min(max((epoch - self.warmup_epochs) / span, 0.0), 1.0)
        return self.final + (1 - self.final) * 0.5 * (1 + math.cos(math.pi * t))


class OneCycle(Schedule):
    """One-cycle (Smith 2018): linear rise from 1/`div_factor` to 1 over `pct_start` of the run,
    then cosine fall to 1/`final_div_factor`. Ignores `warmup_*`."""

    def __init__(
        self, pct_start: float = 0.3, div_factor: float = 25.0, final_div_factor: float = 1e4, **kw
    ) -> None:
        super().__init__(**kw)
        self.pct_start, self.div_factor, self.final_div = pct_start, div_factor, final_div_factor

    def __call__(self, step: int) -> float:
        t = step / self.total_steps
        low, high, end = 1 / self.div_factor, 1.0, 1 / (self.div_factor * self.final_div)
        if t < self.pct_start:
            return low + (high - low) * t / self.pct_start
        u = (t - self.pct_start) / max(1 - self.pct_start, 1e-12)
        return end + (high - end) * 0.5 * (1 + math.cos(math.pi * min(u, 1.0)))
