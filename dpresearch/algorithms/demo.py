"""DeMo: Decoupled Momentum Optimization (Peng, Quesnelle & Kingma 2024, arXiv 2411.19870).

Every worker keeps its own momentum; no gradient is ever all-reduced. What travels is the
momentum's "fast components": the largest coefficients of a chunked DCT of it, which are then
removed from the momentum (the momentum itself is the error feedback). On worker i at each step,
with η the lr of the step (after the schedule) and λ the weight decay ("Algorithm 1": the
paper's; "demo.py:N": line N of the reference code, bloc97/DeMo's demo.py at commit 0e48145):

    m_i ← β·m_i + g_i                    (paper, Algorithm 1 line 2; `lr_in_momentum=true`:
                                          m_i ← β·m_i + η·g_i, the reference, demo.py:128-132)
    c_i = DCT(m_i)                        chunk by chunk (below)
    q_i = the `topk` largest |c_i| of every chunk: (indices, values)      (line 3)
    m_i ← m_i − IDCT(q_i)                 (line 4; the reference subtracts the decoded q_i too)
    all-gather every worker's (indices, values)                           (line 5)
    Q   = IDCT(avg_K q)                   `average=all`: (1/K)·Σ_k q_k, coefficient by
                                          coefficient (zeros where a worker sent nothing;
                                          Algorithm 1 leaves Synchronize abstract: this is
                                          the plain average of the K workers' q);
                                          `average=senders`: the mean over the workers that
                                          sent that coefficient (the reference's
                                          `scatter_reduce(..., "mean", include_self=False)`,
                                          demo.py:296)
    θ   ← θ·(1 − η·λ) − η·sign(Q)        (`sign=true`: the reference's sign-SGD, demo.py:124-125
                                          for the decay, 166-169 for the step; `sign=false`:
                                          θ ← θ·(1 − η·λ) − η·Q, Algorithm 1 line 6)

Every worker decodes the same gathered message, so all hold the same θ after every step (the
momenta differ). The decode scatters each worker's coefficients into its own dense block (no
index twice) and sums over the K workers in worker order, rather than the reference's one
`scatter_reduce` over all of them (whose order of additions its own comment, demo.py:295, calls
nondeterministic on CUDA), so every process computes the same Q bit for bit.

Defaults: β = 0.999, topk = 32, chunk = 64 (the paper's OLMo runs, bloc97/DeMo
`OLMo-*-demo.yaml`), `sign=true`, `average=all`, `lr_in_momentum=false`; lr 4e-4 and weight
decay 0 in `optimizer=demo` (the same files). With a constant lr `lr_in_momentum` changes
nothing but rounding under `sign=true` (top-k and sign are scale-free); under a schedule it
re-weights old gradients against new ones, as the reference does.

Chunks (the reference's `TransformDCT`). A tensor is seen as a matrix: a 2-D one as it is, a
1-D one of n entries as 1 × n, a scalar as 1 × 1, and a tensor of more dimensions as
shape[0] × (the product of the others), in the flat row's order (under `train.channels_last`
a convolution's trailing order is (kh, kw, in)) — the reference handles 1-D and 2-D tensors
only. Each dimension of n entries is cut into blocks of s = the largest divisor of n that is
at most `chunk` (n itself when n ≤ chunk; 1 for a prime n > chunk), the reference's
`_get_smaller_split`; so a 768 × 3072 matrix is tiled by 64 × 64 blocks, a 65-entry dimension
by 13s, a 1-D tensor by 1 × s blocks. Each h × w block gets the separable orthonormal DCT-II
(C_h · block · C_wᵀ, C[u, j] = α_u·cos(π(2j + 1)u / 2n), α_0 = √(1/n), α_u = √(2/n): an
orthonormal basis, so IDCT = Cᵀ · coefficients · C), computed as matrix products. Its h·w
coefficients are ranked by |value| and the top min(topk, h·w) kept (k below 1 is refused);
their index inside the block (row-major, u·w + v) and value are sent.

Bytes. One all-gather per step of one byte message per worker: the values in the parameters'
dtype, then the indices in the narrowest integer that holds every block's largest index: one
byte (uint8) where every block has at most 256 coefficients, two (int16) up to 32768 (so 64 ×
64 blocks cost two), else four (int32). Per worker and step: Σ_tensors blocks·k·(value bytes +
index bytes), no header, no padding (the shapes are fixed by the model). The reference
all-gathers torch.topk's int64 indices (eight bytes each) and the values in two collectives.

The algorithm owns the optimizer step (as `compressed_adam`): the user selects it with
`optimizer=demo`, whose node (`DeMo`: lr, weight decay per parameter group, so
`exclude_bn_bias_from_weight_decay` works) switches `algorithm` to `demo`, whose node holds β,
topk, chunk and the variants above. Momenta are checkpointed (`state_dict`). BatchNorm buffers
follow sync's DDP rule (worker 0's broadcast before every forward; `buffers=local`: each its
own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dpresearch.algorithms.base import Algorithm, Traits
from dpresearch.algorithms.compressed_adam import OwnedOptimizer, require_owned_optimizer
from dpresearch.algorithms.sync import BUFFER_MODES
from dpresearch.comm.base import Communicator
from dpresearch.compress.layout import ParamLayout, param_layout
from dpresearch.replicas import Replicas

AVERAGES = ("all", "senders")


class DeMo(OwnedOptimizer):
    """DeMo's step hyper-parameters: the lr (the schedule's, one for all groups) and the
    decoupled weight decay λ per parameter group (θ ← θ·(1 − lr·λ), the reference's), held as a
    torch optimizer so the schedule, parameter groups and checkpoints treat it as any other;
    never stepped itself. The compression options live in the algorithm node (`DeMoAlgorithm`)."""

    algorithm = "dpresearch.algorithms.demo.DeMoAlgorithm"
    option = "optimizer=demo"

    def __init__(self, params: Any, lr: float = 4e-4, weight_decay: float = 0.0) -> None:
        if lr < 0 or weight_decay < 0:
            raise ValueError("lr and weight_decay must be >= 0")
        # no betas or eps: the torch.optim.Optimizer constructor, not OwnedOptimizer's
        torch.optim.Optimizer.__init__(self, params, dict(lr=lr, weight_decay=weight_decay))


def check_options(beta: Any, topk: Any, chunk: Any, average: Any, buffers: Any,
                  sign: Any = True, lr_in_momentum: Any = False) -> None:  # fmt: skip
    """The algorithm node's values, one line naming the fix (ValueError)."""
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"algorithm.topk={topk}: must be an integer >= 1 (coefficients kept "
                         "per chunk; the paper's 32)")  # fmt: skip
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"algorithm.chunk={chunk}: must be an integer >= 1 (the DCT block "
                         "side; the paper's 64)")  # fmt: skip
    if topk >= chunk * chunk:
        raise ValueError(
            f"algorithm.topk={topk} keeps every coefficient: a block holds at most chunk² = "
            f"{chunk * chunk} (algorithm.chunk={chunk}), so every block would be sent whole, "
            f"indices included; use algorithm.topk < {chunk * chunk} (the paper's 32 of 64²)"
        )
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0 <= beta < 1:
        raise ValueError(f"algorithm.beta={beta}: the momentum decay must be in [0, 1) (the "
                         "paper's 0.999)")  # fmt: skip
    if average not in AVERAGES:
        raise ValueError(f"algorithm.average={average}; choose one of: {', '.join(AVERAGES)}")
    if buffers not in BUFFER_MODES:
        raise ValueError(f"algorithm.buffers={buffers}; choose one of: {', '.join(BUFFER_MODES)}")
    for name, value in (("sign", sign), ("lr_in_momentum", lr_in_momentum)):
        if not isinstance(value, bool):
            raise ValueError(f"algorithm.{name}={value}: must be true or false")


# -- the chunked DCT ----------------------------------------------------------------------------


def dct_matrix(n: int, dtype: torch.dtype = torch.float64, device: Any = "cpu") -> Tensor:
    """The orthonormal DCT-II matrix C (`[n, n]`): C[u, j] = α_u·cos(π(2j + 1)u / 2n),
    α_0 = √(1/n), α_u = √(2/n); C·x are x's coefficients, Cᵀ·c inverts. Built in float64."""
    j = torch.arange(n, dtype=torch.float64)
    u = j[:, None]
    c = torch.cos(math.pi * (2 * j[None, :] + 1) * u / (2 * n)) * math.sqrt(2 / n)
    c[0] /= math.sqrt(2)
    return c.to(dtype=dtype, device=device)


def block_side(n: int, chunk: int) -> int:
    """The largest divisor of n that is at most `chunk` (the reference's `_get_smaller_split`)."""
    return max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)


def as_matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) a tensor of `shape` is chunked as (see the module docstring)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


@dataclass(frozen=True)
class TensorChunks:
    """How one tensor is chunked: columns [offset, offset + rows·cols) of the flat row, seen as
    a rows × cols matrix tiled by h × w blocks, k coefficients kept per block, its entries at
    [start, start + blocks·k) of the message."""

    offset: int
    rows: int
    cols: int
    h: int
    w: int
    k: int
    start: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def blocks(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    @property
    def entries(self) -> int:
        return self.blocks * self.k


class ChunkedDCT:
    """The chunked DCT of flat rows laid out as `layout` (see the module docstring), keeping
    `topk` coefficients per block. `encode` / `decode` work on one tensor's columns of `[R, D]`
    rows at once."""

    def __init__(
        self, layout: ParamLayout, chunk: int, topk: int, dtype: torch.dtype, device: Any
    ) -> None:
        tensors, start = [], 0
        for offset, shape in layout:
            rows, cols = as_matrix(tuple(shape))
            if rows * cols == 0:
                continue
            h, w = block_side(rows, chunk), block_side(cols, chunk)
            t = TensorChunks(offset, rows, cols, h, w, min(topk, h * w), start)
            tensors.append(t)
            start += t.entries
        self.tensors: list[TensorChunks] = tensors
        self.entries = start  # coefficients one worker sends per step
        self.largest_block = max((t.h * t.w for t in tensors), default=1)
        self._bases = {
            n: dct_matrix(n, dtype, device) for t in tensors for n in (t.h, t.w)
        }  # fmt: skip

    def encode(self, t: TensorChunks, x: Tensor) -> Tensor:
        """`x` `[R, rows·cols]` (one tensor's columns of R rows) → its blocks' coefficients
        `[R, blocks, h·w]` (block-row-major; a block's coefficients row-major)."""
        r = x.shape[0]
        blocks = x.reshape(r, t.rows // t.h, t.h, t.cols // t.w, t.w)
        coeffs = torch.einsum("aihjw,uh,vw->aijuv", blocks, self._bases[t.h], self._bases[t.w])
        return coeffs.reshape(r, t.blocks, t.h * t.w)

    def decode(self, t: TensorChunks, coeffs: Tensor) -> Tensor:
        """The inverse of `encode`: `[R, blocks, h·w]` → `[R, rows·cols]`."""
        r = coeffs.shape[0]
        c = coeffs.reshape(r, t.rows // t.h, t.cols // t.w, t.h, t.w)
        x = torch.einsum("aijuv,uh,vw->aihjw", c, self._bases[t.h], self._bases[t.w])
        return x.reshape(r, t.numel)


def index_dtype(largest_block: int) -> torch.dtype:
    """The narrowest integer type holding every index below `largest_block`."""
    if largest_block <= 256:
        return torch.uint8
    if largest_block <= 2**15:
        return torch.int16
    return torch.int32


# -- the algorithm ------------------------------------------------------------------------------


class DeMoAlgorithm(Algorithm):
    """DeMo over the stacked rows `[W, D]` of this process's workers (see the module docstring
    for the update, the chunks, the variants and the bytes). beta: momentum decay β ∈ [0, 1);
    topk: coefficients kept per block (≥ 1); chunk: the target block side (≥ 1); sign: step on
    sign(Q); average: all | senders; lr_in_momentum: add η·g (the reference) instead of g;
    buffers: broadcast | local."""

    traits = Traits(
        compression_note="compresses its momentum itself (top-k coefficients of a chunked DCT, "
        "the rest kept in the momentum)"
    )

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        beta: float = 0.999,
        topk: int = 32,
        chunk: int = 64,
        sign: bool = True,
        average: str = "all",
        lr_in_momentum: bool = False,
        buffers: str = "broadcast",
    ) -> None:
        super().__init__(replicas, comm, optimizers)
        check_options(beta, topk, chunk, average, buffers, sign, lr_in_momentum)
        if not all(isinstance(opt, DeMo) for opt in optimizers):
            raise ValueError(f"this algorithm runs DeMo: select it with {DeMo.option}")
        self.beta, self.topk, self.chunk = float(beta), int(topk), int(chunk)
        self.sign, self.average, self.lr_in_momentum = sign, average, lr_in_momentum
        self.buffer_mode = buffers
        self.hyper: DeMo = optimizers[0]  # type: ignore[assignment]
        params = replicas.params
        self.dct = ChunkedDCT(
            param_layout(replicas.models[0]), self.chunk, self.topk, params.dtype, params.device
        )
        self.index_dtype = index_dtype(self.dct.largest_block)
        self.value_bytes = params.element_size()
        self.index_bytes = torch.empty((), dtype=self.index_dtype).element_size()
        self.decay = column_decay(replicas, self.hyper)
        self.m = torch.zeros_like(params)

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """The optimizer (`optimizer=demo` only) and the node's values (a compressor or error
        feedback is refused by `config.checks.check_compression` with the traits' note)."""
        require_owned_optimizer(cfg, DeMo)
        alg = cfg.algorithm
        check_options(
            alg.get("beta", 0.999), alg.get("topk", 32), alg.get("chunk", 64),
            alg.get("average", "all"), alg.get("buffers", "broadcast"), alg.get("sign", True),
            alg.get("lr_in_momentum", False),
        )  # fmt: skip

    @property
    def bytes_per_step(self) -> int:
        """Bytes each worker hands to the step's all-gather."""
        return self.dct.entries * (self.value_bytes + self.index_bytes)

    def describe(self) -> dict[str, Any]:
        return {
            "demo": {
                "coefficients_per_step": self.dct.entries,
                "bytes_per_step": self.bytes_per_step,
                "index_bytes": self.index_bytes,
                "dense_bytes": self.replicas.params.shape[1] * self.value_bytes,
            }
        }

    def before_forward(self, step: int) -> None:
        if self.buffer_mode == "broadcast" and self.replicas.buffers.shape[1] > 0:
            self.comm.broadcast(self.replicas.buffers, src=0, record="buffers")

    def _lr(self) -> float:
        groups = self.hyper.param_groups
        lr = groups[0]["lr"]
        if any(g["lr"] != lr for g in groups):
            raise ValueError("DeMo takes one learning rate for all parameter groups")
        return lr

    # -- the step -------------------------------------------------------------------------------
    def after_backward(self, step: int) -> None:
        # `train.grad_clip`: each worker's own gradient, before it enters its momentum (what
        # is compressed and exchanged), as a compressed synchronous exchange clips
        self.clip_gradients()
        lr = self._lr()
        params, m = self.replicas.params, self.m
        m.mul_(self.beta).add_(self.replicas.grads, alpha=lr if self.lr_in_momentum else 1.0)
        values, indices = self._extract(m)
        update = self._synchronize(values, indices)
        if self.sign:
            update.sign_()
        decay = self.decay
        if isinstance(decay, Tensor) or decay:
            params.mul_(1 - lr * decay)  # decoupled, before the step (the reference's order)
        params.sub_(update, alpha=lr)

    def _extract(self, m: Tensor) -> tuple[Tensor, Tensor]:
        """Every worker's top-k coefficients per block (`[W, entries]` values and indices,
        tensor after tensor), removed from its momentum."""
        rows = m.shape[0]
        values = m.new_empty(rows, self.dct.entries)
        indices = torch.empty(rows, self.dct.entries, dtype=torch.long, device=m.device)
        for t in self.dct.tensors:
            x = m[:, t.offset : t.offset + t.numel]
            coeffs = self.dct.encode(t, x)
            top = coeffs.abs().topk(t.k, dim=-1, sorted=False).indices
            kept = coeffs.gather(-1, top)
            x.sub_(self.dct.decode(t, torch.zeros_like(coeffs).scatter_(-1, top, kept)))
            values[:, t.start : t.start + t.entries] = kept.reshape(rows, -1)
            indices[:, t.start : t.start + t.entries] = top.reshape(rows, -1)
        return values, indices

    def _synchronize(self, values: Tensor, indices: Tensor) -> Tensor:
        """All-gather every worker's (values, indices) as one byte message; decode the
        average Q (`[D]`, the same on every worker)."""
        rows, n = values.shape
        split = n * self.value_bytes
        wire = torch.empty(rows, split + n * self.index_bytes, dtype=torch.uint8,
                           device=values.device)  # fmt: skip
        wire[:, :split] = values.view(torch.uint8)
        wire[:, split:] = indices.to(self.index_dtype).view(torch.uint8)
        gathered = self.comm.all_gather(wire)  # [K, bytes]
        k = gathered.shape[0]
        all_values = gathered[:, :split].contiguous().view(values.dtype)
        all_indices = gathered[:, split:].contiguous().view(self.index_dtype).long()
        update = values.new_zeros(self.replicas.params.shape[1])
        for t in self.dct.tensors:
            part = slice(t.start, t.start + t.entries)
            where = all_indices[:, part].reshape(k, t.blocks, t.k)
            dense = values.new_zeros(k, t.blocks, t.h * t.w)
            total = dense.scatter_(-1, where, all_values[:, part].reshape(k, t.blocks, t.k))
            total = total.sum(0, keepdim=True)
            if self.average == "all":
                total.div_(k)
            else:
                senders = values.new_zeros(k, t.blocks, t.h * t.w).scatter_(-1, where, 1.0)
                total.div_(senders.sum(0, keepdim=True).clamp_(min=1))
            update[t.offset : t.offset + t.numel] = self.dct.decode(t, total)[0]
        return update

    def consensus(self) -> tuple[Tensor, Tensor]:
        # Parameters are identical on every worker; the buffers are worker 0's.
        buffers = self.replicas.buffers.clone()
        self.comm.broadcast(buffers, src=0, record="eval")
        return self.replicas.params[0].clone(), buffers[0]

    def state_dict(self) -> dict:
        return {"m": self.m}

    def load_state_dict(self, state: dict) -> None:
        self.m.copy_(state["m"])


def column_decay(replicas: Replicas, hyper: torch.optim.Optimizer) -> Tensor | float:
    """The weight decay of every column of the flat row (a float where all groups agree)."""
    rates = {g["weight_decay"] for g in hyper.param_groups}
    if len(rates) == 1:
        return float(rates.pop())
    of_param = {id(p): g["weight_decay"] for g in hyper.param_groups for p in g["params"]}
    params = replicas.params
    decay, offset = torch.zeros(params.shape[1], dtype=params.dtype), 0
    for p in (p for p in replicas.models[0].parameters() if p.requires_grad):
        decay[offset : offset + p.numel()] = of_param[id(p)]
        offset += p.numel()
    return decay.to(params.device)
