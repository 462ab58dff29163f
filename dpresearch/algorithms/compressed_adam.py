"""Compressed Adam: 1-bit Adam (Tang et al. 2021) and 0/1 Adam (Lu et al. 2022).

Adam's update divides by √v, so error feedback around compressed gradients cannot undo the
compression error (the error would have to pass through a non-linear map); these methods make
the step linear in what is communicated by freezing (1-bit Adam) or rarely updating (0/1 Adam)
the variance v, and then communicate the momentum — compressed to 1 bit with error compensation
on the worker and the server side (`compress.onebit_allreduce.OneBitAllreduce`).

Where they live. The communication *is* the optimizer step (what is sent is the momentum, or
the accumulated update, not the gradient), so each is an algorithm that owns the optimizer step
over the flat stacked rows `[W, D]`: `OnebitAdamAlgorithm`, `ZeroOneAdamAlgorithm`. The user
selects them with `optimizer=onebit_adam` / `optimizer=zero_one_adam`: that optimizer node holds
the hyper-parameters (a `torch.optim.Optimizer` per worker, `OnebitAdam` / `ZeroOneAdam`, whose
param groups carry lr, betas, eps, weight decay and the schedule's lr — never stepped itself) and
switches `algorithm` to the matching node (Hydra defaults override). The algorithm keeps m, v
and the error memories (checkpointed through `state_dict`); the trainer keeps the optimizers'
param groups. Another algorithm with these optimizers, or these algorithms with another
optimizer, a compressor or error feedback, is refused before any worker starts.

Weight decay is L2 added to the gradient (torch's Adam), per parameter group (so
`exclude_bn_bias_from_weight_decay` works). BatchNorm buffers follow sync's DDP rule (worker 0's
broadcast before every forward).

Conventions (issue 32): ours are the defaults; DeepSpeed's are named options, each tested
against a re-statement of DeepSpeed's rule — `compress_per_parameter=true` (both optimizers:
one 1-bit allreduce per parameter tensor, DeepSpeed's padding) and 0/1 Adam's
`convention=deepspeed` (DeepSpeed's `ZeroOneAdam.step`); `bias_correction=false` is DeepSpeed's
update. docs/CONVENTIONS.md lists them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from dpresearch.algorithms.base import Algorithm, Traits
from dpresearch.algorithms.sync import BUFFER_MODES
from dpresearch.comm.base import Communicator
from dpresearch.compress.onebit_allreduce import OneBitAllreduce
from dpresearch.options import Options
from dpresearch.replicas import Replicas


def require_owned_optimizer(cfg: Any, wanted: type[OwnedOptimizer]) -> None:
    """ValueError (one line naming the option) unless the run's optimizer node builds `wanted`,
    the optimizer whose step the configured algorithm owns."""
    from hydra.utils import get_object

    try:
        given = get_object(cfg.optimizer._target_)
    except Exception:  # a bad target is reported by check_target
        given = None
    if given is not wanted:
        raise ValueError(
            f"algorithm={cfg.algorithm._target_.rsplit('.', 1)[-1]} runs "
            f"{wanted.__name__}: select it with {wanted.option}"
        )


CONVENTIONS = ("paper", "deepspeed")  # 0/1 Adam's `convention` choices


def check_flag(name: str, value: Any) -> bool:
    """`value` when it is a boolean; else ValueError (one line naming the option)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be true or false")
    return value


class OwnedOptimizer(torch.optim.Optimizer):
    """An optimizer whose step an algorithm owns: its hyper-parameters, held as a torch optimizer
    so the schedule, parameter groups and checkpoints treat it as any other. `algorithm`: the
    `_target_` of the algorithm that steps it (the only one it runs with); `option`: how a user
    selects it."""

    algorithm: ClassVar[str]
    option: ClassVar[str]

    def __init__(
        self, params: Any, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> None:
        betas = (float(betas[0]), float(betas[1]))
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError("lr, eps and weight_decay must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas={list(betas)}: must be two numbers in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def step(self, closure: Any = None) -> None:
        raise RuntimeError(
            f"{type(self).__name__} is stepped by its algorithm ({self.algorithm}); select it "
            f"with {self.option} and leave algorithm unset"
        )


class OnebitAdam(OwnedOptimizer):
    """1-bit Adam's hyper-parameters (Tang et al. 2021; DeepSpeed's `OnebitAdam`): Adam's lr,
    betas, eps and weight decay; `freeze_step` T_w, the number of full-precision Adam steps before
    the variance is frozen and the momentum compressed; `bias_correction`: Adam's bias
    corrections (true: torch's Adam in the warm-up, and after it m/(1−β₁ᵗ) over the frozen
    √(v/(1−β₂^T_w)); false: DeepSpeed's update m/(√v + ε)); `compress_per_parameter` (false:
    ours, the whole momentum row compressed as one vector with one scale per message; true:
    DeepSpeed's `compressed_allreduce` per parameter tensor, each with its own scales, see
    `PerParameterOneBitAllreduce`)."""

    algorithm = "dpresearch.algorithms.compressed_adam.OnebitAdamAlgorithm"
    option = "optimizer=onebit_adam"

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100,
        bias_correction: bool = True,
        compress_per_parameter: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)
        if freeze_step < 0:
            raise ValueError(f"freeze_step={freeze_step}: must be >= 0 (full-precision steps)")
        self.freeze_step, self.bias_correction = int(freeze_step), bool(bias_correction)
        self.compress_per_parameter = check_flag("compress_per_parameter", compress_per_parameter)


class ZeroOneAdam(OwnedOptimizer):
    """0/1 Adam's hyper-parameters (Lu et al. 2022; DeepSpeed's `ZeroOneAdam`, same names):
    Adam's lr, betas, eps and weight decay; `bias_correction` (true: the lr is divided by
    1 − β₁^(t+1) and v by 1 − β₂^n, n the variance updates so far — torch's Adam when every
    step updates the variance; false: m/(√v + ε), the paper's update and what DeepSpeed computes,
    whose `bias_correction` flag is accepted but never applied); `var_freeze_step`: steps
    before which the variance may be updated (after it: frozen, and local steps begin);
    `var_update_scaler` κ: the variance is updated every step for κ updates,
    then every 2 steps for κ more, every 4, … (T_v); `local_step_scaler` and
    `local_step_clipper` H: after the freeze the workers synchronise every step for
    `local_step_scaler` steps, then every 2, every 4, … at most every H steps (T_u);
    `compress_per_parameter` as `OnebitAdam`'s; `convention` (CONVENTIONS): "paper" (ours, the
    default: Algorithm 1 as `ZeroOneAdamAlgorithm` states it) or "deepspeed" (DeepSpeed's
    `ZeroOneAdam.step` step for step: its first call only initialises, the steps before the
    freeze that update no variance 1-bit-average the gradient, the error memories are zeroed at
    the freeze, and the freeze comes one step later; see `ZeroOneAdamAlgorithm`)."""

    algorithm = "dpresearch.algorithms.compressed_adam.ZeroOneAdamAlgorithm"
    option = "optimizer=zero_one_adam"

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        var_freeze_step: int = 100,
        var_update_scaler: int = 16,
        local_step_scaler: int = 100,
        local_step_clipper: int = 16,
        compress_per_parameter: bool = False,
        convention: str = "paper",
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)
        if var_freeze_step < 1:
            raise ValueError(
                f"var_freeze_step={var_freeze_step}: must be >= 1 (the first step estimates v)"
            )
        for name, value in (("var_update_scaler", var_update_scaler),
                            ("local_step_scaler", local_step_scaler),
                            ("local_step_clipper", local_step_clipper)):  # fmt: skip
            if value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")
        self.bias_correction = bool(bias_correction)
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler, self.local_step_clipper = (
            int(local_step_scaler),
            int(local_step_clipper),
        )
        self.compress_per_parameter = check_flag("compress_per_parameter", compress_per_parameter)
        if convention not in CONVENTIONS:
            raise ValueError(f"convention={convention!r}; choose one of: {', '.join(CONVENTIONS)}")
        self.convention = str(convention)


def variance_steps(var_freeze_step: int, scaler: int, first: int = 1) -> frozenset[int]:
    """0/1 Adam's T_v (0-based steps t, s = t + 1), DeepSpeed's rule: the variance is updated at
    step s when s is a multiple of the current interval, which starts at 1 and doubles after
    every `scaler` updates; for the `var_freeze_step` steps s = first, first + 1, … (first = 2:
    DeepSpeed's counting, whose first call, s = 1, only initialises)."""
    steps, interval, count = set(), 1, 0
    for s in range(first, var_freeze_step + first):
        if s % interval == 0:
            steps.add(s - 1)
            count += 1
            if count == scaler:
                count, interval = 0, interval * 2
    return frozenset(steps)


def syncs_at(step: int, var_freeze_step: int, scaler: int, clipper: int) -> bool:
    """0/1 Adam's T_u: every step before the freeze; after it, step t (0-based) synchronises
    when t + 1 is a multiple of min(H, 2^⌊(t − freeze)/scaler⌋) (DeepSpeed's rule)."""
    if step < var_freeze_step:
        return True
    interval = min(clipper, 2 ** ((step - var_freeze_step) // scaler))
    return (step + 1) % interval == 0


class PerParameterOneBitAllreduce:
    """DeepSpeed's convention for the 1-bit allreduce (`compress_per_parameter=true`): every
    parameter tensor of the flat row (`sizes`, in the row's order) is its own
    `OneBitAllreduce`, with its own worker and server scales and errors, as DeepSpeed's
    `OnebitAdam` / `ZeroOneAdam` call `compressed_allreduce` once per parameter. A tensor of n
    entries is padded with zeros to P = the next multiple of K·lcm(K, 8) (DeepSpeed's
    `corrected_tensor_size`); the padding is part of the compressed vector: it enters the
    scales (‖b‖₂/√P, and ‖a‖₂/√(P/K) on the server) and keeps its error, which stays in the
    worker and server memories and comes back at the next call. Bytes per worker and call:
    Σ over tensors of (K + 1)·(4 + P/(8K)) — every tensor's messages counted as
    `OneBitAllreduce` counts them (a float32 scale with each of its K all-to-all messages and
    its allgather message)."""

    def __init__(
        self, comm: Communicator, sizes: list[int], dtype: torch.dtype, device: torch.device
    ) -> None:
        k = comm.world_size
        unit = k * math.lcm(k, 8)
        self.sizes = list(sizes)
        self.padded = [unit * math.ceil(n / unit) for n in self.sizes]
        self.parts = [OneBitAllreduce(comm, n, dtype, device) for n in self.padded]
        self.buffer = torch.zeros(comm.num_local, max(self.padded, default=0), dtype=dtype,
                                  device=device)  # fmt: skip

    @property
    def bytes_per_call(self) -> int:
        return sum(part.bytes_per_call for part in self.parts)

    def __call__(self, x: Tensor, out: Tensor) -> None:
        """`out[w]` = every tensor's compressed average (as `OneBitAllreduce.__call__`)."""
        offset = 0
        for n, size, part in zip(self.sizes, self.padded, self.parts, strict=True):
            buffer = self.buffer[:, :size]
            buffer.zero_()
            buffer[:, :n] = x[:, offset : offset + n]
            part(buffer, buffer)
            out[:, offset : offset + n] = buffer[:, :n]
            offset += n

    def reset(self) -> None:
        """Zero every worker and server error."""
        for part in self.parts:
            part.worker_error.zero_()
            part.server_error.zero_()

    def state_dict(self) -> dict[str, Tensor]:
        return {f"{n}.{key}": value for n, part in enumerate(self.parts)
                for key, value in part.state_dict().items()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        for n, part in enumerate(self.parts):
            part.load_state_dict({key: state[f"{n}.{key}"] for key in part.state_dict()})


@dataclass(frozen=True)
class CompressedAdamOptions(Options):
    """1-bit Adam's and 0/1 Adam's algorithm keys (`optimizer=onebit_adam|zero_one_adam`; their
    hyper-parameters live in the optimizer node)."""

    buffers: str = "broadcast"
    """broadcast (worker 0's BatchNorm statistics, as sync) | local"""

    def check(self) -> None:
        if self.buffers not in BUFFER_MODES:
            raise ValueError(
                f"algorithm.buffers={self.buffers}; choose one of: {', '.join(BUFFER_MODES)}"
            )


class CompressedAdam(Algorithm):
    """What both methods share: the optimizer check, per-column weight decay, the Adam state
    over flat rows, the 1-bit allreduce, sync's buffer rule and checkpoints."""

    optimizer_class: ClassVar[type[OwnedOptimizer]]
    traits = Traits(
        compression_note="compresses its momentum itself (1 bit, error-compensated on the "
        "worker and the server side)"
    )
    OPTIONS = CompressedAdamOptions

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        buffers: str = CompressedAdamOptions.buffers,
    ) -> None:
        super().__init__(replicas, comm, optimizers)
        wanted = self.optimizer_class
        if not all(isinstance(opt, wanted) for opt in optimizers):
            raise ValueError(
                f"this algorithm runs {wanted.__name__}: select it with {wanted.option}"
            )
        CompressedAdamOptions(buffers).check()
        self.buffer_mode = buffers
        self.hyper: OwnedOptimizer = optimizers[0]  # type: ignore[assignment]
        params = replicas.params
        w, d = params.shape
        self.decay = column_decay(replicas, self.hyper)
        self.m = torch.zeros(w, d, dtype=params.dtype, device=params.device)
        self.v = torch.zeros(d, dtype=params.dtype, device=params.device)
        self.onebit: OneBitAllreduce | PerParameterOneBitAllreduce
        if getattr(self.hyper, "compress_per_parameter", False):
            sizes = [p.numel() for p in replicas.models[0].parameters() if p.requires_grad]
            self.onebit = PerParameterOneBitAllreduce(comm, sizes, params.dtype, params.device)
        else:
            self.onebit = OneBitAllreduce(comm, d, params.dtype, params.device)

    def _reset_errors(self) -> None:
        """Zero the 1-bit allreduce's worker and server errors."""
        if isinstance(self.onebit, PerParameterOneBitAllreduce):
            self.onebit.reset()
        else:
            self.onebit.worker_error.zero_()
            self.onebit.server_error.zero_()

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Refuse an optimizer other than this method's (a compressor or error feedback is
        refused by `config.checks.check_compression` with `traits.compression_note`), then
        the declared options' check."""
        require_owned_optimizer(cfg, cls.optimizer_class)
        super().check_config(cfg)
        if cfg.train.get("grad_clip") is not None:
            raise ValueError(
                f"train.grad_clip={cfg.train.grad_clip}: {cls.optimizer_class.option} steps on "
                "exact averages in some steps and on 1-bit-compressed momentum in others, so no "
                "one gradient matches DDP + clip_grad_norm_'s; set train.grad_clip=null"
            )

    # -- the step ---------------------------------------------------------------------------------
    def _hyper(self) -> tuple[float, float, float, float]:
        """(lr, β₁, β₂, ε) for this step (the lr follows the schedule through `set_lr`)."""
        group = self.hyper.param_groups[0]
        if any(g["lr"] != group["lr"] for g in self.hyper.param_groups):
            raise ValueError("compressed Adam takes one learning rate for all parameter groups")
        beta1, beta2 = group["betas"]
        return group["lr"], beta1, beta2, group["eps"]

    def _gradients(self) -> Tensor:
        """The local gradients with L2 weight decay added (torch Adam's `weight_decay`)."""
        grads = self.replicas.grads
        if isinstance(self.decay, Tensor) or self.decay:
            grads.addcmul_(self.replicas.params, torch.as_tensor(self.decay).to(grads))
        return grads

    def _exact_mean(self, grads: Tensor) -> Tensor:
        """The full-precision mean gradient (one allreduce); returns row 0 (all rows equal)."""
        self.comm.all_reduce(grads, op="mean")
        return grads[0]

    def before_forward(self, step: int) -> None:
        if self.buffer_mode == "broadcast" and self.replicas.buffers.shape[1] > 0:
            self.comm.broadcast(self.replicas.buffers, src=0, record="buffers")

    def state_dict(self) -> dict:
        return {"m": self.m, "v": self.v, "onebit": self.onebit.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.m.copy_(state["m"])
        self.v.copy_(state["v"])
        self.onebit.load_state_dict(state["onebit"])


class OnebitAdamAlgorithm(CompressedAdam):
    """1-bit Adam (Tang et al. 2021, Algorithm 1), with the hyper-parameters of `OnebitAdam`.

    Steps t < T_w (`freeze_step`), the warm-up: torch's Adam on the full-precision mean gradient
    (one fp32 allreduce, 4·D bytes per worker). From T_w on, v is frozen and, on worker i,

        m_i = β₁·m + (1 − β₁)·g_i;   m = OneBitAllreduce(m_i)   (worker and server error feedback)
        x ← x − lr · m̂ / (√v̂ + ε)

    with m̂ = m/(1 − β₁ᵗ) and v̂ = v/(1 − β₂^T_w) (bias_correction; else m̂ = m, v̂ = v). Every
    worker holds the same m and x after each step. Bytes per compressed step: (K + 1)·(4 + c/8),
    c = ⌈D/K⌉ rounded up to a multiple of 8.

    `compress_per_parameter=true` (DeepSpeed's convention; default false, ours): the 1-bit
    allreduce runs per parameter tensor with DeepSpeed's padding (`PerParameterOneBitAllreduce`,
    whose docstring gives the bytes); the rest of the step is unchanged.
    """

    optimizer_class = OnebitAdam

    def after_backward(self, step: int) -> None:
        lr, beta1, beta2, eps = self._hyper()
        hyper: OnebitAdam = self.hyper  # type: ignore[assignment]
        grads, params, m, v = self._gradients(), self.replicas.params, self.m, self.v
        t = step + 1
        correct = hyper.bias_correction
        if step < hyper.freeze_step:
            mean = self._exact_mean(grads)
            m.lerp_(grads, 1 - beta1)
            v.mul_(beta2).addcmul_(mean, mean, value=1 - beta2)
            denom = self._denominator(t if correct else 0, eps)
        else:
            m.lerp_(grads, 1 - beta1)
            self.onebit(m, m)
            denom = self._denominator(hyper.freeze_step if correct else 0, eps)
        step_size = lr / (1 - beta1**t) if correct else lr
        params.addcdiv_(m, denom, value=-step_size)

    def _denominator(self, count: int, eps: float) -> Tensor:
        """√(v / (1 − β₂^count)) + ε (count 0: no correction), as torch's Adam forms it."""
        v = self.v
        if not count:
            return v.sqrt().add_(eps)
        beta2 = self.hyper.param_groups[0]["betas"][1]
        return (v.sqrt() / math.sqrt(1 - beta2**count)).add_(eps)

    def consensus(self) -> tuple[Tensor, Tensor]:
        # Parameters are identical on every worker; the buffers are worker 0's.
        buffers = self.replicas.buffers.clone()
        self.comm.broadcast(buffers, src=0, record="eval")
        return self.replicas.params[0].clone(), buffers[0]


class ZeroOneAdamAlgorithm(CompressedAdam):
    """0/1 Adam (Lu et al. 2022, Algorithm 1), with the hyper-parameters of `ZeroOneAdam` and
    DeepSpeed's policies for the variance steps T_v and the synchronisation steps T_u
    (`variance_steps`, `syncs_at`). On worker i at step t, with γ_t the lr (divided by
    1 − β₁^(t+1) with bias correction) and v̂ = v (divided by 1 − β₂^n after n variance updates
    with bias correction):

        t ∈ T_v:  ḡ = the exact mean gradient (fp32 allreduce); v ← β₂v + (1−β₂)ḡ²;
                  m ← β₁m + (1−β₁)ḡ;  x ← x − γ_t·m/(√v̂ + ε)     (every worker the same: a sync)
        else:     m_i ← β₁m_i + (1−β₁)g_i;  x_i ← x_i − γ_t·m_i/(√v̂ + ε);
                  u_i ← u_i + γ_t·m_i;  Γ ← Γ + γ_t
                  t ∈ T_u:  ū = OneBitAllreduce(u_i);  m_i ← ū/Γ;
                            x_i ← x' − ū/(√v̂ + ε)  (x' the model at the last sync);
                            x' ← x_i;  u_i ← 0;  Γ ← 0

    T_v lies before `var_freeze_step` and every step before it synchronises, so a variance step
    always starts from workers in agreement; after the freeze the workers take local steps and
    synchronise at T_u only. With every step in T_v this is Adam (torch's, with bias
    correction). Bytes: 4·D per variance step, (K + 1)·(4 + c/8) per 1-bit synchronisation,
    nothing on a local step.

    `convention="deepspeed"` (default "paper", the above): DeepSpeed's `ZeroOneAdam.step`
    (deepspeed/runtime/fp16/onebit/zoadam.py), whose step counter s = t + 1 counts its first
    call, which only initialises. So, with F = `var_freeze_step`:

        t = 0:          nothing moves and nothing is sent (the gradient is dropped; DeepSpeed's
                        engine still allreduces it and its first call sends a 1-bit message
                        of zeros, neither charged here);
        1 ≤ t ≤ F:      every worker the same: t ∈ T_v (`variance_steps(F, κ, first=2)`) as
                        above; else ĝ = OneBitAllreduce(g_i) (the 1-bit average of the
                        gradients, error-compensated), m ← β₁m + (1−β₁)ĝ, x ← x − γ_t·m/(√v̂+ε);
                        after t = F the worker and server errors are zeroed;
        t ≥ F + 1:      the local steps and T_u above, the freeze one step later
                        (`syncs_at(t, F + 1, …)`).

    Bytes: 4·D per variance step, one 1-bit allreduce per other step before the freeze and per
    synchronisation after it. `compress_per_parameter=true`: DeepSpeed's per-tensor 1-bit
    allreduce (as `OnebitAdamAlgorithm`'s); DeepSpeed's update is `bias_correction=false`.
    """

    optimizer_class = ZeroOneAdam

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        hyper: ZeroOneAdam = self.hyper  # type: ignore[assignment]
        self.deepspeed = hyper.convention == "deepspeed"
        # the first step after the freeze (DeepSpeed: one later, its first call only initialises)
        self.freeze = hyper.var_freeze_step + (1 if self.deepspeed else 0)
        self.variance = variance_steps(
            hyper.var_freeze_step, hyper.var_update_scaler, first=2 if self.deepspeed else 1
        )
        params = self.replicas.params
        self.u = torch.zeros_like(params)
        self.anchor = params.clone()  # x' of each worker: the model at the last sync
        self.lr_sum = 0.0  # Γ

    def _updates_before(self, step: int) -> int:
        """Variance updates made at steps 0 … step."""
        return sum(1 for s in self.variance if s <= step)

    def after_backward(self, step: int) -> None:
        lr, beta1, beta2, eps = self._hyper()
        hyper: ZeroOneAdam = self.hyper  # type: ignore[assignment]
        grads, params, m, v = self._gradients(), self.replicas.params, self.m, self.v
        if self.deepspeed and step == 0:
            return  # DeepSpeed's first call: it only initialises its state
        if hyper.bias_correction:
            lr = lr / (1 - beta1 ** (step + 1))
        if self.deepspeed and step < self.freeze and step not in self.variance:
            self.onebit(grads, grads)  # the 1-bit average of the gradients, on every row
            m.lerp_(grads, 1 - beta1)
            params.addcdiv_(m, self._denominator(step, beta2, eps), value=-lr)
            self.anchor.copy_(params)
            if step == self.freeze - 1:
                self._reset_errors()
            return
        if step in self.variance:
            mean = self._exact_mean(grads)
            v.mul_(beta2).addcmul_(mean, mean, value=1 - beta2)
            m.lerp_(grads, 1 - beta1)
            params.addcdiv_(m, self._denominator(step, beta2, eps), value=-lr)
            self.anchor.copy_(params)
            if self.deepspeed and step == self.freeze - 1:
                self._reset_errors()
            return
        denom = self._denominator(step, beta2, eps)
        m.lerp_(grads, 1 - beta1)
        params.addcdiv_(m, denom, value=-lr)
        self.u.add_(m, alpha=lr)
        self.lr_sum += lr
        if syncs_at(step, self.freeze, hyper.local_step_scaler,
                    hyper.local_step_clipper):  # fmt: skip
            u = self.u
            self.onebit(u, u)
            torch.div(u, self.lr_sum, out=m)
            torch.addcdiv(self.anchor, u, denom, value=-1.0, out=params)
            self.anchor.copy_(params)
            u.zero_()
            self.lr_sum = 0.0

    def _denominator(self, step: int, beta2: float, eps: float) -> Tensor:
        """√v̂ + ε after the variance updates made up to `step`, as torch's Adam forms it."""
        if not self.hyper.bias_correction:  # type: ignore[attr-defined]
            return self.v.sqrt().add_(eps)
        correction = 1 - beta2 ** self._updates_before(step)
        return (self.v.sqrt() / math.sqrt(correction)).add_(eps)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "u": self.u, "anchor": self.anchor,
                "lr_sum": self.lr_sum}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.u.copy_(state["u"])
        self.anchor.copy_(state["anchor"])
        self.lr_sum = float(state["lr_sum"])


def column_decay(replicas: Replicas, hyper: torch.optim.Optimizer) -> Tensor | float:
    """The weight decay of every column of the flat row, read from `hyper`'s parameter groups
    (a float where all groups agree): what an algorithm that owns the optimizer step decays."""
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
