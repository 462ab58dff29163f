"""Forward and backward of local workers, each on its own next batch.

Each local worker has a data cursor: its n-th computation takes batch n of its own sequence —
epoch n // steps_per_epoch, position n % steps_per_epoch within the indices the partitioner
gives it for that epoch (a pure function of seed, worker and epoch) — and draws augmentation
from its own generator. When every worker computes every step (lockstep algorithms) every
cursor equals the global step. An asynchronous worker that computes more often than another
simply walks its own sequence faster.

Several rows computed in one step run either one by one (the loop) or as one batched
computation over their stacked parameter rows (`batched="stacked"|"vmap"`, `run/stacked.py`,
`run/batched.py`): the same batches, cursors, generators, statistics and gradient rows either way.

Computing ahead (an event simulator's workers in flight, `StepPlan.ahead`): a row whose
parameters and next batch are fixed until it is planned can have its gradient computed early,
in the same batched computation as the planned rows. Its gradient waits in its row and its
batch's loss and accuracy are held back; when a later step plans the row, nothing is computed
for it and its statistics count from that step (logged in that step's window, checked there
for non-finite values) — the same gradients, statistics and windows as computing it then.

Dropout on the `worker` stream (`models/dropout.py`): worker w's n-th batch draws its masks
from a generator seeded with `dropout_seed(seed, w, n)`, made for that forward on the compute
device — a pure function of the seed, the global worker id and its cursor, so the loop, one
process per worker and stacked rows draw the same masks, and a resumed run (cursors restored)
draws what the uninterrupted one drew, with nothing more in the checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from dpresearch.data.base import Dataset
from dpresearch.data.partition import Partitioner
from dpresearch.models.dropout import drawing_from, draws_worker_stream
from dpresearch.replicas import Replicas
from dpresearch.run.batched import workers_class

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NO_AUTOCAST = contextlib.nullcontext()  # reusable: building one per batch costs more than this
# Pending batches' statistics are reduced together once there are this many batches or their
# outputs hold this many elements (which bounds the memory they keep).
FOLD_EVERY, FOLD_NUMEL = 256, 1 << 22


def worker_seed(seed: int, worker: int) -> int:
    """Seed of worker `worker`'s own generator (augmentation, sampling in compressors)."""
    return (seed * 1_000_003 + 7919 * (worker + 1)) % (2**63 - 1)


def dropout_seed(seed: int, worker: int, batch: int) -> int:
    """Seed of worker `worker`'s `worker`-stream dropout generator for its `batch`-th batch
    (0-based cursor): a hash of the three, so that it meets no other generator's seed (an
    affine rule like `worker_seed`'s would give worker 0's batch n worker n's augmentation
    seed)."""
    text = f"dropout {seed} {worker} {batch}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


class WorkerCompute:
    """Runs forward/backward for local rows of `replicas` into their rows of `replicas.grads`.

    workers: the global id of each local row (the partitioner's worker index; None: a row that
    never computes, e.g. a parameter server's).
    steps_per_epoch: batches in one pass of a worker over its shard.
    autocast: None, "bf16" or "fp16"; with fp16 the loss is multiplied by `loss_scale` and the
    computed gradient rows divided by it again.
    batched: compute several rows at once as one computation, `"stacked"` (`StackedWorkers`)
    or `"vmap"` (`BatchedWorkers`), None one by one (the caller has checked the model can,
    `batched.decide`); `mode` says how, for the record.
    """

    def __init__(
        self,
        data: Dataset,
        partitioner: Partitioner,
        replicas: Replicas,
        workers: Sequence[int | None],
        batch_size: int,
        steps_per_epoch: int,
        seed: int,
        device: torch.device,
        channels_last: bool = False,
        autocast: str | None = None,
        loss_scale: float = 1.0,
        batched: str | None = None,
        mode: str = "",
    ) -> None:
        self.data, self.partitioner, self.replicas = data, partitioner, replicas
        self._grad_rows = replicas.grads.unbind(0)  # (`grads[w]` is a dispatched op per use)
        self.workers = list(workers)
        self.batch_size, self.steps_per_epoch = batch_size, steps_per_epoch
        self.device, self.channels_last = device, channels_last
        self.autocast_dtype = AUTOCAST_DTYPES.get(autocast or "")
        self.loss_scale = float(loss_scale) if autocast == "fp16" else 1.0
        self.generators = [
            torch.Generator().manual_seed(worker_seed(seed, -1 if w is None else w))
            for w in workers
        ]
        self.cursors = [0] * len(self.workers)
        self._seed = seed
        self._dropout = draws_worker_stream(replicas.models[0])
        self._epochs = [-1] * len(self.workers)
        # Per row: its current epoch's batches of indices, on the data's device.
        self._batches: list[Sequence[Tensor]] = [()] * len(self.workers)
        # Batches not yet reduced, in order, detached: (row, loss, outputs [B, ...], targets
        # [B]) for one row's batch, (rows, losses [S], outputs [S, B, ...], targets [S, B]) for
        # a batched call of S rows (one entry: no per-row work per step); and their outputs'
        # elements. Per row, since the last `drain`: [summed loss, summed accuracy, batches] of
        # those reduced.
        self._pending: list[tuple[int | tuple[int, ...], Tensor, Tensor, Tensor]] = []
        self._pending_numel = 0
        self._sums: list[list[float]] = [[0.0, 0.0, 0] for _ in self.workers]
        # row → its batch's loss in the last `run`: (loss, None) or (losses, its position)
        self._latest: dict[int, tuple[Tensor, int | None]] = {}
        # Rows computed ahead, not yet planned: row → (loss, outputs, targets) of its batch,
        # and whether its loss is finite (checked once per batched call, not once per push).
        self._held: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self._held_finite: dict[int, bool] = {}
        self._finite: dict[int, bool] = {}  # rows of the last `run` whose finiteness is known
        several = batched is not None and len(self.workers) > 1
        self.batched = workers_class(batched)(replicas, data.loss) if several else None
        self.mode = mode

    @classmethod
    def for_run(
        cls,
        cfg,
        data: Dataset,
        partitioner: Partitioner,
        replicas: Replicas,
        workers: Sequence[int | None],
        steps_per_epoch: int,
        device: torch.device,
    ) -> WorkerCompute:
        """The compute of `workers` as a run's config (`cfg.train`, `cfg.seed`) sets it up."""
        from dpresearch.run.batched import decide

        tc = cfg.train
        batched, mode = decide(cfg, data, len(workers), device)
        return cls(
            data,
            partitioner,
            replicas,
            workers,
            tc.batch_size,
            steps_per_epoch,
            cfg.seed,
            device,
            tc.channels_last,
            tc.autocast,
            tc.loss_scale,
            batched,
            mode,
        )

    def describe(self) -> dict[str, str | int]:
        """How the local workers compute — several one by one or batched, and this process's
        intra-op threads (printed at the start, kept in summary.json)."""
        facts: dict[str, str | int] = {"workers_compute": self.mode} if self.mode else {}
        return {**facts, "intra_op_threads": torch.get_num_threads()}

    def autocast(self):
        """Mixed precision for the forward pass (and, through autograd, the backward); without
        it a null context (building a disabled `torch.autocast` costs more than a small
        model's loss)."""
        if self.autocast_dtype is None:
            return NO_AUTOCAST
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def next_indices(self, row: int) -> Tensor:
        """The training indices of local row `row`'s next batch; advances its cursor."""
        epoch, pos = divmod(self.cursors[row], self.steps_per_epoch)
        self.cursors[row] += 1
        if self._epochs[row] != epoch:
            self._batches[row] = self.partitioner.epoch_batches(
                self.workers[row],
                epoch,
                self.batch_size,
                self.steps_per_epoch,
                self.data.train_targets.device,
            )
            self._epochs[row] = epoch
        return self._batches[row][pos]

    def dropout_generators(self, rows: Sequence[int]) -> list[torch.Generator] | None:
        """Each row's dropout generator for its next batch (before `next_batch` advances its
        cursor); None when the model draws no `worker`-stream dropout."""
        if not self._dropout:
            return None
        return [
            torch.Generator(self.device).manual_seed(
                dropout_seed(self._seed, self.workers[w], self.cursors[w])
            )
            for w in rows
        ]

    def next_batch(self, row: int) -> tuple[Tensor, Tensor]:
        """Inputs and targets of local row `row`'s next batch; advances its cursor."""
        x, y = self.data.train_batch(self.next_indices(row), self.generators[row])
        return self.laid_out(x), y

    def laid_out(self, x: Tensor) -> Tensor:
        """A batch `x` in the memory layout the models take: images channels-last where
        `train.channels_last` asks for it (evaluation batches too)."""
        if self.channels_last and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def next_batches(self, rows: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Inputs `[S, B, ...]` and targets `[S, B]` of each row's next batch (the batches
        `next_batch` would give, gathered and transformed together); advances the cursors."""
        x, y = self.data.train_batches(
            [self.next_indices(w) for w in rows], [self.generators[w] for w in rows]
        )
        if self.channels_last and x.dim() == 5:
            # each row's batch channels-last, as the loop's
            x = x.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)
        return x, y

    def run(
        self,
        rows: Sequence[int],
        ahead: Sequence[int] = (),
        models: Mapping[int, nn.Module] | None = None,
    ) -> None:
        """Forward/backward of each row in `rows` (ascending) on its next batch, on the
        parameters its replica holds; each row's gradient is written into its row of
        `replicas.grads` (what was there is overwritten; other rows are left alone). Each
        batch's loss and accuracy are kept for `drain`.

        A row computed ahead earlier is not computed again: its held gradient is its
        result, its held statistics join this step's. `ahead` (`StepPlan.ahead`, rows not in
        `rows`): batched, when some row of `rows` is computed, the rows of `ahead` not yet
        held are computed in the same call and held (the loop ignores `ahead`). `models`
        (`StepPlan.models`): rows that compute with another module than their replica (one
        at a time), their gradients still landing in their rows."""
        # Reduced before this step's batches join, never after: until the next `run`, this
        # step's statistics stay pending (`last_losses_finite`, `forget_last` read them).
        if len(self._pending) >= FOLD_EVERY or self._pending_numel >= FOLD_NUMEL:
            self._fold()
        self._latest, self._finite = {}, {}
        held = self._held
        if held:
            for w in [w for w in rows if w in held]:
                loss, out, y = held.pop(w)
                self._finite[w] = self._held_finite.pop(w)
                self._add_pending(w, loss, out, y)
            rows = [w for w in rows if w not in self._latest]
        if not rows:
            return
        hold: Sequence[int] = ()
        if self.batched is not None and ahead:
            hold = [w for w in ahead if w not in held and w not in rows]
            if hold:
                rows = sorted([*rows, *hold])
        if self.batched is not None and len(rows) > 1 and not models:
            self._run_batched(rows, set(hold))
        else:
            self._run_loop(rows, models)
        if self.loss_scale != 1.0:
            grads = self.replicas.grads
            if len(rows) == grads.shape[0]:
                grads.div_(self.loss_scale)
            else:
                for w in rows:
                    grads[w].div_(self.loss_scale)

    def holds(self, row: int) -> bool:
        """Whether `row`'s next gradient was computed ahead and waits in its row."""
        return row in self._held

    def _run_loop(self, rows: Sequence[int], instead: Mapping[int, nn.Module] | None) -> None:
        models, grads = self.replicas.models, self.replicas.grads
        if len(rows) == grads.shape[0]:
            grads.zero_()
        else:
            for w in rows:
                self._grad_rows[w].zero_()
        autocast = self.autocast()
        for w in rows:
            generators = self.dropout_generators([w]) if self._dropout else None
            x, y = self.next_batch(w)
            # (entering `drawing_from` costs more than a small model's loss: only with dropout)
            with autocast, drawing_from(generators) if generators else NO_AUTOCAST:
                out = (instead.get(w, models[w]) if instead else models[w])(x)
                loss = self.data.loss(out, y)
            # (`torch.autograd.backward`: what `Tensor.backward` calls, one layer less)
            torch.autograd.backward(loss * self.loss_scale if self.loss_scale != 1.0 else loss)
            # Per batch as few small ops as possible: the statistics are computed for many
            # batches at once in `_fold`.
            self._add_pending(w, loss.detach(), out.detach(), y)

    def _run_batched(self, rows: Sequence[int], hold: set[int]) -> None:
        """`rows` as one batched computation; the statistics of those in `hold` held back."""
        assert self.batched is not None
        generators = self.dropout_generators(rows)
        x, y = self.next_batches(rows)
        with drawing_from(generators):
            losses, out = self.batched.run(rows, x, y, self.autocast(), self.loss_scale)
        if not hold:
            self._add_pending(tuple(rows), losses, out, y)
            return
        finite = losses.isfinite().tolist()
        # (one unbind per tensor: three dispatched ops per call, not three per row)
        each = zip(rows, finite, losses.unbind(), out.unbind(), y.unbind(), strict=True)
        for w, ok, loss, row_out, row_y in each:
            if w in hold:
                self._held[w] = (loss, row_out, row_y)
                self._held_finite[w] = ok
            else:
                self._finite[w] = ok
                self._add_pending(w, loss, row_out, row_y)

    def _add_pending(
        self, rows: int | tuple[int, ...], losses: Tensor, out: Tensor, y: Tensor
    ) -> None:
        """Keep one computation's batch statistics for `_fold` (one row: its loss, outputs,
        targets; a tuple of S rows: `[S]`, `[S, B, ...]`, `[S, B]`); they are the rows' latest."""
        if isinstance(rows, int):
            self._latest[rows] = (losses, None)
        else:
            for i, w in enumerate(rows):
                self._latest[w] = (losses, i)
        self._pending.append((rows, losses, out, y))
        self._pending_numel += out.numel()

    def last_losses_finite(self, rows: Sequence[int]) -> bool:
        """Whether the loss of each row's batch in the last `run` is finite (one host sync,
        none where a batched call computing ahead checked it)."""
        if len(rows) == 1 and not self._finite:  # one row computed alone (an event's)
            latest = self._latest.get(rows[0])
            if latest is None or latest[1] is None:  # (not computed / its own batch's loss)
                return latest is None or math.isfinite(latest[0].item())
        if not all(self._finite.get(w, True) for w in rows):
            return False
        positions: dict[int, tuple[Tensor, list[int]]] = {}
        for w in rows:
            if w in self._latest and w not in self._finite:
                losses, i = self._latest[w]
                positions.setdefault(id(losses), (losses, []))[1].append(-1 if i is None else i)
        checked = [
            losses.view(-1) if losses.dim() == 0 or len(at) == losses.shape[0] else losses[at]
            for losses, at in positions.values()
        ]
        if len(checked) == 1 and checked[0].numel() == 1:
            return math.isfinite(checked[0].item())  # (one dispatch: 20× cheaper on a CPU)
        return bool(torch.cat(checked).isfinite().all()) if checked else True

    def forget_last(self, rows: Sequence[int]) -> None:
        """Drop each row's latest batch statistics (a skipped step is not averaged in)."""
        pending = self._pending
        for w in rows:
            for i in range(len(pending) - 1, -1, -1):
                entry_rows, losses, out, y = pending[i]
                if entry_rows != w and (isinstance(entry_rows, int) or w not in entry_rows):
                    continue
                self._pending_numel -= out.numel()
                keep = (
                    []
                    if isinstance(entry_rows, int)
                    else [j for j, r in enumerate(entry_rows) if r != w]
                )
                if keep:
                    kept = (tuple(entry_rows[j] for j in keep), losses[keep], out[keep], y[keep])
                    pending[i] = kept
                    self._pending_numel += kept[2].numel()
                else:
                    pending.pop(i)
                break

    def state_dict(self) -> dict:
        """Data cursors, augmentation generators and the undrained batch statistics: the
        partitioner's order is a pure function of (seed, worker, epoch), so the cursors place
        every worker exactly in its sequence. The pending batches are reduced first (the sums
        are the same whenever they are reduced: batch after batch, in float64). Rows computed
        ahead keep their gradients (copied out of their rows) and their batches' statistics,
        so a resumed run pushes exactly what was computed."""
        self._fold()
        rows = sorted(self._held)
        index = torch.tensor(rows, dtype=torch.long, device=self.replicas.grads.device)
        return {
            "cursors": list(self.cursors),
            "generators": [g.get_state() for g in self.generators],
            "sums": [list(s) for s in self._sums],
            "held_rows": rows,
            "held_grads": self.replicas.grads.index_select(0, index),
            "held_stats": [self._held[w] for w in rows],
        }

    def load_state_dict(self, state: dict) -> None:
        self.cursors = list(state["cursors"])
        for g, s in zip(self.generators, state["generators"], strict=True):
            g.set_state(s)
        self._epochs = [-1] * len(self.workers)
        self._pending, self._pending_numel, self._latest = [], 0, {}
        self._sums = [list(s) for s in state["sums"]]
        rows = [int(w) for w in state.get("held_rows", [])]
        if rows:
            index = torch.tensor(rows, dtype=torch.long, device=self.replicas.grads.device)
            self.replicas.grads.index_copy_(0, index, state["held_grads"].to(index.device))
        self._held = {w: tuple(s) for w, s in zip(rows, state.get("held_stats", []), strict=True)}
        self._held_finite = {w: bool(s[0].isfinite()) for w, s in self._held.items()}
        self._finite = {}

    def drain(self, window: Tensor) -> None:
        """Write into the float64 `window` ([W, 3]) each row's summed batch loss, summed batch
        accuracy and batch count since the last call (sums in float64, batch after batch), and
        start anew."""
        self._fold()
        rows = [[s[0], s[1], float(s[2])] for s in self._sums]
        window.copy_(torch.tensor(rows, dtype=torch.float64))
        self._sums = [[0.0, 0.0, 0] for _ in self.workers]

    def running_loss(self) -> float:
        """The mean batch loss of this process's rows since the last `drain` (nan before any
        batch), the sums left to `drain` (a progress line between logged rows: folding early
        adds the same batches in the same order)."""
        self._fold()
        count = sum(s[2] for s in self._sums)
        return sum(s[0] for s in self._sums) / count if count else math.nan

    def _fold(self) -> None:
        """Reduce the pending batches into their rows' sums (float64, batch after batch)."""
        pending = self._pending
        if not pending:
            return
        # Reduced together — one-row batches first, then batched calls — and added to the rows'
        # sums in the order they were computed.
        singles = [p for p in pending if isinstance(p[0], int)]
        calls = [p for p in pending if not isinstance(p[0], int)]
        loss_parts = [torch.stack([p[1] for p in singles])] if singles else []
        losses = torch.cat(loss_parts + [p[1] for p in calls]).double().tolist()
        sizes = [p[3].shape[0] for p in singles] + [p[3].shape[1] for p in calls for _ in p[0]]
        hits = self.data.hits(
            torch.cat([p[2] for p in singles] + [p[2].flatten(0, 1) for p in calls]),
            torch.cat([p[3] for p in singles] + [p[3].flatten(0, 1) for p in calls]),
        )
        if min(sizes) == max(sizes):
            correct = hits.view(len(sizes), sizes[0]).sum(1).tolist()
        else:
            correct = [int(h.sum()) for h in hits.split(sizes)]
        at, single, call = [], 0, len(singles)
        for p in pending:
            if isinstance(p[0], int):
                at.append((p[0], single))
                single += 1
            else:
                at.extend((w, call + j) for j, w in enumerate(p[0]))
                call += len(p[0])
        for row, i in at:
            loss, right, n = losses[i], correct[i], sizes[i]
            sums = self._sums[row]
            sums[0] += loss
            sums[1] += right / n
            sums[2] += 1
        pending.clear()
        self._pending_numel = 0
