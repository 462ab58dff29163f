"""NoLoCo (Kolehmainen et al. 2025, arXiv 2506.10911): `outer=noloco` over local SGD — every
worker its own slow weights φ_i and momentum Δ_i, each outer round a seeded random pairing and
Δ_i ← α·Δ_i − β·mean_pair(δ) − γ·(φ_i − mean_pair(φ)), φ_i ← φ_i + Δ_i, θ_i ← φ_i.

A. The pairing: a perfect matching every round, the same on every call, new each round.
B. The whole update equals the algorithm written here on plain float64 tensors; the
   diagnostics equal their definitions; K = 2 with γ = 0 is DiLoCo with heavy-ball momentum
   (`outer=sgd`, momentum α, lr β).
C. Runs: one row per worker and round (bytes = hand count); batched ≡ loop; simulated ≡ 4
   gloo processes; killed (also kill -9) and resumed bit for bit.
D. The YAML's defaults are the options' defaults; bad values are one `error:` line.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import torch
from helpers import (
    SHAKESPEARE_WORKS,
    SYNTHETIC_SMALL,
    TOL64,
    compose_config,
    gap,
    gpt_shakespeare_losses,
    least_squares_shards,
    metric_lines,
    refused_before_start,
    tiny_local_sgd,
    tiny_sgd_steps,
    train_on_shards,
)
from helpers import SMALL_512 as QUICK
from helpers import finished_run as run

from dpresearch.algorithms.outer.noloco import NoLoCo, NoLoCoOptions, pairing
from dpresearch.asynchrony.options import AsyncOptions
from dpresearch.asynchrony.speed import SpeedModel
from dpresearch.comm.network import NetworkModel
from dpresearch.compress.rng import stream_seed
from dpresearch.run.checkpoint_files import latest_checkpoint
from dpresearch.run.trainer import InjectedFailure
from dpresearch.train import train

NET = NetworkModel.preset("10gbe")
NOLOCO = ["algorithm=local_sgd", "algorithm.period=4", "outer=noloco"]
MLP_PARAMS = 32 * 16 + 32 + 10 * 32 + 10  # the default MLP: 874


# -- A: the pairing ------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [2, 4, 8, 16])
def test_every_round_pairs_every_worker_with_one_other(workers):
    """peer[peer[i]] = i ≠ peer[i] for every worker, 50 rounds; the same draw on every call."""
    for round_ in range(50):
        peer = pairing(workers, 7, round_)
        assert sorted(peer) == list(range(workers))
        assert all(peer[p] == i and p != i for i, p in enumerate(peer))
        assert pairing(workers, 7, round_) == peer


def test_the_pairings_are_drawn_afresh_each_round_and_uniformly():
    """K = 4 has 3 perfect matchings: over 600 rounds each comes 200 ± 45 times (≈ 4 σ), and
    consecutive rounds differ about 2/3 of the time; another seed gives another sequence."""
    draws = [tuple(pairing(4, 0, r)) for r in range(600)]
    counts = {m: draws.count(m) for m in set(draws)}
    assert len(counts) == 3 and all(abs(c - 200) <= 45 for c in counts.values()), counts
    changes = sum(a != b for a, b in zip(draws, draws[1:], strict=False))
    assert 330 <= changes <= 470
    assert [tuple(pairing(4, 1, r)) for r in range(600)] != draws


# -- B: the update against the algorithm, on plain tensors ---------------------------------------
K, H, ROUNDS, INNER_LR, SEED = 4, 3, 6, 0.1, 11
ALPHA, BETA, GAMMA = 0.6, 0.8, 0.3


def reference_peers(round_: int) -> list[int]:
    """The round's pairs as the docs state them: the pairs (π₀, π₁), (π₂, π₃) of
    randperm(K) under the seed stream_seed("noloco", seed, round) (the seed contract every
    process shares)."""
    gen = torch.Generator().manual_seed(stream_seed("noloco", SEED, round_))
    perm = torch.randperm(K, generator=gen).tolist()
    peer = [0] * K
    for m in range(0, K, 2):
        peer[perm[m]], peer[perm[m + 1]] = perm[m + 1], perm[m]
    return peer


def test_the_update_is_nolocos_written_apart(one_thread):
    """Ours (NoLoCo over local SGD, α = 0.6, β = 0.8, γ = 0.3: β ≠ γ separates the two
    terms) against the algorithm on plain float64 tensors: K = 4 workers, H = 3 inner
    plain-SGD steps on their own least-squares data from their own φ_i, then with the round's
    peer j: δ = φ − θ, Δ_i ← α·Δ_i − β·(δ_i + δ_j)/2 − γ·(φ_i − (φ_i + φ_j)/2),
    φ_i ← φ_i + Δ_i, θ_i ← φ_i. After 6 rounds (with several different pairings) φ, Δ and
    the workers agree to 1e-9 (`helpers.TOL64`); the logged diagnostics of the last round are
    their definitions: drift mean_k ‖θ_k − θ̄‖, momentum norm mean_k ‖Δ_k‖, pseudo-gradient
    cosines over the pairs k < j of δ rows, and the evaluated model is mean_k φ_k."""
    data = least_squares_shards(K)
    start, replicas, inner, base = tiny_local_sgd(K, INNER_LR, H)
    ours = NoLoCo(replicas, base.comm, inner, base, momentum=ALPHA, lr=BETA, gamma=GAMMA, seed=SEED)
    train_on_shards(ours, data, H * ROUNDS, H)

    phi = [start.clone() for _ in range(K)]
    velocity = [torch.zeros_like(start) for _ in range(K)]
    pairings = set()
    for round_ in range(ROUNDS):
        theta = []
        for w, (x, y) in enumerate(data):
            theta.append(tiny_sgd_steps(phi[w], x, y, INNER_LR, H))
        peer = reference_peers(round_)
        pairings.add(tuple(peer))
        delta = [phi[w] - theta[w] for w in range(K)]
        for w in range(K):
            j = peer[w]
            velocity[w] = (
                ALPHA * velocity[w]
                - BETA * (delta[w] + delta[j]) / 2
                - GAMMA * (phi[w] - (phi[w] + phi[j]) / 2)
            )
        phi = [phi[w] + velocity[w] for w in range(K)]
    assert len(pairings) >= 2  # the pairs changed between rounds

    assert gap(ours.slow, torch.stack(phi)) <= TOL64
    assert gap(ours.velocity, torch.stack(velocity)) <= TOL64
    assert gap(replicas.params, torch.stack(phi)) <= TOL64
    assert min(gap(phi[0], phi[w]) for w in range(1, K)) > 1e-4  # the replicas differ

    metrics = ours.metrics()
    thetas = torch.stack(theta)
    drift = (thetas - thetas.mean(0)).norm(dim=1).mean().item()
    assert abs(metrics["outer/drift"] - drift) <= TOL64
    norms = torch.stack(velocity).norm(dim=1).mean().item()
    assert abs(metrics["outer/momentum_norm"] - norms) <= TOL64
    deltas = torch.stack(delta)
    unit = deltas / deltas.norm(dim=1, keepdim=True)
    cos = [(unit[a] @ unit[b]).item() for a in range(K) for b in range(a + 1, K)]
    assert abs(metrics["outer/pseudo_grad_cosine"] - sum(cos) / len(cos)) <= TOL64
    assert abs(metrics["outer/pseudo_grad_cosine_min"] - min(cos)) <= TOL64
    assert gap(ours.consensus()[0], torch.stack(phi).mean(0)) <= TOL64


def test_two_workers_without_the_pull_are_diloco_with_heavy_ball_momentum(one_thread):
    """K = 2 (the pair is everyone) and γ = 0: NoLoCo's step is Δ ← α·Δ − β·mean δ, which is
    torch SGD with momentum α, lr β, no Nesterov on the anchor (`outer=sgd`): the same
    workers after 6 outer rounds, float64 to 1e-9."""
    common = ["algorithm=local_sgd", "algorithm.period=4", "workers=2", "train.steps=24",
              "optimizer.momentum=0.9"]  # fmt: skip
    noloco = run(*common, "outer=noloco", "outer.momentum=0.6", "outer.lr=0.8",
                 "outer.gamma=0", dtype=torch.float64)  # fmt: skip
    diloco = run(*common, "outer=sgd", "outer.optimizer.momentum=0.6", "outer.optimizer.lr=0.8",
                 dtype=torch.float64)  # fmt: skip
    assert noloco.summary["outer/rounds"] == diloco.summary["outer/rounds"] == 6
    assert gap(noloco.replicas.params, diloco.replicas.params) <= TOL64
    assert gap(noloco.replicas.params, noloco.replicas.params[0].expand(2, -1)) == 0.0
    moved = gap(noloco.replicas.params, run(*common, "outer=sgd").replicas.params)
    assert moved > 1e-3  # the momentum really acted


# -- C: runs ---------------------------------------------------------------------------------------
def test_each_round_sends_one_row_to_the_peer():
    """Per worker and outer round: one fp32 row of the MLP's 874 parameters to its peer,
    4·874 = 3496 bytes (the pair's exchange is the run's only algorithm traffic: no
    all-reduce); with BatchNorm the float buffers go to the peer too, as buffers traffic."""
    trainer = run(*NOLOCO, "workers=4", "train.steps=12")
    summary = trainer.summary
    assert summary["outer/rounds"] == 3
    assert summary["outer/bytes_per_round"] == summary["outer/peak_step_bytes"] == 4 * MLP_PARAMS
    assert summary["comm/bytes"] == 3 * 4 * MLP_PARAMS
    assert summary.get("comm/bytes_buffers", 0) == 0
    bn = run(*NOLOCO, "workers=4", "train.steps=12", "model.batch_norm=true")
    buffers = bn.replicas.buffers.shape[1]
    params = bn.replicas.params.shape[1]
    assert buffers > 0
    assert bn.summary["comm/bytes"] == 3 * 4 * params
    assert bn.summary["comm/bytes_buffers"] == 3 * 4 * buffers


def test_batched_workers_equal_the_loop(one_thread):
    """`train.batched_workers=true` (the K workers' forward/backward as one computation) ends
    where the loop ends: float64, to 1e-9, BatchNorm buffers too."""
    args = [*NOLOCO, "workers=4", "train.steps=12", "model.batch_norm=true"]
    loop = run(*args, "train.batched_workers=false", dtype=torch.float64)
    batched = run(*args, "train.batched_workers=true", dtype=torch.float64)
    assert loop.compute.batched is None and batched.compute.batched is not None
    assert gap(loop.replicas.params, batched.replicas.params) <= TOL64
    assert gap(loop.replicas.buffers, batched.replicas.buffers) <= TOL64
    assert gap(loop.replicas.params[0], loop.replicas.params[1]) > 1e-4


# K = 4, worker 3 three times slower, c = 0.25 s a step, 1 GbE (50 µs, 1 Gbit/s)
C, SLOW = 0.25, 3.0
STRAGGLER = ["workers=4", f"async.compute_s={C}", "async.slow_workers=[3]",
             f"async.slowdown={SLOW}", "network=1gbe", "train.steps=10"]  # fmt: skip
P2P_S = 50e-6 + 4 * MLP_PARAMS / (1e9 / 8)  # one row to one peer, by hand


def modeled_clock(tmp_path: Path, *overrides: str) -> dict[int, float]:
    """`time/modeled_s` of every logged step of a NoLoCo run (H = 5) of `overrides`."""
    args = [*QUICK, *NOLOCO[:1], "algorithm.period=5", "outer=noloco", *overrides]
    train(compose_config(*args), tmp_path)
    return {m["step"]: m["time/modeled_s"] for m in metric_lines(tmp_path)}


def test_a_straggler_holds_back_the_last_arrival_as_the_closed_form(tmp_path):
    """One worker 3× slower, H = 5: the run ends when the slow worker has done its rounds,
    each its 5 steps at 3c and then the exchange with its peer (one p2p row, 4·874 bytes):
    2·(15c + p) after 10 steps; at step 8, 15c + p + 9c."""
    rows = modeled_clock(tmp_path, *STRAGGLER)
    round_s = 5 * SLOW * C + P2P_S
    expected = {5: round_s, 8: round_s + 3 * SLOW * C, 10: 2 * round_s}
    assert {s: rows[s] for s in expected} == {
        s: pytest.approx(t, rel=1e-12) for s, t in expected.items()
    }


def test_a_round_waits_for_the_peer_only(tmp_path):
    """Log-normal speeds (cv 1), K = 4, H = 5, 20 steps: `time/modeled_s` is the pairwise
    rule replayed here from the same seeded speed streams — after each round, each pair ends
    at max(t_i, t_j) + p — and not the all-worker rule (every worker at max_w t_w + p), which
    would be later."""
    args = [*STRAGGLER[:1], "async.speed=lognormal", "async.cv=1.0", f"async.compute_s={C}",
            "network=1gbe", "train.steps=20"]  # fmt: skip
    rows = modeled_clock(tmp_path, *args)
    cfg = compose_config(*QUICK, *args)
    speed = SpeedModel.from_options(AsyncOptions.from_node(cfg["async"]), 4, cfg.seed)
    pairwise, everyone = [0.0] * 4, [0.0] * 4
    for step in range(20):
        for w in range(4):
            seconds = speed.draw(w)
            pairwise[w] += seconds
            everyone[w] += seconds
        if (step + 1) % 5 == 0:
            peer = pairing(4, cfg.seed, step // 5)
            pairwise = [max(pairwise[w], pairwise[peer[w]]) + P2P_S for w in range(4)]
            everyone = [max(everyone) + P2P_S] * 4
    assert rows[20] == pytest.approx(max(pairwise), rel=1e-12)
    assert max(everyone) > max(pairwise) * 1.05


GLOO_ARGS = [*NOLOCO, "model.batch_norm=true", "optimizer.momentum=0.9", "workers=4",
             "train.steps=16"]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.slow
def test_simulated_equals_four_gloo_processes(tmp_path):
    """NoLoCo on 4 gloo processes (one worker each: point-to-point rows to the round's peer,
    BatchNorm buffers too) ends with the simulated K = 4 run's parameters and buffers bit for
    bit (no sum is reordered: a pair's mean is taken the same way on both sides), and the same
    bytes and ops."""
    from helpers import cases_on_gloo, row_and_buffers

    real = cases_on_gloo(4, tmp_path, {"noloco": GLOO_ARGS}, row_and_buffers)
    simulated = run(*GLOO_ARGS, dtype=torch.float64)
    assert gap(simulated.replicas.params[0], simulated.replicas.params[1]) > 1e-4
    for rank in range(4):
        params, buffers, summary = real[rank]["noloco"]
        assert params.dtype == torch.float64
        assert gap(params, simulated.replicas.params[rank]) == 0.0, rank
        assert gap(buffers, simulated.replicas.buffers[rank]) == 0.0, rank
        assert summary["comm/bytes"] == simulated.summary["comm/bytes"]
        assert summary["comm/bytes_buffers"] == simulated.summary["comm/bytes_buffers"]
        assert sorted(summary["comm/ops"]) == sorted(simulated.summary["comm/ops"])
    assert simulated.summary["outer/rounds"] == 4


def test_killed_and_resumed_equals_uninterrupted(tmp_path, one_thread):
    """A run that dies at step 35 after a checkpoint at 30 (period 4: mid-round, the slow
    weights apart and the momenta non-zero), resumed, ends bit for bit as the uninterrupted
    run, metrics and bytes too."""
    from helpers import CHECKPOINTED, check_resumed

    check_resumed(tmp_path, [*CHECKPOINTED, "workers=4", *NOLOCO], InjectedFailure)


@pytest.mark.slow
def test_kill_9_then_resume_auto_is_exact(tmp_path):
    """A real SIGKILL of a command-line NoLoCo run, then `train.resume=auto`: bit for bit the
    uninterrupted run (every checkpoint holds per-worker slow weights that differ)."""
    from helpers import CHECKPOINTED, final_params, kill_9_and_resume, metric_lines, same

    args = [*CHECKPOINTED, "workers=4", *NOLOCO, "train.steps=300", "train.eval_every=150",
            "train.checkpoint_every=10"]  # fmt: skip

    def check_state(run_dir: Path) -> None:
        ckpt = torch.load(latest_checkpoint(run_dir), weights_only=False)
        state = ckpt["states"][0]["algorithm"]
        assert state["velocity"].abs().sum() > 0 and state["rounds"] > 0

    run_dir, reference = kill_9_and_resume(args, tmp_path, kill_after=25, before_resume=check_state)
    assert [m["step"] for m in metric_lines(run_dir)] == list(range(1, 301))
    assert same(final_params(run_dir), final_params(reference))


@pytest.mark.slow
@pytest.mark.skipif(not SHAKESPEARE_WORKS.is_dir(), reason="no Shakespeare corpus")
def test_noloco_trains_the_gpt_on_shakespeare(tmp_path, one_thread):
    """`algorithm=local_sgd outer=noloco` (H = 5, AdamW inner steps, α = 0.5) on gpt_tiny, 4
    workers: the training loss falls by more than 0.8 in 100 steps (from about 4.1 over the
    first 10), the held-out loss ends below 3.5, 20 rounds of one row each."""
    losses, summary = gpt_shakespeare_losses(
        tmp_path / "run", "workers=4", "optimizer=adamw", "outer=noloco", "outer.momentum=0.5"
    )
    assert losses[0] - losses[-1] > 0.8, losses
    assert summary["val/loss"] < 3.5
    assert summary["outer/rounds"] == 20
    assert summary["outer/bytes_per_round"] == 4 * summary["num_params"], summary


# -- D: defaults, bad input ------------------------------------------------------------------------
def test_the_yaml_carries_the_options_defaults():
    """outer=noloco composes the dataclass's defaults (the seed: the run's)."""
    cfg = compose_config(*NOLOCO)
    options = NoLoCoOptions.from_node(cfg.outer)
    for f in fields(NoLoCoOptions):
        expected = cfg.seed if f.name == "seed" else f.default
        assert getattr(options, f.name) == expected, f.name
    assert cfg.outer._target_ == "dpresearch.algorithms.outer.noloco.NoLoCo"


BAD = [
    (["workers=3"], "workers=3: NoLoCo pairs every worker with one peer"),
    (["outer.momentum=1.0"], "outer.momentum=1.0: α must be in [0, 1)"),
    (["outer.lr=0"], "outer.lr=0: β must be > 0"),
    (["outer.gamma=-0.5"], "outer.gamma=-0.5: γ must be in [0, 2]"),
    (["outer.buffers=mean"], "outer.buffers=mean; choose one of: average, local"),
    (["outer.period=0"], "outer.period=0: a whole number of steps >= 1"),
    (
        ["+outer.fragments=2"],
        "outer.fragments is not an option of dpresearch.algorithms.outer.noloco",
    ),
    (["algorithm=dpsgd", "outer=noloco", "outer.period=4"], "use algorithm=local_sgd"),
    (["algorithm=sync", "outer=noloco"], "SyncSGD is not one"),
]


@pytest.mark.parametrize("args,fragment", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_are_one_line_before_any_worker(args, fragment, tmp_path, monkeypatch, capsys):
    """Each bad value of the NoLoCo node: exit code 2, one `error: ` line naming the key,
    nothing written. (A case naming its own algorithm replaces local SGD's.)"""
    base = [] if args[0].startswith("algorithm=") else NOLOCO
    argv = [*SYNTHETIC_SMALL, "workers=4", *base, *args]
    refused_before_start(argv, fragment, tmp_path, monkeypatch, capsys)
