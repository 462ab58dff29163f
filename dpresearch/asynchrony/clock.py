"""The simulated clock: an event queue of push arrivals.

A worker released at time t pulls the parameters (the server's state at t; the transfer takes
`pull_s`), computes its gradient (the speed model's draw) and pushes it (`push_s`); the push
reaches the server at

    t + pull_s + compute + push_s,

where the server applies it at once and releases workers per protocol, all in that instant (a
worker's push and its next pull are one event). Transfers are priced by the network model as
one point-to-point message each, α + bytes/B, per worker (the server's link is not a shared
bottleneck). Arrivals at the same time are taken in worker-id order, so the event order is a
pure function of the configuration.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from dpresearch.asynchrony.speed import SpeedModel
from dpresearch.comm.network import NetworkModel


def transfer_seconds(network: NetworkModel, nbytes: int) -> float:
    """One point-to-point message of `nbytes` between a worker and the server: α + bytes/B
    (what the ledger charges a message)."""
    return network.seconds("p2p", nbytes, 2, peers=1)


class EventClock:
    """Pending arrivals of in-flight workers and the simulated time `now`. `steps[w]`: the
    speed model's draws worker w computes between a pull and its push (None: one each, a
    gradient; asynchronous Local-SGD: its H_w local steps, summed in order)."""

    def __init__(
        self,
        speed: SpeedModel,
        pull_s: float,
        push_s: float,
        steps: Sequence[int] | None = None,
    ) -> None:
        self.speed, self.pull_s, self.push_s = speed, pull_s, push_s
        self.steps = list(steps) if steps is not None else None
        self.now = 0.0
        self._heap: list[tuple[float, int]] = []

    def start(self, worker: int) -> None:
        """`worker` pulls at `now` and starts its next gradient (or its next `steps`)."""
        draws = 1 if self.steps is None else self.steps[worker]
        compute = self.speed.draw(worker)
        for _ in range(draws - 1):
            compute += self.speed.draw(worker)
        arrival = self.now + self.pull_s + compute + self.push_s
        heapq.heappush(self._heap, (arrival, worker))

    def next_arrival(self) -> int:
        """Advance `now` to the earliest pending arrival and return its worker."""
        if not self._heap:
            raise RuntimeError("no worker is computing: the protocol released nobody")
        self.now, worker = heapq.heappop(self._heap)
        return worker

    def in_flight(self) -> tuple[int, ...]:
        """The workers with a pending arrival (released, not yet pushed), in no set order."""
        return tuple(w for _, w in self._heap)

    def state_dict(self) -> dict:
        """`now` and the pending arrivals (the speed model's streams are its own state)."""
        return {"now": self.now, "heap": list(self._heap)}

    def load_state_dict(self, state: dict) -> None:
        self.now = float(state["now"])
        self._heap = [(float(t), int(w)) for t, w in state["heap"]]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)
