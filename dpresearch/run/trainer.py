"""The training loop, the same for every algorithm and every worker layout.

Per step: the algorithm plans which local workers compute and on which parameters
(`Algorithm.plan`; lockstep algorithms: all of them, on their own), receives the schedule's lr
multiplier, and each planned worker runs forward and backward on its own next batch into its
row of the flat gradient buffer (`compute.WorkerCompute`); then the algorithm does what it does
between backward and the next forward. Evaluation and the final checkpoint use the algorithm's
consensus model; the test set is split across processes and the sums combined, so evaluation
costs each process 1/P of the test set.

Ending a run. After each step's backward the processes agree, in one tiny collective (none in
a simulated run), on two flags: a stop request (SIGTERM/SIGINT, `dpresearch.run.stop`) and a
non-finite training loss (`train.on_nonfinite`). A stop finishes the step, writes a final
checkpoint (even with `train.checkpoint_every` off, as Lightning does) and ends with
`status: interrupted`; a non-finite loss under `stop` ends before the step's update with
`status: diverged` and no model written; `skip_step` drops the update and counts it.

Checkpoints (`checkpoint`, `_restore`): every process's replicas (parameters, float and integer
buffers), optimizers, algorithm state (`Algorithm.state_dict`), data cursors and augmentation
generators, RNG streams and ledger, gathered by the main process into one file with the
loop's own position (step, best accuracy, last metrics, loop clock, skipped steps); see
`dpresearch/run/checkpoint.py` for the files. Compressor randomness needs no state: it is seeded
by (seed, worker, chunk, step). A resumed run restores all of it and continues bit for bit.
"""

from __future__ import annotations

import copy
import math
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from dpresearch.algorithms import outer
from dpresearch.algorithms.base import Algorithm, StepPlan
from dpresearch.comm.base import Communicator
from dpresearch.comm.ledger import ALGORITHM, EVAL, METRICS
from dpresearch.data.base import Dataset
from dpresearch.optim import make_optimizer
from dpresearch.replicas import Replicas
from dpresearch.run import stop
from dpresearch.run.checkpoint import (
    FORMAT,
    CheckpointError,
    checkpoint_interval,
    find_resume,
    incompatibility,
    latest_checkpoint,
    load_checkpoint,
    to_cpu,
    write_checkpoint,
)
from dpresearch.run.compute import WorkerCompute, worker_seed
from dpresearch.run.logger import NullLogger, RunLogger
from dpresearch.run.progress import format_progress, format_setup
from dpresearch.run.timing import LoopClock


class InjectedFailure(RuntimeError):
    """Raised by `debug.fail_worker` / `debug.fail_at_step` to test failure handling."""


__all__ = ["InjectedFailure", "Trainer", "worker_seed"]

NONFINITE_MODES = ("stop", "skip_step", "continue")


def rng_state() -> dict[str, Any]:
    """Every global random stream of this process: torch (CPU, and CUDA where initialised),
    numpy, Python."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
        runtime = dict(replicas=self.replicas, comm=comm, optimizers=self.optimizers)
        self.algorithm: Algorithm = outer.wrap(
            cfg, instantiate(cfg.algorithm, **runtime, **extra), **runtime
        )
        # One epoch = every worker's shard once: K × worker_steps gradients in all.
        self.gradients_per_step = self.algorithm.gradients_per_step
        self.steps_per_epoch = max(1, round(worker_steps * k / self.gradients_per_step))
        self.total_steps = tc.steps or max(1, math.ceil(tc.epochs * self.steps_per_epoch))
        self.algorithm.set_run_length(self.steps_per_epoch, self.total_steps)
        self.schedule = instantiate(
            cfg.schedule, steps_per_epoch=self.steps_per_epoch, total_steps=self.total_steps
        )
        self.compute = WorkerCompute.for_run(
            cfg,
            self.data,
            self.partitioner,
            self.replicas,
            comm.local_workers,
            worker_steps,
            device,
        )
        self._fail_worker, self._fail_at_step = cfg.debug.fail_worker, cfg.debug.fail_at_step
        self._grad_rows = list(self.replicas.grads.unbind(0))
        self.setup = self.algorithm.describe()
        if self.setup and comm.is_main_process and tc.progress:
            print(format_setup(self.setup), flush=True)
        self.comm.ledger.reset()

        # Ending and resuming (see the module docstring).
        self.run_dir = run_dir
        self.processes = comm.world_size // comm.num_local
        self.on_nonfinite = tc.on_nonfinite
        if self.on_nonfinite not in NONFINITE_MODES:
            raise ValueError(f"train.on_nonfinite={self.on_nonfinite}")
        # Only the ordinary loop honours stop requests (a server loop beside lean workers,
        # `algorithm_target`, would leave them waiting).
        self.stoppable = algorithm_target is None
        self.checkpoint_every = checkpoint_interval(tc.checkpoint_every, self.steps_per_epoch)
        self.checkpoint_keep = tc.checkpoint_keep
        self.start_step, self.best_acc, self.skipped = 0, 0.0, 0
        self.last: dict[str, Any] = {}
        self.algorithm_metrics: dict[str, Any] = {}
        self.clock = LoopClock(comm.ledger)  # restarted when the loop starts
        self._clock_state: dict[str, float] | None = None
        resumed_at = self._resume(tc.resume) if tc.resume is not None else None
        resolved = OmegaConf.to_container(cfg, resolve=True)
        self.logger = (
            RunLogger(run_dir, resolved, cfg.logger, resume_at=resumed_at)
            if run_dir is not None
            else NullLogger()
        )
        if resumed_at and comm.is_main_process and tc.progress:
            print(f"resumed from step {resumed_at} of {self.total_steps}", flush=True)

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
        """Train from the start (or the resumed step) to `total_steps`, or until a stop
        request or a non-finite loss ends the run; returns the summary (with `status`)."""
        if not self.stoppable:
            return self._loop()
        with stop.handling():
            return self._loop()

    def _loop(self) -> dict[str, Any]:
        tc, comm = self.cfg.train, self.comm
        batch = tc.batch_size
        eval_every = tc.eval_every or self.steps_per_epoch
        window = torch.zeros(comm.num_local, 3, dtype=torch.float64, device=self.device)
        clock = self.clock = LoopClock(comm.ledger)
        if self._clock_state is not None:
            clock.load_state_dict(self._clock_state)
        self.replicas.train()
        log_every = tc.log_every
        for step in range(self.start_step, self.total_steps):
            plan = self.algorithm.plan(step)
            multiplier = self.schedule(step)
            self.algorithm.set_lr(multiplier)

            clock.step_begins()
            self.algorithm.before_forward(step)
            self._prepare_rows(plan)
            self.compute.run(plan.workers)
            self._maybe_fail(step)
            signum, nonfinite = self._agree(plan)
            if nonfinite:
                if self.on_nonfinite == "stop":
                    self.algorithm.drop_step(step)
                    clock.step_ends()
                    return self._end_diverged(step + 1)
                self.algorithm.drop_step(step)
                self.compute.forget_last(plan.workers)
                self.skipped += 1
            else:
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
                if self.on_nonfinite == "skip_step":
                    last["train/skipped_steps"] = self.skipped
                self.algorithm_metrics = self.algorithm.metrics()
                last.update(self.algorithm_metrics)
                if done % eval_every == 0 or is_last:
                    last.update(self.evaluate())
                    self.best_acc = max(self.best_acc, last["test/acc"])
                    self.replicas.train()
                self.last = last
                self.logger.log(last)
                if tc.progress and comm.is_main_process:
                    print(format_progress(last, self.total_steps), flush=True)
            if signum and not is_last:  # (on the last step: finishing is the stop)
                return self._end_interrupted(done, signum)
            if self.checkpoint_every and done % self.checkpoint_every == 0 and not is_last:
                self.checkpoint(done)
        return self._end_finished()

    def _end_finished(self) -> dict[str, Any]:
        comm, last = self.comm, self.last
        summary = dict(last)
        summary.update(
            {
                "status": "finished",
                "best/test_acc": self.best_acc,
                "steps_per_epoch": self.steps_per_epoch,
                "total_steps": self.total_steps,
                "num_params": self.replicas.num_params,
                "comm/bytes_per_epoch": last["comm/bytes"]
                / (self.total_steps / self.steps_per_epoch),
                "comm/op_counts": dict(comm.ledger.op_counts),
                "comm/ops": comm.ledger.op_table(),
                **self._bytes_per_worker(),  # the final evaluation's traffic included
                # an algorithm that accounts its own traffic (asynchronous pushes) keeps it
                **{k: v for k, v in self.algorithm_metrics.items() if k.startswith("comm/")},
                **self.setup,
                **self.algorithm.summary(),
            }
        )
        if self.on_nonfinite == "skip_step":
            summary["train/skipped_steps"] = self.skipped
        if isinstance(self.logger, RunLogger) and self.cfg.train.save_model:
            torch.save(self.eval_model.state_dict(), self.logger.run_dir / "model_final.pt")
        self.logger.finish(summary)
        return summary

    def _end_interrupted(self, done: int, signum: int) -> dict[str, Any]:
        """A stop request honoured after step `done`: final checkpoint, `status: interrupted`
        (the caller prints the one line and exits 128 + signal)."""
        path = self.checkpoint(done) if self.algorithm.checkpointable else None
        return self._end_early(
            "interrupted",
            interrupted_at_step=done,
            signal=signal.Signals(signum).name,
            exit_code=128 + signum,
            checkpoint=str(path) if path is not None else None,
        )

    def _end_diverged(self, at_step: int) -> dict[str, Any]:
        """A non-finite loss at step `at_step` (1-based, as metrics count) under
        `on_nonfinite=stop`: `status: diverged`, no model and no checkpoint written (the last
        finite checkpoint stays `latest`)."""
        kept = latest_checkpoint(self.run_dir) if self.run_dir is not None else None
        return self._end_early(
            "diverged",
            diverged_at_step=at_step,
            lr=self.base_lr * self.schedule(at_step - 1),
            last_checkpoint=str(kept) if kept is not None else None,
        )

    def _end_early(self, status: str, **facts: Any) -> dict[str, Any]:
        """The summary of a run that ended before its last step: the last logged metrics,
        `status` and `facts`; written by the main process."""
        summary = {
            **self.last,
            "status": status,
            **facts,
            "total_steps": self.total_steps,
            "steps_per_epoch": self.steps_per_epoch,
            "best/test_acc": self.best_acc,
        }
        if self.on_nonfinite == "skip_step":
            summary["train/skipped_steps"] = self.skipped
        self.logger.finish(summary)
        return summary

    def _agree(self, plan: StepPlan) -> tuple[int, bool]:
        """(stop signal or 0, non-finite loss) of this step, the same on every process: one
        3-number allreduce when there are several processes, none in a simulated run."""
        signum = (stop.requested() or 0) if self.stoppable else 0
        nonfinite = self.on_nonfinite != "continue" and not self.compute.last_losses_finite(
            plan.workers
        )
        if self.processes > 1:
            flags = torch.tensor(
                [[signum == signal.SIGINT, signum not in (0, signal.SIGINT), nonfinite]],
                dtype=torch.float32,
                device=self.device,
            )
            self.comm.all_reduce(flags, op="sum", record=False)
            interrupt, terminate, bad = flags[0].tolist()
            signum = signal.SIGINT if interrupt else signal.SIGTERM if terminate else 0
            nonfinite = bad > 0
        return int(signum), nonfinite

    # -- checkpoints --------------------------------------------------------------------------
    def _process_state(self) -> dict[str, Any]:
        """This process's part of a checkpoint (live tensors: read between steps)."""
        return {
            "params": self.replicas.params,
            "buffers": self.replicas.buffers,
            "int_buffers": [
                [b for b in m.buffers() if not b.is_floating_point()] for m in self.replicas.models
            ],
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "algorithm": self.algorithm.state_dict(),
            "compute": self.compute.state_dict(),
            "ledger": self.comm.ledger.state_dict(),
            "rng": rng_state(),
        }

    def checkpoint(self, done: int) -> Path | None:
        """Write a checkpoint taken after step `done` (a collective: every process calls it;
        the main process gathers every process's state and writes one file); returns its path
        on the main process, None elsewhere."""
        state = self._process_state()
        every = self.comm.gather_objects(to_cpu(state) if self.processes > 1 else state)
        if self.run_dir is None or every is None:
            return None
        return write_checkpoint(
            self.run_dir,
            done,
            {
                "format": FORMAT,
                "step": done,
                "workers": self.cfg.workers,
                "processes": self.processes,
                "algorithm": outer.algorithm_name(self.cfg),
                "num_params": self.replicas.num_params,
                "loop": {
                    "best_acc": self.best_acc,
                    "last": self.last,
                    "algorithm_metrics": self.algorithm_metrics,
                    "clock": self.clock.state_dict(),
                    "skipped": self.skipped,
                },
                "states": every,
            },
            self.checkpoint_keep,
        )

    def _resume(self, resume: str) -> int:
        """Find and load `train.resume`'s checkpoint (main process), hand every process its
        state, restore it; returns the step the run continues after (0: nothing to resume,
        a fresh start)."""
        payload: list[Any] | None = None
        if self.comm.is_main_process:
            try:
                path = find_resume(resume, self.run_dir)
                file = load_checkpoint(path) if path is not None else None
                problem = self._incompatible(file, path) if file is not None else None
            except CheckpointError as exc:
                problem, file = str(exc), None
            if problem is not None:
                payload = [("error", problem)] * self.processes
            elif file is None:
                payload = [None] * self.processes
            else:
                loop = dict(file["loop"], step=file["step"])
                payload = [("state", loop, st) for st in file["states"]]
        mine = self.comm.scatter_objects(payload)
        if mine is None:
            return 0
        if mine[0] == "error":
            from dpresearch.config.validate import ConfigError

            raise ConfigError(mine[1])
        _, loop, state = mine
        self._restore(state)
        self.start_step = loop["step"]
        self.best_acc, self.last = loop["best_acc"], loop["last"]
        self.algorithm_metrics, self.skipped = loop["algorithm_metrics"], loop["skipped"]
        self._clock_state = loop["clock"]
        return self.start_step

    def _incompatible(self, file: dict[str, Any], path: Path) -> str | None:
        """Why checkpoint `file` cannot continue this run (None: it can)."""
        return incompatibility(
            file,
            path,
            {
                "workers": self.cfg.workers,
                "processes": self.processes,
                "algorithm": outer.algorithm_name(self.cfg),
                "num_params": self.replicas.num_params,
            },
        )

    def _restore(self, state: dict[str, Any]) -> None:
        """Put this process's part of a checkpoint back (see `_process_state`)."""
        with torch.no_grad():
            self.replicas.params.copy_(state["params"])
            self.replicas.buffers.copy_(state["buffers"])
            for model, saved in zip(self.replicas.models, state["int_buffers"], strict=True):
                ints = [b for b in model.buffers() if not b.is_floating_point()]
                for dst, src in zip(ints, saved, strict=True):
                    dst.copy_(src)
        for opt, saved in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(saved)
        self.algorithm.load_state_dict(state["algorithm"])
        self.compute.load_state_dict(state["compute"])
        self.comm.ledger.load_state_dict(state["ledger"])
        set_rng_state(state["rng"])

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
