"""DeMo: Decoupled Momentum Optimization (Peng, Quesnelle & Kingma 2024, arXiv 2411.19870).

Every worker keeps its own momentum; no gradient is ever all-reduced. What travels is the
momentum's "fast components": the largest coefficients of a chunked DCT of it, which are then
removed from the momentum (the momentum itself is the error feedback). On worker i at each step,
with η the lr of the step (after the schedule) and λ the weight decay ("Algorithm 1": the
paper's; "demo.py:N": line N of the reference code, bloc97/DeMo's demo.py at commit 0e48145):

    m_i ← β·m_i + g_i                    (paper, Algorithm 1 line 2; `lr_in_momentum=true`:
                                          m_i ← β·m_i + η·g_i, the reference, demo.py:128-132)
    c_i = DCT(m_i)                        chunk by chunk (compress/dct.py)
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

The parts are the shared ones (issue 43): the chunks, the DCT, the top-k and the bytes are the
`dct_topk` compressor's (`compress/dct.py`: blocks of each dimension's largest divisor ≤
`chunk`, the narrowest index integer for the model's largest block, values then indices in one
all-gathered byte row, no header), whose codec this class encodes, decodes and gathers through;
the momentum is EF14's memory with decay β (`compress/error_feedback.py`); the step is
`sign_sgd.decoupled_step`. So `algorithm=sync compressor=dct_topk error_feedback=ef14
error_feedback.decay=β optimizer=sign_sgd` (or `optimizer=sgd` for `sign=false`) is this
algorithm bit for bit (tests/test_dct_topk.py). What stays here is DeMo's own: `average=senders`
(each DCT coefficient's mean over the workers that sent it, before the inverse DCT: a
compressor's `finalize_gathered` sees the decoded sum after it),
`lr_in_momentum`, and one node for all its options. The reference all-gathers torch.topk's int64
indices (eight bytes each) and the values in two collectives.

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
from dpresearch.algorithms.compressed_adam import (
    OwnedOptimizer,
    column_decay,
    require_owned_optimizer,
)
from dpresearch.algorithms.sync import BUFFER_MODES
from dpresearch.comm.base import Communicator
from dpresearch.compress.base import AVERAGES
from dpresearch.compress.chunks import Chunk
from dpresearch.compress.dct import ChunkedDCT, DCTTopK, DCTTopKCodec, block_side
from dpresearch.compress.error_feedback import ErrorFeedback
from dpresearch.compress.layout import param_layout
from dpresearch.options import Options
from dpresearch.replicas import Replicas
from dpresearch.sign_sgd import decoupled_step

__all__ = ["AVERAGES", "ChunkedDCT", "DeMo", "DeMoAlgorithm", "block_side", "check_options"]


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


@dataclass(frozen=True)
class DeMoOptions(Options):
    """DeMo's algorithm keys (`algorithm=demo` or `optimizer=demo`; its lr and weight decay:
    the optimizer node). Defaults: the paper's OLMo runs."""

    beta: float = 0.999
    """momentum decay β, in [0, 1)"""
    topk: int = 32
    """coefficients kept per chunk (>= 1; fewer than chunk²)"""
    chunk: int = 64
    """DCT block side: each dimension in blocks of its largest divisor <= chunk"""
    sign: bool = True
    """θ ← θ − lr·sign(Q) (the reference); false: θ ← θ − lr·Q (Algorithm 1)"""
    average: str = "all"
    """all: Σ_k q_k / K | senders: each coefficient's mean over the workers that sent it (the
    reference)"""
    lr_in_momentum: bool = False
    """true: m ← β·m + lr·g (the reference)"""
    buffers: str = "broadcast"
    """broadcast (worker 0's BatchNorm statistics, as sync) | local"""

    def check(self) -> None:
        check_options(
            self.beta,
            self.topk,
            self.chunk,
            self.average,
            self.buffers,
            self.sign,
            self.lr_in_momentum,
        )


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
    OPTIONS = DeMoOptions

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        beta: float = DeMoOptions.beta,
        topk: int = DeMoOptions.topk,
        chunk: int = DeMoOptions.chunk,
        sign: bool = DeMoOptions.sign,
        average: str = DeMoOptions.average,
        lr_in_momentum: bool = DeMoOptions.lr_in_momentum,
        buffers: str = DeMoOptions.buffers,
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
        layout = param_layout(replicas.models[0])
        chunks = [Chunk(str(i), o, math.prod(s), tuple(s)) for i, (o, s) in enumerate(layout)]
        self.codec: DCTTopKCodec = DCTTopK(self.topk, self.chunk).codec(  # type: ignore[assignment]
            chunks, params.dtype, params.device, comm.local_workers, linear=False
        )
        self.dct = self.codec.dct
        self.index_dtype = self.codec.index
        self.value_bytes = params.element_size()
        self.index_bytes = torch.empty((), dtype=self.index_dtype).element_size()
        self.decay = column_decay(replicas, self.hyper)
        # the momentum is EF14's memory with decay β: m ← β·m + g, then m ← m − (what was sent)
        self.memory = ErrorFeedback("ef14", decay=self.beta).bind(*params.shape, params.dtype,
                                                                  params.device)  # fmt: skip
        self.sent = torch.empty_like(params)

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """The optimizer (`optimizer=demo` only) and the node's values (a compressor or error
        feedback is refused by `config.checks.check_compression` with the traits' note)."""
        require_owned_optimizer(cfg, DeMo)
        super().check_config(cfg)

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
        scale = lr if self.lr_in_momentum else 1.0
        m = self.memory.compensate(self.replicas.grads, step, scale=scale)
        wire = self.codec.encode(m, step)
        self.codec.decode(wire, step, self.sent)  # as the receivers decode it
        self.memory.update(m, self.sent)
        update = self._synchronize(wire)
        # decoupled decay before the step (the reference's order)
        decoupled_step(self.replicas.params, update.sign_() if self.sign else update, lr,
                       self.decay)  # fmt: skip

    def _synchronize(self, wire: Tensor) -> Tensor:
        """All-gather every worker's message; decode the average Q (`[D]`, the same on every
        worker): coefficients summed over the K workers, divided, then one IDCT per tensor."""
        gathered = self.comm.all_gather(wire)  # [K, bytes]
        k = gathered.shape[0]
        coefficients = self.codec.coefficients(gathered)
        if self.average == "senders":
            counts = self.codec.coefficients(gathered, ones=True)
        update = self.replicas.params.new_zeros(self.replicas.params.shape[1])
        for i, (t, dense) in enumerate(zip(self.dct.tensors, coefficients, strict=True)):
            total = dense.sum(0, keepdim=True)
            if self.average == "all":
                total.div_(k)
            else:
                total.div_(counts[i].sum(0, keepdim=True).clamp_(min=1))
            update[t.offset : t.offset + t.numel] = self.dct.decode(t, total)[0]
        return update

    def consensus(self) -> tuple[Tensor, Tensor]:
        # Parameters are identical on every worker; the buffers are worker 0's.
        buffers = self.replicas.buffers.clone()
        self.comm.broadcast(buffers, src=0, record="eval")
        return self.replicas.params[0].clone(), buffers[0]

    @property
    def m(self) -> Tensor:
        """Every local worker's momentum `[W, D]` (the memory's live state)."""
        return self.memory.memory  # type: ignore[return-value]

    def state_dict(self) -> dict:
        return {"m": self.m}

    def load_state_dict(self, state: dict) -> None:
        self.m.copy_(state["m"])
