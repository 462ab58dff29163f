"""Outer optimizers over a base algorithm: SlowMo, DiLoCo, Streaming DiLoCo (issue 19).

A. outer SGD (lr 1, no momentum) is the base algorithm itself; DiLoCo with H = 1 and outer lr 1
   is synchronous SGD; an independent DiLoCo (Algorithm 1 of the paper) written here equals ours
   on an MLP and on ResNet-20 with BatchNorm; SlowMo's update as the paper writes it.
B. Streaming DiLoCo with F = 1, τ = 0 is DiLoCo; an independent Streaming DiLoCo written here
   equals ours (F = 2, τ = 2, α = 0.5); the bytes of each step are the fragments'; simulated
   workers equal 4 gloo processes.
E. Compressed pseudo-gradients: identity with EF14 is the uncompressed outer step bit for bit;
   top-k + EF14 against top-k written here (memory + sent = Δ + previous memory, exact bytes);
   every compressor of the library on Δ with its documented bytes; bit for bit on 4 gloo
   processes; killed (also kill -9) and resumed exactly.
Bad input: one line naming the fix, before any worker starts.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import SMALL_512 as QUICK
from helpers import (
    SUBSET,
    SYNTHETIC_SMALL,
    TOL64,
    build_trainer,
    compose_config,
    default_dtype,
    gap,
    reference_workers,
    run_cli,
)
from helpers import finished_run as run
from hydra.utils import instantiate

from dpresearch.algorithms.outer.fragments import Schedule, blocks_of, split
from dpresearch.comm.ledger import CommOp
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.run.build import network_model
from dpresearch.run.checkpoint_files import latest_checkpoint
from dpresearch.run.trainer import InjectedFailure, Trainer
from dpresearch.train import train

# Every equivalence below compares two *different* computations of the same math (an outer
# step against the base algorithm's own averaging, ours against a reference written here, a
# ring allreduce against a sum in worker order): in float32 they differ by reorderings that
# depend on the CPU's kernels, so they run in float64 (`helpers.TOL64`, `dtype=F64`). The
# bit-for-bit ones (torch.equal, tol 0.0) are the same operations in the same order.
F64 = torch.float64
LOCAL = ["algorithm=local_sgd", "optimizer.momentum=0.9"]


def spread(rows: torch.Tensor) -> float:
    return gap(rows, rows.mean(0, keepdim=True).expand_as(rows))


# -- A: the base algorithm, synchronous SGD, DiLoCo's Algorithm 1, SlowMo ----------------------
def test_outer_sgd_lr_1_is_local_sgd():
    base = run(*LOCAL, "algorithm.period=8", "train.steps=40", "workers=4", dtype=F64)
    outer = run(*LOCAL, "algorithm.period=8", "train.steps=40", "workers=4", "outer=sgd", dtype=F64)
    assert gap(base.replicas.params, outer.replicas.params) <= TOL64
    assert gap(base.replicas.params[0], initial(base.cfg, F64)) > 1e-3  # it trained
    # the same traffic: one allreduce of the parameters per period
    assert outer.summary["comm/bytes"] == base.summary["comm/bytes"]
    assert outer.summary["outer/rounds"] == 5


def test_outer_sgd_lr_1_over_sgp_is_sgp_with_periodic_exact_averaging():
    """SlowMo with α = 1, β = 0 is the base algorithm with an exact average every H steps. On
    the one-peer exponential graph SGP is D-PSGD (adapt then combine), whose Gossip-PGA option
    averages exactly every H steps: the same algorithm, written apart."""
    graph = ["topology=one_peer_exponential", "optimizer.momentum=0.9", "train.steps=40"]
    outer = run("algorithm=sgp", *graph, "workers=4", "outer=sgd", "outer.period=8", dtype=F64)
    pga = run(
        "algorithm=dpsgd",
        "algorithm.order=adapt_then_combine",
        "algorithm.global_average_every=8",
        *graph,
        "workers=4",
        dtype=F64,
    )
    assert gap(outer.replicas.params, pga.replicas.params) <= TOL64
    alone = run("algorithm=sgp", *graph, "workers=4", dtype=F64)
    assert gap(outer.replicas.params, alone.replicas.params) > 1e-4  # the averages matter


def test_the_exact_average_over_push_sum_is_its_consensus():
    """On a star with uniform weights the push-sum weights drift from 1: the outer step's mean
    is SGP's consensus Σx/Σw (its numerators' mean), not the mean of the de-biased models."""
    cfg = compose_config(
        *QUICK,
        "algorithm=sgp",
        "topology=star",
        "topology.weights=uniform",
        "workers=4",
        "outer=sgd",
        "outer.period=4",
        "train.steps=12",
    )
    torch.set_num_threads(1)
    trainer = build_trainer(cfg, SimulatedCommunicator(4, network_model(cfg)), F64)
    algorithm, seen = trainer.algorithm, []
    merge = algorithm._merge

    def recorded(f: int) -> None:
        weights = algorithm.base.ps_weight.clone()
        consensus = algorithm.base.consensus()[0]
        plain = trainer.replicas.params.mean(0)
        merge(f)
        seen.append((weights, consensus, plain, algorithm.anchor.params[0].clone()))

    algorithm._merge = recorded
    trainer.run()
    assert len(seen) == 3
    for weights, consensus, plain, anchor in seen:
        assert gap(weights, torch.ones_like(weights)) > 1e-3  # the weights really differ
        assert gap(anchor, consensus) <= TOL64 and gap(anchor, plain) > 1e-6
    assert torch.equal(algorithm.base.ps_weight, torch.ones_like(algorithm.base.ps_weight))


def test_outer_sgd_lr_1_over_dpsgd_is_gossip_pga():
    """D-PSGD with an exact average every H steps (Gossip-PGA, the algorithm's own option)."""
    common = ["algorithm=dpsgd", "optimizer.momentum=0.9", "train.steps=40", "workers=4"]
    outer = run(*common, "outer=sgd", "outer.period=8", dtype=F64)
    pga = run(*common, "algorithm.global_average_every=8", dtype=F64)
    assert gap(outer.replicas.params, pga.replicas.params) <= TOL64


def test_any_base_that_drifts_restarts_every_worker_from_the_anchor():
    """CHOCO-SGD (compressed gossip) under outer Adam: after the last outer step every worker
    holds θ; the outer optimizer is any optimizer node."""
    trainer = run(
        "algorithm=choco",
        "compressor=topk",
        "compressor.ratio=0.25",
        "workers=4",
        "outer=nesterov",
        "optimizer@outer.optimizer=adam",
        "outer.optimizer.lr=0.01",
        "outer.period=5",
        "train.steps=20",
    )
    assert isinstance(trainer.algorithm.outer[0], torch.optim.Adam)
    assert spread(trainer.replicas.params) == 0.0
    assert torch.equal(trainer.replicas.params[0], trainer.algorithm.anchor.params[0])
    assert trainer.summary["outer/rounds"] == 4


def test_diloco_with_h_1_and_outer_lr_1_is_synchronous_sgd():
    """One inner step then averaging: x − η·mean(g), synchronous SGD (plain SGD inner)."""
    common = ["train.steps=40", "workers=4"]
    diloco = run("algorithm=local_sgd", "algorithm.period=1", "outer=sgd", *common, dtype=F64)
    sync = run("algorithm=sync", *common, dtype=F64)
    assert gap(diloco.replicas.params, sync.replicas.params) <= TOL64
    assert spread(diloco.replicas.params) == 0.0


def diloco_reference(cfg, steps: int, period: int, streaming=None):
    """DiLoCo, Algorithm 1 of Douillard et al. (2023), written directly against torch: K
    copies of the model, each on its shard's batches in the IID partitioner's order, H inner
    AdamW steps, Δ = θ − mean_i θ_i, θ ← Nesterov-SGD(θ, Δ), θ_i ← θ. BatchNorm statistics are
    averaged at each outer step. `streaming` = (fragments, overlap, mix, pattern): Streaming DiLoCo
    (Douillard et al. 2025): fragment p's Δ_p taken at steps ≡ ⌊p·H/F⌋ (mod H), its outer step
    τ steps later, then θ_i,p ← (1 − α)·θ̃_p + α·θ_i,p. In float64, as `run(dtype=F64)`
    builds ours: data and models made under torch's default dtype float64, inputs cast."""
    with default_dtype(F64):
        return _diloco_reference(cfg, steps, period, streaming)


def _diloco_reference(cfg, steps: int, period: int, streaming=None):
    batch = cfg.train.batch_size
    data, partitioner, per_epoch, global_model, workers, inner = reference_workers(cfg)
    fragments, overlap, mix, pattern = streaming or (1, 0, 0.0, "sequential")
    blocks = split(blocks_of(global_model), fragments, pattern)
    names = [n for n, p in global_model.named_parameters()]
    groups = [[names[t] for t in frag.tensors] for frag in blocks]
    params = dict(global_model.named_parameters())
    outer = [
        torch.optim.SGD([params[n] for n in g], lr=0.7, momentum=0.9, nesterov=True) for g in groups
    ]
    buffer_names = [n for n, b in global_model.named_buffers() if b.is_floating_point()]
    pending = {}
    for step in range(steps):
        for w, (model, opt) in enumerate(zip(workers, inner, strict=True)):
            epoch, pos = divmod(step, per_epoch)
            idx = partitioner.epoch_indices(w, epoch)[pos * batch : (pos + 1) * batch]
            x, y = data.train_batch(idx)
            x = x.to(F64)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        done = step + 1
        for p, group in enumerate(groups):
            if done >= 1 and (done - (p * period) // fragments) % period == 0:
                with torch.no_grad():
                    delta = {n: mean_of(workers, "named_parameters", n, params[n]) for n in group}
                    owners = {n.rsplit(".", 1)[0] for n in group}
                    stats = {
                        b: mean_of(workers, "named_buffers", b)
                        for b in buffer_names
                        if b.rsplit(".", 1)[0] in owners
                    }
                pending[p] = (done + overlap, delta, stats)
        for p in list(pending):
            at, delta, stats = pending[p]
            if at != done:
                continue
            del pending[p]
            for n in groups[p]:
                params[n].grad = delta[n].clone()
            outer[p].step()
            with torch.no_grad():
                for m in workers:
                    mp, mb = dict(m.named_parameters()), dict(m.named_buffers())
                    for n in groups[p]:
                        mp[n].copy_((1 - mix) * params[n] + mix * mp[n] if mix else params[n])
                    for b, value in stats.items():
                        mb[b].copy_((1 - mix) * value + mix * mb[b] if mix else value)
    return workers


def mean_of(models, kind: str, name: str, minus: torch.Tensor | None = None) -> torch.Tensor:
    """(1/K)·Σ_i v_i over the models' tensor `name` (Σ_i (minus − v_i) with `minus`), summed
    in worker order then divided, as an allreduce in worker order does (in float64 the order
    matters far less than in float32, but ResNet-20 at batch 4 amplifies any rounding)."""
    values = [dict(getattr(m, kind)())[name] for m in models]
    if minus is not None:
        values = [minus - v for v in values]
    return torch.stack(values).sum(0) / len(models)


def ours_against_reference(args: list[str], period: int, streaming=None):
    trainer = run(*args, dtype=F64)
    reference = diloco_reference(trainer.cfg, trainer.total_steps, period, streaming)
    assert trainer.replicas.params.dtype == F64
    for w, model in enumerate(reference):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert gap(trainer.replicas.params[w], flat) <= TOL64, w
        floats = [b.reshape(-1) for b in model.buffers() if b.is_floating_point()]
        if floats:
            assert gap(trainer.replicas.buffers[w], torch.cat(floats)) <= TOL64, w
    return trainer


DILOCO = [
    "algorithm=local_sgd",
    "algorithm.period=8",
    "outer=nesterov",
    "optimizer=adamw",
    "optimizer.lr=0.003",
    "optimizer.exclude_bn_bias_from_weight_decay=false",
    "workers=4",
    "train.steps=40",
]


def test_diloco_equals_algorithm_1_of_the_paper_mlp():
    trainer = ours_against_reference([*DILOCO, "model.hidden=[32,32]"], 8)
    assert trainer.summary["outer/rounds"] == 5
    assert spread(trainer.replicas.params) == 0.0  # every worker restarted from θ


@pytest.mark.slow  # the default suite: the MLP above; BatchNorm buffers in the gloo test below
@pytest.mark.skipif(not SUBSET.is_dir(), reason=f"no CIFAR subset at {SUBSET}")
def test_diloco_equals_algorithm_1_of_the_paper_resnet20_batchnorm():
    diloco = [a for a in DILOCO if not a.startswith("optimizer")]  # the recipe's Nesterov SGD
    args = [
        *diloco,
        "experiment=resnet20_cifar10_subset",
        f"data.root={SUBSET}",
        "data.subset=128",
        "data.augment=false",
        "model.width=8",
        "train.batch_size=4",
        "train.eval_batch_size=1024",
        "train.eval_every=40",
        "train.log_every=40",
        "schedule=constant",
        "schedule.warmup_epochs=0",
        "optimizer.exclude_bn_bias_from_weight_decay=false",
    ]
    trainer = ours_against_reference(args, 8)
    assert trainer.replicas.buffers.shape[1] > 0


def test_slowmo_is_the_papers_update_with_the_base_lr():
    """SlowMo, Algorithm 1 (Wang et al. 2020): u ← β·u + (θ − x̄)/γ_t, θ ← θ − α·γ_t·u, with
    the base lr γ_t changing under a step schedule; replayed in float64 from the workers'
    average x̄ at every outer step, it gives our anchors. Ours runs in float64 too (the replay
    divides by γ_t: in float32 ours' rounding, amplified by 1/γ_t, was CPU-dependent)."""
    cfg = compose_config(
        *QUICK,
        "algorithm=local_sgd",
        "algorithm.period=4",
        "outer=slowmo",
        "workers=4",
        "outer.optimizer.lr=0.8",
        "outer.optimizer.momentum=0.6",
        "optimizer.lr=0.2",
        "schedule=step",
        "schedule.milestones=[1]",
        "train.steps=24",
    )
    torch.set_num_threads(1)
    trainer = build_trainer(cfg, SimulatedCommunicator(4, network_model(cfg)), F64)
    algorithm, rounds = trainer.algorithm, []
    merge = algorithm._merge

    def recorded(f: int) -> None:
        mean = trainer.replicas.params.double().mean(0)
        merge(f)
        rounds.append((mean, algorithm.anchor.params[0].double().clone()))

    algorithm._merge = recorded
    trainer.run()
    assert len(rounds) == 6
    theta, u = initial(cfg, F64), None
    gammas = []
    for r, (mean, anchor) in enumerate(rounds):
        gamma = 0.2 * trainer.built.schedule(4 * r + 3)  # the inner lr of the round's last step
        gammas.append(gamma)
        u = (theta - mean) / gamma + (0.6 * u if u is not None else 0)
        theta = theta - 0.8 * gamma * u
        assert gap(theta, anchor) <= TOL64, r
    assert len(set(gammas)) > 1  # γ_t changed on the way (warm-up, then the decay)


def initial(cfg, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The initial parameters of `cfg`'s model built in `dtype` as the trainer builds them
    (`build_trainer`), as float64."""
    with default_dtype(dtype):
        torch.manual_seed(cfg.seed)
        data = instantiate(cfg.data, device="cpu")
        torch.manual_seed(cfg.seed)
        model = instantiate(cfg.model, num_classes=data.num_classes, input_shape=data.input_shape)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()


# -- B: Streaming DiLoCo ------------------------------------------------------------------------
def test_streaming_with_one_fragment_and_no_overlap_is_diloco():
    diloco = run(*DILOCO)
    streaming = run(
        *DILOCO, "outer=streaming", "outer.fragments=1", "outer.overlap=0", "outer.mix=0"
    )
    assert torch.equal(diloco.replicas.params, streaming.replicas.params)


@pytest.mark.parametrize("pattern", ["sequential", "strided"])
def test_streaming_equals_the_papers_algorithm_written_apart(pattern):
    args = [
        *DILOCO,
        "model.hidden=[32,32,32]",
        "outer=streaming",
        "outer.fragments=2",
        "outer.overlap=2",
        "outer.mix=0.5",
        "train.steps=38",
        f"outer.fragment_pattern={pattern}",
    ]
    trainer = ours_against_reference(args, 8, streaming=(2, 2, 0.5, pattern))
    assert spread(trainer.replicas.params) > 1e-4  # α = 0.5 keeps the workers apart
    strided = not isinstance(trainer.algorithm.fragments[0].params, slice)
    assert strided == (pattern == "strided")


def test_streaming_bytes_per_step_are_the_fragments():
    """Over local SGD (no traffic of its own) the algorithm bytes of a step are 4·n_f for the
    fragment sent at that step, 0 at the others; the peak is the largest fragment's."""
    cfg = compose_config(
        *QUICK,
        *DILOCO,
        "model.hidden=[32,32,32]",
        "outer=streaming",
        "outer.fragments=4",
        "outer.overlap=1",
        "train.steps=32",
    )
    torch.set_num_threads(1)
    comm = SimulatedCommunicator(4, network_model(cfg))
    trainer = Trainer(cfg, comm, torch.device("cpu"), None)
    algorithm, per_step = trainer.algorithm, []
    after_backward = algorithm.after_backward

    def counted(step: int) -> None:
        before = list(comm.ledger.bytes_by_worker)
        after_backward(step)
        sent = [b - a for a, b in zip(before, comm.ledger.bytes_by_worker, strict=True)]
        assert len(set(sent)) == 1  # every worker sends its row
        per_step.append(sent[0])

    algorithm.after_backward = counted
    summary = trainer.run()
    numel = [f.numel for f in algorithm.fragments]
    assert sum(numel) == trainer.replicas.num_params and len(set(numel)) > 1
    # a fragment whose merge would come after the last step (sent at 32, τ = 1) is not sent
    launched = [algorithm.schedule.launches(n) if n < 32 else [] for n in range(1, 33)]
    expected = [sum(4 * numel[f] for f in fs) for fs in launched]
    assert per_step == expected and algorithm.schedule.launches(32) == [0]
    assert sorted(set(per_step) - {0}) == sorted({4 * n for n in numel})
    assert summary["outer/peak_step_bytes"] == 4 * max(numel) <= 4 * sum(numel) / 4 * 1.5
    assert summary["comm/bytes"] == sum(expected)


def test_schedule_staggers_fragments_and_merges_after_the_overlap():
    s = Schedule(period=8, fragments=4, overlap=3)
    assert [s.offset(f) for f in range(4)] == [0, 2, 4, 6]
    assert [(n, s.launches(n)) for n in range(1, 17) if s.launches(n)] == [
        (2, [1]),
        (4, [2]),
        (6, [3]),
        (8, [0]),
        (10, [1]),
        (12, [2]),
        (14, [3]),
        (16, [0]),
    ]
    assert s.merges(5) == [1] and s.merges(11) == [0] and s.merges(4) == []


def test_overlapped_fragments_are_priced_behind_the_compute_they_hide():
    """An op hidden behind h steps costs max(0, T − h·c) (c = network.compute_step_s); a
    Streaming DiLoCo run records its fragments with h = τ, so its modeled time is what τ steps
    of compute do not hide, and its op table re-prices to exactly that."""
    net = NetworkModel.preset("1gbe", compute_step_s=0.002)
    op = CommOp("allreduce", 1_000_000, 4)
    full = 2 * 3 * 50e-6 + 2 * 3 / 4 * 1_000_000 / (1e9 / 8)
    assert net.op_seconds(op) == pytest.approx(full)
    assert net.op_seconds(replace(op, hidden_steps=3)) == pytest.approx(full - 0.006)
    assert net.op_seconds(replace(op, hidden_steps=10)) == 0.0
    # 34 steps: 16 fragments sent and merged, 4 whole rounds
    args = [
        *DILOCO,
        "model.hidden=[32,32,32]",
        "outer=streaming",
        "outer.overlap=2",
        "network=1gbe",
        "train.steps=34",
    ]
    seconds = {}
    for c in (0.0, 1e-5):
        trainer = run(*args, f"network.compute_step_s={c}")
        summary = trainer.summary
        hidden = [row for row in summary["comm/ops"] if len(row) == 7]  # tier, hidden_steps
        assert hidden and all(row[5:] == ["", 2] for row in hidden)  # no tier, τ = 2
        priced = NetworkModel.from_units(50.0, 1.0, compute_step_s=c)
        assert priced.total_seconds(summary["comm/ops"]) == pytest.approx(summary["comm/modeled_s"])
        seconds[c] = summary["comm/modeled_s"]
        frag = 4 * max(f.numel for f in trainer.algorithm.fragments)
        assert summary["outer/peak_step_bytes"] == frag
        assert summary["outer/bytes_per_round"] == 4 * trainer.replicas.num_params
    assert 0 < seconds[1e-5] < seconds[0.0]


# -- E: compressed pseudo-gradients, error feedback across outer steps -------------------------
TOPK = [
    "compressor@outer.compressor=topk",
    "outer.compressor.ratio=0.1",
    "error_feedback@outer.error_feedback=ef14",
]
EF14 = ["error_feedback@outer.error_feedback=ef14"]


@pytest.mark.parametrize("pattern", ["sequential", "strided"])
def test_compressed_identity_is_the_uncompressed_outer_step_bit_for_bit(pattern):
    """Identity with EF14 runs the reducer's codec path (not its plain allreduce): Streaming
    DiLoCo over two fragments, strided ones too, ends bit for bit as the uncompressed one, with
    the same bytes and ops."""
    args = [
        *DILOCO,
        "model.hidden=[32,32,32]",
        "outer=streaming",
        "outer.fragments=2",
        f"outer.fragment_pattern={pattern}",
        "train.steps=30",
    ]
    plain, coded = run(*args), run(*args, *EF14)
    assert plain.algorithm.reducers is None
    assert [r.passthrough for r in coded.algorithm.reducers] == [False, False]
    assert torch.equal(plain.replicas.params, coded.replicas.params)
    assert torch.equal(plain.algorithm.anchor.params, coded.algorithm.anchor.params)
    assert plain.summary["comm/bytes"] == coded.summary["comm/bytes"]
    assert plain.summary["comm/ops"] == coded.summary["comm/ops"]


def test_topk_ef14_pseudo_gradients_memory_plus_sent_is_the_compensated_delta(monkeypatch):
    """Top-k (10 % per tensor) with EF14 on DiLoCo's Δ, against top-k written here: at every
    outer step p_i = Δ_i + e_i with Δ_i = θ − x_i and e_i the memory the previous outer step
    left; the outer optimizer gets mean_i sent_i with sent_i p_i's k largest entries per
    tensor; e_i ← p_i − sent_i; the bytes are k·8 per tensor per worker per outer step."""
    from dpresearch.compress import CompressedReducer

    calls = []
    reduce = CompressedReducer.reduce

    def recorded(self, rows, step):
        before, delta = self.memory.memory.clone(), rows.clone()
        reduce(self, rows, step)
        calls.append((step, before, delta, rows[0].clone(), self.memory.memory.clone()))

    monkeypatch.setattr(CompressedReducer, "reduce", recorded)
    trainer = run(
        "algorithm=local_sgd",
        "algorithm.period=4",
        "outer=nesterov",
        "workers=4",
        "train.steps=24",
        *TOPK,
    )
    shapes = [tuple(p.shape) for p in trainer.replicas.models[0].parameters()]
    assert [c[0] for c in calls] == list(range(6))  # the reducer's step: the outer round
    previous = torch.zeros_like(calls[0][1])
    for _, before, delta, mean, after in calls:
        assert torch.equal(before, previous)  # the memory lives across outer steps
        p, sent, offset = delta + before, torch.zeros_like(delta), 0
        for shape in shapes:
            n = math.prod(shape)
            k = max(1, round(0.1 * n))
            part = p[:, offset : offset + n]
            idx = part.abs().topk(k, dim=1).indices + offset
            sent.scatter_(1, idx, p.gather(1, idx))
            offset += n
        assert torch.equal(after + sent, p) and torch.equal(after, p - sent)
        # The reducer's mean against torch's, float32 (the bytes above are float32's): two sums
        # of the same K rows, maybe in other orders, each within (K − 1)·u·Σ|sent_i| of the
        # exact sum (u = 2^-24); dividing by K = 4 is exact. Entry by entry, not a fixed 1e-7.
        k_rows, u = sent.shape[0], torch.finfo(torch.float32).eps / 2
        bound = 2 * (k_rows - 1) * u * sent.double().abs().sum(0) / k_rows
        assert ((mean.double() - sent.double().mean(0)).abs() <= bound).all()
        assert after.abs().sum() > 0
        previous = after
    per_round = sum(8 * max(1, round(0.1 * math.prod(s))) for s in shapes)
    assert trainer.summary["outer/bytes_per_round"] == per_round
    assert trainer.summary["comm/bytes"] == 6 * per_round
    assert trainer.algorithm.reducers[0].payload_bytes() == per_round


def test_every_compressor_of_the_library_runs_on_the_pseudo_gradients_with_its_bytes():
    """Each node of the compressor group on DiLoCo's Δ (EF14, or none where the compressor
    takes no memory: majority vote, a sketch): 3 outer rounds, each sending exactly the
    compressor's documented payload per worker (`payload_bytes`, the sum over the model's
    tensors; at most that for a data-dependent size), the only traffic."""
    from dpresearch import CONF_DIR
    from dpresearch.compress import build_compressor

    names = sorted(path.stem for path in (CONF_DIR / "compressor").glob("*.yaml"))
    assert {"identity", "topk", "qsgd", "powersgd", "signum"} <= set(names)
    for name in names:
        node = compose_config(*QUICK, f"compressor={name}").compressor
        kind = type(build_compressor(node, 0))
        memory = "ef14" if "ef14" in kind.memories else "none"
        trainer = run(
            "algorithm=local_sgd",
            "algorithm.period=4",
            "outer=nesterov",
            "workers=4",
            "train.steps=12",
            f"compressor@outer.compressor={name}",
            f"error_feedback@outer.error_feedback={memory}",
        )
        (reducer,) = trainer.algorithm.reducers
        per_round = trainer.summary["outer/bytes_per_round"]
        assert trainer.summary["outer/rounds"] == 3, name
        assert trainer.summary["comm/bytes"] == 3 * per_round, name
        if kind.variable_size:  # data-dependent (threshold): at most the documented bound
            assert 0 < per_round <= reducer.payload_bytes(), name
        else:
            assert per_round == reducer.payload_bytes(), name


# -- simulated ≡ gloo × 4 -------------------------------------------------------------------------
GLOO_CASES = {
    # a background allreduce per fragment (ring sums, not deterministic), BatchNorm buffers.
    # Inner SGD: AdamW on an MLP with BatchNorm turns a 1-ulp difference of the ring's sums into
    # 1e-3 within a step (the biases before BatchNorm have ~0 gradients, which Adam normalises)
    "streaming": [*[a for a in DILOCO if not a.startswith("optimizer")], "optimizer.lr=0.05",
                  "optimizer.momentum=0.9", "model.hidden=[32,32]", "model.batch_norm=true",
                  "outer=streaming", "outer.overlap=2", "train.steps=38"],
    "slowmo_sgp": ["algorithm=sgp", "topology=one_peer_exponential", "outer=slowmo",
                   "outer.period=6", "optimizer.momentum=0.9", "workers=4", "train.steps=36"],
    # top-k + EF14 pseudo-gradients (an allgather of indices and values): bit for bit
    "diloco_topk": ["algorithm=local_sgd", "algorithm.period=4", "outer=nesterov",
                    "optimizer.momentum=0.9", "workers=4", "train.steps=24", *TOPK],
}  # fmt: skip
EXACT = ("diloco_topk",)


@pytest.mark.distributed
@pytest.mark.slow
def test_every_worker_matches_between_simulated_and_gloo(tmp_path):
    from helpers import cases_on_gloo, row_and_buffers

    real = cases_on_gloo(4, tmp_path, GLOO_CASES, row_and_buffers)
    for name, args in GLOO_CASES.items():
        simulated = run(*args, dtype=F64)
        params, buffers, summary = simulated.replicas.params, simulated.replicas.buffers, {}
        summary = simulated.summary
        if name == "streaming":
            assert spread(params) > 1e-4 and buffers.shape[1] > 0  # α = 0.5: workers apart
        for rank in range(4):
            got_params, got_buffers, got_summary = real[rank][name]
            # float64 (F64): gloo's allreduce sums in its own order, the simulated one in
            # worker order; EXACT: an allgather summed in rank order on both sides
            tol = 0.0 if name in EXACT else TOL64
            assert gap(got_params, params[rank]) <= tol, (name, rank)
            assert gap(got_buffers, buffers[rank]) <= TOL64, (name, rank)
            assert got_summary["comm/bytes"] == summary["comm/bytes"], name
            assert got_summary["outer/peak_step_bytes"] == summary["outer/peak_step_bytes"]
            # the same ops (recorded in another order: a background op at its wait)
            assert sorted(got_summary["comm/ops"]) == sorted(summary["comm/ops"]), name


# -- bad input: one line naming the fix, before any worker starts --------------------------------


def test_bad_outer_input_on_the_command_line_with_gloo(tmp_path):
    out = run_cli([*SYNTHETIC_SMALL, "backend=gloo", "workers=2", "outer=nesterov"], tmp_path)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "SyncSGD is not one" in lines[0], lines
    assert list(tmp_path.iterdir()) == []


# -- D: killed and resumed, bit for bit ----------------------------------------------------------
RESUME_STREAMING = [
    "algorithm=local_sgd",
    "algorithm.period=8",
    "outer=streaming",
    "outer.overlap=3",
    "model.hidden=[32,32,32]",
    "optimizer.momentum=0.9",
    "outer.inner_state=average",
]
RESUME_CASES = {
    "diloco": ["algorithm=local_sgd", "algorithm.period=4", "outer=nesterov",
               "optimizer.momentum=0.9"],
    "slowmo_sgp": ["algorithm=sgp", "topology=one_peer_exponential", "outer=slowmo",
                   "outer.period=4", "optimizer.momentum=0.9", "outer.inner_state=reset"],
    # H = 8, F = 4, τ = 3: fragments sent every 2 steps, each merged 3 steps later, so every
    # checkpoint (steps 10, 20, 30) holds two fragments in flight
    "streaming": RESUME_STREAMING,
    # every checkpoint (steps 10, 20, 30) holds a non-zero EF14 memory of the pseudo-gradients
    "diloco_topk_ef14": ["algorithm=local_sgd", "algorithm.period=4", "outer=nesterov",
                         "optimizer.momentum=0.9", *TOPK],
    # QSGD's stochastic rounding (streams drawn by outer round) on fragments in flight
    "streaming_qsgd": [*RESUME_STREAMING, "compressor@outer.compressor=qsgd",
                       "outer.compressor.levels=7"],
}  # fmt: skip


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_killed_and_resumed_equals_uninterrupted(case, tmp_path, one_thread):
    from helpers import CHECKPOINTED, check_resumed

    args = [*CHECKPOINTED, "workers=4", *RESUME_CASES[case]]
    if case.startswith("streaming"):
        cfg = compose_config(*args)
        schedule = Schedule(8, cfg.outer.fragments, cfg.outer.overlap)
        in_flight = [f for n in (28, 29, 30) for f in schedule.launches(n)]  # sent, not merged
        assert len(in_flight) == 2
    check_resumed(tmp_path, args, InjectedFailure)


# slow (a command-line run killed and resumed each): the default suite's outer resume is
# test_killed_and_resumed_equals_uninterrupted above, its CLI kill -9 test_checkpoint's
KILLED = [
    pytest.param(c, marks=pytest.mark.slow)
    for c in ("streaming", "diloco", "slowmo_sgp", "diloco_topk_ef14")
]


@pytest.mark.parametrize("case", KILLED)
def test_kill_9_resumes_exactly(case, tmp_path):
    """A real SIGKILL of DiLoCo, SlowMo over SGP, Streaming DiLoCo (every checkpoint it could
    resume from holds fragments in flight) and DiLoCo with top-k + EF14 (a non-zero memory in
    every checkpoint): the resumed run ends bit for bit as an uninterrupted one."""
    from helpers import CHECKPOINTED, final_params, kill_9_and_resume, metric_lines, same

    args = [
        *CHECKPOINTED,
        "workers=4",
        *RESUME_CASES[case],
        "train.steps=300",
        "train.eval_every=150",
        "train.checkpoint_every=10",
    ]

    def check_state(run_dir: Path) -> None:
        ckpt = torch.load(latest_checkpoint(run_dir), weights_only=False)
        state = ckpt["states"][0]["algorithm"]
        if case == "streaming":
            assert len(state["in_flight"]) == 2
        if case == "diloco_topk_ef14":
            assert state["reducers"][0]["memory"]["memory"].abs().sum() > 0

    run_dir, reference = kill_9_and_resume(args, tmp_path, kill_after=25, before_resume=check_state)
    assert [m["step"] for m in metric_lines(run_dir)] == list(range(1, 301))
    assert same(final_params(run_dir), final_params(reference))


def test_resume_without_the_outer_optimizer_is_refused_in_one_line(tmp_path):
    from dpresearch.config.validate import ConfigError

    args = [*QUICK, "algorithm=local_sgd", "train.steps=10", "train.checkpoint_every=5"]
    train(compose_config(*args, "outer=nesterov"), tmp_path / "run")
    with pytest.raises(ConfigError, match=r"LocalSGD\+dpresearch.algorithms.outer.Outer"):
        train(compose_config(*args, f"train.resume={tmp_path / 'run'}"), tmp_path / "new")


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_and_resumed_gloo_with_background_fragments_in_flight(tmp_path):
    """Streaming DiLoCo on 2 gloo processes, fragments allreduced in the background (ring,
    not deterministic): the checkpoint waits for the ones in flight; a worker process dies at
    step 35, the resumed run ends bit for bit as the uninterrupted one."""
    from helpers import CHECKPOINTED, check_resumed
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = [
        *CHECKPOINTED,
        "workers=2",
        *RESUME_CASES["streaming"],
        "backend=gloo",
        "backend.threads=1",
    ]
    check_resumed(tmp_path, args, ChildFailedError)
