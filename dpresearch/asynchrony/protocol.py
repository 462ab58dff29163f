"""When the server applies gradients, and when each worker may start its next one.

A protocol is a class chosen by `_target_` (`dpresearch/conf/protocol/*.yaml`, selected with
`protocol=<name>`), built with the number of workers. The same object drives the event
simulator (whose clock decides the order of arrivals) and the real mode (where the network
decides it). After every push it answers two questions (`pushed`): does the server apply its
open group of gradients now, and which workers may now pull the parameters and start computing
(a released worker reads the server's parameters at that moment)?

- `ASGD`: apply every accepted gradient at once; the pusher starts again immediately.
- `SoftSync(c)` (Zhang et al. 2016): apply the mean once c accepted gradients have arrived; the
  pusher starts again immediately, on the parameters as they are.
- `Sync`: apply when all K workers have pushed this round, then release all K (a barrier).
- `SSP(max_staleness)` (stale-synchronous parallel, Ho et al. 2013): apply at once; a worker
  that has pushed n gradients may start its next one only while n − min_j n_j ≤ s, otherwise it
  waits until the slowest catches up. `max_ahead` records the largest n − min_j n_j any worker
  started with, so a run can show the bound held.

Dropped gradients (lr policy "drop") count as pushes for the workers' clocks but not towards a
group. A new protocol is one subclass (`pushed`, and its own state beyond the per-worker
counts) and one YAML; see `docs/extending.md`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar


class Protocol(ABC):
    """Base class: per-worker push counts (`clocks`), the workers waiting to be released, the
    accepted gradients of the open group. Subclasses implement `pushed`."""

    name: ClassVar[str]

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a protocol needs at least one worker, got {workers}")
        self.workers = workers
        self.clocks = [0] * workers  # gradients pushed (accepted or dropped)
        self.waiting: list[int] = []  # pushed, not yet allowed to start again
        self.accepted = 0  # accepted gradients in the open group

    def begin(self) -> list[int]:
        """Every worker starts at once, on the initial parameters."""
        return list(range(self.workers))

    @abstractmethod
    def pushed(self, worker: int, accepted: bool) -> tuple[bool, list[int]]:
        """`worker` has pushed a gradient (`accepted`: not dropped). Returns (apply the open
        group now, the workers that may start now in ascending id order)."""

    def describe(self) -> dict[str, Any]:
        """The protocol's name and parameters (stored in summary.json)."""
        return {"protocol": self.name}

    def summary(self) -> dict[str, Any]:
        """End-of-run facts (e.g. SSP's largest lead)."""
        return {}

    def state_dict(self) -> dict:
        """Per-worker progress, the waiting workers and the open group's count."""
        return {
            "clocks": list(self.clocks),
            "waiting": list(self.waiting),
            "accepted": self.accepted,
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["clocks"]) != self.workers:
            raise ValueError("protocol state: another number of workers")
        self.clocks, self.waiting = list(state["clocks"]), list(state["waiting"])
        self.accepted = int(state["accepted"])

    def _count(self, worker: int, accepted: bool) -> None:
        self.clocks[worker] += 1
        self.accepted += int(accepted)

    def _close_group_of(self, size: int) -> bool:
        """Whether the open group has `size` accepted gradients (then it is closed)."""
        if self.accepted >= size:
            self.accepted = 0
            return True
        return False


class ASGD(Protocol):
    """Apply every gradient on arrival; the pusher starts again at once."""

    name = "asgd"

    def pushed(self, worker: int, accepted: bool) -> tuple[bool, list[int]]:
        self._count(worker, accepted)
        return self._close_group_of(1), [worker]


# The protocol of a run that names none: conf/config.yaml's `protocol: asgd` (a test compares
# them); the checks refuse any other for an algorithm that takes no protocol.
DEFAULT_PROTOCOL: type[Protocol] = ASGD


class SoftSync(Protocol):
    """Apply the mean of every `c` accepted gradients (Zhang et al.'s n-softsync: c = K/n)."""

    name = "softsync"

    def __init__(self, workers: int, c: int | None = None) -> None:
        super().__init__(workers)
        if c is None or c < 1:
            raise ValueError(
                "protocol=softsync needs protocol.c >= 1 (gradients per update; Zhang et al.'s "
                f"n-softsync: c = K/n), e.g. protocol.c={max(1, workers // 2)}"
            )
        self.c = int(c)

    def pushed(self, worker: int, accepted: bool) -> tuple[bool, list[int]]:
        self._count(worker, accepted)
        return self._close_group_of(self.c), [worker]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "c": self.c}


class Sync(Protocol):
    """A barrier each round: apply once all K have pushed, then release all K."""

    name = "sync"

    def pushed(self, worker: int, accepted: bool) -> tuple[bool, list[int]]:
        self._count(worker, accepted)
        self.waiting.append(worker)
        if len(self.waiting) < self.workers:
            return False, []
        released, self.waiting = sorted(self.waiting), []
        apply = self.accepted > 0
        self.accepted = 0
        return apply, released


class SSP(Protocol):
    """Stale-synchronous parallel: no worker starts more than `max_staleness` gradients ahead
    of the slowest."""

    name = "ssp"

    def __init__(self, workers: int, max_staleness: int | None = None) -> None:
        super().__init__(workers)
        if max_staleness is None:
            raise ValueError(
                "protocol=ssp needs protocol.max_staleness=s (how many gradients a worker may "
                "run ahead of the slowest), e.g. protocol.max_staleness=4"
            )
        if max_staleness < 0:
            raise ValueError(f"protocol.max_staleness={max_staleness}: must be >= 0")
        self.max_staleness = int(max_staleness)
        self.max_ahead = 0

    def pushed(self, worker: int, accepted: bool) -> tuple[bool, list[int]]:
        self._count(worker, accepted)
        apply = self._close_group_of(1)
        self.waiting.append(worker)
        slowest = min(self.clocks)
        released = sorted(j for j in self.waiting if self.clocks[j] - slowest <= self.max_staleness)
        if released:
            self.waiting = [j for j in self.waiting if j not in released]
            self.max_ahead = max(self.max_ahead, max(self.clocks[j] for j in released) - slowest)
        return apply, released

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "max_staleness": self.max_staleness}

    def summary(self) -> dict[str, Any]:
        return {"async/ssp_max_ahead": self.max_ahead}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "max_ahead": self.max_ahead}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.max_ahead = int(state["max_ahead"])
