"""Hierarchical DiLoCo (issue 41 item 4): `algorithm=node_sync` (synchronous data parallelism
inside each node of `comm.hierarchy`) under an outer optimizer across nodes.

A. Against an independent reference written here from the method's definition (M nodes × G
   workers: each node averages its workers' gradients every step and each worker steps its
   AdamW/SGD; every H steps the nodes' pseudo-gradients are averaged and outer Nesterov
   applied; every worker restarts from the outer model), float64, ≤ 1e-9. G = 1 is DiLoCo.
B. Bytes and modeled seconds per tier against a hand count (intra every step, inter every H),
   `time/modeled_s` against the closed form (a 3× slower worker; log-normal speeds, where each
   node waits only for its own workers between outer steps).
C. Simulated ≡ gloo (4 processes, G = 2), killed (also kill -9) and resumed bit for bit,
   `train.batched_workers=true` equal to the loop, bad input one line.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    SMALL_512,
    TOL64,
    build_trainer,
    compose_config,
    default_dtype,
    gap,
    reference_workers,
    run_cli,
)
from omegaconf import OmegaConf

from dpresearch import CONF_DIR
from dpresearch.algorithms.node_sync import NodeSyncOptions
from dpresearch.asynchrony.options import AsyncOptions
from dpresearch.asynchrony.speed import SpeedModel
from dpresearch.comm.hierarchy import Hierarchy
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.compress import Identity, TopK
from dpresearch.compress.reducer import HierarchicalReducer
from dpresearch.compress.topk import kept
from dpresearch.config.validate import ConfigError, validate
from dpresearch.run.build import build_communicator, hierarchy_of
from dpresearch.run.trainer import InjectedFailure, Trainer

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


def hier(workers: int, per_node: int, period: int, *more: str) -> list[str]:
    return [
        "algorithm=node_sync",
        f"comm.hierarchy.workers_per_node={per_node}",
        "network.intra=nvlink",
        "outer=nesterov",
        f"outer.period={period}",
        f"workers={workers}",
        *more,
    ]


def trained(*overrides: str, dtype: torch.dtype = F64) -> Trainer:
    """A finished simulated run of SMALL_512 + overrides on the communicator the command line
    builds (its two-level cluster included), in `dtype`."""
    cfg = compose_config(*SMALL_512, *overrides)
    validate(cfg)
    trainer = build_trainer(cfg, build_communicator(cfg), dtype)
    trainer.summary = trainer.run()
    return trainer


# -- A. the reference ---------------------------------------------------------------------------
def reference(cfg, steps: int, per_node: int, period: int) -> list[torch.nn.Module]:
    """Hierarchical DiLoCo written directly against torch, in float64: K = M·G model copies
    on their shards' batches (the IID partitioner's order); every step, inside each node of G
    consecutive workers, the gradients are summed in worker order and divided by G, and each
    worker's own torch optimizer steps on that mean; every `period` steps Δ_n = θ − x_n (any
    worker of node n: they are equal) is averaged over the M nodes, θ.grad = Δ̄, outer
    SGD(lr 0.7, momentum 0.9, Nesterov) steps θ, and every worker copies θ."""
    with default_dtype(F64):
        k, batch = cfg.workers, cfg.train.batch_size
        data, partitioner, per_epoch, theta, models, inner = reference_workers(cfg)
        outer = torch.optim.SGD(theta.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        nodes = k // per_node
        for step in range(steps):
            epoch, pos = divmod(step, per_epoch)
            for w, model in enumerate(models):
                idx = partitioner.epoch_indices(w, epoch)[pos * batch : (pos + 1) * batch]
                x, y = data.train_batch(idx)
                model.zero_grad()
                F.cross_entropy(model(x.to(F64)), y).backward()
            with torch.no_grad():
                for n in range(nodes):
                    node = models[n * per_node : (n + 1) * per_node]
                    for ps in zip(*(m.parameters() for m in node), strict=True):
                        mean = torch.stack([p.grad for p in ps]).sum(0) / per_node
                        for p in ps:
                            p.grad.copy_(mean)
            for opt in inner:
                opt.step()
            if (step + 1) % period == 0:
                with torch.no_grad():
                    leaders = models[::per_node]
                    for t, *xs in zip(
                        theta.parameters(), *(m.parameters() for m in leaders), strict=True
                    ):
                        t.grad = torch.stack([t - x for x in xs]).sum(0) / nodes
                outer.step()
                with torch.no_grad():
                    for m in models:
                        for p, t in zip(m.parameters(), theta.parameters(), strict=True):
                            p.copy_(t)
        return models


CASES = {
    # M = 2 nodes × G = 2, AdamW inner (DiLoCo's)
    "adamw_2x2": (4, 2, 4, ["optimizer=adamw", "optimizer.lr=0.003"]),
    # M = 2 × G = 3, SGD with momentum inner, H not dividing the run's 30 steps
    "sgd_2x3": (6, 3, 7, ["optimizer.momentum=0.9"]),
    # M = 4 × G = 1: DiLoCo itself
    "adamw_4x1": (4, 1, 5, ["optimizer=adamw", "optimizer.lr=0.003"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_equals_the_reference_float64(case):
    workers, per_node, period, more = CASES[case]
    args = hier(
        workers,
        per_node,
        period,
        *more,
        "optimizer.exclude_bn_bias_from_weight_decay=false",
        "train.steps=30",
    )
    ours = trained(*args)
    models = reference(ours.cfg, ours.total_steps, per_node, period)
    assert ours.replicas.params.dtype == F64
    for w, model in enumerate(models):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert gap(ours.replicas.params[w], flat) <= TOL64, (case, w)
    # the nodes really drift between outer steps (30 steps: the last ones after the last one)
    rows = ours.replicas.params
    if 30 % period:
        assert gap(rows[0], rows[per_node]) > 1e-4
        assert gap(rows[0], rows[per_node - 1]) == 0.0  # one model inside a node
    assert ours.summary["outer/rounds"] == 30 // period


@pytest.mark.parametrize(
    "outer",
    [["outer=nesterov"], ["outer=streaming", "outer.fragments=2", "outer.overlap=2"]],
    ids=["diloco", "streaming"],
)
def test_one_worker_per_node_is_the_outer_method_over_local_sgd(outer):
    """G = 1: no intra traffic, the nodes are the workers — DiLoCo (and Streaming DiLoCo, its
    fragments in flight) over local SGD exactly: the same allreduce of the K rows, the same
    bytes between nodes, each fragment's exchange priced behind τ steps."""
    common = ["optimizer=adamw", "optimizer.lr=0.003", "train.steps=20", "workers=4",
              "outer.period=5", *outer]  # fmt: skip
    ours = trained("algorithm=node_sync", "comm.hierarchy.workers_per_node=1", *common)
    local = trained("algorithm=local_sgd", *common)
    assert torch.equal(ours.replicas.params, local.replicas.params)
    # a node of one worker: its collectives charge their rows (the framework's convention
    # for a group of one, as a one-worker sync run) and cost no time
    row = 8 * ours.summary["num_params"]  # float64
    assert ours.summary["comm/bytes_inter"] == local.summary["comm/bytes"]
    intra = ours.total_steps * row + local.summary["comm/bytes"]  # + the broadcast of each Δ
    assert ours.summary["comm/bytes_intra"] == intra
    assert ours.summary["comm/modeled_s_intra"] == 0.0
    assert ours.summary["comm/modeled_s"] == pytest.approx(local.summary["comm/modeled_s"])


# -- B. bytes, modeled seconds, modeled wall clock ----------------------------------------------
def allreduce_s(n: int, nbytes: int, link: NetworkModel) -> float:
    """Ring allreduce: 2(n − 1)·a + 2(n − 1)/n·D/B with a = α + o."""
    a = link.latency_s + link.overhead_s
    return 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes / link.bandwidth_Bps


def tree_s(n: int, nbytes: int, link: NetworkModel) -> float:
    """Binomial-tree broadcast: ⌈log₂ n⌉·(a + D/B)."""
    return math.ceil(math.log2(n)) * (
        link.latency_s + link.overhead_s + nbytes / link.bandwidth_Bps
    )


@pytest.mark.parametrize(("workers", "per_node"), [(4, 2), (6, 3), (8, 2)])
def test_bytes_and_modeled_seconds_per_tier_are_the_hand_count(workers, per_node):
    """Per step every worker sends its 4·D-byte gradient row into its node's allreduce
    (intra); every H steps each leader sends Δ into the leaders' allreduce (inter) and
    broadcasts the mean into its node (intra). Means over the K workers, and each tier's
    seconds on its own link."""
    steps, period = 12, 4
    ours = trained(*hier(workers, per_node, period, f"train.steps={steps}"), dtype=torch.float32)
    s, dense = ours.summary, 4 * ours.summary["num_params"]
    nodes, rounds = workers // per_node, steps // period
    assert s["comm/bytes_intra"] == steps * dense + rounds * dense / per_node
    assert s["comm/bytes_inter"] == rounds * dense / per_node
    assert s["comm/bytes"] == s["comm/bytes_intra"] + s["comm/bytes_inter"]
    links = hierarchy_of(ours.cfg)
    assert links is not None and links.intra.bandwidth_Bps > 10 * links.inter.bandwidth_Bps
    intra = steps * allreduce_s(per_node, dense, links.intra) + rounds * tree_s(
        per_node, dense, links.intra
    )
    inter = rounds * allreduce_s(nodes, dense, links.inter)
    assert s["comm/modeled_s_intra"] == pytest.approx(intra, rel=1e-12)
    assert s["comm/modeled_s_inter"] == pytest.approx(inter, rel=1e-12)
    assert s["comm/modeled_s"] == pytest.approx(intra + inter, rel=1e-12)
    ops = {(op[0], op[2], op[4], op[5]) for op in s["comm/ops"]}
    assert ops == {
        ("allreduce", per_node, steps, "intra"),
        ("allreduce", nodes, rounds, "inter"),
        ("broadcast", per_node, rounds, "intra"),
    }
    assert s["outer/bytes_per_round"] == 2 * dense  # worker 0 leads: inter Δ + intra broadcast


def test_modeled_clock_with_a_3x_slower_worker_is_the_closed_form():
    """K = 4 in 2 nodes of 2, worker 1 three times slower (compute c), H = 5, 10 steps: node 0
    takes 3c + c_ar per step, node 1 c + c_ar; the outer step starts when node 0 arrives:
    T = rounds·(H·(3c + c_ar) + c_inter + c_bcast)."""
    c, steps, period = 0.05, 10, 5
    speed = ["async.slow_workers=[1]", "async.slowdown=3", f"async.compute_s={c}"]
    ours = trained(*hier(4, 2, period, f"train.steps={steps}", *speed), dtype=torch.float32)
    dense, links = 4 * ours.summary["num_params"], hierarchy_of(ours.cfg)
    c_ar = allreduce_s(2, dense, links.intra)
    round_s = (
        period * (3 * c + c_ar) + allreduce_s(2, dense, links.inter) + tree_s(2, dense, links.intra)
    )
    assert ours.summary["time/modeled_s"] == pytest.approx(steps // period * round_s, rel=1e-12)


def test_modeled_clock_nodes_wait_only_for_their_own_workers():
    """Log-normal speeds: between outer steps each node is a round of its own workers,
    T_round = max_n Σ_h (max_{w ∈ n} c_w,h + c_ar) + c_inter + c_bcast, from the run's own
    seeded draws (every worker one draw a step); a clock where every step waited for all K
    workers would give Σ_h max_w c_w,h instead, which these draws make larger."""
    steps, period, per_node = 8, 4, 2
    speed = ["async.speed=lognormal", "async.cv=1.0", "async.compute_s=0.1"]
    ours = trained(*hier(4, per_node, period, f"train.steps={steps}", *speed), dtype=torch.float32)
    dense, links = 4 * ours.summary["num_params"], hierarchy_of(ours.cfg)
    draws = SpeedModel.from_options(AsyncOptions.from_node(ours.cfg["async"]), 4, ours.cfg.seed)
    c = [[draws.draw(w) for w in range(4)] for _ in range(steps)]  # step-major, as the clock
    c_ar = allreduce_s(per_node, dense, links.intra)
    c_outer = allreduce_s(2, dense, links.inter) + tree_s(per_node, dense, links.intra)
    total, flat = 0.0, 0.0
    for r in range(steps // period):
        block = c[r * period : (r + 1) * period]
        nodes = [sum(max(row[n : n + per_node]) + c_ar for row in block) for n in (0, 2)]
        total += max(nodes) + c_outer
        flat += sum(max(row) + c_ar for row in block) + c_outer
    assert ours.summary["time/modeled_s"] == pytest.approx(total, rel=1e-12)
    assert flat > total * 1.01  # the per-node rounds matter here


# -- the leaders' exchange itself ---------------------------------------------------------------
NVLINK, ETHERNET = NetworkModel.preset("nvlink"), NetworkModel.preset("10gbe")


@pytest.mark.parametrize("compressor", [Identity(), TopK(ratio=0.1)])
def test_replicated_nodes_reducer_sends_only_between_leaders_and_broadcasts(compressor):
    """Rows equal inside each node: no intra reduce; the leaders aggregate their rows (the
    node's value) and broadcast the result; bytes: leaders D inter + D intra, others nothing."""
    workers, per_node, numel = 6, 3, 50
    comm = SimulatedCommunicator(workers, ETHERNET, hierarchy=Hierarchy(per_node, NVLINK, ETHERNET))
    nodes = torch.randn(2, numel, generator=torch.Generator().manual_seed(3))
    rows = nodes.repeat_interleave(per_node, 0)
    reducer = HierarchicalReducer(compressor, comm, [(0, (numel,))], replicated_nodes=True)
    reducer.reduce(rows, 0)
    if isinstance(compressor, Identity):
        expected = nodes.sum(0) / 2
    else:
        kept = torch.zeros_like(nodes)
        for n in range(2):
            top = nodes[n].abs().topk(5).indices
            kept[n, top] = nodes[n, top]
        expected = kept.sum(0) / 2
    # (a + b)/2 of two float32 rows: the same rounding in any order
    assert all(torch.equal(rows[w], expected) for w in range(workers))
    leader = [w % per_node == 0 for w in range(workers)]
    payload = 4 * numel if isinstance(compressor, Identity) else 5 * (4 + 4)  # values + indices
    assert comm.ledger.bytes_by_tier["intra"] == [4 * numel * x for x in leader]
    assert comm.ledger.bytes_by_tier["inter"] == [payload * x for x in leader]
    assert {op.kind for op in comm.ledger.step_ops} >= {"broadcast"}
    assert "reduce" not in {op.kind for op in comm.ledger.step_ops}


def test_topk_between_nodes_memory_on_the_leaders_and_bytes():
    """`compressor@outer.compressor=topk` + EF14 over node_sync: the leaders compress (one
    memory row per node), each sends the top 10 % of every tensor of Δ (value + index, 8 bytes
    each in float32) between nodes and broadcasts the decoded mean (dense) inside its node."""
    steps, period, workers, per_node = 12, 4, 4, 2
    topk = ["compressor@outer.compressor=topk", "outer.compressor.ratio=0.1",
            "error_feedback@outer.error_feedback=ef14"]  # fmt: skip
    ours = trained(*hier(workers, per_node, period, f"train.steps={steps}", *topk),
                   dtype=torch.float32)  # fmt: skip
    (reducer,) = ours.algorithm.reducers
    d = ours.summary["num_params"]
    assert reducer.memory.memory.shape == (workers // per_node, d)
    assert reducer.memory.memory.abs().sum() > 0
    sizes = [p.numel() for p in ours.replicas.models[0].parameters()]
    payload = sum(8 * kept(n, 0.1) for n in sizes)
    rounds = steps // period
    assert ours.summary["comm/bytes_inter"] == rounds * payload / per_node
    assert ours.summary["comm/bytes_intra"] == steps * 4 * d + rounds * 4 * d / per_node


def test_yaml_carries_the_options_defaults():
    node = OmegaConf.load(CONF_DIR / "algorithm" / "node_sync.yaml")
    declared = {f.name: f.default for f in fields(NodeSyncOptions)}
    assert {k: v for k, v in node.items() if k != "_target_"} == declared


# -- C. gloo, resume, batched, bad input --------------------------------------------------------
GLOO = ["optimizer=adamw", "optimizer.lr=0.003", "train.steps=12"]


@pytest.mark.distributed
@pytest.mark.slow
def test_simulated_equals_gloo(tmp_path):
    """4 gloo processes, 2 nodes of 2: the intra allreduce on each node's subgroup, the
    leaders' Δ allreduce on the leaders' group, the broadcast on the node group — the same
    parameters as the simulated run (sums of two rows: the same in any order), the same bytes
    and modeled seconds per tier."""
    from helpers import final_params

    args = [*SMALL_512, *hier(4, 2, 4, *GLOO), "backend.threads=1"]
    runs = {}
    for name, extra in (("sim", []), ("gloo", ["backend=gloo"])):
        out = run_cli([*args, *extra, f"hydra.run.dir={tmp_path / name}"], tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[name] = json.loads((tmp_path / name / "summary.json").read_text())
    sim, real = final_params(tmp_path / "sim"), final_params(tmp_path / "gloo")
    assert all(torch.equal(sim[k], real[k]) for k in sim)
    for key in ("comm/bytes", "comm/bytes_intra", "comm/bytes_inter"):
        assert runs["gloo"][key] == runs["sim"][key], key
    for key in ("comm/modeled_s", "comm/modeled_s_intra", "comm/modeled_s_inter", "time/modeled_s"):
        assert runs["gloo"][key] == pytest.approx(runs["sim"][key], rel=1e-12), key


RESUME = hier(4, 2, 4, "optimizer=adamw", "optimizer.lr=0.003")


def test_killed_and_resumed_equals_uninterrupted(tmp_path):
    from helpers import CHECKPOINTED, check_resumed

    check_resumed(tmp_path, [*CHECKPOINTED, *RESUME], InjectedFailure)


@pytest.mark.slow
def test_kill_9_resumes_exactly(tmp_path):
    """A real SIGKILL mid-round (checkpoints every 10 steps, H = 4: each holds an outer
    momentum and inner AdamW state); the resumed run ends bit for bit as an uninterrupted one,
    its modeled clock too."""
    from helpers import CHECKPOINTED, final_params, kill_9_and_resume, metric_lines, same

    args = [*CHECKPOINTED, *RESUME, "train.steps=300", "train.eval_every=150",
            "train.checkpoint_every=10"]  # fmt: skip
    run_dir, ref = kill_9_and_resume(args, tmp_path, kill_after=25)
    lines = metric_lines(run_dir)
    assert [m["step"] for m in lines] == list(range(1, 301))
    assert same(final_params(run_dir), final_params(ref))
    clock = [m["time/modeled_s"] for m in lines]
    assert clock == [m["time/modeled_s"] for m in metric_lines(ref)]


@pytest.mark.parametrize("more", [[], ["model.batch_norm=true"]], ids=["mlp", "batch_norm"])
def test_batched_workers_equal_the_loop(more):
    """`train.batched_workers=true` (the workers' forward/backward as one computation) ends
    where the loop does, float64 (14 steps: the nodes apart after the outer step at 12); with
    BatchNorm each node's leader's statistics broadcast inside the node before every forward."""
    args = hier(4, 2, 4, "train.steps=14", "optimizer=adamw", "optimizer.lr=0.003", *more)
    loop = trained(*args, "train.batched_workers=false")
    batched = trained(*args, "train.batched_workers=true")
    assert loop.compute.batched is None and batched.compute.batched is not None
    assert gap(loop.replicas.params, batched.replicas.params) <= TOL64
    assert gap(loop.replicas.buffers, batched.replicas.buffers) <= TOL64


BAD = [
    (["algorithm=node_sync", "outer=nesterov", "outer.period=4"],
     "set comm.hierarchy.workers_per_node=G"),
    (["algorithm=node_sync", "comm.hierarchy.workers_per_node=2"],
     "add an outer optimizer across nodes, e.g. outer=nesterov outer.period=H"),
    (["algorithm=node_sync", "comm.hierarchy.workers_per_node=2", "outer=nesterov"],
     "outer.period is required"),
    (hier(4, 2, 4, "compressor=topk"), "compress the pseudo-gradients between nodes"),
    (hier(4, 2, 4, "algorithm.buffers=all"), "algorithm.buffers=all; choose one of"),
    (hier(4, 2, 4, "algorithm.bucket_mb=0"), "algorithm.bucket_mb=0: must be a number > 0"),
    (hier(4, 2, 4, "algorithm.overlap=3"), "algorithm.overlap=3: must be true or false"),
    (hier(4, 2, 4, "train.eval_bn_stats=average"), "add algorithm.buffers=local"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "fragment"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line(args, fragment):
    with pytest.raises(ConfigError, match=None) as info:
        validate(compose_config(*SMALL_512, "workers=4", *args))
    message = str(info.value)
    assert "\n" not in message and fragment in message, message


@pytest.mark.slow  # a subprocess; the messages themselves are the rows above
def test_bad_input_on_the_command_line_is_one_line_exit_2(tmp_path):
    out = run_cli(
        [*SMALL_512, "algorithm=node_sync", "workers=4", "outer=nesterov", "outer.period=4"],
        tmp_path,
    )
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "comm.hierarchy.workers_per_node=G" in lines[0]
    assert not any(Path(tmp_path).iterdir())
