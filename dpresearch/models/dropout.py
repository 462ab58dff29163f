"""Dropout drawn from a per-worker stream (`model.dropout_stream`).

torch's dropout draws its masks from the process's global generator: K simulated workers in
one process draw from one stream one after another, K gloo processes from K streams, and a
stacked forward (`run/stacked.py`) would draw layer by layer across the workers — three
different sets of masks for the same run. Under the `worker` stream each worker's masks come
from its own generator instead: the caller (`run/compute.py`) seeds one per worker and batch
and installs them with `drawing_from` around the forward; each dropout site then draws, in
forward order, one mask per worker from that worker's generator. The loop, one process per
worker and the stacked rows thereby draw the same masks bit for bit.

`stream_dropout(x, p, generators)` is the one mask rule: `x`'s first dimension is split into
`len(generators)` equal rows (one generator: all of `x`), row i's keep mask is float32
`torch.rand(row shape, generator=generators[i]) >= p`, and the kept entries are multiplied
by 1/(1−p) (the dropped ones are 0), as torch's dropout scales them. Without installed
generators (a model used outside a run's compute) the masks come from torch's global
generator by the same rule.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WORKER, GLOBAL = "worker", "global"
STREAMS = (WORKER, GLOBAL)

_GENERATORS: ContextVar[tuple[torch.Generator, ...] | None] = ContextVar(
    "dropout_generators", default=None
)


def check_stream(stream: str) -> str:
    """`stream` if it is one of `STREAMS`, else a one-line `ValueError` naming the choices."""
    if stream not in STREAMS:
        raise ValueError(f"model.dropout_stream={stream}: choose one of: {', '.join(STREAMS)}")
    return stream


@contextmanager
def drawing_from(generators: Sequence[torch.Generator] | None) -> Iterator[None]:
    """Within the block, `worker`-stream dropout draws from `generators` (one per worker, in
    the order of the rows of the activations; None: torch's global generator)."""
    token = _GENERATORS.set(None if generators is None else tuple(generators))
    try:
        yield
    finally:
        _GENERATORS.reset(token)


def installed() -> tuple[torch.Generator, ...] | None:
    """The generators `drawing_from` installed (None: none)."""
    return _GENERATORS.get()


def stream_dropout(x: Tensor, p: float, generators: Sequence[torch.Generator] | None) -> Tensor:
    """`x` with dropout `p` under the mask rule of the module docstring (training mode)."""
    device, f32 = x.device, torch.float32  # float32 uniforms whatever the default dtype
    if generators is None:
        keep = torch.rand(x.shape, device=device, dtype=f32) >= p
    elif len(generators) == 1:
        keep = torch.rand(x.shape, generator=generators[0], device=device, dtype=f32) >= p
    else:
        if x.shape[0] % len(generators):
            raise ValueError(
                f"dropout over {x.shape[0]} rows cannot be split among {len(generators)} workers"
            )
        row = (x.shape[0] // len(generators), *x.shape[1:])
        keep = torch.cat(
            [torch.rand(row, generator=g, device=device, dtype=f32) >= p for g in generators]
        )
    return x * (keep.to(x.dtype) * (1.0 / (1.0 - p)))


def draws_worker_stream(model: nn.Module) -> bool:
    """Whether `model` draws `worker`-stream dropout in training: a module with
    `dropout_stream == "worker"` and a probability (`p` of a dropout module, else its
    `dropout`) above 0. Its compute then installs per-worker generators."""
    for m in model.modules():
        if getattr(m, "dropout_stream", None) == WORKER:
            p = m.p if isinstance(m, nn.Dropout) else getattr(m, "dropout", 0.0)
            if p > 0:
                return True
    return False


class StreamDropout(nn.Dropout):
    """`nn.Dropout` on the stream `dropout_stream`: `global` is torch's own dropout (its
    global generator), `worker` draws by `stream_dropout` from the installed generators."""

    def __init__(self, p: float = 0.5, dropout_stream: str = WORKER) -> None:
        super().__init__(p)
        self.dropout_stream = check_stream(dropout_stream)

    def forward(self, x: Tensor) -> Tensor:
        if self.dropout_stream == GLOBAL:
            return F.dropout(x, self.p, self.training, self.inplace)
        if not self.training or self.p == 0:
            return x
        return stream_dropout(x, self.p, installed())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dropout_stream={self.dropout_stream}"
