"""DES-LOC (Iacob et al. 2025, arXiv 2505.22549): `algorithm=desloc`, local SGD whose Adam
moments are averaged at their own periods (parameters K_x, first moment K_u, second K_v).

A. The trajectory equals the paper's update written here on plain float64 tensors (local
   AdamW per worker, "t mod K = 0" averaging before step t of each quantity).
B. K_u = K_v = K_x is Local Adam (local SGD with `average_optimizer_state=true`) bit for bit;
   outer SGD with lr 1 and no momentum over DES-LOC is DES-LOC bit for bit.
C. Bytes per kind equal the hand count; simulated K = 2 equals 2 gloo processes; killed (also
   kill -9) and resumed exactly; batched workers equal the loop.
D. Bad inputs are one `error:` line before any worker.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    MLP_RUN,
    SYNTHETIC_SMALL,
    TOL64,
    compose_config,
    gap,
    refused_before_start,
    train_on_shards,
    trainer_for,
)
from helpers import finished_run as run
from torch import nn

from dpresearch.algorithms.desloc import DesLoc
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.replicas import Replicas
from dpresearch.run.trainer import InjectedFailure

NET = NetworkModel.preset("10gbe")
DESLOC = [
    "algorithm=desloc",
    "algorithm.period=2",
    "algorithm.state_periods={exp_avg:3,exp_avg_sq:6}",
]


# -- A: the paper's update, written apart --------------------------------------------------------
K, T, KX, KU, KV = 4, 13, 2, 3, 5
LR, BETAS, EPS, WD = 0.05, (0.9, 0.99), 1e-8, 0.1


def tiny_model() -> nn.Module:
    """5 → 7 → 2 (tanh), float64: W1 (35), b1 (7), W2 (14), b2 (2)."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()


def forward(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = flat.split([35, 7, 14, 2])
    return torch.tanh(x @ w1.view(7, 5).T + b1) @ w2.view(2, 7).T + b2


def mean(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """E_m[·]: every worker's copy replaced by the workers' mean."""
    m = sum(rows) / len(rows)
    return [m.clone() for _ in rows]


def paper_update(
    theta0: torch.Tensor, data: list, kx: int, ku: int, kv: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The paper's box for T steps of K workers from θ0 on flat tensors: each worker's θ, m,
    v after it (local AdamW, each quantity averaged before step t where its period divides t)."""
    theta = [theta0.clone() for _ in range(K)]
    u = [torch.zeros_like(theta0) for _ in range(K)]
    v = [torch.zeros_like(theta0) for _ in range(K)]
    b1, b2 = BETAS
    for t in range(T):
        if t % ku == 0:
            u = mean(u)
        if t % kv == 0:
            v = mean(v)
        if t % kx == 0:
            theta = mean(theta)
        n = t + 1
        for w, (x, y) in enumerate(data):
            flat = theta[w].clone().requires_grad_(True)
            g = torch.autograd.grad(F.mse_loss(forward(flat, x), y), flat)[0]
            theta[w] = theta[w] * (1 - LR * WD)
            u[w] = b1 * u[w] + (1 - b1) * g
            v[w] = b2 * v[w] + (1 - b2) * g * g
            u_hat, v_hat = u[w] / (1 - b1**n), v[w] / (1 - b2**n)
            theta[w] = theta[w] - LR * u_hat / (v_hat.sqrt() + EPS)
    return theta, u, v


def test_the_trajectory_is_the_papers_update_written_apart(one_thread):
    """Ours (DesLoc over 4 workers' torch AdamW, stacked steps) against the paper's box on flat
    float64 tensors: before step t (0-based) m ← E[m] if t mod K_u = 0, v ← E[v] if
    t mod K_v = 0, θ ← E[θ] if t mod K_x = 0; then per worker g = ∇f_m(θ_m) and AdamW:
    θ ← θ(1 − ηλ), m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g², θ ← θ − η·m̂/(√v̂ + ε)
    with Adam's bias corrections. K_x = 2, K_u = 3, K_v = 5 and T = 13 steps (no period
    divides 13: no final average, where averaging after step t and before step t + 1
    differ); all three quantities agree to 1e-9, and the workers still differ (no period
    ended at the end)."""
    gen = torch.Generator().manual_seed(5)
    data = [
        (
            torch.randn(16, 5, generator=gen, dtype=torch.float64),
            torch.randn(16, 2, generator=gen, dtype=torch.float64),
        )
        for _ in range(K)
    ]
    model = tiny_model()
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = Replicas(model, K, torch.device("cpu"))
    comm = SimulatedCommunicator(K, NET, deterministic=True)
    opts = [
        torch.optim.AdamW(list(m.parameters()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        for m in replicas.models
    ]
    ours = DesLoc(replicas, comm, opts, period=KX, state_periods={"exp_avg": KU, "exp_avg_sq": KV})
    train_on_shards(ours, data, T, T)

    theta, u, v = paper_update(theta0, data, KX, KU, KV)

    def state(key: str) -> torch.Tensor:
        return torch.stack(
            [torch.cat([o.state[p][key].reshape(-1) for p in m.parameters()])
             for o, m in zip(opts, replicas.models, strict=True)]
        )  # fmt: skip

    assert gap(replicas.params, torch.stack(theta)) <= TOL64
    assert gap(state("exp_avg"), torch.stack(u)) <= TOL64
    assert gap(state("exp_avg_sq"), torch.stack(v)) <= TOL64
    for rows in (theta, u, v):
        assert (rows[0] - rows[1]).abs().max() > 1e-6  # still local since the last sync
    # the moments' periods matter: averaging every state at K_x goes elsewhere
    local_adam, _, _ = paper_update(theta0, data, KX, KX, KX)
    assert gap(torch.stack(theta), torch.stack(local_adam)) > 1e-4


# -- B: special cases that are other methods ------------------------------------------------------
def test_equal_periods_are_local_adam_bit_for_bit(one_thread):
    """K_u = K_v = K_x = 3: DES-LOC equals local SGD with average_optimizer_state=true over
    AdamW (its one allreduce of every state), parameters and bytes exactly."""
    common = ["workers=4", "optimizer=adamw", "train.steps=14"]
    desloc = run(*common, "algorithm=desloc", "algorithm.period=3",
                 "algorithm.state_periods={exp_avg:3,exp_avg_sq:3}")  # fmt: skip
    local_adam = run(*common, "algorithm=local_sgd", "algorithm.period=3",
                     "algorithm.average_optimizer_state=true")  # fmt: skip
    assert torch.equal(desloc.replicas.params, local_adam.replicas.params)
    assert desloc.summary["comm/bytes"] == local_adam.summary["comm/bytes"]
    assert not torch.equal(desloc.replicas.params, run(*common, *DESLOC).replicas.params)


def test_outer_sgd_lr_one_over_desloc_is_desloc(one_thread):
    """The parameter sync handed to the outer optimizer (outer=sgd: lr 1, no momentum, period
    K_x) while the moments stay DES-LOC's at their periods: the same parameters; outer
    Nesterov (DiLoCo's) then differs, its moments still averaged (bytes per kind)."""
    alone = run("workers=4", "train.steps=12", *DESLOC)
    outer = run("workers=4", "train.steps=12", *DESLOC, "outer=sgd")
    assert gap(alone.replicas.params, outer.replicas.params) <= 1e-6
    assert outer.summary["outer/rounds"] == 6
    nesterov = run("workers=4", "train.steps=12", *DESLOC, "outer=nesterov")
    assert gap(alone.replicas.params, nesterov.replicas.params) > 1e-4
    row = 4 * 874  # one worker's fp32 row of the 16-32-10 MLP
    assert nesterov.summary["desloc/bytes_exp_avg"] == 4 * row
    assert nesterov.summary["desloc/bytes_exp_avg_sq"] == 2 * row
    assert nesterov.summary["desloc/bytes_params"] == 0  # the outer optimizer's now


# -- C: bytes, gloo, resume, batched -------------------------------------------------------------
def test_bytes_per_kind_are_the_hand_count(one_thread):
    """The 16-32-10 MLP has D = 16·32 + 32 + 32·10 + 10 = 874 parameters, one fp32 row 3496
    bytes. 12 steps with K_x = 2, K_u = 3, K_v = 6: 6 parameter syncs, 4 of exp_avg, 2 of
    exp_avg_sq, each one allreduce of one row per worker; comm/bytes is their sum."""
    trainer = run("workers=4", "train.steps=12", *DESLOC)
    row = 4 * 874
    s = trainer.summary
    assert s["desloc/bytes_params"] == 6 * row
    assert s["desloc/bytes_exp_avg"] == 4 * row
    assert s["desloc/bytes_exp_avg_sq"] == 2 * row
    assert s["comm/bytes"] == 12 * row
    # after step 12 every period ended: one model, one pair of moments
    assert torch.equal(trainer.replicas.params[0], trainer.replicas.params[3])


GLOO_ARGS = [*DESLOC, "workers=2", "train.steps=14"]


def second_moments(trainer, row: int = 0) -> torch.Tensor:
    """Local worker row `row`'s Adam second moments v, flattened in parameter order."""
    opt = trainer.optimizers[row]
    params = trainer.replicas.models[row].parameters()
    return torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params])


def row_and_moments(trainer, summary: dict) -> tuple:
    """What each rank keeps: its parameter row, its second moments, the summary."""
    return trainer.replicas.params[0].clone(), second_moments(trainer), summary


@pytest.mark.distributed
@pytest.mark.slow
def test_simulated_k2_equals_two_gloo_processes(tmp_path):
    """DES-LOC on 2 gloo processes (one worker each) ends with the simulated K = 2 run's
    parameters and second moments (float64, to 1e-9: gloo need not add in the simulated
    order), the same bytes per kind and ops."""
    from helpers import cases_on_gloo

    real = cases_on_gloo(2, tmp_path, {"desloc": GLOO_ARGS}, row_and_moments)
    simulated = run(*GLOO_ARGS, dtype=torch.float64)
    for rank in range(2):
        params, v, summary = real[rank]["desloc"]
        assert params.dtype == torch.float64
        assert gap(params, simulated.replicas.params[rank]) <= TOL64, rank
        assert gap(v, second_moments(simulated, rank)) <= TOL64, rank
        for key in ("comm/bytes", "desloc/bytes_params", "desloc/bytes_exp_avg_sq"):
            assert summary[key] == simulated.summary[key], key
        assert sorted(summary["comm/ops"]) == sorted(simulated.summary["comm/ops"])


def test_killed_and_resumed_equals_uninterrupted(tmp_path, one_thread):
    """Dies at step 35 after a checkpoint at 30 (K_x = 2, K_u = 3, K_v = 6: the moments differ
    across workers there), resumed: bit for bit the uninterrupted run, bytes per kind too."""
    from helpers import CHECKPOINTED, check_resumed

    check_resumed(tmp_path, [*CHECKPOINTED, "workers=4", *DESLOC], InjectedFailure)


@pytest.mark.slow
def test_kill_9_then_resume_auto_is_exact(tmp_path):
    """A real SIGKILL of a command-line DES-LOC run, then `train.resume=auto`: bit for bit."""
    from helpers import CHECKPOINTED, final_params, kill_9_and_resume, metric_lines, same

    args = [*CHECKPOINTED, "workers=4", *DESLOC, "train.steps=300",
            "train.eval_every=150", "train.checkpoint_every=10"]  # fmt: skip
    run_dir, reference = kill_9_and_resume(args, tmp_path, kill_after=25)
    assert [m["step"] for m in metric_lines(run_dir)] == list(range(1, 301))
    assert same(final_params(run_dir), final_params(reference))
    last = metric_lines(run_dir)[-1]
    assert last["desloc/bytes_exp_avg_sq"] == 50 * 4 * 874


@pytest.mark.parametrize("way", ["stacked", "vmap"])
def test_batched_workers_equal_the_loop(way):
    """`train.batched_workers` (stacked layers or vmap) ≡ one worker at a time, float64, to
    1e-9, BatchNorm on (its buffers averaged at K_x)."""
    rows = {}
    for mode in ("false", way):
        trainer = trainer_for(*MLP_RUN, *DESLOC, mode=mode, dtype=torch.float64)
        start = trainer.replicas.params.clone()
        trainer.run()
        rows[mode] = (trainer.replicas.params.clone(), trainer.replicas.buffers.clone())
        assert (trainer.replicas.params - start).abs().max() > 1e-3
    assert gap(rows["false"][0], rows[way][0]) <= TOL64
    assert gap(rows["false"][1], rows[way][1]) <= TOL64


# -- D: bad input ---------------------------------------------------------------------------------
BAD = [
    (["algorithm.state_periods.exp_avg=0"], "algorithm.state_periods.exp_avg=0: average every"),
    (["algorithm.state_periods=3"], "algorithm.state_periods=3: give a mapping"),
    (["optimizer=sgd"], "keeps no state 'exp_avg' (its states: none); use optimizer=adamw"),
    (["+algorithm.state_periods.exp_avg_sqr=4"], "keeps no state 'exp_avg_sqr'"),
    (["algorithm.average_optimizer_state=true"], "name each state's period instead"),
    (["algorithm.sync_epochs=1"], "DES-LOC has no dense start"),
    (["outer=nesterov", "outer.inner_state=average"], "set outer.inner_state=keep"),
    (["algorithm.period=0"], "algorithm.period=0"),
    (["+algorithm.q=1"], "algorithm.q is not an option of dpresearch.algorithms.desloc.DesLoc"),
]


@pytest.mark.parametrize("args,fragment", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_before_any_worker(args, fragment, tmp_path, monkeypatch, capsys):
    refused_before_start(
        [*SYNTHETIC_SMALL, "algorithm=desloc", *args], fragment, tmp_path, monkeypatch, capsys
    )


def test_yaml_carries_the_options_defaults():
    """conf/algorithm/desloc.yaml's state_periods are DeslocOptions' defaults (K_u = 3·K_x,
    K_v = 6·K_x for the local SGD period 8)."""
    from dpresearch.algorithms.desloc import DeslocOptions

    node = compose_config("algorithm=desloc").algorithm
    assert DeslocOptions.from_node(node) == DeslocOptions()
    assert dict(node.state_periods) == {"exp_avg": 3 * node.period, "exp_avg_sq": 6 * node.period}
    assert compose_config("algorithm=desloc").optimizer._target_ == "torch.optim.AdamW"
