"""Gradient clipping by global L2 norm (`train.grad_clip`) and the pre-clip norms behind the
metric `train/grad_norm`.

Row w of the flat `[W, D]` gradient buffer (`Replicas.grads`) is worker w's gradient over all
its trainable parameters, so clipping a row is `torch.nn.utils.clip_grad_norm_` on that worker's
model: g ← g · min(1, c / (‖g‖₂ + 1e-6)), torch's formula with its ε, the multiplication made
even where the factor is 1 (as torch does: no host sync to decide). The K norms of K rows are
one `torch.linalg.vector_norm` over the rows, the K scalings one multiply: no per-parameter
work. Which gradient a row holds when it is clipped — the worker's own before its local step,
the average after an exact allreduce, the worker's own before a compressor — is the
algorithm's choice (`Algorithm.clip_gradients`; docs/ARCHITECTURE.md).

`train/grad_norm` is the mean, over the gradients clipped since the last metrics row (one per
worker per step in lockstep; one per event where one worker steps), of each one's pre-clip
norm: for synchronous SGD without compression every row holds the averaged gradient, so it is
the averaged gradient's norm. `train.grad_clip=inf` measures without clipping.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


class GradClip:
    """Clipping of this process's `rows` gradient rows to global L2 norm `max_norm` (None: off,
    nothing measured), keeping each row's summed pre-clip norms until `drain`."""

    def __init__(self, max_norm: float | None, rows: int, device: torch.device) -> None:
        self.max_norm = None if max_norm is None else float(max_norm)
        self.sums = torch.zeros(rows, dtype=torch.float64, device=device)
        self.counts = [0] * rows

    @property
    def active(self) -> bool:
        return self.max_norm is not None

    def __call__(self, grads: Tensor, row: int | None = None) -> None:
        """Clip every row of `grads` (`[W, D]`), or only row `row`, each by its own norm."""
        max_norm = self.max_norm
        if max_norm is None:
            return
        rows, sums = (grads, self.sums) if row is None else (grads[row : row + 1], self.sums[row])
        norms = torch.linalg.vector_norm(rows, dim=1)
        if not math.isinf(max_norm):
            factor = (max_norm / (norms + EPS)).clamp_(max=1.0)
            rows.mul_(factor.unsqueeze(1))
        sums.add_(norms if row is None else norms[0])
        if row is None:
            self.counts = [n + 1 for n in self.counts]
        else:
            self.counts[row] += 1

    def drain(self, window: Tensor) -> None:
        """Write each row's summed pre-clip norms and their count since the last call into
        the float64 `window` (`[W, 2]`), and start anew."""
        window[:, 0].copy_(self.sums)
        window[:, 1].copy_(torch.tensor(self.counts, dtype=torch.float64))
        self.sums.zero_()
        self.counts = [0] * len(self.counts)

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self.sums, "counts": list(self.counts)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore `state_dict()` (None: a checkpoint from before clipping existed, whose run
        clipped nothing)."""
        if state is None:
            return
        self.sums.copy_(state["sums"])
        self.counts = [int(n) for n in state["counts"]]


def check_grad_clip(value: Any) -> str | None:
    """Why `train.grad_clip=value` is refused (None: a positive number, inf included, or
    null)."""
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not value > 0:
        return (
            f"train.grad_clip={value}: must be a positive number, the largest global L2 norm "
            "of a gradient (nanoGPT's 1.0), or null (no clipping)"
        )
    return None
