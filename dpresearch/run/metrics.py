"""The metrics a run logs: at every log step a row (training loss and accuracy over the window,
with `train.grad_clip` the mean pre-clip gradient norm over it, lr, bytes per worker, modeled
communication time, the loop clock, the algorithm's own metrics, and at evaluation points the
evaluation), written by the run's logger and printed as the progress line; and the bytes every
worker sent, per purpose."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from dpresearch.algorithms.base import Verdict
from dpresearch.comm.ledger import ALGORITHM, METRICS
from dpresearch.run.build import Run
from dpresearch.run.evaluation import Evaluator
from dpresearch.run.logger import NullLogger, RunLogger
from dpresearch.run.loop import Hook, LoopState
from dpresearch.run.progress import Pacer, format_progress


def bytes_per_worker(run: Run) -> dict[str, float]:
    """`comm/bytes`, `comm/bytes_max`: the mean and the max over all K workers of the
    algorithm's bytes each has sent; `comm/bytes_<purpose>`: the mean over all K workers for
    every other purpose recorded (buffers, eval, metrics, ...).

    Lockstep: one gather of every process's ledger, recorded as metrics traffic; every process
    records the same purposes, so the rows line up. Otherwise (the main process of an
    asynchronous run, alone): its own workers' sends and what it heard from the others."""
    ledger, comm = run.ledger, run.comm
    if run.lockstep:
        purposes = [ALGORITHM] + sorted(p for p in ledger.bytes_by_purpose if p != ALGORITHM)
        mine = torch.tensor(
            [ledger.bytes_of(p) for p in purposes], dtype=torch.float64, device=run.device
        ).T.contiguous()
        every = comm.all_gather(mine, record=METRICS)  # [K, purposes]
    else:
        purposes = [ALGORITHM] + sorted({*ledger.bytes_by_purpose, *ledger.heard} - {ALGORITHM})
        every = torch.tensor(
            [[_known_bytes(run, w, p) for p in purposes] for w in range(comm.num_workers)],
            dtype=torch.float64,
        )
    mean = every.mean(0).tolist()
    result = {"comm/bytes": mean[0], "comm/bytes_max": every[:, 0].max().item()}
    result.update({f"comm/bytes_{p}": m for p, m in zip(purposes[1:], mean[1:], strict=True)})
    return result


def token_metrics(run: Run, row: dict[str, Any]) -> dict[str, float]:
    """For data made of tokens: `tokens` (trained on so far, all workers), `tokens_per_s`
    (over the steps' own time: compute and exposed communication) and `comm/bytes_per_token`
    (the algorithm's bytes a worker sent per token it trained on); {} otherwise."""
    per_example = run.data.tokens_per_example
    if not per_example:
        return {}
    tokens = row["samples"] * per_example
    step_s = row["time/compute_s"] + row["time/comm_s"]
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / step_s if step_s > 0 else math.nan,
        "comm/bytes_per_token": row["comm/bytes"] * run.comm.num_workers / tokens,
    }


def _known_bytes(run: Run, worker: int, purpose: str) -> int:
    """Bytes worker `worker` sent for `purpose`, as this process knows them: its own
    workers' from the ledger's rows, the others' as heard."""
    comm, ledger = run.comm, run.ledger
    endpoint = worker + comm.first_worker
    if endpoint in comm.local_workers:
        return ledger.bytes_of(purpose)[comm.local_workers.index(endpoint)]
    return ledger.heard.get(purpose, {}).get(endpoint, 0)


class MetricsLog(Hook):
    """Logs a metrics row every `train.log_every` steps, at every evaluation point
    (`train.eval_every`, default: every epoch end) and at the last step; evaluates at the
    evaluation points (keeping the best test accuracy in the loop state). In a lockstep run
    every process takes part; otherwise only the main process has this hook."""

    def __init__(
        self, run: Run, state: LoopState, logger: RunLogger | NullLogger, progress: bool
    ) -> None:
        tc = run.cfg.train
        self.run, self.state, self.logger = run, state, logger
        self.evaluate = Evaluator(run)
        self.log_every = tc.log_every
        self.eval_every = tc.eval_every or run.steps_per_epoch
        self.progress = progress and run.comm.is_main_process
        self.pacer = Pacer() if self.progress else None
        self.counts_skipped = tc.on_nonfinite == "skip_step"
        # per local row: summed loss, accuracy, batches; with clipping, summed pre-clip
        # gradient norms and their count (`grad_clip.GradClip`): one allreduce for all
        columns = 5 if run.clip.active else 3
        self.window = torch.zeros(
            run.comm.num_local, columns, dtype=torch.float64, device=run.device
        )

    def _between_rows(self, done: int) -> dict[str, Any]:
        """What a progress line between logged rows shows, read without a collective or a
        logged byte: the training loss of this process's workers since the last row, lr,
        modeled comm time, wall time and throughput."""
        run = self.run
        samples = done * run.gradients_per_step * run.cfg.train.batch_size
        row = {
            "step": done,
            "epoch": done / run.steps_per_epoch,
            "samples": samples,
            "train/loss": run.compute.running_loss(),
            "lr": run.base_lr * run.schedule(done - 1),
            "comm/modeled_s": run.ledger.modeled_s,
            "time/wall_s": time.perf_counter() - self.state.clock.start,
        }
        if run.data.tokens_per_example:
            row["tokens"] = samples * run.data.tokens_per_example
        return row

    def after_step(self, done: int, verdict: Verdict) -> None:
        run = self.run
        evaluates = done % self.eval_every == 0 or verdict.finished
        if not (evaluates or done % self.log_every == 0):
            if self.pacer is not None and self.pacer.due():
                print(format_progress(self._between_rows(done), run.total_steps), flush=True)
                self.pacer.printed()
            return
        state = self.state
        clips = run.clip.active
        run.compute.drain(self.window[:, :3] if clips else self.window)
        if clips:
            run.clip.drain(self.window[:, 3:])
        if run.lockstep:
            run.comm.all_reduce(self.window, op="sum", record=METRICS)
        loss_sum, acc_sum, count, *norms = self.window[0].tolist()
        row: dict[str, Any] = {
            "step": done,
            "epoch": done / run.steps_per_epoch,
            "samples": done * run.gradients_per_step * run.cfg.train.batch_size,
            "train/loss": loss_sum / count if count else math.nan,
            **(
                {"train/acc": acc_sum / count if count else math.nan}
                if run.data.classification
                else {}
            ),
            **({"train/grad_norm": norms[0] / norms[1] if norms[1] else math.nan} if clips else {}),
            "lr": run.base_lr * run.schedule(done - 1),
            **bytes_per_worker(run),
            "comm/modeled_s": run.ledger.modeled_s,
            **state.clock.metrics(),
        }
        row.update(token_metrics(run, row))
        if self.counts_skipped:
            row["train/skipped_steps"] = state.skipped
        state.algorithm_metrics = run.algorithm.metrics()
        row.update(state.algorithm_metrics)
        row["time/modeled_s"] = run.modeled.seconds(state.algorithm_metrics)
        row.update(run.modeled.scenario_seconds())
        if evaluates:
            row.update(self.evaluate())
            if "test/acc" in row:
                state.best_acc = max(state.best_acc, row["test/acc"])
        state.last = row
        self.logger.log(row)
        if self.pacer is not None:
            print(format_progress(row, run.total_steps), flush=True)
            self.pacer.printed()
