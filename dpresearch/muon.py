"""Muon for the hidden weight matrices, AdamW for every other parameter, as one optimizer.

Muon (Keller Jordan 2024, https://kellerjordan.github.io/posts/muon/) orthogonalises the
momentum of a 2-D weight matrix by Newton–Schulz iterations; its authors prescribe it for the
hidden layers only, and AdamW for the embeddings, the output head, gains and biases. `MuonAdamW`
is that pair as one `torch.optim.Optimizer`: its groups are tagged `use_muon`, its step runs
torch's own `torch.optim.Muon` and `torch.optim.AdamW` group by group over its state, so
`param_groups`, `state[p]`, `state_dict`/`load_state_dict`, `zero_grad` and the schedule's
`set_lr` (every group's lr rescaled from its base lr) work as for any torch optimizer.

Which parameters are hidden matrices needs the model: `split_param_groups(groups, module)`
(the hook `optim.build_optimizer` calls) tags every 2-D parameter that is not an
`nn.Embedding`'s weight (nor tied to one: the same tensor) `use_muon=True`, the rest False.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups with `use_muon=True` (2-D parameters only), AdamW on the others.

    Every group must say `use_muon` (`split_param_groups` builds them from a module). A group's
    `lr` and `weight_decay` are its own: unless the group sets them, Muon groups take `lr` and
    `weight_decay`, AdamW groups `adamw_lr` and `adamw_weight_decay`; so one schedule
    multiplier scales both and keeps their ratio. Muon's keys (`momentum`, `nesterov`,
    `ns_coefficients`, `ns_steps`, `eps`, `adjust_lr_fn`) are torch's `Muon`'s: the update is
    torch's, Newton–Schulz in bfloat16, scaled by `adjust_lr_fn` ("original": √max(1, A/B),
    Keller Jordan's; "match_rms_adamw": 0.2·√max(A, B), Moonlight's, so that AdamW's lr fits
    Muon too). AdamW's (`adamw_betas`, `adamw_eps`) are torch's `AdamW`'s; its state per
    parameter is torch AdamW's (`step`, `exp_avg`, `exp_avg_sq`), Muon's is
    `momentum_buffer`.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_coefficients: Sequence[float] = (3.4445, -4.775, 2.0315),
        ns_steps: int = 5,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = "original",
        adamw_lr: float = 1e-3,
        adamw_betas: Sequence[float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
    ) -> None:
        for key, value in (
            ("lr", lr),
            ("momentum", momentum),
            ("weight_decay", weight_decay),
            ("eps", eps),
            ("adamw_lr", adamw_lr),
            ("adamw_eps", adamw_eps),
            ("adamw_weight_decay", adamw_weight_decay),
        ):
            if not value >= 0:
                raise ValueError(f"optimizer.{key}={value}: must be >= 0")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(
                f"optimizer.adjust_lr_fn={adjust_lr_fn}: choose one of original, "
                "match_rms_adamw (or null: original)"
            )
        betas = tuple(float(b) for b in adamw_betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"optimizer.adamw_betas={list(adamw_betas)}: two numbers in [0, 1)")
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
            raise ValueError(
                f"optimizer.ns_steps={ns_steps}: must be an integer >= 1 (Newton–Schulz "
                "iterations that orthogonalise the update; 5 is usual, 0 would apply it raw)"
            )
        if len(ns_coefficients) != 3:
            raise ValueError(f"optimizer.ns_coefficients={list(ns_coefficients)}: three numbers")
        # read by add_param_group, which torch's constructor calls for every group
        self._adamw_lr, self._adamw_weight_decay = adamw_lr, adamw_weight_decay
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(float(c) for c in ns_coefficients),
            "ns_steps": ns_steps,
            "eps": eps,
            "adjust_lr_fn": adjust_lr_fn,
            "adamw_betas": betas,
            "adamw_eps": adamw_eps,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's `add_param_group`, with the group's `use_muon` required and its default
        `lr` and `weight_decay` chosen by it."""
        if not isinstance(param_group, dict) or "use_muon" not in param_group:
            raise ValueError(
                "MuonAdamW: every parameter group needs use_muon (True: hidden 2-D matrices; "
                "False: embeddings, output head, gains, biases); build the groups with "
                "dpresearch.muon.split_param_groups(groups, model)"
            )
        group = dict(param_group)
        params = group["params"]
        group["params"] = [params] if isinstance(params, Tensor) else list(params)
        if group["use_muon"]:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(
                        f"MuonAdamW: a use_muon group holds a parameter of shape "
                        f"{list(p.shape)}; Muon takes 2-D matrices only"
                    )
        else:
            group.setdefault("lr", self._adamw_lr)
            group.setdefault("weight_decay", self._adamw_weight_decay)
        super().add_param_group(group)

    @staticmethod
    def split_param_groups(
        groups: list[dict[str, Any]], module: nn.Module | None
    ) -> list[dict[str, Any]]:
        """The hook `optim.build_optimizer` calls on an optimizer class that has it: the
        module-level `split_param_groups`."""
        return split_param_groups(groups, module)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step: torch's Muon update on every `use_muon` group, torch's AdamW update on
        the others (parameters without a gradient are skipped, their state left as it is)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("MuonAdamW does not support sparse gradients")
                if torch.is_complex(p):
                    raise RuntimeError("MuonAdamW does not support complex parameters")
            if group["use_muon"]:
                self._muon_step(group, params)
            else:
                self._adamw_step(group, params)
        return loss

    def _muon_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        keys = ("lr", "weight_decay", "momentum", "nesterov", "eps", "ns_steps", "adjust_lr_fn")
        hyper = {key: group[key] for key in keys}
        hyper["ns_coefficients"] = tuple(group["ns_coefficients"])
        self._torch_step(torch.optim.Muon, params, **hyper)

    def _adamw_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        hyper = {"betas": group["adamw_betas"], "eps": group["adamw_eps"]}
        hyper |= {"lr": group["lr"], "weight_decay": group["weight_decay"]}
        self._torch_step(torch.optim.AdamW, params, **hyper)

    def _torch_step(
        self, optimizer: type[torch.optim.Optimizer], params: list[Tensor], **hyper: Any
    ) -> None:
        """One step of torch's own `optimizer` with the hyperparameters `hyper` on `params`,
        over this optimizer's `state` (each parameter's state created by torch, lazily, as
        that optimizer keeps it): the update is torch's, through its public classes."""
        torch_optimizer = optimizer(params, **hyper)
        torch_optimizer.state = self.state
        torch_optimizer.step()


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """The lr torch's `Muon` steps an A × B matrix with (A, B = shape[:2]): lr·√max(1, A/B)
    for "original" (or None), lr·0.2·√max(A, B) for "match_rms_adamw", the ratio computed
    first as torch computes it, so the product rounds alike."""
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, a / b))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(a, b))
    else:
        ratio = 1.0
    return lr * ratio


def newton_schulz(x: Tensor, coefficients: Sequence[float], steps: int, eps: float) -> Tensor:
    """torch's Muon orthogonalisation (`torch.optim._muon._zeropower_via_newtonschulz`) of a
    batch of same-shape matrices `x` (`[B, m, n]`) at once, in `x`'s dtype (torch's Muon casts
    to bfloat16 first; so does `stacked_step`): each matrix transposed when m > n, divided by
    its Frobenius norm (at least `eps`), then `steps` quintic iterations X <- a·X + (b·A + c·A²)·X
    with A = X·Xᵀ — torch's per-matrix sequence with `bmm`/`baddbmm` for `mm`/`addmm`. A
    batched product may sum in another order than the per-matrix one, so a matrix's result
    equals torch's to the rounding of the dtype (stated and tested in
    tests/test_stacked_step.py)."""
    if x.dim() != 3:
        raise ValueError(f"newton_schulz takes [B, m, n] matrices, got shape {list(x.shape)}")
    a, b, c = coefficients
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def split_param_groups(
    groups: list[dict[str, Any]], module: nn.Module | None
) -> list[dict[str, Any]]:
    """`groups` (dicts with `params`, possibly other keys) split by `use_muon`: True for the
    2-D parameters of `module` that are not an `nn.Embedding`'s weight (a tied output head is
    that same tensor, so it is not one either), False for every other parameter. Muon groups
    come first (so `param_groups[0]["lr"]` is Muon's); empty groups are dropped. Without the
    module embeddings cannot be told apart: `ValueError`."""
    if module is None:
        raise ValueError(
            "MuonAdamW needs the model to tell embeddings from hidden matrices; build it with "
            "optim.make_optimizer(cfg, model) (an outer optimizer cannot be MuonAdamW)"
        )
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    muon_groups, adamw_groups = [], []
    for group in groups:
        params = list(group["params"])
        hidden = [p for p in params if p.dim() == 2 and id(p) not in embeddings]
        hidden_ids = {id(p) for p in hidden}
        other = [p for p in params if id(p) not in hidden_ids]
        if hidden:
            muon_groups.append({**group, "params": hidden, "use_muon": True})
        if other:
            adamw_groups.append({**group, "params": other, "use_muon": False})
    return muon_groups + adamw_groups
