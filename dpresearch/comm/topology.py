"""Communication graphs for decentralized (gossip) training: who talks to whom, with what weight.

Contract. A `Topology` is a graph over `num_workers` = K workers, possibly time-varying with
`period` distinct graphs: the graph at step t is the graph at phase t % period. Subclasses give
the directed edges (src, dst) of each phase in `_edges(phase)`; undirected graphs list both
directions. Everything else is derived here and cached per phase, because the algorithms ask for
it every training step:

- `out_peers(step)[i]` / `in_peers(step)[i]`: the workers i sends to / receives from; sorted,
  unique, never i itself. j ∈ out_peers[i] ⇔ i ∈ in_peers[j].
- `mixing_matrix(step)`: W, float64 [K, K]. **W[i, j] is the weight worker i gives to worker
  j's value**, so one gossip step on stacked rows is x ← W x, and W[i, j] ≠ 0 only for
  j ∈ in_peers[i] or j = i.
- `push_matrix(step)`: P for push-sum (SGP), column stochastic: P[i, j] = 1/(outdeg_j + 1) for
  j ∈ in_peers[i] or j = i, i.e. every worker splits its value evenly over itself and the
  workers it sends to.

Weights (`weights=`):

- `metropolis` (default). Undirected graphs: w_ij = 1/(1 + max(deg_i, deg_j)) on edges and
  w_ii = 1 − Σ_j w_ij, symmetric and doubly stochastic for any undirected graph (the ring with
  K ≥ 3 gives (I + S + Sᵀ)/3). Directed graphs: Metropolis-Hastings needs a symmetric support,
  so we use 1/(p + 1) for each in-peer and self instead; all our directed graphs are regular
  (in-degree = out-degree = p everywhere), which makes that doubly stochastic. A directed graph
  that is not regular is rejected with `weights=metropolis`.
- `uniform`: w_ij = 1/(indeg_i + 1) for each in-peer j and self. Row stochastic; doubly
  stochastic only on regular graphs. On the complete graph it is exactly 11ᵀ/K.

Naming. We call δ = 1 − |λ₂(W)| the **spectral gap**, with |λ₂| the second-largest eigenvalue
modulus. ChocoSGD's `rho` is the same quantity; D-PSGD's ρ is |λ₂|², a different one. Gossip
alone contracts the consensus distance Ξ² = (1/K) Σ_i ‖x_i − x̄‖² by at least ‖W − 11ᵀ/K‖₂²
per step; that is (1 − δ)² when W is normal (symmetric, or circulant as on the exponential
graph). For time-varying graphs δ is taken **per period, not per step**: one minus the
second-largest eigenvalue modulus of the product W(period−1)···W(0). `beta` is ‖I − W‖₂, the
maximum over the period.

Every graph must be connected (strongly connected when directed; for a time-varying graph, the
union of its graphs over one period), checked at construction. Invalid options raise a one-line
`ValueError` that names the key to change.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch
from torch import Tensor

WEIGHTS = ("metropolis", "uniform")
TOL = 1e-12
MAX_RANDOM_DRAWS = 1000

Edges = set[tuple[int, int]]
Peers = list[tuple[int, ...]]


@dataclass(frozen=True)
class _Phase:
    """Everything derived from one phase's edges."""

    out_peers: Peers
    in_peers: Peers
    mixing: Tensor
    push: Tensor


class Topology(ABC):
    """A communication graph over `num_workers` workers, possibly time-varying.

    Subclasses set `name` and `directed` and define `_edges`; one with state of its own sets it
    in `_setup` (and `self.period`, if time-varying), which `__init__` calls before it checks
    the graph (a constructor taking more arguments keeps them, then calls `super().__init__`).
    """

    name: ClassVar[str]
    directed: ClassVar[bool]

    def __init__(self, num_workers: int, weights: str = "metropolis") -> None:
        if num_workers < 2:
            raise ValueError(f"topology={self.name} needs workers >= 2; got workers={num_workers}")
        if weights not in WEIGHTS:
            raise ValueError(f"topology.weights={weights}; choose one of: {', '.join(WEIGHTS)}")
        self.num_workers = num_workers
        self.weights = weights
        self.period = 1
        self._phases: dict[int, _Phase] = {}
        self._setup()
        self._check_graph()

    def _setup(self) -> None:
        """Set the graph's own state (and `period`) from `num_workers` and the constructor's
        arguments; the graph is checked after."""

    @abstractmethod
    def _edges(self, phase: int) -> Edges:
        """Directed edges (src, dst), src ≠ dst, of the graph at `phase` ∈ [0, period)."""

    # ---- per-step views (cached per phase) ----

    def out_peers(self, step: int) -> Peers:
        """Per worker i, the workers i sends to at `step`: sorted, unique, never i."""
        return list(self._phase(step).out_peers)

    def in_peers(self, step: int) -> Peers:
        """Per worker i, the workers i receives from at `step`: sorted, unique, never i."""
        return list(self._phase(step).in_peers)

    def mixing_matrix(self, step: int) -> Tensor:
        """W at `step`, float64 [K, K] on the CPU; W[i, j] = weight i gives to j's value.

        Returns the cached tensor: callers must not modify it in place (copy or `.to()` it).
        """
        return self._phase(step).mixing

    def push_matrix(self, step: int) -> Tensor:
        """Push-sum P at `step`, float64 [K, K], column stochastic; cached, do not modify."""
        return self._phase(step).push

    # ---- spectral and structural properties (over the whole period) ----

    @cached_property
    def spectral_gap(self) -> float:
        """δ = 1 − |λ₂|; for time-varying graphs of W(period−1)···W(0), per period."""
        product = torch.eye(self.num_workers, dtype=torch.float64)
        for phase in range(self.period):
            product = self._phase(phase).mixing @ product
        return 1.0 - _second_modulus(product)

    @cached_property
    def beta(self) -> float:
        """‖I − W‖₂, the maximum over the period."""
        eye = torch.eye(self.num_workers, dtype=torch.float64)
        return max(torch.linalg.matrix_norm(eye - w, ord=2).item() for w in self._all_mixing())

    @cached_property
    def is_symmetric(self) -> bool:
        """W = Wᵀ at every phase (to 1e-12)."""
        return all(_is_symmetric(w) for w in self._all_mixing())

    @cached_property
    def is_doubly_stochastic(self) -> bool:
        """Rows and columns of W sum to 1 at every phase (to 1e-12)."""
        return all(_sums_to_one(w, dim=1) and _sums_to_one(w, dim=0) for w in self._all_mixing())

    @cached_property
    def is_column_stochastic(self) -> bool:
        """Columns of W sum to 1 at every phase (to 1e-12)."""
        return all(_sums_to_one(w, dim=0) for w in self._all_mixing())

    def describe(self) -> dict:
        """A JSON-serialisable summary, for logs and run metadata."""
        degrees = [len(p) for phase in range(self.period) for p in self._phase(phase).out_peers]
        return {
            "name": self.name,
            "num_workers": self.num_workers,
            "directed": self.directed,
            "time_varying": self.period > 1,
            "period": self.period,
            "weights": self.weights,
            "degree_min": min(degrees),
            "degree_max": max(degrees),
            "spectral_gap": self.spectral_gap,
            "beta": self.beta,
            "symmetric": self.is_symmetric,
            "doubly_stochastic": self.is_doubly_stochastic,
            "column_stochastic": self.is_column_stochastic,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_workers={self.num_workers}, weights={self.weights!r})"

    # ---- construction ----

    def _check_graph(self) -> None:
        """Check every phase's edges and (strong) connectivity of their union; build caches."""
        union: Edges = set()
        for phase in range(self.period):
            self._phase(phase)
            union |= self._edges(phase)
        if not _strongly_connected(self.num_workers, union):
            raise ValueError(
                f"topology={self.name} with workers={self.num_workers} is not connected; "
                "choose another topology or workers"
            )

    def _phase(self, step: int) -> _Phase:
        phase = step % self.period
        cached = self._phases.get(phase)
        if cached is None:
            cached = self._phases[phase] = self._build(phase)
        return cached

    def _build(self, phase: int) -> _Phase:
        k = self.num_workers
        edges = self._edges(phase)
        if any(s == d or not (0 <= s < k and 0 <= d < k) for s, d in edges):
            raise ValueError(f"topology={self.name}: edges must join two distinct workers < {k}")
        if not self.directed and any((d, s) not in edges for s, d in edges):
            raise ValueError(f"topology={self.name} is undirected but its edges are one-way")
        outs: list[list[int]] = [[] for _ in range(k)]
        ins: list[list[int]] = [[] for _ in range(k)]
        for s, d in edges:
            outs[s].append(d)
            ins[d].append(s)
        out_peers = [tuple(sorted(peers)) for peers in outs]
        in_peers = [tuple(sorted(peers)) for peers in ins]
        a = _receives(in_peers)
        return _Phase(out_peers, in_peers, mixing=self._mixing(a), push=_push(a))

    def _mixing(self, a: Tensor) -> Tensor:
        if self.weights == "uniform":
            return _uniform(a)
        if not self.directed:
            return _metropolis(a)
        if len(set(a.sum(0).tolist()) | set(a.sum(1).tolist())) != 1:
            raise ValueError(
                f"topology={self.name} is directed and not regular, so metropolis weights are "
                "not doubly stochastic; set topology.weights=uniform"
            )
        return _uniform(a)

    def _all_mixing(self) -> list[Tensor]:
        return [self._phase(phase).mixing for phase in range(self.period)]


# ---- weights ----


def _receives(in_peers: Peers) -> Tensor:
    """Adjacency A, float64 [K, K]: A[i, j] = 1 when i receives from j."""
    k = len(in_peers)
    a = torch.zeros(k, k, dtype=torch.float64)
    for i, peers in enumerate(in_peers):
        a[i, list(peers)] = 1.0
    return a


def _uniform(a: Tensor) -> Tensor:
    """w_ij = 1/(indeg_i + 1) for each in-peer j and self."""
    eye = torch.eye(len(a), dtype=a.dtype)
    return (a + eye) / (a.sum(1, keepdim=True) + 1)


def _metropolis(a: Tensor) -> Tensor:
    """Metropolis-Hastings weights of an undirected graph: symmetric and doubly stochastic."""
    deg = a.sum(1)
    w = a / (1 + torch.maximum(deg[:, None], deg[None, :]))
    w.diagonal().copy_(1.0 - w.sum(1))
    return w


def _push(a: Tensor) -> Tensor:
    """P[i, j] = 1/(outdeg_j + 1) for j ∈ in_peers[i] ∪ {i}: column stochastic."""
    eye = torch.eye(len(a), dtype=a.dtype)
    return (a + eye) / (a.sum(0, keepdim=True) + 1)


# ---- matrix and graph helpers ----


def _is_symmetric(w: Tensor) -> bool:
    return bool((w - w.T).abs().max() <= TOL)


def _sums_to_one(w: Tensor, dim: int) -> bool:
    return bool((w.sum(dim) - 1.0).abs().max() <= TOL)


def _second_modulus(w: Tensor) -> float:
    """The second-largest eigenvalue modulus |λ₂| of a square matrix."""
    eig = torch.linalg.eigvalsh if _is_symmetric(w) else torch.linalg.eigvals
    return eig(w).abs().sort(descending=True).values[1].item()


def _reaches_all(k: int, edges: Edges) -> bool:
    """Whether every worker is reachable from worker 0 along `edges`."""
    succ: dict[int, list[int]] = {i: [] for i in range(k)}
    for s, d in edges:
        succ[s].append(d)
    seen, stack = {0}, [0]
    while stack:
        for j in succ[stack.pop()]:
            if j not in seen:
                seen.add(j)
                stack.append(j)
    return len(seen) == k


def _strongly_connected(k: int, edges: Edges) -> bool:
    return _reaches_all(k, edges) and _reaches_all(k, {(d, s) for s, d in edges})


def _both_ways(pairs: list[tuple[int, int]]) -> Edges:
    """The directed edges of undirected `pairs`, deduplicated, self-loops dropped."""
    return {e for a, b in pairs if a != b for e in ((a, b), (b, a))}


def _log2_floor(n: int) -> int:
    return n.bit_length() - 1


# ---- the graphs ----


class Ring(Topology):
    """i ↔ i ± 1 mod K. K = 2 has one neighbour per worker (W = 11ᵀ/2)."""

    name = "ring"
    directed = False

    def _edges(self, phase: int) -> Edges:
        k = self.num_workers
        return _both_ways([(i, (i + 1) % k) for i in range(k)])


class Torus(Topology):
    """rows × cols grid with wraparound; worker i sits at (i // cols, i % cols).

    Neighbours are up, down, left and right, deduplicated (with 2 rows, up = down). Without
    `rows`/`cols`, rows is the largest divisor of K that is ≤ √K; giving one derives the other.
    """

    name = "torus"
    directed = False

    def __init__(
        self,
        num_workers: int,
        weights: str = "metropolis",
        rows: int | None = None,
        cols: int | None = None,
    ) -> None:
        self._asked = rows, cols
        super().__init__(num_workers, weights)

    def _setup(self) -> None:
        self.rows, self.cols = _torus_shape(self.num_workers, *self._asked)

    def _edges(self, phase: int) -> Edges:
        r, c = self.rows, self.cols
        pairs = []
        for i in range(self.num_workers):
            row, col = divmod(i, c)
            pairs.append((i, ((row + 1) % r) * c + col))
            pairs.append((i, row * c + (col + 1) % c))
        return _both_ways(pairs)

    def __repr__(self) -> str:
        return (
            f"Torus(num_workers={self.num_workers}, weights={self.weights!r}, "
            f"rows={self.rows}, cols={self.cols})"
        )


def _torus_shape(k: int, rows: int | None, cols: int | None) -> tuple[int, int]:
    if rows is None and cols is None:
        rows = max(d for d in range(1, math.isqrt(k) + 1) if k % d == 0)
        if rows == 1:
            raise ValueError(
                "topology=torus needs workers = rows × cols with both ≥ 2; "
                f"workers={k} is prime — use topology=ring or another K"
            )
        return rows, k // rows
    for key, value in (("rows", rows), ("cols", cols)):
        if value is not None and value < 2:
            raise ValueError(
                f"topology.{key}={value} must be ≥ 2 (one {key[:-1]} is a ring: use topology=ring)"
            )
        if value is not None and k % value != 0:
            raise ValueError(
                f"topology.{key}={value} does not divide workers={k}; "
                f"set topology.rows × topology.cols = {k} or leave both null"
            )
    rows = rows if rows is not None else k // cols
    cols = cols if cols is not None else k // rows
    if rows * cols != k:
        raise ValueError(
            f"topology.rows={rows} × topology.cols={cols} = {rows * cols} but workers={k}; "
            f"set topology.rows × topology.cols = {k} or leave both null"
        )
    if cols < 2 or rows < 2:
        raise ValueError(
            f"topology.rows={rows}, topology.cols={cols}: both must be ≥ 2; use topology=ring"
        )
    return rows, cols


class Exponential(Topology):
    """Static directed exponential graph: i sends to (i + 2^k) mod K, k = 0..⌊log₂(K−1)⌋.

    With K a power of two its spectral gap is 2/(1 + log₂ K) (Ying et al. 2021).
    """

    name = "exponential"
    directed = True

    def _edges(self, phase: int) -> Edges:
        k = self.num_workers
        hops = {2**e for e in range(_log2_floor(k - 1) + 1)}
        return {(i, (i + h) % k) for i in range(k) for h in hops}


class OnePeerExponential(Topology):
    """SGP's time-varying graph: at step t, i sends to (i + 2^(t mod m)) mod K only.

    m = ⌊log₂(K−1)⌋ + 1 is the period. Weights are 1/2, 1/2. For K a power of two the product
    of the mixing matrices over one period is exactly 11ᵀ/K (spectral gap 1).
    """

    name = "one_peer_exponential"
    directed = True

    def _setup(self) -> None:
        self.period = _log2_floor(self.num_workers - 1) + 1

    def _edges(self, phase: int) -> Edges:
        k = self.num_workers
        return {(i, (i + 2**phase) % k) for i in range(k)}


class Complete(Topology):
    """Everyone ↔ everyone; with `uniform` weights W = 11ᵀ/K exactly."""

    name = "complete"
    directed = False

    def _edges(self, phase: int) -> Edges:
        k = self.num_workers
        return {(i, j) for i in range(k) for j in range(k) if i != j}


class Star(Topology):
    """Worker 0 ↔ every other worker."""

    name = "star"
    directed = False

    def _edges(self, phase: int) -> Edges:
        return _both_ways([(0, i) for i in range(1, self.num_workers)])


class Chain(Topology):
    """i ↔ i + 1, without wraparound."""

    name = "chain"
    directed = False

    def _edges(self, phase: int) -> Edges:
        return _both_ways([(i, i + 1) for i in range(self.num_workers - 1)])


class ErdosRenyi(Topology):
    """Undirected G(K, p), drawn from a `torch.Generator` seeded with `seed`.

    Draws again from the same generator until the graph is connected, at most 1000 times, so
    (K, p, seed) fixes the graph.
    """

    name = "random"
    directed = False

    def __init__(
        self, num_workers: int, weights: str = "metropolis", p: float = 0.3, seed: int = 0
    ) -> None:
        self.p, self.seed = p, seed
        super().__init__(num_workers, weights)

    def _setup(self) -> None:
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"topology.p={self.p} must be in (0, 1]; e.g. topology.p=0.3")
        self._drawn = _draw_connected(self.num_workers, self.p, self.seed)

    def _edges(self, phase: int) -> Edges:
        return set(self._drawn)

    def __repr__(self) -> str:
        return (
            f"ErdosRenyi(num_workers={self.num_workers}, weights={self.weights!r}, "
            f"p={self.p}, seed={self.seed})"
        )


def _draw_connected(k: int, p: float, seed: int) -> Edges:
    generator = torch.Generator().manual_seed(seed)
    pairs = torch.triu_indices(k, k, offset=1).T
    for _ in range(MAX_RANDOM_DRAWS):
        keep = torch.rand(len(pairs), generator=generator, dtype=torch.float64) < p
        edges = _both_ways([tuple(pair) for pair in pairs[keep].tolist()])
        if _reaches_all(k, edges):
            return edges
    raise ValueError(
        f"topology=random drew no connected G({k}, p={p}) in {MAX_RANDOM_DRAWS} tries "
        f"(seed={seed}); raise topology.p (connected needs p above about ln(K)/K)"
    )
