"""Element-wise kernels with a faster numpy path on the CPU (where torch's kernel for the same
operation is several times slower, or needs a full-size temporary); other devices use torch."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dpresearch.compress.workspace import scratch

BLOCK = 1 << 18  # entries per block: a 1 MiB fp32 temporary stays in L2
NUMPY_PATHS = True  # tests switch this off to run the torch paths on the CPU


def numpy_path(t: Tensor) -> bool:
    """Whether `t` takes the numpy fast path (CPU tensors, unless switched off)."""
    return NUMPY_PATHS and t.device.type == "cpu"


def cast_into(out: Tensor, src: Tensor) -> Tensor:
    """`out` = `src` converted to `out`'s dtype (float → integer truncates toward zero)."""
    if numpy_path(out) and out.is_contiguous() and src.is_contiguous():
        np.copyto(out.numpy(), src.numpy(), casting="unsafe")
        return out
    return out.copy_(src)


def entries_at_least(x: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """(indices (int64, ascending), values) of the entries with |x| ≥ threshold. On the CPU,
    block by block: |x| never goes to memory and the values are picked from cache."""
    if not numpy_path(x):
        idx = (x.abs() >= threshold).nonzero().view(-1)
        return idx, x[idx]
    values = x.numpy()
    magnitude = scratch("kernels.abs", min(BLOCK, x.numel()), x.dtype, x.device).numpy()
    mask = scratch("kernels.mask", min(BLOCK, x.numel()), torch.bool, x.device).numpy()
    found, picked = [], []
    for start in range(0, x.numel(), BLOCK):
        block = values[start : start + BLOCK]
        size = block.size
        np.abs(block, out=magnitude[:size])
        np.greater_equal(magnitude[:size], threshold, out=mask[:size])
        local = np.flatnonzero(mask[:size])
        picked.append(block[local])
        found.append(local + start)
    return torch.from_numpy(np.concatenate(found)), torch.from_numpy(np.concatenate(picked))
