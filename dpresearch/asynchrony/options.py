"""The `async` config node: its schema and the checks that run before any worker starts.

`async` is a Python keyword, so the node is read as `cfg["async"]` and reaches the algorithm as
its `options` argument (`options: ${async}` in `dpresearch/conf/algorithm/async_sgd.yaml`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from dpresearch.options import Options

ORDERS = ("arrival", "seeded")
SPEEDS = ("constant", "exponential", "lognormal", "uniform")
LR_POLICIES = ("constant", "inverse", "delay_adaptive", "drop")
# the speed model's keys: read by every family's modeled clock (`run/modeled_clock.py`)
SPEED_KEYS = frozenset(
    {"speed", "compute_s", "cv", "slow_workers", "slowdown", "straggler_prob", "straggler_factor"}
)


@dataclass
class AsyncOptions(Options):
    """Asynchronous training: the `async` node (`algorithm=async_sgd`, `algorithm=adpsgd`; its
    speed keys, `SPEED_KEYS`, are every algorithm's compute model for `time/modeled_s`,
    `run/modeled_clock.py`).

    When the server applies gradients and whom it releases is the `protocol` node's (its own
    config group: `protocol=asgd|ssp|softsync|sync`, `asynchrony/protocol.py`). Not frozen:
    it is the schema's typed node, which overrides change.
    """

    NODE: ClassVar[str] = "async"

    delay: int | None = None
    """fixed-delay mode (overrides the simulator): step t applies g(x_{t−delay}) computed by
    worker t mod K, x_{t+1} = x_t − η·g(x_{t−τ}) with τ = min(t, delay); null: the event
    simulator"""
    speed: str = "constant"
    """compute-time model, mean `compute_s` seconds per gradient: constant | exponential |
    lognormal (coefficient of variation `cv`) | uniform (mean 1, `cv`)"""
    compute_s: float = 0.1
    """mean seconds per gradient"""
    cv: float = 0.5
    """coefficient of variation of lognormal and uniform times"""
    slow_workers: list[int] = field(default_factory=list)
    """workers whose times are multiplied by `slowdown`"""
    slowdown: float = 1.0
    """the slow workers' factor (4: four times slower)"""
    straggler_prob: float = 0.0
    """probability that any one gradient takes `straggler_factor` times longer"""
    straggler_factor: float = 10.0
    """a straggling gradient's factor"""
    lr_policy: str = "constant"
    """constant | inverse (η/max(1, τ), Zhang et al. 2016) | delay_adaptive (η·K/max(K, τ),
    Mishchenko et al. 2022) | drop (gradients with τ > `tau_max` are discarded)"""
    tau_max: int | None = None
    """the staleness above which lr_policy=drop discards a gradient"""
    delay_compensation: float = 0.0
    """λ > 0 adds DC-ASGD's λ·g⊙g⊙(x_now − x_read) (Zheng et al. 2017); 0: off"""
    inject_delay: float = 0.0
    """real mode: each worker sleeps this many seconds per gradient, scaled by its speed
    model's draw ÷ compute_s (so slow workers and stragglers are slow for real)"""
    timeout_s: float = 120.0
    """real mode: the server stops with an error when no push arrives for this long"""
    order: str = "arrival"
    """real mode: arrival (the server takes pushes as they arrive) | seeded (in the event
    simulator's order for this seed and speed model: a real run replays the simulated one
    exactly)"""

    @classmethod
    def from_node(cls, node: Mapping[str, Any] | None) -> AsyncOptions:
        """Options from a config node (or a plain mapping); missing keys take the defaults."""
        node = node or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(node) - known)
        if unknown:
            raise ValueError(f"async.{unknown[0]} is not an option; valid: {', '.join(known)}")
        values = {k: node[k] for k in node}
        if "slow_workers" in values:
            values["slow_workers"] = [int(w) for w in values["slow_workers"] or []]
        return cls(**values)


def _choose(key: str, value: str, options: tuple[str, ...]) -> str:
    return f"async.{key}={value} is not an option; choose one of: {', '.join(options)}"


def check_options(opts: AsyncOptions, workers: int) -> None:
    """Raise ValueError, one line naming the fix, for options that cannot run on `workers`."""
    if opts.delay is not None and opts.delay < 0:
        raise ValueError(
            f"async.delay={opts.delay}: the fixed delay τ must be >= 0 "
            "(or null for the event simulator)"
        )
    if opts.speed not in SPEEDS:
        raise ValueError(_choose("speed", opts.speed, SPEEDS))
    if not opts.compute_s > 0:
        raise ValueError(f"async.compute_s={opts.compute_s}: the mean compute time must be > 0")
    if opts.speed in ("lognormal", "uniform") and not opts.cv > 0:
        raise ValueError(f"async.cv={opts.cv}: async.speed={opts.speed} needs a cv > 0")
    if opts.speed == "uniform" and opts.cv > 1 / math.sqrt(3):
        raise ValueError(
            f"async.cv={opts.cv}: a uniform time with mean 1 stays positive only for "
            "cv <= 0.577 (1/√3); lower async.cv or use async.speed=lognormal"
        )
    bad = [w for w in opts.slow_workers if not 0 <= w < workers]
    if bad:
        raise ValueError(
            f"async.slow_workers has worker {bad[0]}, but workers are 0..{workers - 1}"
        )
    if not opts.slowdown > 0:
        raise ValueError(f"async.slowdown={opts.slowdown}: must be > 0 (4 = four times slower)")
    if not 0.0 <= opts.straggler_prob <= 1.0:
        raise ValueError(f"async.straggler_prob={opts.straggler_prob}: must be in [0, 1]")
    if not opts.straggler_factor > 0:
        raise ValueError(f"async.straggler_factor={opts.straggler_factor}: must be > 0")
    if opts.lr_policy not in LR_POLICIES:
        raise ValueError(_choose("lr_policy", opts.lr_policy, LR_POLICIES))
    if opts.lr_policy == "drop" and opts.tau_max is None:
        raise ValueError(
            "async.lr_policy=drop needs async.tau_max (gradients with τ > τ_max are "
            "discarded), e.g. async.tau_max=16"
        )
    if opts.tau_max is not None and opts.tau_max < 0:
        raise ValueError(f"async.tau_max={opts.tau_max}: must be >= 0")
    if opts.delay_compensation < 0:
        raise ValueError(
            f"async.delay_compensation={opts.delay_compensation}: λ must be >= 0 (0 = off)"
        )
    if opts.inject_delay < 0:
        raise ValueError(f"async.inject_delay={opts.inject_delay}: seconds must be >= 0")
    if not opts.timeout_s > 0:
        raise ValueError(f"async.timeout_s={opts.timeout_s}: must be > 0")
    if opts.order not in ORDERS:
        raise ValueError(_choose("order", opts.order, ORDERS))
