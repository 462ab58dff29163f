"""Element-wise kernels with a faster numpy path on the CPU (where torch's kernel for the same
operation is several times slower, or needs a full-size temporary); other devices use torch."""

from __future__ import annotations

import numpy as np
from torch import Tensor

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
