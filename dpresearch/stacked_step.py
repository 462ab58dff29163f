"""Every local worker's optimizer step as one call per parameter group over the stacked rows.

The W local workers' parameters and gradients tile the rows of two flat `[W, D]` tensors
(`Replicas.params`, `.grads`). Where the W optimizers are the same class with the same
hyper-parameters group by group (`torch.optim.SGD`, `Adam`, `AdamW`, `muon.MuonAdamW`), their
step is one call of torch's own functional update (`torch.optim.sgd.sgd`, `torch.optim.adam.adam`;
for MuonAdamW's Muon groups its momentum and a batched Newton–Schulz, `muon.newton_schulz`) per
group, over the group's column runs of all W rows at once — `[W, n]` slices of the flat rows —
instead of one call (and one pass through the optimizer's Python) per parameter per worker.

The rows are the state. Each group's state (SGD's `momentum_buffer`, Adam's `exp_avg` and
`exp_avg_sq`, Muon's `momentum_buffer`) is one packed `[W, n_g]` tensor per key, and every
parameter's entry in its optimizer's ordinary `state[p]` is a view of it with the parameter's
own shape and strides; Adam's per-parameter `step` counters are 0-d views of one `[W, P_g]`
tensor (on the CPU, where torch keeps them). So `state_dict`, a checkpoint, a fragment's reset
(`state.pop`) and `average_optimizer_state` (in place) see ordinary per-parameter state. State
from elsewhere (a loaded checkpoint, a step taken one by one) is copied into fresh packed
tensors first; a group where only some parameters have state (just reset), or whose step
counters disagree, leaves the whole step to each optimizer's own `step()`.

Equality with each optimizer's own step: torch's per-tensor and multi-tensor updates are
elementwise, so running them on `[W, n]` slices does the same arithmetic on every element —
bit for bit (tested) — with the multi-tensor kernels where torch would pick them (an
accelerator) and per tensor where it would (a CPU). Muon's orthogonalisation is a matrix
function: `newton_schulz` runs all workers' same-shape matrices as one batched product, within
the rounding of its bfloat16 products of torch's per-matrix one (see `muon.py`).
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import optimizer as _torch_optimizer

from dpresearch.muon import MuonAdamW, adjusted_lr, newton_schulz

# Group keys that never take part in the comparison of the workers' groups.
_NOT_HYPER = ("params", "initial_lr")


def step_together(
    optimizers: Sequence[torch.optim.Optimizer], rows: FlatRows | None = None
) -> None:
    """`opt.step()` for every optimizer in `optimizers` (one per local worker, or a single
    one: an asynchronous event's, an outer step's). Where they are all the same supported
    class (`stackable`) and `rows` says their parameters and gradients tile the rows of two
    flat tensors (`Replicas`; one worker's: `FlatRows.of_row`), one functional call per
    parameter group on the rows (`FlatRows.step`). Plain SGD without rows: one multi-tensor
    call per group over every worker's parameters. Otherwise one by one. The same result as
    one by one (bit for bit; Muon's groups within their stated rounding)."""
    kind = stackable(optimizers)
    if kind is not None and rows is not None and rows.step(optimizers):
        return
    if kind is torch.optim.SGD:
        _sgd_lists(optimizers)
        return
    for opt in optimizers:
        opt.step()


def step_dtype() -> torch.dtype:
    """The dtype torch's (non-fused) Adam and AdamW keep a step count in: float64 under a
    float64 default dtype, else float32 (so a packed state loads into theirs as it is)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def stackable(optimizers: Sequence[torch.optim.Optimizer]) -> type | None:
    """The common class of `optimizers` where their steps may run together: all exactly one
    of `SGD`, `Adam`, `AdamW`, `MuonAdamW`, none with hooks (their own or torch's global
    ones), fused, capturable, differentiable or AMSGrad steps or a tensor lr, with the same
    number of groups and the same hyper-parameters group by group; else None."""
    hooks = _torch_optimizer
    if hooks._global_optimizer_pre_hooks or hooks._global_optimizer_post_hooks:
        return None
    first = optimizers[0]
    kind = type(first)
    if kind not in _KINDS:
        return None
    groups = first.param_groups
    hyper = [[k for k in group if k not in _NOT_HYPER] for group in groups]
    for opt in optimizers:
        if type(opt) is not kind or len(opt.param_groups) != len(groups):
            return None
        if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
            return None
        for group, reference, keys in zip(opt.param_groups, groups, hyper, strict=True):
            if any(map(group.get, _UNSUPPORTED)) or isinstance(group["lr"], Tensor):
                return None
            if opt is not first and any(
                map(operator.ne, map(group.get, keys), map(reference.get, keys))
            ):
                return None
    return kind


_UNSUPPORTED = ("fused", "capturable", "differentiable", "amsgrad")


def _sgd_lists(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Plain SGD, each group of all optimizers as one functional call over every worker's
    parameter tensors (no flat rows: e.g. parameters outside `Replicas`)."""
    from torch.optim.sgd import sgd

    with torch.no_grad():
        for groups in zip(*(opt.param_groups for opt in optimizers), strict=True):
            params: list[Tensor] = []
            grads: list[Tensor] = []
            buffers: list[Tensor | None] = []
            states: list[dict] = []
            first = groups[0]
            for opt, group in zip(optimizers, groups, strict=True):
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise ValueError("step_together: sparse gradients are not supported")
                    params.append(p)
                    grads.append(p.grad)
                    if first["momentum"] != 0:  # as SGD: no state entry without momentum
                        state = opt.state[p]
                        buffers.append(state.get("momentum_buffer"))
                        states.append(state)
                    else:
                        buffers.append(None)
            sgd(
                params,
                grads,
                buffers,
                foreach=True,
                weight_decay=first["weight_decay"],
                momentum=first["momentum"],
                lr=first["lr"],
                dampening=first["dampening"],
                nesterov=first["nesterov"],
                maximize=first["maximize"],
            )
            if first["momentum"] != 0:
                for state, buffer in zip(states, buffers, strict=True):
                    state["momentum_buffer"] = buffer


# -- one group of all workers on the rows ---------------------------------------------------------


@dataclass
class Span:
    """One parameter group of all W optimizers on the rows: its column `runs` (`(start, end)`
    within a row, the same in every row; maximal, so one group alone on an accelerator is one
    run `(0, D)`, on a CPU cut into cache-sized pieces),
    `pairs` (optimizer, parameter, its gradient, row, column) over all rows, the group's
    packed state (`state[key]`: `[W, n]`, the runs side by side) and step counters."""

    runs: list[tuple[int, int]]
    pairs: list[tuple[torch.optim.Optimizer, Tensor, Tensor, int, int]]
    params: list[Tensor]  # the runs of the parameter rows, `[W, end - start]` each
    grads: list[Tensor]
    state: dict[str, Tensor] = field(default_factory=dict)
    views: dict[str, list[Tensor]] = field(default_factory=dict)  # per pair, per key
    steps: Tensor | None = None  # `[W, P]` float32 on the CPU: each parameter's counter
    step_views: list[Tensor] = field(default_factory=list)
    run_counts: Tensor | None = None  # the functional's counters, one per run
    run_steps: list[Tensor] = field(default_factory=list)  # ... as 0-d views

    @property
    def width(self) -> int:
        return sum(end - start for start, end in self.runs)

    def state_runs(self, key: str) -> list[Tensor]:
        """The runs of packed state `key` (`[W, n_run]` each), in the order of `runs`."""
        packed, out, at = self.state[key], [], 0
        for start, end in self.runs:
            out.append(packed[:, at : at + end - start])
            at += end - start
        return out

    def packed_column(self, col: int) -> int:
        """The column of a packed `[W, n]` tensor that holds column `col` of the rows."""
        i = bisect.bisect_right(self.runs, (col, math.inf)) - 1
        start, _ = self.runs[i]
        return sum(end - begin for begin, end in self.runs[:i]) + col - start

    def packed_views(self, packed: Tensor) -> list[Tensor]:
        """Each pair's view of a packed `[W, n]` tensor: its parameter's shape and strides at
        the parameter's place in its run."""
        base, width = packed.storage_offset(), packed.stride(0)
        return [
            packed.as_strided(p.shape, p.stride(), base + row * width + self.packed_column(col))
            for _, p, _, row, col in self.pairs
        ]

    def matrices(self, params: Tensor, packed: Tensor) -> dict[tuple[int, ...], tuple[list, list]]:
        """Per matrix shape: (the `[W, m, n]` views of the parameter rows `params`, the same
        views of a packed `[W, n]` tensor), one of each per parameter of that shape in a row."""
        out: dict[tuple[int, ...], tuple[list, list]] = {}
        first_row = self.pairs[0][3]
        for _, p, _, row, col in self.pairs:
            if row != first_row:
                continue
            shape, stride = tuple(p.shape), p.stride()
            size = (params.shape[0], *shape)
            targets, sources = out.setdefault(shape, ([], []))
            at = params.storage_offset() + col
            targets.append(params.as_strided(size, (params.stride(0), *stride), at))
            at = packed.storage_offset() + self.packed_column(col)
            sources.append(packed.as_strided(size, (packed.stride(0), *stride), at))
        return out


class FlatRows:
    """The flat `[W, D]` parameter and gradient rows (`Replicas.params`, `.grads`) that W
    optimizers' parameters view — worker w's parameters, each dense, in row w — so that
    their step runs as one functional call per parameter group on column runs of the two
    tensors (see the module docstring for the state layout and the equality)."""

    def __init__(self, params: Tensor, grads: Tensor) -> None:
        self.params, self.grads = params, grads
        # torch's own default: multi-tensor on an accelerator, per tensor on a CPU (where the
        # multi-tensor kernels fall back to the same per-tensor ops after grouping them)
        self._foreach = params.device.type != "cpu"
        # On a CPU the per-tensor kernels pass over a tensor once per operation (Adam: eight),
        # so runs are cut into pieces of at most this many elements (all rows together) that
        # stay in cache across them: ~3x faster than whole rows for a 1.8 M-parameter model
        # (pieces of 2**15 to 2**22 elements measured: 2**18 fastest). Elementwise: the same
        # numbers.
        self._piece = CPU_PIECE if params.device.type == "cpu" else 0
        self._for: tuple[int, ...] = ()  # the optimizers the check below was made for
        self.spans: list[Span] = []
        self._params: list[Tensor] = []  # every parameter checked, and its gradient
        self._grads: list[Tensor] = []

    @classmethod
    def of_row(cls, params: Tensor, grads: Tensor, row: int) -> FlatRows:
        """The flat rows of one worker: row `row` of `params` and `grads` (`[1, D]` views),
        for its optimizer stepping alone (`step_together([optimizer], ...)`)."""
        return cls(params[row : row + 1], grads[row : row + 1])

    @property
    def momentum(self) -> Tensor | None:
        """The first group's packed momentum buffer (SGD, Muon), None before it exists."""
        return self.spans[0].state.get("momentum_buffer") if self.spans else None

    def step(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """One step of all `optimizers` (checked `stackable`) on the rows, group by group;
        False, having changed nothing, where the rows do not apply (parameters not tiling
        them, a gradient replaced, state present for only some parameters of a group)."""
        kind = type(optimizers[0])
        if not self._tile(optimizers):
            return False
        groups = optimizers[0].param_groups
        with torch.no_grad():
            for span, group in zip(self.spans, groups, strict=True):
                if not _ready(span, kind, group):
                    return False
            for span, group in zip(self.spans, groups, strict=True):
                _STEPS[kind](self, span, group)
        return True

    def foreach(self, group: dict[str, Any]) -> bool:
        """The group's own `foreach` where it sets one, else torch's default for the device."""
        chosen = group.get("foreach")
        return self._foreach if chosen is None else bool(chosen)

    # -- the layout check ---------------------------------------------------------------------
    def _tile(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Whether every optimizer's parameters are dense views of its row of `params` whose
        gradients are the same views of `grads`, each group on the same columns in every row
        (checked once per set of optimizers; then only that every gradient is still the view
        it was)."""
        key = tuple(id(opt) for opt in optimizers)
        if key != self._for:
            self._for, self.spans = key, self._check(optimizers)
            self._params = [p for s in self.spans for _, p, _, _, _ in s.pairs]
            self._grads = [g for s in self.spans for _, _, g, _, _ in s.pairs]
        # (per step, K·P identity checks: in C, map over operator.is_, not a Python loop)
        return bool(self.spans) and _same(list(map(_GRAD, self._params)), self._grads)

    def _check(self, optimizers: Sequence[torch.optim.Optimizer]) -> list[Span]:
        params, grads = self.params, self.grads
        if (
            params.dim() != 2
            or params.shape != grads.shape
            or len(optimizers) != len(params)
            or not (params.is_contiguous() and grads.is_contiguous())
        ):
            return []
        width, base, grad_base = params.shape[1], params.storage_offset(), grads.storage_offset()
        p_store, g_store = params.untyped_storage().data_ptr(), grads.untyped_storage().data_ptr()
        spans = []
        for g_index in range(len(optimizers[0].param_groups)):
            pairs, layouts = [], []
            for w, opt in enumerate(optimizers):
                layout = []
                for p in opt.param_groups[g_index]["params"]:
                    g = p.grad
                    if (
                        g is None
                        or p.untyped_storage().data_ptr() != p_store
                        or g.untyped_storage().data_ptr() != g_store
                        or p.stride() != g.stride()
                        or p.shape != g.shape
                        or p.storage_offset() - base != g.storage_offset() - grad_base
                        or _span(p) != p.numel()
                    ):
                        return []
                    col = p.storage_offset() - base - w * width
                    if not 0 <= col <= width - p.numel():
                        return []
                    layout.append((col, p.numel(), tuple(p.shape), p.stride()))
                    pairs.append((opt, p, g, w, col))
                layouts.append(sorted(layout))
            if any(layout != layouts[0] for layout in layouts):
                return []  # the group sits elsewhere in another row
            runs: list[tuple[int, int]] = []
            for col, numel, _, _ in layouts[0]:
                if runs and runs[-1][1] > col:
                    return []  # overlapping parameters
                if runs and runs[-1][1] == col:
                    runs[-1] = (runs[-1][0], col + numel)
                else:
                    runs.append((col, col + numel))
            if not runs:
                return []
            if self._piece:
                runs = _pieces(runs, max(1, self._piece // len(params)))
            spans.append(
                Span(
                    runs, pairs, [params[:, a:b] for a, b in runs], [grads[:, a:b] for a, b in runs]
                )
            )
        return spans


CPU_PIECE = 2**18


def _pieces(runs: list[tuple[int, int]], width: int) -> list[tuple[int, int]]:
    """`runs` cut into consecutive pieces of at most `width` columns."""
    return [(a, min(a + width, end)) for start, end in runs for a in range(start, end, width)]


def _span(t: Tensor) -> int:
    """Elements between a tensor's first and last (inclusive): its numel when it is dense."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


# -- state ----------------------------------------------------------------------------------------


def _state_keys(kind: type, group: dict[str, Any]) -> tuple[str, ...]:
    """The dense per-parameter state a group of `kind` keeps."""
    if kind is torch.optim.SGD:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()
    if kind is MuonAdamW and group["use_muon"]:
        return ("momentum_buffer",)
    return ("exp_avg", "exp_avg_sq")


def _counted(kind: type, group: dict[str, Any]) -> bool:
    """Whether a group of `kind` keeps torch's per-parameter `step` counter."""
    return kind is not torch.optim.SGD and not (kind is MuonAdamW and group["use_muon"])


def _ready(span: Span, kind: type, group: dict[str, Any]) -> bool:
    """Make the span's state the packed tensors bound into every optimizer's `state[p]`:
    kept where the bound views are still there; copied from whatever is there (every key for
    every parameter, equal step counts); created where no parameter has state yet (zeros and
    a zero count, as torch's lazy state; SGD's momentum is made by its first step). False
    where only some parameters have it or the counts differ."""
    keys, counted = _state_keys(kind, group), _counted(kind, group)
    if not keys:
        return True
    states = [opt.state.get(p) for opt, p, _, _, _ in span.pairs]
    found = {k: [s.get(k) if s else None for s in states] for k in keys}
    steps_found = [s.get("step") if s else None for s in states] if counted else []
    if (
        span.views
        and all(_same(found[k], span.views[k]) for k in keys)
        and (_same(steps_found, span.step_views))
    ):
        # a step taken one by one meanwhile advanced the bound counters in place: equal still?
        return not counted or bool((span.steps == span.steps.view(-1)[0]).all())  # type: ignore[union-attr]
    span.state, span.views, span.steps, span.step_views = {}, {}, None, []
    rows, width = span.params[0].shape[0], span.width
    new = span.params[0].new_zeros
    if all(not s for s in states):
        if kind is not torch.optim.SGD:
            for key in keys:
                _bind(span, key, new(rows, width))
        if counted:
            _bind_steps(span, torch.zeros(rows, len(span.pairs) // rows, dtype=step_dtype()))
        return True
    if any(v is None for k in keys for v in found[k]) or (
        counted and any("step" not in s for s in states)  # type: ignore[operator]
    ):
        return False
    if counted:
        # the counters' own dtype (torch's scalar dtype when they were made), on the CPU
        steps = torch.stack([torch.as_tensor(s["step"]).cpu() for s in states])  # type: ignore[index]
        if not bool((steps == steps[0]).all()):
            return False
    for key in keys:
        packed = new(rows, width)
        views = span.packed_views(packed)
        torch._foreach_copy_(views, found[key])  # type: ignore[arg-type]
        _bind(span, key, packed, views)
    if counted:
        _bind_steps(span, steps.view(rows, -1).clone())
    return True


def _same(found: list[Any], bound: list[Tensor]) -> bool:
    """Whether `found` holds exactly the objects `bound` does, in order."""
    return len(found) == len(bound) and all(map(operator.is_, found, bound))


_GRAD = operator.attrgetter("grad")


def _bind(span: Span, key: str, packed: Tensor, views: list[Tensor] | None = None) -> None:
    span.state[key] = packed
    span.views[key] = views if views is not None else span.packed_views(packed)
    for (opt, p, _, _, _), view in zip(span.pairs, span.views[key], strict=True):
        opt.state[p][key] = view


def _bind_steps(span: Span, steps: Tensor) -> None:
    """Bind `[W, P]` counters (equal) as each parameter's `step`; the functional update gets
    one counter per run of its own (it increments them), set from these before each step."""
    span.steps = steps
    flat = steps.view(-1)
    span.step_views = [flat[i] for i in range(flat.numel())]
    for (opt, p, _, _, _), view in zip(span.pairs, span.step_views, strict=True):
        opt.state[p]["step"] = view
    span.run_counts = steps.new_empty(len(span.runs))
    span.run_steps = list(span.run_counts)


# -- the updates ----------------------------------------------------------------------------------


def _sgd_step(rows: FlatRows, span: Span, group: dict[str, Any]) -> None:
    """torch's functional SGD on the group's runs (momentum created by the first step: the
    functional's own clone, then packed and bound)."""
    lr, momentum = group["lr"], group["momentum"]
    foreach = rows.foreach(group)
    if momentum == 0 and group["weight_decay"] == 0 and not group["maximize"] and not foreach:
        # what torch's per-tensor SGD does with these settings, without its wrapper (for one
        # small model's event its Python costs more than the update): the same op
        for p, g in zip(span.params, span.grads, strict=True):
            p.add_(g, alpha=-lr)
        return
    from torch.optim.sgd import sgd

    fresh = momentum != 0 and "momentum_buffer" not in span.state
    buffers: list[Tensor | None] = (
        [None] * len(span.runs) if momentum == 0 or fresh else span.state_runs("momentum_buffer")
    )
    sgd(
        span.params,
        span.grads,
        buffers,
        foreach=foreach,
        weight_decay=group["weight_decay"],
        momentum=momentum,
        lr=lr,
        dampening=group["dampening"],
        nesterov=group["nesterov"],
        maximize=group["maximize"],
    )
    if fresh:
        packed = span.params[0].new_empty(span.params[0].shape[0], span.width)
        if len(buffers) == 1:
            packed = buffers[0]  # type: ignore[assignment]  # already `[W, n]`, contiguous
        else:
            torch.cat(buffers, dim=1, out=packed)  # type: ignore[arg-type]
        _bind(span, "momentum_buffer", packed)


def _adam_step(rows: FlatRows, span: Span, group: dict[str, Any]) -> None:
    """torch's functional Adam (AdamW: decoupled weight decay) on the group's runs; the
    per-parameter counters advance with the functional's per-run ones."""
    from torch.optim.adam import adam

    assert span.steps is not None and span.run_counts is not None
    span.run_counts.copy_(span.steps.view(-1)[0])  # the count every bound counter holds
    muon = "adamw_betas" in group  # a MuonAdamW group without Muon: its AdamW keys
    beta1, beta2 = group["adamw_betas"] if muon else group["betas"]
    adam(
        span.params,
        span.grads,
        span.state_runs("exp_avg"),
        span.state_runs("exp_avg_sq"),
        [],
        span.run_steps,
        foreach=rows.foreach(group),
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["adamw_eps"] if muon else group["eps"],
        maximize=group.get("maximize", False),
        decoupled_weight_decay=muon or group.get("decoupled_weight_decay", False),
        has_complex=False,
    )
    span.steps.add_(1)


def _muon_adamw_step(rows: FlatRows, span: Span, group: dict[str, Any]) -> None:
    """MuonAdamW: its AdamW groups as Adam's; its Muon groups as torch's Muon (momentum,
    Nesterov, weight decay: elementwise on the runs) with the Newton–Schulz iterations of all
    rows' same-shape matrices as one batched product (`muon.newton_schulz`)."""
    if not group["use_muon"]:
        _adam_step(rows, span, group)
        return
    momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
    packed = span.state["momentum_buffer"]
    for g, buf in zip(span.grads, span.state_runs("momentum_buffer"), strict=True):
        buf.lerp_(g, 1 - momentum)
    update = packed
    if group["nesterov"]:
        update = torch.empty_like(packed)
        at = 0
        for g, buf in zip(span.grads, span.state_runs("momentum_buffer"), strict=True):
            torch.lerp(g, buf, momentum, out=update[:, at : at + g.shape[1]])
            at += g.shape[1]
    if decay != 0:  # torch multiplies by 1 - lr·0 = 1 too: the same numbers
        for p in span.params:
            p.mul_(1 - lr * decay)
    for shape, (targets, sources) in span.matrices(rows.params, update).items():
        stacked = sources[0].new_empty((len(sources), *sources[0].shape), dtype=torch.bfloat16)
        for into, source in zip(stacked, sources, strict=True):
            into.copy_(source)  # cast as torch's Muon casts, in one pass
        stacked = stacked.flatten(0, 1)
        ortho = newton_schulz(stacked, group["ns_coefficients"], group["ns_steps"], group["eps"])
        ortho = ortho.view(len(targets), -1, *shape)
        step = -adjusted_lr(lr, group["adjust_lr_fn"], shape)
        for target, o in zip(targets, ortho, strict=True):
            target.add_(o, alpha=step)


_STEPS: dict[type, Callable[[FlatRows, Span, dict[str, Any]], None]] = {
    torch.optim.SGD: _sgd_step,
    torch.optim.Adam: _adam_step,
    torch.optim.AdamW: _adam_step,
    MuonAdamW: _muon_adamw_step,
}
_KINDS = tuple(_STEPS)
