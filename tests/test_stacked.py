"""Stacked workers (issue 31, item 1): every shipped model family run as one stacked
forward/backward over the workers' parameter rows (`run/stacked.py`) gives each row the loop's
gradient, BatchNorm statistics and `num_batches_tracked`, its gradient written into the
gradient rows themselves (no copy), any subset of rows, channels-last, autocast; models the
stacked layers do not know say why (exact types, dropout from torch's generator, cumulative
BatchNorm); dropout on the per-worker stream runs stacked (`tests/test_dropout_stream.py`).

In float64: the stacked kernels (a batched product, a grouped convolution, BatchNorm over all
workers' channels at once) compute each worker's numbers with the loop's arithmetic, most of
them bit for bit; where a kernel blocks its sums differently the gap is a few float64 ulps
(≤ 1e-15 relative, measured), so TOL64 (1e-9 relative to the largest gradient) is six orders
above it and far below what a wrong row, layer or worker offset moves (≥ 1e-3). The whole
training runs of every algorithm: `tests/test_batched.py`; the GPT on text:
`tests/test_lm_workload.py`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TOL64
from torch import nn

from dpresearch.models.gpt import GPT
from dpresearch.models.mlp import MLP, Linear, LogisticRegression
from dpresearch.models.resnet18 import ResNet18
from dpresearch.models.resnet_cifar import ResNetCifar
from dpresearch.models.vgg import VGG
from dpresearch.replicas import Replicas
from dpresearch.run.stacked import THIN_OUTPUTS, StackedWorkers, Unsupported, unsupported


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def images(rows: int, batch: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, batch, 3, side, side, generator=g, dtype=torch.float64)
    return x, torch.randint(10, (rows, batch), generator=g)


def tokens(rows: int, batch: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(vocab, (rows, batch, length + 1), generator=g)
    return ids[..., :-1], ids[..., 1:]


# name: (model, inputs of 3 rows, loss); small sizes of every shipped family
CASES = {
    "mlp": (lambda: MLP(10, (3, 4, 4), hidden=(16, 8)), lambda: images(3, 5, 4), F.cross_entropy),
    "mlp_batchnorm": (lambda: MLP(10, (3, 4, 4), hidden=(16,), batch_norm=True),
                      lambda: images(3, 5, 4), F.cross_entropy),
    "logreg": (lambda: LogisticRegression(10, (3, 4, 4)), lambda: images(3, 5, 4),
               F.cross_entropy),
    "linear": (lambda: Linear(10, (3, 4, 4), bias=True, zero_init=False),
               lambda: images(3, 5, 4), F.cross_entropy),
    "resnet8_A": (lambda: ResNetCifar(10, (3, 8, 8), depth=8, width=4),
                  lambda: images(3, 4, 8), F.cross_entropy),
    "resnet8_B": (lambda: ResNetCifar(10, (3, 8, 8), depth=8, width=4, shortcut="B"),
                  lambda: images(3, 4, 8), F.cross_entropy),
    "resnet18": (lambda: ResNet18(10, (3, 8, 8)), lambda: images(3, 2, 8), F.cross_entropy),
    "vgg11": (lambda: VGG(10, (3, 32, 32), depth=11), lambda: images(3, 2, 32), F.cross_entropy),
    "gpt": (lambda: GPT(17, (8,), n_layer=2, n_head=2, n_embd=16, bias=True),
            lambda: tokens(3, 3, 8, 17), lm_loss),
}  # fmt: skip
SLOW = {"resnet18", "vgg11"}


def pair(model: nn.Module, rows: int, channels_last: bool = False) -> tuple[Replicas, Replicas]:
    """Two identical sets of `rows` replicas of `model` in float64, every row different."""
    model = model.double()
    loop, stacked = (Replicas(model, rows, torch.device("cpu"), channels_last) for _ in range(2))
    noise = (
        torch.randn(
            loop.params.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64
        )
        * 1e-2
    )
    with torch.no_grad():
        for reps in (loop, stacked):
            reps.params.add_(noise)
            reps.grads.fill_(5.0)  # the computed rows' gradients are overwritten
    return loop, stacked


def loop_rows(reps: Replicas, rows: list[int], x, y, loss_fn) -> None:
    for i, w in enumerate(rows):
        reps.grads[w].zero_()
        loss_fn(reps.models[w](x[i]), y[i]).backward()


def assert_rows_equal(loop: Replicas, stacked: Replicas) -> None:
    scale = loop.grads.abs().max().item()
    assert (loop.grads - stacked.grads).abs().max().item() <= TOL64 * scale
    if loop.buffers.numel():
        assert (loop.buffers - stacked.buffers).abs().max().item() <= TOL64
    assert torch.equal(loop.int_buffers, stacked.int_buffers)
    assert torch.equal(loop.params, stacked.params)  # a forward never moves the parameters


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES]
)
def test_every_shipped_family_stacked_equals_the_loop(name, one_thread):
    make, data, loss_fn = CASES[name]
    model = make()
    assert unsupported(model) is None
    loop, stacked = pair(model, 3)
    x, y = data()
    x = x.double() if x.is_floating_point() else x
    loop_rows(loop, [0, 1, 2], x, y, loss_fn)
    losses, out = StackedWorkers(stacked, loss_fn).run([0, 1, 2], x, y)
    assert_rows_equal(loop, stacked)
    if loop.int_buffers.numel():
        assert loop.int_buffers.min() == 1
    assert losses.shape == (3,) and out.shape[:2] == (3, x.shape[1])
    for w in range(3):  # each row's loss is its own batch's, as the loop computes it
        expected = loss_fn(loop.models[w](x[w]), y[w]).item()
        assert losses[w].item() == pytest.approx(expected, rel=1e-12)


def test_gradients_land_in_the_rows_without_a_copy(one_thread):
    """The leaves' gradients are views of `replicas.grads`: after a step the rows hold them,
    and a second step reuses the same storage (nothing allocated per parameter)."""
    loop, stacked = pair(CASES["resnet8_A"][0](), 2)
    x, y = images(2, 4, 8)
    workers = StackedWorkers(stacked)
    for _ in range(2):
        workers.run([0, 1], x, y)
    stack = workers._stacks[(0, 1 + 1)]
    base = stacked.grads.untyped_storage().data_ptr()
    assert all(leaf.grad.untyped_storage().data_ptr() == base for leaf in stack.leaves.values())
    loop_rows(loop, [0, 1], x, y, F.cross_entropy)
    loop_rows(loop, [0, 1], x, y, F.cross_entropy)
    assert_rows_equal(loop, stacked)


@pytest.mark.parametrize("rows", [[0, 2], [1], [1, 3], [0, 1, 2, 3]])
def test_any_subset_of_rows_computes_as_the_loop_and_leaves_the_others(rows, one_thread):
    loop, stacked = pair(CASES["resnet8_A"][0](), 4)
    x, y = images(len(rows), 4, 8)
    loop_rows(loop, rows, x, y, F.cross_entropy)
    StackedWorkers(stacked).run(rows, x, y)
    assert_rows_equal(loop, stacked)
    others = [w for w in range(4) if w not in rows]
    assert all((stacked.grads[w] == 5.0).all() for w in others)
    assert (stacked.int_buffers[others] == 0).all() and stacked.int_buffers[rows].min() == 1


def test_channels_last_rows_stack_as_the_loop(one_thread):
    loop, stacked = pair(CASES["resnet8_B"][0](), 3, channels_last=True)
    x, y = images(3, 4, 8)
    x = x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x
    loop_rows(loop, [0, 1, 2], x, y, F.cross_entropy)
    StackedWorkers(stacked).run([0, 1, 2], x, y)
    assert_rows_equal(loop, stacked)


def test_bf16_autocast_stacks_as_the_loop(one_thread):
    """bf16 rounds every product to 8 bits; the stacked products round the same values in
    another blocking: 2e-2 of the largest gradient is a few bf16 ulps (2^-8 ≈ 4e-3)."""
    model = GPT(17, (8,), n_layer=1, n_head=2, n_embd=16)
    loop, stacked = (Replicas(model, 2, torch.device("cpu")) for _ in range(2))
    x, y = tokens(2, 3, 8, 17)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loop_rows(loop, [0, 1], x, y, lm_loss)
    StackedWorkers(stacked, lm_loss).run([0, 1], x, y, torch.autocast("cpu", dtype=torch.bfloat16))
    scale = loop.grads.abs().max().item()
    assert scale > 0 and (loop.grads - stacked.grads).abs().max().item() <= 2e-2 * scale


class Subclassed(MLP):
    """A shipped class with its forward changed: not taken for its base."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


@pytest.mark.parametrize(
    ("model", "says"),
    [
        (
            GPT(17, (8,), n_layer=1, n_head=2, n_embd=16, dropout=0.1, dropout_stream="global"),
            "dropout_stream=global",
        ),
        (nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.1)), "draws dropout masks (p=0.1)"),
        (Subclassed(10, (4,)), "Subclassed) has no stacked counterpart"),
        (nn.Sequential(nn.Linear(4, 3), nn.Tanh()), "(Tanh) has no stacked counterpart"),
        (nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, momentum=None)), "cumulatively"),
    ],
)
def test_a_model_the_stacked_layers_do_not_know_says_why(model, says):
    reason = unsupported(model)
    assert reason is not None and says in reason and "\n" not in reason
    with pytest.raises(Unsupported, match="stacked|dropout|cumulatively"):
        StackedWorkers(Replicas(model, 2, torch.device("cpu")))


@pytest.mark.parametrize(("hidden", "classes"), [(64, 10), (64, 40)])
def test_thin_layers_run_class_major_and_equal_the_loop(hidden, classes, one_thread):
    """A linear layer with at most `THIN_OUTPUTS` outputs computes weight @ xᵀ on a CPU (its
    output `[S, B, C]` a transposed view of `[S, C, B]`), a wider one x @ weightᵀ: either way
    each row's gradient and loss are the loop's. Cross-entropy over the thin output runs as
    one call over the classes of `[S, C, B]`: its vectorised log-softmax rounds its last bit
    differently from the loop's (TOL64); over the wider one, as one call over all rows'
    examples `[S·B, C]`, whose gradient is the loop's bit for bit (1/B per example either
    way)."""
    thin = classes <= THIN_OUTPUTS
    loop, stacked = pair(MLP(classes, (3, 4, 4), hidden=(hidden,)), 4)
    x, y = images(3, 5, 4)
    y = y * classes // 10  # every class index in range, some above 10
    rows = [0, 1, 3]
    loop_rows(loop, rows, x, y, F.cross_entropy)
    losses, out = StackedWorkers(stacked, F.cross_entropy).run(rows, x, y)
    assert out.transpose(1, 2).is_contiguous() is thin and out.is_contiguous() is not thin
    assert_rows_equal(loop, stacked)
    _, per_row = pair(MLP(classes, (3, 4, 4), hidden=(hidden,)), 4)
    per_row.params.copy_(stacked.params)
    each = StackedWorkers(per_row, lambda o, t: F.cross_entropy(o, t))  # a call per row
    per_row_losses, _ = each.run(rows, x, y)
    if thin:
        scale = per_row.grads.abs().max().item()
        assert (per_row.grads - stacked.grads).abs().max().item() <= TOL64 * scale
    else:
        assert torch.equal(per_row.grads, stacked.grads)
    for w, i in zip(rows, range(3), strict=True):
        expected = F.cross_entropy(loop.models[w](x[i]), y[i]).item()
        assert losses[i].item() == pytest.approx(expected, rel=1e-12)
        assert per_row_losses[i].item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", ["mlp_batchnorm", "resnet8_B"])
def test_rows_not_consecutive_compute_on_reused_staging(name, one_thread):
    """Rows that are not consecutive are gathered into staging rows grown once to the most
    rows a call took (no allocation per call) and written back: each call gives the loop's
    gradients, buffers and counters, and leaves the other rows as they were (ResNet-8 with
    channels-last rows: the staged views keep the rows' layout)."""
    loop, stacked = pair(CASES[name][0](), 6, channels_last=name == "resnet8_B")
    workers = StackedWorkers(stacked)
    pointers = []
    for rows in ([0, 2, 5], [1, 4], [0, 3, 5], [2, 4]):
        x, y = images(len(rows), 5, 4) if name == "mlp_batchnorm" else images(len(rows), 4, 8)
        with torch.no_grad():
            loop.grads.fill_(5.0)
            stacked.grads.fill_(5.0)
        loop_rows(loop, rows, x, y, F.cross_entropy)
        workers.run(rows, x, y)
        assert_rows_equal(loop, stacked)
        others = [w for w in range(6) if w not in rows]
        assert (stacked.grads[others] == 5.0).all()
        pointers.append([t.data_ptr() for t in workers._staging])
    assert all(p == pointers[0] for p in pointers)
    assert workers._staging[0].shape[0] == 3  # grown to the largest call, not to every row
