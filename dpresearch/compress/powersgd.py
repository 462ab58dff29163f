"""PowerSGD: rank-r gradient compression by one step of power iteration (Vogels et al. 2019)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.compress import rng
from dpresearch.compress.base import Chunk, Compressor
from dpresearch.compress.workspace import scratch


def orthogonalize(matrix: Tensor) -> None:
    """Gram–Schmidt on the columns of `matrix` [m, r], in place (r is small, so this beats QR).
    A zero column stays zero instead of becoming NaN."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i : i + 1]
        col.div_(torch.linalg.vector_norm(col).clamp_min(1e-30))
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(col * (col.T @ rest))


class PowerSGD(Compressor):
    """Rank-r approximation M ≈ P̂·Qᵀ of each chunk viewed as a matrix M, found by one power
    iteration per step warm-started from the previous step's Q. Linear (the factors are summed):
    two allreduce rounds per bucket, every chunk of the bucket in the same two collectives:

        round 1: P_w = M_w·Q              allreduce-mean → P̄; P̂ = Gram–Schmidt(P̄)
        round 2: Q_w = M_wᵀ·P̂             allreduce-mean → Q̄ (kept as next step's Q)
        aggregate = P̂·Q̄ᵀ = P̂P̂ᵀ·mean_w(M_w)

    Matrix view: a chunk that is one parameter of ≥ 2 dims is (shape[0], prod(shape[1:])) (conv
    weights: out × in·k·k); a chunk without a shape (bucket / whole-model granularity) is
    zero-padded to a near-square m × c with m = ⌈√d⌉, c = ⌈d/m⌉. A chunk is sent uncompressed
    (in round 1) when it is a 1-D parameter, or when compression does not pay:
    m·c ≤ min_compression_rate·(m + c)·r, or r > min(m, c).

    Error feedback: the decoded message of every worker is the shared aggregate P̂Q̄ᵀ, as in the
    paper's Algorithm 1 (e_w ← M_w − P̂Q̄ᵀ); an uncompressed chunk decodes to itself.

    Wire bytes per chunk of d fp32 entries: 4·r·(m + c) when compressed (4·m·r in round 1,
    4·c·r in round 2), else 4·d (round 1).

    Initial Q ~ N(0, 1), drawn from (run seed, key) so that all workers agree; with
    `warm_start=False` it is redrawn every step from (run seed, key, step).
    """

    linear = True

    def __init__(
        self,
        rank: int = 2,
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        seed: int = 0,
        worker: int = 0,
    ) -> None:
        super().__init__(seed, worker)
        if rank < 1:
            raise ValueError(f"rank={rank}: must be >= 1")
        if min_compression_rate < 0:
            raise ValueError(f"min_compression_rate={min_compression_rate}: must be >= 0")
        self.rank, self.min_compression_rate = rank, min_compression_rate
        self.warm_start = warm_start
        self.q: dict[str, Tensor] = {}

    def matrix_shape(self, numel: int, shape: tuple[int, ...] | None) -> tuple[int, int] | None:
        """(m, c) of the matrix view, or None if the chunk goes uncompressed."""
        if shape is not None:
            if len(shape) < 2:
                return None
            m, c = shape[0], math.prod(shape[1:])
        else:
            m = math.isqrt(numel - 1) + 1 if numel > 0 else 0
            c = -(-numel // m) if m else 0
        r = self.rank
        if r > min(m, c) or m * c <= self.min_compression_rate * (m + c) * r:
            return None
        return m, c

    def payload_bytes(
        self, numel: int, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32
    ) -> int:
        size = dtype.itemsize
        mc = self.matrix_shape(numel, shape)
        return size * (numel if mc is None else self.rank * (mc[0] + mc[1]))

    def _initial_q(self, key: str, step: int, c: int, like: Tensor) -> Tensor:
        parts: tuple = ("powersgd", self.seed, key)
        if not self.warm_start:
            parts += (step,)
        gen = rng.generator(rng.stream_seed(*parts))
        return torch.randn(c, self.rank, generator=gen).to(like)

    def _q(self, key: str, step: int, c: int, like: Tensor) -> Tensor:
        q = self.q.get(key)
        if not self.warm_start or q is None or q.shape != (c, self.rank):
            q = self._initial_q(key, step, c, like)
        return q

    def state_dict(self) -> dict:
        return {"q": {k: v.clone() for k, v in self.q.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.q = {k: v.clone() for k, v in state.get("q", {}).items()}

    @classmethod
    def aggregate(
        cls,
        workers: Sequence[Compressor],
        rows: Sequence[Tensor],
        chunks: Sequence[Chunk],
        comm: Communicator,
        step: int,
        out: Tensor,
        local: Sequence[Tensor] | None = None,
        collective: str = "auto",
    ) -> None:
        if collective == "allgather":
            raise ValueError("powersgd runs its own two allreduce rounds; use collective=auto")
        lead = workers[0]
        assert isinstance(lead, PowerSGD)
        r, k, n_workers = lead.rank, comm.world_size, len(rows)
        dtype, device = rows[0].dtype, rows[0].device
        plans = [(ch, lead.matrix_shape(ch.numel, ch.shape)) for ch in chunks]
        dense = [ch for ch, mc in plans if mc is None]
        low = [(ch, mc[0], mc[1]) for ch, mc in plans if mc is not None]

        matrices = [[_Matrix(row[ch.slice], m, c) for ch, m, c in low] for row in rows]
        size1 = sum(ch.numel for ch in dense) + sum(m * r for _, m, _ in low)
        wire = scratch("powersgd.round1", (n_workers, size1), dtype, device)
        for w, (worker, row) in enumerate(zip(workers, rows, strict=True)):
            offset = 0
            for ch in dense:
                wire[w, offset : offset + ch.numel].copy_(row[ch.slice])
                offset += ch.numel
            for (ch, m, c), matrix in zip(low, matrices[w], strict=True):
                q = worker._q(ch.key, step, c, row)
                matrix.times(q, out=wire[w, offset : offset + m * r].view(m, r))
                offset += m * r
        comm.all_reduce(wire, op="sum")
        reduced = wire[0].div(k)

        offset = 0
        for ch in dense:
            out[ch.slice].copy_(reduced[offset : offset + ch.numel])
            if local is not None:
                for w, row in enumerate(rows):
                    local[w][ch.slice].copy_(row[ch.slice])
            offset += ch.numel
        if not low:
            return
        ps = []
        for _, m, _ in low:
            p = reduced[offset : offset + m * r].view(m, r)
            orthogonalize(p)
            ps.append(p)
            offset += m * r

        size2 = sum(c * r for _, _, c in low)
        wire2 = scratch("powersgd.round2", (n_workers, size2), dtype, device)
        for w in range(n_workers):
            offset = 0
            for (_, _m, c), matrix, p in zip(low, matrices[w], ps, strict=True):
                matrix.transposed_times(p, out=wire2[w, offset : offset + c * r].view(c, r))
                offset += c * r
        comm.all_reduce(wire2, op="sum")
        reduced2 = wire2[0].div(k)

        offset = 0
        for (ch, _m, c), p in zip(low, ps, strict=True):
            q = reduced2[offset : offset + c * r].view(c, r)
            offset += c * r
            for worker in workers:
                assert isinstance(worker, PowerSGD)
                worker.q[ch.key] = q.clone()
            approx = out[ch.slice]
            _Matrix(approx, p.shape[0], c).assign_product(p, q)
            if local is not None:
                for w in range(n_workers):
                    local[w][ch.slice].copy_(approx)


class _Matrix:
    """A flat tensor of d entries read as an m × c matrix, row by row, without copying: the
    first ⌊d/c⌋ rows are a view, and a partial last row (d < m·c) counts as zero-padded."""

    def __init__(self, flat: Tensor, m: int, c: int) -> None:
        self.full = flat.numel() // c
        self.head = flat[: self.full * c].view(self.full, c)
        self.tail = flat[self.full * c :]
        self.m, self.c = m, c

    def _padded_tail(self) -> Tensor:
        return torch.cat([self.tail, self.tail.new_zeros(self.c - self.tail.numel())])

    def times(self, q: Tensor, out: Tensor) -> None:
        """out [m, r] = M·q."""
        torch.matmul(self.head, q, out=out[: self.full])
        out[self.full :].zero_()
        if self.tail.numel():
            out[self.full] = self.tail @ q[: self.tail.numel()]

    def transposed_times(self, p: Tensor, out: Tensor) -> None:
        """out [c, r] = Mᵀ·p."""
        torch.matmul(self.head.T, p[: self.full], out=out)
        if self.tail.numel():
            out.addr_(self._padded_tail(), p[self.full])

    def assign_product(self, p: Tensor, q: Tensor) -> None:
        """M ← p·qᵀ (entries beyond d dropped)."""
        torch.matmul(p[: self.full], q.T, out=self.head)
        if self.tail.numel():
            self.tail.copy_((p[self.full] @ q.T)[: self.tail.numel()])
