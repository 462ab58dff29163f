"""The algorithm contract.

An algorithm receives the local replicas (gradients already in `replicas.grads` after each
worker's backward), the communicator and one optimizer per local worker. Every step the trainer
asks it for a `StepPlan` (`plan(step)`: which local workers compute, and on which parameters),
hands it the schedule's learning-rate multiplier (`set_lr`), calls `before_forward(step)`, runs
forward/backward for the planned workers only, each on its own next batch, and calls
`after_backward(step)`. It calls `consensus()` whenever it needs the single model the run stands
for (evaluation, the final checkpoint). An algorithm never asks which process a worker lives
on: it only uses the communicator's stacked collectives.

The defaults are lockstep data parallelism: every local worker computes every step on its own
parameters, every optimizer's lr is base × multiplier, and one step consumes one batch per
worker. An asynchronous algorithm overrides `plan` (one worker per step, chosen by its event
queue, possibly on a stale snapshot), `set_lr` (its server optimizer) and `gradients_per_step`.
"""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from dpresearch.comm.base import Communicator
from dpresearch.compress.pairing import ChannelNeeds
from dpresearch.grad_clip import GradClip
from dpresearch.optim import set_lr
from dpresearch.options import Options
from dpresearch.replicas import Replicas
from dpresearch.stacked_step import FlatRows, step_together


@dataclass(frozen=True)
class StepPlan:
    """What the trainer runs in one step.

    workers: the local worker rows (0 … W−1, ascending, no repeats) that run forward and
    backward this step, each on its own next batch (a data cursor per worker), with the
    gradient landing in its row of `replicas.grads`. Rows not listed keep their parameters and
    gradients untouched.
    reads: parameters a planned worker computes on instead of its row's current ones (e.g. a
    stale snapshot): row w's parameters are overwritten with `reads[w]` (a `[D]` tensor the
    algorithm owns; copied at once, so it may change afterwards) before the forward pass.
    models: modules planned rows compute with instead of their replicas' (nothing copied):
    parameters held elsewhere — e.g. a stale read kept in place, `Replicas.models_on` — with
    the replica's gradient views and buffers, so the gradient lands in the row's gradients
    and the row's parameters stay as they are. Such rows compute one at a time.
    ahead: rows (not in `workers`) whose parameters and next batch stay fixed until a later
    plan lists them in `workers` (an event simulator's workers in flight, their pulls in their
    rows). A batched compute may compute their next gradients now, together with `workers`,
    and hold them in their gradient rows (and their batches' statistics) until then; so the
    algorithm must leave those rows' parameters, buffers and gradients alone meanwhile. The
    loop computes one row at a time and ignores it.
    """

    workers: tuple[int, ...]
    reads: Mapping[int, Tensor] = field(default_factory=dict)
    ahead: tuple[int, ...] = ()
    models: Mapping[int, nn.Module] = field(default_factory=dict)

    @classmethod
    def every(cls, num_local: int) -> StepPlan:
        """Lockstep: every local worker on its own parameters."""
        return cls(tuple(range(num_local)))


@dataclass(frozen=True)
class Traits:
    """What the run-control layers need to know about an algorithm class before building it,
    declared once on the class (`Algorithm.traits`) and read only from there.

    checkpointable: `state_dict` holds all the algorithm's state beyond replicas and
    optimizers, so a checkpoint resumes it exactly (otherwise the checks refuse
    `train.checkpoint_every` and `train.resume`, and a stop request writes none).
    skippable: `drop_step` leaves the algorithm able to go on (`train.on_nonfinite=skip_step`).
    extra_processes: processes a real (gloo/nccl) run starts besides one per worker (a
    parameter server: 1); they take the first ranks (`Communicator.first_worker`).
    lockstep: on real ranks every process takes every step together, so the loop's
    agreement, metrics and evaluation are collectives among them. Otherwise (asynchronous
    algorithms) the processes exchange messages, the algorithm's `agree` tells each process
    when the run checkpoints or ends, and the main process alone logs and evaluates.
    messages: sends point-to-point messages between processes (`Communicator.isend`; on NCCL
    they travel in a gloo group the communicator creates beside it).
    drifts: the workers' models drift apart between the algorithm's synchronisations (local
    SGD, gossip), so an outer optimizer has pseudo-gradients to work on (synchronous SGD's
    workers always hold one model, a parameter server's workers none of their own).
    node_replicas: on a two-level cluster (`comm.hierarchy`) the workers of each node always
    hold one model (synchronous inside the node, nodes drifting apart: `algorithm=node_sync`),
    so an outer optimizer exchanges its pseudo-gradients among the node leaders only and
    broadcasts the result inside each node.
    two_level: reduces in two levels on a two-level cluster (`comm.hierarchy`: exact inside
    each node, then between the node leaders); the checks refuse `comm.hierarchy` for an
    algorithm without it. Declared by each class that has it, as every trait (a subclass
    restates its traits).
    compression_note: why an algorithm without `compressor`/`error_feedback` options takes
    none, shown when a configuration gives one (empty: the generic line).
    """

    checkpointable: bool = True
    skippable: bool = True
    extra_processes: int = 0
    drifts: bool = False
    node_replicas: bool = False
    two_level: bool = False
    lockstep: bool = True
    messages: bool = False
    compression_note: str = ""

    def processes(self, workers: int) -> int:
        """Processes a real run of `workers` workers starts."""
        return workers + self.extra_processes


@dataclass(frozen=True)
class Verdict:
    """What every process agreed on after a step's backward (`Algorithm.agree`): a stop
    request's signal (0: none), whether a loss was non-finite (and `train.on_nonfinite` cares),
    whether to checkpoint after this step, whether it was the run's last, and whether a write
    into the run directory was refused (`io_errors.RunIOError`, known to the main process)."""

    signum: int = 0
    nonfinite: bool = False
    checkpoint: bool = False
    finished: bool = False
    io_failed: bool = False


class Algorithm(ABC):
    """Base class; subclasses implement `after_backward` and may override the rest.

    `traits` (class level): see `Traits`. `OPTIONS` (class level): the declaration of its
    config node's own keys (`dpresearch.options.Options`: defaults, docs, check). `channel`
    (class level): what its compressed messages need (`compress.ChannelNeeds`: sync
    aggregation, gossip or pushes), read by the configuration checks (`compressor` /
    `error_feedback` pairing) and by `compress.open_channel`; None: it takes no compressor.
    `evaluates_local_models` (instance level, may be a config option): the workers' models
    differ (gossip, local SGD between averages), so evaluation also reports each worker's own
    model (`test/acc_local_mean`, `_min`).
    """

    traits: ClassVar[Traits] = Traits()
    channel: ClassVar[ChannelNeeds | None] = None
    OPTIONS: ClassVar[type[Options] | None] = None
    evaluates_local_models: bool = False

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Raise ValueError (one line naming the fix) for a configuration this algorithm
        cannot run; called with the whole composed config before any worker starts. By
        default: its declared options' own check (`OPTIONS.check_node(cfg.algorithm)`)."""
        if cls.OPTIONS is not None:
            cls.OPTIONS.check_node(cfg.algorithm)

    @classmethod
    def part(cls, comm: Communicator) -> type[Algorithm]:
        """The class this process runs (built with the same arguments): the algorithm itself,
        or, where processes play different parts (a parameter server and its workers), this
        process's part."""
        return cls

    def __init__(
        self, replicas: Replicas, comm: Communicator, optimizers: list[torch.optim.Optimizer]
    ) -> None:
        if len(optimizers) != replicas.num_local:
            raise ValueError("one optimizer per local worker is required")
        self.replicas = replicas
        self.comm = comm
        # a plain list: Hydra hands a list argument over as an OmegaConf ListConfig, whose
        # iteration costs microseconds per element on every step
        self.optimizers = list(optimizers)
        self._rows = FlatRows(replicas.params, replicas.grads)
        self._row_steps: dict[int, FlatRows] = {}  # per row stepping alone (`step_optimizer`)
        self.base_lrs = [[g["lr"] for g in opt.param_groups] for opt in optimizers]
        self._lockstep = StepPlan.every(replicas.num_local)
        self.grad_clip: GradClip | None = None  # `train.grad_clip` (`set_grad_clip`)

    @property
    def gradients_per_step(self) -> int:
        """Worker gradients (batches) one step consumes across all K workers; the trainer
        converts `train.epochs` into steps with it. Lockstep: K."""
        return self.comm.world_size

    def plan(self, step: int) -> StepPlan:
        """The workers that compute at `step` and what they read (default: all, their own)."""
        return self._lockstep

    def set_lr(self, multiplier: float) -> None:
        """Apply the schedule's multiplier for the coming step: by default every optimizer's
        groups get base lr × `multiplier`."""
        for opt, bases in zip(self.optimizers, self.base_lrs, strict=True):
            set_lr(opt, bases, multiplier)

    def set_grad_clip(self, clip: GradClip) -> None:
        """Told once, before the first step, the run's gradient clipping (`train.grad_clip`),
        which `clip_gradients` applies."""
        self.grad_clip = clip

    def clip_gradients(self, row: int | None = None) -> None:
        """Clip every local row of `replicas.grads` (or only `row`) to the global L2 norm
        `train.grad_clip`, each by its own norm (`grad_clip.GradClip`); nothing without it.
        `step_optimizers` and `step_optimizer` call it first: a worker stepping on its own
        gradient clips that gradient. An algorithm that exchanges gradients before the step
        calls it where its convention says (synchronous SGD: on the average, or on each
        worker's gradient before a compressor) and steps with `clip=False`."""
        if self.grad_clip is not None:
            self.grad_clip(self.replicas.grads, row)

    def step_optimizers(self, clip: bool = True) -> None:
        """Every local worker's optimizer steps: one functional call per parameter group over
        the flat rows where they are the same SGD, Adam(W) or MuonAdamW
        (`stacked_step.step_together`; the same result as one by one), after clipping each
        worker's gradient (`clip_gradients`; not with `clip=False`: the caller has)."""
        if clip:
            self.clip_gradients()
        step_together(self.optimizers, self._rows)

    def step_optimizer(self, row: int) -> None:
        """Local row `row`'s optimizer steps alone (an asynchronous event's update), after
        clipping its gradient (`clip_gradients`): one functional call per group on its row of
        the flat rows (`stacked_step.step_together`), without the optimizer's wrapper; the same
        result as its own `step()`."""
        self.clip_gradients(row)
        rows = self._row_steps.get(row)
        if rows is None:
            replicas = self.replicas
            rows = self._row_steps[row] = FlatRows.of_row(replicas.params, replicas.grads, row)
        step_together((self.optimizers[row],), rows)

    def before_forward(self, step: int) -> None:
        """Called before the workers' forward passes of `step`."""

    def losses_finite(self) -> bool:
        """Whether the training losses that reached this process by message this step (a
        parameter server's pushes) were finite; the local workers' own are the loop's."""
        return True

    def agree(self, proposal: Verdict) -> Verdict:
        """The step's verdict, the same on every process, from this process's `proposal`
        (its stop request, non-finite and refused-write flags; checkpoint and end by the step
        count, equal everywhere). Lockstep: one 4-number allreduce [SIGINT, other stop signal,
        non-finite, refused write] when there are several processes, none in one process."""
        processes = self.comm.world_size // self.comm.num_local
        if processes == 1:
            return proposal
        signum = proposal.signum
        flags = torch.tensor(
            [
                [
                    signum == signal.SIGINT,
                    signum not in (0, signal.SIGINT),
                    proposal.nonfinite,
                    proposal.io_failed,
                ]
            ],
            dtype=torch.float32,
            device=self.replicas.params.device,
        )
        self.comm.all_reduce(flags, op="sum", record=False)
        interrupt, terminate, bad, io = flags[0].tolist()
        signum = signal.SIGINT if interrupt else signal.SIGTERM if terminate else 0
        return replace(proposal, signum=int(signum), nonfinite=bad > 0, io_failed=io > 0)

    @abstractmethod
    def after_backward(self, step: int) -> None:
        """Called once every local worker's gradient of `step` is in `replicas.grads`;
        must leave every replica ready for the next forward (normally: optimizer stepped)."""

    def drop_step(self, step: int) -> None:
        """Called instead of `after_backward` when the trainer drops step `step`'s update
        (`train.on_nonfinite=skip_step`): finish any communication `before_forward` or the
        backward pass started, change nothing else."""

    def consensus(self) -> tuple[Tensor, Tensor]:
        """The (flat params, flat float buffers) of the model the run stands for, identical on
        every process: by default the average over all workers (recorded as "eval" traffic)."""
        params = self.replicas.params.clone()
        buffers = self.replicas.buffers.clone()
        self.comm.all_reduce(params, op="mean", record="eval")
        self.comm.all_reduce(buffers, op="mean", record="eval")
        return params[0], buffers[0]

    def attach_compute(self, compute: Any) -> None:
        """Told once, after the run is built, which object runs the local workers'
        forward/backward (`run.compute.WorkerCompute`): an algorithm that sends its workers'
        training losses elsewhere (an asynchronous worker's pushes) reads them there."""

    def set_run_length(self, steps_per_epoch: int, total_steps: int) -> None:
        """Told once, before the first step, how many steps make an epoch and the run (for
        options given in epochs, e.g. post-local SGD's switch)."""

    def metrics(self) -> dict[str, float]:
        """Extra metrics logged at every log step (same value on every process); collectives
        here pass `record="metrics"`."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Facts about the run's set-up printed at the start and stored in summary.json
        (e.g. the topology's spectral gap)."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Facts known only at the end of the run (e.g. a histogram), added to summary.json."""
        return {}

    # -- under an outer optimizer (`algorithms/outer`) ------------------------------------------
    @classmethod
    def outer_handover(cls, node: Any) -> int | None:
        """The period, in steps, of the exact averaging the algorithm configured by `node` does
        on its own, which an outer optimizer wrapping it takes over (None: it has none). Raise
        ValueError (one line naming the fix) where the algorithm cannot hand it over."""
        return None

    def hand_over_averaging(self) -> int | None:
        """Called once, before the first step, by an outer optimizer wrapping this algorithm:
        stop the exact averaging `outer_handover` names (the outer step replaces it) and
        return its period (None: none)."""
        return None

    def model_rows(self) -> Tensor:
        """The `[W, D]` rows whose mean over all K workers is the exact average of the workers'
        models (an outer optimizer's pseudo-gradients are taken against it): by default the
        parameters themselves."""
        return self.replicas.params

    def restarted(self) -> None:
        """Every worker's parameters and buffers were just set to one common model by an outer
        optimizer: reset whatever the algorithm derives from the workers' spread."""

    def state_dict(self) -> dict:
        """Algorithm state to checkpoint beyond what the trainer saves itself (every replica's
        parameters and buffers, every optimizer, data cursors, RNG streams, the ledger): e.g.
        error-feedback memories, PowerSGD's Q, gossip copies. Tensors may be live (the
        trainer saves between steps); this process's workers only. The checkpoint contract:
        `load_state_dict(state_dict())` on a freshly built algorithm continues bit for bit."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (called after replicas and optimizers are
        restored, before the first step)."""
