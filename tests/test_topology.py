"""Communication graphs: spectral facts from the papers, stochasticity, gossip contraction."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from dpresearch import CONF_DIR
from dpresearch.comm.topology import (
    Chain,
    Complete,
    Edges,
    ErdosRenyi,
    Exponential,
    OnePeerExponential,
    Ring,
    Star,
    Topology,
    Torus,
)

CONF = CONF_DIR / "topology"
KS = range(2, 18)
COMPOSITE = [k for k in KS if any(k % d == 0 for d in range(2, math.isqrt(k) + 1))]


def _undirected() -> list[Topology]:
    graphs: list[Topology] = []
    for k in KS:
        graphs += [Ring(k), Complete(k), Star(k), Chain(k), ErdosRenyi(k, p=0.3, seed=k)]
    return graphs + [Torus(k) for k in COMPOSITE]


def _directed() -> list[Topology]:
    return [cls(k) for k in KS for cls in (Exponential, OnePeerExponential)]


def _all() -> list[Topology]:
    return _undirected() + _directed()


def _consensus_distance(x: torch.Tensor) -> float:
    """Ξ² = (1/K) Σ_i ‖x_i − x̄‖²."""
    return (x - x.mean(0)).pow(2).sum(1).mean().item()


# ---- A: spectral and stochastic properties ----


def test_ring_spectral_gap_matches_closed_form():
    for k in range(3, 65):
        assert Ring(k).spectral_gap == pytest.approx(4 / 3 * math.sin(math.pi / k) ** 2, abs=1e-9)


def test_undirected_metropolis_is_symmetric_and_doubly_stochastic():
    for topo in _undirected():
        w = topo.mixing_matrix(0)
        assert topo.is_symmetric and topo.is_doubly_stochastic, topo
        assert torch.equal(w, w.T), topo
        assert (w >= 0).all(), topo


def test_push_matrix_is_column_stochastic_for_every_topology():
    for topo in _all():
        for step in range(topo.period):
            p = topo.push_matrix(step)
            assert torch.allclose(p.sum(0), torch.ones(topo.num_workers, dtype=p.dtype)), topo


def test_directed_graphs_are_regular_and_doubly_stochastic():
    for topo in _directed():
        assert topo.is_doubly_stochastic and topo.is_column_stochastic, topo
        info = topo.describe()
        assert info["degree_min"] == info["degree_max"], topo


@pytest.mark.parametrize("k", [4, 8, 16, 32, 64])
def test_exponential_spectral_gap_matches_ying_et_al(k: int):
    topo = Exponential(k)
    assert topo.out_peers(0)[0] == tuple(2**e for e in range(int(math.log2(k))))
    assert topo.spectral_gap == pytest.approx(2 / (1 + math.log2(k)), abs=1e-9)


@pytest.mark.parametrize("k", [2, 4, 8, 16, 32, 64])
def test_one_peer_exponential_averages_exactly_over_a_period(k: int):
    topo = OnePeerExponential(k)
    assert topo.period == max(1, int(math.log2(k)))
    product = torch.eye(k, dtype=torch.float64)
    for step in range(topo.period):
        assert all(len(p) == 1 for p in topo.out_peers(step))
        product = topo.mixing_matrix(step) @ product
    assert torch.allclose(product, torch.full((k, k), 1 / k, dtype=torch.float64), atol=1e-12)
    assert topo.spectral_gap == pytest.approx(1.0, abs=1e-9)


def test_one_peer_exponential_rotates_its_peer():
    topo = OnePeerExponential(8)
    assert [topo.out_peers(t)[3] for t in range(4)] == [(4,), (5,), (7,), (4,)]
    assert topo.mixing_matrix(1) is topo.mixing_matrix(1 + topo.period)


def test_complete_uniform_is_exact_averaging():
    for k in KS:
        w = Complete(k, weights="uniform").mixing_matrix(0)
        assert torch.equal(w, torch.full((k, k), 1 / k, dtype=torch.float64))


def test_uniform_weights_are_row_stochastic_but_not_doubly_on_a_star():
    topo = Star(5, weights="uniform")
    assert not topo.is_column_stochastic and not topo.is_symmetric
    assert torch.allclose(topo.mixing_matrix(0).sum(1), torch.ones(5, dtype=torch.float64))


def test_mixing_and_push_supports_follow_in_peers():
    for topo in _all():
        for step in range(topo.period):
            w, p = topo.mixing_matrix(step), topo.push_matrix(step)
            outdeg = [len(peers) for peers in topo.out_peers(step)]
            for i, peers in enumerate(topo.in_peers(step)):
                allowed = {i, *peers}
                assert {j for j in range(topo.num_workers) if w[i, j] != 0} <= allowed, topo
                for j in range(topo.num_workers):
                    expected = 1 / (outdeg[j] + 1) if j in allowed else 0.0
                    assert p[i, j].item() == pytest.approx(expected), topo


# ---- B: gossip alone, at the matrix level ----


@pytest.mark.parametrize("topo", [Ring(8), Torus(16), Exponential(16)], ids=repr)
def test_gossip_keeps_the_mean_and_contracts_consensus_distance(topo: Topology):
    k = topo.num_workers
    w = topo.mixing_matrix(0)
    x = torch.randn(k, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mean0, xi0 = x.mean(0), _consensus_distance(x)
    # x_t − x̄ = (W − J)^t (x_0 − x̄) for doubly stochastic W, so the bound that holds for any
    # such W is ‖W − J‖₂^{2t}. 1 − δ = |λ₂| is only the asymptotic rate in general, but it equals
    # ‖W − J‖₂ when W is normal: symmetric (ring, torus) or circulant (exponential, directed).
    sigma = torch.linalg.matrix_norm(w - 1 / k, ord=2).item()
    assert sigma == pytest.approx(1 - topo.spectral_gap, abs=1e-9)
    for t in range(1, 51):
        x = w @ x
        assert torch.allclose(x.mean(0), mean0, atol=1e-6)
        bound = sigma ** (2 * t) * xi0
        assert _consensus_distance(x) <= bound * (1 + 1e-9) + 1e-12
        assert _consensus_distance(x) <= (1 - topo.spectral_gap) ** (2 * t) * xi0 * (1 + 1e-9)


# ---- peers ----


def test_two_worker_ring_has_one_peer_each():
    topo = Ring(2)
    assert topo.in_peers(0) == topo.out_peers(0) == [(1,), (0,)]
    assert torch.equal(topo.mixing_matrix(0), torch.full((2, 2), 0.5, dtype=torch.float64))


def test_torus_neighbours():
    topo = Torus(16)
    assert (topo.rows, topo.cols) == (4, 4)
    assert topo.out_peers(0)[5] == (1, 4, 6, 9)
    two_rows = Torus(8)
    assert (two_rows.rows, two_rows.cols) == (2, 4)
    assert two_rows.out_peers(0)[0] == (1, 3, 4)  # up and down coincide with 2 rows


def test_in_and_out_peers_are_consistent():
    for topo in _all():
        for step in range(4):
            out, inn = topo.out_peers(step), topo.in_peers(step)
            for i in range(topo.num_workers):
                for peers in (out[i], inn[i]):
                    assert list(peers) == sorted(set(peers)) and i not in peers, topo
                for j in range(topo.num_workers):
                    assert (j in out[i]) == (i in inn[j]), topo


def test_random_graph_is_reproducible_and_connected():
    a, b, c = ErdosRenyi(12, p=0.2, seed=3), ErdosRenyi(12, p=0.2, seed=3), ErdosRenyi(12, p=0.2)
    assert a.out_peers(0) == b.out_peers(0) != c.out_peers(0)
    assert a.spectral_gap > 0
    assert ErdosRenyi(6, p=1.0).out_peers(0) == Complete(6).out_peers(0)


# ---- errors ----


ERRORS: list[tuple[Callable[[], Topology], str]] = [
    (lambda: Torus(7), "topology=ring"),
    (lambda: Torus(12, rows=2, cols=3), "topology.rows"),
    (lambda: Torus(8, rows=3, cols=3), "topology.rows"),
    (lambda: Torus(8, rows=1), "topology.rows"),
    (lambda: Ring(1), "workers >= 2"),
    (lambda: OnePeerExponential(1), "workers >= 2"),
    (lambda: Ring(4, weights="foo"), "topology.weights=foo; choose one of: metropolis, uniform"),
    (lambda: ErdosRenyi(8, p=0), "topology.p"),
    (lambda: ErdosRenyi(20, p=1e-4), "topology.p"),
]


@pytest.mark.parametrize(("build", "key"), ERRORS, ids=[f"error{i}" for i in range(len(ERRORS))])
def test_invalid_options_raise_one_line_naming_the_key(build: Callable[[], Topology], key: str):
    with pytest.raises(ValueError) as info:
        build()
    message = str(info.value)
    assert key in message and "\n" not in message


class _Lopsided(Topology):
    """A strongly connected directed graph that is not regular."""

    name = "lopsided"
    directed = True

    def __init__(self, num_workers: int, weights: str = "metropolis") -> None:
        super().__init__(num_workers, weights)
        self._check_graph()

    def _edges(self, phase: int) -> Edges:
        return {(0, 1), (1, 2), (2, 0), (0, 2)}


def test_metropolis_refuses_an_irregular_directed_graph():
    with pytest.raises(ValueError, match="topology.weights=uniform"):
        _Lopsided(3)
    assert _Lopsided(3, weights="uniform").in_peers(0) == [(2,), (0,), (0, 1)]


# ---- describe and config ----


def test_describe_is_json_serialisable():
    keys = {
        "name",
        "num_workers",
        "directed",
        "time_varying",
        "period",
        "weights",
        "degree_min",
        "degree_max",
        "spectral_gap",
        "beta",
        "symmetric",
        "doubly_stochastic",
        "column_stochastic",
    }
    for topo in [Ring(5), Torus(6), OnePeerExponential(12), ErdosRenyi(9)]:
        info = topo.describe()
        assert set(info) == keys
        assert json.loads(json.dumps(info)) == info
    assert OnePeerExponential(12).describe()["time_varying"] is True
    assert Ring(8).describe()["beta"] == pytest.approx(4 / 3)


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.stem)
def test_yaml_instantiates_with_eight_workers(path: Path):
    topo = instantiate(OmegaConf.load(path), num_workers=8)
    assert isinstance(topo, Topology)
    assert topo.name == path.stem and topo.num_workers == 8
    if isinstance(topo, Torus):
        assert (topo.rows, topo.cols) == (2, 4)


def test_every_topology_has_a_yaml():
    names = {cls.name for cls in (Ring, Torus, Exponential, OnePeerExponential, Complete)}
    names |= {Star.name, Chain.name, ErdosRenyi.name}
    assert {p.stem for p in CONF.glob("*.yaml")} == names
