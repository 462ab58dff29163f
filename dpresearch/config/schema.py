"""Structured-config schema: types and defaults for every key that is not a plug-in.

Plug-in groups (`data`, `model`, `optimizer`, `schedule`, `algorithm`, `compressor`,
`error_feedback`, `topology`, `protocol`, `outer`) are Hydra `_target_`
nodes whose keys belong to their target; their arguments are checked against the target's
signature by `validate.py` before any worker starts. Everything else is typed here, so an
unknown key or a wrongly typed value fails at composition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


@dataclass
class TrainConfig:
    """The loop. `batch_size` is per worker; the global batch is `workers × batch_size`.

    Run length: `train.steps=N` runs N steps and wins over the configured `epochs` (so a short
    smoke run is just `train.steps=6`); to train by epochs where a config sets `steps`, pass
    `train.steps=null train.epochs=E`. Giving both `train.steps` and `train.epochs` on one command
    line, or `train.epochs` while `steps` is set, is rejected. `eval_every` is in steps (null: at
    every epoch end; the language-model data presets set 50);
    `lr_scaling`: "linear" multiplies the optimizer's lr by the number of workers (Goyal et al.),
    "none" leaves it. `channels_last`: NHWC inputs and conv weights (faster convolutions on
    GPUs). `autocast`: null, "bf16" or "fp16" mixed-precision forward/backward; fp16 multiplies
    the loss by the static `loss_scale` and divides the gradients by it before communication.
    `val_size`: training examples held out as a validation split (a count, or a fraction < 1;
    0: none), the same examples in every seed, never trained on, evaluated as `val/loss` and
    `val/acc` beside the test metrics — what a study selects its learning rate on.
    `eval_bn_stats`: the BatchNorm running statistics the evaluated model carries — `consensus`
    (the algorithm's: worker 0's for `sync`, the workers' mean for gossip and local methods),
    `average` (the mean of every worker's) or `recompute` (recomputed on the first
    `eval_batch_size` training examples); see `dpresearch/run/evaluation.py`.

    Checkpoints (`dpresearch/run/checkpoint_files.py`): `checkpoint_every` is a number of steps
    (`500`), of epochs (`1ep`, `0.5ep`) or 0/null (off, the default); `checkpoint_keep` keeps
    the last N.
    SIGTERM/SIGINT always write a final checkpoint (as Lightning does), whatever
    `checkpoint_every` says. `resume`: null (start fresh), `auto` (continue from the run
    directory's latest complete checkpoint if there is one, else start fresh) or a path (a
    checkpoint file or a run directory); a checkpoint written with other settings in anything
    that shapes the trajectory is refused, naming the keys, unless `resume_allow_changes` lists
    them (keys or whole nodes, e.g. `[train.steps, optimizer]`: deliberate changes; see
    `dpresearch/resume.py`). `init_from`: start from another run's model weights only (a
    checkpoint file or a run directory: a finished run's final model, else its latest
    checkpoint's worker-0 row), with a fresh optimizer, schedule, step counter and data order;
    refused if the model differs (`dpresearch/run/init_from.py`). `on_nonfinite`: what a
    non-finite training loss does — `stop` (exit 3, `status: diverged`, no model written),
    `skip_step` (that step's update is dropped and counted) or `continue`.

    `batched_workers`: how the simulated workers of one process compute — `false` one by one,
    `stacked` as one forward/backward whose layers hold the workers' weights as one tensor
    and write the gradients into their rows (`dpresearch/run/stacked.py`: the shipped model
    families), `vmap` as a `torch.func.vmap` ensemble over the parameter rows (any model vmap
    can run; `dpresearch/run/batched.py`), `true` stacked where the model can, else vmap (a
    model that can do neither is refused before the run), `auto` batched where that is faster
    (a GPU; a CPU only for models small enough that per-operation overhead dominates) and
    where the model can be. Printed at the start.

    `grad_clip`: clip gradients to this global L2 norm (`torch.nn.utils.clip_grad_norm_` over
    a worker's parameters; null: off, the default; `inf`: measure only; the language-model data
    sets `data=shakespeare|text` set nanoGPT's 1.0). Each worker clips its own gradient before
    its local step; synchronous SGD clips the averaged gradient (as DDP + clip_grad_norm_), or,
    with a compressor, each worker's gradient before it is encoded (`dpresearch/grad_clip.py`).
    Logged as `train/grad_norm`, the mean pre-clip norm.

    `time_scenarios`: further modeled clocks of a lockstep run, name → {speed keys of the
    `async` node, `network: <preset>`} (a key left out is the run's own), each logged as
    `time/modeled_s@<name>`: what `time/modeled_s` of a run with those keys would read
    (`dpresearch/run/time_scenarios.py`); on the command line one at a time,
    `+train.time_scenarios.slow4={slow_workers:[3],slowdown:4}`.
    """

    steps: int | None = None
    epochs: float = 1.0
    batch_size: int = 32
    eval_every: int | None = None
    eval_batch_size: int = 1000
    eval_bn_stats: str = "consensus"
    val_size: float = 0.0
    log_every: int = 10
    lr_scaling: str = "none"
    device: str = "auto"
    progress: bool = True
    save_model: bool = True
    channels_last: bool = False
    autocast: str | None = None
    loss_scale: float = 1024.0
    checkpoint_every: str | None = None
    checkpoint_keep: int = 2
    resume: str | None = None
    resume_allow_changes: list[str] = field(default_factory=list)
    init_from: str | None = None
    on_nonfinite: str = "stop"
    batched_workers: str = "auto"
    grad_clip: float | None = None
    time_scenarios: dict[str, Any] = field(default_factory=dict)


@dataclass
class BackendConfig:
    """How workers are placed: `simulated` (all in this process), `gloo` (CPU processes) or
    `nccl` (one GPU per process). `threads`: torch threads per process (null: chosen by
    `dpresearch/launch/threads.py` — cores ÷ local processes ÷ concurrent sweep jobs, and a
    simulated run 1 unless its model is large enough to gain and that many cores are idle at
    the start; printed). Matrix products round differently with different thread counts, so
    bit-level comparisons across runs and backends fix it (e.g. 1). `timeout_s`: how long a
    collective may wait for a peer. `heartbeat_s`: a worker process started by this
    machine's launcher that shows no sign of life for this long (stopped, frozen) ends the job
    with one line naming it (null: no watchdog; torchrun jobs rely on `timeout_s`).
    `start_method`: how this machine's launcher starts its worker processes: `forkserver`
    (forked from a server that imported torch once: a fraction of a second each after the
    first launch) or `spawn` (a new interpreter each; see `dpresearch/launch/forkserver.py`)."""

    name: str = "simulated"
    threads: int | None = None
    timeout_s: float = 600.0
    heartbeat_s: float | None = 60.0
    start_method: str = "forkserver"


@dataclass
class NetworkConfig:
    """The α-β network model pricing every recorded collective (`comm/modeled_s`).
    `message_overhead_us`: host overhead per message (added to α); `allgather_factor`:
    multiplies allgather's bandwidth term; `allgather_latency_us`: latency of one allgather round
    in place of `latency_us` (see `dpresearch/comm/network.py`; 0, 1 and null: an ideal
    fabric). `compute_step_s`: modeled compute seconds of one training step, behind which
    communication an algorithm overlaps with later steps (Streaming DiLoCo's fragments) is
    hidden (0: nothing is hidden). With `comm.hierarchy` (a two-level cluster), `intra` names
    the preset pricing links inside a node and `inter` the one between nodes (null: this
    network)."""

    name: str = "10gbe"
    latency_us: float = 20.0
    bandwidth_gbit: float = 10.0
    message_overhead_us: float = 0.0
    allgather_factor: float = 1.0
    allgather_latency_us: float | None = None
    compute_step_s: float = 0.0
    intra: str = "nvlink"
    inter: str | None = None


@dataclass
class HierarchyConfig:
    """A two-level cluster (`dpresearch.comm.hierarchy`): `workers_per_node` G (null: flat).
    Workers nG … nG+G−1 form node n; `algorithm=sync` then reduces inside each node exactly,
    compresses across nodes (between the node leaders) and broadcasts back.
    `intra_algorithm`: how that intra-node reduce and broadcast are priced and their bytes
    counted — "tree" (binomial trees) or "ring" (NCCL's intra-node ring: pipelined chains);
    the values are the same."""

    workers_per_node: int | None = None
    intra_algorithm: str = "tree"


@dataclass
class CommConfig:
    """`reduction`: "ring" allreduce or "centralized" (parameter server on worker 0).
    `deterministic`: add sums in worker order on every backend, so simulated and multi-process
    runs agree bit for bit (see `Communicator`). `p2p_schedule`: how real ranks post a
    neighbour exchange — `by_distance` (one ring distance at a time: no pair sends both ways at
    once, which gloo serialises), `one_batch`, or `auto` (by distance for gloo across machines,
    one batch otherwise; see `comm.distributed.default_p2p_schedule`)."""

    reduction: str = "ring"
    deterministic: bool = False
    p2p_schedule: str = "auto"
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)


@dataclass
class LoggerConfig:
    """Local files are always written; `wandb=true` adds Weights & Biases (rank 0 only).

    `mode`: online / offline / disabled; null takes WANDB_MODE, else "online". An online start
    that fails (no network, no API key, no answer within `init_timeout_s`) falls back to offline
    with one warning line. `name` (null: derived from the run, e.g. `sync-topk-w8-s0`) and
    `group` (null: the sweep, or the `experiment=` study) label the run in W&B.
    """

    wandb: bool = False
    mode: str | None = None
    project: str = "dpresearch"
    entity: str | None = None
    name: str | None = None
    group: str | None = None
    job_type: str | None = None
    tags: list[str] = field(default_factory=list)
    init_timeout_s: float = 30.0


@dataclass
class DebugConfig:
    """Fault injection for testing failure handling: worker `fail_worker` raises at
    `fail_at_step`."""

    fail_worker: int | None = None
    fail_at_step: int | None = None


@dataclass
class Config:
    workers: int = 4
    seed: int = 0
    train: TrainConfig = field(default_factory=TrainConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    data: Any = None
    model: Any = None
    optimizer: Any = None
    schedule: Any = None
    algorithm: Any = None
    compressor: Any = None
    error_feedback: Any = None
    topology: Any = None
    protocol: Any = None


def schema() -> DictConfig:
    """`Config` plus the typed `async` node (`AsyncOptions`), which cannot be a dataclass field:
    `async` is a Python keyword, and the `outer` plug-in node, open (not struct): its options
    compose nested groups (`optimizer@outer.optimizer`, `compressor@outer.compressor`) before
    their own keys."""
    from dpresearch.asynchrony.options import AsyncOptions

    node = OmegaConf.structured(Config)
    OmegaConf.set_struct(node, False)
    node["async"] = OmegaConf.structured(AsyncOptions)
    node["outer"] = OmegaConf.create({})
    OmegaConf.set_struct(node, True)
    OmegaConf.set_struct(node.outer, False)
    return node


def register_configs() -> None:
    """Make the schema available to `dpresearch/conf/config.yaml` as `base_config`."""
    ConfigStore.instance().store(name="base_config", node=schema())
