"""Per-worker, per-chunk state buffers (error-feedback memory, momentum) that survive changes
in how chunks are grouped into buckets."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dpresearch.compress.base import Chunk


class ChunkBuffers:
    """One flat buffer per bucket, with a view per chunk key.

    `get(chunks, like)` returns the bucket's buffer (zeros the first time). If a bucket's
    composition changes (DDP rebuilds its buckets after the first iteration), the new buffer is
    assembled from the chunks' previous values, so state is kept per chunk, not per bucket.
    """

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, ...], Tensor] = {}
        self._views: dict[str, Tensor] = {}

    def get(self, chunks: Sequence[Chunk], like: Tensor) -> Tensor:
        keys = tuple(ch.key for ch in chunks)
        buf = self._buckets.get(keys)
        if buf is not None and buf.numel() == like.numel() and buf.device == like.device:
            return buf
        buf = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
        for ch in chunks:
            old = self._views.get(ch.key)
            if old is not None and old.numel() == ch.numel:
                buf[ch.slice].copy_(old)
        for other in [k for k in self._buckets if set(k) & set(keys)]:
            del self._buckets[other]
        self._buckets[keys] = buf
        for ch in chunks:
            self._views[ch.key] = buf[ch.slice]
        return buf

    def state_dict(self) -> dict[str, Tensor]:
        return {key: view.clone() for key, view in self._views.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self._buckets = {}
        self._views = {key: value.clone() for key, value in state.items()}
