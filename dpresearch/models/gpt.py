"""A decoder-only transformer language model (GPT-2 style), as nanoGPT's `model.py` defines it.

Differences from the image models' contract (`models/__init__.py`): `num_classes` is the
vocabulary size, `input_shape == (T,)` is the data's window length, and the forward pass maps
a LongTensor `[B, T]` of token ids to float logits `[B, T, num_classes]` (next-token logits at
every position). Module and parameter names are nanoGPT's (`transformer.wte`, `.wpe`, `.h.<i>`,
`.ln_f`, `lm_head`), and so is the order in which initialisation draws from torch's generator.

Dropout (`dropout` > 0, training) draws on the stream `dropout_stream` (`models/dropout.py`):
`global` as nanoGPT — torch's global generator, attention dropout inside the fused
`scaled_dot_product_attention` — or `worker` (the default): every mask from the worker's own
generator, in forward order (the embedding's, then per block the attention probabilities',
the attention output's and the MLP's), attention written out (`causal_attention`) so that its
probabilities can be masked from that generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpresearch.models.dropout import GLOBAL, StreamDropout, check_stream, installed, stream_dropout
from dpresearch.models.sampling import sample_tokens


def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, p: float, generators: Sequence[torch.Generator] | None
) -> Tensor:
    """softmax(q·kᵀ/√d, causal) · v with `worker`-stream dropout `p` on the probabilities
    (`stream_dropout`, its rows split along q's first dimension), for q, k, v `[N, heads, T,
    d]`: scaled_dot_product_attention's math written out, as nanoGPT's non-flash path."""
    t = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    att = F.softmax(att.masked_fill(future, float("-inf")), dim=-1)
    return stream_dropout(att, p, generators) @ v


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused q/k/v projection (`c_attn`), torch's
    `scaled_dot_product_attention` with `is_causal=True`, an output projection (`c_proj`);
    in training with dropout on the `worker` stream, `causal_attention` instead."""

    def __init__(
        self, n_embd: int, n_head: int, dropout: float, bias: bool, dropout_stream: str = "worker"
    ) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = StreamDropout(dropout, dropout_stream)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout
        self.dropout_stream = check_stream(dropout_stream)

    def drawn(self) -> bool:
        """Whether this forward masks attention from the `worker` stream (`causal_attention`)."""
        return self.training and self.dropout > 0 and self.dropout_stream != GLOBAL

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.drawn():
            y = causal_attention(q, k, v, self.dropout, installed())
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Linear (4× wider) → GELU → Linear → dropout."""

    def __init__(
        self, n_embd: int, dropout: float, bias: bool, dropout_stream: str = "worker"
    ) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = StreamDropout(dropout, dropout_stream)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(
        self, n_embd: int, n_head: int, dropout: float, bias: bool, dropout_stream: str = "worker"
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias, dropout_stream)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias, dropout_stream)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT: token + learned position embeddings (dropout), `n_layer` pre-LN blocks,
    a final LayerNorm and an output head tied to the token embedding (`lm_head.weight is
    transformer.wte.weight`). `bias`: biases in the Linears and LayerNorms (GPT-2: true;
    nanoGPT's default false). `block_size`: the longest context (None: the data's `T`).
    `dropout_stream`: where dropout's masks come from, `worker` (each worker's own generator,
    the same masks in simulated, gloo and stacked workers) or `global` (torch's global
    generator, as nanoGPT); see the module docstring.

    Initialisation as nanoGPT: every Linear and Embedding weight N(0, 0.02²), biases 0, the
    residual projections (`c_proj.weight`) N(0, (0.02/√(2·n_layer))²).

    Contract: `forward(idx)` with `idx` a LongTensor `[B, T]` of ids in [0, num_classes),
    T ≤ block_size, returns float logits `[B, T, num_classes]`; a causal model: the logits at
    position t depend on `idx[:, :t+1]` only. Bad sizes raise one-line `ValueError`s naming the
    `model.` key; a float input (image data) raises a one-line `TypeError`.
    """

    def __init__(
        self,
        num_classes: int,
        input_shape: Sequence[int],
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 192,
        block_size: int | None = None,
        dropout: float = 0.0,
        bias: bool = False,
        dropout_stream: str = "worker",
    ) -> None:
        super().__init__()
        if len(input_shape) != 1:
            raise ValueError(
                f"model GPT takes windows of token ids, not inputs of shape {list(input_shape)}; "
                "use a text data set (data=shakespeare or data=text)"
            )
        window = int(input_shape[0])
        block_size = window if block_size is None else block_size
        for key, value in (
            ("n_layer", n_layer),
            ("n_head", n_head),
            ("n_embd", n_embd),
            ("block_size", block_size),
            ("num_classes", num_classes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{key}={value}: must be an integer >= 1")
        if n_embd % n_head != 0:
            raise ValueError(f"model.n_embd={n_embd} must be a multiple of model.n_head={n_head}")
        if window > block_size:
            raise ValueError(
                f"model.block_size={block_size} is shorter than the data's windows of {window}; "
                "raise model.block_size or lower data.block_size"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout={dropout}: must be in [0, 1)")
        check_stream(dropout_stream)
        self.block_size, self.n_layer = block_size, n_layer
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(num_classes, n_embd),
                "wpe": nn.Embedding(block_size, n_embd),
                "drop": StreamDropout(dropout, dropout_stream),
                "h": nn.ModuleList(
                    Block(n_embd, n_head, dropout, bias, dropout_stream) for _ in range(n_layer)
                ),
                "ln_f": nn.LayerNorm(n_embd, bias=bias),
            }
        )
        self.lm_head = nn.Linear(n_embd, num_classes, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(_init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: Tensor) -> Tensor:
        if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise TypeError(
                f"model.GPT takes integer token ids [B, T], got a {idx.dtype} tensor of shape "
                f"{list(idx.shape)} (image data? use a text data set)"
            )
        if idx.dim() != 2:
            raise ValueError(f"model.GPT takes token ids [B, T], got shape {list(idx.shape)}")
        length = idx.shape[1]
        if length > self.block_size:
            raise ValueError(
                f"model.block_size={self.block_size} is shorter than the input's {length} tokens"
            )
        pos = torch.arange(length, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, the tied embedding/head counted once; `non_embedding`: without the
        position embeddings (nanoGPT's convention: the token embedding stays in, since it is
        also the output layer's weight)."""
        count = sum(p.numel() for p in self.parameters())
        return count - self.transformer.wpe.weight.numel() if non_embedding else count

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """`idx` `[B, T0]` followed by `max_new_tokens` sampled tokens, `[B, T0 +
        max_new_tokens]`: each drawn from softmax(logits / `temperature`) at the last position,
        restricted to the `top_k` likeliest (None: all), with `generator` (the same generator
        state gives the same tokens); the context is cropped to the last `block_size` tokens.
        Runs in eval mode (no dropout) and restores the module's mode afterwards
        (`sampling.sample_tokens`)."""
        return sample_tokens(
            self, idx, max_new_tokens, self.block_size, temperature, top_k, generator
        )


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
