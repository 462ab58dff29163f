"""Error feedback over stacked rows: the one memory every compressed exchange uses.

    p = memory.compensate(g, step)        # what to compress instead of g   ([W, n] -> [W, n])
    wire = codec.encode(p, step); sent = codec.decode(wire, ...)   # as the receivers decode it
    memory.update(p, sent)                # what was not sent is remembered

Synchronous SGD (`reducer.py`), the DDP hook and asynchronous pushes (`channel.Channel.encode`)
call it; an algorithm that compresses something else (e.g. an outer optimizer's pseudo-gradients)
does the same. `sent` must be decoded from the wire bytes, never taken from the encoder's
tensors: the memory then holds exactly what the receivers have not seen.

A memory is configured by the `error_feedback` node and then bound to a `[rows, numel]` state
(`bind`); every call names the rows and columns it works on (default: all), a slice or, for
columns, an index tensor (a DDP bucket's parameters in the model's flat order).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dpresearch.compress.workspace import Workspace

MODES = ("none", "ef14", "ef21")
ALL = slice(None)

Columns = slice | Tensor


class ErrorFeedback:
    """Per-worker error-feedback memory over stacked rows, with DGC momentum correction and a
    dense warm-up.

    With g_w the worker's gradient (or its local momentum, below), C the compressor and D(C(·))
    the message as every receiver decodes it:
    - mode="none":  send C(g_w).
    - mode="ef14" (Seide et al. 2014; Karimireddy et al. 2019):
          p_w = g_w + β·e_w;  send C(p_w);  e_w ← p_w − D(C(p_w)),
      β = `decay` (default 1: the plain memory, computed without the multiply). β < 1 is
      SparseLoCo's accumulator (Sarfi et al. 2025), e ← β·e + Δ before the top-k, which
      stands in for the outer momentum: the memory decays before the new input is added.
    - mode="ef21" (Richtárik et al. 2021): worker state h_w, shared estimate H = mean_w h_w
      (both start at 0):
          c_w = C(g_w − h_w);  h_w ← h_w + D(c_w);  H ← H + mean_w D(c_w);  aggregate = H.
      (`combine` turns the aggregate of the messages into H.)

    momentum > 0: DGC's momentum correction (Lin et al. 2018): u_w ← m·u_w + g_w, and u_w
    replaces g_w above, so momentum is applied before compression — run the optimizer without
    momentum. momentum_masking: after sending, zero u_w where the decoded message is non-zero
    (DGC's momentum factor masking, meant for sparsifiers; leave it off for dense compressors,
    e.g. Signum = majority vote with local momentum, where it would erase the momentum).

    start_after_steps: steps before that are dense (`warming_up`; the caller exchanges p
    uncompressed, an allreduce-mean, 4 bytes per entry, and calls `warm`). They leave EF14's
    memory at zero; EF21 sets h_w = g_w and H = mean_w g_w (its full-gradient initialisation),
    so the estimate carries over into compression.
    """

    def __init__(
        self,
        mode: str = "ef14",
        momentum: float = 0.0,
        momentum_masking: bool = False,
        start_after_steps: int = 0,
        decay: float = 1.0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; choose one of: {', '.join(MODES)}")
        if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 <= decay <= 1:
            raise ValueError(f"decay={decay}: must be a number in [0, 1]")
        if decay != 1 and mode != "ef14":
            raise ValueError(
                f"decay={decay} decays EF14's memory (e ← decay·e + g), not mode={mode}'s; "
                "set error_feedback=ef14 or decay=1"
            )
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum}: must be in [0, 1)")
        if start_after_steps < 0:
            raise ValueError(f"start_after_steps={start_after_steps}: must be >= 0")
        self.mode, self.momentum = mode, float(momentum)
        self.momentum_masking, self.start_after_steps = momentum_masking, int(start_after_steps)
        self.decay = float(decay)
        self.memory: Tensor | None = None  # e_w (ef14) or h_w (ef21): [rows, numel]
        self.velocity: Tensor | None = None  # u_w: [rows, numel]
        self.estimate: Tensor | None = None  # H (ef21), the same for every worker: [numel]
        self.ws = Workspace()

    @property
    def active(self) -> bool:
        """Whether this memory changes anything (else p = g and nothing is kept)."""
        return self.mode != "none" or self.momentum > 0 or self.start_after_steps > 0

    @property
    def wants_sent(self) -> bool:
        """Whether `update` needs the decoded messages."""
        return self.mode != "none" or (self.momentum > 0 and self.momentum_masking)

    def bind(
        self, rows: int, numel: int, dtype: torch.dtype = torch.float32, device="cpu"
    ) -> ErrorFeedback:
        """Allocate the state for `rows` workers of `numel` entries (zeros); returns self."""

        def zeros(*shape: int) -> Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.memory = zeros(rows, numel) if self.mode != "none" else None
        self.velocity = zeros(rows, numel) if self.momentum else None
        self.estimate = zeros(numel) if self.mode == "ef21" else None
        return self

    def warming_up(self, step: int) -> bool:
        """Whether `step` is a dense warm-up step."""
        return step < self.start_after_steps

    # -- the protocol -----------------------------------------------------------------------
    def compensate(
        self, g: Tensor, step: int, rows: slice = ALL, cols: Columns = ALL, scale: float = 1.0
    ) -> Tensor:
        """p for the gradients `g` `[r, n]` of rows `rows`, columns `cols` of the state (see the
        class docstring). During warm-up: g (or u_w) itself. p may be a view of the state:
        pass it unchanged to `update` (or `warm`) before the next call. scale: EF14 without
        momentum correction only, p = β·e + scale·g in one fused add (DeMo's lr_in_momentum)."""
        if scale != 1.0 and (self.mode != "ef14" or self.velocity is not None):
            raise ValueError("compensate: scale is for EF14 without momentum correction")
        u = g
        if self.velocity is not None:
            u = _take(self.velocity, rows, cols)
            u.mul_(self.momentum).add_(g)
            _put(self.velocity, rows, cols, u)
        if self.mode == "none" or self.warming_up(step):
            return u
        memory = _take(self.memory, rows, cols)
        if self.mode == "ef14":
            if self.decay != 1.0:
                memory.mul_(self.decay)
            return memory.add_(u, alpha=scale)  # stored back by `update`
        delta = self.ws.get("delta", tuple(u.shape), u.dtype, u.device)
        return torch.sub(u, memory, out=delta)

    def update(self, p: Tensor, sent: Tensor, rows: slice = ALL, cols: Columns = ALL) -> None:
        """After sending `p`: `sent` `[r, n]` is each row's message as decoded from the wire."""
        if self.mode == "ef14":
            _put(self.memory, rows, cols, p.sub_(sent))
        elif self.mode == "ef21":
            memory = _take(self.memory, rows, cols)
            _put(self.memory, rows, cols, memory.add_(sent))
        if self.velocity is not None and self.momentum_masking:
            velocity = _take(self.velocity, rows, cols)
            sent_entries = self.ws.get("masked", tuple(sent.shape), torch.bool, sent.device)
            torch.ne(sent, 0, out=sent_entries)
            _put(self.velocity, rows, cols, velocity.masked_fill_(sent_entries, 0.0))

    def combine(self, aggregate: Tensor, cols: Columns = ALL) -> None:
        """EF21: H ← H + aggregate; aggregate ← H (in place, `[n]`). Other modes: nothing."""
        if self.mode != "ef21":
            return
        estimate = _take(self.estimate, None, cols)
        estimate.add_(aggregate)
        _put(self.estimate, None, cols, estimate)
        aggregate.copy_(estimate)

    def warm(self, p: Tensor, mean: Tensor, rows: slice = ALL, cols: Columns = ALL) -> None:
        """After a dense warm-up step that sent `p` and agreed on `mean` `[n]`: EF21 starts
        from the full gradients (h_w = p_w, H = mean); other modes keep their memory."""
        if self.mode == "ef21":
            _put(self.memory, rows, cols, p)
            _put(self.estimate, None, cols, mean)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor | None]:
        """The state tensors (live, not copies: read them between steps)."""
        return {"memory": self.memory, "velocity": self.velocity, "estimate": self.estimate}

    def load_state_dict(self, state: dict[str, Tensor | None]) -> None:
        for name in ("memory", "velocity", "estimate"):
            mine, saved = getattr(self, name), state.get(name)
            if (mine is None) != (saved is None):
                raise ValueError(f"error-feedback state: {name} saved with another configuration")
            if mine is not None:
                mine.copy_(saved)


def _take(state: Tensor, rows: slice | None, cols: Columns) -> Tensor:
    """state[rows, cols] (a 1-D state when rows is None): a view for slices, else a copy."""
    part = state if rows is None else state[rows]
    return part[..., cols]


def _put(state: Tensor, rows: slice | None, cols: Columns, value: Tensor) -> None:
    """state[rows, cols] = value, unless value already is that view."""
    part = state if rows is None else state[rows]
    if isinstance(cols, slice):
        target = part[..., cols]
        if target.data_ptr() != value.data_ptr() or target.stride() != value.stride():
            target.copy_(value)
        return
    part.index_copy_(-1, cols, value)
