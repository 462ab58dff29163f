"""Batched worker compute (issue 16, items 2 and 7; issue 31, item 1): the local workers' forward
and backward as one computation over their stacked parameter rows — stacked layers writing
their gradients into the rows (`run/stacked.py`) or a vmapped ensemble (`run/batched.py`) —
give the parameters, BatchNorm statistics and `num_batches_tracked` of the loop (worker after
worker) to 1e-9 after 20 steps in float64, for every algorithm and every compressor with error
feedback (the algorithm runs unchanged, only the compute differs), on the MLP and on ResNet-20
with BatchNorm; mixed precision, channels-last, the divergence check and skipped steps, and
checkpoints behave as in the loop; any subset of rows computes as the loop; a model that cannot
be batched is refused (`true`, `stacked`, `vmap`) or falls back (`auto`) with one line saying
why. The stacked layers of every shipped model family: `tests/test_stacked.py`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    CHECKPOINT_CASES,
    CHECKPOINTED,
    MLP_RUN,
    RESNET_RUN,
    SMALL,
    TOL64,
    check_resumed,
    compose_config,
    needs_subset,
    trainer_for,
)
from torch import nn

from dpresearch.config.preflight import preflight
from dpresearch.config.validate import ConfigError
from dpresearch.models.mlp import MLP
from dpresearch.models.resnet_cifar import ResNetCifar
from dpresearch.replicas import Replicas
from dpresearch.run.batched import BatchedWorkers, decide, probe, probe_config
from dpresearch.run.stacked import StackedWorkers
from dpresearch.run.trainer import InjectedFailure, Trainer
from dpresearch.train import train

STEPS = 20
WAYS = ("stacked", "vmap")
CLASSES = {"stacked": StackedWorkers, "vmap": BatchedWorkers}
# ResNet-20 at batch 4 amplifies a perturbation ~1e6-fold over 20 steps (below): float64's
# ~1e-16 reordering of the batched kernels grows to ~1e-10, so 1e-6 leaves 4 orders of room
# and still catches a wrong row (> 1e-3).
RESNET_TOL64 = 1e-6

ALGORITHMS = {
    "sync": [],
    "sync_local_buffers": ["algorithm.buffers=local"],
    "local_sgd": ["algorithm=local_sgd", "algorithm.period=4"],
    "dpsgd": ["algorithm=dpsgd"],
    "choco": ["algorithm=choco", "compressor=topk", "compressor.ratio=0.2"],
    "sgp": ["algorithm=sgp"],
}
# Every compressor, with error feedback where it pairs with it (as conf/compressor says).
# Batched kernels add in another order than the loop's (class b of issue 33: two computations
# of the same math), so the comparison runs in float64 (helpers.TOL64): there the batched
# gradients equal the loop's to ~1e-16, too little to move a 16-bit rounding, a top-k choice
# or a quantization level, or to survive PowerSGD's orthogonalisation above 1e-9 (in float32
# a reordering turned into one fp16 ulp now and then: 1e-5 was needed, CPU-dependent).
COMPRESSORS = {
    "fp16": ["compressor=fp16"],
    "bf16": ["compressor=bf16"],
    "topk+ef14": ["compressor=topk", "compressor.ratio=0.05", "error_feedback=ef14"],
    "topk+ef21": ["compressor=topk", "compressor.ratio=0.05", "error_feedback=ef21"],
    "randomk+ef14": ["compressor=randomk", "compressor.ratio=0.05", "error_feedback=ef14"],
    "qsgd": ["compressor=qsgd"],
    "terngrad": ["compressor=terngrad"],
    "sign+ef14": ["compressor=sign", "error_feedback=ef14"],
    "powersgd+ef14": [
        "compressor=powersgd",
        "compressor.min_compression_rate=1.1",
        "error_feedback=ef14",
    ],
}


def rows_after(
    *overrides: str, mode: str, dtype: torch.dtype = torch.float32
) -> tuple[Trainer, dict[str, torch.Tensor]]:
    """A simulated run of `overrides` with `train.batched_workers=mode`, the model and its
    inputs in `dtype`; its rows after it (evaluation left out: it reads the rows, it does not
    change them)."""
    trainer = trainer_for(*overrides, mode=mode, dtype=dtype)
    initial = trainer.replicas.params.clone()
    trainer.run()
    reps = trainer.replicas
    rows = {"params": reps.params, "buffers": reps.buffers, "int_buffers": reps.int_buffers}
    rows["moved"] = (reps.params - initial).abs().max()
    return trainer, rows


def assert_same_rows(
    *overrides: str, tol: float = TOL64, dtype: torch.dtype = torch.float64, way: str = "stacked"
) -> None:
    """Batched `way` ≡ loop: parameters and float buffers to `tol`, integer buffers exactly.
    Float64 by default (see COMPRESSORS); a float32 or bf16 run passes its own tolerance."""
    loop_run, loop = rows_after(*overrides, mode="false", dtype=dtype)
    batched_run, batched = rows_after(*overrides, mode=way, dtype=dtype)
    assert loop_run.compute.batched is None
    assert isinstance(batched_run.compute.batched, CLASSES[way])
    assert loop["moved"] > 1e-3  # the runs really trained
    for what in ("params", "buffers"):
        if loop[what].numel():
            gap = (loop[what].double() - batched[what].double()).abs().max().item()
            assert gap <= tol, (what, gap)
    assert torch.equal(loop["int_buffers"], batched["int_buffers"])
    if loop["int_buffers"].numel():
        assert loop["int_buffers"].min() > 0  # num_batches_tracked counted per worker


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_mlp_batched_equals_loop_for_every_algorithm(name, way):
    assert_same_rows(*MLP_RUN, *ALGORITHMS[name], way=way)


# QSGD asks torch for float32 norms of its buckets (dpresearch/compress/qsgd.py: vector_norm
# with dtype=float32), which torch refuses for float64 rows: it stays in float32 at 1e-6, a
# CPU-dependent rounding budget, until the codec takes float64 rows.
FLOAT32_ONLY: dict[str, float] = {}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_mlp_batched_equals_loop_for_every_compressor(name, way):
    if name in FLOAT32_ONLY:
        assert_same_rows(
            *MLP_RUN, *COMPRESSORS[name], tol=FLOAT32_ONLY[name], dtype=torch.float32, way=way
        )
    else:
        assert_same_rows(*MLP_RUN, *COMPRESSORS[name], way=way)


@pytest.mark.parametrize("way", WAYS)
def test_signum_votes_the_same_signs_batched_as_in_the_loop(way):
    """A majority vote of signs is discontinuous: a gradient entry within ~1e-8 of zero would
    flip its vote and send the two runs apart. Without BatchNorm (whose preceding biases have
    gradients of pure rounding noise, whose signs are a coin toss) over the first 10 steps no
    such entry comes up: the same to 1e-9 in float64 (the batched sums are in another order)."""
    assert_same_rows(
        *MLP_RUN, "compressor=signum", "model.batch_norm=false", "train.steps=10", way=way
    )


@pytest.mark.parametrize("way", WAYS)
def test_asynchronous_sgd_computes_each_push_as_the_loop(way):
    """One push per step computed alone (fixed-delay mode: its read is chosen at its step): a
    single row is computed as the loop computes it (bit for bit). The event simulator computes
    the gradients of workers in flight ahead, together: `test_async_ahead.py`."""
    fixed = ("algorithm=async_sgd", "async.delay=2")
    loop_run, loop = rows_after(*MLP_RUN, *fixed, mode="false")
    batched_run, batched = rows_after(*MLP_RUN, *fixed, mode=way)
    assert isinstance(batched_run.compute.batched, CLASSES[way])
    assert loop["moved"] > 1e-3
    assert all(torch.equal(loop[k], batched[k]) for k in ("params", "buffers", "int_buffers"))
    server = loop_run.algorithm.server.params
    assert (server - loop["params"][0]).abs().max() > 0  # stale rows: real asynchrony


@needs_subset
# every algorithm batched ≡ loop on the MLP above; on ResNet-20 the default suite keeps an
# allreduce and a gossip one (the others slow)
@pytest.mark.parametrize(
    "name",
    [
        "sync",
        *(pytest.param(n, marks=pytest.mark.slow) for n in ("local_sgd",)),
        "dpsgd",
        *(pytest.param(n, marks=pytest.mark.slow) for n in ("choco", "sgp")),
    ],
)
@pytest.mark.parametrize("way", WAYS)
def test_resnet20_with_batchnorm_batched_equals_loop(name, way):
    """In float64. ResNet-20 with BatchNorm at batch 4 is chaotic: in float32 the loop against
    itself with its parameters perturbed by 1e-7 (relative) is 3e-4 apart after 5 steps and
    0.15 after 20, whatever computes it; in float64 the rounding of batched kernels stays far
    below 1e-6 over 20 steps (the chaos amplifies ~1e-16 by ~1e6: RESNET_TOL64), so the
    comparison tests the computation, not the chaos."""
    assert_same_rows(*RESNET_RUN, *ALGORITHMS[name], tol=RESNET_TOL64, way=way)


@needs_subset
@pytest.mark.parametrize("way", WAYS)
def test_resnet20_channels_last_batched_equals_loop(way):
    assert_same_rows(
        *RESNET_RUN, "train.channels_last=true", "train.steps=8", tol=RESNET_TOL64, way=way
    )


@needs_subset
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("channels_last", [False, True])
def test_resnet20_float32_step_batched_equals_loop(channels_last, way):
    """One float32 step of ResNet-20 (BatchNorm, CIFAR augmentation): gradients, BatchNorm
    statistics and counters agree to float32 rounding. Float32 on purpose: the float32 kernels
    batched (the float64 tests above check the arithmetic). Batched and loop sum the same
    products in another order (class b of issue 33), so the bound is relative to the values
    summed, not fixed: a reordered float32 sum of n terms moves by at most ~n·u·Σ|terms| (u =
    2^-24 ≈ 6e-8), in practice ~√n·u·max|g| — a few hundred ulps for the ~10^3-term sums of a
    conv gradient; 1e-5·max|g| (~170 ulps of the largest entry) is that budget, one step
    only (no training to amplify it). The BatchNorm statistics are means of O(1) values
    (running_var ~ 1): 1e-5 absolute, the same budget."""
    args = [*RESNET_RUN, "train.steps=1", f"train.channels_last={channels_last}"]
    loop, batched = (rows_after(*args, mode=m)[0].replicas for m in ("false", way))
    scale = loop.grads.abs().max().item()
    assert (loop.grads - batched.grads).abs().max().item() <= 1e-5 * scale
    assert (loop.buffers - batched.buffers).abs().max().item() <= 1e-5  # running_var ~ 1
    assert torch.equal(loop.int_buffers, batched.int_buffers) and loop.int_buffers.min() == 1


@pytest.mark.parametrize("way", WAYS)
def test_bf16_autocast_batched_equals_loop(way):
    """bf16 rounds every product to 8 bits: batched and loop agree to bf16's precision. In
    float32 (autocast leaves float64 alone): bf16's unit roundoff is 2^-8 ≈ 4e-3, so one
    reordered product can move a step by that much; 2e-2 is a few bf16 ulps of a parameter of
    size ~1 after 20 steps."""
    assert_same_rows(
        *MLP_RUN,
        "model.batch_norm=false",
        "train.autocast=bf16",
        tol=2e-2,
        dtype=torch.float32,
        way=way,
    )


def test_bf16_with_batchnorm_on_the_cpu_runs_stacked_and_vmap_is_refused():
    """torch's batching rule for BatchNorm refuses bf16 inputs with float32 statistics on the
    CPU (the loop's kernel mixes them): `vmap` is one line before the run; the stacked
    BatchNorm calls the loop's kernel on all workers' channels, so `auto` and `true` run
    stacked, equal to the loop at bf16's precision (see test_bf16_autocast_batched_equals_loop)."""
    args = [*MLP_RUN, "workers=16", "train.autocast=bf16"]
    cfg = compose_config(*args)
    way, line = decide(cfg, preflight(cfg), 16, torch.device("cpu"))
    assert way == "stacked" and line.startswith("16 workers stacked")
    with pytest.raises(ConfigError, match="train.batched_workers=vmap but model MLP cannot"):
        preflight(compose_config(*args, "train.batched_workers=vmap"))
    assert_same_rows(*MLP_RUN, "train.autocast=bf16", tol=2e-2, dtype=torch.float32)


def _replicas(model: nn.Module, rows: int, seed: int = 1) -> Replicas:
    reps = Replicas(model, rows, torch.device("cpu"))
    with torch.no_grad():
        noise = torch.randn(reps.params.shape, generator=torch.Generator().manual_seed(seed))
        reps.params.add_(noise)
    return reps


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("rows", [[0, 2], [1], [1, 2], [0, 1, 2, 3]])
def test_any_subset_of_rows_computes_as_the_loop_and_leaves_the_others(rows, way, one_thread):
    """In float64 (TOL64 of the gradients): vmapped kernels sum in another order than the
    loop's (class b of issue 33)."""
    torch.manual_seed(0)
    model = MLP(5, (6,), hidden=[7], batch_norm=True).double()
    loop, batched = _replicas(model, 4), _replicas(model, 4)
    for reps in (loop, batched):
        reps.grads.fill_(3.0)  # overwritten for the rows computed, kept for the others
    x = torch.randn(len(rows), 8, 6, dtype=torch.float64)
    y = torch.randint(5, (len(rows), 8))
    for i, w in enumerate(rows):
        loop.grads[w].zero_()
        F.cross_entropy(loop.models[w](x[i]), y[i]).backward()
    losses, out = CLASSES[way](batched).run(rows, x, y)
    assert losses.shape == (len(rows),) and out.shape == (len(rows), 8, 5)
    for what in ("grads", "params", "buffers", "int_buffers"):
        assert torch.allclose(
            getattr(loop, what).double(), getattr(batched, what).double(), atol=TOL64, rtol=0
        ), what
    others = [w for w in range(4) if w not in rows]
    assert all((batched.grads[w] == 3.0).all() for w in others)
    assert batched.int_buffers[rows].min() == 1 and (batched.int_buffers[others] == 0).all()


def test_fp16_loss_scaling_batched_equals_loop(one_thread):
    """Mixed precision with a loss scale: the scaled loss is differentiated and the gradient
    rows divided back, batched as in the loop (CPU autocast in fp16). fp16's unit roundoff
    is 2^-11 ≈ 5e-4: a product rounded differently in the reordered batched kernels moves a
    gradient entry by a few of those, relative or (near zero) absolute: 2e-3 each, fp16's
    precision, not a fixed float32 figure."""
    from dpresearch.data.synthetic import make_synthetic
    from dpresearch.run.compute import WorkerCompute

    data = make_synthetic(num_train=256, num_test=16, num_features=6, num_classes=5)
    part = data.make_partitioner(4, 0)
    grads = {}
    for batched in (None, *WAYS):
        torch.manual_seed(0)
        reps = _replicas(MLP(5, (6,), hidden=[7]), 4)
        compute = WorkerCompute(
            data,
            part,
            reps,
            range(4),
            8,
            8,
            0,
            torch.device("cpu"),
            autocast="fp16",
            loss_scale=1024.0,
            batched=batched,
        )
        compute.run([0, 1, 2, 3])
        grads[batched] = reps.grads.clone()
    assert grads[None].abs().max() > 1e-3
    for way in WAYS:
        assert torch.allclose(grads[None], grads[way], atol=2e-3, rtol=2e-3), way


def test_divergence_and_skipped_steps_are_the_loops(tmp_path):
    """A huge lr: `skip_step` drops the same steps batched as in the loop; `stop` stops at the
    same step."""
    quick = [
        *SMALL,
        "workers=4",
        "data.num_train=256",
        "data.num_test=64",
        "train.log_every=1",
        "train.steps=30",
        "optimizer.lr=1e6",
        "backend.threads=1",
    ]
    summaries = {}
    for mode in ("false", "true"):
        for nonfinite in ("skip_step", "stop"):
            run_dir = tmp_path / f"{mode}-{nonfinite}"
            summaries[mode, nonfinite] = train(
                compose_config(
                    *quick, f"train.on_nonfinite={nonfinite}", f"train.batched_workers={mode}"
                ),
                run_dir,
            )
    skipped = summaries["false", "skip_step"]["train/skipped_steps"]
    assert skipped > 0
    assert summaries["true", "skip_step"]["train/skipped_steps"] == skipped
    assert summaries["false", "stop"]["status"] == "diverged"
    assert (
        summaries["true", "stop"]["diverged_at_step"]
        == summaries["false", "stop"]["diverged_at_step"]
    )


@pytest.mark.parametrize(  # one in the default suite; the others slow
    "case",
    ["sync_qsgd_ef14", *(pytest.param(c, marks=pytest.mark.slow) for c in ("local_sgd", "choco"))],
)
def test_batched_run_killed_and_resumed_equals_uninterrupted(case, tmp_path, one_thread):
    """Killed after a checkpoint and resumed, a batched run continues bit for bit (cursors,
    generators, the stacked integer buffers), metrics line for line
    (`helpers.check_resumed`)."""
    args = [*CHECKPOINTED, "workers=4", "model.batch_norm=true", "train.batched_workers=true"]
    check_resumed(tmp_path, [*args, *CHECKPOINT_CASES[case]], InjectedFailure)


def test_auto_batches_small_workers_on_the_cpu_and_says_so(capsys):
    """On a CPU `auto` batches from 8 workers (fewer: one by one, exactly as a process per
    worker computes), stacked where the model can, else vmapped; a model above the size bound,
    or workers whose inputs together exceed the cache budget, run one by one."""
    data = preflight(compose_config(*SMALL))
    cpu = torch.device("cpu")
    way, line = decide(compose_config(*SMALL, "workers=16"), data, 16, cpu)
    assert way == "stacked" and line.startswith("16 workers stacked") and "auto" in line
    way, line = decide(compose_config(*SMALL, "workers=2"), data, 2, cpu)
    assert way is None and "one by one (auto: on a CPU batching gains from 8 workers" in line
    assert decide(compose_config(*SMALL), data, 1, cpu) == (None, "")  # nothing to batch
    # a model above the CPU's size limit runs one by one
    big = compose_config(*SMALL, "workers=16", "model.hidden=[4096,4096]", "train.batch_size=64")
    way, line = decide(big, data, 16, cpu)
    assert way is None and "multiply-adds per worker forward" in line
    # a model with no stacked counterpart: vmapped from 8 workers, while the inputs fit
    odd = f"model._target_={__name__}.PlainMLP"
    way, line = decide(compose_config(*SMALL, odd, "workers=16"), data, 16, cpu)
    assert way == "vmap" and "stacked: the model (PlainMLP) has no stacked counterpart" in line
    way, line = decide(compose_config(*SMALL, odd, "workers=4"), data, 4, cpu)
    assert way is None and "from 8 workers" in line
    wide = compose_config(
        "model=logreg",
        "workers=64",
        "data.num_features=3072",
        "data.num_train=4096",
        "train.batch_size=64",
    )
    way, line = decide(wide, preflight(wide), 64, cpu)
    assert way is None and "48.0 MiB" in line
    # and the run prints its choice once at the start
    train(compose_config(*SMALL, "workers=16", "train.steps=2", "train.progress=true"), None)
    out = capsys.readouterr().out
    assert out.count("workers_compute: 16 workers stacked") == 1


class PlainMLP(nn.Module):
    """A model of known layers in a class the stacked layers do not know: vmap runs it."""

    def __init__(self, num_classes: int, input_shape, hidden=(8,), batch_norm=False) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(math.prod(input_shape), 8), nn.ReLU(), nn.Linear(8, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DropoutMLP(nn.Module):
    """A model that draws random numbers in training: cannot be batched like the loop."""

    def __init__(self, num_classes: int, input_shape, hidden=(8,), batch_norm=False) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(input_shape[0], 8), nn.Dropout(0.5), nn.Linear(8, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_true_for_a_model_that_cannot_be_batched_is_one_line_before_any_worker():
    target = f"model._target_={__name__}.DropoutMLP"
    cfg = compose_config(*SMALL, target, "train.batched_workers=true")
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    message = str(err.value)
    assert message.startswith("train.batched_workers=true but model DropoutMLP cannot run")
    assert "random numbers" in message and "train.batched_workers=auto" in message
    assert "\n" not in message
    # auto falls back and says why
    cfg = compose_config(*SMALL, target, "workers=16")
    way, line = decide(cfg, preflight(cfg), 16, torch.device("cpu"))
    assert way is None and "DropoutMLP cannot be batched" in line and "random numbers" in line
    # and stacked, the same for the shipped MLP with a dropout layer swapped in
    with pytest.raises(ConfigError, match="train.batched_workers=stacked but model DropoutMLP"):
        preflight(compose_config(*SMALL, target, "train.batched_workers=stacked"))


def test_bad_value_is_one_line():
    with pytest.raises(ConfigError, match="train.batched_workers=sometimes; choose one of: auto"):
        preflight(compose_config(*SMALL, "train.batched_workers=sometimes"))


SHIPPED = sorted(
    p.stem
    for p in (Path(__file__).resolve().parents[1] / "dpresearch" / "conf" / "model").glob("*.yaml")
)
FAST = {"mlp", "logreg", "resnet20"}


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in SHIPPED]
)
def test_every_shipped_model_batches_or_says_why(name):
    """Every model in conf/model/ runs batched exactly as the loop (`probe`), or — only the
    torchvision bridge, whose models may draw (dropout) or be missing, and a GPT with dropout
    vmapped — says why. The GPTs are probed on token windows of a text corpus
    (`Dataset.probe_batch`)."""
    if name == "torchvision":
        pytest.importorskip("torchvision")
    images = name.startswith(("resnet", "vgg")) or name == "torchvision"
    shape, classes, data = ((3, 32, 32) if images else (16,)), 10, None
    node = compose_config(f"model={name}").model
    if name.startswith("gpt"):
        from dpresearch.data.text import TextDataset

        data = TextDataset(
            torch.zeros(64, dtype=torch.int32),
            torch.zeros(1),
            torch.zeros(64, dtype=torch.int32),
            torch.zeros(1, dtype=torch.long),
            classes,
            block_size=8,
        )
        shape = data.input_shape
    for way in WAYS:
        reason = probe_config(node, shape, classes, data=data, way=way)
        # dropout on the per-worker stream (gpt_nanogpt) runs stacked; vmap draws no stream
        if name == "torchvision" or (node.get("dropout", 0) > 0 and way == "vmap"):
            assert reason is None or "cannot" in reason or "random" in reason
        else:
            assert reason is None, (way, reason)


def test_a_forward_that_keeps_python_state_is_caught_by_the_probe():
    class Counting(nn.Module):
        calls = 0  # shared by every replica: the loop counts each worker, batched all at once

        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            Counting.calls += 1
            return self.linear(x) * Counting.calls

    assert probe(Counting(), (4,), 3) is not None
    assert probe(ResNetCifar(10, (3, 8, 8), depth=8, width=4), (3, 8, 8), 10) is None


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("extra", [[], ["train.autocast=bf16", "model.batch_norm=false"]])
def test_cuda_batched_equals_loop_on_the_mlp(extra):
    """On a GPU (where `auto` batches): the same rows as the loop on the same GPU; in
    float64 (TOL64) without autocast, in float32 at bf16's precision with it (autocast leaves
    float64 alone; see test_bf16_autocast_batched_equals_loop)."""
    if extra:
        assert_same_rows(*MLP_RUN, "train.device=cuda", *extra, tol=2e-2, dtype=torch.float32)
    else:
        assert_same_rows(*MLP_RUN, "train.device=cuda")


@needs_cuda
@needs_subset
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_resnet20_batched_equals_loop(channels_last):
    assert_same_rows(
        *RESNET_RUN, "train.device=cuda", f"train.channels_last={channels_last}", tol=RESNET_TOL64
    )


@needs_cuda
def test_auto_batches_on_a_gpu():
    cfg = compose_config(*MLP_RUN)
    way, line = decide(cfg, preflight(cfg), 4, torch.device("cuda"))
    assert way == "stacked"
    assert line == "4 workers stacked, one forward/backward into their gradient rows (auto: cuda)"
