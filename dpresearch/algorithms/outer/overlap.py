"""One-step-delayed outer steps and eager updates (Kale, Douillard & Donchev 2025, "Eager
Updates For Overlapped Communication and Computation in DiLoCo", arXiv 2502.12996): the outer
allreduce of round t runs behind the whole inner phase of round t + 1.

With K workers, round t's pseudo-gradients Δ_i^(t) and their mean Δ̄^(t):

- "delayed" (the paper's naive delayed outer gradients): at the end of round t every worker
  sends Δ_i^(t) and at once steps the outer optimizer on the mean that has just arrived,
  θ^(t) = OuterOpt(θ^(t−1), Δ̄^(t−1)) (round 1: nothing has arrived, θ^(1) = θ^(0)); the
  workers restart from θ^(t). One global θ.
- "eager": the missing mean is estimated with the worker's own fresh pseudo-gradient in place
  of its share of it: Δ̃_i^(t) = Δ_i^(t)/K + (Δ̄^(t−1) − Δ_i^(t−1)/K), i.e. the worker's own new
  contribution and the other K − 1 workers' contributions of the round before; every worker
  steps its own copy θ_i of the outer parameters (and outer optimizer state) on its own Δ̃_i.
  Summed over rounds the estimates telescope to Σ_t Δ̄^(t) (each worker's own share is applied
  one round early, the others' one round late).

At the run's end the last round's exchange (which would be merged after the last step) is
completed at once and applied as one more outer step on what is still missing — Δ̄^(T) for
"delayed", Δ̄^(T) − Δ_i^(T)/K for "eager" — so every round's pseudo-gradients are sent and
applied, as DiLoCo's are (the same messages, one round later).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

DELAYS = ("none", "delayed", "eager")


@dataclass(frozen=True)
class OverlapOptions:
    """The outer node's overlap of a round's exchange with the next round's compute:
    `delay` is `OuterOptions.delay` (declared there, with its meaning)."""

    delay: str

    @property
    def delayed(self) -> bool:
        """Whether round t's exchange is applied at the end of round t + 1."""
        return self.delay != "none"

    @property
    def eager(self) -> bool:
        return self.delay == "eager"

    def check(self, overlap: int, compressed: bool) -> None:
        """One line naming the fix for an option that cannot run (ValueError)."""
        if self.delay not in DELAYS:
            raise ValueError(f"outer.delay={self.delay}; choose one of: {', '.join(DELAYS)}")
        if self.delayed and overlap:
            raise ValueError(
                f"outer.delay={self.delay} overlaps each exchange with the whole next round "
                f"(H steps) in place of outer.overlap={overlap} steps; set outer.overlap=0"
            )
        if self.eager and compressed:
            raise ValueError(
                "outer.delay=eager stands the worker's own uncompressed pseudo-gradient in for "
                "its share of the average; use compressor@outer.compressor=identity "
                "error_feedback@outer.error_feedback=none, or outer.delay=delayed"
            )


def eager_estimate(
    own: Tensor, workers: int, mean_before: Tensor | None, own_before: Tensor | None
) -> Tensor:
    """Δ̃_i = Δ_i/K + (Δ̄_prev − Δ_i,prev/K) for `own` = Δ_i rows `[W, n]`; `mean_before`
    `[n]` and `own_before` `[W, n]` are the previous round's (None in the first round: zero)."""
    estimate = own / workers
    if mean_before is not None and own_before is not None:
        estimate = estimate + (mean_before.unsqueeze(0) - own_before / workers)
    return estimate
