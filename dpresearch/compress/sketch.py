"""FetchSGD (Rothchild et al. 2020): count sketches of the gradient, summed by allreduce, with
momentum and error accumulation in sketch space and the heavy hitters recovered from the
aggregate."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.compress import rng
from dpresearch.compress.base import Aggregation, Compressor
from dpresearch.compress.topk import kept

SKETCH_UPDATES = ("subtract", "zero")


class CountSketch:
    """A count sketch of `rows` × `columns` for vectors of `numel` entries: row j adds
    s_j(i)·x_i into column h_j(i), with h_j uniform on the columns and s_j uniform on ±1, drawn
    from the stream (seed, key) — fixed for the run and the same on every worker, so sketches of
    different workers and steps live in one space. Linear: S(a) + S(b) = S(a + b) (up to
    rounding). `estimate` reads entry i back as the median over rows of s_j(i)·S[j, h_j(i)]."""

    def __init__(
        self,
        numel: int,
        rows: int,
        columns: int,
        seed: int,
        key: str,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.numel, self.rows, self.columns = numel, rows, columns
        gen = rng.generator(rng.stream_seed("sketch", seed, key))
        buckets = torch.randint(0, columns, (rows, numel), generator=gen)
        signs = torch.randint(0, 2, (rows, numel), generator=gen).mul_(2).sub_(1)
        # entry (j, i) of the flattened [rows, numel] tables lands in sketch cell j·columns + h_j(i)
        self.cells = (buckets + torch.arange(rows).unsqueeze(1) * columns).to(device)
        self.signs = signs.to(dtype).to(device)

    @property
    def size(self) -> int:
        return self.rows * self.columns

    def sketch(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """S(x[r]) for every row of `x` `[R, numel]`: `[R, rows·columns]` (added into `out`
        if given, else into zeros)."""
        if out is None:
            out = x.new_zeros(x.shape[0], self.size)
        signed = x.unsqueeze(1) * self.signs  # [R, rows, numel]
        out.index_add_(1, self.cells.view(-1), signed.view(x.shape[0], -1))
        return out

    def sketch_sparse(self, index: Tensor, values: Tensor, out: Tensor) -> None:
        """out += S(v) for the vector v that is `values` at `index` and 0 elsewhere (1-D)."""
        cells = self.cells[:, index].reshape(-1)
        out.index_add_(0, cells, (self.signs[:, index] * values).reshape(-1))

    def estimate(self, table: Tensor) -> Tensor:
        """Every entry's estimate from one sketch `[rows·columns]`: `[numel]`."""
        looked_up = table[self.cells] * self.signs  # [rows, numel]
        if self.rows == 1:
            return looked_up[0]
        return looked_up.median(dim=0).values


class SketchAggregation(Aggregation):
    """FetchSGD's round for a chunk set: every local worker's chunks sketched into one row
    (`[W, Σ rows·columns]`), one allreduce (sum; or allgather and a sum in worker order), then —
    the same on every worker, standing for the paper's aggregator — per chunk:
        S = (1/K) Σ_w S_w;  S_u ← ρ·S_u + S;  S_e ← S_e + S_u;
        Δ = top-k of the estimates of S_e;  S_e ← S_e − S(Δ);  out = Δ.
    (`sketch_update="zero"`: S_e and S_u ← 0 in every cell where S(Δ) ≠ 0, instead.)
    S_u and S_e are the compressor's state (one pair per chunk key, per process)."""

    compressor: Sketch

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.compressor
        self.sketches, self.at = [], []
        size = 0
        for ch in self.chunks:
            k = kept(ch.numel, c.ratio)
            table = CountSketch(
                ch.numel, c.rows, c.columns(ch.numel), c.seed, ch.key, self.dtype, self.device
            )
            self.sketches.append((ch, k, table))
            self.at.append(slice(size, size + table.size))
            size += table.size
        self.size = size
        self.wire = torch.empty(len(self.workers), size, dtype=self.dtype, device=self.device)

    def run(
        self, x: Tensor, comm: Communicator, step: int, out: Tensor, sent: Tensor | None = None
    ) -> None:
        wire = self.wire
        wire.zero_()
        for (ch, _, table), at in zip(self.sketches, self.at, strict=True):
            table.sketch(x[:, ch.slice], out=wire[:, at])
        if self.collective == "allgather":
            gathered = comm.all_gather(wire)
            total = gathered[0].clone()
            for r in range(1, gathered.shape[0]):
                total.add_(gathered[r])
        else:
            comm.all_reduce(wire, op="sum")
            total = wire[0]
        total.div_(comm.world_size)
        for (ch, k, table), at in zip(self.sketches, self.at, strict=True):
            momentum, error = self.compressor.state_for(ch.key, table.size, total)
            momentum.mul_(self.compressor.momentum).add_(total[at])
            error.add_(momentum)
            estimates = table.estimate(error)
            index = torch.topk(estimates.abs(), k, sorted=False).indices
            values = estimates[index]
            if self.compressor.sketch_update == "subtract":
                table.sketch_sparse(index, -values, error)
            else:  # the authors' code: zero the cells S(Δ) touches, in S_e and S_u
                touched = torch.zeros_like(error)
                table.sketch_sparse(index, values, touched)
                hit = touched != 0
                error.masked_fill_(hit, 0.0)
                momentum.masked_fill_(hit, 0.0)
            target = out[ch.slice]
            target.zero_()
            target[index] = values.to(out.dtype)


class Sketch(Compressor):
    """FetchSGD (Rothchild et al. 2020, Algorithm 1): each worker sends a count sketch of its
    gradient (`rows` × `columns` fp32 cells per chunk); sketches are linear, so one allreduce sums
    them; momentum (ρ = `momentum`) and error accumulation run on the aggregate in sketch space,
    and the k = round(ratio·d) entries with the largest estimated magnitude are recovered from
    the accumulated sketch and applied (`SketchAggregation`). The workers keep no state; the
    aggregator's two sketches per chunk (S_u, S_e) are this object's state, identical on every
    process, and checkpointed.

    Learning rate: the paper accumulates η·S_u into S_e; here S_e accumulates S_u and the
    optimizer (plain SGD, optimizer.momentum=0: the sketch holds the momentum) applies the lr to
    the recovered Δ — the same run at a constant lr; under a schedule, error carried from earlier
    steps is applied at the current lr, as this library's error feedback does. The paper's
    optional second round that fetches exact values of the recovered entries is not made: Δ
    holds the sketch's estimates (Algorithm 1 as written).

    sketch_update: how the recovered Δ leaves the sketches. "subtract" (default; the paper's
    Algorithm 1): S_e ← S_e − S(Δ), S_u untouched. "zero" (the authors' code, CommEfficient
    `fed_aggregator._server_helper_sketched`, whose comment says the subtraction "should work
    but doesn't (model diverges)"): every cell where S(Δ) is non-zero is set to 0 in S_e, and
    in S_u (their momentum masking, an approximation of zeroing Δ's coordinates).

    columns = ⌈width·k⌉ per row (width ≥ 1: fewer columns than heavy hitters cannot separate
    them). granularity=auto sketches the whole model as one vector (the paper's setting).
    Not a gossip codec and no error-feedback memory of the library's: both live in the sketch.

    Wire bytes per chunk of d entries: 4·rows·⌈width·k⌉ (the sketch, fp32), k = round(ratio·d).
    """

    linear = True
    gossip = False
    gossip_note = (
        "recovers heavy hitters from the aggregate sketch with momentum and error kept in "
        "sketch space: its decoder is not a weighted sum of decoded messages"
    )
    memories = ("none",)
    memories_note = (
        "FetchSGD accumulates its error in sketch space (and its momentum: compressor.momentum)"
    )
    applies_momentum = True
    default_granularity = "model"
    aggregation_class: ClassVar[type[Aggregation]] = SketchAggregation

    def __init__(
        self,
        ratio: float = 0.01,
        rows: int = 5,
        width: float = 10.0,
        momentum: float = 0.9,
        seed: int = 0,
        sketch_update: str = "subtract",
    ) -> None:
        super().__init__(seed)
        if sketch_update not in SKETCH_UPDATES:
            raise ValueError(
                f"sketch_update={sketch_update}; choose one of: {', '.join(SKETCH_UPDATES)}"
            )
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio={ratio}: must be in (0, 1]")
        if rows < 1:
            raise ValueError(f"rows={rows}: a count sketch needs at least 1 row")
        if not width >= 1.0:
            raise ValueError(
                f"width={width}: the sketch has fewer columns than the k = ratio·d heavy hitters "
                "it must recover; set compressor.width >= 1 (columns = width·k)"
            )
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum}: must be in [0, 1)")
        self.ratio, self.rows, self.width, self.momentum = ratio, int(rows), width, momentum
        self.sketch_update = sketch_update
        self._state: dict[str, tuple[Tensor, Tensor]] = {}

    def columns(self, numel: int) -> int:
        """Columns per sketch row for a chunk of `numel` entries."""
        return math.ceil(self.width * kept(numel, self.ratio))

    def payload_bytes(
        self, numel: int, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32
    ) -> int:
        return self.rows * self.columns(numel) * dtype.itemsize

    def state_for(self, key: str, size: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """The (momentum S_u, error S_e) sketches of chunk `key` (zeros at first)."""
        state = self._state.get(key)
        if state is None:
            state = (like.new_zeros(size), like.new_zeros(size))
        elif state[0].device != like.device or state[0].dtype != like.dtype:  # restored
            state = (state[0].to(like), state[1].to(like))
        self._state[key] = state
        return state

    def state_dict(self) -> dict:
        return {key: {"momentum": u, "error": e} for key, (u, e) in self._state.items()}

    def load_state_dict(self, state: dict) -> None:
        self._state = {
            key: (saved["momentum"].clone(), saved["error"].clone()) for key, saved in state.items()
        }
