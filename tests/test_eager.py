"""One-step-delayed outer steps and eager updates (Kale et al. 2025; `outer.delay`), over
DiLoCo and Streaming DiLoCo.

A. The paper's algorithm written apart (K copies, H inner AdamW steps; delayed: θ steps on the
   previous round's mean; eager: each worker's θ_i steps on Δ_i/K + Δ̄_prev − Δ_i,prev/K; the
   last round applied at the end) equals ours in float64, on DiLoCo and on two fragments mixed
   by α = 0.5; the run evaluates the mean of the workers' θ_i.
B. The bytes are DiLoCo's (the same messages, one round later), by hand.
C. `time/modeled_s` on a hand-computed straggler case: the allreduce hides behind the next
   round's compute, what it does not hide is waited for.
D. Killed and resumed bit for bit with an exchange in flight; simulated ≡ gloo; batched
   workers ≡ the loop; bad input one line.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    CHECKPOINTED,
    SMALL_512,
    TOL64,
    cases_on_gloo,
    check_resumed,
    compose_config,
    default_dtype,
    gap,
    metric_lines,
    reference_start,
    run_main,
)
from helpers import finished_run as run

from dpresearch.algorithms.outer.fragments import blocks_of, split
from dpresearch.config.validate import ConfigError, validate
from dpresearch.run.trainer import InjectedFailure
from dpresearch.train import train

F64 = torch.float64
H = 8
EAGER = [
    "algorithm=local_sgd",
    f"algorithm.period={H}",
    "outer=eager",
    "optimizer=adamw",
    "optimizer.lr=0.003",
    "optimizer.exclude_bn_bias_from_weight_decay=false",
    "workers=4",
    "model.hidden=[32,32]",
]
STREAMING = ["outer.fragments=2", "outer.mix=0.5"]


# -- A: the paper's algorithm written apart ------------------------------------------------------
def reference(cfg, steps: int, delay: str, fragments: int, mix: float):
    """Eager updates / delayed outer gradients written directly against torch (float64): K
    models on their shards' batches in the IID partitioner's order, inner AdamW; fragment p's
    round ends after steps ≡ ⌊p·H/F⌋ (mod H). At a round's end each worker computes
    Δ_i = θ(_i) − x_i (sent; the mean arrives one round later) and steps the outer Nesterov
    optimizer on the previous round's mean (delayed; nothing in round 1) or on
    Δ_i/K + (Δ̄_prev − Δ_i,prev/K) with its own θ_i (eager); x_i ← (1 − α)·θ(_i) + α·x_i. A
    round whose mean would arrive after the last step is applied at once: Δ̄ (delayed),
    Δ̄ − Δ_i/K (eager). Returns the workers and their outer models."""
    with default_dtype(F64):
        k, batch = cfg.workers, cfg.train.batch_size
        data, partitioner, per_epoch, model = reference_start(cfg)
        workers = [copy.deepcopy(model) for _ in range(k)]
        outers = [copy.deepcopy(model) for _ in range(k if delay == "eager" else 1)]
        options = {k: v for k, v in cfg.optimizer.items() if not k.startswith(("_", "exclude"))}
        inner = [torch.optim.AdamW(m.parameters(), **options) for m in workers]
        names = [n for n, _ in model.named_parameters()]
        groups = [[names[t] for t in f.tensors] for f in split(blocks_of(model), fragments)]
        params = [dict(m.named_parameters()) for m in outers]
        opt = [
            [
                torch.optim.SGD([ps[n] for n in g], lr=0.7, momentum=0.9, nesterov=True)
                for g in groups
            ]
            for ps in params
        ]
        pending: dict[int, tuple[dict, list[dict]]] = {}

        def restart(p: int) -> None:
            with torch.no_grad():
                for w, m in enumerate(workers):
                    theta = params[w if delay == "eager" else 0]
                    for n, x in m.named_parameters():
                        if n in groups[p]:
                            x.copy_((1 - mix) * theta[n] + mix * x if mix else theta[n])

        def outer_step(p: int, grads: list[dict]) -> None:
            for o, ps in enumerate(params):
                for n in groups[p]:
                    ps[n].grad = grads[o][n].clone()
                opt[o][p].step()
            restart(p)

        for step in range(steps):
            for w, (m, o) in enumerate(zip(workers, inner, strict=True)):
                epoch, pos = divmod(step, per_epoch)
                x, y = data.train_batch(
                    partitioner.epoch_indices(w, epoch)[pos * batch : (pos + 1) * batch]
                )
                o.zero_grad()
                F.cross_entropy(m(x.to(F64)), y).backward()
                o.step()
            done = step + 1
            for p, group in enumerate(groups):
                if (done - (p * H) // fragments) % H:
                    continue
                with torch.no_grad():
                    own = [
                        {n: params[w if delay == "eager" else 0][n] - x[n] for n in group}
                        for w, x in enumerate(dict(m.named_parameters()) for m in workers)
                    ]
                    mean = {n: torch.stack([d[n] for d in own]).sum(0) / k for n in group}
                before = pending.pop(p, None)
                if delay == "eager":
                    outer_step(
                        p,
                        [
                            {
                                n: own[w][n] / k
                                + (0 if before is None else before[0][n] - before[1][w][n] / k)
                                for n in group
                            }
                            for w in range(k)
                        ],
                    )
                elif before is not None:
                    outer_step(p, [before[0]])
                else:  # round 1: nothing has arrived, every worker restarts from θ^(0)
                    restart(p)
                if done + H > steps:  # its mean would arrive after the run: applied now
                    if delay == "eager":
                        outer_step(
                            p, [{n: mean[n] - own[w][n] / k for n in group} for w in range(k)]
                        )
                    else:
                        outer_step(p, [mean])
                else:
                    pending[p] = (mean, own)
        return workers, outers


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("delay", ["eager", "delayed"])
@pytest.mark.parametrize("steps", [40, 36])  # 36: the last round is applied at step 32
@pytest.mark.parametrize("streaming", [False, True])
def test_equals_the_papers_algorithm_written_apart(delay, steps, streaming):
    extra = STREAMING if streaming else []
    trainer = run(*EAGER, f"outer.delay={delay}", f"train.steps={steps}", *extra, dtype=F64)
    workers, outers = reference(trainer.cfg, steps, delay, 2 if streaming else 1, 0.5 * streaming)
    for w, model in enumerate(workers):
        assert gap(trainer.replicas.params[w], flat(model)) <= TOL64, w
    anchor = trainer.algorithm.anchor.params
    assert anchor.shape[0] == len(outers)
    for o, model in enumerate(outers):
        assert gap(anchor[o], flat(model)) <= TOL64, o
    # evaluated: the mean of the workers' outer parameters (θ itself when delayed)
    consensus, _ = trainer.algorithm.consensus()
    assert gap(consensus, torch.stack([flat(m) for m in outers]).mean(0)) <= TOL64
    if delay == "eager":  # each worker stepped its own estimate: the θ_i differ
        assert gap(anchor[0], anchor[1]) > 1e-6
    fragments = 2 if streaming else 1  # every exchange applied once: sends per fragment
    sends = [n for n in range(1, steps + 1) for f in range(fragments) if (n - f * H // 2) % H == 0]
    assert trainer.summary["outer/rounds"] == len(sends) / fragments


def test_eager_with_plain_outer_sgd_telescopes_to_the_sum_of_the_means():
    """With outer SGD lr 1 (no momentum) every θ_i ends at θ^(0) − Σ_t Δ̄^(t): the estimates
    telescope (each worker's own share applied early, then corrected), so the workers' outer
    parameters, apart during the run, meet again at the end."""
    args = [*EAGER, "optimizer@outer.optimizer=outer_sgd", "train.steps=20"]  # ends mid-round
    eager = run(*args, dtype=F64)
    anchor = eager.algorithm.anchor.params
    assert gap(anchor, anchor[:1].expand_as(anchor)) <= TOL64
    assert gap(anchor[0], eager.replicas.params[0]) > 1e-4  # steps 17–20 trained past it


# -- B: bytes ------------------------------------------------------------------------------------
PARAMS = 16 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10  # the 16-32-32-10 MLP


@pytest.mark.parametrize("delay", ["eager", "delayed"])
def test_bytes_are_dilocos_by_hand(delay):
    args = [*EAGER, "train.steps=40"]
    diloco = run(*args, "outer.delay=none").summary
    ours = run(*args, f"outer.delay={delay}").summary
    assert ours["comm/bytes"] == diloco["comm/bytes"] == 5 * 4 * PARAMS  # 5 rounds, fp32 Δ
    assert ours["outer/bytes_per_round"] == diloco["outer/bytes_per_round"] == 4 * PARAMS
    # the same 5 allreduces; 4 of them now hidden behind a round (7th entry: H steps)
    rows = sorted(ours["comm/ops"])
    assert [r[:4] for r in rows] == [["allreduce", 4 * PARAMS, 4, 0]] * 2
    assert [r[4] for r in rows] == [1, 4] and rows[1][6] == H


# -- C: the modeled clock ------------------------------------------------------------------------
C, SLOW, K, H5 = 0.25, 3.0, 4, 5
SMALL_PARAMS = 16 * 32 + 32 + 32 * 10 + 10  # SMALL's 16-32-10 MLP
LATENCY_US, GBIT = 100.0, 2e-5
CLOCK = [
    *SMALL_512,
    f"workers={K}",
    f"async.compute_s={C}",
    "async.slow_workers=[3]",
    f"async.slowdown={SLOW}",
    "network=custom",
    f"network.latency_us={LATENCY_US}",
    f"network.bandwidth_gbit={GBIT}",
    "algorithm=local_sgd",
    f"algorithm.period={H5}",
    "outer=nesterov",
    "train.steps=15",
    "train.log_every=1",
]


def allreduce_s() -> float:
    """A ring allreduce of Δ (fp32) among K workers on the custom link, by hand."""
    return 2 * (K - 1) * LATENCY_US * 1e-6 + 2 * (K - 1) / K * 4 * SMALL_PARAMS / (GBIT * 1e9 / 8)


def test_modeled_clock_hides_the_allreduce_behind_the_next_round(tmp_path):
    t = allreduce_s()
    assert 1.0 < t < 3.0  # comparable to a round (slow worker 5 × 0.75 s), not hidden by it
    fast, slow = H5 * C, H5 * SLOW * C
    # DiLoCo: every round the slowest worker, then the allreduce
    diloco = {5: slow + t, 10: 2 * (slow + t), 12: 2 * (slow + t) + 2 * SLOW * C,
              15: 3 * (slow + t)}  # fmt: skip
    # delayed / eager: round 1's allreduce starts when the slow worker arrives (3.75 s) and
    # ends at 3.75 + t; round 2 ends for the fast workers at max(2.5, 3.75 + t), for the slow
    # one at 7.5; round 2's allreduce runs 7.5 → 7.5 + t (the link is free by then). The run's
    # last round (15) waits for its own allreduce: it starts at max(11.25, 7.5 + t).
    ready1, ready2 = slow + t, 2 * slow + t
    overlapped = {
        5: slow,
        10: 2 * slow,
        12: max(2 * slow + 2 * SLOW * C, max(2 * fast, ready1) + 2 * C),
        15: max(3 * slow, ready2) + t,
    }
    for name, extra, expected in (
        ("diloco", [], diloco),
        ("delayed", ["outer.delay=delayed"], overlapped),
        ("eager", ["outer.delay=eager"], overlapped),
    ):
        train(compose_config(*CLOCK, *extra), tmp_path / name)
        clock = {m["step"]: m["time/modeled_s"] for m in metric_lines(tmp_path / name)}
        assert {s: clock[s] for s in expected} == {
            s: pytest.approx(v, rel=1e-12) for s, v in expected.items()
        }, name


def test_modeled_clock_streaming_fragment_waited_for_at_its_merge(tmp_path):
    """The same rule for Streaming DiLoCo's τ: a fragment sent at step 5 (when the slow worker
    arrives, 3.75 s) is waited for at its merge τ = 2 steps later; the one of step 10 would
    merge after the run and is not sent."""
    t = allreduce_s()
    streaming = ["outer=streaming", "outer.fragments=1", "outer.overlap=2", "train.steps=10"]
    train(compose_config(*CLOCK, *streaming), tmp_path)
    clock = {m["step"]: m["time/modeled_s"] for m in metric_lines(tmp_path)}
    merged = max(H5 * SLOW * C + 2 * SLOW * C, H5 * SLOW * C + t)  # slow worker vs the allreduce
    expected = {5: H5 * SLOW * C, 7: merged, 10: merged + 3 * SLOW * C}
    assert {s: clock[s] for s in expected} == {
        s: pytest.approx(v, rel=1e-12) for s, v in expected.items()
    }


# -- D: resume, gloo, batched, bad input ---------------------------------------------------------
@pytest.mark.parametrize("delay", ["eager", "delayed"])
def test_killed_and_resumed_with_an_exchange_in_flight(delay, tmp_path, one_thread):
    # H = 4: every checkpoint (steps 10, 20, 30) holds the round sent at 8, 20 or 28 in flight
    args = [*CHECKPOINTED, "workers=4", "algorithm=local_sgd", "algorithm.period=4",
            "outer=eager", f"outer.delay={delay}", "optimizer.momentum=0.9"]  # fmt: skip
    check_resumed(tmp_path, args, InjectedFailure)


@pytest.mark.slow
def test_kill_9_resumes_exactly(tmp_path):
    from helpers import final_params, kill_9_and_resume, same

    args = [*CHECKPOINTED, "workers=4", "algorithm=local_sgd", "algorithm.period=4",
            "outer=eager", "optimizer.momentum=0.9", "train.steps=300", "train.eval_every=150",
            "train.checkpoint_every=10"]  # fmt: skip
    run_dir, reference = kill_9_and_resume(args, tmp_path, kill_after=25)
    assert [m["step"] for m in metric_lines(run_dir)] == list(range(1, 301))
    assert same(final_params(run_dir), final_params(reference))


def test_batched_workers_equal_the_loop():
    args = [*EAGER, "train.steps=24", *STREAMING]
    loop = run(*args, "train.batched_workers=false", dtype=F64)
    batched = run(*args, "train.batched_workers=true", dtype=F64)
    assert gap(loop.replicas.params, batched.replicas.params) <= TOL64
    assert gap(loop.algorithm.anchor.params, batched.algorithm.anchor.params) <= TOL64


GLOO_CASES = {
    "eager": [*EAGER, "train.steps=24"],
    "delayed": [*EAGER, "train.steps=24", "outer.delay=delayed"],
    "eager_streaming": [*EAGER, "train.steps=24", *STREAMING],
}


def kept_on_gloo(trainer, summary: dict) -> tuple:
    """What each rank keeps of a case: its worker, its outer parameters, the evaluated model."""
    algorithm = trainer.algorithm
    return (
        trainer.replicas.params[0].clone(),
        algorithm.anchor.params[0].clone(),
        algorithm.consensus()[0].clone(),
        summary,
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_gloo_ranks_equal_the_simulated_workers(tmp_path):
    """4 gloo processes: each rank's worker, outer parameters and evaluated model, the bytes
    and the op table equal the simulated run's (float64; gloo sums in its own order)."""
    real = cases_on_gloo(4, tmp_path, GLOO_CASES, kept_on_gloo)
    for name, args in GLOO_CASES.items():
        simulated = run(*args, dtype=F64)
        consensus = simulated.algorithm.consensus()[0]
        anchors = simulated.algorithm.anchor.params
        for rank in range(4):
            params, anchor, evaluated, summary = real[rank][name]
            assert gap(params, simulated.replicas.params[rank]) <= TOL64, (name, rank)
            assert gap(anchor, anchors[rank if name != "delayed" else 0]) <= TOL64, (name, rank)
            assert gap(evaluated, consensus) <= TOL64, (name, rank)
            assert summary["comm/bytes"] == simulated.summary["comm/bytes"], name
            # every worker's own outer momentum (eager): the RMS over all K, on every rank
            norm = simulated.summary["outer/momentum_norm"]
            assert summary["outer/momentum_norm"] == pytest.approx(norm, rel=1e-9), name
            assert sorted(summary["comm/ops"]) == sorted(simulated.summary["comm/ops"]), name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["outer.delay=later"], "outer.delay=later; choose one of: none, delayed, eager"),
        (["outer=streaming", "outer.delay=eager"], "set outer.overlap=0"),
        (["compressor@outer.compressor=topk"], "outer.delay=eager stands the worker's own"),
    ],
)
def test_bad_input_is_one_line(args, message, tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match=message) as caught:
        validate(compose_config("algorithm=local_sgd", "outer=eager", *args))
    assert "\n" not in str(caught.value)
    # on the command line: exit 2, one `error:` line, before any worker starts
    cli = [*SMALL_512, "algorithm=local_sgd", "outer=eager", *args]
    code, _, err = run_main(cli, tmp_path, monkeypatch, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert list(tmp_path.iterdir()) == []
