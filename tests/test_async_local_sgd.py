"""Asynchronous Local-SGD (Liu et al. 2024; issue 41 item 2): the trajectory of an independent
reference written from the paper's algorithm boxes (Algorithm 1 with the Delayed Nesterov outer
update of Algorithm 2, c = 0, and Dynamic Local Updates), float64; the sync protocol is DiLoCo;
kill + resume bit for bit; a seeded real (gloo) run equals the simulator; the batched
compute equals the loop; bad input one line. The
modeled clock's straggler closed form and the push bytes are in test_modeled_clock.py."""

from __future__ import annotations

import copy
import heapq
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    CHECKPOINTED,
    DATA,
    LR,
    STEPS,
    TOL64,
    compose_config,
    default_dtype,
    final_params,
    kill_and_resume,
    max_diff,
    metric_lines,
    reference_model,
    refused_before_start,
    run_ours64,
    same,
    shard_batches,
    untimed,
)
from omegaconf import OmegaConf

from dpresearch.algorithms.async_local_sgd import AsyncLocalOptions
from dpresearch.config.validate import ConfigError, validate
from dpresearch.data.synthetic import make_synthetic
from dpresearch.run.checkpoint_files import latest_checkpoint
from dpresearch.run.trainer import InjectedFailure
from dpresearch.train import train

ALSGD = "algorithm=async_local_sgd"
C, SLOW, SLOWDOWN = 0.25, 2, 3.0  # worker 2 three times slower; every time exact in binary
OUTER_LR, BETA, INNER_MOMENTUM = 0.7, 0.9, 0.9


def reference(workers: int, h: int, n: int, dylu: bool, steps: int) -> dict:
    """The paper's algorithm, written against torch alone, float64: every worker runs H_w
    local SGD steps (momentum kept across its rounds) from the parameters it pulled, on its
    next DistributedSampler batches; the earliest arrival (ties: lower worker id) pushes
    Δ = x_start − x_end; the server applies Algorithm 2 (Delayed Nesterov, c = 0):

        buf ← buf + Δ;  every N-th arrival: m ← β·m + buf/N, θ ← θ − ε·(β·m + Δ/N), buf ← 0;
        otherwise θ ← θ − ε·Δ/N

    and the worker pulls θ. Stops before a round that would pass `steps` local steps."""
    with default_dtype(torch.float64):
        data = make_synthetic(**DATA)
        server = reference_model(batch_norm=False)
        theta = [p.detach().clone() for p in server.parameters()]
        m = [torch.zeros_like(p) for p in theta]
        buf = [torch.zeros_like(p) for p in theta]
        seconds = [C * (SLOWDOWN if w == SLOW else 1.0) for w in range(workers)]
        speed = [1.0 / s for s in seconds]
        local = [math.floor(h * v / max(speed)) if dylu else h for v in speed]
        models = [copy.deepcopy(server) for _ in range(workers)]
        opts = [torch.optim.SGD(mod.parameters(), lr=LR, momentum=INNER_MOMENTUM) for mod in models]
        streams = [shard_batches(workers, w, DATA["num_train"]) for w in range(workers)]
        # The transfers (pull + push, ≈ 50 µs on 10 GbE) only order equal compute times: the
        # worker with fewer rounds arrives first; 1e-6 a round gives the same order.
        transfer = 1e-6
        pulled = {w: [t.clone() for t in theta] for w in range(workers)}
        events = [(local[w] * seconds[w] + transfer, w) for w in range(workers)]
        heapq.heapify(events)
        done = arrivals = 0
        while True:
            now, w = heapq.heappop(events)
            if done + local[w] > steps:
                break
            model = models[w]
            with torch.no_grad():
                for p, t in zip(model.parameters(), pulled[w], strict=True):
                    p.copy_(t)
            for _ in range(local[w]):
                x, y = data.train_batch(next(streams[w]))
                opts[w].zero_grad()
                F.cross_entropy(model(x.to(torch.float64)), y).backward()
                opts[w].step()
            done += local[w]
            delta = [s - p.detach() for s, p in zip(pulled[w], model.parameters(), strict=True)]
            for i, d in enumerate(delta):
                buf[i] += d
                if (arrivals + 1) % n == 0:
                    m[i] = BETA * m[i] + buf[i] / n
                    theta[i] = theta[i] - OUTER_LR * (BETA * m[i] + d / n)
                    buf[i] = torch.zeros_like(d)
                else:
                    theta[i] = theta[i] - OUTER_LR * d / n
            arrivals += 1
            pulled[w] = [t.clone() for t in theta]
            heapq.heappush(events, (now + local[w] * seconds[w] + transfer, w))
        names = [name for name, _ in server.named_parameters()]
        return dict(zip(names, theta, strict=True))


def ours(small_config, workers: int, h: int, n: int, dylu: bool, steps: int) -> tuple:
    return run_ours64(
        small_config,
        f"workers={workers}",
        ALSGD,
        f"algorithm.period={h}",
        f"algorithm.delayed_nesterov={n}",
        f"algorithm.dynamic_local_updates={str(dylu).lower()}",
        f"optimizer.momentum={INNER_MOMENTUM}",
        f"async.compute_s={C}",
        f"async.slow_workers=[{SLOW}]",
        f"async.slowdown={SLOWDOWN}",
        f"train.steps={steps}",
    )


@pytest.mark.parametrize(
    "n, dylu",
    [(1, False), (3, False), (2, True)],
    ids=["nesterov", "delayed_nesterov", "delayed_nesterov_dylu"],
)
def test_trajectory_equals_the_papers_algorithm(small_config, n, dylu, one_thread):
    """Flat rows, the server's outer optimizer (Delayed Nesterov as θ_s's Nesterov step every
    N arrivals) against the boxes written per tensor: float64, to 1e-9."""
    workers, h, steps = 3, 3, 40
    got, summary = ours(small_config, workers, h, n, dylu, steps)
    expected = reference(workers, h, n, dylu, steps)
    assert max_diff(got, expected) <= TOL64
    # the options matter: plain Nesterov on every arrival, H for every worker
    assert max_diff(got, reference(workers, h, 1 if n > 1 else 2, False, steps)) > 1e-3
    assert summary["async/staleness_mean_run"] > 0  # stale pushes were applied


def test_sync_protocol_is_diloco(small_config, one_thread):
    """protocol=sync: the server averages the K pseudo-gradients of a round and steps its
    outer Nesterov, every worker restarts from it — DiLoCo (local SGD, period H, outer
    Nesterov), whatever the speeds. Float64: the barrier's mean and the allreduce's differ in
    rounding only."""
    h, k = 4, 4
    common = ["optimizer.momentum=0.9", f"workers={k}"]
    diloco, _ = run_ours64(
        small_config, *common, "algorithm=local_sgd", f"algorithm.period={h}", "outer=nesterov"
    )
    barrier, summary = run_ours64(
        small_config,
        *common,
        ALSGD,
        f"algorithm.period={h}",
        "protocol=sync",
        "async.speed=exponential",
        "async.slow_workers=[1]",
        "async.slowdown=4",
        f"train.steps={k * STEPS}",
    )
    assert max_diff(diloco, barrier) <= TOL64
    assert summary["async/updates"] == STEPS // h
    assert summary["async/tau_histogram"] == [k * STEPS // h]  # τ = 0 for every Δ
    initial, _ = run_ours64(small_config, *common, "train.steps=1")
    assert max_diff(diloco, initial) > 1e-3  # it really trained


RANDOM = [
    ALSGD,
    "workers=4",
    "algorithm.period=4",
    "algorithm.delayed_nesterov=2",
    "algorithm.dynamic_local_updates=true",
    "optimizer.momentum=0.9",
    "async.speed=lognormal",
    "async.straggler_prob=0.2",
    "async.slow_workers=[3]",
    "async.slowdown=2.5",
]


def test_kill_and_resume_bit_for_bit(tmp_path):
    """The checkpoint resumed (step 30) lands inside a round (H = 4, worker 3's H_3 = 1) and
    inside a window of Delayed Nesterov: the current worker's start and steps left, the
    window, the clock and the speed streams continue exactly."""
    args = [*CHECKPOINTED, *RANDOM]
    train(compose_config(*args), tmp_path / "reference")
    resumed = kill_and_resume(tmp_path, args, InjectedFailure)
    probe = tmp_path / "probe"  # the state at step 30, which the resumed run started from
    train(compose_config(*args, "train.steps=31", "train.checkpoint_every=30"), probe)
    saved = torch.load(probe / "checkpoints" / "step_30.pt", weights_only=False)
    state = saved["states"][0]["algorithm"]
    assert state["local"]["left"] > 0 and state["server"]["version"] % 2 == 1
    assert state["local"]["window"]["sum"].abs().sum() > 0
    assert same(final_params(resumed), final_params(tmp_path / "reference"))
    lines = [untimed(m) for m in metric_lines(resumed)]
    assert lines == [untimed(m) for m in metric_lines(tmp_path / "reference")]
    assert metric_lines(resumed)[-1]["async/updates"] > 10
    assert metric_lines(resumed)[-1]["outer/momentum_norm"] > 0  # (Delayed Nesterov's θ_s)


def test_batched_compute_equals_the_loop(tmp_path):
    """train.batched_workers=true computes the one planned row batched: the same run."""
    args = [*CHECKPOINTED, *RANDOM, "train.steps=30"]
    runs = {}
    for mode in ("false", "true"):
        run_dir: Path = tmp_path / mode
        train(compose_config(*args, f"train.batched_workers={mode}"), run_dir)
        runs[mode] = final_params(run_dir)
    assert max_diff(runs["false"], runs["true"]) <= 1e-6


@pytest.mark.slow
@pytest.mark.distributed
def test_seeded_real_run_equals_the_simulator(tmp_path):
    """A server and 3 gloo workers in the event clock's order compute what the simulator
    computes, bit for bit: each worker's H_w local steps on its own rank, Δ pushed through
    top-k with error feedback, Delayed Nesterov on the server; checkpoints every 7 steps land
    inside rounds (the server holds the round's push; the others' pushes in flight are
    received meanwhile)."""
    args = [
        *CHECKPOINTED,
        *RANDOM,
        "workers=3",
        "async.slow_workers=[2]",
        "async.order=seeded",
        "backend.threads=1",
        "train.steps=40",
        "train.checkpoint_every=7",
        "compressor=topk",  # Δ compressed, each worker's EF14 memory on its own rank
        "compressor.ratio=0.2",
        "error_feedback=ef14",
        "train.grad_clip=0.5",  # each local step's gradient, on its worker's rank
    ]
    simulated = train(compose_config(*args), tmp_path / "sim")
    real = train(compose_config(*args, "backend=gloo"), tmp_path / "real")
    assert same(final_params(tmp_path / "sim"), final_params(tmp_path / "real"))
    assert real["async"]["mode"] == "real processes"
    assert real["async/tau_histogram"] == simulated["async/tau_histogram"]
    # the server counts a push as it receives it (a round's first step, or in flight at a
    # checkpoint), the simulator as it is sent (the round's last step): at the end, the rounds
    # still open on real ranks were pushed (at most one per worker), the simulator's not
    extra = (real["comm/bytes"] - simulated["comm/bytes"]) * 3 / real["async"]["push_bytes"]
    assert extra == pytest.approx(round(extra), abs=1e-9) and 0 <= round(extra) <= 3
    keys = ("step", "async/updates", "time/simulated_s")
    assert [[m.get(k) for k in keys] for m in metric_lines(tmp_path / "real")] == [
        [m.get(k) for k in keys] for m in metric_lines(tmp_path / "sim")
    ]


@pytest.mark.slow
@pytest.mark.distributed
def test_real_run_that_failed_resumes_to_the_simulated_result(tmp_path):
    """Worker 1 fails at its 15th local step on its own rank (the job ends); `train.resume=auto`
    continues from the server's last checkpoint (pushes held included) and ends where the
    uninterrupted simulated run ends, bit for bit."""
    args = [
        *CHECKPOINTED,
        *RANDOM,
        "workers=3",
        "async.slow_workers=[2]",
        "async.order=seeded",
        "backend.threads=1",
        "train.checkpoint_every=10",
    ]
    train(compose_config(*args), tmp_path / "sim")
    real = tmp_path / "real"
    with pytest.raises(Exception):  # noqa: B017 (the launcher's: the rank's failure inside)
        train(
            compose_config(*args, "backend=gloo", "debug.fail_worker=1", "debug.fail_at_step=15"),
            real,
        )
    assert latest_checkpoint(real) is not None and not (real / "summary.json").exists()
    summary = train(compose_config(*args, "backend=gloo", "train.resume=auto"), real)
    assert summary["status"] == "finished"
    assert same(final_params(tmp_path / "sim"), final_params(real))


def test_yaml_defaults_are_the_options_defaults():
    node = compose_config(ALSGD).algorithm
    assert AsyncLocalOptions.from_node(node) == AsyncLocalOptions()
    assert OmegaConf.to_container(node.outer_optimizer) == OmegaConf.to_container(
        compose_config("optimizer=outer_nesterov").optimizer
    )


def test_workers_clip_their_own_steps_on_real_ranks():
    """`train.grad_clip` clips each local step's gradient on its worker's rank (the pushed Δ is
    not a gradient): compressed pushes on gloo are accepted, unlike asynchronous SGD's."""
    real = ["backend=gloo", "train.grad_clip=1.0", "compressor=topk", "error_feedback=ef14"]
    validate(compose_config(ALSGD, *real))
    with pytest.raises(ConfigError, match="clips the gradient the server receives"):
        validate(compose_config("algorithm=async_sgd", *real))


BAD = [
    (["algorithm.period=0"], "algorithm.period=0: must be a whole number >= 1"),
    (["algorithm.delayed_nesterov=0"], "algorithm.delayed_nesterov=0"),
    (["algorithm.dynamic_local_updates=2"], "algorithm.dynamic_local_updates=2"),
    (["async.delay=2"], "drop async.delay"),
    (["async.delay_compensation=0.1"], "set async.delay_compensation=0"),
    (["async.speed=fast"], "async.speed=fast is not an option"),
]


@pytest.mark.parametrize("args, fragment", BAD)
def test_bad_input_is_one_line(args, fragment, tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        validate(compose_config(ALSGD, *args))
    refused_before_start([ALSGD, *args], fragment, tmp_path, monkeypatch, capsys)
