"""Staleness-aware learning rates and the staleness statistics of a run.

A gradient's staleness τ is the server's version when it is applied minus the version the
worker read: the number of updates the server made while the worker computed.
"""

from __future__ import annotations

import copy
from typing import Any

from dpresearch.asynchrony.options import LR_POLICIES


class StalenessPolicy:
    """The learning-rate factor of a gradient with staleness τ (None: discard it).

    constant: 1; inverse: 1/max(1, τ) (Zhang et al. 2016's α/τ, with τ = 0 taken as 1);
    delay_adaptive: K/max(K, τ) (Mishchenko et al. 2022); drop: 1 if τ ≤ tau_max, else the
    gradient is discarded.
    """

    def __init__(self, name: str, workers: int, tau_max: int | None = None) -> None:
        if name not in LR_POLICIES:
            raise ValueError(f"unknown lr policy {name!r}; choose one of: {', '.join(LR_POLICIES)}")
        if name == "drop" and tau_max is None:
            raise ValueError("lr policy drop needs tau_max")
        self.name, self.workers, self.tau_max = name, workers, tau_max

    def factor(self, tau: int) -> float | None:
        if self.name == "inverse":
            return 1.0 / max(1, tau)
        if self.name == "delay_adaptive":
            return self.workers / max(self.workers, tau)
        if self.name == "drop" and tau > self.tau_max:
            return None
        return 1.0


def count_tau(histogram: list[int], tau: int) -> None:
    """Add one τ to `histogram` (index τ → count), growing it as needed."""
    if tau >= len(histogram):
        histogram.extend([0] * (tau + 1 - len(histogram)))
    histogram[tau] += 1


def mean_tau(histogram: list[int]) -> float:
    """The mean τ a histogram holds (0 when empty)."""
    total = sum(histogram)
    return sum(t * n for t, n in enumerate(histogram)) / total if total else 0.0


class StalenessStats:
    """τ of every applied gradient: a histogram over the run, per-worker counts, and the mean
    and maximum since the last `window()` call."""

    def __init__(self, workers: int) -> None:
        self.histogram: list[int] = []
        self.applied_by_worker = [0] * workers
        self.dropped = 0
        self._sum = self._count = self._max = 0

    def applied(self, worker: int, tau: int) -> None:
        count_tau(self.histogram, tau)
        self.applied_by_worker[worker] += 1
        self._sum += tau
        self._count += 1
        self._max = max(self._max, tau)

    _FIELDS = ("histogram", "applied_by_worker", "dropped", "_sum", "_count", "_max")

    def state_dict(self) -> dict:
        """The run's histogram and counts and the open window."""
        return {name: copy.copy(getattr(self, name)) for name in self._FIELDS}

    def load_state_dict(self, state: dict) -> None:
        for name in self._FIELDS:
            setattr(self, name, copy.copy(state[name]))

    def drop(self) -> None:
        self.dropped += 1

    @property
    def mean(self) -> float:
        """Mean τ over the whole run."""
        return mean_tau(self.histogram)

    def window(self) -> dict[str, float]:
        """`async/staleness_mean` and `_max` over the gradients applied since the last call
        (NaN if none), then start a new window."""
        mean = self._sum / self._count if self._count else float("nan")
        out = {
            "async/staleness_mean": mean,
            "async/staleness_max": float(self._max) if self._count else float("nan"),
        }
        self._sum = self._count = self._max = 0
        return out

    def totals(self) -> dict[str, Any]:
        per_worker = self.applied_by_worker
        return {
            "async/gradients_applied": sum(per_worker),
            "async/dropped": self.dropped,
            "async/applied_per_worker_min": min(per_worker),
            "async/applied_per_worker_max": max(per_worker),
        }

    def summary(self) -> dict[str, Any]:
        """The whole run: histogram (index τ → count), per-worker counts, mean τ."""
        return {
            "async/tau_histogram": list(self.histogram),
            "async/applied_per_worker": list(self.applied_by_worker),
            "async/staleness_mean_run": self.mean,
            "async/staleness_max_run": len(self.histogram) - 1 if self.histogram else 0,
        }
