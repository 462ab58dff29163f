"""The training loop, the same for every algorithm and every worker layout.

Per step: the algorithm plans which local workers compute and on which parameters
(`Algorithm.plan`; lockstep algorithms: all of them, on their own), receives the schedule's lr
multiplier, and each planned worker runs forward and backward on its own next batch into its
row of the flat gradient buffer (`compute.WorkerCompute`); then the algorithm does what it does
between backward and the next forward. Evaluation and the final checkpoint use the algorithm's
consensus model; the test set is split across processes and the sums combined, so evaluation
costs each process 1/P of the test set.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from dpresearch.algorithms.base import Algorithm, StepPlan
from dpresearch.comm.base import Communicator
from dpresearch.comm.ledger import ALGORITHM, EVAL, METRICS
from dpresearch.compute import WorkerCompute, worker_seed
from dpresearch.data.base import Dataset
from dpresearch.optim import make_optimizer
from dpresearch.progress import format_progress, format_setup
from dpresearch.replicas import Replicas
from dpresearch.run_logger import NullLogger, RunLogger
from dpresearch.timing import LoopClock


class InjectedFailure(RuntimeError):
    """Raised by `debug.fail_worker` / `debug.fail_at_step` to test failure handling."""


__all__ = ["InjectedFailure", "Trainer", "worker_seed"]


class Trainer:
    """Builds everything from `cfg` for the workers this process holds and runs the loop.

    algorithm_target / algorithm_kwargs: instantiate the `algorithm` node as another class,
    with extra arguments (the asynchronous server process runs the server half of its
    algorithm, `asynchrony.remote.RemoteServer`)."""

    def __init__(
        self,
        cfg: DictConfig,
        comm: Communicator,
        device: torch.device,
        run_dir: Path | None,
        dataset: Dataset | None = None,
        algorithm_target: str | None = None,
        algorithm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.cfg, self.comm, self.device = cfg, comm, device
        k, tc = cfg.workers, cfg.train
        torch.manual_seed(cfg.seed)
        self.data: Dataset = (
            dataset.to(device) if dataset is not None else instantiate(cfg.data, device=str(device))
        ).hold_out(tc.val_size)
        self.partitioner = self.data.make_partitioner(k, cfg.seed)
        # Batches in one pass of a worker over its shard.
        worker_steps = self.partitioner.samples_per_worker // tc.batch_size
        if worker_steps < 1:
            raise ValueError(
                f"train.batch_size={tc.batch_size} is larger than the "
                f"{self.partitioner.samples_per_worker} examples each of {k} workers holds; "
                "lower train.batch_size or workers"
            )

        torch.manual_seed(cfg.seed)
        model: nn.Module = instantiate(
            cfg.model, num_classes=self.data.num_classes, input_shape=self.data.input_shape
        )
        self.replicas = Replicas(model, comm.num_local, device, tc.channels_last)
        # Replicas built from one seed are identical, but broadcasting worker 0's state makes
        # that true even where initialisation draws differ between processes.
        comm.broadcast(self.replicas.params, src=0, record=False)
        comm.broadcast(self.replicas.buffers, src=0, record=False)
        self.eval_model = copy.deepcopy(model).to(device)

        lr_scale = float(k) if tc.lr_scaling == "linear" else 1.0
        self.optimizers = [make_optimizer(cfg.optimizer, m, lr_scale) for m in self.replicas.models]
        self.base_lr = self.optimizers[0].param_groups[0]["lr"]
        extra = dict(algorithm_kwargs or {})
        if algorithm_target is not None:
            extra["_target_"] = algorithm_target
        self.algorithm: Algorithm = instantiate(
            cfg.algorithm, replicas=self.replicas, comm=comm, optimizers=self.optimizers, **extra
        )
        # One epoch = every worker's shard once: K × worker_steps gradients in all.
        self.gradients_per_step = self.algorithm.gradients_per_step
        self.steps_per_epoch = max(1, round(worker_steps * k / self.gradients_per_step))
        self.total_steps = tc.steps or max(1, math.ceil(tc.epochs * self.steps_per_epoch))
        self.algorithm.set_run_length(self.steps_per_epoch, self.total_steps)
        self.schedule = instantiate(
            cfg.schedule, steps_per_epoch=self.steps_per_epoch, total_steps=self.total_steps
        )
        self.compute = WorkerCompute(
            self.data,
            self.partitioner,
            self.replicas,
            comm.local_workers,
            tc.batch_size,
            worker_steps,
            cfg.seed,
            device,
            tc.channels_last,
            tc.autocast,
            tc.loss_scale,
        )
        resolved = OmegaConf.to_container(cfg, resolve=True)
        self.logger = (
            RunLogger(run_dir, resolved, cfg.logger) if run_dir is not None else NullLogger()
        )
        self._fail_worker, self._fail_at_step = cfg.debug.fail_worker, cfg.debug.fail_at_step
        self._grad_rows = list(self.replicas.grads.unbind(0))
        self.setup = self.algorithm.describe()
        if self.setup and comm.is_main_process and tc.progress:
            print(format_setup(self.setup), flush=True)
        self.comm.ledger.reset()

    # -- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Test (and, with a validation split, validation) loss and accuracy of the consensus
        model; with an algorithm whose workers hold different models, also the mean and the
        minimum of every worker's own test accuracy."""
        params, buffers = self.algorithm.consensus()
        model = self.replicas.load_into(self.eval_model, params, buffers)
        num_processes = self.comm.world_size // self.comm.num_local
        process_index = self.comm.local_workers[0] // self.comm.num_local
        splits = ["test"] + (["val"] if self.data.val_targets is not None else [])
        sums = torch.zeros(self.comm.num_local, 3 * len(splits), dtype=torch.float64,
                           device=self.device)  # fmt: skip
        for i, split in enumerate(splits):
            sums[0, 3 * i : 3 * i + 3] = self._eval_sums(model, process_index, num_processes, split)
        self.comm.all_reduce(sums, op="sum", record=EVAL)
        result = {}
        for i, split in enumerate(splits):
            loss, correct, count = sums[0, 3 * i : 3 * i + 3].tolist()
            result.update({f"{split}/loss": loss / count, f"{split}/acc": correct / count})
        if self.algorithm.evaluates_local_models:
            # Each worker's model lives only where the worker does: it sees the whole test set.
            accs = torch.stack([self._eval_sums(m, 0, 1)[1:] for m in self.replicas.models])
            accs = self.comm.all_gather(accs[:, :1] / accs[:, 1:], record=EVAL)[:, 0]
            result["test/acc_local_mean"] = accs.mean().item()
            result["test/acc_local_min"] = accs.min().item()
        return result

    def _eval_sums(
        self, model: nn.Module, part: int, parts: int, split: str = "test"
    ) -> torch.Tensor:
        """(summed loss, correct, count) of `model` on shard `part` of `parts` of `split`."""
        was_training = model.training
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        batches = self.data.test_batches(self.cfg.train.eval_batch_size, part, parts, split)
        for x, y in batches:
            if self.cfg.train.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            with self.compute.autocast():
                out = model(x).float()
            sums[0] += F.cross_entropy(out, y, reduction="sum").double()
            sums[1] += (out.argmax(1) == y).sum().double()
            sums[2] += y.numel()
        model.train(was_training)
        return sums

    def _bytes_per_worker(self) -> dict[str, float]:
        """`comm/bytes`, `comm/bytes_max`: the mean and the max over all K workers of the
        algorithm's bytes each has sent; `comm/bytes_<purpose>`: the mean over all K workers
        for every other purpose recorded (buffers, eval, metrics, ...). One gather, recorded
        as metrics traffic; every process records the same purposes, so the rows line up."""
        ledger = self.comm.ledger
        purposes = [ALGORITHM] + sorted(p for p in ledger.bytes_by_purpose if p != ALGORITHM)
        mine = torch.tensor(
            [ledger.bytes_of(p) for p in purposes], dtype=torch.float64, device=self.device
        ).T.contiguous()
        every = self.comm.all_gather(mine, record=METRICS)  # [K, purposes]
        mean = every.mean(0).tolist()
        result = {"comm/bytes": mean[0], "comm/bytes_max": every[:, 0].max().item()}
        result.update({f"comm/bytes_{p}": m for p, m in zip(purposes[1:], mean[1:], strict=True)})
        return result

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        tc, comm = self.cfg.train, self.comm
        batch = tc.batch_size
        eval_every = tc.eval_every or self.steps_per_epoch
        window = torch.zeros(comm.num_local, 3, dtype=torch.float64, device=self.device)
        clock = LoopClock(comm.ledger)
        last: dict[str, Any] = {}
        best_acc = 0.0
        self.replicas.train()
        log_every = tc.log_every
        algorithm_metrics: dict[str, Any] = {}
        for step in range(self.total_steps):
            plan = self.algorithm.plan(step)
            multiplier = self.schedule(step)
            self.algorithm.set_lr(multiplier)

            clock.step_begins()
            self.algorithm.before_forward(step)
            self._prepare_rows(plan)
            self.compute.run(plan.workers)
            self._maybe_fail(step)
            self.algorithm.after_backward(step)
            clock.step_ends()

            done = step + 1
            is_last = done == self.total_steps
            if done % log_every == 0 or done % eval_every == 0 or is_last:
                self.compute.drain(window)
                comm.all_reduce(window, op="sum", record=METRICS)
                loss_sum, acc_sum, count = window[0].tolist()
                bytes_sent = self._bytes_per_worker()
                last = {
                    "step": done,
                    "epoch": done / self.steps_per_epoch,
                    "samples": done * self.gradients_per_step * batch,
                    "train/loss": loss_sum / count if count else math.nan,
                    "train/acc": acc_sum / count if count else math.nan,
                    "lr": self.base_lr * multiplier,
                    **bytes_sent,
                    "comm/modeled_s": comm.ledger.modeled_s,
                    **clock.metrics(),
                }
                algorithm_metrics = self.algorithm.metrics()
                last.update(algorithm_metrics)
                if done % eval_every == 0 or is_last:
                    last.update(self.evaluate())
                    best_acc = max(best_acc, last["test/acc"])
                    self.replicas.train()
                self.logger.log(last)
                if tc.progress and comm.is_main_process:
                    print(format_progress(last, self.total_steps), flush=True)

        summary = dict(last)
        summary.update(
            {
                "best/test_acc": best_acc,
                "steps_per_epoch": self.steps_per_epoch,
                "total_steps": self.total_steps,
                "num_params": self.replicas.num_params,
                "comm/bytes_per_epoch": last["comm/bytes"]
                / (self.total_steps / self.steps_per_epoch),
                "comm/op_counts": dict(comm.ledger.op_counts),
                "comm/ops": comm.ledger.op_table(),
                **self._bytes_per_worker(),  # the final evaluation's traffic included
                # an algorithm that accounts its own traffic (asynchronous pushes) keeps it
                **{k: v for k, v in algorithm_metrics.items() if k.startswith("comm/")},
                **self.setup,
                **self.algorithm.summary(),
            }
        )
        if isinstance(self.logger, RunLogger) and tc.save_model:
            torch.save(self.eval_model.state_dict(), self.logger.run_dir / "model_final.pt")
        self.logger.finish(summary)
        return summary

    def _prepare_rows(self, plan: StepPlan) -> None:
        """Load the planned reads into their rows and zero the planned gradient rows."""
        params = self.replicas.params
        for w, source in plan.reads.items():
            params[w].copy_(source)
        if len(plan.workers) == self.replicas.num_local:
            self.replicas.zero_grad()
        else:
            for w in plan.workers:
                self._grad_rows[w].zero_()

    def _maybe_fail(self, step: int) -> None:
        if step == self._fail_at_step and self._fail_worker in self.comm.local_workers:
            raise InjectedFailure(f"injected failure on worker {self._fail_worker} at step {step}")
