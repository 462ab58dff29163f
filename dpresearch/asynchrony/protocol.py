"""When the server applies gradients, and when each worker may start its next one.

The same rules drive the simulator (`clock.py` decides the order of arrivals) and the real mode
(the network decides it). After every push the protocol answers two questions: does the server
apply its open group of gradients now, and which workers may now pull the parameters and start
computing (a released worker reads the server's parameters at that moment)?

- asgd: apply every accepted gradient at once; the pusher starts again immediately.
- softsync(c) (Zhang et al. 2016): apply the mean once c accepted gradients have arrived; the
  pusher starts again immediately, on the parameters as they are.
- sync: apply when all K workers have pushed this round, then release all K (a barrier).
- ssp(s) (stale-synchronous parallel, Ho et al. 2013): apply at once; a worker that has pushed
  n gradients may start its next one only while n − min_j n_j ≤ s, otherwise it waits until
  the slowest catches up. `max_ahead` records the largest n − min_j n_j any worker started
  with, so a run can show the bound held.

Dropped gradients (lr policy "drop") count as pushes for the workers' clocks but not towards a
group.
"""

from __future__ import annotations

from dpresearch.asynchrony.options import PROTOCOLS


class Protocol:
    """Protocol `name` over `workers` workers (see the module docstring)."""

    def __init__(
        self,
        name: str,
        workers: int,
        max_staleness: int | None = None,
        softsync_c: int | None = None,
    ) -> None:
        if name not in PROTOCOLS:
            raise ValueError(f"unknown protocol {name!r}; choose one of: {', '.join(PROTOCOLS)}")
        self.name, self.workers = name, workers
        self.max_staleness = max_staleness
        self.group_size = {"asgd": 1, "ssp": 1, "softsync": softsync_c or 1, "sync": workers}[name]
        self.clocks = [0] * workers  # gradients pushed (accepted or dropped)
        self.waiting: list[int] = []  # pushed, not yet allowed to start again
        self.accepted = 0  # accepted gradients in the open group
        self.max_ahead = 0

    def begin(self) -> list[int]:
        """Every worker starts at once, on the initial parameters."""
        return list(range(self.workers))

    def state_dict(self) -> dict:
        """Per-worker progress, the waiting workers and the open group's count."""
        return {
            "clocks": list(self.clocks),
            "waiting": list(self.waiting),
            "accepted": self.accepted,
            "max_ahead": self.max_ahead,
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["clocks"]) != self.workers:
            raise ValueError("protocol state: another number of workers")
        self.clocks, self.waiting = list(state["clocks"]), list(state["waiting"])
        self.accepted, self.max_ahead = int(state["accepted"]), int(state["max_ahead"])

    def pushed(self, worker: int, accepted: bool) -> tuple[bool, list[int]]:
        """`worker` has pushed a gradient (`accepted`: not dropped). Returns (apply the open
        group now, the workers that may start now in ascending id order)."""
        self.clocks[worker] += 1
        self.accepted += int(accepted)
        if self.name == "sync":
            self.waiting.append(worker)
            if len(self.waiting) < self.workers:
                return False, []
            released, self.waiting = sorted(self.waiting), []
            apply = self.accepted > 0
            self.accepted = 0
            return apply, released
        apply = self.accepted >= self.group_size
        if apply:
            self.accepted = 0
        if self.name != "ssp":
            return apply, [worker]
        self.waiting.append(worker)
        slowest = min(self.clocks)
        released = sorted(j for j in self.waiting if self.clocks[j] - slowest <= self.max_staleness)
        if released:
            self.waiting = [j for j in self.waiting if j not in released]
            self.max_ahead = max(self.max_ahead, max(self.clocks[j] for j in released) - slowest)
        return apply, released
