"""Several workers' forward and backward as one stacked computation, copy-free
(`train.batched_workers`, the `stacked` way).

The W replicas' parameters sit in the rows of `replicas.params` (`[W, D]`) and their gradients
in the rows of `replicas.grads`. `StackedWorkers` takes, for S rows, each parameter's
`[S, *shape]` strided view of the parameter rows as an autograd leaf whose `.grad` is the
same view of the gradient rows, and runs the template model's structure with layers that hold
the S workers' weights as one tensor: linear layers as one batched matrix product (`baddbmm`),
convolutions grouped over workers, BatchNorm with per-worker statistics (workers in channels),
LayerNorm, embeddings and attention per worker. Backward accumulates each parameter's gradient
in place into its view of the gradient rows (autograd's in-place accumulation into an existing
`.grad`): no gradient is copied, unlike a vmapped ensemble, whose gradients come back as
fresh tensors.

Layouts: an activation of S workers is either `rows` (`[S, B, ...]`: linear layers, tokens)
or `channels` (`[B, S·C, H, W]`: convolutions, BatchNorm, pooling — worker s owns channels
s·C … s·C+C−1, so a grouped convolution and a per-channel BatchNorm act per worker). Each layer
asks for the layout it needs; the conversion is one reshape where the model changes from one
to the other (the input, and the flatten before a classifier).

The structure is read from the template module by type: a model is stacked only when every
module in it has a stacked counterpart here (`STACKED_FORWARDS`, exact types, so a subclass that
changes `forward` is not taken for its base) and draws no random numbers in training from
torch's global generator (dropout with p > 0 there would draw other numbers than the loop).
Dropout on the `worker` stream (`models/dropout.py`) runs stacked: at each dropout site, in the
loop's order, row i's mask is drawn from row i's installed generator, so every row gets the
mask its worker draws in the loop or in its own process. `unsupported(model)` says why a model
cannot run stacked (None: it can); `run/batched.py` decides between this, the vmapped ensemble
(the general fallback) and the loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpresearch.data.base import Dataset
from dpresearch.models import dropout as stream
from dpresearch.models import gpt as gpt_model
from dpresearch.models import mlp as small_models
from dpresearch.models import resnet18, resnet_cifar, vgg
from dpresearch.replicas import Replicas
from dpresearch.run.slots import NULL_CONTEXT, slots

ROWS, CHANNELS = "rows", "channels"
# Linear layers with at most this many outputs run their forward as weight @ xᵀ on a CPU
# (measured per worker, 64 × 3072 inputs: 10 outputs 64 µs against 106, 15 outputs 91 against
# 223, 20 outputs 96 against 134; at 16, 32 and 64 outputs the same; wider, x @ weightᵀ is
# ~2% faster).
THIN_OUTPUTS = 32
# A leaf whose `.grad` is a strided view of the gradient rows is the point of this module: the
# accumulation into it is in place; torch's note that the layouts differ from a fresh tensor's
# would repeat at every step.
warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout")


class Unsupported(Exception):
    """The model holds a module (or a setting) with no stacked counterpart."""


@dataclass
class Act:
    """An activation of S workers in one of the two layouts (see the module docstring)."""

    data: Tensor
    layout: str
    workers: int

    def rows(self) -> Tensor:
        """`[S, B, ...]`."""
        if self.layout == ROWS:
            return self.data
        b, sc = self.data.shape[:2]
        s = self.workers
        return self.data.reshape(b, s, sc // s, *self.data.shape[2:]).transpose(0, 1)

    def channels(self) -> Tensor:
        """`[B, S·C, H, W]` (from `rows` `[S, B, C, H, W]`)."""
        if self.layout == CHANNELS:
            return self.data
        s, b, c = self.data.shape[:3]
        return self.data.transpose(0, 1).reshape(b, s * c, *self.data.shape[3:])

    def with_data(self, data: Tensor, layout: str | None = None) -> Act:
        return Act(data, layout or self.layout, self.workers)


class Stack:
    """The S workers' tensors for one call: parameter leaves and buffer views by template
    tensor, and the dispatch of a template module to its stacked forward."""

    def __init__(
        self,
        workers: int,
        leaves: dict[int, Tensor],
        buffers: dict[int, Tensor],
        counters: dict[int, Tensor],
    ) -> None:
        self.workers = workers
        self.leaves, self.buffers, self.counters = leaves, buffers, counters

    def __call__(self, module: nn.Module, x: Act) -> Act:
        return STACKED_FORWARDS[type(module)](self, module, x)

    def param(self, p: Tensor | None) -> Tensor | None:
        """The `[S, *shape]` leaf of template parameter `p` (None stays None)."""
        return None if p is None else self.leaves[id(p)]

    def flat(self, p: Tensor | None) -> Tensor | None:
        """The leaf of `p` with the workers folded into its first dimension (`[S·n, ...]`)."""
        leaf = self.param(p)
        return None if leaf is None else leaf.reshape(-1, *leaf.shape[2:])


# -- layers -----------------------------------------------------------------------------------


class _StackedLinear(torch.autograd.Function):
    """`x @ weightᵀ + bias` for S workers (`x` `[S, M, in]`, `weight` `[S, out, in]`, `bias`
    `[S, out]`), whose backward adds the weight and bias gradients straight into their views
    of the gradient rows (`grads`) as `gradᵀ @ x`: the form autograd would take for a batched
    product, `xᵀ @ grad`, multiplies a transposed operand, which the CPU's batched product runs
    several times slower, and its result would then be added into the rows transposed."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        grads: tuple[Tensor, Tensor | None],
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.grads = grads
        if weight.shape[1] <= THIN_OUTPUTS and x.device.type == "cpu":
            # A few outputs (a classifier): the CPU's product is ~1.6x faster as
            # weight @ xᵀ, the result read transposed.
            xt = x.transpose(1, 2)
            out = (
                torch.bmm(weight, xt)
                if bias is None
                else torch.baddbmm(bias[:, :, None], weight, xt)
            )
            return out.transpose(1, 2)
        transposed = weight.transpose(1, 2)
        return (
            torch.bmm(x, transposed)
            if bias is None
            else torch.baddbmm(bias[:, None], x, transposed)
        )

    @staticmethod
    def backward(ctx: Any, out_grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        weight_grad, bias_grad = ctx.grads
        if out_grad.dtype == x.dtype == weight_grad.dtype:
            # Straight into the rows' views (strided by the row width): on this CPU 0.60 ms
            # against 0.72 for a product then `add_` ([16, 256, 256], batch 32), 2.6 against
            # 4.2 at 64 workers, 1.07 against 1.23 for logistic regression's [16, 10, 3072].
            weight_grad.baddbmm_(out_grad.transpose(1, 2), x)
        else:  # autocast: the product in the forward's precision, accumulated in the rows'
            weight_grad.add_(torch.bmm(out_grad.transpose(1, 2), x.to(out_grad.dtype)))
        if bias_grad is not None:
            bias_grad.add_(out_grad.sum(1))
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return torch.bmm(out_grad, weight.to(out_grad.dtype)), None, None, None


def _linear(stack: Stack, m: nn.Linear, x: Act) -> Act:
    rows = x.rows()
    flat = rows.reshape(stack.workers, -1, rows.shape[-1])
    weight, bias = stack.param(m.weight), stack.param(m.bias)
    grads = (weight.grad, None if bias is None else bias.grad)
    out = _StackedLinear.apply(flat, weight, bias, grads)
    return Act(out.view(*rows.shape[:-1], out.shape[-1]), ROWS, stack.workers)


def _conv2d(stack: Stack, m: nn.Conv2d, x: Act) -> Act:
    out = F.conv2d(
        x.channels(),
        stack.flat(m.weight),
        stack.flat(m.bias),
        m.stride,
        m.padding,
        m.dilation,
        m.groups * stack.workers,
    )
    return Act(out, CHANNELS, stack.workers)


def _batch_norm(stack: Stack, m: nn.modules.batchnorm._BatchNorm, x: Act) -> Act:
    s = stack.workers
    if x.layout == ROWS and x.data.dim() == 3:  # BatchNorm1d on features [S, B, F]
        data = x.data.transpose(0, 1).reshape(x.data.shape[1], -1)
    else:
        data = x.channels()
    training = m.training or m.running_mean is None
    momentum = 0.0 if m.momentum is None else m.momentum
    if m.training and m.track_running_stats and m.num_batches_tracked is not None:
        stack.counters[id(m.num_batches_tracked)].add_(1)
    stats = [
        stack.buffers.get(id(b)) if b is not None else None for b in (m.running_mean, m.running_var)
    ]
    staged = [None if b is None else b.reshape(-1).clone() for b in stats]
    out = F.batch_norm(
        data,
        staged[0],
        staged[1],
        stack.flat(m.weight),
        stack.flat(m.bias),
        training,
        momentum,
        m.eps,
    )
    for view, new in zip(stats, staged, strict=True):
        if view is not None:
            view.copy_(new.view_as(view))
    if x.layout == ROWS and x.data.dim() == 3:
        return Act(out.view(out.shape[0], s, -1).transpose(0, 1), ROWS, s)
    return Act(out, CHANNELS, s)


def _layer_norm(stack: Stack, m: nn.LayerNorm, x: Act) -> Act:
    rows = x.rows()
    out = F.layer_norm(rows, m.normalized_shape, None, None, m.eps)
    expand = (slice(None), *([None] * (rows.dim() - 1 - len(m.normalized_shape))))
    weight, bias = stack.param(m.weight), stack.param(m.bias)
    if weight is not None:
        out = out * weight[expand]
    if bias is not None:
        out = out + bias[expand]
    return Act(out, ROWS, stack.workers)


def _embedding(stack: Stack, m: nn.Embedding, x: Act) -> Act:
    ids = x.rows()
    s, vocab = stack.workers, m.num_embeddings
    offsets = torch.arange(s, device=ids.device).view(s, *([1] * (ids.dim() - 1))) * vocab
    return Act(F.embedding(ids + offsets, stack.flat(m.weight)), ROWS, s)


def _same_layout(stack: Stack, m: nn.Module, x: Act) -> Act:
    """A per-element or per-channel module (activation, pooling): the template module itself
    on either layout."""
    return x.with_data(m(x.data))


def _identity(stack: Stack, m: nn.Module, x: Act) -> Act:
    return x


def _stream_dropout(stack: Stack, m: stream.StreamDropout, x: Act) -> Act:
    """`worker`-stream dropout (`unsupported` refuses the `global` one): each row's mask from
    its own generator, as the loop draws it."""
    if not m.training or m.p == 0:
        return x
    return Act(stream.stream_dropout(x.rows(), m.p, _generators(stack)), ROWS, stack.workers)


def _generators(stack: Stack) -> tuple[torch.Generator, ...] | None:
    generators = stream.installed()
    if generators is not None and len(generators) != stack.workers:
        raise ValueError(
            f"{len(generators)} dropout generators installed for {stack.workers} stacked rows"
        )
    return generators


def _flatten(stack: Stack, m: nn.Flatten, x: Act) -> Act:
    return Act(x.rows().flatten(2), ROWS, stack.workers)


def _sequential(stack: Stack, m: nn.Sequential, x: Act) -> Act:
    for child in m:
        x = stack(child, x)
    return x


def _relu(data: Act) -> Act:
    return data.with_data(F.relu(data.data))


# -- models -----------------------------------------------------------------------------------


def _pad_shortcut(stack: Stack, m: resnet_cifar.PadShortcut, x: Act) -> Act:
    data = x.channels()[:, :, :: m.stride, :: m.stride]
    b, sc, h, w = data.shape
    s = stack.workers
    padded = F.pad(data.reshape(b, s, sc // s, h, w), (0, 0, 0, 0, 0, m.extra_channels))
    return Act(padded.reshape(b, -1, h, w), CHANNELS, s)


def _basic_block(stack: Stack, m: resnet_cifar.BasicBlock, x: Act) -> Act:
    out = _relu(stack(m.bn1, stack(m.conv1, x)))
    out = stack(m.bn2, stack(m.conv2, out))
    return _relu(out.with_data(out.data + stack(m.shortcut, x).channels()))


def _resnet(stack: Stack, m: nn.Module, x: Act) -> Act:
    stages = [m.stem, m.stage1, m.stage2, m.stage3] + ([m.stage4] if hasattr(m, "stage4") else [])
    for stage in stages:
        x = stack(stage, x)
    return stack(m.fc, _flatten(stack, m.pool, stack(m.pool, x)))


def _vgg(stack: Stack, m: vgg.VGG, x: Act) -> Act:
    x = stack(m.pool, stack(m.features, x))
    return stack(m.classifier, _flatten(stack, m.pool, x))


def _mlp(stack: Stack, m: small_models.MLP, x: Act) -> Act:
    return stack(m.net, x)


def _flat_linear(stack: Stack, m: nn.Module, x: Act) -> Act:
    return stack(m.linear, _flatten(stack, m, x))


def _attention(stack: Stack, m: gpt_model.CausalSelfAttention, x: Act) -> Act:
    s, (b, t, c) = stack.workers, x.rows().shape[1:]
    qkv = stack(m.c_attn, x).data.view(s * b, t, 3 * c)
    q, k, v = (
        part.view(s * b, t, m.n_head, c // m.n_head).transpose(1, 2)
        for part in qkv.split(m.n_embd, dim=2)
    )
    if m.drawn():
        y = gpt_model.causal_attention(q, k, v, m.dropout, _generators(stack))
    else:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).reshape(s, b, t, c)
    return stack(m.resid_dropout, stack(m.c_proj, Act(y, ROWS, s)))


def _gpt_mlp(stack: Stack, m: gpt_model.MLP, x: Act) -> Act:
    return stack(m.dropout, stack(m.c_proj, stack(m.gelu, stack(m.c_fc, x))))


def _gpt_block(stack: Stack, m: gpt_model.Block, x: Act) -> Act:
    x = x.with_data(x.data + stack(m.attn, stack(m.ln_1, x)).data)
    return x.with_data(x.data + stack(m.mlp, stack(m.ln_2, x)).data)


def _gpt(stack: Stack, m: gpt_model.GPT, x: Act) -> Act:
    ids = x.rows()
    if ids.is_floating_point() or ids.dim() != 3 or ids.shape[2] > m.block_size:
        raise Unsupported(f"GPT takes token ids [B, T ≤ {m.block_size}]")
    t = ids.shape[2]
    positions = stack.param(m.transformer.wpe.weight)[:, None, :t]
    h = stack(m.transformer.wte, x)
    h = stack(m.transformer.drop, h.with_data(h.data + positions))
    for block in m.transformer.h:
        h = stack(block, h)
    return stack(m.lm_head, stack(m.transformer.ln_f, h))


Forward = Callable[[Stack, Any, Act], Act]
STACKED_FORWARDS: dict[type, Forward] = {
    nn.Linear: _linear,
    nn.Conv2d: _conv2d,
    nn.BatchNorm1d: _batch_norm,
    nn.BatchNorm2d: _batch_norm,
    nn.LayerNorm: _layer_norm,
    nn.Embedding: _embedding,
    nn.ReLU: _same_layout,
    nn.GELU: _same_layout,
    nn.MaxPool2d: _same_layout,
    nn.AvgPool2d: _same_layout,
    nn.AdaptiveAvgPool2d: _same_layout,
    nn.Dropout: _identity,  # p = 0 only (`unsupported`)
    stream.StreamDropout: _stream_dropout,
    nn.Identity: _identity,
    nn.Flatten: _flatten,
    nn.Sequential: _sequential,
    resnet_cifar.PadShortcut: _pad_shortcut,
    resnet_cifar.BasicBlock: _basic_block,
    resnet_cifar.ResNetCifar: _resnet,
    resnet18.ResNet18: _resnet,
    vgg.VGG: _vgg,
    small_models.MLP: _mlp,
    small_models.LogisticRegression: _flat_linear,
    small_models.Linear: _flat_linear,
    gpt_model.CausalSelfAttention: _attention,
    gpt_model.MLP: _gpt_mlp,
    gpt_model.Block: _gpt_block,
    gpt_model.GPT: _gpt,
}
# Containers the model forwards above walk themselves.
_WALKED = (nn.ModuleDict, nn.ModuleList)


def unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot run stacked (None: it can)."""
    for name, m in model.named_modules():
        where = name or "the model"
        if type(m) not in STACKED_FORWARDS and not isinstance(m, _WALKED):
            return f"{where} ({type(m).__name__}) has no stacked counterpart"
        if getattr(m, "dropout_stream", None) == stream.GLOBAL and (
            getattr(m, "p", 0) > 0 or getattr(m, "dropout", 0) > 0
        ):
            return (
                f"{where} draws dropout masks from torch's global generator "
                "(model.dropout_stream=global), which stacked rows would draw differently; "
                "model.dropout_stream=worker runs stacked"
            )
        if type(m) is nn.Dropout and m.p > 0:
            return (
                f"{where} draws dropout masks (p={m.p}), which stacked rows would draw differently"
            )
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None:
            return f"{where} averages its statistics cumulatively (momentum=None)"
        if isinstance(m, nn.Conv2d) and m.padding_mode != "zeros":
            return f"{where} pads with {m.padding_mode!r}"
        if isinstance(m, nn.Flatten) and (m.start_dim, m.end_dim) != (1, -1):
            return f"{where} flattens dimensions {m.start_dim}…{m.end_dim}"
    return None


# -- the computation --------------------------------------------------------------------------


class StackedWorkers:
    """Forward and backward of rows of `replicas` as one stacked computation (the contract of
    `run/batched.py:BatchedWorkers.run`). `loss_fn(outputs, targets)` is the per-row loss."""

    def __init__(
        self, replicas: Replicas, loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy
    ) -> None:
        reason = unsupported(replicas.models[0])
        if reason is not None:
            raise Unsupported(reason)
        self.replicas = replicas
        self.template = replicas.models[0]
        self.loss_fn = loss_fn
        self._cross_entropy = loss_fn is F.cross_entropy or (
            getattr(loss_fn, "__func__", None) is Dataset.loss
        )
        self.params, self.floats, self.ints = slots(replicas)
        named = dict(self.template.named_parameters())
        self._param_ids = [id(named[s.name]) for s in self.params]
        buffers = dict(self.template.named_buffers())
        self._float_ids = [id(buffers[s.name]) for s in self.floats]
        self._int_ids = [id(buffers[s.name]) for s in self.ints]
        self._stacks: dict[tuple[int, int], Stack] = {}
        # Rows that are not consecutive are computed on copies gathered into these (parameters,
        # float and integer buffers, gradients), grown to the most rows a call has taken: a
        # fresh tensor each call would pay the page faults of a new allocation every time.
        self._staging: list[Tensor] = []

    def _staged(self, count: int) -> list[Tensor]:
        """`[count, …]` staging rows for the parameters, float buffers, integer buffers and
        gradients."""
        reps = self.replicas
        if not self._staging or self._staging[0].shape[0] < count:
            self._staging = [
                t.new_empty((count, t.shape[1]))
                for t in (reps.params, reps.buffers, reps.int_buffers, reps.grads)
            ]
        return [t[:count] for t in self._staging]

    def _stack(self, params: Tensor, grads: Tensor, floats: Tensor, ints: Tensor) -> Stack:
        """A `Stack` over the rows `params`/`grads`/`floats`/`ints` (`[S, …]` each)."""
        leaves = {}
        for slot, key in zip(self.params, self._param_ids, strict=True):
            leaf = slot.view(params).detach().requires_grad_(True)
            leaf.grad = slot.view(grads)
            leaves[key] = leaf
        return Stack(
            params.shape[0],
            leaves,
            {k: s.view(floats) for s, k in zip(self.floats, self._float_ids, strict=True)},
            {k: s.view(ints) for s, k in zip(self.ints, self._int_ids, strict=True)},
        )

    def _losses(self, out: Tensor, y: Tensor) -> Tensor:
        """Each row's loss `[S]` of outputs `out` `[S, B, C]` on targets `y` `[S, B]`:
        cross-entropy as one call over all rows' examples, each row's mean of its own (the
        same gradient as a call per row: each example's weight is 1/B either way); any other
        loss one call per row."""
        if self._cross_entropy and out.dim() == 3 and y.dim() == 2:
            by_class = out.transpose(1, 2)
            if by_class.is_contiguous():  # a thin classifier's `[S, C, B]` output: softmax
                each = F.cross_entropy(by_class, y, reduction="none")  # along B, vectorised
            else:
                each = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")
            return each.view(out.shape[0], -1).mean(1)
        return torch.stack([self.loss_fn(out[i], y[i]) for i in range(out.shape[0])])

    def run(
        self, rows: Sequence[int], x: Tensor, y: Tensor, autocast: Any = None, scale: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        """`BatchedWorkers.run`'s contract: `rows` ascending, `x`/`y` `[S, B, ...]`; each
        row's gradient overwrites its row of `replicas.grads`, its buffers are updated; the
        per-row losses `[S]` and outputs `[S, B, ...]` come back detached."""
        reps = self.replicas
        lo, hi = rows[0], rows[-1] + 1
        contiguous = hi - lo == len(rows)
        if contiguous:
            key = (lo, hi)
            if key not in self._stacks:
                views = (
                    t[lo:hi] for t in (reps.params, reps.grads, reps.buffers, reps.int_buffers)
                )
                self._stacks[key] = self._stack(*views)
            stack = self._stacks[key]
            reps.grads[lo:hi].zero_()
        else:
            index = torch.tensor(rows, device=reps.params.device)
            *gathered, grads = self._staged(len(rows))
            for source, staged in zip(
                (reps.params, reps.buffers, reps.int_buffers), gathered, strict=False
            ):
                if staged.numel():
                    torch.index_select(source, 0, index, out=staged)
            stack = self._stack(gathered[0], grads.zero_(), gathered[1], gathered[2])
        with autocast if autocast is not None else NULL_CONTEXT:
            out = stack(self.template, Act(x, ROWS, len(rows))).rows()
            losses = self._losses(out, y)
        total = losses.sum()
        (total * scale if scale != 1.0 else total).backward()
        if not contiguous:
            reps.grads.index_copy_(0, index, grads)
            for target, staged in zip((reps.buffers, reps.int_buffers), gathered[1:], strict=True):
                if staged.numel():
                    target.index_copy_(0, index, staged)
        return losses.detach(), out.detach()
