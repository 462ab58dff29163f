"""Seeded compute-time models: how long each worker takes for each gradient.

Worker w's n-th gradient takes

    compute_s × base_{w,n} × (slowdown if w ∈ slow_workers) × (straggler_factor if u_{w,n} < p)

seconds, where base has mean 1 (constant: 1; exponential: Exp(1); lognormal: exp(N(−σ²/2, σ²))
with σ² = ln(1 + cv²); uniform: 1 + √3·cv·U(−1, 1)) and u is uniform on [0, 1). Each worker
draws from its own streams, seeded by (purpose, run seed, worker) through `rng.stream_seed`, in
fixed blocks: the n-th draw of a worker is the same whatever order the workers' events are
processed in, so the simulator's event order is a pure function of the configuration.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from dpresearch.compress.rng import stream_seed

BLOCK = 256  # draws per refill; fixed, so the streams do not depend on how they are consumed


class DrawStream:
    """Successive draws of one worker from one numpy generator, refilled in fixed blocks of
    `BLOCK` (`fill(generator, n)`), so the n-th draw does not depend on how they are
    consumed."""

    def __init__(self, seed: int, fill) -> None:
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._fill = fill
        self._block: list[float] = []
        self._pos = 0

    def next(self) -> float:
        if self._pos == len(self._block):
            self._block = self._fill(self._rng, BLOCK).tolist()
            self._pos = 0
        value = self._block[self._pos]
        self._pos += 1
        return value

    def state_dict(self) -> dict:
        """The generator's state and the unread rest of its current block."""
        # plain floats: numpy scalars would make the checkpoint unreadable with weights_only
        return {
            "rng": self._rng.bit_generator.state,
            "block": [float(v) for v in self._block],
            "pos": self._pos,
        }

    def load_state_dict(self, state: dict) -> None:
        self._rng.bit_generator.state = state["rng"]
        self._block, self._pos = list(state["block"]), int(state["pos"])


def drawn_streams(kind: str, straggler_prob: float) -> tuple[str, ...]:
    """The per-worker streams a speed model draws from, as its `state_dict` holds them: "base"
    unless `kind` is constant, "straggle" where `straggler_prob` > 0. A checkpoint's state
    loads only into a model drawing the same ones (`run.resume.check_speed_streams`)."""
    return (
        *(("base",) if kind != "constant" else ()),
        *(("straggle",) if straggler_prob > 0 else ()),
    )


class SpeedModel:
    """Compute seconds of every worker's successive gradients (see the module docstring)."""

    def __init__(
        self,
        kind: str,
        compute_s: float,
        workers: int,
        seed: int,
        cv: float = 0.5,
        slow_workers: Iterable[int] = (),
        slowdown: float = 1.0,
        straggler_prob: float = 0.0,
        straggler_factor: float = 10.0,
    ) -> None:
        self.kind, self.compute_s, self.cv = kind, float(compute_s), float(cv)
        slow = set(slow_workers)
        self.scale = [self.compute_s * (slowdown if w in slow else 1.0) for w in range(workers)]
        self.straggler_prob, self.straggler_factor = straggler_prob, straggler_factor
        fill = self._base_fill()
        drawn = drawn_streams(kind, straggler_prob)
        self._base = [
            DrawStream(stream_seed("async.speed", kind, seed, w), fill) if "base" in drawn else None
            for w in range(workers)
        ]
        self._straggle = [
            DrawStream(stream_seed("async.straggler", seed, w), lambda g, n: g.random(n))
            if "straggle" in drawn
            else None
            for w in range(workers)
        ]

    @classmethod
    def from_options(cls, opts, workers: int, seed: int) -> SpeedModel:
        """The speed model the `async` node (`AsyncOptions`) describes for `workers`."""
        return cls(
            opts.speed,
            opts.compute_s,
            workers,
            seed,
            opts.cv,
            opts.slow_workers,
            opts.slowdown,
            opts.straggler_prob,
            opts.straggler_factor,
        )

    def _base_fill(self):
        """A function (generator, n) → n draws of mean 1, or None for constant times."""
        if self.kind == "constant":
            return None
        if self.kind == "exponential":
            return lambda g, n: g.standard_exponential(n)
        if self.kind == "lognormal":
            sigma = math.sqrt(math.log1p(self.cv**2))
            return lambda g, n: np.exp(g.normal(-0.5 * sigma**2, sigma, n))
        if self.kind == "uniform":
            half = math.sqrt(3.0) * self.cv
            return lambda g, n: 1.0 + half * g.uniform(-1.0, 1.0, n)
        raise ValueError(f"unknown speed model {self.kind!r}")

    def draw(self, worker: int) -> float:
        """Seconds of `worker`'s next gradient."""
        base = self._base[worker]
        seconds = self.scale[worker] * (base.next() if base is not None else 1.0)
        straggle = self._straggle[worker]
        if straggle is not None and straggle.next() < self.straggler_prob:
            seconds *= self.straggler_factor
        return seconds

    def state_dict(self) -> dict:
        """Every worker's streams (None where a stream is not drawn from)."""
        return {
            "base": [st.state_dict() if st is not None else None for st in self._base],
            "straggle": [st.state_dict() if st is not None else None for st in self._straggle],
        }

    def load_state_dict(self, state: dict) -> None:
        for name in ("base", "straggle"):
            for stream, saved in zip(getattr(self, f"_{name}"), state[name], strict=True):
                if (stream is None) != (saved is None):
                    raise ValueError(f"speed model state: {name} streams do not match")
                if stream is not None:
                    stream.load_state_dict(saved)

    def relative(self, worker: int) -> float:
        """`draw(worker)` ÷ compute_s: how many mean compute times the next gradient takes."""
        return self.draw(worker) / self.compute_s

    def describe(self) -> dict[str, float | str]:
        return {"speed": self.kind, "compute_s": self.compute_s}
