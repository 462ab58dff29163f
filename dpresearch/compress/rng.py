"""Seeded randomness that depends only on what it is for, never on call order.

Every random draw of a compressor is seeded from a tuple such as
(purpose, run seed, worker, key, step): the same tuple gives the same numbers whether the
workers are simulated in one process or spread over processes, whatever order tensors are
compressed in, and after a resume. Draws shared by all workers (random-k indices, PowerSGD's
initial Q) leave the worker out of the tuple.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import Tensor

from dpresearch.compress.kernels import BLOCK, numpy_path


def stream_seed(*parts: object) -> int:
    """A 63-bit seed from `parts` (stable across processes and Python versions)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on `device` seeded with `seed`."""
    return torch.Generator(device=device).manual_seed(seed)


class Int16Stream:
    """Independent integers uniform on −2¹⁵…2¹⁵−1 (16 random bits each), written as floats into
    successive tensors.

    On the CPU the bits come from numpy's PCG64 (raw 64-bit words split into four), about five
    times cheaper per entry than a torch float draw; fill tensors of a multiple of 4 entries to
    keep the stream independent of how it is cut. On other devices they come from torch's
    generator. Both are deterministic in `seed`, but they are different streams: a seed
    reproduces a run on the same device type.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.numpy = numpy_path(torch.empty(0, device=device))
        if self.numpy:
            self._bits = np.random.PCG64(seed)
        else:
            self._gen = generator(seed, device)

    def fill(self, out: Tensor) -> Tensor:
        """Write the next `out.numel()` values into the float tensor `out`; returns `out`."""
        numel = out.numel()
        if self.numpy:
            flat = out.view(-1)
            for start in range(0, numel, BLOCK):
                size = min(BLOCK, numel - start)
                words = self._bits.random_raw((size + 3) // 4)
                flat[start : start + size].copy_(torch.from_numpy(words.view(np.int16)[:size]))
            return out
        ints = torch.randint(
            -(2**15), 2**15, out.shape, dtype=torch.int16, device=out.device, generator=self._gen
        )
        return out.copy_(ints)


def uniform_bits(seed: int, out: Tensor, bits: int) -> Tensor:
    """Fill the int32 tensor `out` with independent integers uniform on 0 … 2^bits − 1
    (1 ≤ bits ≤ 31) from a stream seeded by `seed`; returns `out`. On the CPU: the top `bits`
    of numpy PCG64's raw 32-bit words; elsewhere torch's generator (both deterministic in the
    seed, different streams: a seed reproduces a run on the same device type)."""
    if not 1 <= bits <= 31:
        raise ValueError(f"bits={bits}: must be in 1..31")
    numel = out.numel()
    if numpy_path(out):
        words = np.random.PCG64(seed).random_raw((numel + 1) // 2).view(np.uint32)[:numel]
        if out.is_contiguous() and out.dtype == torch.int32:  # shifted straight into `out`
            np.right_shift(words, 32 - bits, out=out.numpy().reshape(-1), casting="unsafe")
            return out
        out.view(-1).copy_(torch.from_numpy((words >> np.uint32(32 - bits)).astype(np.int32)))
        return out
    gen = generator(seed, out.device)
    return out.copy_(torch.randint(0, 2**bits, out.shape, generator=gen, device=out.device))
