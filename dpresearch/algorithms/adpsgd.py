"""AD-PSGD: asynchronous decentralized parallel SGD (Lian et al., ICML 2018).

K workers on an undirected graph (`topology`), each with its own compute speed (the `async`
node's speed model). Worker i repeatedly

    1. reads its model, x̂_i ← x_i, and computes a stochastic gradient g_i at x̂_i (meanwhile its
       neighbours may average with it, so x_i moves on: the gradient is stale);
    2. averages with one neighbour j, atomically: x_i, x_j ← (x_i + x_j) / 2;
    3. applies its gradient to its own model: x_i ← x_i − η·u_i(g_i) (its own optimizer);

with no global clock. The event clock (`asynchrony/clock.py`) orders the workers' finishing
times; every step of the loop is one event (one gradient), so an epoch is K × (batches per
worker) steps, as in asynchronous SGD. The neighbour is chosen by `pairing`:

- "random": uniform among i's neighbours, from i's own seeded stream;
- "bipartite": the paper's deadlock-free rule for real ranks — the graph is 2-coloured,
  workers of the first colour (active) average with a uniformly chosen neighbour, workers of
  the second (passive) only apply their gradients (they are averaged with by active ones).

The exchange of a pair is two point-to-point messages (x_i to j, x_j to i, float buffers with
them when `mix_buffers`), each charged to its sender; the event takes compute + α + D/B.

Compressed exchanges (`compressor=` any gossip-capable codec, `algorithm.gamma`): CHOCO-gossip
(Koloskova et al. 2019) on the pair. Every directed edge keeps the public copy x̂_{i→j} of x_i
that j holds (i holds the same copy, so both know it exactly). At an event i and j send
q_i = C(x_i − x̂_{i→j}) and q_j = C(x_j − x̂_{j→i}); both add the decoded messages to their copies,
then x_i += γ/2·(x̂_{j→i} − x̂_{i→j}) and x_j += γ/2·(x̂_{i→j} − x̂_{j→i}): the pair's sum is kept,
and with the identity codec and γ = 1 it is the plain average. Float buffers travel
uncompressed beside the wire row.
Metrics: `gossip/consensus_distance` Ξ² = (1/K) Σ‖x_i − x̄‖², `adpsgd/staleness_mean` and
`_max` (τ, ours: how many averagings by other workers changed x_i while i computed its
gradient), `adpsgd/delay_mean` and `_max` (T, the paper's delay: x̂_k = x_{k−T_k} in Lian et
al.'s update x_{k+1} = x_k W_k − γ∂g(x̂_k), i.e. how many global iterations — events of any
worker — came between i's read and i's update; an event whose read was at the start counts
every event before it), `time/simulated_s`; the summary holds the histograms of τ and T and
the pairs averaged. For the same events T ≥ τ (every averaging that changed x_i is an event),
typically several times τ (every other worker's event counts, not only those touching i).

Modes: simulated (all K workers here), or real ranks (`backend=gloo|nccl`, one worker per
process) where every rank replays the same seeded event order (`async.order=seeded`, the only
real order so far): the pushing worker computes, the pair exchanges its models through the
communicator and every rank steps through every event — so the real run equals the simulated
one bit for bit, and its processes take every step together (agreement, metrics, checkpoints
are the ordinary lockstep ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from dpresearch.algorithms.base import StepPlan, Traits
from dpresearch.algorithms.choco import check_gamma
from dpresearch.algorithms.gossip import Gossip, GossipOptions, build_topology
from dpresearch.asynchrony.clock import EventClock, transfer_seconds
from dpresearch.asynchrony.options import AsyncOptions, check_options
from dpresearch.asynchrony.speed import DrawStream, SpeedModel
from dpresearch.asynchrony.staleness import count_tau, mean_tau
from dpresearch.comm.base import Communicator
from dpresearch.comm.topology import Topology
from dpresearch.compress import ChannelNeeds, Codec, open_channel
from dpresearch.compress.build import ChannelOptions
from dpresearch.compress.rng import stream_seed
from dpresearch.optim import set_lr
from dpresearch.replicas import Replicas

PAIRINGS = ("random", "bipartite")


def two_colouring(topology: Topology) -> list[int] | None:
    """Colour 0/1 of every worker such that neighbours differ, or None (not bipartite)."""
    peers = topology.out_peers(0)
    colour: list[int | None] = [None] * topology.num_workers
    for start in range(topology.num_workers):
        if colour[start] is not None:
            continue
        colour[start], stack = 0, [start]
        while stack:
            i = stack.pop()
            for j in peers[i]:
                if colour[j] is None:
                    colour[j] = 1 - colour[i]
                    stack.append(j)
                elif colour[j] == colour[i]:
                    return None
    return [int(c) for c in colour]


class Pairing:
    """Whom each worker averages with when its gradient is done (see the module docstring)."""

    def __init__(self, rule: str, topology: Topology, seed: int) -> None:
        if rule not in PAIRINGS:
            raise ValueError(f"algorithm.pairing={rule}; choose one of: {', '.join(PAIRINGS)}")
        self.rule = rule
        self.peers = [list(p) for p in topology.out_peers(0)]
        colours = two_colouring(topology) if rule == "bipartite" else None
        if rule == "bipartite" and colours is None:
            raise ValueError(
                f"algorithm.pairing=bipartite needs a bipartite graph; topology={topology.name} "
                f"with workers={topology.num_workers} is not (an even ring, a chain, a star, a "
                "torus with even sides are); use algorithm.pairing=random"
            )
        self.active = [c == 0 for c in colours] if colours is not None else [True] * len(self.peers)
        self.streams = [
            DrawStream(stream_seed("adpsgd.pair", seed, w), lambda g, n: g.random(n))
            for w in range(len(self.peers))
        ]

    def partner(self, worker: int) -> int | None:
        """The neighbour `worker` averages with now (None: a passive worker, nobody)."""
        if not self.active[worker]:
            return None
        peers = self.peers[worker]
        return peers[int(self.streams[worker].next() * len(peers))]

    def state_dict(self) -> dict:
        return {"streams": [s.state_dict() for s in self.streams]}

    def load_state_dict(self, state: dict) -> None:
        for stream, saved in zip(self.streams, state["streams"], strict=True):
            stream.load_state_dict(saved)


@dataclass(frozen=True)
class ADPSGDOptions(GossipOptions, ChannelOptions):
    """AD-PSGD's keys (`algorithm=adpsgd`; speeds and the real order: the `async` node)."""

    pairing: str = "random"
    """random (a uniform neighbour) | bipartite (the paper's active/passive split)"""
    gamma: float = 1.0
    """CHOCO-gossip step size on each pair's compressed exchange, in (0, 1] (identity and 1:
    the plain average)"""

    def check(self) -> None:
        check_gamma(self.gamma)


class ADPSGD(Gossip):
    """AD-PSGD (see the module docstring). `options`: the `async` node (speed model, real
    order); `pairing`: "random" or "bipartite"; `seed`: the run's (pairing and speed streams)."""

    # one gradient per step; a dropped one would leave its worker without a next event
    traits = Traits(skippable=False, messages=True)
    channel = ChannelNeeds.gossip("AD-PSGD")
    OPTIONS = ADPSGDOptions

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        topology: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        pairing: str = ADPSGDOptions.pairing,
        compressor: Mapping[str, Any] | None = None,
        gamma: float = ADPSGDOptions.gamma,
        seed: int = 0,
        granularity: str = ADPSGDOptions.granularity,
        bucket_mb: float = ADPSGDOptions.bucket_mb,
        mix_buffers: bool = ADPSGDOptions.mix_buffers,
        eval_local_models: bool = ADPSGDOptions.eval_local_models,
    ) -> None:
        super().__init__(replicas, comm, optimizers, topology, mix_buffers, eval_local_models)
        k = comm.world_size
        self.options = opts = AsyncOptions.from_node(options)
        check_options(opts, k)
        self.pairing = Pairing(pairing, self.topology, seed)
        self.speed = SpeedModel.from_options(opts, k, seed)
        params, buffers = replicas.params, replicas.buffers
        self._has_buffers = mix_buffers and buffers.shape[1] > 0
        check_gamma(gamma)
        self.gamma = float(gamma)
        # identity and γ = 1: the plain average, no codec
        link = open_channel(
            self.channel,
            replicas.models[0],
            params,
            comm.local_workers,
            compressor,
            None,
            seed,
            granularity,
            bucket_mb,
            shortcut=gamma == 1.0,
        )
        self.codec: Codec | None = link.codec
        if self.codec is not None:
            # x̂ of every directed edge with an end here (simulated: all of them)
            peers = self.pairing.peers
            edges = [
                (a, b)
                for a in range(k)
                for b in peers[a]
                if a in comm.local_workers or b in comm.local_workers
            ]
            self.edge = {e: n for n, e in enumerate(edges)}
            self.hat = params.new_zeros((len(edges), params.shape[1]))
            self.sent = params.new_empty((2, params.shape[1]))  # each side's decoded message
            self.delta = params.new_empty((1, params.shape[1]))
        row_bytes = link.wire_bytes
        if self._has_buffers:
            row_bytes += buffers.shape[1] * buffers.element_size()
        # one uncompressed message of the pair: x_i's row (and its float buffers)
        self._message_bytes = params[0].nbytes + (buffers[0].nbytes if self._has_buffers else 0)
        self.clock = EventClock(self.speed, 0.0, transfer_seconds(comm.ledger.network, row_bytes))
        # the row of each worker held here (simulated: all; real ranks: one)
        self.row = {w: r for r, w in enumerate(comm.local_workers)}
        self.read = params.clone()  # x̂: what each local worker read when it started
        # each local row's two plans: on its row as it is, on its read x̂ where it lies (a
        # module viewing the read row, the row's gradients and buffers: nothing copied; x_i
        # stays in its row)
        on_reads = replicas.models_on(self.read)
        self._plans = [
            (StepPlan((r,)), StepPlan((r,), models={r: on_reads[r]})) for r in range(len(self.row))
        ]
        # each local row's views, made once (indexing `params[r]` is a dispatched op per use)
        self._param_rows, self._buffer_rows = params.unbind(0), buffers.unbind(0)
        self._read_rows = self.read.unbind(0)
        # what each side of a pair receives (simulated: both sides are here)
        self.received = params.new_empty((2, params.shape[1]))
        self.received_buffers = buffers.new_empty((2, buffers.shape[1]))
        self.changed = [0] * k  # averagings by others since each worker's read
        self.histogram: list[int] = []
        self.pairs = 0
        self._window: list[int] = []
        # the paper's delay T: events so far, and the event after which each worker read
        self.events = 0
        self.read_at = [-1] * k
        self.delay_histogram: list[int] = []
        self._delay_window: list[int] = []
        self._event: tuple[int, int | None] = (-1, None)
        self._multiplier = 1.0  # the schedule's, for the optimizer that steps
        self._lr_of: list[float | None] = [None] * len(self.row)  # each row's, as last set
        self._started = False
        self._idle = StepPlan(())

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        alg = cfg.algorithm
        node = alg.get("topology") or cls.default_topology
        topology = build_topology(node, cfg.workers)
        cls.check_topology(topology)
        own = ADPSGDOptions.from_node(alg)
        Pairing(own.pairing, topology, 0)
        opts = AsyncOptions.from_node(alg.get("options"))
        check_options(opts, cfg.workers)
        if opts.delay is not None:
            raise ValueError("algorithm=adpsgd has no fixed-delay mode; drop async.delay")
        own.check()
        if cfg.backend.name != "simulated" and opts.order != "seeded":
            raise ValueError(
                f"algorithm=adpsgd on real processes (backend={cfg.backend.name}) replays the "
                "seeded event order; add async.order=seeded"
            )

    @classmethod
    def check_topology(cls, topology: Topology) -> None:
        """Pairwise averaging needs a static undirected graph (any weights: the pair's own
        average is doubly stochastic)."""
        if topology.directed or topology.period != 1:
            raise ValueError(
                f"algorithm=adpsgd averages pairs of neighbours, so its graph must be undirected "
                f"and static; topology={topology.name} is not: use topology=ring, torus, "
                "complete, chain, star or random"
            )

    def describe(self) -> dict[str, Any]:
        real = self.comm.num_local != self.comm.world_size
        return {
            **super().describe(),
            "adpsgd": {
                "mode": "real processes (seeded order)" if real else "event simulator",
                "pairing": self.pairing.rule,
                "active": sum(self.pairing.active),
                "exchange_s": self.clock.push_s,
                **self.speed.describe(),
            },
        }

    # -- the step --------------------------------------------------------------------------------
    @property
    def gradients_per_step(self) -> int:
        return 1

    def plan(self, step: int) -> StepPlan:
        if not self._started:  # every worker starts at once, on its initial model
            self._started = True
            for w in range(self.comm.world_size):
                self.clock.start(w)
        i = self.clock.next_arrival()
        self._event = (i, self.pairing.partner(i))
        row = self.row.get(i)
        if row is None:
            return self._idle
        # Nobody averaged with i since its read: its row is still x̂_i, bit for bit.
        return self._plans[row][self.changed[i] > 0]

    def set_lr(self, multiplier: float) -> None:
        """Kept for the one optimizer that steps this event (`after_backward`): setting all K
        every event costs more than a small model's average."""
        self._multiplier = multiplier

    def after_backward(self, step: int) -> None:
        i, j = self._event
        params = self._param_rows
        here, there = self.row.get(i), self.row.get(j) if j is not None else None
        if j is not None:
            self.pairs += 1
            if there is not None and self.changed[j] == 0:
                # j's row has been its read x̂_j (j computes on it): kept before it first changes
                self._read_rows[there].copy_(params[there])
            self.changed[j] += 1
            if self.codec is None:
                self._average(i, j)
            else:
                self._choco(i, j, step)
        if here is not None:
            if self._lr_of[here] != self._multiplier:  # (constant between schedule changes)
                set_lr(self.optimizers[here], self.base_lrs[here], self._multiplier)
                self._lr_of[here] = self._multiplier
            self.step_optimizer(here)
            # i starts its next gradient on its row as it is now: its read, until a neighbour
            # changes the row (only then is it copied into `read`)
        tau, self.changed[i] = self.changed[i], 0
        count_tau(self.histogram, tau)
        self._window.append(tau)
        delay, self.read_at[i] = self.events - self.read_at[i] - 1, self.events
        self.events += 1
        count_tau(self.delay_histogram, delay)
        self._delay_window.append(delay)
        self.clock.start(i)

    def _average(self, i: int, j: int) -> None:
        """x_i, x_j ← (x_i + x_j) / 2 (and their float buffers), through two messages; both
        received before either is averaged, and the same sum on every rank (a + b is b + a in
        floating point)."""
        params, buffers = self._param_rows, self._buffer_rows
        a, b = self.row.get(i), self.row.get(j)
        if a is not None and b is not None:
            # Both ends in this process (simulated): each side reads the other's row where it
            # lies, so the two messages are recorded (the same bytes and ops as sent) and
            # nothing moves; one mean serves both (the same bits: a + b is b + a).
            self.comm.record_sends(self._message_bytes, (i, j))
            params[a].add_(params[b]).mul_(0.5)
            params[b].copy_(params[a])
            if self._has_buffers:
                buffers[a].add_(buffers[b]).mul_(0.5)
                buffers[b].copy_(buffers[a])
            return
        sides = self._sides(i, j)
        for me, peer, row, _ in sides:
            message = [params[row]] + ([buffers[row]] if self._has_buffers else [])
            self.comm.isend(message, dst=peer, src=me)
        for me, peer, _, slot in sides:
            out = [self.received[slot]]
            if self._has_buffers:
                out.append(self.received_buffers[slot])
            self.comm.recv(peer, out, dst=me)
        for _, _, row, slot in sides:
            params[row].add_(self.received[slot]).mul_(0.5)
            if self._has_buffers:
                buffers[row].add_(self.received_buffers[slot]).mul_(0.5)

    def _sides(self, i: int, j: int) -> list[tuple[int, int, int, int]]:
        """(me, peer, my row, slot) of each end of the pair held here."""
        return [
            (me, peer, self.row[me], slot)
            for slot, (me, peer) in enumerate(((i, j), (j, i)))
            if me in self.row
        ]

    def _choco(self, i: int, j: int, step: int) -> None:
        """The pair's compressed exchange (see the module docstring); every message encoded
        before any copy moves, the same operations on every rank."""
        params, buffers = self.replicas.params, self.replicas.buffers
        codec, hat, edge = self.codec, self.hat, self.edge
        sides = self._sides(i, j)
        wires = {}
        for me, peer, row, slot in sides:
            torch.sub(params[row], hat[edge[(me, peer)]], out=self.delta[0])
            wire = codec.encode(self.delta, step, (me,))[0].clone()  # the codec's buffer
            codec.decode(wire.unsqueeze(0), step, self.sent[slot : slot + 1])
            wires[me] = wire
            message = [wire] + ([buffers[row]] if self._has_buffers else [])
            self.comm.isend(message, dst=peer, src=me)
        for me, peer, _, slot in sides:
            out = [torch.empty_like(wires[me])]
            if self._has_buffers:
                out.append(self.received_buffers[slot])
            self.comm.recv(peer, out, dst=me)
            codec.decode(out[0].unsqueeze(0), step, self.received[slot : slot + 1])
        # the copies of both directed edges: one per edge here (both ends here share it)
        for me, peer, _, slot in sides:
            hat[edge[(me, peer)]].add_(self.sent[slot])
            if peer not in self.row:
                hat[edge[(peer, me)]].add_(self.received[slot])
        for me, peer, row, slot in sides:
            diff = torch.sub(hat[edge[(peer, me)]], hat[edge[(me, peer)]], out=self.sent[slot])
            params[row].add_(diff, alpha=self.gamma / 2)
            if self._has_buffers:
                buffers[row].add_(self.received_buffers[slot]).mul_(0.5)

    def metrics(self) -> dict[str, float]:
        window, self._window = self._window, []
        delays, self._delay_window = self._delay_window, []
        return {
            **super().metrics(),
            "adpsgd/staleness_mean": sum(window) / len(window) if window else float("nan"),
            "adpsgd/staleness_max": float(max(window)) if window else float("nan"),
            "adpsgd/delay_mean": sum(delays) / len(delays) if delays else float("nan"),
            "adpsgd/delay_max": float(max(delays)) if delays else float("nan"),
            "adpsgd/pairs": self.pairs,
            "time/simulated_s": self.clock.now,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "adpsgd/tau_histogram": list(self.histogram),
            "adpsgd/staleness_mean_run": mean_tau(self.histogram),
            "adpsgd/delay_histogram": list(self.delay_histogram),
            "adpsgd/delay_mean_run": mean_tau(self.delay_histogram),
            "adpsgd/pairs": self.pairs,
        }

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The reads x̂ of the local workers, the event queue, speed and pairing streams, the
        staleness and delay counts (the live models are the replicas' rows)."""
        params = self.replicas.params
        for w, row in self.row.items():
            if self.changed[w] == 0:  # the read is the row itself (see `after_backward`)
                self.read[row].copy_(params[row])
        return {
            "read": self.read, "clock": self.clock.state_dict(), "speed": self.speed.state_dict(),
            "pairing": self.pairing.state_dict(), "changed": list(self.changed),
            "histogram": list(self.histogram), "pairs": self.pairs, "window": list(self._window),
            "started": self._started,
            "hat": self.hat if self.codec is not None else None,
            "events": self.events, "read_at": list(self.read_at),
            "delay_histogram": list(self.delay_histogram),
            "delay_window": list(self._delay_window),
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.read.copy_(state["read"])
        self.clock.load_state_dict(state["clock"])
        self.speed.load_state_dict(state["speed"])
        self.pairing.load_state_dict(state["pairing"])
        self.changed = [int(n) for n in state["changed"]]
        self.histogram = [int(n) for n in state["histogram"]]
        self.pairs, self._window = int(state["pairs"]), [int(t) for t in state["window"]]
        self._started = bool(state["started"])
        # the paper's delay counts (absent from checkpoints written before they were kept: they
        # restart there, every worker's read taken as the resumed step)
        self.events = int(state.get("events", 0))
        self.read_at = [int(r) for r in state.get("read_at", [-1] * len(self.read_at))]
        self.delay_histogram = [int(n) for n in state.get("delay_histogram", [])]
        self._delay_window = [int(t) for t in state.get("delay_window", [])]
        if (state["hat"] is None) != (self.codec is None):
            raise ValueError("adpsgd state: saved with another compressor setting")
        if self.codec is not None:
            self.hat.copy_(state["hat"])
