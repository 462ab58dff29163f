"""W local worker replicas of one model, with parameters and gradients in flat stacked buffers.

Each replica's parameters are views into row w of `params` (`[W, D]`) and its gradients views
into row w of `grads`, so a collective over all parameters or gradients of all local workers is
one call on one tensor, and backward accumulates straight into the communication buffer (as
DDP's `gradient_as_bucket_view`). With `channels_last`, 4-D parameters are laid out NHWC inside
their slice of the row (a permuted view), so convolutions get channels-last weights without
leaving the flat buffer. Floating-point buffers (BatchNorm statistics) are likewise
views into `buffers` (`[W, Db]`). Integer buffers (`num_batches_tracked`) are views into
`int_buffers` (`[W, Di]`, when they share one dtype; otherwise they stay per replica and
`int_buffers` is `[W, 0]`): never communicated (every worker steps the same number of times, so
they agree), but stacked so that one computation over several rows
(`dpresearch/run/batched.py`) updates each row's own.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn


class Replicas:
    """`num_local` independent copies of `model`, all starting from its current state."""

    def __init__(
        self, model: nn.Module, num_local: int, device: torch.device, channels_last: bool = False
    ) -> None:
        model = model.to(device)
        params = [p for p in model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"all trainable parameters must share one dtype, got {dtypes}")
        self.models: list[nn.Module] = [copy.deepcopy(model) for _ in range(num_local)]
        numel = sum(p.numel() for p in params)
        dtype = params[0].dtype
        self.params = torch.empty(num_local, numel, dtype=dtype, device=device)
        self.grads = torch.zeros(num_local, numel, dtype=dtype, device=device)
        float_buffers = [b for b in model.buffers() if b.is_floating_point()]
        buf_numel = sum(b.numel() for b in float_buffers)
        self.buffers = torch.empty(num_local, buf_numel, dtype=dtype, device=device)
        int_buffers = [b for b in model.buffers() if not b.is_floating_point()]
        int_dtypes = {b.dtype for b in int_buffers}
        stack_ints = len(int_dtypes) == 1
        self.int_buffers = torch.zeros(
            num_local,
            sum(b.numel() for b in int_buffers) if stack_ints else 0,
            dtype=int_dtypes.pop() if stack_ints else torch.int64,
            device=device,
        )
        self.channels_last = channels_last
        for w, replica in enumerate(self.models):
            offset = 0
            for p in (p for p in replica.parameters() if p.requires_grad):
                nhwc = channels_last and p.dim() == 4
                view = _shaped(self.params[w, offset : offset + p.numel()], p.shape, nhwc)
                view.copy_(p.data)
                p.data = view
                p.grad = _shaped(self.grads[w, offset : offset + p.numel()], p.shape, nhwc)
                offset += p.numel()
            offset = int_offset = 0
            for module in replica.modules():
                for name, b in module.named_buffers(recurse=False):
                    if b is None:
                        continue
                    if b.is_floating_point():
                        view = self.buffers[w, offset : offset + b.numel()].view_as(b)
                        offset += b.numel()
                    elif stack_ints:
                        view = self.int_buffers[w, int_offset : int_offset + b.numel()].view_as(b)
                        int_offset += b.numel()
                    else:
                        continue
                    view.copy_(b)
                    setattr(module, name, view)

    @property
    def num_local(self) -> int:
        return len(self.models)

    @property
    def num_params(self) -> int:
        return self.params.shape[1]

    def zero_grad(self) -> None:
        """Zero every replica's gradient in place (keeps `.grad` as views into `grads`)."""
        self.grads.zero_()

    def train(self, mode: bool = True) -> None:
        for m in self.models:
            m.train(mode)

    def state_dict(self) -> dict:
        """Every replica's parameters and float buffers (the flat `[W, ·]` tensors, live) and
        integer buffers (per replica: views of `int_buffers` where they are stacked)."""
        return {
            "params": self.params,
            "buffers": self.buffers,
            "int_buffers": [
                [b for b in m.buffers() if not b.is_floating_point()] for m in self.models
            ],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Copy `state_dict()`'s tensors back into place (the views stay the replicas')."""
        self.params.copy_(state["params"])
        self.buffers.copy_(state["buffers"])
        for model, saved in zip(self.models, state["int_buffers"], strict=True):
            ints = [b for b in model.buffers() if not b.is_floating_point()]
            for dst, src in zip(ints, saved, strict=True):
                dst.copy_(src)

    def models_on(self, bank: Tensor) -> list[nn.Module]:
        """One module per replica whose trainable parameters are views of row w of `bank`
        (`[W, D]`, laid out as `params`, channels-last where the replica's are) and which
        shares everything else with replica w: each parameter's `.grad` is the replica's
        gradient view (backward accumulates into `grads`), the buffers are the replica's own
        tensors (a training forward updates its statistics), frozen parameters are the
        replica's. For computing a row's gradient at parameters kept elsewhere — a stale read —
        with nothing copied (`StepPlan.models`)."""
        if bank.shape != self.params.shape or bank.dtype != self.params.dtype:
            raise ValueError(
                f"models_on: the bank must be laid out as params {tuple(self.params.shape)} "
                f"{self.params.dtype}, got {tuple(bank.shape)} {bank.dtype}"
            )
        twins = []
        for w, replica in enumerate(self.models):
            # deepcopy with every tensor mapped in advance: the module structure is copied,
            # no tensor is (a parameter's deepcopy would copy the whole stacked storage)
            memo: dict[int, object] = {id(b): b for b in replica.buffers()}
            offset = 0
            for p in replica.parameters():
                if not p.requires_grad:
                    memo[id(p)] = p
                    continue
                nhwc = p.dim() == 4 and not p.is_contiguous()
                twin = nn.Parameter(_shaped(bank[w, offset : offset + p.numel()], p.shape, nhwc))
                twin.grad = p.grad
                memo[id(p)] = twin
                offset += p.numel()
            twins.append(copy.deepcopy(replica, memo))
        return twins

    def load_into(self, target: nn.Module, params: Tensor, buffers: Tensor) -> nn.Module:
        """Copy one flat parameter row and buffer row into `target` (same architecture);
        integer buffers are taken from local replica 0."""
        offset = 0
        sources = [q for q in self.models[0].parameters() if q.requires_grad]
        targets = [p for p in target.parameters() if p.requires_grad]
        for p, q in zip(targets, sources, strict=True):
            nhwc = q.dim() == 4 and not q.is_contiguous()
            p.data.copy_(_shaped(params[offset : offset + p.numel()], p.shape, nhwc))
            offset += p.numel()
        offset = 0
        source_int = [b for b in self.models[0].buffers() if not b.is_floating_point()]
        target_int = [b for b in target.buffers() if not b.is_floating_point()]
        for b in target.buffers():
            if b.is_floating_point():
                b.copy_(buffers[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
        for dst, src in zip(target_int, source_int, strict=True):
            dst.copy_(src)
        return target


def row_state_dict(
    model: nn.Module,
    params: Tensor,
    buffers: Tensor,
    int_buffers: Sequence[Tensor],
    channels_last: bool = False,
) -> dict[str, Tensor]:
    """One replica's row as `model`'s named tensors: its trainable parameters from the flat
    `params` row (4-D ones NHWC inside it where the row was laid out `channels_last`), its
    floating-point buffers from `buffers` and its integer buffers from `int_buffers` (one tensor
    each), in the order `Replicas` lays `model` out (`Replicas.state_dict` holds these rows).
    Named as `model.state_dict()` names them: a tensor the model holds under several names (a
    GPT's output head tied to its token embedding) is laid out once and given under each name.
    Raises ValueError naming the first size that does not fit `model`."""
    state: dict[str, Tensor] = {}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    floats = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
    ints = [(n, b) for n, b in model.named_buffers() if not b.is_floating_point()]
    for label, row, named in (
        ("parameters", params, trainable),
        ("buffer values", buffers, floats),
    ):
        total = sum(t.numel() for _, t in named)
        if row.numel() != total:
            raise ValueError(f"{row.numel()} {label} where this model has {total}")
        offset = 0
        for name, t in named:
            nhwc = channels_last and t.dim() == 4 and label == "parameters"
            state[name] = _shaped(row[offset : offset + t.numel()], t.shape, nhwc).contiguous()
            offset += t.numel()
    if len(int_buffers) != len(ints):
        raise ValueError(f"{len(int_buffers)} integer buffers where this model has {len(ints)}")
    for (name, b), saved in zip(ints, int_buffers, strict=True):
        if saved.shape != b.shape:
            raise ValueError(
                f"{name} of shape {tuple(saved.shape)} where this model's is {tuple(b.shape)}"
            )
        state[name] = saved
    # A row holds each tensor once, under the first name `named_parameters`/`named_buffers`
    # give it; the state dict's other names of the same tensor (found by identity) alias it.
    first = {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}
    for name, t in model.state_dict(keep_vars=True).items():
        if name not in state and first.get(id(t)) in state:
            state[name] = state[first[id(t)]]
    return state


def _shaped(flat: Tensor, shape: torch.Size, channels_last: bool) -> Tensor:
    """View a flat slice as `shape`, NCHW-contiguous or (4-D only) channels-last."""
    if not channels_last:
        return flat.view(shape)
    n, c, h, w = shape
    return flat.view(n, h, w, c).permute(0, 3, 1, 2)
