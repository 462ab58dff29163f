"""Where the training loop's wall-clock time goes: compute, exposed communication, other.

The loop is cut into regions that tile it without gaps: *steps* (from the algorithm's
`before_forward` to the end of its `after_backward`) and everything between them (*other*:
epoch bookkeeping, the learning-rate schedule, metric reduction, evaluation, logging). Inside a
step, the time the step was blocked on a recorded collective is *exposed communication* (the
ledger's `exposed_s`); the rest of the step is *compute* (data, forward, backward, compression,
optimizer). So at every reading

    time/compute_s + time/comm_s + time/other_s = time/wall_s

Communication that ran in the background while the step computed (gradient buckets allreduced
during backward) is *overlapped*: `time/comm_overlapped_s` = the time some collective was in
flight minus the exposed time (see `CommLedger`). It is already inside `time/compute_s` (the
step was computing meanwhile) and is not a term of the sum.

All figures are cumulative seconds on this process, measured with `time.perf_counter()` on
the host: on a GPU, kernels still queued when a region ends are charged to a later region.
"""

from __future__ import annotations

import time

from dpresearch.comm.ledger import CommLedger


class LoopClock:
    """Accumulates the loop's regions; the clock starts at construction."""

    def __init__(self, ledger: CommLedger) -> None:
        self.ledger = ledger
        self.start = time.perf_counter()
        self.compute_s = self.comm_s = self.other_s = 0.0
        self._mark = self.start  # start of the region now open
        self._exposed_at_mark = ledger.exposed_s
        self._in_step = False

    def step_begins(self) -> None:
        """Close the open *other* region; a step starts now."""
        now = time.perf_counter()
        self.other_s += now - self._mark
        self._mark, self._exposed_at_mark, self._in_step = now, self.ledger.exposed_s, True

    def step_ends(self) -> None:
        """Close the step: its blocked time is exposed comm, the rest compute."""
        now = time.perf_counter()
        exposed = self.ledger.exposed_s - self._exposed_at_mark
        self.comm_s += exposed
        self.compute_s += now - self._mark - exposed
        self._mark, self._in_step = now, False

    def state_dict(self) -> dict[str, float]:
        """The cumulative regions, for a checkpoint (read between steps)."""
        return {"compute_s": self.compute_s, "comm_s": self.comm_s, "other_s": self.other_s}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Continue a resumed run's clock: its regions so far count as already elapsed, so
        the sum identity holds and `time/wall_s` is the run's time over all its attempts."""
        self.compute_s, self.comm_s = state["compute_s"], state["comm_s"]
        self.other_s = state["other_s"]
        now = time.perf_counter()
        self.start = now - (self.compute_s + self.comm_s + self.other_s)
        self._mark, self._exposed_at_mark = now, self.ledger.exposed_s

    def metrics(self) -> dict[str, float]:
        """The cumulative figures now (closing the open *other* region up to now)."""
        if self._in_step:
            raise RuntimeError("read the loop clock between steps")
        now = time.perf_counter()
        self.other_s += now - self._mark
        self._mark = now
        return {
            "time/compute_s": self.compute_s,
            "time/comm_s": self.comm_s,
            "time/comm_overlapped_s": self.ledger.overlapped_s,
            "time/other_s": self.other_s,
            "time/wall_s": now - self.start,
        }
