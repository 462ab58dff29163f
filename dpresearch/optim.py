"""Optimizer construction: a Hydra `_partial_` optimizer plus parameter groups.

The `optimizer` node is any `torch.optim` class as `_target_` with `_partial_: true`; the one
extra key `exclude_bn_bias_from_weight_decay` (ours, removed before instantiation) puts
BatchNorm weights and all biases (every parameter with fewer than two dimensions) in a group
without weight decay, as in Goyal et al. 2017. For a transformer that is nanoGPT's rule too:
weight matrices and embeddings decay, biases and LayerNorm gains do not.

An optimizer class that splits its groups by the model's structure (`muon.MuonAdamW`: hidden
matrices apart from embeddings) has a static `split_param_groups(groups, module)`, called with
the model `make_optimizer` was given (None from `build_optimizer` alone); a node's `adamw_lr`
is scaled with its `lr`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.optim import optimizer as _torch_optimizer

OWN_KEYS = ("exclude_bn_bias_from_weight_decay",)


def make_optimizer(
    cfg: DictConfig, model: nn.Module, lr_scale: float = 1.0
) -> torch.optim.Optimizer:
    """Instantiate the optimizer node for `model`'s trainable parameters; lr × `lr_scale`."""
    params = [p for p in model.parameters() if p.requires_grad]
    return build_optimizer(cfg, params, lr_scale, module=model)


def build_optimizer(
    cfg: DictConfig | dict,
    params: list[nn.Parameter],
    lr_scale: float = 1.0,
    module: nn.Module | None = None,
) -> torch.optim.Optimizer:
    """Instantiate the optimizer node for `params` (e.g. one fragment of a model); lr (and
    `adamw_lr`, where the node has one) × `lr_scale`. `module`: the model `params` belong
    to, for an optimizer class with `split_param_groups` (see the module's docstring)."""
    node: dict[str, Any] = (
        OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    )  # type: ignore[assignment]
    exclude = bool(node.pop("exclude_bn_bias_from_weight_decay", False))
    node["_partial_"] = True
    node["lr"] = float(node.get("lr", 0.1)) * lr_scale
    if "adamw_lr" in node:
        node["adamw_lr"] = float(node["adamw_lr"]) * lr_scale
    factory = instantiate(node)
    split = getattr(getattr(factory, "func", None), "split_param_groups", None)
    if not exclude and split is None:
        return factory(params)
    if exclude:
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    else:
        groups = [{"params": params}]
    groups = [g for g in groups if g["params"]]
    return factory(split(groups, module) if split is not None else groups)


def set_lr(optimizer: torch.optim.Optimizer, base_lrs: list[float], multiplier: float) -> None:
    """Set every group's lr to its base lr × `multiplier`."""
    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
        group["lr"] = base * multiplier


def step_together(
    optimizers: Sequence[torch.optim.Optimizer], rows: FlatRows | None = None
) -> None:
    """`opt.step()` for every optimizer in `optimizers` (one per local worker, or a single
    one: an asynchronous event's). Where they are all plain `torch.optim.SGD` with the same
    hyper-parameters group by group, each group of all of them is one call of torch's own
    functional SGD (`torch.optim.sgd.sgd`, `foreach=True`) over every worker's parameters at
    once: the same arithmetic, tensor by tensor, as each optimizer's own step (bit for bit:
    tested), without passes through the optimizer's Python (for a single small model its
    wrapper — profiler record, grad mode, dispatch choice — costs more than the update).
    Where, in addition, `rows` says their parameters and gradients tile the rows of two flat
    tensors (`Replicas`; one worker's: `FlatRows.of_row`), that call runs on the two flat
    tensors themselves (`FlatRows.step`). Otherwise one by one."""
    if not _same_plain_sgd(optimizers):
        for opt in optimizers:
            opt.step()
        return
    if rows is not None and rows.step(optimizers):
        return
    from torch.optim.sgd import sgd

    with torch.no_grad():
        for groups in zip(*(opt.param_groups for opt in optimizers), strict=True):
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor | None] = []
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
            sgd(params, grads, buffers, foreach=True, weight_decay=first["weight_decay"],
                momentum=first["momentum"], lr=first["lr"], dampening=first["dampening"],
                nesterov=first["nesterov"], maximize=first["maximize"])  # fmt: skip
            if first["momentum"] != 0:
                for state, buffer in zip(states, buffers, strict=True):
                    state["momentum_buffer"] = buffer


# Hyper-parameters of an SGD group that must agree for its workers to step together.
_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")


def _same_plain_sgd(optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """All exactly `torch.optim.SGD`, none with hooks (their own or torch's global ones), fused
    or differentiable steps, with the same number of groups and the same hyper-parameters group
    by group (gradients are dense: the replicas' are views of one flat tensor)."""
    hooks = _torch_optimizer
    if hooks._global_optimizer_pre_hooks or hooks._global_optimizer_post_hooks:
        return False
    first = optimizers[0]
    for opt in optimizers:
        if type(opt) is not torch.optim.SGD or len(opt.param_groups) != len(first.param_groups):
            return False
        if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
            return False
        for group, reference in zip(opt.param_groups, first.param_groups, strict=True):
            if group.get("fused") or group.get("differentiable"):
                return False
            if opt is not first and any(group[k] != reference[k] for k in _SGD_KEYS):
                return False
    return True


class FlatRows:
    """The flat `[W, D]` parameter and gradient rows (`Replicas.params`, `.grads`) that W
    optimizers' parameters view — worker w's parameters, each dense, tiling row w — so that
    their plain SGD step runs as one `torch.optim.sgd.sgd` call on two tensors instead of one
    per parameter per worker: elementwise the same arithmetic, so bit for bit the same result
    (tested), and a fraction of the time for a small model with many workers.

    With momentum the buffers are views of one flat buffer with the parameters' layout, bound
    into each optimizer's state (so checkpoints, `average_optimizer_state` and a fragment's
    reset see ordinary per-parameter state). State from elsewhere (a loaded checkpoint, a
    step taken one by one) is copied into a fresh flat buffer first; a step where only some
    parameters have a buffer (just reset) is left to the per-tensor path.
    """

    def __init__(self, params: torch.Tensor, grads: torch.Tensor) -> None:
        self.params, self.grads = params, grads
        # torch's SGD's own default: multi-tensor on an accelerator, per tensor on a CPU (where
        # the multi-tensor kernels fall back to the same per-tensor ops after grouping them)
        self._foreach = params.device.type != "cpu"
        self._for: tuple[int, ...] = ()  # the optimizers the check below was made for
        self._pairs: list[tuple[torch.optim.Optimizer, torch.Tensor, torch.Tensor]] = []
        self.momentum: torch.Tensor | None = None
        self._buffers: list[torch.Tensor] = []  # per pair, its view of `momentum`

    @classmethod
    def of_row(cls, params: torch.Tensor, grads: torch.Tensor, row: int) -> FlatRows:
        """The flat rows of one worker: row `row` of `params` and `grads` (`[1, D]` views),
        for its optimizer stepping alone (`step_together([optimizer], ...)`)."""
        return cls(params[row : row + 1], grads[row : row + 1])

    def step(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """One SGD step of all `optimizers` on the flat rows (they have been checked to be the
        same plain SGD); False, having done nothing, where the rows do not apply."""
        if not self._tile(optimizers):
            return False
        group = optimizers[0].param_groups[0]
        lr = group["lr"]
        if (group["momentum"] == 0 and group["weight_decay"] == 0 and not group["maximize"]
                and not self._foreach and not isinstance(lr, torch.Tensor)):  # fmt: skip
            # what torch's per-tensor SGD does with these settings, without its wrapper (for
            # one small model's event its Python costs more than the update): the same op
            self.params.add_(self.grads, alpha=-lr)
            return True
        buffers: list[torch.Tensor | None] = [None]
        if group["momentum"] != 0:
            flat = self._momentum_rows()
            if flat is False:
                return False
            buffers = [flat]
        from torch.optim.sgd import sgd

        with torch.no_grad():
            sgd([self.params], [self.grads], buffers, foreach=self._foreach,
                weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                dampening=group["dampening"], nesterov=group["nesterov"],
                maximize=group["maximize"])  # fmt: skip
        if group["momentum"] != 0 and buffers[0] is not self.momentum:
            self._bind(buffers[0])  # created by this first step
        return True

    def _tile(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Whether each optimizer (one group) holds dense views tiling its row of `params`
        whose gradients are the same views of `grads` (checked once per set of optimizers;
        then only that every gradient is still the view it was)."""
        key = tuple(id(opt) for opt in optimizers)
        if key != self._for:
            self._for, self._pairs = key, self._check(optimizers)
            self.momentum, self._buffers = None, []
        return bool(self._pairs) and all(p.grad is g for _, p, g in self._pairs)

    def _check(self, optimizers) -> list[tuple[torch.optim.Optimizer, torch.Tensor, torch.Tensor]]:
        params, grads = self.params, self.grads
        if (params.dim() != 2 or params.shape != grads.shape or len(optimizers) != len(params)
                or not (params.is_contiguous() and grads.is_contiguous())):  # fmt: skip
            return []
        width, base, grad_base = params.shape[1], params.storage_offset(), grads.storage_offset()
        p_store, g_store = params.untyped_storage().data_ptr(), grads.untyped_storage().data_ptr()
        pairs = []
        for w, opt in enumerate(optimizers):
            if len(opt.param_groups) != 1:
                return []
            spans = []
            for p in opt.param_groups[0]["params"]:
                g = p.grad
                if (g is None or p.untyped_storage().data_ptr() != p_store
                        or g.untyped_storage().data_ptr() != g_store
                        or p.stride() != g.stride() or p.shape != g.shape
                        or p.storage_offset() - base != g.storage_offset() - grad_base
                        or _span(p) != p.numel()):  # fmt: skip
                    return []
                spans.append((p.storage_offset() - base, p.numel()))
                pairs.append((opt, p, g))
            spans.sort()
            end = w * width
            for start, size in spans:
                if start != end:
                    return []
                end += size
            if end != (w + 1) * width:
                return []
        return pairs

    def _momentum_rows(self) -> torch.Tensor | None | bool:
        """The flat momentum buffer (None: no parameter has one yet, the step creates it;
        False: only some have one)."""
        states = [opt.state.get(p) for opt, p, _ in self._pairs]
        found = [s.get("momentum_buffer") if s else None for s in states]
        if self.momentum is not None and all(
            b is v for b, v in zip(found, self._buffers, strict=True)
        ):
            return self.momentum
        if all(b is None for b in found):
            return None
        if any(b is None for b in found):
            return False
        flat = torch.empty_like(self.params)
        views = self._views(flat)
        torch._foreach_copy_(views, found)
        self._bind(flat, views)
        return flat

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view of `flat` (same shape, strides and offset in the rows)."""
        shift = flat.storage_offset() - self.params.storage_offset()
        return [flat.as_strided(p.shape, p.stride(), p.storage_offset() + shift)
                for _, p, _ in self._pairs]  # fmt: skip

    def _bind(self, flat: torch.Tensor, views: list[torch.Tensor] | None = None) -> None:
        self.momentum, self._buffers = flat, views if views is not None else self._views(flat)
        for (opt, p, _), view in zip(self._pairs, self._buffers, strict=True):
            opt.state[p]["momentum_buffer"] = view


def _span(t: torch.Tensor) -> int:
    """Elements between a tensor's first and last (inclusive): its numel when it is dense."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
