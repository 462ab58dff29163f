"""Sign-SGD with decoupled weight decay: θ ← θ·(1 − lr·λ) − lr·sign(g).

The step DeMo takes on its decoded average (Peng, Quesnelle & Kingma 2024; the reference code,
bloc97/DeMo demo.py: the decay before the step, then the sign), written as a plain torch
optimizer so it composes with any exchange: `optimizer=sign_sgd` after a compressed
synchronous average (`compressor=dct_topk error_feedback=ef14 error_feedback.decay=β`) is
DeMo's `sign=true` step. No state: the momentum lives in the error-feedback memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def decoupled_step(p: Tensor, direction: Tensor, lr: float, decay: float | Tensor) -> None:
    """p ← p·(1 − lr·decay) − lr·direction, in place (`decay`: a float, or a tensor
    broadcasting against `p`, e.g. one rate per column of DeMo's flat rows)."""
    if isinstance(decay, Tensor) or decay:
        p.mul_(1 - lr * decay)
    p.sub_(direction, alpha=lr)


class SignSGD(torch.optim.Optimizer):
    """θ ← θ·(1 − lr·weight_decay) − lr·sign(grad), per parameter group (lr, weight_decay ≥ 0).
    A parameter without a gradient is left as it is."""

    def __init__(self, params: Any, lr: float = 4e-4, weight_decay: float = 0.0) -> None:
        if lr < 0 or weight_decay < 0:
            raise ValueError("lr and weight_decay must be >= 0")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    decoupled_step(p, torch.sign(p.grad), group["lr"], group["weight_decay"])
        return loss
