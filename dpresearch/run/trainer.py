"""A run in this process, end to end (`train`: its communicator and the rest built from the
configuration by `build`): build it (`build.build_run`), resume it if asked
(`checkpoint_state.Checkpoints`), open its writer (`logger.RunLogger`, main process only), run the
loop (`loop.run_loop`) with its hooks — fault injection, metrics and evaluation
(`metrics.MetricsLog`), periodic checkpoints — and write the summary of how it ended:

- finished: the last metrics, the best test accuracy, bytes per worker (the final evaluation's
  traffic included), the op table for re-pricing, the algorithm's set-up and end-of-run facts;
  the consensus model is saved as `model_final.pt` (`train.save_model`);
- interrupted (a stop request, `dpresearch.run.stop`): a final checkpoint (even with
  `train.checkpoint_every` off, as Lightning does), `status: interrupted`; `train.py` prints one
  line and exits 128 + signal;
- diverged (a non-finite loss under `train.on_nonfinite=stop`): `status: diverged`, no model
  and no checkpoint written (the last finite checkpoint stays `latest`);
- failed_io (a write into the run directory refused by the machine, `io_errors`): `status:
  failed_io` naming the last good checkpoint; `train.py` prints one line and exits 74.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dpresearch.comm.base import Communicator
from dpresearch.data.base import Dataset
from dpresearch.run import stop
from dpresearch.run.build import Run, build_communicator, build_run
from dpresearch.run.checkpoint_files import atomic_save, atomic_write_text, latest_checkpoint
from dpresearch.run.checkpoint_state import Checkpoints
from dpresearch.run.io_errors import RunIOError, writing
from dpresearch.run.logger import NullLogger, RunLogger
from dpresearch.run.loop import Hook, LoopState, Outcome, run_loop
from dpresearch.run.metrics import MetricsLog, bytes_per_worker
from dpresearch.run.progress import format_setup, format_start


def train(
    cfg: DictConfig, device: torch.device, run_dir: Path | None, dataset: Dataset | None = None
) -> dict[str, Any]:
    """Build this process's part of the run of `cfg` from the configuration alone
    (`build.build_communicator`, then `Trainer`) and run it on `device`; the main process writes
    `run_dir`. `dataset`: the data set if already loaded."""
    comm = build_communicator(cfg)
    writer_dir = run_dir if comm.is_main_process else None
    return Trainer(cfg, comm, device, writer_dir, dataset).run()


class InjectedFailure(RuntimeError):
    """Raised by `debug.fail_worker` / `debug.fail_at_step` to test failure handling."""


class FaultInjection(Hook):
    """Worker `debug.fail_worker` raises `InjectedFailure` at step `debug.fail_at_step`."""

    def __init__(self, run: Run) -> None:
        debug = run.cfg.debug
        self.worker, self.step = debug.fail_worker, debug.fail_at_step
        self.here = self.worker is not None and self.worker in run.compute.workers

    def after_compute(self, step: int) -> None:
        self._maybe_fail(step)

    def _maybe_fail(self, step: int) -> None:
        if self.here and step == self.step:
            raise InjectedFailure(f"injected failure on worker {self.worker} at step {step}")


class Trainer:
    """Builds the run of `cfg` for the workers `comm` holds and runs it (see the module
    docstring). `run_dir`: where the main process writes (None: nowhere). `dataset`: the data
    set if already loaded."""

    def __init__(
        self,
        cfg: DictConfig,
        comm: Communicator,
        device: torch.device,
        run_dir: Path | None,
        dataset: Dataset | None = None,
    ) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.built = run = build_run(cfg, comm, device, dataset)
        tc = cfg.train
        self.state = LoopState()
        self.checkpoints = Checkpoints(run, self.state, run_dir)
        resumed_at = self.checkpoints.resume(tc.resume) if tc.resume is not None else None
        if run.setup and comm.is_main_process and tc.progress:  # (as resumed: its init_from)
            print(format_setup(run.setup), flush=True)
        self.start_step = self.state.step
        resolved = OmegaConf.to_container(cfg, resolve=True)
        logger = (
            RunLogger(run_dir, resolved, cfg.logger, resume_at=resumed_at)
            if run_dir is not None
            else NullLogger()
        )
        if resumed_at and comm.is_main_process and tc.progress:
            print(f"resumed from step {resumed_at} of {run.total_steps}", flush=True)
        self.metrics = MetricsLog(run, self.state, logger, tc.progress)
        if comm.is_main_process and tc.progress:
            text = bool(run.data.tokens_per_example)
            every = (tc.log_every, self.metrics.eval_every)
            print(format_start(run.total_steps, run.steps_per_epoch, *every, text), flush=True)
        self.hooks: list[Hook] = [FaultInjection(run), self.checkpoints]
        if run.lockstep or comm.is_main_process:  # (asynchronous: the main process reports)
            self.hooks.insert(1, self.metrics)

    @property
    def logger(self) -> RunLogger | NullLogger:
        """Where the metrics rows and the summary go (replaceable, e.g. by a test's)."""
        return self.metrics.logger

    @logger.setter
    def logger(self, logger: RunLogger | NullLogger) -> None:
        self.metrics.logger = logger

    # The built run's parts, by name.
    comm = property(lambda self: self.built.comm)
    data = property(lambda self: self.built.data)
    eval_model = property(lambda self: self.built.eval_model)
    partitioner = property(lambda self: self.built.partitioner)
    replicas = property(lambda self: self.built.replicas)
    optimizers = property(lambda self: self.built.optimizers)
    algorithm = property(lambda self: self.built.algorithm)
    compute = property(lambda self: self.built.compute)
    steps_per_epoch = property(lambda self: self.built.steps_per_epoch)
    total_steps = property(lambda self: self.built.total_steps)

    def checkpoint(self, done: int) -> Path | None:
        """Write a checkpoint taken after step `done` (a collective; see `Checkpoints.save`)."""
        return self.checkpoints.save(done)

    def run(self) -> dict[str, Any]:
        """Train from the start (or the resumed step) to the last step, or until a stop
        request or a non-finite loss ends the run; returns the summary (with `status`). Stop
        requests are recorded until the summary is written (a scheduler's SIGUSR2 is handed on
        to its own handler after that)."""
        with stop.handling():
            self.state.step = self.start_step  # (a second call runs the same steps again)
            outcome = run_loop(self.built, self.state, self.hooks, self.cfg.train.on_nonfinite)
            return self._ending(outcome)

    def _ending(self, outcome: Outcome) -> dict[str, Any]:
        try:
            if outcome.status == "finished":
                return self._finished()
            if outcome.status == "interrupted":
                return self._interrupted(outcome)
        except RunIOError as exc:  # the final model, the summary, a stop's checkpoint
            self.state.io_error = self.state.io_error or exc
            outcome = Outcome("failed_io", outcome.step)
        if outcome.status == "failed_io":
            return self._failed_io(outcome)
        return self._diverged(outcome)

    def _finished(self) -> dict[str, Any]:
        run, state = self.built, self.state
        last, ledger = state.last, run.ledger
        summary = {
            **last,
            "status": "finished",
            **self._best(),
            "steps_per_epoch": run.steps_per_epoch,
            "total_steps": run.total_steps,
            "num_params": run.replicas.num_params,
            **self._data_facts(),
            "comm/bytes_per_epoch": last.get("comm/bytes", 0.0)
            / (run.total_steps / run.steps_per_epoch),
            "comm/op_counts": dict(ledger.op_counts),
            "comm/ops": ledger.op_table(),
            **bytes_per_worker(run),  # the final evaluation's traffic included
            **run.setup,
            **run.algorithm.summary(),
        }
        if self.cfg.train.on_nonfinite == "skip_step":
            summary["train/skipped_steps"] = state.skipped
        if isinstance(self.logger, RunLogger) and self.cfg.train.save_model:
            model, weights = self.logger.run_dir / "model_final.pt", run.eval_model.state_dict()
            with writing(model, sum(t.numel() * t.element_size() for t in weights.values())):
                atomic_save(weights, model)
        if isinstance(self.logger, RunLogger):
            self._write_sample(self.logger.run_dir / "sample.txt")
        self.logger.finish(summary)
        return summary

    def _write_sample(self, path: Path) -> None:
        """A text sample of the final model (`Dataset.sample`; data without text: none),
        drawn with a generator seeded by the run's seed."""
        run = self.built
        generator = torch.Generator(device=run.device).manual_seed(self.cfg.seed)
        text = run.data.sample(run.eval_model, generator)
        if text is not None:
            with writing(path, len(text.encode())):
                atomic_write_text(path, text)

    def _interrupted(self, outcome: Outcome) -> dict[str, Any]:
        """A stop request honoured after step `outcome.step`: final checkpoint, `status:
        interrupted` (the caller prints the one line and exits 128 + signal)."""
        checkpointable = self.built.algorithm.traits.checkpointable
        path = self.checkpoints.save(outcome.step) if checkpointable else None
        return self._ended_early(
            "interrupted",
            interrupted_at_step=outcome.step,
            signal=signal.Signals(outcome.signum).name,
            exit_code=128 + outcome.signum,
            checkpoint=str(path) if path is not None else None,
        )

    def _diverged(self, outcome: Outcome) -> dict[str, Any]:
        """A non-finite loss at step `outcome.step` under `on_nonfinite=stop`."""
        run = self.built
        kept = latest_checkpoint(self.run_dir) if self.run_dir is not None else None
        return self._ended_early(
            "diverged",
            diverged_at_step=outcome.step,
            lr=run.base_lr * run.schedule(outcome.step - 1),
            last_checkpoint=str(kept) if kept is not None else None,
        )

    def _failed_io(self, outcome: Outcome) -> dict[str, Any]:
        """A write into the run directory failed (`LoopState.io_error`, known to the main
        process): `status: failed_io` after step `outcome.step`, naming the last good
        checkpoint (`latest`, which a failed checkpoint never moves); the summary is written
        if it still fits."""
        exc = self.state.io_error
        kept = latest_checkpoint(self.run_dir) if self.run_dir is not None else None
        facts = {
            "failed_at_step": outcome.step,
            "io_error": exc.describe() if exc is not None else None,
            "last_checkpoint": str(kept) if kept is not None else None,
        }
        try:
            return self._ended_early("failed_io", **facts)
        except RunIOError:
            return {**self.state.last, "status": "failed_io", **facts, "summary_written": False}

    def _best(self) -> dict[str, float]:
        return {"best/test_acc": self.state.best_acc} if self.built.data.classification else {}

    def _data_facts(self) -> dict[str, Any]:
        """The sizes a report needs to judge its numbers: classes (chance level) and the
        examples behind each accuracy (its binomial standard error)."""
        data = self.built.data
        facts = {
            "data/classes": data.num_classes,
            "data/train_examples": data.num_train,
            "data/test_examples": int(data.test_targets.shape[0]),
        }
        if data.val_targets is not None:
            facts["data/val_examples"] = int(data.val_targets.shape[0])
        return {**facts, **data.facts()}

    def _ended_early(self, status: str, **facts: Any) -> dict[str, Any]:
        """The summary of a run that ended before its last step: the last logged metrics,
        `status` and `facts`; written by the main process."""
        run, state = self.built, self.state
        summary = {
            **state.last,
            "status": status,
            **facts,
            "total_steps": run.total_steps,
            "steps_per_epoch": run.steps_per_epoch,
            **self._best(),
            **self._data_facts(),
        }
        if self.cfg.train.on_nonfinite == "skip_step":
            summary["train/skipped_steps"] = state.skipped
        self.logger.finish(summary)
        return summary
