"""Byte and time accounting: every recorded collective says what left each worker, and why.

Bytes. `comm/bytes` in the metrics comes from these records — the size of the tensors each
worker handed to the network (values, indices, scales, padding: whatever the payload holds) —
never a formula. A collective counts its payload once per sending worker; a broadcast charges
its source only (priced as a ring, `Communicator.rooted_algorithm`: every worker forwarding
it); a point-to-point send of D bytes to p peers counts p·D for the sender (an
exponential graph is not as cheap as a ring). A receiver is charged nothing for what it only
received.

Purposes. Every record carries a purpose: "algorithm" (gradients, models, gossip messages: what
`comm/bytes` counts), "buffers" (BatchNorm statistics kept in step), "eval" (evaluation's
consensus model and sums), "metrics" (the logged training loss and accuracy), or any other name
an algorithm chooses. Bytes are kept per purpose and per local worker. The network model prices
every record; `modeled_s` sums the purposes that are part of training steps (all but
`OFF_STEP_PURPOSES`), since buffer broadcasts are real traffic of the step while evaluation and
logging traffic are not the method's cost.

Messages. A point-to-point message (`Communicator.isend`) is recorded at the send in O(1): its
bytes charged to the sending local worker under its purpose, one "p2p" op (α + bytes/B) in
the op table and the modeled seconds, and the sender's own clock (`clock`: simulated seconds
for an event simulator, wall seconds since the ledger started for real ranks). A message
received from another process is recorded too, under its sender (`heard`), and priced in the
receiver's op table: that is how a process that hears every worker (a parameter server) knows
their traffic, and the run's ops, without a collective.

Time. The communicator reports, for each recorded collective, the interval it was in flight
(launch → completion) and the interval the calling thread was blocked on it. `exposed_s` sums
the blocked time (what a step actually waited for); `busy_s` is the length of the union of all
those intervals (the time some collective was in flight); `overlapped_s = busy_s − exposed_s`
is communication hidden behind computation.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from dpresearch.comm.network import NetworkModel

ALGORITHM = "algorithm"
BUFFERS = "buffers"
EVAL = "eval"
METRICS = "metrics"
# Traffic outside the training steps: recorded and priced, but not in `modeled_s`.
OFF_STEP_PURPOSES = frozenset({EVAL, METRICS})


def purpose_of(record: bool | str) -> str | None:
    """The purpose a collective's `record` argument names: True → "algorithm", a non-empty
    string → itself, False → None (not recorded)."""
    if record is True:
        return ALGORITHM
    if record is False or record is None:
        return None
    if isinstance(record, str) and record:
        return record
    raise ValueError(f"record={record!r}: pass True, False or a purpose name")


@dataclass(frozen=True)
class CommOp:
    """One collective, as the network model prices it.

    kind: "allreduce", "allreduce_ps" (parameter-server: gather to worker 0 + broadcast),
    "allgather", "broadcast", "reduce" (to one worker; both binomial trees), "broadcast_ring",
    "reduce_ring" (the same as NCCL's ring chains), "alltoall" or "p2p" (neighbour exchange).
    nbytes: bytes of the payload row each worker handed to the collective.
    group: number of workers taking part.
    peers: for "p2p", the largest number of peers any worker sent its row to (the round ends
    when the busiest link is done).
    purpose: why it was sent (see the module docstring).
    tier: "" for the run's one network, or the tier of a two-level cluster it crossed
    ("intra": inside nodes, "inter": between node leaders; see `comm.hierarchy`), priced on
    that tier's link.
    hidden_steps: steps of computation the op runs behind (launched at one step, needed only
    that many steps later); the network model charges only what they do not hide.
    """

    kind: str
    nbytes: int
    group: int
    peers: int = 0
    purpose: str = ALGORITHM
    tier: str = ""
    hidden_steps: int = 0


@dataclass
class CommLedger:
    """Cumulative bytes per purpose per local worker, modeled seconds per purpose, measured
    time, and the ops of the current step. `num_local`: how many workers this process holds
    (their ids are the communicator's `local_workers`, in that order)."""

    network: NetworkModel
    num_local: int = 1
    tiers: dict[str, NetworkModel] = field(default_factory=dict)
    bytes_by_purpose: dict[str, list[int]] = field(default_factory=dict)
    bytes_by_tier: dict[str, list[int]] = field(default_factory=dict)
    modeled_by_purpose: dict[str, float] = field(default_factory=dict)
    exposed_s: float = 0.0
    _op_counts: Counter = field(default_factory=Counter)
    _op_totals: Counter = field(default_factory=Counter)  # CommOp -> times recorded
    _purpose_op_counts: Counter = field(default_factory=Counter)
    step_ops: list[CommOp] = field(default_factory=list)  # since the last `end_step`
    # when a list: `end_step` appends each ended step's ops to it (a benchmark that checks every
    # step's ops); None keeps nothing, so a long run's ledger does not grow with its steps
    history: list[CommOp] | None = None
    # per local worker: its clock at its last message (seconds; see the module docstring)
    clock: list[float] = field(default_factory=list)
    # bytes received per purpose, by sending endpoint (another process's)
    heard: dict[str, dict[int, int]] = field(default_factory=dict)
    # per (bytes, purpose) of a message: [op, its modeled seconds, messages not yet counted]
    _messages: dict[tuple[int, str], list] = field(default_factory=dict)
    # other networks' pricings of every op recorded (a time scenario's `Repricing`, each with
    # `add(op)` and `reset()`: `run/time_scenarios.py`)
    repricings: list = field(default_factory=list)
    _hidden_steps: int = 0
    _busy_closed: float = 0.0
    _frontier: tuple[float, float] | None = None
    _pending: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bytes_by_purpose.setdefault(ALGORITHM, [0] * self.num_local)
        self.clock = self.clock or [0.0] * self.num_local
        self._started = time.perf_counter()

    # -- bytes -------------------------------------------------------------------------------
    @property
    def bytes_by_worker(self) -> list[int]:
        """The algorithm's bytes sent by each local worker."""
        return self.bytes_by_purpose[ALGORITHM]

    @property
    def bytes_sent(self) -> int:
        """The algorithm's bytes sent by the first local worker."""
        return self.bytes_by_worker[0]

    def bytes_of(self, purpose: str) -> list[int]:
        """Bytes each local worker sent for `purpose` (zeros if never recorded)."""
        return list(self.bytes_by_purpose.get(purpose, [0] * self.num_local))

    @property
    def modeled_s(self) -> float:
        """Modeled seconds of the training steps' traffic (every purpose but evaluation and
        metrics)."""
        return sum(s for p, s in self.modeled_by_purpose.items() if p not in OFF_STEP_PURPOSES)

    def record(self, op: CommOp, sent_by_worker: Sequence[int] | None = None) -> None:
        """Record `op` under `op.purpose`. `sent_by_worker`: bytes each local worker sent
        (default: `op.nbytes` each, the case of allreduce and allgather)."""
        if self._hidden_steps and not op.hidden_steps:
            op = replace(op, hidden_steps=self._hidden_steps)
        sent = sent_by_worker if sent_by_worker is not None else [op.nbytes] * self.num_local
        if len(sent) != self.num_local:
            raise ValueError(f"sent_by_worker needs {self.num_local} entries, got {len(sent)}")
        totals = self.bytes_by_purpose.setdefault(op.purpose, [0] * self.num_local)
        for w, nbytes in enumerate(sent):
            totals[w] += int(nbytes)
        if op.tier and op.purpose == ALGORITHM:
            by_tier = self.bytes_by_tier.setdefault(op.tier, [0] * self.num_local)
            for w, nbytes in enumerate(sent):
                by_tier[w] += int(nbytes)
        self.modeled_by_purpose[op.purpose] = self.modeled_by_purpose.get(
            op.purpose, 0.0
        ) + self.network_of(op).op_seconds(op)
        for pricing in self.repricings:
            pricing.add(op)
        if op.purpose == ALGORITHM:
            self._op_counts[op.kind] += 1
        self._purpose_op_counts[(op.purpose, op.kind)] += 1
        if op.purpose not in OFF_STEP_PURPOSES:  # what `modeled_s` prices
            self._op_totals[op] += 1
        self.step_ops.append(op)

    @contextmanager
    def hidden_behind(self, steps: int) -> Iterator[None]:
        """Ops recorded inside run behind `steps` steps of computation (`CommOp.hidden_steps`):
        e.g. a fragment's outer communication, launched at step t and merged at t + steps."""
        before, self._hidden_steps = self._hidden_steps, int(steps)
        try:
            yield
        finally:
            self._hidden_steps = before

    def network_of(self, op: CommOp) -> NetworkModel:
        """The link `op` is priced on: its tier's, else the run's network."""
        return self.tiers.get(op.tier, self.network) if op.tier else self.network

    def view(self, rows: Sequence[int], tier: str) -> LedgerView:
        """A ledger for a communicator over a subset of this process's workers in one tier of a
        two-level cluster: its local row i is row `rows[i]` here; every op it records is tagged
        `tier` (priced on that tier's link, its bytes also kept per tier)."""
        return LedgerView(self, tuple(rows), tier)

    def record_message(
        self, row: int | None, nbytes: int, purpose: str, at: float | None = None
    ) -> None:
        """One point-to-point message of `nbytes` sent by local worker `row` (None: an endpoint
        that is not a worker, e.g. a parameter server, or another process's message heard
        here: counted as an op, charged to nobody) at its clock `at` (None: wall seconds since
        the ledger started). O(1): the op counts are folded in when read."""
        entry = self._messages.get((nbytes, purpose))
        if entry is None:
            op = CommOp("p2p", nbytes, 2, peers=1, purpose=purpose)
            entry = self._messages[(nbytes, purpose)] = [op, self.network.op_seconds(op), 0]
        entry[2] += 1
        if row is not None:
            totals = self.bytes_by_purpose.get(purpose)
            if totals is None:
                totals = self.bytes_by_purpose[purpose] = [0] * self.num_local
            totals[row] += nbytes
            self.clock[row] = time.perf_counter() - self._started if at is None else at
        modeled = self.modeled_by_purpose
        modeled[purpose] = modeled.get(purpose, 0.0) + entry[1]
        for pricing in self.repricings:
            pricing.add(entry[0])
        self.step_ops.append(entry[0])

    def _fold_messages(self) -> None:
        """Count the messages recorded since the last fold into the op counters."""
        for op, _, count in self._messages.values():
            if not count:
                continue
            if op.purpose == ALGORITHM:
                self._op_counts["p2p"] += count
            self._purpose_op_counts[(op.purpose, "p2p")] += count
            if op.purpose not in OFF_STEP_PURPOSES:
                self._op_totals[op] += count
        for entry in self._messages.values():
            entry[2] = 0

    @property
    def op_counts(self) -> Counter:
        """The algorithm's ops recorded, by kind."""
        self._fold_messages()
        return self._op_counts

    @property
    def op_totals(self) -> Counter:
        """Every distinct op priced in `modeled_s`, with the times it was recorded."""
        self._fold_messages()
        return self._op_totals

    def modeled_by_tier(self) -> dict[str, float]:
        """`modeled_s` split by the tier each op crossed ("" for the run's one network):
        the op table priced tier by tier, each op on its tier's link."""
        seconds: dict[str, float] = {}
        for op, count in self.op_totals.items():
            priced = count * self.network_of(op).op_seconds(op)
            seconds[op.tier] = seconds.get(op.tier, 0.0) + priced
        return seconds

    @property
    def purpose_op_counts(self) -> Counter:
        """Ops recorded per (purpose, kind)."""
        self._fold_messages()
        return self._purpose_op_counts

    def record_heard(self, src: int, nbytes: int, purpose: str) -> None:
        """A message of `nbytes` for `purpose` received from endpoint `src` of another
        process. O(1)."""
        by_source = self.heard.setdefault(purpose, {})
        by_source[src] = by_source.get(src, 0) + nbytes

    # -- time --------------------------------------------------------------------------------
    def add_time(self, in_flight: tuple[float, float], blocked: tuple[float, float]) -> None:
        """One collective was in flight over `in_flight` and its caller blocked over `blocked`
        (perf_counter seconds; equal intervals for a synchronous call)."""
        self.exposed_s += max(0.0, blocked[1] - blocked[0])
        self._pending.append(in_flight)
        if blocked != in_flight:
            self._pending.append(blocked)
        if len(self._pending) > 512:
            self._merge()

    @property
    def measured_s(self) -> float:
        """Seconds callers were blocked in recorded collectives (= `exposed_s`)."""
        return self.exposed_s

    @property
    def busy_s(self) -> float:
        """Seconds during which at least one recorded collective was in flight."""
        self._merge()
        frontier = self._frontier[1] - self._frontier[0] if self._frontier else 0.0
        return self._busy_closed + frontier

    @property
    def overlapped_s(self) -> float:
        """Seconds collectives were in flight while no caller waited for them."""
        return max(0.0, self.busy_s - self.exposed_s)

    def _merge(self) -> None:
        # Intervals arrive when their op is waited for, so a batch may be out of order but
        # rarely reaches back before the last merged one; an interval that does is merged into
        # the frontier (a slight overestimate) rather than kept forever.
        for start, end in sorted(self._pending):
            if self._frontier is None:
                self._frontier = (start, end)
            elif start <= self._frontier[1]:
                self._frontier = (min(start, self._frontier[0]), max(end, self._frontier[1]))
            else:
                self._busy_closed += self._frontier[1] - self._frontier[0]
                self._frontier = (start, end)
        self._pending.clear()

    # -- steps -------------------------------------------------------------------------------
    def end_step(self) -> list[CommOp]:
        """Return and clear the ops recorded since the last call (the run loop calls it after
        every step; `history`, when a list, keeps them)."""
        ops, self.step_ops = self.step_ops, []
        if self.history is not None:
            self.history.extend(ops)
        return ops

    def reset(self) -> None:
        self.bytes_by_purpose = {ALGORITHM: [0] * self.num_local}
        self.bytes_by_tier = {}
        self.clock = [0.0] * self.num_local
        self.heard = {}
        self._started = time.perf_counter()
        self.modeled_by_purpose = {}
        for pricing in self.repricings:
            pricing.reset()
        self.exposed_s = 0.0
        self._busy_closed, self._frontier = 0.0, None
        self._pending.clear()
        self._messages.clear()
        self._op_counts.clear()
        self._op_totals.clear()
        self._purpose_op_counts.clear()
        self.step_ops.clear()

    def state_dict(self) -> dict:
        """The cumulative counters, for a checkpoint (the busy time as a closed total), as plain
        data (a checkpoint holds no class of ours: see `checkpoint.load_checkpoint`): the ops
        as `[kind, nbytes, group, peers, purpose, count]` rows, then (where not the defaults)
        the tier of a two-level cluster and the op's `hidden_steps`."""
        return {
            "bytes_by_purpose": {p: list(v) for p, v in self.bytes_by_purpose.items()},
            "bytes_by_tier": {t: list(v) for t, v in self.bytes_by_tier.items()},
            "modeled_by_purpose": dict(self.modeled_by_purpose),
            "exposed_s": self.exposed_s,
            "busy_s": self.busy_s,
            "op_counts": dict(self.op_counts),
            "op_totals": [
                [op.kind, op.nbytes, op.group, op.peers, op.purpose, n] + _extra(op)
                for op, n in self.op_totals.items()
            ],
            "purpose_op_counts": [[p, k, n] for (p, k), n in self.purpose_op_counts.items()],
            "clock": list(self.clock),
            "heard": {p: dict(v) for p, v in self.heard.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()`'s counters (the current step's ops are dropped)."""
        self.reset()
        self.bytes_by_purpose = {p: list(v) for p, v in state["bytes_by_purpose"].items()}
        self.bytes_by_tier = {t: list(v) for t, v in state.get("bytes_by_tier", {}).items()}
        self.modeled_by_purpose = dict(state["modeled_by_purpose"])
        self.exposed_s = state["exposed_s"]
        self._busy_closed = state["busy_s"]
        self.op_counts.update(state["op_counts"])
        for kind, nbytes, group, peers, purpose, n, *extra in state["op_totals"]:
            self.op_totals[CommOp(kind, nbytes, group, peers, purpose, *extra)] += n
        for purpose, kind, n in state["purpose_op_counts"]:
            self.purpose_op_counts[(purpose, kind)] += n
        self.clock = list(state["clock"])
        self.heard = {p: dict(v) for p, v in state["heard"].items()}
        self._started = time.perf_counter() - max(self.clock, default=0.0)

    def op_table(self) -> list[list]:
        """Every distinct op with its count, `[kind, nbytes, group, peers, count]`, then (where
        not the defaults) a sixth entry, the tier, for ops of a two-level cluster, and a seventh,
        `hidden_steps`, for ops hidden behind computation; so a run can be re-priced on any
        network afterwards (`NetworkModel.total_seconds`)."""
        return [
            [op.kind, op.nbytes, op.group, op.peers, n] + _extra(op)
            for op, n in self.op_totals.items()
        ]


def _extra(op: CommOp) -> list:
    """An op row's optional tail: [tier] or [tier, hidden_steps] (nothing for the defaults)."""
    if op.hidden_steps:
        return [op.tier, op.hidden_steps]
    return [op.tier] if op.tier else []


@dataclass
class LedgerView:
    """A sub-communicator's ledger inside a process's `CommLedger` (`CommLedger.view`): maps its
    rows to the parent's and tags its ops with a tier; times go to the parent unchanged."""

    parent: CommLedger
    rows: tuple[int, ...]
    tier: str

    @property
    def num_local(self) -> int:
        return len(self.rows)

    def record(self, op: CommOp, sent_by_worker: Sequence[int] | None = None) -> None:
        sent = sent_by_worker if sent_by_worker is not None else [op.nbytes] * len(self.rows)
        if len(sent) != len(self.rows):
            raise ValueError(f"sent_by_worker needs {len(self.rows)} entries, got {len(sent)}")
        mapped = [0] * self.parent.num_local
        for row, nbytes in zip(self.rows, sent, strict=True):
            mapped[row] += int(nbytes)
        self.parent.record(replace(op, tier=self.tier), mapped)

    def add_time(self, in_flight: tuple[float, float], blocked: tuple[float, float]) -> None:
        self.parent.add_time(in_flight, blocked)
