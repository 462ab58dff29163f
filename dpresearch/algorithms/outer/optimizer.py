"""An outer optimizer over any base algorithm whose workers drift apart: SlowMo, DiLoCo and
Streaming DiLoCo in one class.

The base algorithm (local SGD, D-PSGD, CHOCO-SGD, SGP) runs every step as it would alone: its
inner optimizers, its own communication. Every `period` steps (H) the outer optimizer takes the
exact average of the workers' models into a pseudo-gradient and steps a global model, the
*anchor* θ, with a torch optimizer:

    Δ = θ − (1/K) Σ_i x_i                       (the mean of Δ_i = θ − x_i, an allreduce)
    θ ← OuterOpt(θ, Δ)                            (Δ as θ's gradient)
    x_i ← θ for every worker                      (every worker restarts from the anchor)

- DiLoCo (Douillard et al. 2023, Algorithm 1): local SGD inner steps, outer SGD with Nesterov
  momentum (lr 0.7, momentum 0.9); inner optimizer states stay local and are kept.
- SlowMo (Wang et al., ICLR 2020, Algorithm 1): with the base lr γ_t, slow momentum β and slow
  lr α, u ← β·u + Δ/γ_t and θ ← θ − α·γ_t·u — outer SGD (momentum β, lr α) with
  `scale_by_inner_lr=true`, which divides Δ by the inner optimizer's current lr and multiplies
  the outer lr by it (exactly that update, also while the schedule changes γ_t).
- Streaming DiLoCo (Douillard et al. 2025): the model cut into `fragments` of whole blocks
  (`fragments.py`), fragment f sent at steps ≡ ⌊f·H/F⌋ (mod H) and merged `overlap` (τ) steps
  later; meanwhile the workers keep training. The merge mixes: x_i,f ← (1−α)·θ̃_f + α·x_i,f
  with α = `mix` (0: take the outer result, the paper's α = 0.5: average it with the local
  progress). F = 1, τ = 0, α = 0 is DiLoCo.
- One-step-delayed outer steps and eager updates (Kale et al. 2025; `outer.delay`,
  `overlap.py`): a round's exchange runs behind the whole next round (τ replaced by H) and is
  applied at that round's end — late (delayed), or with each worker's own fresh Δ_i standing in
  for its share (eager; every worker then steps its own anchor row θ_i with its own outer
  optimizer state). The run's last exchange is applied at once.
- SparseLoCo (Sarfi et al. 2025, Algorithm 1; `outer=sparseloco`): no outer momentum, each
  worker's decayed error-feedback accumulator stands in for it. Per outer step, Δ_i = θ − x_i:
      e_i ← β·e_i + Δ_i;  m_i = Q(TopK_chunk(e_i));  e_i ← e_i − m_i;  θ ← θ − α·(1/K)·Σ_i m_i
  — the compressed path below with EF14's `decay` β = 0.95, the `quantized_topk` codec (each
  4096-entry block's top 1.56 %, values to 2 bits with a per-tensor codebook; its module gives
  Q and the bytes) and outer SGD with lr α = 1, momentum 0.

What the base algorithm had as its own periodic exact average (local SGD's) is handed over:
`period` defaults to local SGD's `algorithm.period`, and local SGD stops averaging by itself.
Gossip algorithms keep gossiping; `period` must be given for them. The exact average is the
mean of the base algorithm's `model_rows()`: the workers' parameters, or for SGP the push-sum
numerators w_i·z_i, whose mean is its consensus Σx/Σw (SGP restarts its weights at 1 after a
whole-model restart).

Inner optimizer state at each outer step (`inner_state`, per fragment): "keep" (DiLoCo; the
SlowMo authors' fairscale implementation keeps the base momentum too), "reset" (the state of the
fragment's parameters dropped, rebuilt by the next step), or "average" (averaged over workers,
one allreduce). Float buffers (BatchNorm statistics) are averaged with their fragment
(`buffers="average"`, "buffers" traffic) and mixed like the parameters; "local" leaves them.

Bytes: the pseudo-gradients are the algorithm's traffic (`comm/bytes`), one `[n_f]` row per
worker per fragment sync; `outer/peak_step_bytes` is the most the outer optimizer sent in one
step (≈ 4·D/F); `outer/bytes_per_round` and `outer/modeled_s_per_round` its bytes per worker and
modeled seconds (buffers included) per outer step of the whole model (F fragment merges). Ops
of a fragment in flight are recorded as hidden behind τ steps (`CommLedger.hidden_behind`), so
the network model charges only what τ steps of `network.compute_step_s` do not hide. On real
ranks, an uncompressed fragment with τ > 0 is a background allreduce where the communicator can
overlap (`start_all_reduce_sum`), waited for at the merge. A fragment whose merge would come
after the run's last step is not sent (under `delay`: is merged at once).

Compressed pseudo-gradients (`compressor`, `error_feedback`: the groups' nodes, e.g.
compressor@outer.compressor=topk error_feedback@outer.error_feedback=ef14): each fragment's Δ
rows go through the synchronous reducer of `dpresearch.compress` (`build_reducer`, one per
fragment, tensor chunks), so any compressor the synchronous algorithm takes works here, with
its exact wire bytes in the ledger. The error-feedback memory lives across outer steps:
p_i = Δ_i + e_i is encoded, e_i ← p_i − D(C(p_i)) (EF14), and the outer optimizer steps on the
mean of the decoded messages; the reducer's step is the fragment's outer round (0, 1, …), which
seeds random codecs and counts `start_after_steps`. A compressed fragment is exchanged when it
is sent (never in the background); with τ > 0 its traffic is still priced as hidden.

Hierarchical DiLoCo (`algorithm=node_sync`, `comm.hierarchy`): the base averages gradients
inside each node every step, so a node's workers hold one model and Δ is the same on all of
them; the mean over nodes is then exchanged by the node leaders only (the inter-node tier) and
broadcast inside each node (the intra tier) — the reducer above with `replicated_nodes`,
compressed between nodes or not.

Evaluation (`evaluate`): "anchor" (the global model θ, as DiLoCo evaluates; between outer steps
it lags the workers; under eager updates the mean of the workers' θ_i) or "average" (the base
algorithm's consensus).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig
from torch import Tensor

from dpresearch.algorithms.base import Algorithm, StepPlan, Verdict
from dpresearch.algorithms.diagnostics import (
    OuterDiagnostics,
    outer_momentum_norm,
    reducers_memory_norm,
)
from dpresearch.algorithms.local_sgd import average_optimizer_state
from dpresearch.algorithms.outer.fragments import (
    PATTERNS,
    Fragment,
    Schedule,
    blocks_of,
    on_device,
    put,
    split,
    take,
)
from dpresearch.algorithms.outer.overlap import OverlapOptions, eager_estimate
from dpresearch.comm.base import Communicator
from dpresearch.comm.ledger import BUFFERS
from dpresearch.compress import CompressedReducer, build_reducer, check_compatibility
from dpresearch.compress.channel import compresses
from dpresearch.compress.layout import ParamLayout
from dpresearch.compress.reducer import HierarchicalReducer
from dpresearch.grad_clip import GradClip
from dpresearch.optim import build_optimizer
from dpresearch.options import Options
from dpresearch.replicas import Replicas
from dpresearch.stacked_step import FlatRows, step_together

INNER_STATES = ("keep", "reset", "average")
BUFFER_MODES = ("average", "local")
EVALUATIONS = ("anchor", "average")


@dataclass(frozen=True)
class OuterOptions(Options):
    """The outer node's own keys (`outer=sgd|nesterov|slowmo|streaming|...`; its `optimizer`,
    `compressor` and `error_feedback` are nodes of their own groups)."""

    NODE: ClassVar[str] = "outer"

    period: int | None = None
    """H, steps between outer steps; null takes the base algorithm's own averaging period
    (local SGD's `algorithm.period`, whose averaging the outer step replaces); gossip bases
    need it"""
    fragments: int = 1
    """F fragments of whole blocks (Streaming DiLoCo); fragment f is sent at steps
    ≡ ⌊f·H/F⌋ (mod H)"""
    fragment_pattern: str = "sequential"
    """how blocks form fragments: sequential (consecutive, ≈ D/F parameters each) | strided"""
    overlap: int = 0
    """τ: a fragment is merged τ steps after it is sent, the workers training meanwhile"""
    mix: float = 0.0
    """α in [0, 1): the merge sets x_i ← (1−α)·θ̃ + α·x_i (the share of local progress kept)"""
    scale_by_inner_lr: bool = False
    """SlowMo's form: Δ / γ_t and outer lr × γ_t, with γ_t the inner lr now"""
    inner_state: str = "keep"
    """the inner optimizers' state at each outer step: keep (DiLoCo) | reset | average"""
    buffers: str = "average"
    """BatchNorm statistics averaged with their fragment (average) | local"""
    evaluate: str = "anchor"
    """test/acc of the anchor θ (anchor, as DiLoCo) | of the base algorithm's consensus
    (average)"""
    delay: str = "none"
    """none: the average is applied when it arrives (DiLoCo; Streaming DiLoCo after τ =
    `overlap` steps) | delayed: applied one round late | eager: applied one round late, with
    the worker's own fresh pseudo-gradient standing in for its share of the missing average
    (Kale et al. 2025; `outer/overlap.py`)"""

    def check(self) -> None:
        """The choice keys, each with the line naming its choices, and α in [0, 1)."""
        for key, value, choices in (
            ("inner_state", self.inner_state, INNER_STATES),
            ("buffers", self.buffers, BUFFER_MODES),
            ("evaluate", self.evaluate, EVALUATIONS),
            ("fragment_pattern", self.fragment_pattern, PATTERNS),
        ):
            if value not in choices:
                raise ValueError(f"outer.{key}={value}; choose one of: {', '.join(choices)}")
        if not 0.0 <= float(self.mix) < 1.0:
            raise ValueError(
                f"outer.mix={self.mix}: the share of local progress kept at a merge must be "
                "in [0, 1)"
            )


@dataclass
class InFlight:
    """A fragment sent and not merged yet: merged after step `merge_at` (1-based); `finish`
    (while the exchange runs) completes it into `mean` (the averaged pseudo-gradient) and
    `buffers` (the averaged float buffers, if averaged)."""

    merge_at: int
    mean: Tensor | None = None
    buffers: Tensor | None = None
    finish: Callable[[], Tensor] | None = None
    own: Tensor | None = None  # eager updates: this process's rows Δ_i of the round


class OuterOptimizer(Algorithm):
    """Outer optimizer steps over the base algorithm `base` (see the module docstring).

    optimizer: the outer optimizer node (any `torch.optim` class as `_target_`, the `optimizer`
    group's form), built once per fragment over the anchor's parameters. period: H (None: the
    base algorithm's own averaging period). fragments / fragment_pattern / overlap / mix:
    Streaming DiLoCo's F, pattern, τ and α. scale_by_inner_lr: SlowMo's γ_t scaling.
    inner_state / buffers / evaluate / delay (the one-step-delayed and eager outer steps of
    `overlap.py`): see the module docstring. Their defaults and meaning: `OuterOptions`.
    """

    OPTIONS = OuterOptions

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        base: Algorithm,
        optimizer: Mapping[str, Any],
        period: int | None = OuterOptions.period,
        fragments: int = OuterOptions.fragments,
        fragment_pattern: str = OuterOptions.fragment_pattern,
        overlap: int = OuterOptions.overlap,
        mix: float = OuterOptions.mix,
        scale_by_inner_lr: bool = OuterOptions.scale_by_inner_lr,
        inner_state: str = OuterOptions.inner_state,
        buffers: str = OuterOptions.buffers,
        evaluate: str = OuterOptions.evaluate,
        compressor: Mapping[str, Any] | None = None,
        error_feedback: Mapping[str, Any] | None = None,
        seed: int = 0,
        delay: str = OuterOptions.delay,
    ) -> None:
        super().__init__(replicas, comm, optimizers)
        choices = OuterOptions(
            fragment_pattern=fragment_pattern,
            mix=mix,
            inner_state=inner_state,
            buffers=buffers,
            evaluate=evaluate,
        )
        choices.check()
        self.overlap = OverlapOptions(delay)
        self.overlap.check(int(overlap), compresses(compressor, error_feedback))
        if not base.traits.drifts:
            raise ValueError(no_drift_message(type(base).__name__))
        self.base = base
        handed = base.hand_over_averaging()
        period = period if period is not None else handed
        if period is None:
            raise ValueError(PERIOD_MESSAGE.format(name=type(base).__name__))
        self.schedule = Schedule(int(period), int(fragments), int(overlap))
        self.mix, self.scale_by_inner_lr = float(mix), bool(scale_by_inner_lr)
        self.inner_state, self.buffer_mode, self.evaluate = inner_state, buffers, evaluate
        self.evaluates_local_models = base.evaluates_local_models
        self.traits = base.traits  # checkpointable, skippable: the base algorithm's

        device = replicas.params.device
        model = replicas.models[0]
        channels_last = any(p.dim() == 4 and not p.is_contiguous() for p in model.parameters())
        # The anchor θ: one more replica, whose parameters the outer optimizers step; under
        # eager updates one per local worker (θ_i: each worker steps its own estimate).
        rows = replicas.num_local if self.overlap.eager else 1
        self.anchor = Replicas(model, rows, device, channels_last)
        self.anchor.params.copy_(replicas.params[:1].expand(rows, -1))
        self.anchor.buffers.copy_(replicas.buffers[:1].expand(rows, -1))
        self.fragments = [
            on_device(f, device)
            for f in split(blocks_of(model), self.schedule.fragments, fragment_pattern)
        ]
        anchor_params = [[p for p in m.parameters() if p.requires_grad] for m in self.anchor.models]
        # per fragment, one outer optimizer per anchor row; `outer` lists them fragment-major
        self.outer_by_fragment = [
            [build_optimizer(optimizer, [ps[t] for t in f.tensors]) for ps in anchor_params]
            for f in self.fragments
        ]
        self.outer = [opt for opts in self.outer_by_fragment for opt in opts]
        self.outer_lrs = [[g["lr"] for g in o[0].param_groups] for o in self.outer_by_fragment]
        # each fragment's outer step as one functional call per group on its columns of the
        # anchor's row (`stacked_step`), its momentum packed there
        self._outer_rows = [FlatRows(self.anchor.params, self.anchor.grads) for _ in self.outer]
        self._worker_params = [
            [p for p in m.parameters() if p.requires_grad] for m in replicas.models
        ]
        self._deltas = [
            replicas.params.new_empty(replicas.num_local, f.numel) for f in self.fragments
        ]
        # One reducer (codec + error-feedback memory) per fragment, over its Δ rows; None: the
        # plain allreduce (identity without memory, which may run in the background).
        # Over a base whose nodes are replicas (`Traits.node_replicas`, `algorithm=node_sync`)
        # the mean over nodes is the leaders' exchange, broadcast inside each node (even
        # uncompressed: a flat allreduce would price every worker on the inter-node link).
        self.reducers: list[HierarchicalReducer | CompressedReducer] | None = None
        by_leaders = base.traits.node_replicas and comm.tiers is not None
        if by_leaders or compresses(compressor, error_feedback):
            shapes = [tuple(p.shape) for p in anchor_params[0]]
            self.reducers = [
                build_reducer(
                    compressor,
                    error_feedback,
                    comm,
                    fragment_layout(f, shapes),
                    seed,
                    dtype=replicas.params.dtype,
                    device=device,
                    replicated_nodes=by_leaders,
                )
                for f in self.fragments
            ]
        self.in_flight: dict[int, InFlight] = {}
        self.total_steps = 2**62  # told by `set_run_length`
        self.merges = 0  # fragment merges so far
        self.peak_step_bytes = 0  # the most the outer optimizer sent in one step
        self.outer_bytes, self.outer_modeled_s = 0, 0.0  # its traffic so far
        self.last_delta_norm = 0.0
        group = comm.tiers.hierarchy.workers_per_node if by_leaders and comm.tiers else 1
        self.diagnostics = OuterDiagnostics(len(self.fragments), group)

    # -- configuration checks ----------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """One line naming the fix for an outer node that cannot run over `cfg.algorithm`."""
        from hydra.utils import get_object

        node = cfg.outer
        base = get_object(cfg.algorithm._target_)
        if not base.traits.drifts:
            raise ValueError(no_drift_message(base.__name__))
        handed = base.outer_handover(cfg.algorithm)
        opts = OuterOptions.from_node(node)
        period = opts.period if opts.period is not None else handed
        if period is None:
            raise ValueError(PERIOD_MESSAGE.format(name=base.__name__))
        Schedule(int(period), int(opts.fragments), int(opts.overlap))
        opts.check()
        OverlapOptions(opts.delay).check(
            int(opts.overlap), compresses(node.get("compressor"), node.get("error_feedback"))
        )
        try:
            check_compatibility(node.get("compressor"), node.get("error_feedback"), where="outer")
        except ValueError as exc:  # the keys named for the outer node's groups
            raise ValueError(re.sub(GROUP_CHOICE, r"\1@outer.\1=", f"outer.{exc}")) from None

    # Every member of `Algorithm` is either defined here (handed to the base as it is, below, or
    # the base's with the outer step around it; `traits` and `evaluates_local_models` are the
    # base's, taken in `__init__`) or left as `Algorithm` has it on purpose, for the reason
    # given. tests/test_architecture.py checks that none is missing, so a hook added to
    # `Algorithm` is a decision here, not a silent default.
    NOT_FORWARDED: ClassVar[dict[str, str]] = {
        "part": "one class on every process (the outer step is lockstep)",
        "channel": "the outer node's own compressor is checked by check_config",
        "step_optimizers": "the base steps its inner optimizers in its own after_backward",
        "step_optimizer": "the base steps an event's optimizer in its own after_backward",
        "clip_gradients": "the base clips its inner gradients in its own after_backward (the "
        "pseudo-gradients are not clipped)",
        "outer_handover": "asked of the base class by check_config; outer steps do not nest",
        "hand_over_averaging": "asked of the base in __init__; outer steps do not nest",
        "model_rows": "read from the base by the outer step itself",
        "restarted": "called on the base by the outer step itself",
    }

    # -- delegated to the base algorithm -----------------------------------------------------------
    @property
    def gradients_per_step(self) -> int:
        return self.base.gradients_per_step

    def plan(self, step: int) -> StepPlan:
        return self.base.plan(step)

    def set_lr(self, multiplier: float) -> None:
        self.base.set_lr(multiplier)

    def before_forward(self, step: int) -> None:
        self.base.before_forward(step)

    def set_run_length(self, steps_per_epoch: int, total_steps: int) -> None:
        self.base.set_run_length(steps_per_epoch, total_steps)
        self.total_steps = total_steps

    def attach_compute(self, compute: Any) -> None:
        self.base.attach_compute(compute)

    def set_grad_clip(self, clip: GradClip) -> None:
        self.base.set_grad_clip(clip)

    def losses_finite(self) -> bool:
        return self.base.losses_finite()

    def agree(self, proposal: Verdict) -> Verdict:
        return self.base.agree(proposal)

    def summary(self) -> dict[str, Any]:
        return self.base.summary()

    # -- the step ----------------------------------------------------------------------------------
    def after_backward(self, step: int) -> None:
        self.base.after_backward(step)
        self._outer(step)

    def drop_step(self, step: int) -> None:
        # The schedule goes on: a dropped step leaves the models where they were.
        self.base.drop_step(step)
        self._outer(step)

    @property
    def hidden_steps(self) -> int:
        """Steps of computation an exchange runs behind: τ, or under `outer.delay` the whole
        next round (H)."""
        return self.schedule.period if self.overlap.delayed else self.schedule.overlap

    def _outer(self, step: int) -> None:
        done = step + 1
        with self._accounted() as sent:
            if self.overlap.delayed:
                for f in self.schedule.launches(done):
                    self._delayed_round(f, step)
            else:
                for f in self.schedule.launches(done):
                    if done + self.schedule.overlap <= self.total_steps:  # else never merged
                        self.in_flight[f] = self._launch(f, step, self.schedule.overlap)
                for f in self.schedule.merges(done):
                    self._merge(f)
        self.peak_step_bytes = max(self.peak_step_bytes, sent[0])

    @contextmanager
    def _accounted(self) -> Iterator[list[int]]:
        """Count the outer optimizer's own traffic inside (bytes of local worker 0, every
        worker sends the same rows; modeled seconds of every purpose); yields a one-element list
        that holds the bytes once the block is done."""
        ledger, sent = self.comm.ledger, [0]
        bytes_before, seconds_before = ledger.bytes_by_worker[0], ledger.modeled_s
        try:
            yield sent
        finally:
            sent[0] = ledger.bytes_by_worker[0] - bytes_before
            self.outer_bytes += sent[0]
            self.outer_modeled_s += ledger.modeled_s - seconds_before

    def _launch(self, f: int, step: int, hidden: int) -> InFlight:
        """Send fragment f's pseudo-gradients Δ_i = θ(_i) − x_i (and average its buffers),
        hidden behind `hidden` steps of computation; the exchange in flight."""
        frag, delta = self.fragments[f], self._deltas[f]
        anchor = take(self.anchor.params, frag.params)  # [1, n], or [W, n] under eager updates
        torch.sub(anchor, take(self.base.model_rows(), frag.params), out=delta)
        self.diagnostics.observe(f, delta, self.comm)  # before averaging overwrites the rows
        flight = InFlight(merge_at=step + 1 + hidden)
        if self.overlap.eager:
            flight.own = delta.clone()
        with self.comm.ledger.hidden_behind(hidden):
            flight.finish = self._average(f, delta, step // self.schedule.period, hidden)
            if self.buffer_mode == "average" and frag.buffer_numel:
                buffers = take(self.replicas.buffers, frag.buffers).clone()
                self.comm.all_reduce(buffers, op="mean", record=BUFFERS)
                flight.buffers = buffers[0].clone()
        return flight

    def _delayed_round(self, f: int, step: int) -> None:
        """Fragment f's round under `outer.delay` (`overlap.py`): send this round's Δ_i
        behind the next round, step on the previous round's mean (delayed) or on the eager
        estimate; a round whose exchange would be merged after the run's last step is
        completed and applied at once (the run's last exchange)."""
        last = step + 1 + self.schedule.period > self.total_steps
        before = self.in_flight.pop(f, None)
        if before is not None:
            self._resolve(before)
        flight = self._launch(f, step, 0 if last else self.schedule.period)
        world = self.comm.world_size
        if self.overlap.eager:
            assert flight.own is not None
            own_before = None if before is None else before.own
            mean_before = None if before is None else before.mean
            estimate = eager_estimate(flight.own, world, mean_before, own_before)
            self._apply(f, estimate, before)
        else:
            self._apply(f, None if before is None else before.mean, before)
        if not last:
            self.in_flight[f] = flight
            return
        self._resolve(flight)
        assert flight.mean is not None
        missing = flight.mean if flight.own is None else flight.mean - flight.own / world
        self._apply(f, missing, flight)

    def _apply(self, f: int, grads: Tensor | None, arrived: InFlight | None) -> None:
        """Step fragment f's anchor row(s) on `grads` (`[n]`, or `[W, n]` one per anchor
        row; None: no outer step, as before any mean arrived) and restart the workers from it;
        `arrived`: the exchange whose mean (and averaged buffers) this applies, if any."""
        frag = self.fragments[f]
        if grads is not None:
            self._outer_step(f, grads)
        if arrived is not None:
            assert arrived.mean is not None
            self.last_delta_norm = float(arrived.mean.double().norm())
            self.merges += 1
        self._restart(frag, None if arrived is None else arrived.buffers)
        self._inner_state(frag)
        if len(self.fragments) == 1 and self.mix == 0.0:
            self.base.restarted()

    def _average(self, f: int, delta: Tensor, round_: int, hidden: int) -> Callable[[], Tensor]:
        """Begin averaging fragment f's `[W, n]` pseudo-gradient rows over all K workers (its
        `round_`-th send, 0-based); the returned function gives the mean `[n]`. Compressed:
        the fragment's reducer, synchronously (its memory compensates Δ before encoding and
        keeps what was not sent, across outer steps; its rounds are the reducer's steps)."""
        if self.reducers is not None:
            self.reducers[f].reduce(delta, round_)
            mean = delta[0].clone()
            return lambda: mean
        world = self.comm.world_size
        if hidden and self.comm.can_overlap:
            pending = self.comm.start_all_reduce_sum(delta)

            def finish() -> Tensor:
                pending.wait()
                return delta[0] / world

            return finish
        self.comm.all_reduce(delta, op="mean")
        mean = delta[0].clone()
        return lambda: mean

    def _resolve(self, flight: InFlight) -> None:
        """Complete `flight`'s exchange (its traffic still counted as hidden)."""
        if flight.finish is not None:
            with self.comm.ledger.hidden_behind(self.hidden_steps):
                flight.mean = flight.finish()
            flight.finish = None

    def _merge(self, f: int) -> None:
        """Step fragment f of the anchor on its averaged pseudo-gradient; restart the workers'
        fragment from it (mixed with their progress by `mix`)."""
        flight = self.in_flight.pop(f)
        self._resolve(flight)
        self._apply(f, flight.mean, flight)

    def _outer_step(self, f: int, grads: Tensor) -> None:
        """One outer optimizer step of fragment f's anchor row(s), `grads` as their gradient
        (`[n]` for every row, or one `[W, n]` row each)."""
        frag, opts = self.fragments[f], self.outer_by_fragment[f]
        grad = self.anchor.grads
        if self.scale_by_inner_lr:
            gamma = float(self.optimizers[0].param_groups[0]["lr"])
            put(grad, frag.params, grads / gamma if gamma > 0 else torch.zeros_like(grads))
            for opt in opts:
                for group, base_lr in zip(opt.param_groups, self.outer_lrs[f], strict=True):
                    group["lr"] = base_lr * gamma
        else:
            put(grad, frag.params, grads)
        step_together(opts, self._outer_rows[f])

    def _restart(self, frag: Fragment, buffers: Tensor | None) -> None:
        params, anchor = self.replicas.params, take(self.anchor.params, frag.params)
        put(params, frag.params, self._mixed(take(params, frag.params), anchor))
        if buffers is not None:
            put(self.anchor.buffers, frag.buffers, buffers)
            rows = self.replicas.buffers
            put(rows, frag.buffers, self._mixed(take(rows, frag.buffers), buffers.unsqueeze(0)))

    def _mixed(self, local: Tensor, outer: Tensor) -> Tensor:
        """(1 − α)·outer + α·local for every row (α = 0: the outer result itself); `outer`:
        one row for all, or one per local row."""
        if self.mix == 0.0:
            return outer.expand_as(local)
        return local * self.mix + outer * (1.0 - self.mix)

    def _inner_state(self, frag: Fragment) -> None:
        """The inner optimizers' state of the fragment's parameters: kept, dropped or averaged."""
        if self.inner_state == "keep":
            return
        params = [[ps[t] for t in frag.tensors] for ps in self._worker_params]
        if self.inner_state == "reset":
            for opt, mine in zip(self.optimizers, params, strict=True):
                for p in mine:
                    opt.state.pop(p, None)
        else:
            average_optimizer_state(self.optimizers, self.comm, params)

    # -- evaluation, reporting ---------------------------------------------------------------------
    def consensus(self) -> tuple[Tensor, Tensor]:
        if self.evaluate == "average":
            return self.base.consensus()
        if self.overlap.eager:  # the mean of the workers' own outer parameters θ_i
            params, buffers = self.anchor.params.clone(), self.anchor.buffers.clone()
            self.comm.all_reduce(params, op="mean", record="eval")
            self.comm.all_reduce(buffers, op="mean", record="eval")
            return params[0], buffers[0]
        return self.anchor.params[0].clone(), self.anchor.buffers[0].clone()

    def metrics(self) -> dict[str, float]:
        rounds = self.merges / len(self.fragments)
        return {
            **self.base.metrics(),
            "outer/rounds": rounds,
            "outer/peak_step_bytes": float(self.peak_step_bytes),
            "outer/bytes_per_round": self.outer_bytes / rounds if rounds else 0.0,
            "outer/modeled_s_per_round": self.outer_modeled_s / rounds if rounds else 0.0,
            "outer/delta_norm": self.last_delta_norm,
            **self.diagnostics.metrics(),
            "outer/momentum_norm": self._momentum_norm(),
            **reducers_memory_norm(self.reducers or []),
        }

    def _momentum_norm(self) -> float:
        """The outer momentum's norm; under eager updates, where every worker has its own, the
        root mean square over all K workers of their norms (one "metrics" allreduce)."""
        if not self.overlap.eager:
            return outer_momentum_norm(self.outer)
        squares = self.anchor.params.new_tensor(
            [
                [outer_momentum_norm(opts[row] for opts in self.outer_by_fragment) ** 2]
                for row in range(self.anchor.params.shape[0])
            ]
        )
        self.comm.all_reduce(squares, op="mean", record="metrics")
        return float(squares[0, 0]) ** 0.5

    def describe(self) -> dict[str, Any]:
        return {
            **self.base.describe(),
            "outer/period": self.schedule.period,
            "outer/fragments": len(self.fragments),
            "outer/overlap": self.schedule.overlap,
            "outer/delay": self.overlap.delay,
            "outer/fragment_numel": [f.numel for f in self.fragments],
        }

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        with self._accounted():
            for flight in self.in_flight.values():
                self._resolve(flight)
        return {
            "base": self.base.state_dict(),
            "anchor": self.anchor.params,
            "anchor_buffers": self.anchor.buffers,
            "outer": [opt.state_dict() for opt in self.outer],
            "in_flight": {
                f: {"merge_at": fl.merge_at, "mean": fl.mean, "buffers": fl.buffers, "own": fl.own}
                for f, fl in self.in_flight.items()
            },
            "merges": self.merges,
            "peak_step_bytes": self.peak_step_bytes,
            "outer_bytes": self.outer_bytes,
            "outer_modeled_s": self.outer_modeled_s,
            "last_delta_norm": self.last_delta_norm,
            "reducers": [r.state_dict() for r in self.reducers or []],
            "diagnostics": self.diagnostics.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.base.load_state_dict(state["base"])
        self.anchor.params.copy_(state["anchor"])
        self.anchor.buffers.copy_(state["anchor_buffers"])
        for opt, saved in zip(self.outer, state["outer"], strict=True):
            opt.load_state_dict(saved)
        device = self.replicas.params.device
        self.in_flight = {
            int(f): InFlight(
                merge_at=int(fl["merge_at"]),
                mean=fl["mean"].to(device),
                buffers=None if fl["buffers"] is None else fl["buffers"].to(device),
                own=None if fl.get("own") is None else fl["own"].to(device),
            )
            for f, fl in state["in_flight"].items()
        }
        self.merges = int(state["merges"])
        self.peak_step_bytes = int(state["peak_step_bytes"])
        self.outer_bytes = int(state["outer_bytes"])
        self.outer_modeled_s = float(state["outer_modeled_s"])
        self.last_delta_norm = float(state["last_delta_norm"])
        for reducer, saved in zip(self.reducers or [], state.get("reducers", []), strict=True):
            reducer.load_state_dict(saved)
        self.diagnostics.load_state_dict(state.get("diagnostics"))


PERIOD_MESSAGE = (
    "outer.period is required: {name} has no averaging period of its own for the outer "
    "optimizer to take over; set outer.period=H (steps between outer steps)"
)


def no_drift_message(name: str) -> str:
    return (
        f"an outer optimizer needs a lockstep base algorithm whose workers drift apart between "
        f"synchronisations, and {name} is not one; use algorithm=local_sgd (period 1 is "
        "synchronous SGD with model averaging), dpsgd, choco, sgp or sparta"
    )


GROUP_CHOICE = r"\b(compressor|error_feedback)="  # "use error_feedback=none" in a pairing line


def fragment_layout(fragment: Fragment, shapes: list[tuple[int, ...]]) -> ParamLayout:
    """(offset, shape) of each of the fragment's tensors in its packed `[n_f]` Δ row."""
    layout, offset = [], 0
    for t in fragment.tensors:
        layout.append((offset, shapes[t]))
        offset += math.prod(shapes[t])
    return layout
