"""Gradient clipping by global L2 norm (`train.grad_clip`, issue 40 item 1) against
`torch.nn.utils.clip_grad_norm_`, and the metric `train/grad_norm`.

The conventions tested (docs/ARCHITECTURE.md): a worker stepping on its own gradient (local
SGD, DiLoCo's inner steps) clips that gradient; synchronous SGD clips the averaged gradient, as
DDP + clip_grad_norm_; with a compressor and error feedback each worker clips its own gradient
before the error-feedback memory compensates it and the codec encodes it. The references are
written against torch (plain SGD on DistributedSampler shards, `clip_grad_norm_` on a model's
parameters), in float64, compared to `helpers.TOL64`; the clipping threshold is below every
step's norm here, so every step clips.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    CHECKPOINTED,
    DATA,
    LR,
    SHARED,
    STEPS,
    TOL,
    TOL64,
    compose_config,
    default_dtype,
    final_params,
    kill_and_resume,
    make_synthetic,
    max_diff,
    metric_lines,
    reference_model,
    run_main,
    run_ours,
    run_ours64,
    same,
    shard_batches,
    trainer_for,
    untimed,
)

from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.compress import build_reducer, param_layout
from dpresearch.grad_clip import GradClip
from dpresearch.replicas import Replicas
from dpresearch.run.trainer import InjectedFailure
from dpresearch.train import train

F64 = torch.float64
WORKS = SHARED / "data" / "shakespeare" / "works"
CLIP = 0.3  # below the MLP's gradient norms (0.5-0.9) on these batches: every step clips
WINDOW = 5  # SMALL's train.log_every: the last metrics row averages steps 16-20 ...
EVAL = "train.eval_every=20"  # ... with no evaluation row (an epoch's end) between
TOPK = ["compressor=topk", "compressor.ratio=0.1", "error_feedback=ef14"]


def _clip(model: torch.nn.Module) -> float:
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))


def _data_and_model():
    with default_dtype(F64):
        return make_synthetic(**DATA), reference_model(batch_norm=False)


def _step(model, data, indices) -> None:
    x, y = data.train_batch(indices)
    model.zero_grad(set_to_none=False)  # (a replica's .grad: a view of its row)
    F.cross_entropy(model(x.to(F64)), y).backward()


def sync_reference(k: int) -> tuple[dict, list[float]]:
    """Plain SGD on each global batch (the K shards' batches together: the mean of the K
    workers' gradients), clipped by clip_grad_norm_; the final state and each step's
    pre-clip norm."""
    data, model = _data_and_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    streams = [shard_batches(k, r, DATA["num_train"]) for r in range(k)]
    norms = []
    for _ in range(STEPS):
        _step(model, data, torch.cat([next(s) for s in streams]))
        norms.append(_clip(model))
        opt.step()
    return model.state_dict(), norms


def local_reference(k: int, period: int, outer: bool) -> tuple[dict, list[float]]:
    """K models, each stepping plain SGD on its own shard's batch clipped by clip_grad_norm_
    over its own parameters; every `period` steps their average (local SGD) or DiLoCo's outer
    step (SGD, lr 0.7, Nesterov momentum 0.9 on θ − mean) and a restart from θ. The final
    model (the average, or θ) and each step's mean over workers of the pre-clip norms."""
    data, model = _data_and_model()
    models = [copy.deepcopy(model) for _ in range(k)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    anchor = copy.deepcopy(model)
    outer_opt = torch.optim.SGD(anchor.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    streams = [shard_batches(k, r, DATA["num_train"]) for r in range(k)]
    norms = []
    for step in range(STEPS):
        each = []
        for m, opt, stream in zip(models, opts, streams, strict=True):
            _step(m, data, next(stream))
            each.append(_clip(m))
            opt.step()
        norms.append(sum(each) / k)
        if (step + 1) % period:
            continue
        with torch.no_grad():
            for ps in zip(anchor.parameters(), *(m.parameters() for m in models), strict=True):
                mean = torch.stack([p for p in ps[1:]]).mean(0)
                if outer:
                    ps[0].grad = ps[0] - mean
                else:
                    ps[0].copy_(mean)
            if outer:
                outer_opt.step()
            for m in models:
                m.load_state_dict(anchor.state_dict())
    return anchor.state_dict(), norms


def compressed_reference(k: int, after: bool = False) -> tuple[dict, list[float]]:
    """Synchronous SGD through the configuration's reducer (top-k 10 % + EF14, tested against
    DDP's hook elsewhere), each worker's gradient clipped by clip_grad_norm_ over its replica's
    parameters before the reduce (`after`: the decoded average clipped instead)."""
    cfg = compose_config(f"workers={k}", *TOPK)
    data, model = _data_and_model()
    replicas = Replicas(model, k, torch.device("cpu"))
    comm = SimulatedCommunicator(k, NetworkModel.preset("10gbe"))
    alg = cfg.algorithm
    reducer = build_reducer(
        alg.compressor,
        alg.error_feedback,
        comm,
        param_layout(model),
        alg.seed,
        granularity=alg.granularity,
        bucket_mb=alg.bucket_mb,
        collective=alg.collective,
        dtype=F64,
        device=torch.device("cpu"),
    )
    streams = [shard_batches(k, r, DATA["num_train"]) for r in range(k)]
    norms = []
    for step in range(STEPS):
        each = []
        for replica, stream in zip(replicas.models, streams, strict=True):
            _step(replica, data, next(stream))
            if not after:
                each.append(_clip(replica))
        reducer.reduce(replicas.grads, step)
        if after:
            each = [_clip(replica) for replica in replicas.models]
        norms.append(sum(each) / k)
        with torch.no_grad():
            replicas.params.sub_(LR * replicas.grads)
    final = copy.deepcopy(model)
    replicas.load_into(final, replicas.params[0], replicas.buffers[0])
    return final.state_dict(), norms


def logged_norm(norms: list[float]) -> float:
    """`train/grad_norm` of the last metrics row: the mean over its window's steps."""
    return sum(norms[-WINDOW:]) / WINDOW


CASES = {
    "one worker": (["workers=1"], lambda: sync_reference(1)),
    "sync": (["workers=4"], lambda: sync_reference(4)),
    "local SGD": (["workers=4", "algorithm=local_sgd", "algorithm.period=5"],
                  lambda: local_reference(4, 5, outer=False)),
    "DiLoCo": (["workers=4", "algorithm=local_sgd", "algorithm.period=5", "outer=nesterov"],
               lambda: local_reference(4, 5, outer=True)),
    "topk + EF14": (["workers=4", *TOPK], lambda: compressed_reference(4)),
    # one worker pushing to a parameter server: sequential SGD, its pushes clipped
    "async SGD": (["workers=1", "algorithm=async_sgd"], lambda: sync_reference(1)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_clipping_matches_clip_grad_norm(small_config, case, one_thread):
    """Ours in float64 = the torch reference to TOL64, parameters and `train/grad_norm`; the
    clipping changed the trajectory."""
    args, reference = CASES[case]
    ours, summary = run_ours64(small_config, *args, f"train.grad_clip={CLIP}", EVAL)
    expected, norms = reference()
    unclipped, plain = run_ours64(small_config, *args)
    assert min(norms) > CLIP  # every step clipped
    assert max_diff(ours, unclipped) > 1e-3
    assert "train/grad_norm" not in plain  # off: nothing measured
    assert max_diff(ours, expected) <= TOL64
    assert summary["train/grad_norm"] == pytest.approx(logged_norm(norms), rel=1e-12)


def test_compressed_sync_clips_before_the_error_feedback(small_config, one_thread):
    """The placement matters and is the documented one: clipping each worker's gradient
    before compression is not clipping the decoded average."""
    ours, _ = run_ours64(small_config, "workers=4", *TOPK, f"train.grad_clip={CLIP}")
    after, _ = compressed_reference(4, after=True)
    assert max_diff(ours, after) > 1e-4


def test_rows_clip_as_clip_grad_norm_each_worker():
    """`GradClip` on the `[K, D]` rows = clip_grad_norm_ on each replica's parameters (float64,
    norms above and below the threshold, one row alone); the pre-clip norms are kept."""
    with default_dtype(F64):
        model = reference_model(batch_norm=False)
    replicas = Replicas(model, 3, torch.device("cpu"))
    torch.manual_seed(1)
    replicas.grads.copy_(torch.randn_like(replicas.grads) * torch.tensor([[0.01], [1.0], [5.0]]))
    clones = [copy.deepcopy(m) for m in replicas.models]
    for c, g in zip(clones, replicas.grads, strict=True):
        offset = 0
        for p in c.parameters():
            p.grad = g[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
    expected_norms = [float(torch.nn.utils.clip_grad_norm_(c.parameters(), 1.0)) for c in clones]
    clip = GradClip(1.0, 3, torch.device("cpu"))
    clip(replicas.grads)
    for c, g in zip(clones, replicas.grads, strict=True):
        flat = torch.cat([p.grad.reshape(-1) for p in c.parameters()])
        assert (flat - g).abs().max() <= 1e-15
    window = torch.zeros(3, 2, dtype=F64)
    clip.drain(window)
    assert window[:, 0].tolist() == pytest.approx(expected_norms, rel=1e-14)
    assert window[:, 1].tolist() == [1.0, 1.0, 1.0]
    before = replicas.grads.clone()
    replicas.grads[2].mul_(10)  # row 2 alone: the others untouched
    clip(replicas.grads, 2)
    assert torch.equal(replicas.grads[:2], before[:2])
    assert float(replicas.grads[2].norm()) == pytest.approx(1.0, rel=1e-6)
    clip.drain(window)
    assert window[:, 1].tolist() == [0.0, 0.0, 1.0]
    measure = GradClip(math.inf, 3, torch.device("cpu"))  # train.grad_clip=inf: measure only
    before = replicas.grads.mul(100)
    replicas.grads.copy_(before)
    measure(replicas.grads)
    assert torch.equal(replicas.grads, before)
    measure.drain(window)
    assert window[:, 0].tolist() == pytest.approx(before.norm(dim=1).tolist(), rel=1e-14)


@pytest.mark.parametrize("way", ["stacked", "vmap"])
def test_batched_workers_equal_the_loop(way, one_thread):
    """Local SGD with clipping on 4 workers: the stacked and vmapped rows = the loop's, in
    float64 (batched kernels only add in another order)."""
    args = [
        *CHECKPOINTED,
        "workers=4",
        "train.steps=20",
        "algorithm=local_sgd",
        "algorithm.period=5",
        f"train.grad_clip={CLIP}",
    ]
    rows = {}
    for mode in ("false", way):
        trainer = trainer_for(*args, mode=mode, dtype=F64)
        if mode != "false":
            assert trainer.built.compute.batched is not None
        trainer.run()
        rows[mode] = trainer.replicas.params.clone()
    assert (rows["false"] - rows[way]).abs().max() <= TOL64


@pytest.mark.parametrize(
    "case",
    [
        ["algorithm=local_sgd", "algorithm.period=4"],
        TOPK,
        pytest.param(["algorithm=adpsgd"], id="adpsgd"),
    ],
    ids=["local_sgd", "topk_ef14", "adpsgd"],
)
def test_killed_and_resumed_equals_uninterrupted(case, tmp_path, one_thread):
    """Resume with clipping continues bit for bit, `train/grad_norm` rows included: the window
    of pre-clip norms is in the checkpoint (the row of steps 29-35 straddles the checkpoint
    at step 30, the kill at 35)."""
    args = [*CHECKPOINTED, "workers=4", "train.log_every=7", f"train.grad_clip={CLIP}", *case]
    reference = tmp_path / "reference"
    train(compose_config(*args), reference)
    resumed = kill_and_resume(tmp_path, args, InjectedFailure)
    assert same(final_params(resumed), final_params(reference))
    lines = metric_lines(resumed)
    assert [untimed(m) for m in lines] == [untimed(m) for m in metric_lines(reference)]
    assert [m["step"] for m in lines][:6] == [7, 14, 20, 21, 28, 35]
    assert all(math.isfinite(m["train/grad_norm"]) for m in lines)


@pytest.mark.distributed
def test_simulated_equals_gloo(small_config, tmp_path):
    """Clipping before top-k + EF14 on 2 gloo ranks = 2 simulated workers (float32, the CLI on
    both sides: a sum of two is the same in any order), metrics rows too."""
    args = ["workers=2", *TOPK, f"train.grad_clip={CLIP}"]
    simulated = run_ours(small_config, tmp_path, "sim", *args)
    gloo = run_ours(small_config, tmp_path, "gloo", *args, "backend=gloo")
    assert max_diff(simulated, gloo) <= TOL
    norms = [[m["train/grad_norm"] for m in metric_lines(tmp_path / r)] for r in ("sim", "gloo")]
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)


@pytest.mark.slow  # (five processes)
@pytest.mark.distributed
def test_seeded_real_async_equals_the_simulator(tmp_path):
    """Asynchronous SGD on 4 gloo workers and a server, the event clock's order driving it:
    the server clipping each uncompressed push it receives = the simulator clipping the
    pushing worker's row before its push, parameters and `train/grad_norm` rows."""
    args = [
        *CHECKPOINTED,
        "workers=4",
        "algorithm=async_sgd",
        "async.speed=exponential",
        "async.order=seeded",
        "train.steps=24",
        "train.log_every=6",
        "backend.threads=1",
        f"train.grad_clip={CLIP}",
    ]
    train(compose_config(*args), tmp_path / "sim")
    train(compose_config(*args, "backend=gloo"), tmp_path / "real")
    assert same(final_params(tmp_path / "sim"), final_params(tmp_path / "real"))
    norms = [[m["train/grad_norm"] for m in metric_lines(tmp_path / r)] for r in ("sim", "real")]
    assert len(norms[0]) == 5 and norms[0] == norms[1]  # steps 6, 12, 18, 20 (evaluated), 24


def test_language_model_data_clip_at_one_by_default():
    """`data=shakespeare` / `data=text` set nanoGPT's 1.0; the other data sets leave it off."""
    assert compose_config("data=shakespeare", "model=gpt_tiny").train.grad_clip == 1.0
    assert compose_config("data=text", "data.root=x.txt").train.grad_clip == 1.0
    assert compose_config().train.grad_clip is None
    assert compose_config("data=shakespeare", "train.grad_clip=null").train.grad_clip is None


BAD = {
    "negative": (["train.grad_clip=-1"], "must be a positive number"),
    "zero": (["train.grad_clip=0"], "must be a positive number"),
    "nan": (["train.grad_clip=nan"], "must be a positive number"),
    "not a number": (["train.grad_clip=abc"], "train.grad_clip"),
    "compressed Adam": (["optimizer=onebit_adam", "train.grad_clip=1"], "train.grad_clip=null"),
    "compressed async on gloo": (["algorithm=async_sgd", "backend=gloo", "compressor=topk",
                                  "train.grad_clip=1"], "the pushes must be uncompressed"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_grad_clip_is_one_line(case, tmp_path, monkeypatch, capsys):
    args, fragment = BAD[case]
    code, _, err = run_main(["data.num_train=256", *args], tmp_path, monkeypatch, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]


@pytest.mark.slow  # (the corpus loaded; tests/test_lm_workload.py runs the GPT clipped at 1.0)
@pytest.mark.skipif(not WORKS.is_dir(), reason=f"no Shakespeare corpus at {WORKS}")
def test_gpt_on_shakespeare_logs_the_grad_norm(tmp_path, one_thread):
    """The acceptance command, `data=shakespeare model=gpt_tiny train.grad_clip=1.0` (DiLoCo
    over 2 workers here), logs `train/grad_norm` in every metrics row."""
    args = ["data=shakespeare", f"data.root={WORKS}", "model=gpt_tiny", "model.block_size=16",
            "data.eval_tokens=256", "data.sample_tokens=0", "workers=2", "train.batch_size=4",
            "train.steps=6", "train.log_every=2", "train.progress=false", "backend.threads=1",
            "algorithm=local_sgd", "algorithm.period=3", "outer=nesterov",
            "train.grad_clip=1.0"]  # fmt: skip
    train(compose_config(*args), tmp_path / "run")
    lines = metric_lines(tmp_path / "run")
    assert [m["step"] for m in lines] == [2, 4, 6]
    assert all(0 < m["train/grad_norm"] < math.inf for m in lines)
