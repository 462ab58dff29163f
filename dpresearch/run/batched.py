"""Forward and backward of several local workers as one computation (`train.batched_workers`).

The W replicas' parameters already sit in the rows of `replicas.params` (`[W, D]`): each
parameter of the model is a `[W, *shape]` strided view of a column block. `BatchedWorkers`
runs the model once, under `torch.func.vmap` over those views (`functional_call` on one replica
as the template), each row on its own batch (`[S, B, ...]`), and writes each row's gradient into
its row of `replicas.grads` — the same numbers the loop computes worker by worker, up to the
rounding of batched kernels (tested to 1e-6 after 20 steps, `tests/test_batched.py`).

Per row state is kept per row: BatchNorm running statistics are updated in the rows of
`replicas.buffers` and `num_batches_tracked` in `replicas.int_buffers`, as each replica's own
forward would. Any subset of rows works: a contiguous range is computed on views of the rows
themselves; other subsets are gathered and their results scattered back.

Not every model can run this way: a model that draws random numbers in training (dropout)
would draw for all rows at once, not as the loop does one worker after another (the stacked
way runs dropout on the `worker` stream, `models/dropout.py`; vmap none), and a model
whose forward reads tensor values into Python control flow cannot be vmapped. `probe` runs a
model both ways on two rows and says why it cannot be batched (None: it can); `decide` turns
`train.batched_workers` (auto | true | false) into the mode a run takes.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from dpresearch.models.dropout import drawing_from
from dpresearch.replicas import Replicas
from dpresearch.run.slots import NULL_CONTEXT, slots

MODES = ("auto", "true", "false", "stacked", "vmap")
# How batched rows compute: `StackedWorkers` (run/stacked.py: the shipped model families, their
# gradients accumulated straight into the rows) or this module's vmapped ensemble (any model
# vmap can run; its gradients come back as fresh tensors and are copied into the rows).
STACKED, VMAP = "stacked", "vmap"
# vmap runs an operator without a batching rule (CPU attention, `scaled_dot_product_attention`)
# row by row, correctly, and says so at every call: the batched-workers line says how workers
# compute, and the warning would repeat every step.
warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet")
# On a CPU a batched step gains only while per-operation overhead outweighs the arithmetic,
# and only with enough workers to spread vmap's own fixed cost over: `auto` batches on a CPU
# from this many local workers and up to this many multiply-adds per worker forward (measured
# with `experiments/bench/batched_vs_ensemble.py`, see the bench README). A stacked model has
# no such fixed cost, but below this many workers it gains little on a CPU and `auto` keeps the
# loop there for another reason: a few simulated workers then compute exactly as one process
# per worker does (the same kernels in the same order), so a float32 run of K < 8 simulated
# workers equals its gloo/NCCL twin on any CPU; stacked kernels round otherwise (equal in
# float64, tests/test_stacked.py) and `train.batched_workers=stacked` asks for them.
CPU_BATCHED_MIN_WORKERS = 8
CPU_BATCHED_MAX_MACS = 2.0e7
# ... and while the inputs of all workers' batches together stay near the CPU's cache: beyond
# it a batched step streams them from memory, while one worker at a time works in cache (the
# stacked step too: logistic regression at 16 workers, 12.6 MB, one by one 0.77 of the vmap
# ensemble's step, stacked 0.89, vmapped 0.99 — batched_vs_ensemble.py, 2026-11-28, load 2.3)
# (logistic regression, 3072 features, batch 64: 16 workers = 12.6 MB batched ≈ one by one,
# 64 workers = 50 MB one by one 0.59× the batched step in one quiet run, equal in another,
# never slower; the MLP at 64 workers, 2 MB, gains from batching).
CPU_BATCHED_MAX_INPUT_BYTES = 8 * 2**20
# A probe's gradients may differ from the loop's by this much (relative, in float64: the two
# ways agree to ~1e-14 on every shipped model); a wrong result differs by far more.
PROBE_RTOL = 1e-8
PROBE_RTOL_16BIT = 5e-2  # under bf16/fp16 autocast every product is rounded to 8 or 11 bits


class BatchedWorkers:
    """Forward and backward of rows of `replicas` as one vmapped computation.

    `loss_fn(outputs, targets)` is the per-row loss (the loop's cross-entropy)."""

    def __init__(
        self, replicas: Replicas, loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy
    ) -> None:
        self.replicas = replicas
        self.template = replicas.models[0]
        self.params, self.floats, self.ints = slots(replicas)
        self.loss_fn = loss_fn
        self._names = [s.name for s in (*self.params, *self.floats, *self.ints)]
        # The gradient is taken per row inside vmap (vmap of grad), as an ensemble does: the
        # backward of a batched forward (grad of vmap) multiplies transposed operands, which
        # the CPU's batched matrix product runs several times slower.
        self._step = vmap(grad(self._loss, has_aux=True), randomness="error")
        self._autocast: Any = NULL_CONTEXT
        self._scale = 1.0
        self._orders: dict[tuple[int, torch.device], Tensor] = {}
        self._row_views: dict[tuple[int, int], tuple] = {}

    def _loss(
        self, params: tuple[Tensor, ...], others: tuple[Tensor, ...], x: Tensor, y: Tensor
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        tensors = dict(zip(self._names, (*params, *others), strict=True))
        with self._autocast:
            out = functional_call(self.template, tensors, (x,))
            loss = self.loss_fn(out, y)
        return (loss * self._scale if self._scale != 1.0 else loss), (loss, out)

    def _views(self, lo: int, hi: int) -> tuple[tuple[Tensor, ...], list[Tensor], list[Tensor]]:
        """The `[S, *shape]` views of rows lo…hi−1 of the parameters, gradients and integer
        buffers (cached: views of the same storage stay valid, and a step on a GPU is short
        enough that building some 200 views each time would show)."""
        key = (lo, hi)
        if key not in self._row_views:
            reps = self.replicas
            self._row_views[key] = (
                tuple(s.view(reps.params[lo:hi]) for s in self.params),
                [s.view(reps.grads[lo:hi]) for s in self.params],
                [s.view(reps.int_buffers[lo:hi]) for s in self.ints],
            )
        return self._row_views[key]

    def _buffer_major(self, count: int, device: torch.device) -> Tensor:
        """Positions in `count` flat buffer rows (`[count, Db]`, row-major) listed buffer by
        buffer, each buffer's `[count, C]` block row-major (cached per count and device)."""
        key = (count, device)
        if key not in self._orders:
            width = self.replicas.buffers.shape[1]
            rows = torch.arange(count)[:, None] * width
            order = [(rows + s.offset + torch.arange(s.numel)).reshape(-1) for s in self.floats]
            self._orders[key] = torch.cat(order).to(device)
        return self._orders[key]

    def _blocks(self, staged: Tensor, count: int) -> list[Tensor]:
        """The `[count, *shape]` block of each float buffer in a buffer-major copy."""
        blocks, start = [], 0
        for slot in self.floats:
            size = count * slot.numel
            blocks.append(staged[start : start + size].view(count, *slot.shape))
            start += size
        return blocks

    def run(
        self, rows: Sequence[int], x: Tensor, y: Tensor, autocast: Any = None, scale: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        """Forward and backward of `rows` (ascending) on inputs `x` (`[S, B, ...]`) and targets
        `y` (`[S, B]`), the forward under the context `autocast`, the loss multiplied by
        `scale` before differentiation; each row's gradient is written into its row of
        `replicas.grads` (overwriting it) and its buffers updated. Returns the per-row losses
        `[S]` and outputs `[S, B, ...]` (detached)."""
        reps = self.replicas
        lo, hi = rows[0], rows[-1] + 1
        contiguous = hi - lo == len(rows)
        if contiguous:
            params, grad_views, ints = self._views(lo, hi)
            float_rows = reps.buffers[lo:hi]
        else:
            index = torch.tensor(rows, device=reps.params.device)
            param_rows, float_rows, int_rows = (
                t.index_select(0, index) for t in (reps.params, reps.buffers, reps.int_buffers)
            )
            params = tuple(s.view(param_rows) for s in self.params)
            ints = [s.view(int_rows) for s in self.ints]
        # BatchNorm's batching rule updates running statistics in place only on contiguous
        # [S, C] tensors: the buffers are computed on one buffer-major copy of the rows (each
        # buffer's [S, C] block contiguous; one gather), scattered back afterwards.
        order = self._buffer_major(len(rows), float_rows.device) if self.floats else None
        staged = float_rows.reshape(-1).index_select(0, order) if order is not None else None
        floats = self._blocks(staged, len(rows)) if staged is not None else []
        self._autocast, self._scale = autocast if autocast is not None else NULL_CONTEXT, scale
        grads, (losses, out) = self._step(params, (*floats, *ints), x, y)
        if staged is not None:
            float_rows.view(-1).index_copy_(0, order, staged)
        if contiguous:
            torch._foreach_copy_(grad_views, list(grads))
        else:
            for slot, g in zip(self.params, grads, strict=True):
                slot.view(reps.grads).index_copy_(0, index, g)
            if self.floats:
                reps.buffers.index_copy_(0, index, float_rows)
            if self.ints:
                reps.int_buffers.index_copy_(0, index, int_rows)
        return losses.detach(), out.detach()


# -- can a model be batched, and does a run batch ----------------------------------------------


def probe(
    model: nn.Module,
    input_shape: Sequence[int],
    num_classes: int,
    autocast: str | None = None,
    device: torch.device | str = "cpu",
    data: Any = None,
    way: str = VMAP,
) -> str | None:
    """Why `model` cannot run its workers batched `way` (`stacked` or `vmap`), or None: a copy
    on `device` is run both ways (the loop, and batched) on two rows with different parameters
    and inputs (training mode, under the run's `autocast`: None, "bf16" or "fp16"), and the
    gradients and buffers compared; with the data set `data`, on its kind of inputs
    (`Dataset.probe_batch`) and its loss. Without autocast the copy runs in float64: in
    float32, BatchNorm over the probe's 4-image batches amplifies rounding so much in a deep
    model (ResNet-18: the loop itself 2 % from the exact gradient) that no tolerance would tell
    rounding from a forward that keeps state; in float64 the two ways agree to ~1e-14.
    `worker`-stream dropout draws from one generator per row, the same both ways."""
    device = torch.device(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(autocast or "")
    model = copy.deepcopy(model).to(device, None if dtype else torch.float64).train()
    real = next((p.dtype for p in model.parameters()), torch.float32)
    generator = torch.Generator().manual_seed(0)
    context = (
        (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else (lambda: NULL_CONTEXT)
    )
    try:
        loop, batched = (Replicas(model, 2, device) for _ in range(2))
        with torch.no_grad():
            noise = torch.randn(loop.params.shape, generator=generator).to(device, real) * 1e-2
            for reps in (loop, batched):
                reps.params.add_(noise)
        if data is not None:
            x, y = data.probe_batch(2, 4, generator)
            loss_fn = data.loss
        else:
            x = torch.randn(2, 4, *input_shape, generator=generator)
            y = torch.randint(num_classes, (2, 4), generator=generator)
            loss_fn = F.cross_entropy
        x = x.to(device, real) if x.is_floating_point() else x.to(device)
        y = y.to(device)

        def streams() -> list[torch.Generator]:
            return [torch.Generator(device).manual_seed(w) for w in range(2)]

        for w, g in enumerate(streams()):
            with context(), drawing_from([g]):
                loss = loss_fn(loop.models[w](x[w]), y[w])
            loss.backward()
        with drawing_from(streams()):
            workers_class(way)(batched, loss_fn).run([0, 1], x, y, context())
    except Exception as exc:
        return _reason(exc, autocast, way)
    rtol = PROBE_RTOL if dtype is None else PROBE_RTOL_16BIT
    for what in ("grads", "buffers", "int_buffers"):
        a, b = getattr(loop, what).double(), getattr(batched, what).double()
        scale = max(a.abs().max().item(), 1e-12) if a.numel() else 1.0
        if a.numel() and (a - b).abs().max().item() > rtol * scale:
            return f"its batched {what} differ from the loop's (a forward that keeps state?)"
    return None


def _reason(exc: BaseException, autocast: str | None, way: str = VMAP) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "randomness" in text or "random operation" in text:
        return (
            "it draws random numbers in training (e.g. dropout), which batched rows would "
            "draw differently from the loop"
        )
    under = f" under train.autocast={autocast}" if autocast else ""
    what = "be vmapped" if way == VMAP else "run stacked"
    return f"it cannot {what}{under} ({type(exc).__name__}: {text[:160]})"


_PROBED: dict[str, str | None] = {}


def probe_config(
    model_node: Any,
    input_shape: Sequence[int],
    num_classes: int,
    autocast: str | None = None,
    device: torch.device | str = "cpu",
    data: Any = None,
    way: str = VMAP,
) -> str | None:
    """`probe` of the model a `model` config node builds, batched `way` (memoised per node,
    shape, autocast, device type and way: the checks before a run and the run itself ask
    once). Building it does not move torch's global random stream."""
    from hydra.utils import instantiate
    from omegaconf import DictConfig, OmegaConf

    node = (
        OmegaConf.to_container(model_node, resolve=True)
        if isinstance(model_node, DictConfig)
        else model_node
    )
    device = torch.device(device)
    key = json.dumps(
        [node, list(input_shape), num_classes, autocast, device.type, type(data).__name__, way],
        sort_keys=True,
        default=str,
    )
    if key not in _PROBED:
        state = torch.get_rng_state()
        try:
            model = instantiate(node, num_classes=num_classes, input_shape=tuple(input_shape))
            _PROBED[key] = probe(model, input_shape, num_classes, autocast, device, data, way)
        finally:
            torch.set_rng_state(state)
    return _PROBED[key]


def batched_mode(value: Any) -> str:
    """`train.batched_workers` normalised to one of `MODES` (a YAML/command-line boolean
    arrives as a bool or "True")."""
    return str(value).strip().lower()


def workers_class(way: str) -> type:
    """The class computing batched rows `way` (`stacked` or `vmap`); both take
    `(replicas, loss_fn)` and have `run(rows, x, y, autocast, scale)`."""
    from dpresearch.run.stacked import StackedWorkers

    return StackedWorkers if way == STACKED else BatchedWorkers


def stacked_reason(cfg: Any, data: Any, device: torch.device) -> str | None:
    """Why the run's model cannot run stacked (None: it can): the structure first (a module
    with no stacked counterpart, dropout), then the probe against the loop."""
    from hydra.utils import instantiate

    from dpresearch.run.stacked import unsupported

    state = torch.get_rng_state()
    try:
        model = instantiate(
            cfg.model, num_classes=data.num_classes, input_shape=tuple(data.input_shape)
        )
    finally:
        torch.set_rng_state(state)
    reason = unsupported(model)
    if reason is not None:
        return reason
    return probe_config(
        cfg.model, data.input_shape, data.num_classes, cfg.train.autocast, device, data, STACKED
    )


def choose_way(cfg: Any, data: Any, device: torch.device) -> tuple[str | None, str]:
    """The way batched rows compute for `train.batched_workers` true/stacked/vmap (None when
    the model cannot, with the reason): `true` is stacked where the model can, else vmap."""
    mode = batched_mode(cfg.train.batched_workers)
    reasons = []
    for way in (STACKED, VMAP) if mode in ("true", "auto") else (mode,):
        if way == STACKED:
            reason = stacked_reason(cfg, data, device)
        else:
            reason = probe_config(
                cfg.model,
                data.input_shape,
                data.num_classes,
                cfg.train.autocast,
                device,
                data,
                VMAP,
            )
        if reason is None:
            return way, ""
        reasons.append(f"{way}: {reason}" if mode in ("true", "auto") else reason)
    return None, "; ".join(reasons)


def decide(cfg: Any, data: Any, num_local: int, device: torch.device) -> tuple[str | None, str]:
    """How this process's `num_local` workers compute — `stacked`, `vmap` or None (one by
    one) — and the one line saying which and why ("" with a single worker: nothing to batch).
    `true`, `stacked` or `vmap` for a model that cannot run that way raises `ConfigError`
    (the checks before the run say so first)."""
    from dpresearch.errors import ConfigError
    from dpresearch.models.workload import describe_macs, forward_macs

    if num_local < 2:
        return None, ""
    mode = batched_mode(cfg.train.batched_workers)
    name = str(cfg.model._target_).rsplit(".", 1)[-1]
    if mode == "false":
        return None, f"{num_local} workers one by one (train.batched_workers=false)"
    if mode != "auto":
        way, reason = choose_way(cfg, data, device)
        if way is None:
            raise ConfigError(unbatchable_message(name, reason, mode))
        return way, f"{num_local} workers {_described(way)} (train.batched_workers={mode})"
    if device.type != "cpu":
        way, reason = choose_way(cfg, data, device)
        if way is None:
            return (
                None,
                f"{num_local} workers one by one (auto: {name} cannot be batched: {reason})",
            )
        return way, f"{num_local} workers {_described(way)} (auto: {device.type})"
    per_example = forward_macs(
        cfg.model, data.input_shape, data.num_classes, data.tokens_per_example is not None
    )
    macs = per_example * cfg.train.batch_size if per_example is not None else None
    if macs is None or macs > CPU_BATCHED_MAX_MACS:
        size = "uncounted" if macs is None else describe_macs(macs)
        return None, (
            f"{num_local} workers one by one (auto: on a CPU batching gains only below "
            f"{describe_macs(CPU_BATCHED_MAX_MACS)} multiply-adds per worker forward; "
            f"{name} at batch {cfg.train.batch_size}: {size})"
        )
    inputs = math.prod(data.input_shape) * 4 * cfg.train.batch_size * num_local  # float32
    if inputs > CPU_BATCHED_MAX_INPUT_BYTES:
        return None, (
            f"{num_local} workers one by one (auto: on a CPU batching gains only while all "
            f"workers' inputs fit {CPU_BATCHED_MAX_INPUT_BYTES // 2**20} MiB; "
            f"{num_local} × batch {cfg.train.batch_size}: {inputs / 2**20:.1f} MiB)"
        )
    if num_local < CPU_BATCHED_MIN_WORKERS:
        return None, (
            f"{num_local} workers one by one (auto: on a CPU batching gains from "
            f"{CPU_BATCHED_MIN_WORKERS} workers in one process)"
        )
    stacked = stacked_reason(cfg, data, device)
    if stacked is None:
        return STACKED, f"{num_local} workers {_described(STACKED)} (auto: cpu)"
    reason = probe_config(
        cfg.model, data.input_shape, data.num_classes, cfg.train.autocast, device, data, VMAP
    )
    if reason is not None:
        return None, (
            f"{num_local} workers one by one (auto: {name} cannot be batched: stacked: "
            f"{stacked}; vmap: {reason})"
        )
    return VMAP, f"{num_local} workers {_described(VMAP)} (auto: cpu; stacked: {stacked})"


def _described(way: str) -> str:
    if way == STACKED:
        return "stacked, one forward/backward into their gradient rows"
    return "batched, one vmapped forward/backward"


def unbatchable_message(name: str, reason: str, mode: str = "true") -> str:
    """The one line for `train.batched_workers=true|stacked|vmap` with a model that cannot
    run its workers that way."""
    how = "batched" if mode == "true" else mode
    return (
        f"train.batched_workers={mode} but model {name} cannot run its workers {how}: "
        f"{reason}; use train.batched_workers=auto (falls back to one by one) or false"
    )
