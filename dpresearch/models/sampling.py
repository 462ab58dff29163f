"""Autoregressive sampling from any language model: the one loop `GPT.generate` and
`TextDataset.sample` (the run's `sample.txt`) both run."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@torch.no_grad()
def sample_tokens(
    model: nn.Module,
    idx: Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """`idx` `[B, T0]` followed by `max_new_tokens` tokens drawn from `model` (token ids `[B, T]`
    to logits `[B, T, V]`), `[B, T0 + max_new_tokens]`: each from softmax(logits / `temperature`)
    at the last position (in float32), restricted to the `top_k` likeliest (None: all), over
    the last `block_size` tokens of context. The draws use `generator` (the same state gives
    the same tokens), on the generator's device, which may differ from the model's. Runs in
    eval mode (no dropout) and restores the module's mode afterwards."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}: must be >= 1 (or None)")
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits = model(idx[:, -block_size:])[:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            if generator is not None:
                probs = probs.to(generator.device)
            nxt = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, nxt.to(idx.device)), dim=1)
    finally:
        model.train(was_training)
    return idx
